// Package driverstep holds the driver steps of the operations (lock, checkpoint, restore,
// unlock through the NVIDIA driver's checkpoint API), each over every CUDA process of an
// operation, with their undos and the step kinds a crash recovery rebuilds them by.
package driverstep

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"syscall"
	"time"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/hold"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
)

// Step names of the driver steps, shared by checkpoint, restore and migrate.
const (
	StepLock          = "lock"
	StepCheckpoint    = "checkpoint"
	StepDriverRestore = "driver-restore"
	StepUnlock        = "unlock"
)

// The driver steps act on every CUDA process of an operation (a tree may hold several), in
// order. Each Undo looks at the driver's actual state of each process and does only what is still
// needed, so a step that failed halfway (two of three processes locked) rolls back cleanly.

// Step kinds of the driver steps with an undo (see op.Kind): their journal data is the pids
// (and, for a live move, the GPU pairs).
const (
	KindLock       = "driver.lock"
	KindCheckpoint = "driver.checkpoint"
	KindMove       = "driver.move"
)

// moveData is what the journal records of a live move's driver restore: the processes and the
// GPU pairs (UUIDs) they were restored with.
type moveData struct {
	PIDs  []int       `json:"pids"`
	Pairs [][2]string `json:"pairs"`
}

func (m moveData) pairs() ([]cudackpt.Pair, error) {
	if len(m.Pairs) == 0 || len(m.Pairs) > 64 {
		return nil, fmt.Errorf("%d GPU pairs", len(m.Pairs))
	}
	out := make([]cudackpt.Pair, len(m.Pairs))
	for i, p := range m.Pairs {
		o, err1 := cudackpt.ParseUUID(p[0])
		n, err2 := cudackpt.ParseUUID(p[1])
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("GPU pair %q -> %q: %w", p[0], p[1], err)
		}
		out[i] = cudackpt.Pair{Old: o, New: n}
	}
	return out, nil
}

// pidsData is what the journal records of a driver step: the processes it acts on.
type pidsData struct {
	PIDs []int `json:"pids"`
}

func init() {
	// After a crash the undos act on the recorded processes still alive as themselves, through
	// the driver the recovery opens.
	rebuild := func(undo func(d op.Driver, pids []int, note func(string, ...any)) error, what string) func(*op.Rec, json.RawMessage) (op.Recovery, error) {
		return func(r *op.Rec, data json.RawMessage) (op.Recovery, error) {
			var x pidsData
			if err := json.Unmarshal(data, &x); err != nil {
				return op.Recovery{}, err
			}
			return op.Recovery{Undo: func(context.Context) error {
				pids := r.Alive(x.PIDs)
				if len(pids) == 0 {
					return nil
				}
				d, err := r.Driver()
				if err != nil {
					return fmt.Errorf("pid %s may be %s, but the NVIDIA driver cannot be used: %v", op.PIDText(pids), what, err)
				}
				return undo(d, pids, r.Note)
			}}, nil
		}
	}
	op.RegisterKind(op.Kind{ID: KindLock, Rebuild: rebuild(unlockLocked, "locked")})
	op.RegisterKind(op.Kind{ID: KindCheckpoint, Rebuild: rebuild(restoreCheckpointed, "checkpointed")})
	op.RegisterKind(op.Kind{ID: KindMove, Rebuild: func(r *op.Rec, data json.RawMessage) (op.Recovery, error) {
		var x moveData
		if err := json.Unmarshal(data, &x); err != nil {
			return op.Recovery{}, err
		}
		pairs, err := x.pairs()
		if err != nil {
			return op.Recovery{}, err
		}
		return op.Recovery{Undo: func(context.Context) error {
			pids := r.Alive(x.PIDs)
			if len(pids) == 0 {
				return nil
			}
			if r.Step != nil && r.Step.UndoBegan && !r.Step.Undone {
				// ptxmig died while its own rollback moved the processes back: which ones it had
				// moved, the driver's state does not say (a moved one is locked on its source
				// GPUs, as one still on its targets is), so none is moved twice.
				r.Note("ptxmig died while it moved the processes back onto their source GPUs: pid %s may run on their target GPUs", op.PIDText(pids))
				return nil
			}
			d, err := r.Driver()
			if err != nil {
				return fmt.Errorf("pid %s may run on their target GPUs, but the NVIDIA driver cannot be used: %v", op.PIDText(pids), err)
			}
			// One case this gets wrong: a ptxmig that died while the step, failing for one
			// process, moved the others back itself; a process already back is moved onto its
			// targets again. It runs there.
			return moveBack(d, pids, pairs, r.Note)
		}}, nil
	}})
}

// unlockLocked unlocks those of pids the driver has locked: the lock step's undo, in-process
// and after a crash. note (may be nil) is told what was done.
func unlockLocked(d op.Driver, pids []int, note func(string, ...any)) error {
	return eachPID(pids, func(pid int) error {
		return withHeld(d, pid, false, false, func() error {
			st, err := d.State(pid)
			if errors.Is(err, cudackpt.ErrNotCUDA) || (err == nil && st != cudackpt.Locked) {
				return nil // running again (or gone)
			}
			if err := d.Unlock(pid); err != nil {
				return err
			}
			if note != nil {
				note("driver unlock of pid %d", pid)
			}
			return nil
		})
	})
}

// restoreCheckpointed restores those of pids the driver holds checkpointed onto their own GPUs
// (no pairs: the identity, which every driver accepts): the checkpoint step's undo, in-process
// and after a crash (the lock's undo then unlocks).
func restoreCheckpointed(d op.Driver, pids []int, note func(string, ...any)) error {
	return eachPID(pids, func(pid int) error {
		return withHeld(d, pid, false, false, func() error {
			st, err := d.State(pid)
			if errors.Is(err, cudackpt.ErrNotCUDA) || (err == nil && st != cudackpt.Checkpointed) {
				return nil // restored already
			}
			if rerr := d.Restore(pid, nil); rerr != nil {
				return fmt.Errorf("restore pid %d onto its own GPUs (state %v, %v): %w", pid, st, err, rerr)
			}
			if note != nil {
				note("driver restore of pid %d onto its own GPUs", pid)
			}
			return nil
		})
	})
}

// withHeld runs f, driver calls about pid, with every thread of pid but the driver's restore
// thread held (package hold): the driver's checkpoint takes the process's device mappings away and
// its restore gives them back, and a thread that touches one in between kills the process (JAX's
// threads do). A process left stopped is continued for it (only the driver's thread runs). After
// f, the process is left stopped (a group-stop without a tracer: CRIU can dump it) when f was a
// checkpoint that succeeded, or when the driver holds it checkpointed or cannot say; else it runs
// again. The driver is asked about a process only while it is held: a stopped process's driver
// thread cannot answer. must makes a failure to hold the threads an error before f; else (an undo,
// which must still try) f runs unheld on the process continued: it may die, but left stopped and
// checkpointed it could not be used either.
func withHeld(d op.Driver, pid int, must, checkpoints bool, f func() error) error {
	h, err := holdThreads(d, pid)
	switch {
	case errors.Is(err, cudackpt.ErrNotCUDA):
		// The driver took nothing from it: nothing to hold, and nothing to keep it stopped for.
		return errors.Join(f(), continueStopped(pid))
	case err != nil && must:
		return err
	case err != nil:
		slog.Error("the driver's call runs with the process's threads not held: it may die", "pid", pid, "err", err)
		if kerr := syscall.Kill(pid, syscall.SIGCONT); kerr != nil && !errors.Is(kerr, syscall.ESRCH) {
			return errors.Join(err, kerr)
		}
		return f()
	}
	err = f()
	if h == nil {
		return err
	}
	stop := checkpoints && err == nil // checkpointed: no need to ask
	if !stop {
		st, serr := d.State(pid)
		stop = serr != nil || st == cudackpt.Checkpointed // when the driver cannot say, stopped is the safe side
	}
	if stop {
		return errors.Join(err, h.Stop())
	}
	return errors.Join(err, h.Release())
}

// continueStopped continues pid if it is stopped.
func continueStopped(pid int) error {
	if s, err := proc.ReadStat(pid); err == nil && s.State == 'T' {
		return proc.Continue([]int{pid}, 5*time.Second)
	}
	return nil
}

// holdThreads holds every thread of pid but the one the driver names for its checkpoint and
// restore; nil (no error) for a driver that names none (a fake driver's pretend process); an
// error matching cudackpt.ErrNotCUDA for a process the driver does not know.
func holdThreads(d op.Driver, pid int) (*hold.Held, error) {
	tid, err := d.RestoreThreadID(pid)
	if errors.Is(err, cudackpt.ErrNoRestoreThread) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("pid %d: the driver's restore thread: %w", pid, err)
	}
	return hold.Threads(pid, tid)
}

// LockStep locks each pid (waiting up to timeout for running kernels); undo unlocks those still
// locked. When one pid fails, the step unlocks the ones it locked before failing: it leaves
// nothing behind (StepUndid).
func LockStep(d op.Driver, pids []int, timeout time.Duration) op.Step {
	undo := func(pids []int) error { return unlockLocked(d, pids, nil) }
	return op.Step{Name: StepLock, Kind: KindLock, Data: pidsData{PIDs: pids},
		Do: func(context.Context) error {
			go hold.Prewarm() // the checkpoint's hold then finds its holder started
			return eachDo(pids, func(pid int) error {
				if err := d.Lock(pid, timeout); err != nil {
					return fmt.Errorf("lock pid %d: %w", pid, err)
				}
				return nil
			}, undo)
		},
		Undo: func(context.Context) error { return undo(pids) }}
}

// CheckpointStep moves each pid's device memory to host memory; undo restores those still
// checkpointed onto their own GPUs. When one pid fails, the step restores those it checkpointed
// (the failed one too, should the driver have left it checkpointed) before failing.
func CheckpointStep(d op.Driver, pids []int) op.Step {
	undo := func(pids []int) error { return restoreCheckpointed(d, pids, nil) }
	return op.Step{Name: StepCheckpoint, Kind: KindCheckpoint, Data: pidsData{PIDs: pids},
		Do: func(context.Context) error {
			return eachDo(pids, func(pid int) error {
				if err := withHeld(d, pid, true, true, func() error { return d.Checkpoint(pid) }); err != nil {
					return fmt.Errorf("checkpoint pid %d: %w", pid, err)
				}
				return nil
			}, undo)
		},
		Undo: func(context.Context) error { return undo(pids) }}
}

// eachDo runs do for every pid in order. When one fails, undo runs over the pids done so far
// and the failed one (undos look at the driver's real state), and the error says the step undid
// its own part (StepUndid), so no step over several processes leaves some of them changed.
func eachDo(pids []int, do func(pid int) error, undo func(pids []int) error) error {
	for i, pid := range pids {
		if err := do(pid); err != nil {
			return op.StepUndid(err, undo(pids[:i+1]))
		}
	}
	return nil
}

// RestoreStep restores each pid's device memory (with pairs, nil for the identity). check, when
// set, runs first: it re-reads the world and fails the step before the driver is asked (on driver
// 580 a restore that runs out of memory leaves the process checkpointed for good). expectCheckpointed
// makes the step verify each pid is checkpointed first (after a CRIU restore). After a CRIU
// restore (or with no pairs) it has no undo: the checkpoint step's undo (or killing the restored
// process) covers it. A live move (pairs, not after a CRIU restore) that fails for one process
// moves the processes it already restored back onto their source GPUs (checkpoint, restore with
// the inverse pairs) before it fails, so the checkpoint step's undo finds every process of a job
// on its own GPUs again: a job is never left split between the old and the new GPUs. Its undo
// (kind KindMove, also after a crash), when a later step fails, moves every process back the
// same way (locking again one that was unlocked already), so a rolled-back move ends where it
// began.
func RestoreStep(d op.Driver, pids func() []int, pairs []cudackpt.Pair, check func() error, expectCheckpointed bool) op.Step {
	s := op.Step{Name: StepDriverRestore, Do: func(context.Context) error {
		if check != nil {
			if err := check(); err != nil {
				return err
			}
		}
		var restored []int
		for _, pid := range pids() {
			err := withHeld(d, pid, true, false, func() error {
				if expectCheckpointed {
					st, err := d.State(pid)
					if err != nil {
						return fmt.Errorf("pid %d: %w", pid, err)
					}
					if st != cudackpt.Checkpointed {
						return fmt.Errorf("restored pid %d is %s, expected checkpointed", pid, st)
					}
				}
				if err := d.Restore(pid, pairs); err != nil {
					return fmt.Errorf("driver restore pid %d: %w", pid, err)
				}
				return nil
			})
			if err != nil {
				if expectCheckpointed || len(pairs) == 0 || len(restored) == 0 {
					return err
				}
				return op.StepUndid(err, moveBack(d, restored, pairs, nil))
			}
			restored = append(restored, pid)
		}
		return nil
	}}
	if !expectCheckpointed && len(pairs) > 0 {
		x := moveData{PIDs: pids()}
		for _, p := range pairs {
			x.Pairs = append(x.Pairs, [2]string{p.Old.String(), p.New.String()})
		}
		s.Kind, s.Data = KindMove, x
		s.Undo = func(context.Context) error { return moveBack(d, pids(), pairs, nil) }
	}
	return s
}

// moveBackLock bounds the lock of a process that moveBack finds unlocked on its target: its
// launches are still held by the quiesce, so no kernel of it runs.
const moveBackLock = 10 * time.Second

// moveBack returns processes restored onto their targets to their source GPUs: lock one that was
// unlocked already, checkpoint it again and restore it with the inverse pairs (a bijection too).
// They stay locked, as they were before the restore; one still checkpointed (never restored onto
// its targets) or unknown to the driver is skipped. note (may be nil) is told what was done.
func moveBack(d op.Driver, pids []int, pairs []cudackpt.Pair, note func(string, ...any)) error {
	inverse := make([]cudackpt.Pair, len(pairs))
	for i, p := range pairs {
		inverse[i] = cudackpt.Pair{Old: p.New, New: p.Old}
	}
	return eachPID(pids, func(pid int) error {
		// The state is asked unheld (a stopped process answers ErrStopped: stopped after its
		// checkpoint, it was never restored onto its target), and a running process is locked
		// before its threads are held: a thread held inside a CUDA call could keep the lock from
		// completing.
		st, err := d.State(pid)
		switch {
		case errors.Is(err, cudackpt.ErrNotCUDA):
			return nil
		case errors.Is(err, cudackpt.ErrStopped) || (err == nil && st == cudackpt.Checkpointed):
			return nil // never restored onto its target: the checkpoint step's undo restores it
		case err != nil:
			return fmt.Errorf("move pid %d back: driver state: %w", pid, err)
		case st == cudackpt.Running:
			if err := d.Lock(pid, moveBackLock); err != nil {
				return fmt.Errorf("move pid %d back: lock on its target: %w", pid, err)
			}
		}
		return withHeld(d, pid, false, false, func() error {
			if err := d.Checkpoint(pid); err != nil {
				return fmt.Errorf("move pid %d back: checkpoint on its target: %w", pid, err)
			}
			if err := d.Restore(pid, inverse); err != nil {
				return fmt.Errorf("move pid %d back: restore onto its source GPUs: %w", pid, err)
			}
			if note != nil {
				note("moved pid %d back onto its source GPUs", pid)
			}
			return nil
		})
	})
}

// UnlockStep unlocks each pid (held: a process left stopped cannot be asked).
func UnlockStep(d op.Driver, pids func() []int) op.Step {
	return op.Step{Name: StepUnlock, Do: func(context.Context) error {
		for _, pid := range pids() {
			if err := withHeld(d, pid, true, false, func() error { return d.Unlock(pid) }); err != nil {
				return fmt.Errorf("unlock pid %d: %w", pid, err)
			}
		}
		return nil
	}}
}

// eachPID runs f for every pid (in reverse: the last one touched first) and joins the errors, so
// one process that cannot be rolled back does not stop the others.
func eachPID(pids []int, f func(pid int) error) error {
	var errs []error
	for i := len(pids) - 1; i >= 0; i-- {
		if err := f(pids[i]); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
