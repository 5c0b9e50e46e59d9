package op

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
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

// LockStep locks each pid (waiting up to timeout for running kernels); undo unlocks those still
// locked. When one pid fails, the step unlocks the ones it locked before failing: it leaves
// nothing behind (StepUndid).
func LockStep(d Driver, pids []int, timeout time.Duration) Step {
	undo := func(pids []int) error {
		return eachPID(pids, func(pid int) error {
			if st, err := d.State(pid); err == nil && st != cudackpt.Locked {
				return nil // running again (or gone)
			}
			return d.Unlock(pid)
		})
	}
	return Step{Name: StepLock,
		Do: func(context.Context) error {
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
// checkpointed onto their own GPUs (no pairs: the identity, which every driver accepts). When
// one pid fails, the step restores those it checkpointed (the failed one too, should the driver
// have left it checkpointed) before failing.
func CheckpointStep(d Driver, pids []int) Step {
	undo := func(pids []int) error {
		return eachPID(pids, func(pid int) error {
			st, err := d.State(pid)
			if err == nil && st != cudackpt.Checkpointed {
				return nil // restored already (the lock's undo unlocks)
			}
			if rerr := d.Restore(pid, nil); rerr != nil {
				return fmt.Errorf("restore pid %d onto its own GPUs (state %v, %v): %w", pid, st, err, rerr)
			}
			return nil
		})
	}
	return Step{Name: StepCheckpoint,
		Do: func(context.Context) error {
			return eachDo(pids, func(pid int) error {
				if err := d.Checkpoint(pid); err != nil {
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
			return StepUndid(err, undo(pids[:i+1]))
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
// on its own GPUs again: a job is never left split between the old and the new GPUs. Its undo,
// when a later step fails (an unlock, the shim's resume), moves every process back the same way
// (locking again one that was unlocked already), so a rolled-back move ends where it began.
func RestoreStep(d Driver, pids func() []int, pairs []cudackpt.Pair, check func() error, expectCheckpointed bool) Step {
	var undo func(context.Context) error
	if !expectCheckpointed && len(pairs) > 0 {
		undo = func(context.Context) error { return moveBack(d, pids(), pairs) }
	}
	return Step{Name: StepDriverRestore, Undo: undo, Do: func(context.Context) error {
		if check != nil {
			if err := check(); err != nil {
				return err
			}
		}
		var restored []int
		for _, pid := range pids() {
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
				err = fmt.Errorf("driver restore pid %d: %w", pid, err)
				if expectCheckpointed || len(pairs) == 0 || len(restored) == 0 {
					return err
				}
				return StepUndid(err, moveBack(d, restored, pairs))
			}
			restored = append(restored, pid)
		}
		return nil
	}}
}

// moveBackLock bounds the lock of a process that moveBack finds unlocked on its target: its
// launches are still held by the quiesce, so no kernel of it runs.
const moveBackLock = 10 * time.Second

// moveBack returns processes restored onto their targets to their source GPUs: lock one that was
// unlocked already, checkpoint it again and restore it with the inverse pairs (a bijection too).
// They stay locked, as they were before the restore; one the driver holds no state for is skipped.
func moveBack(d Driver, pids []int, pairs []cudackpt.Pair) error {
	inverse := make([]cudackpt.Pair, len(pairs))
	for i, p := range pairs {
		inverse[i] = cudackpt.Pair{Old: p.New, New: p.Old}
	}
	return eachPID(pids, func(pid int) error {
		st, err := d.State(pid)
		switch {
		case errors.Is(err, cudackpt.ErrNotCUDA):
			return nil
		case err != nil:
			return fmt.Errorf("move pid %d back: driver state: %w", pid, err)
		case st == cudackpt.Checkpointed:
			return nil // never restored onto its target: the checkpoint step's undo restores it
		case st == cudackpt.Running:
			if err := d.Lock(pid, moveBackLock); err != nil {
				return fmt.Errorf("move pid %d back: lock on its target: %w", pid, err)
			}
		}
		if err := d.Checkpoint(pid); err != nil {
			return fmt.Errorf("move pid %d back: checkpoint on its target: %w", pid, err)
		}
		if err := d.Restore(pid, inverse); err != nil {
			return fmt.Errorf("move pid %d back: restore onto its source GPUs: %w", pid, err)
		}
		return nil
	})
}

// UnlockStep unlocks each pid.
func UnlockStep(d Driver, pids func() []int) Step {
	return Step{Name: StepUnlock, Do: func(context.Context) error {
		for _, pid := range pids() {
			if err := d.Unlock(pid); err != nil {
				return fmt.Errorf("unlock pid %d: %w", pid, err)
			}
		}
		return nil
	}}
}

// Fixed returns a pid list known in advance, for RestoreStep and UnlockStep.
func Fixed(pids []int) func() []int { return func() []int { return pids } }

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
