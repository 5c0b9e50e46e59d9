package migrate

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"reflect"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/cudackpt/cudackpttest"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/placement"
)

const (
	u0 = "GPU-00000000-0000-0000-0000-000000000000"
	u1 = "GPU-11111111-1111-1111-1111-111111111111"
)

func dev(i int, uuid string) gpu.Device {
	return gpu.Device{Index: i, UUID: uuid, Name: "NVIDIA H200", ComputeCap: "9.0", MemoryTotal: 100 << 30}
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
			d := cudackpttest.New(u0, []string{u0, u1}, 42)
			if tt.fail != "" {
				d.FailNext[tt.fail] = oom
			}
			_, err := op.Execute(context.Background(), Steps(d, 42, tt.pairs, time.Second, nil), nil, 0, slog.New(slog.NewTextHandler(io.Discard, nil)))
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v", err)
			}
			if g := d.Get(42); g.State != cudackpt.Running || g.GPU != tt.wantGPU {
				t.Errorf("process ends %v on %s, want running on %s", g.State, g.GPU, tt.wantGPU)
			}
			if !reflect.DeepEqual(d.Calls, tt.wantCalls) {
				t.Errorf("calls %q\nwant  %q", d.Calls, tt.wantCalls)
			}
			var se *op.StepError
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
	two := []gpu.Device{dev(0, u0), dev(1, u1)}
	pairs, err := placement.PlanPairs([]imagedesc.GPU{{Index: 0, UUID: u0, Name: "NVIDIA H200", ComputeCap: "9.0", MemoryBytes: 1}}, placement.StoreGPUs(two, nil), two, []int{1}, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	dp, err := placement.DriverPairs(pairs)
	if err != nil {
		t.Fatal(err)
	}
	d := cudackpttest.New(u0, []string{u0, u1}, 42)
	if _, err := op.Execute(context.Background(), Steps(d, 42, dp, time.Second, nil), nil, 0, slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
		t.Fatalf("planned pairs %s: %v", placement.PairText(pairs), err)
	}
	if g := d.Get(42); g.GPU != u1 || g.State != cudackpt.Running {
		t.Fatalf("process ends %v on %s, want running on %s", g.State, g.GPU, u1)
	}
}

// TestMigrateRecheckBeforeRestore: a target that lost its free memory after preflight is caught
// just before the driver restore (which, on driver 580, cannot be retried after running out of
// memory), so the process is restored onto its source and unlocked instead.
func TestMigrateRecheckBeforeRestore(t *testing.T) {
	src, dst := mustUUID(t, u0), mustUUID(t, u1)
	swap := []cudackpt.Pair{{Old: src, New: dst}, {Old: dst, New: src}}
	d := cudackpttest.New(u0, []string{u0, u1}, 42)
	recheck := func() error { return fmt.Errorf("%w: GPU 1 filled up", placement.ErrNoRoom) }
	_, err := op.Execute(context.Background(), Steps(d, 42, swap, time.Second, recheck), nil, 0, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if !errors.Is(err, placement.ErrNoRoom) {
		t.Fatalf("err = %v, want placement.ErrNoRoom", err)
	}
	want := []string{"lock", "checkpoint", "restore", "unlock"}
	if !reflect.DeepEqual(d.Calls, want) {
		t.Errorf("calls %q, want %q (no restore onto the full target)", d.Calls, want)
	}
	if g := d.Get(42); g.State != cudackpt.Running || g.GPU != u0 {
		t.Errorf("process ends %v on %s, want running on %s", g.State, g.GPU, u0)
	}
	var se *op.StepError
	if !errors.As(err, &se) || !se.RolledBack() {
		t.Errorf("want a rolled-back step error, got %v", err)
	}
}
