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
	if err := PrivateDir(dir); err != nil {
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
			h := readHolder(f)
			f.Close()
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

// readHolder reads the holder record through the open (O_NOFOLLOW) descriptor, at most 256
// bytes, keeping only printable characters: it is printed to a terminal.
func readHolder(f *os.File) string {
	b := make([]byte, 256)
	n, _ := f.ReadAt(b, 0)
	return strings.TrimSpace(strings.Map(func(r rune) rune {
		if r < ' ' || r == 0x7f {
			return -1
		}
		return r
	}, string(b[:n])))
}

// ErrUnsafeDir means a directory ptxmig keeps private state in (locks, staging) is a symlink,
// not a directory, or owned by another user, so it could be used to redirect or read what
// ptxmig, running as root, writes there.
var ErrUnsafeDir = errors.New("unsafe directory")

// PrivateDir makes path a directory only the current user can use: it creates it (and missing
// parents) with mode 0700, then refuses a symlink, a non-directory or a directory owned by
// another user, and tightens the mode of one it owns to 0700. Staging roots live in the
// world-writable /dev/shm and /var/tmp, where another user could have created the name first.
func PrivateDir(path string) error {
	mkErr := os.MkdirAll(path, 0o700) // fails on a file in the way: Lstat below says why
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		if mkErr != nil {
			return fmt.Errorf("create %s: %w", path, mkErr)
		}
		return fmt.Errorf("%s: %w", path, err)
	}
	switch {
	case st.Mode&unix.S_IFMT == unix.S_IFLNK:
		return fmt.Errorf("%s: %w: it is a symlink", path, ErrUnsafeDir)
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("%s: %w: not a directory", path, ErrUnsafeDir)
	case int(st.Uid) != os.Geteuid():
		return fmt.Errorf("%s: %w: owned by uid %d, not %d (remove it)", path, ErrUnsafeDir, st.Uid, os.Geteuid())
	}
	if st.Mode&0o777 != 0o700 {
		// O_NOFOLLOW|O_DIRECTORY: chmod the directory just checked, never a symlink's target.
		fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		defer unix.Close(fd)
		if err := unix.Fchmod(fd, 0o700); err != nil {
			return fmt.Errorf("chmod %s: %w", path, err)
		}
	}
	return nil
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

// Locks are the operation locks of several processes (a tree, a job's ranks).
type Locks []*Lock

// AcquireAll takes the lock of every pid (duplicates once), in the order given, with Acquire's
// wait for each; if one is busy it releases those it took and fails.
func AcquireAll(pids []int, op string, wait time.Duration) (Locks, error) {
	var locks Locks
	seen := map[int]bool{}
	for _, pid := range pids {
		if seen[pid] {
			continue
		}
		seen[pid] = true
		lk, err := Acquire(pid, op, wait)
		if err != nil {
			locks.Release()
			return nil, err
		}
		locks = append(locks, lk)
	}
	return locks, nil
}

// Release releases every lock.
func (ls Locks) Release() {
	for _, l := range ls {
		_ = l.Release()
	}
}
