package criu

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/ptxmig/ptxmig/internal/proc"
)

// ErrStalled means a CRIU dump or restore made no progress for its stall bound and was killed.
// Seen for real (2026-11-28, CRIU 4.1.1, a VM whose ptrace hardware breakpoints never fire): the
// dump waited for ever for a trap that never came, with the tree it had seized still traced.
var ErrStalled = errors.New("criu made no progress")

// DefaultStall is how long a CRIU dump or restore may go without progress before it is killed.
// A working CRIU logs every step and uses CPU time while it moves pages, so half a minute with
// neither is a hang, not a slow disk.
const DefaultStall = 30 * time.Second

// Bound resolves a stall option: 0 is DefaultStall, < 0 no bound (returned as 0).
func Bound(stall time.Duration) time.Duration {
	switch {
	case stall < 0:
		return 0
	case stall == 0:
		return DefaultStall
	}
	return stall
}

// StallError is a CRIU killed by its watchdog.
type StallError struct {
	PID   int
	Bound time.Duration
	Last  string // the last line of its log ("" when it has none)
}

func (e *StallError) Error() string {
	s := fmt.Sprintf("criu (pid %d) made no progress for %s and was killed", e.PID, e.Bound)
	if e.Last != "" {
		s += "; its log ends with: " + e.Last
	}
	return s
}

// Is makes every *StallError match ErrStalled.
func (e *StallError) Is(target error) bool { return target == ErrStalled }

// Activity is the progress counter of the CRIU whose process group is pgid: the CPU time (clock
// ticks) its live processes have used. A dump or restore that moves pages or forks uses CPU; one
// waiting for an event that never comes (a trap, a stopped peer) or stopped itself uses none.
func Activity(pgid int) uint64 {
	var n uint64
	for _, s := range proc.Group(pgid) {
		n += s.CPUTicks
	}
	return n
}

// Idle follows a progress counter and says how long it has not moved.
type Idle struct {
	last  uint64
	since time.Time
}

// Observe records the counter's value v at now and returns how long it has kept that value.
func (i *Idle) Observe(v uint64, now time.Time) time.Duration {
	if i.since.IsZero() || v != i.last {
		i.last, i.since = v, now
	}
	return now.Sub(i.since)
}

// watchdog ends a CRIU process group that makes no progress for bound: no growth of its log,
// no CPU time, and no change of the caller's own counter (the bytes it streamed).
type watchdog struct {
	pid     int
	logPath string
	bound   time.Duration
	extra   func() int64
	done    chan struct{}
	wg      sync.WaitGroup
	mu      sync.Mutex
	fired   bool
}

// watch starts a watchdog for the CRIU process pid (leader of its own process group), with the
// stall option's bound (see Bound). stop it once CRIU has exited.
func watch(pid int, logPath string, stall time.Duration, extra func() int64) *watchdog {
	bound := Bound(stall)
	w := &watchdog{pid: pid, logPath: logPath, bound: bound, extra: extra, done: make(chan struct{})}
	if bound <= 0 {
		return w
	}
	tick := min(max(bound/20, 10*time.Millisecond), time.Second)
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		t := time.NewTicker(tick)
		defer t.Stop()
		var idle Idle
		for {
			select {
			case <-w.done:
				return
			case now := <-t.C:
				if idle.Observe(w.sample(), now) < bound {
					continue
				}
				w.mu.Lock()
				w.fired = true
				w.mu.Unlock()
				// The whole group: the helpers CRIU forked share it. A tree CRIU had seized is
				// let go by the kernel when its tracer dies (the caller resumes what stays stopped).
				_ = syscall.Kill(-w.pid, syscall.SIGKILL)
				return
			}
		}
	}()
	return w
}

// sample adds up the three progress counters; any change is progress.
func (w *watchdog) sample() uint64 {
	v := Activity(w.pid)
	if st, err := os.Stat(w.logPath); err == nil {
		v += uint64(st.Size())
	}
	if w.extra != nil {
		v += uint64(w.extra())
	}
	return v
}

// stop ends the watch; it returns a *StallError when the watchdog killed CRIU.
func (w *watchdog) stop() error {
	close(w.done)
	w.wg.Wait()
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.fired {
		return nil
	}
	var last string
	if t := LogTail(w.logPath, 1); len(t) == 1 {
		last = t[0]
	}
	return &StallError{PID: w.pid, Bound: w.bound, Last: last}
}
