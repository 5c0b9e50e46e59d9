//go:build gpu

// Package gputest runs ptxmig's checkpoint, restore and migrate on real GPUs with real workloads
// (make gpu-test; scripts/gpu-e2e.sh runs this binary). It needs root, two identical NVIDIA GPUs,
// and the environment gpu-e2e.sh sets: PTXMIG_BIN, PTXMIG_WORKLOADS, PTXMIG_CRIU, PTXMIG_OUT.
// Every case compares the workload's output with an uninterrupted run: exact continuity.
package gputest

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/placement"
	procfs "github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/migrate"
	"github.com/ptxmig/ptxmig/restore"
)

var bin, workloads, out string

func TestMain(m *testing.M) {
	bin, workloads, out = os.Getenv("PTXMIG_BIN"), os.Getenv("PTXMIG_WORKLOADS"), os.Getenv("PTXMIG_OUT")
	if out == "" {
		out = os.TempDir()
	}
	_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) // restored workloads become ours to reap
	os.Exit(m.Run())
}

func need(t *testing.T, gpus int) []gpu.Device {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("GPU checkpoint tests need root")
	}
	if bin == "" || workloads == "" {
		t.Skip("PTXMIG_BIN and PTXMIG_WORKLOADS not set (run through gpu-e2e.sh)")
	}
	inv, err := gpu.Open()
	if err != nil {
		t.Skipf("no NVIDIA driver: %v", err)
	}
	defer inv.Close()
	devs, err := inv.Devices()
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) < gpus {
		t.Skipf("needs %d GPUs, this host has %d", gpus, len(devs))
	}
	if gpus > 1 && (devs[0].Name != devs[1].Name) {
		t.Skipf("needs two identical GPUs, has %s and %s", devs[0].Name, devs[1].Name)
	}
	return devs
}

// proc is a workload started in its own session, stdout appended to a log file.
type proc struct {
	pid  int
	log  string
	done chan struct{}
}

func start(t *testing.T, name string, args ...string) *proc {
	t.Helper()
	return startEnv(t, nil, name, args...)
}

// startEnv is start with extra environment variables (KEY=VALUE).
func startEnv(t *testing.T, env []string, name string, args ...string) *proc {
	t.Helper()
	dir := filepath.Join(out, "gputest", t.Name())
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(dir, fmt.Sprintf("%s-%d.log", filepath.Base(name), time.Now().UnixNano()))
	f, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var cmd *exec.Cmd
	if strings.HasSuffix(name, ".py") {
		cmd = exec.Command("python3", append([]string{filepath.Join(workloads, name)}, args...)...)
	} else if filepath.IsAbs(name) {
		cmd = exec.Command(name, args...)
	} else {
		cmd = exec.Command(filepath.Join(workloads, name), args...)
	}
	cmd.Stdout, cmd.Stderr = f, f
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{pid: cmd.Process.Pid, log: logPath, done: make(chan struct{})}
	// Never wait on it while it lives: in-process operations (rollbackOnPurpose) hold its threads
	// with ptrace, and a wait would take a thread's ptrace-stop for the end of the process.
	go func() { _ = procfs.WaitDead(cmd); close(p.done) }()
	t.Cleanup(func() { _ = syscall.Kill(p.pid, syscall.SIGKILL) })
	return p
}

// waitExit waits for a process that may not be our child any more (a restored one) to exit.
func waitExit(t *testing.T, pid int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for procfs.Alive(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("pid %d still running after %s", pid, timeout)
		}
		var ws syscall.WaitStatus
		_, _ = syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		time.Sleep(50 * time.Millisecond)
	}
}

func lines(path string) []string {
	b, _ := os.ReadFile(path)
	var out []string
	sc := bufio.NewScanner(strings.NewReader(string(b)))
	for sc.Scan() {
		out = append(out, sc.Text())
	}
	return out
}

// waitLine waits for a line starting with prefix and returns it.
func waitLine(t *testing.T, path, prefix string, timeout time.Duration) string {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		for _, l := range lines(path) {
			if strings.HasPrefix(l, prefix) {
				return l
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no line %q in %s after %s; log:\n%s", prefix, path, timeout, strings.Join(lines(path), "\n"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// results strips lines that legitimately differ between runs (pid, device banner).
func results(path string) []string {
	var out []string
	for _, l := range lines(path) {
		if strings.HasPrefix(l, "step ") || strings.HasPrefix(l, "final ") || strings.HasPrefix(l, "frozen ") || strings.HasPrefix(l, "result ") {
			out = append(out, l)
		}
	}
	return out
}

// ptxmig runs the CLI with a per-test store; it returns stdout, stderr and the exit status.
func ptxmig(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	so, se, code, _ := ptxmigWithin(t, 0, args...)
	return so, se, code
}

// ptxmigWithin is ptxmig with a deadline (0: none): past it the command is killed (SIGKILL) and
// timedOut is true.
func ptxmigWithin(t *testing.T, d time.Duration, args ...string) (so, se string, code int, timedOut bool) {
	t.Helper()
	ctx, cancel := context.Background(), context.CancelFunc(func() {})
	if d > 0 {
		ctx, cancel = context.WithTimeout(ctx, d)
	}
	defer cancel()
	store := filepath.Join(out, "gputest", "store")
	cmd := exec.CommandContext(ctx, bin, append([]string{"--store", store}, args...)...)
	var sob, seb strings.Builder
	cmd.Stdout, cmd.Stderr = &sob, &seb
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	t.Logf("ptxmig %s -> %d\n%s%s", strings.Join(args, " "), code, sob.String(), seb.String())
	return sob.String(), seb.String(), code, ctx.Err() != nil
}

// logPairs records the GPU pairs an operation used, in the test log and in
// $PTXMIG_OUT/gputest/pairs.log (the driver-580 pairing rule is what these runs confirm).
func logPairs(t *testing.T, what string, pairs []placement.Pair) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s: %d GPU pairs\n", t.Name(), what, len(pairs))
	for _, p := range pairs {
		fmt.Fprintf(&b, "  %s\n", p)
	}
	t.Log(b.String())
	dir := filepath.Join(out, "gputest")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(filepath.Join(dir, "pairs.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	_, _ = f.WriteString(b.String())
}

// visibleHere is how many GPUs a workload started by these tests sees (they inherit this
// process's environment), plus extra variables.
func visibleHere(t *testing.T, devs []gpu.Device, extra ...string) int {
	t.Helper()
	env := gpu.ParseEnviron([]byte(strings.Join(append(os.Environ(), extra...), "\x00")))
	vis, err := gpu.VisibleDevices(env, devs)
	if err != nil {
		t.Fatal(err)
	}
	return len(vis)
}

// usedBy returns the GPUs NVML shows pid on, in index order, with the memory it holds on each.
func usedBy(t *testing.T, pid int) []gpu.Usage {
	t.Helper()
	inv, err := gpu.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer inv.Close()
	devs, err := inv.Devices()
	if err != nil {
		t.Fatal(err)
	}
	return gpu.UsedBy(devs, pid)
}

// gpuOf returns the GPU index NVML shows pid on (-1: none).
func gpuOf(t *testing.T, pid int) int {
	t.Helper()
	u := usedBy(t, pid)
	if len(u) == 0 {
		return -1
	}
	return u[0].Device.Index
}

func reference(t *testing.T, name string, args ...string) []string {
	t.Helper()
	p := start(t, name, args...)
	select {
	case <-p.done:
	case <-time.After(4 * time.Minute):
		t.Fatalf("reference run of %s did not finish", name)
	}
	r := results(p.log)
	if len(r) == 0 {
		t.Fatalf("reference run of %s printed nothing: %s", name, strings.Join(lines(p.log), "\n"))
	}
	return r
}

// referenceAsync runs reference in the background. The test waits for it before it ends, so a
// failure of the reference run is reported on the test, never after it has completed (the
// workload cleanups registered later run first and end the reference's process).
func referenceAsync(t *testing.T, name string, args ...string) <-chan []string {
	t.Helper()
	ref := make(chan []string, 1)
	done := make(chan struct{})
	t.Cleanup(func() { <-done })
	go func() {
		defer close(done)
		ref <- reference(t, name, args...)
	}()
	return ref
}

// reap waits until pid, ended and left to this process (the subreaper: a restored process that a
// rollback ended, an orphaned child), is reaped, so that its pid is free for a restore.
func reap(t *testing.T, pid int, timeout time.Duration) {
	t.Helper()
	waitExit(t, pid, timeout)
	for deadline := time.Now().Add(timeout); procfs.Exists(pid) && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		var ws syscall.WaitStatus
		_, _ = syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
	}
}

func sameResults(t *testing.T, got, want []string) {
	t.Helper()
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("output differs from the uninterrupted run:\n--- got\n%s\n--- want\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func counterArgs(steps int, device int) []string {
	return []string{"--mib", "256", "--steps", strconv.Itoa(steps), "--interval-ms", "100", "--device", strconv.Itoa(device)}
}

// (a) counter checkpointed on GPU 0, restored with --gpu 1: same final checksum, shows on GPU 1.
func TestCheckpointRestoreOtherGPU(t *testing.T) {
	devs := need(t, 2)
	ref := referenceAsync(t, "counter", "--mib", "256", "--steps", "60", "--interval-ms", "0", "--device", "1")
	p := start(t, "counter", counterArgs(60, 0)...)
	waitLine(t, p.log, "step 10 ", 60*time.Second)
	so, _, code := ptxmig(t, "--json", "checkpoint", "--name", "gpu-a", strconv.Itoa(p.pid))
	if code != 0 {
		t.Fatalf("checkpoint exit %d", code)
	}
	var cr checkpoint.Result
	if err := json.Unmarshal([]byte(so), &cr); err != nil || cr.Kind != "cuda" || len(cr.GPUs) != 1 || cr.GPUs[0].Index != 0 {
		t.Fatalf("checkpoint result %+v (%v)", cr, err)
	}
	if n := visibleHere(t, devs); len(cr.Visible) != n {
		t.Fatalf("checkpoint recorded %d visible GPUs (%+v), want %d", len(cr.Visible), cr.Visible, n)
	}
	<-p.done
	so, _, code = ptxmig(t, "--json", "restore", "--gpu", "1", "gpu-a")
	if code != 0 {
		t.Fatalf("restore exit %d", code)
	}
	var rr restore.Result
	if err := json.Unmarshal([]byte(so), &rr); err != nil || !rr.Remapped || len(rr.Pairs) != len(cr.Visible) {
		t.Fatalf("restore result %+v (%v), want %d pairs given to the driver", rr, err, len(cr.Visible))
	}
	logPairs(t, "restore --gpu 1", rr.Pairs)
	if g := gpuOf(t, p.pid); g != 1 {
		t.Fatalf("restored pid %d is on GPU %d in NVML, want 1", p.pid, g)
	}
	waitExit(t, p.pid, 2*time.Minute)
	sameResults(t, results(p.log), <-ref)
}

// TestTreeWithCUDAChild: a shell whose child is the CUDA counter (as with a wrapper script,
// torchrun or a DataLoader parent) is checkpointed as a tree — the driver steps act on the child,
// CRIU saves both, and both end — then restored: the counter finishes with the checksum of an
// uninterrupted run and no process is left stopped.
func TestTreeWithCUDAChild(t *testing.T) {
	need(t, 1)
	ref := referenceAsync(t, "counter", "--mib", "256", "--steps", "60", "--interval-ms", "0", "--device", "0")
	counter := filepath.Join(workloads, "counter")
	// The trailing command keeps bash from exec'ing the counter: the counter is bash's child.
	p := startEnv(t, nil, "/bin/bash", "-c", counter+" "+strings.Join(counterArgs(60, 0), " ")+"; echo shell-done")
	waitLine(t, p.log, "step 10 ", 60*time.Second)
	so, _, code := ptxmig(t, "--json", "checkpoint", "--name", "gpu-tree", strconv.Itoa(p.pid))
	if code != 0 {
		t.Fatalf("checkpoint exit %d", code)
	}
	var cr checkpoint.Result
	if err := json.Unmarshal([]byte(so), &cr); err != nil || cr.Kind != "cuda" || len(cr.Tree) != 2 || cr.Tree[0].CUDA || !cr.Tree[1].CUDA {
		t.Fatalf("checkpoint result %+v (%v), want a tree of the shell and its CUDA child", cr, err)
	}
	<-p.done
	child := cr.Tree[1].PID
	if procfs.Alive(child) {
		t.Fatalf("the CUDA child %d still runs after the checkpoint", child)
	}
	// The test is the subreaper of the orphaned child (TestMain): reap it so its pid is free.
	reap(t, child, 10*time.Second)
	so, _, code = ptxmig(t, "--json", "restore", "gpu-tree")
	if code != 0 {
		t.Fatalf("restore exit %d", code)
	}
	var rr restore.Result
	if err := json.Unmarshal([]byte(so), &rr); err != nil || len(rr.Tree) != 2 {
		t.Fatalf("restore result %+v (%v)", rr, err)
	}
	for _, tp := range rr.Tree {
		if s, err := procfs.ReadStat(tp.PID); err == nil && s.Stopped() {
			t.Errorf("pid %d (%s) is stopped after the restore", tp.PID, tp.Comm)
		}
	}
	waitExit(t, child, 2*time.Minute)
	waitExit(t, p.pid, 30*time.Second)
	got := results(p.log)
	sameResults(t, got, <-ref)
}

// (b) migrate 0 → 1 → 0 in place with exact continuity.
func TestMigrateThereAndBack(t *testing.T) {
	devs := need(t, 2)
	ref := referenceAsync(t, "counter", "--mib", "256", "--steps", "80", "--interval-ms", "0", "--device", "1")
	p := start(t, "counter", counterArgs(80, 0)...)
	waitLine(t, p.log, "step 10 ", 60*time.Second)
	for _, to := range []int{1, 0} {
		so, _, code := ptxmig(t, "--json", "migrate", "--gpu", strconv.Itoa(to), strconv.Itoa(p.pid))
		if code != 0 {
			t.Fatalf("migrate to %d: exit %d", to, code)
		}
		var mr migrate.Result
		if err := json.Unmarshal([]byte(so), &mr); err != nil || mr.Downtime <= 0 || mr.Target[0].Index != to {
			t.Fatalf("migrate result %+v (%v)", mr, err)
		}
		logPairs(t, fmt.Sprintf("migrate --gpu %d", to), mr.Pairs)
		if n := visibleHere(t, devs); len(mr.Pairs) != n {
			t.Fatalf("migrate used %d GPU pairs, want one per visible GPU (%d)", len(mr.Pairs), n)
		}
		if g := gpuOf(t, p.pid); g != to {
			t.Fatalf("after migrate pid %d is on GPU %d, want %d", p.pid, g, to)
		}
		time.Sleep(1 * time.Second)
	}
	<-p.done
	sameResults(t, results(p.log), <-ref)
}

// (c) train.py migrated mid-run, and separately checkpointed and restored mid-run: every logged
// loss equals an uninterrupted run's.
func TestTrainingContinuity(t *testing.T) {
	need(t, 2)
	args := []string{"--steps", "300", "--log-every", "10", "--sleep-ms", "20"}
	ref := reference(t, "train.py", args...)
	t.Run("migrate", func(t *testing.T) {
		p := start(t, "train.py", args...)
		waitLine(t, p.log, "step 50 ", 3*time.Minute)
		if _, _, code := ptxmig(t, "migrate", "--gpu", "1", strconv.Itoa(p.pid)); code != 0 {
			t.Fatalf("migrate exit %d", code)
		}
		<-p.done
		sameResults(t, results(p.log), ref)
	})
	t.Run("checkpoint-restore", func(t *testing.T) {
		p := start(t, "train.py", args...)
		waitLine(t, p.log, "step 50 ", 3*time.Minute)
		if _, _, code := ptxmig(t, "checkpoint", "--name", "train-c", strconv.Itoa(p.pid)); code != 0 {
			t.Fatalf("checkpoint exit %d", code)
		}
		<-p.done
		if _, _, code := ptxmig(t, "restore", "--gpu", "1", "train-c"); code != 0 {
			t.Fatalf("restore exit %d", code)
		}
		waitExit(t, p.pid, 3*time.Minute)
		sameResults(t, results(p.log), ref)
	})
}

// fill starts a counter on GPU dev that leaves about leaveMiB free, and waits until it holds it.
func fill(t *testing.T, dev, leaveMiB int) *proc {
	t.Helper()
	inv, err := gpu.Open()
	if err != nil {
		t.Fatal(err)
	}
	devs, err := inv.Devices()
	inv.Close()
	if err != nil {
		t.Fatal(err)
	}
	freeMiB := int(devs[dev].MemoryFree() >> 20)
	mib := freeMiB - leaveMiB - 600 // the filler's own context and scratch take ~600 MiB
	if mib < 64 {
		t.Skipf("GPU %d has only %d MiB free", dev, freeMiB)
	}
	f := start(t, "counter", "--mib", strconv.Itoa(mib), "--steps", "100000", "--interval-ms", "100000", "--device", strconv.Itoa(dev))
	waitLine(t, f.log, "step 1 ", 2*time.Minute)
	return f
}

// (d1) restore onto a GPU without enough free memory is refused by preflight (3) and the image
// stays intact: it restores onto GPU 0 afterwards and finishes exactly.
func TestRestoreRefusedWithoutMemory(t *testing.T) {
	need(t, 2)
	ref := referenceAsync(t, "counter", "--mib", "1024", "--steps", "40", "--interval-ms", "0", "--device", "0")
	p := start(t, "counter", "--mib", "1024", "--steps", "40", "--interval-ms", "100")
	waitLine(t, p.log, "step 5 ", 60*time.Second)
	if _, _, code := ptxmig(t, "checkpoint", "--name", "gpu-d", strconv.Itoa(p.pid)); code != 0 {
		t.Fatalf("checkpoint exit %d", code)
	}
	<-p.done
	filler := fill(t, 1, 256)
	_, se, code := ptxmig(t, "restore", "--gpu", "1", "gpu-d")
	if code != 3 || !strings.Contains(se, "free") {
		t.Fatalf("restore onto a full GPU: exit %d (%s), want 3 naming the free memory", code, se)
	}
	if procfs.Alive(p.pid) {
		t.Fatal("a refused restore started the process")
	}
	_ = syscall.Kill(filler.pid, syscall.SIGKILL)
	if _, _, code := ptxmig(t, "restore", "--gpu", "0", "gpu-d"); code != 0 {
		t.Fatalf("restore after the refusal: exit %d", code)
	}
	waitExit(t, p.pid, 2*time.Minute)
	sameResults(t, results(p.log), <-ref)
}

// (d2) migrate into a GPU that fails mid-restore (filled between preflight and the restore):
// the process comes back on its source GPU, running, and finishes exactly.
func TestMigrateTargetFailsMidRestore(t *testing.T) {
	need(t, 2)
	ref := referenceAsync(t, "counter", "--mib", "1024", "--steps", "60", "--interval-ms", "0", "--device", "0")
	p := start(t, "counter", "--mib", "1024", "--steps", "60", "--interval-ms", "100")
	waitLine(t, p.log, "step 5 ", 60*time.Second)
	d, err := cudackpt.Open()
	if err != nil {
		t.Fatal(err)
	}
	inv, err := gpu.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer inv.Close()
	var filler *proc
	env := &op.Env{Driver: d, GPUs: inv, Euid: 0, Log: slog.New(slog.NewTextHandler(os.Stderr, nil)),
		Hook: func(_ context.Context, step string) error {
			if step == migrate.StepRestore {
				filler = fill(t, 1, 128) // the target now lacks room for the 1 GiB buffer
			}
			return nil
		}}
	mr, err := migrate.Run(context.Background(), env, migrate.Options{PID: p.pid, GPUs: []int{1}, LockTimeout: 10 * time.Second})
	if mr != nil {
		logPairs(t, "migrate into a full GPU", mr.Pairs)
	}
	if filler != nil {
		_ = syscall.Kill(filler.pid, syscall.SIGKILL)
	}
	var se *op.StepError
	if err == nil {
		t.Fatal("migrate into a full GPU succeeded; the test could not make the target fail")
	}
	t.Logf("migrate failed as intended: %v", err)
	if !asStep(err, &se) || se.Step != migrate.StepRestore || !se.RolledBack() {
		t.Fatalf("err = %v, want a rolled-back failure of the restore step", err)
	}
	st, err := d.State(p.pid)
	if err != nil || st != cudackpt.Running {
		t.Fatalf("after rollback pid %d is %v (%v), want running", p.pid, st, err)
	}
	if g := gpuOf(t, p.pid); g != 0 {
		t.Fatalf("after rollback pid %d is on GPU %d, want its source GPU 0", p.pid, g)
	}
	<-p.done
	sameResults(t, results(p.log), <-ref)
}

func asStep(err error, se **op.StepError) bool {
	for e := err; e != nil; {
		if s, ok := e.(*op.StepError); ok {
			*se = s
			return true
		}
		u, ok := e.(interface{ Unwrap() error })
		if !ok {
			return false
		}
		e = u.Unwrap()
	}
	return false
}

// (e) a 30 s kernel with --lock-timeout 2s: the checkpoint fails cleanly (exit 4: the lock timed
// out, the quiesce is undone, nothing else was touched) and the process finishes with the right
// result.
func TestLockTimeoutLeavesProcessRunning(t *testing.T) {
	need(t, 2)
	p := start(t, "longkernel", "--seconds", "30", "--device", "0")
	iters := strings.Fields(waitLine(t, p.log, "iters ", 60*time.Second))[1]
	ref := referenceAsync(t, "longkernel", "--iters", iters, "--device", "1")
	time.Sleep(2 * time.Second) // the kernel is running now
	t0 := time.Now()
	_, se, code := ptxmig(t, "checkpoint", "--lock-timeout", "2s", strconv.Itoa(p.pid))
	if code != 4 || !strings.Contains(se, "lock") {
		t.Fatalf("checkpoint during a 30 s kernel: exit %d (%s), want 4 (lock timed out, rolled back)", code, se)
	}
	if d := time.Since(t0); d > 20*time.Second {
		t.Errorf("the failed checkpoint took %s; the lock timeout was 2 s", d)
	}
	if !procfs.Alive(p.pid) {
		t.Fatal("the process died")
	}
	<-p.done
	got := results(p.log)
	want := <-ref
	if len(got) == 0 || got[len(got)-1] != want[len(want)-1] {
		t.Fatalf("result %v, want %v", got, want)
	}
}

// (f) processes that see only GPU 0 (CUDA_VISIBLE_DEVICES by UUID prefix, and by index) are moved
// to GPU 1, which they cannot see. Driver 580 pairs over every GPU of the host whatever
// CUDA_VISIBLE_DEVICES says: {0→1} alone is refused, {0→1, 1→0} works (measured), so the image
// records both GPUs and the move passes two pairs.
func TestVisibleSubsetMovesOutside(t *testing.T) {
	devs := need(t, 2)
	ref := reference(t, "counter", "--mib", "256", "--steps", "60", "--interval-ms", "0", "--device", "1")
	prefix := devs[0].UUID
	if len(prefix) > 12 {
		prefix = prefix[:12] // "GPU-" and 8 hex digits
	}
	t.Run("migrate, UUID prefix", func(t *testing.T) {
		p := startEnv(t, []string{"CUDA_VISIBLE_DEVICES=" + prefix}, "counter", counterArgs(60, 0)...)
		waitLine(t, p.log, "step 10 ", 60*time.Second)
		if g := gpuOf(t, p.pid); g != 0 {
			t.Fatalf("pid %d started on GPU %d, want 0", p.pid, g)
		}
		so, _, code := ptxmig(t, "--json", "migrate", "--gpu", "1", strconv.Itoa(p.pid))
		if code != 0 {
			t.Fatalf("migrate exit %d", code)
		}
		var mr migrate.Result
		if err := json.Unmarshal([]byte(so), &mr); err != nil || len(mr.Pairs) != 2 || mr.Pairs[0].To.Index != 1 {
			t.Fatalf("migrate result %+v (%v), want the single pair GPU 0 -> GPU 1", mr, err)
		}
		logPairs(t, "migrate --gpu 1", mr.Pairs)
		if g := gpuOf(t, p.pid); g != 1 {
			t.Fatalf("after migrate pid %d is on GPU %d, want 1", p.pid, g)
		}
		<-p.done
		sameResults(t, results(p.log), ref)
	})
	t.Run("checkpoint-restore, index", func(t *testing.T) {
		p := startEnv(t, []string{"CUDA_VISIBLE_DEVICES=0", "CUDA_DEVICE_ORDER=PCI_BUS_ID"}, "counter", counterArgs(60, 0)...)
		waitLine(t, p.log, "step 10 ", 60*time.Second)
		so, _, code := ptxmig(t, "--json", "checkpoint", "--name", "gpu-f", strconv.Itoa(p.pid))
		if code != 0 {
			t.Fatalf("checkpoint exit %d", code)
		}
		var cr checkpoint.Result
		if err := json.Unmarshal([]byte(so), &cr); err != nil || len(cr.Visible) != 2 || cr.Visible[0].Index != 0 {
			t.Fatalf("checkpoint result %+v (%v), want GPU 0 as the only visible GPU", cr, err)
		}
		<-p.done
		so, _, code = ptxmig(t, "--json", "restore", "--gpu", "1", "gpu-f")
		if code != 0 {
			t.Fatalf("restore exit %d", code)
		}
		var rr restore.Result
		if err := json.Unmarshal([]byte(so), &rr); err != nil || len(rr.Pairs) != 2 || rr.Pairs[0].To.Index != 1 {
			t.Fatalf("restore result %+v (%v), want the single pair GPU 0 -> GPU 1", rr, err)
		}
		logPairs(t, "restore --gpu 1", rr.Pairs)
		if g := gpuOf(t, p.pid); g != 1 {
			t.Fatalf("restored pid %d is on GPU %d, want 1", p.pid, g)
		}
		waitExit(t, p.pid, 2*time.Minute)
		sameResults(t, results(p.log), ref)
	})
}
