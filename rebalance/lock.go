package rebalance

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// ErrBusy means another rebalance run holds the lock.
var ErrBusy = errors.New("another ptxmig rebalance run is active")

// Lock is the global rebalance lock: an flock on dir/lock, released when the holder exits.
type Lock struct{ f *os.File }

// TryLock takes the lock without waiting. When another run holds it, the error wraps ErrBusy and
// names the holder's PID when known.
func TryLock(dir string) (*Lock, error) {
	file := dir + "/" + LockFile
	f, err := os.OpenFile(file, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock %s: %w", file, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		defer f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			b := make([]byte, 32)
			n, _ := f.ReadAt(b, 0)
			if pid, perr := strconv.Atoi(string(bytes.TrimSpace(b[:n]))); perr == nil && pid > 0 {
				return nil, fmt.Errorf("%w (pid %d)", ErrBusy, pid)
			}
			return nil, ErrBusy
		}
		return nil, fmt.Errorf("lock %s: %w", file, err)
	}
	// Record the holder for the message a contending run prints; best effort.
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return &Lock{f: f}, nil
}

// Unlock releases the lock.
func (l *Lock) Unlock() error {
	if l == nil || l.f == nil {
		return nil
	}
	_ = l.f.Truncate(0)
	err := l.f.Close() // closing drops the flock
	l.f = nil
	return err
}
