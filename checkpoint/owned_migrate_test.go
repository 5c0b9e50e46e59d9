package checkpoint_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/cudackpt/cudackpttest"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/shimctl"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/migrate"
)

// Migrate of a process whose shim owns device memory, through the real shim and the fake driver
// (its VMM modelled on host memory: app_owned checks all of it every step), with the driver's
// checkpoint steps faked (cudackpttest): the owned memory goes into the process's own host
// memory before the lock and comes back after the unlock; whatever fails, and when ptxmig goes
// away with the memory stashed, the app runs on with all of it.

const (
	gpu0 = "GPU-00000000-0000-0000-0000-000000000000"
	gpu1 = "GPU-11111111-1111-1111-1111-111111111111"
	// What app_owned's shim owns: A 6 MiB, B 10 MiB, P 300 rows of 4096 bytes.
	appOwnedBytes = 6<<20 + 10<<20 + 300*4096
)

// ownedLister is an NVML inventory of n H200s, the app holding 64 MiB of GPU 0.
type ownedLister struct{ pid, n int }

func (l ownedLister) Devices() ([]gpu.Device, error) {
	devs := []gpu.Device{{Index: 0, UUID: gpu0, Name: "NVIDIA H200", ComputeCap: "9.0", MemoryTotal: 100 << 30, MemoryUsed: 64 << 20,
		Processes: []gpu.Process{{PID: l.pid, UsedMemory: 64 << 20}}}}
	if l.n > 1 {
		devs = append(devs, gpu.Device{Index: 1, UUID: gpu1, Name: "NVIDIA H200", ComputeCap: "9.0", MemoryTotal: 100 << 30})
	}
	return devs, nil
}

func ownedMigrateEnv(f *fixture, a *ownedApp, gpus int) *cudackpttest.Driver {
	visible := []string{gpu0}
	if gpus > 1 {
		visible = append(visible, gpu1)
	}
	drv := cudackpttest.NewReal(gpu0, visible, a.pid)
	f.env.Driver, f.env.DriverErr = drv, nil
	f.env.GPUs = ownedLister{a.pid, gpus}
	f.env.UsesCUDA = func(pid int) (bool, error) { return pid == a.pid, nil }
	f.env.DriverVersion = func() (string, error) { return "580.159.04", nil }
	return drv
}

// memStatus asks the app's shim for its owned-memory overview on a connection of its own.
func memStatus(t *testing.T, pid int) *shimctl.MemStatus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := op.DialShim(ctx, pid)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	st, err := c.MemStatus(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// TestMigrateOwnedMemory: a rehearsal on one GPU and a move to GPU 1 stash all the owned memory
// (pre-copied while the app runs, then what changed since in the stop) and put it back; the
// driver moved the process; the app runs on with its memory intact.
func TestMigrateOwnedMemory(t *testing.T) {
	for _, tt := range []struct {
		name     string
		gpus     int
		opts     migrate.Options
		wantGPU  string
		wantCall string
	}{
		{"rehearse", 1, migrate.Options{Rehearse: true}, gpu0, "restore"},
		{"gpu 1", 2, migrate.Options{GPUs: []int{1}}, gpu1, "restore-to-" + gpu1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := setup(t)
			a := startOwned(t, f, "owned")
			drv := ownedMigrateEnv(f, a, tt.gpus)
			// The app writes region A between the last pre-copy round and the stop, which must
			// then copy it again.
			f.env.Hook = func(_ context.Context, s string) error {
				if s == shimstep.StepQuiesce {
					a.waitSteps(t, 2)
				}
				return nil
			}
			o := tt.opts
			o.PID, o.LockTimeout = a.pid, 5*time.Second
			res, err := migrate.Run(context.Background(), f.env, o)
			if err != nil {
				t.Fatalf("migrate: %v", err)
			}
			m := ownedOf(t, res.Preemption, a.pid)
			if m.Stash == nil || m.Stash.Bytes != appOwnedBytes || m.Stash.Regions != 3 || m.Unstash == nil || m.Unstash.Bytes != appOwnedBytes || m.Released {
				t.Fatalf("owned memory: %+v, stash %+v, unstash %+v", m, m.Stash, m.Unstash)
			}
			if m.Prepare == nil || m.Prepare.Bytes != appOwnedBytes || !m.Stash.Prepared {
				t.Errorf("stash not prepared before the stop: prepare %+v, stash %+v", m.Prepare, m.Stash)
			}
			// Pre-copy: round 1 takes everything; region A (6 MiB, two chunks) changes every
			// step, B and P never: later rounds and the stop copy A only.
			if len(m.Precopy) < 2 || m.Precopy[0].Bytes != appOwnedBytes || m.Precopy[1].Bytes > 8<<20 || !m.Stash.Precopied || m.Stash.CopiedBytes > 8<<20 {
				t.Errorf("pre-copy: rounds %v, stash %+v", m.Precopy, m.Stash)
				for _, r := range m.Precopy {
					t.Logf("round %+v", r)
				}
			}
			if res.Stash <= 0 || res.Unstash <= 0 || res.Rehearsal != o.Rehearse {
				t.Errorf("result: stash %s unstash %s rehearsal %v", res.Stash, res.Unstash, res.Rehearsal)
			}
			if g := drv.Get(a.pid); g.State != cudackpt.Running || g.GPU != tt.wantGPU || !slices.Contains(drv.Calls, tt.wantCall) {
				t.Errorf("driver: %v on %s, calls %q (want running on %s, a %s)", g.State, g.GPU, drv.Calls, tt.wantGPU, tt.wantCall)
			}
			a.waitSteps(t, 5)
			if st := memStatus(t, a.pid); st.Released || st.Stashed || st.Regions != 3 || st.StashBytes != 0 {
				t.Errorf("shim after the migrate: %+v; want the memory back and the stash freed", st)
			}
		})
	}
}

// TestMigrateOwnedMemoryRollback: a failure at the stash (its stash prepared and pre-copied, then
// unused), at any driver step, or at the unstash on the target, ends with the app running on GPU
// 0 with all its memory and no stash left; with memory kept on the target for the device-to-device
// copy too (a rollback puts the memory back from the stash). "re-create" fails the shim's own
// unstash on the target (its second cuMemCreate: the first region re-created is released again):
// the driver moves the app back, where the stash is put back.
func TestMigrateOwnedMemoryRollback(t *testing.T) {
	injected := errors.New("injected")
	for _, tc := range []struct {
		fail       string
		deviceCopy bool
	}{
		{"hook " + shimstep.StepStashMemory, false}, {"lock", false}, {"checkpoint", false}, {"restore-to-" + gpu1, false},
		{"unlock", false}, {"hook " + shimstep.StepUnstashMemory, false}, {"hook " + shimstep.StepResume, false}, {"re-create", false},
		// With memory kept on the target for the device-to-device copy (filled in the stop).
		{"restore-to-" + gpu1, true}, {"hook " + shimstep.StepUnstashMemory, true}, {"hook " + shimstep.StepResume, true}, {"re-create", true},
	} {
		fail, name := tc.fail, tc.fail
		if tc.deviceCopy {
			name += " (device copy)"
		}
		t.Run(name, func(t *testing.T) {
			f := setup(t)
			failAt := filepath.Join(f.dir, "vmm-fail-at")
			a := startOwned(t, f, "owned", "FAKE_CUDA_VMM_FAIL_AT="+failAt)
			drv := ownedMigrateEnv(f, a, 2)
			if tc.deviceCopy {
				f.env.Driver = keeping(t, drv)
			}
			want := injected
			if fail == "re-create" {
				want = nil
				f.env.Hook = func(_ context.Context, s string) error {
					if s == shimstep.StepUnstashMemory {
						return os.WriteFile(failAt, []byte("2\n"), 0o600)
					}
					return nil
				}
			} else if step, ok := strings.CutPrefix(fail, "hook "); ok {
				f.env.Hook = func(_ context.Context, s string) error {
					if s == step {
						return injected
					}
					return nil
				}
			} else {
				drv.FailNext[fail] = injected
			}
			_, err := migrate.Run(context.Background(), f.env, migrate.Options{PID: a.pid, GPUs: []int{1}, LockTimeout: 5 * time.Second})
			switch {
			case want != nil && !errors.Is(err, want):
				t.Fatalf("err = %v, want the injected failure", err)
			case want == nil && (err == nil || !strings.Contains(err.Error(), "re-creating")):
				t.Fatalf("err = %v, want the shim's failure to re-create the memory", err)
			}
			var se *op.StepError
			if errors.As(err, &se) && se.Touched && !se.RolledBack() {
				t.Fatalf("rollback incomplete: %v", err)
			}
			if g := drv.Get(a.pid); g.State != cudackpt.Running || g.GPU != gpu0 {
				t.Errorf("driver: %v on %s (calls %q), want running on %s", g.State, g.GPU, drv.Calls, gpu0)
			}
			a.waitSteps(t, 5)
			if st := memStatus(t, a.pid); st.Released || st.Stashed || st.StashBytes != 0 {
				t.Errorf("shim after the rollback: %+v; want the memory back and the stash freed", st)
			}
		})
	}
}

// TestStashSurvivesPtxmig: ptxmig goes away (its connection closes, no resume) after the owned
// memory was stashed (into memory mapped in the stop: nothing prepared) and released: the shim
// puts it back and the app runs on. A second stash on the same process works again. In a third,
// putting it back fails (no device memory): the app stays held with its memory stashed until a
// later resume (a recovery's) puts it back.
func TestStashSurvivesPtxmig(t *testing.T) {
	f := setup(t)
	failAt := filepath.Join(f.dir, "vmm-fail-at")
	a := startOwned(t, f, "owned", "FAKE_CUDA_VMM_FAIL_AT="+failAt)
	for round := range 3 {
		pre := shimstep.NewPreemption(f.env, 0)
		steps := []op.Step{pre.QuiesceStep([]int{a.pid}), pre.StashMemoryStep()}
		if _, err := op.Execute(context.Background(), steps, nil, 0, f.env.Logger()); err != nil {
			t.Fatalf("round %d: quiesce and stash: %v", round, err)
		}
		if m := ownedOf(t, pre.Reports, a.pid); m.Stash == nil || m.Stash.Bytes != appOwnedBytes || m.Stash.Prepared || !m.Released {
			t.Fatalf("round %d: owned memory %+v", round, m)
		}
		if st := memStatus(t, a.pid); !st.Released || !st.Stashed {
			t.Fatalf("round %d: shim while stashed: %+v", round, st)
		}
		if round == 2 {
			if err := os.WriteFile(failAt, []byte("1\n"), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		pre.Close() // as if ptxmig died: the lease ends without a resume
		if round == 2 {
			held := a.step(t)
			time.Sleep(300 * time.Millisecond) // 15 steps of the app, were it running
			if st := memStatus(t, a.pid); !st.Released || !st.Stashed || a.step(t) != held {
				t.Fatalf("unstash failed at the lease's end: shim %+v, app at step %d (was %d); want it held, stashed", st, a.step(t), held)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			c, err := op.DialShim(ctx, a.pid)
			if err == nil {
				_, err = c.Resume(ctx)
				c.Close()
			}
			cancel()
			if err != nil {
				t.Fatalf("the later resume: %v", err)
			}
		}
		a.waitSteps(t, 5)
		if st := memStatus(t, a.pid); st.Released || st.Stashed {
			t.Fatalf("round %d: shim after the lease ended: %+v", round, st)
		}
	}
}

// TestStashProtocol: the stash's requests answer misuse with an error and change nothing: a
// pre-copy round without a prepared stash, a stash or an unstash while the process runs, a stash
// from a connection that does not hold the lease, an unstash with nothing stashed (an empty
// reply), and, while stashed, a save session, a release or a second stash. A resume puts the
// memory back; the app runs on with all of it.
func TestStashProtocol(t *testing.T) {
	f := setup(t)
	a := startOwned(t, f, "owned")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := func() *shimctl.Client {
		t.Helper()
		c, err := op.DialShim(ctx, a.pid)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	c := dial()
	wantErr := func(what, substr string, err error) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), substr) {
			t.Errorf("%s: err %v, want one saying %q", what, err, substr)
		}
	}
	_, err := c.MemPrecopy(ctx, false)
	wantErr("pre-copy, nothing prepared", "no prepared stash", err)
	_, err = c.MemStash(ctx)
	wantErr("stash while running", "not quiesced", err)
	_, err = c.MemUnstash(ctx)
	wantErr("unstash while running", "not quiesced", err)
	p, err := c.MemPrepare(ctx)
	if err != nil || p.Bytes != appOwnedBytes {
		t.Fatalf("prepare: %+v, %v", p, err)
	}
	r1, err := c.MemPrecopy(ctx, false)
	if err != nil || r1.Round != 1 || r1.Bytes != appOwnedBytes {
		t.Fatalf("pre-copy round 1: %+v, %v", r1, err)
	}
	a.waitSteps(t, 2) // region A changes
	r2, err := c.MemPrecopy(ctx, true)
	if err != nil || r2.Round != 2 || r2.Bytes == 0 || r2.Bytes > 8<<20 || r2.Pinned {
		t.Fatalf("pre-copy round 2: %+v, %v; want region A only, unpinned after", r2, err)
	}
	lease := dial()
	if _, err := lease.Quiesce(ctx, time.Second); err != nil {
		t.Fatal(err)
	}
	_, err = c.MemStash(ctx)
	wantErr("stash from a connection without the lease", "only the connection that quiesced", err)
	if x, err := lease.MemUnstash(ctx); err != nil || x.Regions != 0 || x.Bytes != 0 {
		t.Errorf("unstash with nothing stashed: %+v, %v; want an empty reply", x, err)
	}
	x, err := lease.MemStash(ctx)
	if err != nil || !x.Precopied || x.Bytes != appOwnedBytes || x.CopiedBytes > 8<<20 {
		t.Fatalf("stash: %+v, %v", x, err)
	}
	_, err = lease.MemStash(ctx)
	wantErr("a second stash", "already stashed", err)
	_, err = lease.MemRelease(ctx)
	wantErr("release while stashed", "stashed", err)
	_, err = lease.MemBegin(ctx, "save", 4<<20, 4, false)
	wantErr("save session while stashed", "stashed", err)
	if st := memStatus(t, a.pid); !st.Released || !st.Stashed {
		t.Fatalf("shim while stashed: %+v", st)
	}
	if _, err := lease.Resume(ctx); err != nil {
		t.Fatalf("resume: %v", err)
	}
	a.waitSteps(t, 5)
	if st := memStatus(t, a.pid); st.Released || st.Stashed {
		t.Errorf("shim after the resume: %+v", st)
	}
}

// keepingDriver is the fake driver of the migrate tests plus what ptxmig itself does on a GPU:
// the memory it keeps for the device-to-device copy comes from the real binding
// (internal/cudackpt) over the fake libcuda, whose one device stands for every target.
type keepingDriver struct {
	*cudackpttest.Driver
	real *cudackpt.Driver
	dev  cudackpt.UUID
}

func (d keepingDriver) Keep(_ cudackpt.UUID, bytes uint64) (*cudackpt.Kept, error) {
	return d.real.Keep(d.dev, bytes)
}

// keeping wraps drv into a keepingDriver.
func keeping(t *testing.T, drv *cudackpttest.Driver) keepingDriver {
	t.Helper()
	_, fake, _ := ownedBuild(t)
	// No other test of this package opens the driver binding: the first Open loads the fake
	// (Open keeps its first result for the process).
	t.Setenv("PTXMIG_LIBCUDA", filepath.Join(fake, "libcuda.so.1"))
	real, err := cudackpt.Open()
	if err != nil {
		t.Fatalf("open the fake driver for ptxmig's own calls: %v", err)
	}
	devs, err := real.Devices()
	if err != nil || len(devs) == 0 {
		t.Fatalf("fake driver devices: %v %v", devs, err)
	}
	return keepingDriver{drv, real, devs[0].UUID}
}

// TestMigrateOwnedMemoryDeviceCopy: with memory kept on the target (the default), the stop also
// copies the owned memory into it device to device, and the unstash puts it back from there (no
// pinning, no host copy); memory the app wrote between the last pre-copy round and the stop is
// in it. When that copy cannot be read at the unstash (its import fails), the stash is used;
// with --device-copy=false there is none. Every way, the app runs on with all its memory (it
// checks every byte every step).
func TestMigrateOwnedMemoryDeviceCopy(t *testing.T) {
	for _, tt := range []struct {
		name       string
		noCopy     bool
		failImport bool
		wantFrom   string
	}{
		{name: "device copy", wantFrom: "target"},
		{name: "import fails at the unstash", failImport: true, wantFrom: "host"},
		{name: "device-copy=false", noCopy: true, wantFrom: "host"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := setup(t)
			failAt := filepath.Join(f.dir, "import-fail-at")
			a := startOwned(t, f, "owned", "FAKE_CUDA_IMPORT_FAIL_AT="+failAt)
			f.env.Driver = keeping(t, ownedMigrateEnv(f, a, 2))
			f.env.Hook = func(_ context.Context, s string) error {
				switch {
				case s == shimstep.StepQuiesce:
					a.waitSteps(t, 2) // region A changes after the last pre-copy round
				case s == shimstep.StepUnstashMemory && tt.failImport:
					return os.WriteFile(failAt, []byte("1\n"), 0o600)
				}
				return nil
			}
			res, err := migrate.Run(context.Background(), f.env, migrate.Options{PID: a.pid, GPUs: []int{1}, LockTimeout: 5 * time.Second,
				NoDeviceCopy: tt.noCopy})
			if err != nil {
				t.Fatalf("migrate: %v", err)
			}
			m := ownedOf(t, res.Preemption, a.pid)
			if m.Stash == nil || m.Unstash == nil || m.Unstash.Bytes != appOwnedBytes || m.Released {
				t.Fatalf("owned memory: %+v, stash %+v, unstash %+v", m, m.Stash, m.Unstash)
			}
			if tt.noCopy {
				if m.Target != nil || m.Stash.Target != nil {
					t.Errorf("--device-copy=false: target %+v, stash's %+v", m.Target, m.Stash.Target)
				}
			} else if m.Target == nil || m.Target.Bytes < appOwnedBytes || m.Stash.Target == nil || !m.Stash.Target.Filled ||
				m.Stash.Target.Bytes != appOwnedBytes {
				t.Fatalf("no device copy: target %+v (note %q), stash's %+v", m.Target, m.TargetNote, m.Stash.Target)
			}
			if m.Unstash.From != tt.wantFrom || (tt.wantFrom == "target") == (m.Unstash.TargetError != "") && tt.failImport {
				t.Errorf("unstash from %q (target error %q), want %q", m.Unstash.From, m.Unstash.TargetError, tt.wantFrom)
			}
			if tt.failImport && !strings.Contains(m.Unstash.TargetError, "import") {
				t.Errorf("unstash: target error %q, want the failed import", m.Unstash.TargetError)
			}
			if tt.wantFrom == "target" && m.Unstash.Pinned {
				t.Errorf("unstash from the target copy pinned the stash: %+v", m.Unstash)
			}
			a.waitSteps(t, 5)
			if st := memStatus(t, a.pid); st.Released || st.Stashed || st.Regions != 3 || st.StashBytes != 0 {
				t.Errorf("shim after the migrate: %+v; want the memory back and the stash freed", st)
			}
		})
	}
}
