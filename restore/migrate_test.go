package restore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"reflect"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
)

// fakeDriver models the driver's state machine for one process on one GPU.
type fakeDriver struct {
	state    cudackpt.State
	gpu      string
	calls    []string
	failNext map[string]error // call name → error, consumed once
}

func (f *fakeDriver) fail(call string) error {
	f.calls = append(f.calls, call)
	if err, ok := f.failNext[call]; ok {
		delete(f.failNext, call)
		return err
	}
	return nil
}

func (f *fakeDriver) State(int) (cudackpt.State, error) { return f.state, nil }
func (f *fakeDriver) Lock(int, time.Duration) error {
	if f.state != cudackpt.Running {
		return fmt.Errorf("lock in state %v", f.state)
	}
	if err := f.fail("lock"); err != nil {
		return err
	}
	f.state = cudackpt.Locked
	return nil
}
func (f *fakeDriver) Checkpoint(int) error {
	if err := f.fail("checkpoint"); err != nil {
		return err
	}
	f.state = cudackpt.Checkpointed
	return nil
}
func (f *fakeDriver) Restore(_ int, pairs []cudackpt.Pair) error {
	name := "restore"
	if len(pairs) > 0 {
		name = "restore-to-" + pairs[0].New.String()
	}
	if f.state != cudackpt.Checkpointed {
		return fmt.Errorf("restore in state %v", f.state)
	}
	if err := f.fail(name); err != nil {
		return err
	}
	if len(pairs) > 0 {
		f.gpu = pairs[0].New.String()
	}
	f.state = cudackpt.Locked
	return nil
}
func (f *fakeDriver) Unlock(int) error {
	if err := f.fail("unlock"); err != nil {
		return err
	}
	f.state = cudackpt.Running
	return nil
}

// TestMigrateRollback: whatever step fails, the process ends running, on its source GPU unless
// the move itself completed.
func TestMigrateRollback(t *testing.T) {
	src, dst := mustUUID(t, u0), mustUUID(t, u1)
	pairs := []cudackpt.Pair{{Old: src, New: dst}}
	oom := errors.New("CUDA_ERROR_OUT_OF_MEMORY")
	tests := []struct {
		name      string
		fail      string
		wantGPU   string
		wantCalls []string
		wantErr   bool
	}{
		{"success", "", u1, []string{"lock", "checkpoint", "restore-to-" + u1, "unlock"}, false},
		{"lock times out", "lock", u0, []string{"lock"}, true},
		{"checkpoint fails", "checkpoint", u0, []string{"lock", "checkpoint", "unlock"}, true},
		{"target fails mid-restore", "restore-to-" + u1, u0, []string{"lock", "checkpoint", "restore-to-" + u1, "restore", "unlock"}, true},
		{"unlock fails once", "unlock", u1, []string{"lock", "checkpoint", "restore-to-" + u1, "unlock", "unlock"}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := &fakeDriver{state: cudackpt.Running, gpu: u0, failNext: map[string]error{}}
			if tt.fail != "" {
				d.failNext[tt.fail] = oom
			}
			_, err := checkpoint.Execute(context.Background(), migrateSteps(d, 42, pairs, time.Second), nil, 0, slog.New(slog.NewTextHandler(io.Discard, nil)))
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v", err)
			}
			if d.state != cudackpt.Running || d.gpu != tt.wantGPU {
				t.Errorf("process ends %v on %s, want running on %s", d.state, d.gpu, tt.wantGPU)
			}
			if !reflect.DeepEqual(d.calls, tt.wantCalls) {
				t.Errorf("calls %q\nwant  %q", d.calls, tt.wantCalls)
			}
			var se *checkpoint.StepError
			if err != nil && errors.As(err, &se) && se.Touched && !se.RolledBack() {
				t.Errorf("rollback incomplete: %v", err)
			}
		})
	}
}

func mustUUID(t *testing.T, s string) cudackpt.UUID {
	u, err := cudackpt.ParseUUID(s)
	if err != nil {
		t.Fatal(err)
	}
	return u
}
