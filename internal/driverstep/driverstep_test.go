package driverstep

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"testing"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/cudackpt/cudackpttest"
	"github.com/ptxmig/ptxmig/internal/op"
)

// TestDriverStepsFailAtEveryProcess: a job of three CUDA processes goes through the driver steps
// of a --leave-running checkpoint (lock, checkpoint, restore, unlock); the driver fails each step
// at each process in turn. Whatever failed, every process ends running and unlocked, the error
// names the step and says it rolled back: no step leaves some processes locked or checkpointed
// (the hang of a DDP job whose second rank's lock timed out with the first one locked).
func TestDriverStepsFailAtEveryProcess(t *testing.T) {
	pids := []int{101, 102, 103}
	calls := map[string]string{StepLock: "lock", StepCheckpoint: "checkpoint", StepDriverRestore: "restore", StepUnlock: "unlock"}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, step := range []string{StepLock, StepCheckpoint, StepDriverRestore, StepUnlock} {
		for i, pid := range pids {
			t.Run(fmt.Sprintf("%s/%d", step, i), func(t *testing.T) {
				d := cudackpttest.New("GPU-0", nil, pids...)
				errDriver := errors.New("CUDA_ERROR_NOT_READY (600)")
				d.FailNext[fmt.Sprintf("%s %d", calls[step], pid)] = errDriver
				steps := []op.Step{LockStep(d, pids, 0), CheckpointStep(d, pids), RestoreStep(d, op.Fixed(pids), nil, nil, false), UnlockStep(d, op.Fixed(pids))}
				_, err := op.Execute(context.Background(), steps, nil, 0, log)
				var se *op.StepError
				if !errors.As(err, &se) || se.Step != step || !errors.Is(err, errDriver) {
					t.Fatalf("err = %v, want the %s step failing with the driver's error", err, step)
				}
				for _, p := range pids {
					if st := d.Get(p).State; st != cudackpt.Running {
						t.Errorf("pid %d left %s (calls %v)", p, st, d.PIDCalls)
					}
				}
				if !se.RolledBack() || se.UndoErr != nil {
					t.Errorf("rolled back %v, undo error %v: %v", se.RolledBack(), se.UndoErr, err)
				}
				// A step that fails part way undoes its own part first (lock, checkpoint); the
				// steps without an undo leave it to the completed steps before them.
				if own := step == StepLock || step == StepCheckpoint; own != slices.Contains(se.Undone, step) {
					t.Errorf("undone %v: the failed step %s listed %v, want %v", se.Undone, step, !own, own)
				}
			})
		}
	}
}
