//go:build gpu

package gputest

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/journal"
	procfs "github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/migrate"
)

// NCCL's transports that a driver checkpoint can take: the ranks exchange data through sockets
// (P2P and shared memory map GPU or host memory between the rank processes; cuMem shares
// allocations through file descriptors). NVLink multicast stays off on shared hosts. PyTorch's
// TCPStore server (rank 0) must not use libuv, whose io_uring instance CRIU cannot dump
// (UV_USE_IO_URING=0 did not remove it; USE_LIBUV=0 did: 2x H200, PyTorch 2.11, 2026-11-28).
// `ptxmig run --nccl-sockets` sets the same, and denies io_uring_setup (--no-io-uring), which
// torchrun's agent needs; the reference runs get the variables by hand and keep io_uring.
var ncclSockets = []string{"NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1", "NCCL_CUMEM_ENABLE=0", "NCCL_NVLS_ENABLE=0", "USE_LIBUV=0"}

// job is how a DDP job is started: world ranks (one per GPU), steps training steps, and the
// launcher: mp.spawn from ddp.py's own parent, or torchrun.
type job struct {
	world, steps int
	torchrun     bool
}

// args is the command line (after python3) of the job on rendezvous port port.
func (j job) args(port int) []string {
	ddp := []string{filepath.Join(workloads, "ddp.py"), "--world", strconv.Itoa(j.world), "--steps", strconv.Itoa(j.steps),
		"--log-every", "10", "--sleep-ms", "20", "--port", strconv.Itoa(port)}
	if !j.torchrun {
		return ddp
	}
	// torchrun's rendezvous store ignores USE_LIBUV: its libuv is turned off here (the agent still
	// creates an io_uring instance elsewhere: --nccl-sockets' filter takes care of it).
	return append([]string{"-m", "torch.distributed.run", "--standalone", "--nproc-per-node", strconv.Itoa(j.world),
		"--rdzv-conf", "use_libuv=0", "--master-port", strconv.Itoa(port)}, ddp...)
}

// reference is an uninterrupted run of the job with env, plain (no shim).
func (j job) reference(t *testing.T, env []string, port int) <-chan []string {
	t.Helper()
	ref := make(chan []string, 1)
	done := make(chan struct{})
	t.Cleanup(func() { <-done })
	go func() {
		defer close(done)
		p := startEnv(t, env, "/usr/bin/env", append([]string{"python3"}, j.args(port)...)...)
		select {
		case <-p.done:
		case <-time.After(8 * time.Minute):
			t.Errorf("reference DDP run did not finish")
		}
		ref <- results(p.log)
	}()
	return ref
}

// start starts the job under `ptxmig run` (the shim in the launcher and every rank) with run's
// flags, and waits for its 30th step.
func (j job) start(t *testing.T, env, flags []string, port int) *proc {
	t.Helper()
	shim := os.Getenv("PTXMIG_SHIM")
	if shim == "" {
		t.Skip("PTXMIG_SHIM not set (run through gpu-e2e.sh)")
	}
	runArgs := append(append([]string{"run", "--shim", shim, "--socket-dir", filepath.Join(t.TempDir(), "sock")}, flags...), "--", "python3")
	p := startEnv(t, env, bin, append(runArgs, j.args(port)...)...)
	waitLine(t, p.log, "step 30 ", 4*time.Minute)
	return p
}

// ranks maps each process of the job's tree that holds GPU memory to its GPU index.
func ranks(t *testing.T, root int) map[int]int {
	t.Helper()
	stats, err := procfs.Tree(root)
	if err != nil {
		t.Fatalf("the job's tree: %v", err)
	}
	out := map[int]int{}
	for _, pid := range procfs.PIDs(stats) {
		if g := gpuOf(t, pid); g >= 0 {
			out[pid] = g
		}
	}
	return out
}

// rotation maps GPU i to i+by (mod world): "0=1,1=0" for two GPUs and by 1.
func rotation(world, by int) string {
	parts := make([]string, world)
	for i := range parts {
		parts[i] = fmt.Sprintf("%d=%d", i, ((i+by)%world+world)%world)
	}
	return strings.Join(parts, ",")
}

// progresses fails the test unless the job prints a new result line within d.
func progresses(t *testing.T, p *proc, d time.Duration, after string) {
	t.Helper()
	n := len(results(p.log))
	for deadline := time.Now().Add(d); len(results(p.log)) == n; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the job made no progress in %s after %s", d, after)
		}
	}
}

// running fails the test unless every pid runs (not stopped) and, for the CUDA ones, the driver
// says running.
func running(t *testing.T, pids []int, cuda map[int]int, after string) {
	t.Helper()
	drv, err := cudackpt.Open()
	if err != nil {
		t.Fatal(err)
	}
	for _, pid := range pids {
		if s, err := procfs.ReadStat(pid); err != nil || s.Stopped() {
			t.Fatalf("after %s, pid %d is stopped or gone (%v)", after, pid, err)
		}
		if _, ok := cuda[pid]; ok {
			if st, err := drv.State(pid); err != nil || st != cudackpt.Running {
				t.Fatalf("after %s, rank pid %d is %v (%v), want running", after, pid, st, err)
			}
		}
	}
}

// pct returns the p-th percentile (0..100) of ds (nearest rank).
func pct(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(p/100*float64(len(s))+0.5) - 1
	return s[max(0, min(i, len(s)-1))]
}

// record appends a line to $PTXMIG_OUT/jobs.txt (the numbers of docs/COMPATIBILITY.md).
func record(t *testing.T, format string, a ...any) {
	t.Helper()
	line := fmt.Sprintf("%s %s: %s\n", time.Now().UTC().Format(time.RFC3339), t.Name(), fmt.Sprintf(format, a...))
	t.Log(strings.TrimSpace(line))
	f, err := os.OpenFile(filepath.Join(out, "jobs.txt"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err == nil {
		_, _ = f.WriteString(line)
		_ = f.Close()
	}
}

// TestJobDDP: a PyTorch DDP job over NCCL, one rank per GPU (up to four), under `ptxmig run`.
//   - With NCCL's default transports the ranks map each other's GPU memory, which the driver
//     cannot restore: the checkpoint is refused up front (exit 3) naming the way out, and the
//     job runs on untouched to the losses of an uninterrupted run.
//   - With socket transports (`ptxmig run --nccl-sockets`), started by mp.spawn and by torchrun:
//     ten --leave-running checkpoints of the whole job (TCP connections between the ranks
//     included), a checkpoint that ends it and a restore with the ranks' GPUs rotated, a migrate
//     of the whole job back, a checkpoint and a plain restore; the job finishes with the losses of
//     an uninterrupted run. On a one-GPU host the job has one rank (launcher and rank, the
//     rendezvous store, torchrun's agent: all but the collectives between GPUs), its restore
//     cannot rotate and its migrate is a rehearsal (--rehearse) onto its own GPU.
func TestJobDDP(t *testing.T) {
	devs := need(t, 1)
	world := min(len(devs), 4)
	t.Run("default-transports", func(t *testing.T) {
		if world < 2 {
			t.Skip("one GPU: a single rank maps no other rank's memory, there is nothing to refuse")
		}
		j := job{world: world, steps: 300}
		ref := j.reference(t, []string{"NCCL_NVLS_ENABLE=0"}, 29601)
		p := j.start(t, []string{"NCCL_NVLS_ENABLE=0"}, nil, 29602)
		_, se, code := ptxmig(t, "checkpoint", "--leave-running", "--tcp-established", strconv.Itoa(p.pid))
		if code != 3 || !strings.Contains(se, "--nccl-sockets") {
			t.Fatalf("checkpoint of a job on NCCL's default transports: exit %d, want 3 naming the way out:\n%s", code, se)
		}
		record(t, "%d ranks on NCCL's default transports: refused up front, the job ran on (%s)", world, lastLine(se))
		select {
		case <-p.done:
		case <-time.After(5 * time.Minute):
			t.Fatal("the job did not finish after the refusal")
		}
		sameResults(t, results(p.log), <-ref)
	})
	t.Run("mp.spawn", func(t *testing.T) { jobCycle(t, job{world: world, steps: 6000}, 29603) })
	t.Run("torchrun", func(t *testing.T) {
		// torchrun's agent creates an io_uring instance (which CRIU cannot dump) even with its
		// store's libuv off (PyTorch 2.11, 2026-11-28); under --nccl-sockets io_uring_setup fails
		// with ENOSYS, and the whole job must be checkpointable.
		jobCycle(t, job{world: world, steps: 6000, torchrun: true}, 29605)
	})
}

// jobCycle runs one socket-transport job through every operation (see TestJobDDP).
func jobCycle(t *testing.T, j job, port int) {
	ref := j.reference(t, ncclSockets, port)
	p := j.start(t, []string{"NCCL_NVLS_ENABLE=0"}, []string{"--nccl-sockets"}, port+1) // what the reference gets by hand
	stats, err := procfs.Tree(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	tree := procfs.PIDs(stats)
	home := ranks(t, p.pid)
	if len(home) != j.world {
		t.Fatalf("job tree %v: %d processes on GPUs (%v), want %d ranks", tree, len(home), home, j.world)
	}

	// Ten --leave-running checkpoints while it trains.
	var quiesce, align, took []time.Duration
	for i := 0; i < 10; i++ {
		t0 := time.Now()
		so, se, code := ptxmig(t, "--json", "checkpoint", "--leave-running", "--tcp-established", "--lock-timeout", "10s",
			"--name", fmt.Sprintf("job-live-%d-%d", port, i), strconv.Itoa(p.pid))
		took = append(took, time.Since(t0))
		if code != 0 {
			t.Fatalf("checkpoint --leave-running %d of the job: exit %d, want 0:\n%s", i, code, se)
		}
		var res checkpoint.Result
		if err := json.Unmarshal([]byte(so), &res); err != nil {
			t.Fatalf("checkpoint --json: %v\n%s", err, so)
		}
		for _, r := range res.Preemption {
			if r.Quiesce != nil {
				quiesce = append(quiesce, r.QuiesceDur+r.StopWait)
			}
			if r.Align != nil {
				align = append(align, r.Align.Waited)
			}
		}
		running(t, tree, home, fmt.Sprintf("checkpoint --leave-running %d", i))
		progresses(t, p, 2*time.Minute, fmt.Sprintf("checkpoint --leave-running %d", i))
	}
	record(t, "%d ranks: 10 checkpoints --leave-running ok: wall p50 %s max %s; quiesce per rank p50 %s p99 %s (n=%d); align wait p50 %s p99 %s",
		j.world, pct(took, 50).Round(time.Millisecond), pct(took, 100).Round(time.Millisecond),
		pct(quiesce, 50), pct(quiesce, 99), len(quiesce), pct(align, 50).Round(time.Microsecond), pct(align, 99).Round(time.Microsecond))

	// A checkpoint that ends the job, then a restore with every rank on the next GPU.
	end := func(name string) time.Duration {
		t0 := time.Now()
		_, se, code := ptxmig(t, "checkpoint", "--tcp-established", "--lock-timeout", "10s", "--name", name, strconv.Itoa(p.pid))
		d := time.Since(t0)
		if code != 0 {
			t.Fatalf("checkpoint of the job: exit %d\n%s", code, se)
		}
		for _, pid := range tree {
			reap(t, pid, time.Minute)
		}
		return d
	}
	ckpt := end(fmt.Sprintf("job-%d-a", port))
	t0 := time.Now()
	rargs := []string{"restore", "--gpu-map", rotation(j.world, 1), fmt.Sprintf("job-%d-a", port)}
	margs := []string{"--json", "migrate", "--gpu-map", rotation(j.world, -1), strconv.Itoa(p.pid)}
	if j.world == 1 {
		rargs = []string{"restore", fmt.Sprintf("job-%d-a", port)}
		margs = []string{"--json", "migrate", "--rehearse", strconv.Itoa(p.pid)}
	}
	if so, se, code := ptxmig(t, rargs...); code != 0 {
		t.Fatalf("%v of the job: exit %d\n%s\n%s", rargs[:len(rargs)-1], code, so, se)
	}
	rst := time.Since(t0)
	for pid, g := range home {
		if got := gpuOf(t, pid); got != (g+1)%j.world {
			t.Errorf("restored rank pid %d on GPU %d, want %d (it was on %d)", pid, got, (g+1)%j.world, g)
		}
	}
	running(t, tree, home, "the rotated restore")
	progresses(t, p, 2*time.Minute, "the rotated restore")
	record(t, "%d ranks: checkpoint (ends the job) %s, %s %s",
		j.world, ckpt.Round(time.Millisecond), strings.Join(rargs[:len(rargs)-1], " "), rst.Round(time.Millisecond))

	// Migrate the whole job back.
	so, se, code := ptxmig(t, margs...)
	if code != 0 {
		t.Fatalf("%v of the job: exit %d\n%s", margs[1:len(margs)-1], code, se)
	}
	var mres migrate.Result
	if err := json.Unmarshal([]byte(so), &mres); err != nil {
		t.Fatalf("migrate --json: %v\n%s", err, so)
	}
	for pid, g := range home {
		if got := gpuOf(t, pid); got != g {
			t.Errorf("migrated rank pid %d on GPU %d, want %d", pid, got, g)
		}
	}
	running(t, tree, home, "the migrate")
	progresses(t, p, 2*time.Minute, "the migrate")
	record(t, "%d ranks: migrate of the whole job (%s): downtime %s (lock %s, device->host %s, host->device %s, unlock %s)",
		j.world, strings.Join(margs[2:len(margs)-1], " "), mres.Downtime.Round(time.Millisecond), mres.Lock.Round(time.Millisecond),
		mres.Checkpoint.Round(time.Millisecond), mres.Restore.Round(time.Millisecond), mres.Unlock.Round(time.Millisecond))

	// Checkpoint and a plain restore; then it finishes.
	ckpt = end(fmt.Sprintf("job-%d-b", port))
	t0 = time.Now()
	if so, se, code := ptxmig(t, "restore", fmt.Sprintf("job-%d-b", port)); code != 0 {
		t.Fatalf("restore of the job: exit %d\n%s\n%s", code, so, se)
	}
	record(t, "%d ranks: checkpoint %s, restore %s", j.world, ckpt.Round(time.Millisecond), time.Since(t0).Round(time.Millisecond))
	waitExit(t, p.pid, 8*time.Minute)
	sameResults(t, results(p.log), <-ref)
	record(t, "%d ranks: losses identical to an uninterrupted run (%d lines)", j.world, len(results(p.log)))
}

// TestJobGuardian: ptxmig is killed (SIGKILL) right after each step of a checkpoint
// --leave-running and of a migrate of a whole DDP job over NCCL sockets; the guardian brings
// every rank back (running, unlocked, on its own GPU), the job trains on, and it finishes with
// the losses of an uninterrupted run.
func TestJobGuardian(t *testing.T) {
	devs := need(t, 1) // one GPU: one rank, and the migrate is a rehearsal
	j := job{world: min(len(devs), 4), steps: 8000}
	ref := j.reference(t, ncclSockets, 29611)
	p := j.start(t, []string{"NCCL_NVLS_ENABLE=0"}, []string{"--nccl-sockets"}, 29612)
	stats, err := procfs.Tree(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	tree := procfs.PIDs(stats)
	home := ranks(t, p.pid)
	drv, err := cudackpt.Open()
	if err != nil {
		t.Fatal(err)
	}
	kills := []struct{ verb, step string }{
		{"checkpoint", shimstep.StepAlign}, {"checkpoint", shimstep.StepQuiesce}, {"checkpoint", driverstep.StepLock},
		{"checkpoint", driverstep.StepCheckpoint}, {"checkpoint", "dump"},
		{"migrate", driverstep.StepLock}, {"migrate", driverstep.StepCheckpoint}, {"migrate", driverstep.StepDriverRestore},
	}
	for i, k := range kills {
		dir := filepath.Join(out, "gputest", t.Name(), fmt.Sprintf("%d-%s-%s", i, k.verb, k.step))
		jdir, logs := filepath.Join(dir, "journal"), filepath.Join(dir, "logs")
		args := []string{"--store", filepath.Join(out, "gputest", "store"), k.verb}
		switch {
		case k.verb == "migrate" && j.world == 1:
			args = append(args, "--rehearse")
		case k.verb == "migrate":
			args = append(args, "--gpu-map", rotation(j.world, 1))
		default:
			args = append(args, "--leave-running", "--tcp-established", "--name", fmt.Sprintf("job-guardian-%d", i))
		}
		t0 := killAfterStep(t, append(args, strconv.Itoa(p.pid)), k.step, jdir, logs, nil)
		for {
			js, err := journal.List(jdir)
			ok := err == nil && len(js) == 0
			for pid := range home {
				if st, err := drv.State(pid); err != nil || st != cudackpt.Running {
					ok = false
				}
			}
			if ok {
				break
			}
			if time.Since(t0) > 90*time.Second {
				t.Fatalf("90 s after killing ptxmig %s after %s: journals %v (%v)", k.verb, k.step, js, err)
			}
			time.Sleep(10 * time.Millisecond)
		}
		back := time.Since(t0)
		running(t, tree, home, fmt.Sprintf("killing ptxmig %s after %s", k.verb, k.step))
		// Every rank goes back to its own GPU; after a migrate's driver restore, the guardian
		// moves the ranks back with the journal's pairs inverted.
		for pid, g := range home {
			if got := gpuOf(t, pid); got != g {
				t.Errorf("after killing ptxmig %s after %s, rank pid %d is on GPU %d, want %d", k.verb, k.step, pid, got, g)
			}
		}
		progresses(t, p, 2*time.Minute, fmt.Sprintf("killing ptxmig %s after %s", k.verb, k.step))
		record(t, "%d ranks: SIGKILL of ptxmig %s right after %s: every rank running on its GPU again %s later",
			j.world, k.verb, k.step, back.Round(time.Millisecond))
	}
	waitExit(t, p.pid, 8*time.Minute)
	sameResults(t, results(p.log), <-ref)
}
