package op

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/oplock"
)

// Logs of failed operations (CRIU's dump.log or restore.log, kept so that an operator can read
// why) go to one private directory, one subdirectory per failure, with bounded retention:
// the newest LogKeep failures, none older than LogMaxAge. Writing a new one prunes the rest;
// `ptxmig image gc` prunes too.

// DefaultLogDir is where failure logs go unless $PTXMIG_LOG_DIR says otherwise.
const DefaultLogDir = "/var/log/ptxmig"

// Retention of failure logs.
const (
	LogKeep   = 20
	LogMaxAge = 14 * 24 * time.Hour
)

// maxLogCopy bounds one kept log file (CRIU's log at level 4 is a few MiB at most).
const maxLogCopy = 64 << 20

// LogDir is the failure-log directory in use.
func LogDir() string {
	if d := os.Getenv("PTXMIG_LOG_DIR"); d != "" {
		return d
	}
	return DefaultLogDir
}

// KeepLogs copies the given log files (missing ones are skipped) into a new directory
// LogDir()/OP-PID-YYYYMMDD-HHMMSS[.N] and prunes old failures. It returns the directory.
func KeepLogs(op string, pid int, files ...string) (string, error) {
	root := LogDir()
	if err := oplock.PrivateDir(root); err != nil {
		return "", fmt.Errorf("failure log directory: %w", err)
	}
	base := fmt.Sprintf("%s-%d-%s", op, pid, time.Now().UTC().Format("20060102-150405"))
	dir := filepath.Join(root, base)
	for n := 1; ; n++ {
		err := os.Mkdir(dir, 0o700)
		if err == nil {
			break
		}
		if !errors.Is(err, os.ErrExist) || n > 100 {
			return "", fmt.Errorf("failure log directory: %w", err)
		}
		dir = filepath.Join(root, fmt.Sprintf("%s.%d", base, n))
	}
	var errs []error
	for _, f := range files {
		if err := copyLog(f, filepath.Join(dir, filepath.Base(f))); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if _, err := PruneLogs(root, LogKeep, LogMaxAge, time.Now()); err != nil {
		errs = append(errs, err)
	}
	return dir, errors.Join(errs...)
}

func copyLog(src, dst string) error {
	in, err := os.OpenFile(src, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, io.LimitReader(in, maxLogCopy)); err != nil {
		out.Close()
		return fmt.Errorf("copy %s: %w", src, err)
	}
	return out.Close()
}

// PruneLogs removes failure-log directories in root beyond the newest keep, and those older than
// maxAge (by modification time). It returns the names removed. A missing root is not an error.
func PruneLogs(root string, keep int, maxAge time.Duration, now time.Time) ([]string, error) {
	ents, err := os.ReadDir(root)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	type entry struct {
		name string
		mod  time.Time
	}
	var dirs []entry
	for _, e := range ents {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue
		}
		dirs = append(dirs, entry{e.Name(), info.ModTime()})
	}
	sort.Slice(dirs, func(i, j int) bool { return dirs[i].mod.After(dirs[j].mod) })
	var removed []string
	var errs []error
	for i, d := range dirs {
		if i < keep && now.Sub(d.mod) <= maxAge {
			continue
		}
		if err := os.RemoveAll(filepath.Join(root, d.name)); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, d.name)
	}
	return removed, errors.Join(errs...)
}
