package op

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"testing"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/cudackpt/cudackpttest"
)

// TestStepUndidReportsItsOwnUndo: a step's own failed undo is a failed rollback.
func TestStepUndidReportsItsOwnUndo(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	errDo, errUndo := errors.New("dump failed"), errors.New("pid 7 still stopped")
	_, err := Execute(context.Background(), []Step{{Name: "dump", Do: func(context.Context) error { return StepUndid(errDo, errUndo) }}}, nil, 0, log)
	var se *StepError
	if !errors.As(err, &se) || !errors.Is(err, errDo) || !errors.Is(se.UndoErr, errUndo) || se.RolledBack() || !se.Touched {
		t.Fatalf("err = %v (%+v): want a touched, not rolled back, failure naming both", err, se)
	}
	_, err = Execute(context.Background(), []Step{{Name: "dump", Do: func(context.Context) error { return StepUndid(errDo, nil) }}}, nil, 0, log)
	if !errors.As(err, &se) || !se.RolledBack() || !slices.Equal(se.Undone, []string{"dump"}) {
		t.Fatalf("err = %v (%+v): want rolled back (dump)", err, se)
	}
}

// TestFailureStateAsksTheDriver: the state a failure reports comes from /proc and the driver, so
// a process the driver still holds is not reported as plainly running.
func TestFailureStateAsksTheDriver(t *testing.T) {
	self := os.Getpid()
	d := cudackpttest.New("GPU-0", nil, self)
	d.Procs[self].State = cudackpt.Locked
	e := &Env{Driver: d}
	err := e.NewFailure(&StepError{Step: "checkpoint", Err: errors.New("boom"), Touched: true}, "checkpoint", self, nil, []int{self}, []int{self})
	var f *Failure
	if !errors.As(err, &f) || f.State != fmt.Sprintf("pid %d is running; locked by the driver: pid %d", self, self) {
		t.Fatalf("state %q", f.State)
	}
	d.Procs[self].State = cudackpt.Running
	if err := e.NewFailure(&StepError{Step: "checkpoint", Err: errors.New("boom")}, "checkpoint", self, nil, []int{self}, []int{self}); !errors.As(err, &f) ||
		f.State != fmt.Sprintf("pid %d is running", self) {
		t.Fatalf("state %q", f.State)
	}
}
