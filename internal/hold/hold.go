// Package hold keeps every thread of a process but one from running while the NVIDIA driver
// checkpoints or restores it.
//
// The driver's checkpoint unmaps the process's device mappings (the unified address range and the
// driver's own mappings) and its restore maps them again, both done by one thread of the process
// (cuCheckpointProcessGetRestoreThreadId). A thread of the process that touches such an address
// in between dies with SIGSEGV, and the process with it: a JAX process does (XLA's threads poll
// host-mapped memory), measured on an H200 with driver 580.159.04 (docs/PLATFORM.md). The driver
// lock does not prevent it: it blocks CUDA calls, not loads and stores. CRIU's own CUDA plugin
// keeps the process frozen except for that thread for the same reason.
//
// Threads has a holder process (holder.go) seize every other thread with ptrace (PTRACE_SEIZE +
// PTRACE_INTERRUPT) and wake the process if it was stopped, so that only the driver's thread
// runs. After the driver's checkpoint, Stop leaves the whole process in a group-stop (SIGSTOP)
// without a tracer, so that CRIU can seize and dump it and the process still cannot run; CRIU
// keeps a stopped process stopped, after a dump and after a restore. Before the driver's restore,
// Threads again, and Release after it. The holder outlives ptxmig: if ptxmig dies while the
// threads are held (in the middle of a driver call), the holder stops the process instead of
// letting the threads go, and the guardian takes it from there.
//
// The tracer is not ptxmig because of what a dying tracer does: the kernel detaches its tracees,
// which then run. Nor can the process simply be kept in a group-stop while the driver's thread
// runs: a thread seized with PTRACE_SEIZE that is continued while the group-stop is in effect is
// trapped again at once (measured on Linux 6.18: it stayed traced-stopped), and one attached with
// PTRACE_ATTACH runs but cannot be interrupted (PTRACE_INTERRUPT is for seized threads).
package hold

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/proc"
)

// stopTimeout bounds the wait for the process to reach a group-stop, or to leave it.
const stopTimeout = 5 * time.Second

// local is a process whose threads but one are seized by this process (the holder). Its methods
// are not safe for concurrent use; every ptrace request runs on one OS thread (the kernel ties a
// tracee to its tracer thread).
type local struct {
	pid, keep int
	tids      []int       // seized, in order
	sigs      map[int]int // a signal a thread was stopped with, to deliver again at detach
	calls     chan func()
	done      bool
}

// holdHere seizes every thread of pid except keep (the driver's restore thread) from this
// process and returns once each of them is stopped; a process in a group-stop is continued, so
// that keep runs while the others stay stopped under ptrace. A thread created meanwhile is seized
// too. On error nothing stays seized and the process is as it was (a stopped process is stopped
// again).
func holdHere(pid, keep int) (*local, error) {
	if pid <= 0 || keep <= 0 {
		return nil, fmt.Errorf("hold pid %d: bad thread %d", pid, keep)
	}
	if _, err := os.Stat(taskDir(pid, keep)); err != nil {
		return nil, fmt.Errorf("hold pid %d: the driver's thread %d: %w", pid, keep, err)
	}
	h := &local{pid: pid, keep: keep, sigs: map[int]int{}, calls: make(chan func())}
	go h.tracer()
	wasStopped := stopped(pid, keep)
	var err error
	h.do(func() { err = h.seizeAll() })
	if err == nil && wasStopped {
		// The group-stop ends for keep; the seized threads stay in their ptrace-stop.
		if err = syscall.Kill(pid, syscall.SIGCONT); err == nil {
			err = waitState(pid, keep, func(s byte) bool { return s != 'T' })
		}
	}
	if err != nil {
		rerr := h.release(wasStopped)
		return nil, errors.Join(fmt.Errorf("hold pid %d: %w", pid, err), rerr)
	}
	return h, nil
}

func (h *local) release(stop bool) error {
	if h.done {
		return nil
	}
	h.done = true
	var errs []error
	if stop {
		if err := syscall.Kill(h.pid, syscall.SIGSTOP); err != nil {
			errs = append(errs, fmt.Errorf("stop pid %d: %w", h.pid, err))
		} else if err := waitState(h.pid, h.keep, func(s byte) bool { return s == 'T' }); err != nil {
			errs = append(errs, fmt.Errorf("stop pid %d: %w", h.pid, err))
		}
	}
	h.do(func() {
		for _, tid := range h.tids {
			err := detach(tid, h.sigs[tid])
			if errors.Is(err, syscall.ESRCH) && proc.ThreadState(h.pid, tid) != 0 {
				// Seized but not in its ptrace-stop yet (a failed Threads: a thread stuck in an
				// uninterruptible wait): wait for the stop the interrupt asked for, then detach.
				_ = h.waitStop(tid)
				err = detach(tid, h.sigs[tid])
			}
			if err != nil && !errors.Is(err, syscall.ESRCH) {
				errs = append(errs, fmt.Errorf("detach thread %d of pid %d: %w", tid, h.pid, err))
			}
		}
	})
	close(h.calls)
	if stop && len(errs) == 0 {
		for _, tid := range h.tids { // stopped, not running: the group-stop took them at the detach
			if err := waitState(h.pid, tid, func(s byte) bool { return s == 'T' }); err != nil {
				errs = append(errs, fmt.Errorf("stop pid %d: %w", h.pid, err))
			}
		}
	}
	return errors.Join(errs...)
}

// The main goroutine keeps the process's main thread (Go parks a locked main thread when its
// goroutine ends instead of ending it), so that a tracer goroutine never runs there: when it
// ends, its OS thread ends, and the kernel detaches anything it still traced.
func init() { runtime.LockOSThread() }

// tracer runs the ptrace requests on one locked OS thread, which ends with them (a locked thread
// that exits takes nothing of the runtime along).
func (h *local) tracer() {
	runtime.LockOSThread()
	for f := range h.calls {
		f()
	}
}

func (h *local) do(f func()) {
	done := make(chan struct{})
	h.calls <- func() { f(); close(done) }
	<-done
}

// seizeAll seizes and stops the threads of the process until no thread is left unseized.
func (h *local) seizeAll() error {
	for round := 0; ; round++ {
		tids, err := threads(h.pid)
		if err != nil {
			return err
		}
		var fresh []int
		for _, tid := range tids {
			if st := proc.ThreadState(h.pid, tid); st == 'Z' || st == 'X' || st == 0 {
				continue // ended (a main thread that exited stays a zombie while the others run): nothing to hold
			}
			if tid != h.keep && !slices.Contains(h.tids, tid) {
				fresh = append(fresh, tid)
			}
		}
		if len(fresh) == 0 {
			return nil
		}
		if round > 100 {
			return fmt.Errorf("threads keep appearing (%d seized)", len(h.tids))
		}
		var seized []int
		for _, tid := range fresh {
			switch err := unix.PtraceSeize(tid); {
			case errors.Is(err, syscall.ESRCH):
				continue // exited
			case errors.Is(err, syscall.EPERM):
				return fmt.Errorf("thread %d cannot be seized (traced by another process, a debugger?): %w", tid, err)
			case err != nil:
				return fmt.Errorf("seize thread %d: %w", tid, err)
			}
			h.tids = append(h.tids, tid)
			seized = append(seized, tid)
			if err := unix.PtraceInterrupt(tid); err != nil && !errors.Is(err, syscall.ESRCH) {
				return fmt.Errorf("interrupt thread %d: %w", tid, err)
			}
		}
		for _, tid := range seized {
			if err := h.waitStop(tid); err != nil {
				return err
			}
		}
	}
}

// waitStop waits until tid is in its ptrace-stop ('t' in /proc) and takes the stop's wait status
// if it is there, so that a signal the thread was stopped with is delivered again at the detach.
// It never blocks in wait4: another thread of this process that waits for the process (its
// parent's Wait, as in tests that start the process themselves) may take the status first, and a
// blocking wait would then never return.
func (h *local) waitStop(tid int) error {
	deadline := time.Now().Add(stopTimeout)
	for {
		if done, err := h.takeStatus(tid); done || err != nil {
			return err
		}
		switch proc.ThreadState(h.pid, tid) {
		case 0:
			return nil // exited
		case 't':
			_, err := h.takeStatus(tid) // reported by now, unless another waiter took it
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("thread %d did not stop within %s (state %c)", tid, stopTimeout, proc.ThreadState(h.pid, tid))
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// takeStatus takes tid's wait status without blocking: done when it reported a stop or its end.
func (h *local) takeStatus(tid int) (done bool, err error) {
	var ws syscall.WaitStatus
	for {
		wpid, err := syscall.Wait4(tid, &ws, unix.WALL|unix.WNOHANG, nil)
		switch {
		case errors.Is(err, syscall.EINTR):
			continue
		case errors.Is(err, syscall.ECHILD):
			return true, nil // gone, or its status taken already
		case err != nil:
			return false, fmt.Errorf("wait for thread %d: %w", tid, err)
		case wpid != tid:
			return false, nil
		case ws.Stopped() && uint32(ws)>>16 == 0:
			h.sigs[tid] = int(ws.StopSignal()) // a signal-delivery-stop, not a ptrace event: keep the signal
		}
		return true, nil
	}
}

func detach(tid, sig int) error {
	_, _, e := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_DETACH, uintptr(tid), 0, uintptr(sig), 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

func taskDir(pid, tid int) string {
	return filepath.Join(proc.Root, strconv.Itoa(pid), "task", strconv.Itoa(tid))
}

// threads lists the threads of pid.
func threads(pid int) ([]int, error) {
	ents, err := os.ReadDir(filepath.Join(proc.Root, strconv.Itoa(pid), "task"))
	if err != nil {
		return nil, err
	}
	out := make([]int, 0, len(ents))
	for _, e := range ents {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			out = append(out, tid)
		}
	}
	return out, nil
}

// stopped reports whether thread keep of pid is in a group-stop.
func stopped(pid, keep int) bool { return proc.ThreadState(pid, keep) == 'T' }

// waitState waits until thread tid of pid is in a state ok accepts, or gone or dead (a zombie:
// the process was killed meanwhile, there is nothing left to stop or run).
func waitState(pid, tid int, ok func(byte) bool) error {
	deadline := time.Now().Add(stopTimeout)
	for {
		s := proc.ThreadState(pid, tid)
		if s == 0 || s == 'Z' || s == 'X' || ok(s) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("thread %d still in state %c after %s", tid, s, stopTimeout)
		}
		time.Sleep(200 * time.Microsecond)
	}
}
