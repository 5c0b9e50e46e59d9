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
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/store"
)

// fakeDriver models the driver's state machine for one process on one GPU. With visible set, it
// also checks restore pairs as driver 580 does: they must pair every visible GPU, one to one.
type fakeDriver struct {
	state    cudackpt.State
	gpu      string
	visible  []string
	calls    []string
	failNext map[string]error // call name → error, consumed once
}

var errInvalidValue = errors.New("CUDA_ERROR_INVALID_VALUE (1): invalid argument")

func (f *fakeDriver) checkPairs(pairs []cudackpt.Pair) error {
	if len(pairs) == 0 || f.visible == nil {
		return nil
	}
	olds, news := map[string]bool{}, map[string]bool{}
	for _, p := range pairs {
		olds[p.Old.String()], news[p.New.String()] = true, true
	}
	if len(olds) != len(pairs) || len(news) != len(pairs) || len(pairs) != len(f.visible) {
		return errInvalidValue
	}
	for _, v := range f.visible {
		if !olds[v] {
			return errInvalidValue
		}
	}
	return nil
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
	if err := f.checkPairs(pairs); err != nil {
		return err
	}
	for _, p := range pairs {
		if p.Old.String() == f.gpu {
			f.gpu = p.New.String()
			break
		}
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
	swap := []cudackpt.Pair{{Old: src, New: dst}, {Old: dst, New: src}}
	partial := []cudackpt.Pair{{Old: src, New: dst}} // what ptxmig passed before it paired every visible GPU
	oom := errors.New("CUDA_ERROR_OUT_OF_MEMORY")
	tests := []struct {
		name      string
		pairs     []cudackpt.Pair
		fail      string
		wantGPU   string
		wantCalls []string
		wantErr   bool
	}{
		{"success", swap, "", u1, []string{"lock", "checkpoint", "restore-to-" + u1, "unlock"}, false},
		{"lock times out", swap, "lock", u0, []string{"lock"}, true},
		{"checkpoint fails", swap, "checkpoint", u0, []string{"lock", "checkpoint", "unlock"}, true},
		{"target fails mid-restore", swap, "restore-to-" + u1, u0, []string{"lock", "checkpoint", "restore-to-" + u1, "restore", "unlock"}, true},
		{"unlock fails once", swap, "unlock", u1, []string{"lock", "checkpoint", "restore-to-" + u1, "unlock", "unlock"}, true},
		{"partial pairs: driver refuses, rolled back", partial, "", u0, []string{"lock", "checkpoint", "restore-to-" + u1, "restore", "unlock"}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := &fakeDriver{state: cudackpt.Running, gpu: u0, visible: []string{u0, u1}, failNext: map[string]error{}}
			if tt.fail != "" {
				d.failNext[tt.fail] = oom
			}
			_, err := checkpoint.Execute(context.Background(), migrateSteps(d, 42, tt.pairs, time.Second, nil), nil, 0, slog.New(slog.NewTextHandler(io.Discard, nil)))
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

// TestPlannedPairsSatisfyDriver runs planned pairs through the fake driver's 580 check: moving
// 0→1 on a two-GPU host passes both GPUs, and the process ends on GPU 1.
func TestPlannedPairsSatisfyDriver(t *testing.T) {
	two := []gpu.Device{dev(0, u0, "NVIDIA H200", 0), dev(1, u1, "NVIDIA H200", 0)}
	pairs, err := PlanPairs([]store.GPU{src(0, u0, 1)}, StoreGPUs(two, nil), two, []int{1}, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	dp, err := DriverPairs(pairs)
	if err != nil {
		t.Fatal(err)
	}
	d := &fakeDriver{state: cudackpt.Running, gpu: u0, visible: []string{u0, u1}, failNext: map[string]error{}}
	if _, err := checkpoint.Execute(context.Background(), migrateSteps(d, 42, dp, time.Second, nil), nil, 0, slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
		t.Fatalf("planned pairs %s: %v", pairText(pairs), err)
	}
	if d.gpu != u1 || d.state != cudackpt.Running {
		t.Fatalf("process ends %v on %s, want running on %s", d.state, d.gpu, u1)
	}
}

// TestMigrateRecheckBeforeRestore: a target that lost its free memory after preflight is caught
// just before the driver restore (which, on driver 580, cannot be retried after running out of
// memory), so the process is restored onto its source and unlocked instead.
func TestMigrateRecheckBeforeRestore(t *testing.T) {
	src, dst := mustUUID(t, u0), mustUUID(t, u1)
	swap := []cudackpt.Pair{{Old: src, New: dst}, {Old: dst, New: src}}
	d := &fakeDriver{state: cudackpt.Running, gpu: u0, visible: []string{u0, u1}, failNext: map[string]error{}}
	recheck := func() error { return fmt.Errorf("%w: GPU 1 filled up", ErrNoRoom) }
	_, err := checkpoint.Execute(context.Background(), migrateSteps(d, 42, swap, time.Second, recheck), nil, 0, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if !errors.Is(err, ErrNoRoom) {
		t.Fatalf("err = %v, want ErrNoRoom", err)
	}
	want := []string{"lock", "checkpoint", "restore", "unlock"}
	if !reflect.DeepEqual(d.calls, want) {
		t.Errorf("calls %q, want %q (no restore onto the full target)", d.calls, want)
	}
	if d.state != cudackpt.Running || d.gpu != u0 {
		t.Errorf("process ends %v on %s, want running on %s", d.state, d.gpu, u0)
	}
	var se *checkpoint.StepError
	if !errors.As(err, &se) || !se.RolledBack() {
		t.Errorf("want a rolled-back step error, got %v", err)
	}
}

func TestCheckRoom(t *testing.T) {
	devs := []gpu.Device{dev(0, u0, "NVIDIA H200", 0), dev(1, u1, "NVIDIA H200", 0)}
	pairs, err := PlanPairs([]store.GPU{src(0, u0, 1)}, StoreGPUs(devs, nil), devs, []int{1}, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	if err := CheckRoom(pairs, devs, true); err != nil {
		t.Fatalf("room available: %v", err)
	}
	full := []gpu.Device{devs[0], devs[1]}
	full[1].MemoryUsed = full[1].MemoryTotal
	if err := CheckRoom(pairs, full, true); !errors.Is(err, ErrNoRoom) {
		t.Fatalf("full target: err = %v, want ErrNoRoom", err)
	}
	if err := CheckRoom(pairs, devs[:1], true); !errors.Is(err, ErrBadTarget) {
		t.Fatalf("vanished target: err = %v, want ErrBadTarget", err)
	}
}
