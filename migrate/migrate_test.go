package migrate

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/cudackpt/cudackpttest"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/placement"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimctl/shimctltest"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/internal/testreq"
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
		{"unlock fails once: moved back", swap, "unlock", u0, []string{"lock", "checkpoint", "restore-to-" + u1, "unlock", "checkpoint", "restore-to-" + u0, "unlock"}, true},
		{"partial pairs: driver refuses, rolled back", partial, "", u0, []string{"lock", "checkpoint", "restore-to-" + u1, "restore", "unlock"}, true},
	}
	// Each case runs on a pretend pid, and on a real process with a thread that touches a mapping
	// the fake driver takes away at the checkpoint and gives back at the restore (as the driver
	// does with device mappings): it survives every case only if no thread but the driver's runs
	// in between (package hold), moves back included.
	bin, berr := testproc.Build(t.TempDir())
	for _, tt := range tests {
		for _, real := range []bool{false, true} {
			name := tt.name
			if real {
				name += "/real process"
			}
			t.Run(name, func(t *testing.T) {
				pid, d := 42, cudackpttest.New(u0, []string{u0, u1}, 42)
				var p *testproc.Proc
				if real {
					p = uvmProc(t, bin, berr)
					pid, d = p.PID, cudackpttest.New(u0, []string{u0, u1}, p.PID)
					d.Procs[pid].UVM = p.UVM
				}
				migrateCase(t, d, pid, p, tt.pairs, tt.fail, tt.wantGPU, tt.wantCalls, tt.wantErr, oom)
			})
		}
	}
}

// uvmProc starts a test process whose second thread reads a file mapping all the time.
func uvmProc(t *testing.T, bin string, berr error) *testproc.Proc {
	t.Helper()
	if berr != nil {
		testreq.Skip(t, "cc", "cannot build the test program: %v", berr)
	}
	p, err := testproc.StartUVM(bin, t.TempDir(), testproc.Options{IntervalMs: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Kill() })
	return p
}

func migrateCase(t *testing.T, d *cudackpttest.Driver, pid int, p *testproc.Proc, pairs []cudackpt.Pair, fail, wantGPU string, wantCalls []string, wantErr bool, oom error) {
	t.Helper()
	if fail != "" {
		d.FailNext[fail] = oom
	}
	_, err := op.Execute(context.Background(), Steps(d, []int{pid}, pairs, time.Second, nil), nil, 0, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if (err != nil) != wantErr {
		t.Fatalf("err = %v", err)
	}
	if g := d.Get(pid); g.State != cudackpt.Running || g.GPU != wantGPU {
		t.Errorf("process ends %v on %s, want running on %s", g.State, g.GPU, wantGPU)
	}
	if p != nil {
		s0, _ := testproc.ReadState(p.StateFile)
		time.Sleep(200 * time.Millisecond)
		s1, err := testproc.ReadState(p.StateFile)
		if err != nil || s1.Step <= s0.Step || !testproc.Alive(p.PID) {
			t.Fatalf("the process does not run on (alive %v, step %d -> %d, %v)", testproc.Alive(p.PID), s0.Step, s1.Step, err)
		}
	}
	if !reflect.DeepEqual(d.Calls, wantCalls) {
		t.Errorf("calls %q\nwant  %q", d.Calls, wantCalls)
	}
	var se *op.StepError
	if err != nil && errors.As(err, &se) && se.Touched && !se.RolledBack() {
		t.Errorf("rollback incomplete: %v", err)
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
	if _, err := op.Execute(context.Background(), Steps(d, []int{42}, dp, time.Second, nil), nil, 0, slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
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
	_, err := op.Execute(context.Background(), Steps(d, []int{42}, swap, time.Second, recheck), nil, 0, slog.New(slog.NewTextHandler(io.Discard, nil)))
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

// TestMigrateJobRollback: a job's two ranks (one per GPU) swap GPUs. Whatever driver call fails,
// for whichever rank (an unlock after the move too: the ranks are moved back), both ranks end
// running: on the swapped GPUs if the move completed, else both on their own.
func TestMigrateJobRollback(t *testing.T) {
	src, dst := mustUUID(t, u0), mustUUID(t, u1)
	swap := []cudackpt.Pair{{Old: src, New: dst}, {Old: dst, New: src}}
	oom := errors.New("CUDA_ERROR_OUT_OF_MEMORY")
	home := map[int]string{42: u0, 43: u1}
	moved := map[int]string{42: u1, 43: u0}
	fails := []string{""}
	for _, call := range []string{"lock", "checkpoint", "restore-to-" + u1, "unlock"} {
		for _, pid := range []int{42, 43} {
			fails = append(fails, fmt.Sprintf("%s %d", call, pid))
		}
	}
	for _, fail := range fails {
		t.Run("fail "+fail, func(t *testing.T) {
			d := cudackpttest.New(u0, []string{u0, u1}, 42, 43)
			d.Procs[43].GPU = u1
			if fail != "" {
				d.FailNext[fail] = oom
			}
			_, err := op.Execute(context.Background(), Steps(d, []int{42, 43}, swap, time.Second, nil), nil, 0, slog.New(slog.NewTextHandler(io.Discard, nil)))
			var se *op.StepError
			if err != nil && (!errors.As(err, &se) || se.Touched && !se.RolledBack()) {
				t.Fatalf("rollback incomplete: %v", err)
			}
			want := home
			if err == nil {
				want = moved
			}
			for pid, gpu := range want {
				if g := d.Get(pid); g.State != cudackpt.Running || g.GPU != gpu {
					t.Errorf("pid %d ends %v on %s, want running on %s (calls %q)", pid, g.State, g.GPU, gpu, d.PIDCalls)
				}
			}
		})
	}
}

// jobLister is an NVML inventory of two H200s on which ranks[i] holds 3 GiB of GPU i, and each
// GPU has 1 GiB free (others hold the rest): a swap fits only with the memory the ranks give back.
type jobLister struct{ ranks []int }

func (l jobLister) Devices() ([]gpu.Device, error) {
	devs := []gpu.Device{dev(0, u0), dev(1, u1)}
	for i, pid := range l.ranks {
		devs[i].Processes = []gpu.Process{{PID: pid, UsedMemory: 3 << 30}}
		devs[i].MemoryUsed = devs[i].MemoryTotal - 1<<30
	}
	return devs, nil
}

// TestMigrateJob plans and runs the migrate of a job (a real process tree: a launcher and two
// ranks, the ranks' GPU state in the fake driver, one per GPU) with its ranks' GPUs swapped: the
// plan names both ranks and aligns them first, and the swap fits on nearly full GPUs; both ranks
// end on the other GPU. When the second
// rank's driver restore onto its target fails, both end running on their own GPUs.
func TestMigrateJob(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("PTXMIG_LOCK_DIR", filepath.Join(dir, "locks"))
	t.Setenv("PTXMIG_JOURNAL_DIR", filepath.Join(dir, "journal"))
	t.Setenv("PTXMIG_LOG_DIR", filepath.Join(dir, "logs"))
	cmd := exec.Command("sh", "-c", "sleep 60 & sleep 60 & wait")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); _ = cmd.Wait() })
	root := cmd.Process.Pid
	tree, err := testproc.WaitTree(root, 3, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	ranks := proc.PIDs(tree)[1:]
	for _, tt := range []struct {
		name, fail string
		want       [2]string
	}{
		{"swapped", "", [2]string{u1, u0}},
		{"second rank's restore fails: both back", fmt.Sprintf("restore-to-%s %d", u1, ranks[1]), [2]string{u0, u1}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			d := cudackpttest.New(u0, []string{u0, u1}, ranks...)
			d.Procs[ranks[1]].GPU = u1
			if tt.fail != "" {
				d.FailNext[tt.fail] = errors.New("CUDA_ERROR_OUT_OF_MEMORY")
			}
			env := &op.Env{Driver: d, GPUs: jobLister{ranks}, Euid: 0, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
				UsesCUDA:      func(pid int) (bool, error) { return slices.Contains(ranks, pid), nil },
				DriverVersion: func() (string, error) { return "580.159.04", nil }}
			p, err := PlanMigrate(context.Background(), env, Options{PID: root, GPUMap: map[string]string{"0": "1", "1": "0"}, LockTimeout: time.Second})
			if err != nil {
				t.Fatalf("plan: %v", err)
			}
			if !slices.Equal(p.PIDs, ranks) || p.Steps[1].Step != shimstep.StepAlign || len(p.Source) != 2 {
				t.Fatalf("plan: pids %v (want %v), steps %v, source %v", p.PIDs, ranks, p.Steps, p.Source)
			}
			_, err = Execute(context.Background(), env, p)
			if (err != nil) != (tt.fail != "") {
				t.Fatalf("execute: %v", err)
			}
			for i, pid := range ranks {
				if g := d.Get(pid); g.State != cudackpt.Running || g.GPU != tt.want[i] {
					t.Errorf("rank %d (pid %d) ends %v on %s, want running on %s (calls %q)", i, pid, g.State, g.GPU, tt.want[i], d.PIDCalls)
				}
			}
		})
	}
}

// peerLister: GPUs 0 and 1, one process on both, and whether they have a peer path.
type peerLister struct {
	pid  int
	path bool
}

func (l peerLister) Devices() ([]gpu.Device, error) {
	devs := []gpu.Device{dev(0, u0), dev(1, u1)}
	for i := range devs {
		devs[i].Processes = []gpu.Process{{PID: l.pid, UsedMemory: 1 << 30}}
	}
	return devs, nil
}

func (l peerLister) PeerPath(a, b string) (bool, error) { return l.path, nil }

// TestMigrateRefusesNoPeerPath: a process on two GPUs whose shim reports peer links is refused
// (nothing touched) when its targets have no peer path, naming them and the way out; with a path,
// or without links, the plan goes ahead.
func TestMigrateRefusesNoPeerPath(t *testing.T) {
	// The process is the test itself: a shim's socket must be served by the pid it is named for.
	sock := t.TempDir()
	t.Setenv("PTXMIG_SOCKET_DIR", sock)
	pid := os.Getpid()
	for _, tt := range []struct {
		name  string
		links int
		path  bool
		want  string // "" : planned
	}{
		{"peer links, no peer path", 2, false, "its targets GPU 1 and GPU 0 have no peer path"},
		{"peer links, a peer path", 2, true, ""},
		{"no peer links, no peer path", 0, false, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(sock, fmt.Sprintf("%d.sock", pid))
			_ = os.Remove(path)
			shimctltest.Serve(t, path, map[string]string{"status": fmt.Sprintf(`{"ok":true,"proto":2,"cmd":"status","result":`+
				`{"pid":%d,"proto":2,"peer_access":%d,"peer_toggle":true,"ipc":{"exported":0,"imported":0}}}`+"\n", pid, tt.links)})
			d := cudackpttest.New(u0, []string{u0, u1}, pid)
			env := &op.Env{Driver: d, GPUs: peerLister{pid, tt.path}, Euid: 0, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
				UsesCUDA:      func(q int) (bool, error) { return q == pid, nil },
				DriverVersion: func() (string, error) { return "580.159.04", nil }}
			_, err := PlanMigrate(context.Background(), env, Options{PID: pid, GPUMap: map[string]string{"0": "1", "1": "0"}, LockTimeout: time.Second})
			if tt.want == "" {
				if err != nil {
					t.Fatalf("plan: %v", err)
				}
				return
			}
			if !errors.Is(err, op.ErrRefused) || !strings.Contains(err.Error(), tt.want) || !strings.Contains(err.Error(), "--no-peer-access") ||
				!strings.Contains(err.Error(), "nothing was touched") {
				t.Fatalf("plan: %v, want a refusal with %q", err, tt.want)
			}
			if len(d.PIDCalls) != 0 {
				t.Fatalf("the refusal touched the driver: %q", d.PIDCalls)
			}
		})
	}
}
