package driverstep

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/cudackpt/cudackpttest"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/internal/testreq"
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

// TestHeldWhenTheDriverCannotSay: on a real process whose second thread dies if it runs while the
// fake driver has its mapping away, the driver's state query fails after each call. A checkpoint
// that succeeded leaves the process stopped without asking; a restore whose state cannot be read
// leaves it stopped too (the safe side), and the unlock step continues it; it survives all of it.
func TestHeldWhenTheDriverCannotSay(t *testing.T) {
	dir := t.TempDir()
	bin, err := testproc.Build(dir)
	if err != nil {
		testreq.Skip(t, "cc", "cannot build the test program: %v", err)
	}
	p, err := testproc.StartUVM(bin, dir, testproc.Options{IntervalMs: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Kill() })
	d := cudackpttest.NewReal("GPU-0", nil, p.PID)
	d.Procs[p.PID].UVM = p.UVM
	transient := errors.New("transient")
	ctx := context.Background()
	if err := LockStep(d, []int{p.PID}, 0).Do(ctx); err != nil {
		t.Fatal(err)
	}
	d.FailNext[fmt.Sprintf("state %d", p.PID)] = transient
	if err := CheckpointStep(d, []int{p.PID}).Do(ctx); err != nil {
		t.Fatal(err)
	}
	if s := proc.ThreadState(p.PID, p.PID); s != 'T' {
		t.Fatalf("after the checkpoint the process is in state %c, want stopped (T)", s)
	}
	restore := RestoreStep(d, op.Fixed([]int{p.PID}), nil, nil, false)
	restore.Do = func(do func(context.Context) error) func(context.Context) error {
		return func(ctx context.Context) error {
			d.FailNext[fmt.Sprintf("state %d", p.PID)] = transient // asked after the restore
			return do(ctx)
		}
	}(restore.Do)
	if err := restore.Do(ctx); err != nil {
		t.Fatal(err)
	}
	if s := proc.ThreadState(p.PID, p.PID); s != 'T' {
		t.Fatalf("after a restore whose state could not be read the process is in state %c, want stopped (T)", s)
	}
	if err := UnlockStep(d, op.Fixed([]int{p.PID})).Do(ctx); err != nil {
		t.Fatal(err)
	}
	if st := d.Get(p.PID).State; st != cudackpt.Running {
		t.Fatalf("driver state %v, want running", st)
	}
	s0, _ := testproc.ReadState(p.StateFile)
	time.Sleep(200 * time.Millisecond)
	if s1, err := testproc.ReadState(p.StateFile); err != nil || s1.Step <= s0.Step || !testproc.Alive(p.PID) {
		t.Fatalf("the process does not run on (alive %v, %v)", testproc.Alive(p.PID), err)
	}
}
