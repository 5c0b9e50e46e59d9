// Package oplock serialises ptxmig operations on one process: one lock file per PID under
// /run/ptxmig/locks (or $PTXMIG_LOCK_DIR), held with flock(2) so a crashed ptxmig never leaves a
// stale lock. The file records who holds it, for the "busy" message.
package oplock

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// ErrBusy means another ptxmig operation holds the lock on the same process.
var ErrBusy = errors.New("another ptxmig operation is working on this process")

// DefaultDir is where lock files live unless $PTXMIG_LOCK_DIR says otherwise.
const DefaultDir = "/run/ptxmig/locks"

// Dir returns the lock directory in use.
func Dir() string {
	if d := os.Getenv("PTXMIG_LOCK_DIR"); d != "" {
		return d
	}
	return DefaultDir
}

// Lock is a held per-PID operation lock.
type Lock struct {
	f    *os.File
	path string
}

// Acquire takes the lock for pid, recording op as the holder's operation. It waits up to wait
// (0: not at all) and fails with ErrBusy, naming the holder, when the lock stays taken.
func Acquire(pid int, op string, wait time.Duration) (*Lock, error) {
	if pid <= 0 {
		return nil, fmt.Errorf("lock: bad pid %d", pid)
	}
	dir := Dir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("lock dir: %w", err)
	}
	path := filepath.Join(dir, fmt.Sprintf("pid-%d.lock", pid))
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	deadline := time.Now().Add(wait)
	for {
		err = unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if time.Now().After(deadline) {
			holder, _ := os.ReadFile(path)
			f.Close()
			h := strings.TrimSpace(string(holder))
			if h == "" {
				h = "unknown holder"
			}
			return nil, fmt.Errorf("pid %d: %w (%s; lock file %s)", pid, ErrBusy, h, path)
		}
		time.Sleep(50 * time.Millisecond)
	}
	rec := fmt.Sprintf("%s by ptxmig pid %d since %s\n", op, os.Getpid(), time.Now().UTC().Format(time.RFC3339))
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(rec), 0)
	}
	return &Lock{f: f, path: path}, nil
}

// Release drops the lock. The file stays (removing it would race with a waiter that opened it).
func (l *Lock) Release() error {
	if l == nil || l.f == nil {
		return nil
	}
	_ = l.f.Truncate(0)
	err := l.f.Close() // closing drops the flock
	l.f = nil
	return err
}
