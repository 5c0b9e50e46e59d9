//go:build gpu

package gputest

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/migrate"
)

// fwRow is one framework of the matrix: its frameworks.py name, whether ptxmig refuses it by
// name (the process then runs on untouched), and its environment.
type fwRow struct {
	name    string // the row, and frameworks.py's FRAMEWORK unless fw says
	fw      string
	refused string // a word the refusal names ("" when it must work)
	maybe   bool   // the refusal may not come (then the row must work)
	steps   int
	env     []string
	run     []string // flags of `ptxmig run`
	args    []string // more arguments of frameworks.py
	gpus    int      // the GPUs the row needs (0: one)
	peer    bool     // peer access must have been on, and turned off for every checkpoint
	owned   uint64   // under --owned-memory: at least this much must be owned and moved device to device
}

var fwRows = []fwRow{
	{name: "resnet", steps: 300}, {name: "gpt2", steps: 300},
	// ResNet-18 training beside 8 GiB of data on the GPU, under --owned-memory: migrate moves it
	// device to device (the issue-34 case: a PyTorch process with 8 GiB, downtime under 1 s).
	{name: "resnet-8g-owned", fw: "resnet", steps: 300, run: []string{"--owned-memory"}, args: []string{"--hold-gib", "8"}, owned: 8 << 30},
	// torch.compile's Inductor compiles in a pool of worker processes, which load libcuda without
	// a CUDA context and, in some runs, map the GPU's device files (CRIU cannot dump those): such a
	// tree is refused, naming the fix; compiling in the process works.
	{name: "compile", steps: 300, env: []string{"TORCHINDUCTOR_COMPILE_THREADS=1"}},
	{name: "compile-workers", fw: "compile", refused: "TORCHINDUCTOR_COMPILE_THREADS=1", maybe: true, steps: 300},
	{name: "triton", steps: 400}, {name: "cupy", steps: 400}, {name: "numba", steps: 400},
	// JAX on one GPU; on several, XLA enables peer access between them: the shim turns it off for
	// each checkpoint and on again after; or it is started with --no-peer-access.
	{name: "jax", steps: 400, env: []string{"CUDA_VISIBLE_DEVICES=0"}},
	{name: "jax-gpus", fw: "jax", steps: 400, gpus: 2, peer: true},
	{name: "jax-gpus-no-peer", fw: "jax", steps: 400, run: []string{"--no-peer-access"}, gpus: 2},
	// One PyTorch process over two GPUs (model parallel): PyTorch enables peer access for its
	// copies between them where the GPUs have a peer path.
	{name: "pipeline", steps: 300, gpus: 2},
	{name: "pipeline-no-peer", fw: "pipeline", steps: 300, run: []string{"--no-peer-access"}, gpus: 2},
}

// fwAvailable skips the test when the host lacks the framework (frameworks.py says "skip:").
func fwAvailable(t *testing.T, fw string) {
	t.Helper()
	out, _ := exec.Command("python3", filepath.Join(workloads, "frameworks.py"), fw, "--steps", "0").CombinedOutput()
	if s := string(out); strings.HasPrefix(s, "skip: ") {
		t.Skip(strings.TrimSpace(s))
	}
}

// fwReference is an uninterrupted run of frameworks.py with env, plain (no shim), in the
// background; the test waits for it before it ends.
func fwReference(t *testing.T, env []string, args ...string) <-chan []string {
	t.Helper()
	ref := make(chan []string, 1)
	done := make(chan struct{})
	t.Cleanup(func() { <-done })
	go func() {
		defer close(done)
		p := startEnv(t, env, "/usr/bin/env", append([]string{"python3", filepath.Join(workloads, "frameworks.py")}, args...)...)
		select {
		case <-p.done:
		case <-time.After(10 * time.Minute):
			t.Errorf("reference run of frameworks.py %s did not finish", strings.Join(args, " "))
		}
		ref <- results(p.log)
	}()
	return ref
}

// fwStart runs frameworks.py under `ptxmig run` (the default preemption) and waits for the line
// starting with until; a framework missing on the host skips the row (frameworks.py prints
// "skip: REASON").
func fwStart(t *testing.T, env, run []string, until string, args ...string) *proc {
	t.Helper()
	shim := os.Getenv("PTXMIG_SHIM")
	if shim == "" {
		t.Skip("PTXMIG_SHIM not set (run through gpu-e2e.sh)")
	}
	runArgs := append(append([]string{"run", "--shim", shim, "--socket-dir", filepath.Join(t.TempDir(), "sock")}, run...),
		"--", "python3", filepath.Join(workloads, "frameworks.py"))
	p := startEnv(t, env, bin, append(runArgs, args...)...)
	for deadline := time.Now().Add(5 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
		for _, l := range lines(p.log) {
			if strings.HasPrefix(l, "skip: ") {
				t.Skip(l)
			}
			if strings.HasPrefix(l, until) {
				return p
			}
		}
		select {
		case <-p.done:
			t.Fatalf("frameworks.py %s ended before %q:\n%s", strings.Join(args, " "), until, strings.Join(lines(p.log), "\n"))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("frameworks.py %s: no %q in 5 minutes:\n%s", strings.Join(args, " "), until, strings.Join(lines(p.log), "\n"))
		}
	}
}

// peerOffOf is the number of peer links the checkpoint turned off in its process (0: none).
func peerOffOf(res *checkpoint.Result) int {
	for _, r := range res.Preemption {
		if r.PeerOff != nil {
			return r.PeerOff.Links
		}
	}
	return 0
}

// quiesceOf is the quiesce time of the checkpoint's process (its first shim report).
func quiesceOf(res *checkpoint.Result) (time.Duration, bool) {
	for _, r := range res.Preemption {
		if r.Quiesce != nil {
			return r.QuiesceDur + r.StopWait, true
		}
	}
	return 0, false
}

// TestFrameworks: the framework matrix (docs/COMPATIBILITY.md). Each framework's loop runs under
// the default `ptxmig run`; three `checkpoint --leave-running` (the first quiesce recorded apart),
// a checkpoint + restore, and a migrate (two GPUs: there and back; one: --rehearse); a process
// with peer access has it turned off for each checkpoint and on after (row.peer: it must); the output
// must equal an uninterrupted run's. A framework ptxmig refuses by name must be refused up front (exit 3) and
// run on to the same output.
func TestFrameworks(t *testing.T) {
	devs := need(t, 1)
	for _, row := range fwRows {
		t.Run(row.name, func(t *testing.T) {
			fw := row.fw
			if fw == "" {
				fw = row.name
			}
			if len(devs) < max(row.gpus, 1) {
				t.Skipf("needs %d GPUs, this host has %d", row.gpus, len(devs))
			}
			fwAvailable(t, fw)
			args := append([]string{fw, "--steps", strconv.Itoa(row.steps), "--sleep-ms", "30"}, row.args...)
			ref := fwReference(t, row.env, args...)
			p := fwStart(t, row.env, row.run, "step 5 ", args...)
			var first time.Duration
			var later, walls []time.Duration
			peers := ""
			for i := 0; i < 3; i++ {
				t0 := time.Now()
				so, se, code := ptxmig(t, "--json", "checkpoint", "--leave-running", "--lock-timeout", "10s",
					"--name", fmt.Sprintf("fw-%s-%d-%d", row.name, i, time.Now().UnixNano()), strconv.Itoa(p.pid))
				walls = append(walls, time.Since(t0))
				if row.refused != "" && (code != 0 || !row.maybe) {
					if code != 3 || !strings.Contains(so+se, row.refused) { // --json: the refusal is on stdout
						t.Fatalf("checkpoint of %s: exit %d, want 3 naming %s:\n%s", row.name, code, row.refused, se)
					}
					running(t, []int{p.pid}, map[int]int{p.pid: 0}, "the refusal")
					waitExit(t, p.pid, 8*time.Minute)
					sameResults(t, results(p.log), <-ref)
					var refusal struct {
						Error string `json:"error"`
					}
					_ = json.Unmarshal([]byte(so), &refusal)
					record(t, "%s: refused up front (exit 3), ran on to identical output (%s)", row.name, refusal.Error)
					return
				}
				if code != 0 {
					t.Fatalf("checkpoint --leave-running %d of %s: exit %d\n%s", i, row.name, code, se)
				}
				var res checkpoint.Result
				if err := json.Unmarshal([]byte(so), &res); err != nil {
					t.Fatalf("checkpoint --json: %v\n%s", err, so)
				}
				links := peerOffOf(&res)
				if row.peer && links == 0 {
					t.Fatalf("checkpoint --leave-running %d of %s: no peer access turned off (the row enables it)", i, row.name)
				}
				if links > 0 && i == 0 {
					peers = fmt.Sprintf("; peer access (%d links) off for each checkpoint, on after", links)
				}
				if q, ok := quiesceOf(&res); ok && i == 0 {
					first = q
				} else if ok {
					later = append(later, q)
				}
				progresses(t, p, 2*time.Minute, fmt.Sprintf("checkpoint --leave-running %d", i))
			}
			name := fmt.Sprintf("fw-%s-end-%d", row.name, time.Now().UnixNano())
			t0 := time.Now()
			so, se, code := ptxmig(t, "--json", "checkpoint", "--lock-timeout", "10s", "--name", name, strconv.Itoa(p.pid))
			if code != 0 {
				t.Fatalf("checkpoint of %s: exit %d\n%s", row.name, code, se)
			}
			ck := time.Since(t0)
			var end checkpoint.Result
			if err := json.Unmarshal([]byte(so), &end); err != nil {
				t.Fatalf("checkpoint --json: %v\n%s", err, so)
			}
			// The whole tree ended (torch.compile's workers too); orphans come to this test (a
			// subreaper) to be reaped before the restore needs their pids.
			for _, tp := range end.Tree {
				reap(t, tp.PID, time.Minute)
			}
			t0 = time.Now()
			if so, se, code := ptxmig(t, "restore", name); code != 0 {
				t.Fatalf("restore of %s: exit %d\n%s\n%s", row.name, code, so, se)
			}
			rs := time.Since(t0)
			progresses(t, p, 2*time.Minute, "the restore")
			// Two GPUs: there and back. One: a rehearsal onto its own GPU (the whole move: the
			// driver's checkpoint to host memory and its restore, without the store).
			moves, targets := "migrate 0→1→0", [][]string{{"--gpu", "1"}, {"--gpu", "0"}}
			switch {
			case len(devs) == 1:
				moves, targets = "migrate --rehearse (one GPU)", [][]string{{"--rehearse"}}
			case row.gpus > 1: // a process on GPUs 0 and 1: swapped, and back
				moves, targets = "migrate --gpu-map 0=1,1=0 twice", [][]string{{"--gpu-map", "0=1,1=0"}, {"--gpu-map", "0=1,1=0"}}
			}
			var downs []string
			for _, to := range targets {
				so, se, code := ptxmig(t, append(append([]string{"--json", "migrate"}, to...), strconv.Itoa(p.pid))...)
				if code != 0 {
					t.Fatalf("migrate %v of %s: exit %d\n%s", to, row.name, code, se)
				}
				var mres migrate.Result
				if err := json.Unmarshal([]byte(so), &mres); err != nil {
					t.Fatalf("migrate --json: %v\n%s", err, so)
				}
				downs = append(downs, mres.Downtime.Round(time.Millisecond).String())
				if row.owned > 0 {
					var m *shimstep.OwnedMemory
					for _, r := range mres.Preemption {
						if r.PID == p.pid {
							m = r.Owned
						}
					}
					if m == nil || m.Stash == nil || m.Stash.Bytes < row.owned || m.Unstash == nil || m.Unstash.From != "target" {
						t.Fatalf("migrate %v of %s: owned memory %+v, want at least %d bytes moved device to device", to, row.name, m, row.owned)
					}
					downs[len(downs)-1] += fmt.Sprintf(" (%d MiB owned: stop copy %s, device copy %s, driver %s + %s, unstash %s)", m.Stash.Bytes>>20,
						(time.Duration(m.Stash.CopyUS) * time.Microsecond).Round(time.Millisecond),
						(time.Duration(m.Stash.Target.CopyUS) * time.Microsecond).Round(100*time.Microsecond),
						mres.Checkpoint.Round(time.Millisecond), mres.Restore.Round(time.Millisecond), mres.Unstash.Round(time.Millisecond))
				}
				progresses(t, p, 2*time.Minute, fmt.Sprintf("the migrate %v", to))
			}
			moves += " downtime " + strings.Join(downs, ", ")
			waitExit(t, p.pid, 8*time.Minute)
			sameResults(t, results(p.log), <-ref)
			record(t, "%s: identical output; first quiesce %s, later %s; --leave-running wall p50 %s; checkpoint %s, restore %s; %s%s",
				row.name, first, strings.Trim(fmt.Sprint(later), "[]"), pct(walls, 50).Round(time.Millisecond),
				ck.Round(time.Millisecond), rs.Round(time.Millisecond), moves, peers)
		})
	}
}

// TestJITLongKernels: CuPy's and Numba's JIT-compiled kernels spinning about 3 s a block, over
// many blocks (about four waves) and over one wave, under the default `ptxmig run`: a
// `checkpoint --leave-running` one second into the second launch must succeed within the lock
// timeout, with identical output. CuPy compiles with NVRTC straight to a cubin, numba-cuda links
// NVVM's LTO-IR with nvJitLink: the shim takes the PTX from the compiler, so a many-block launch
// must be preempted by a twin (CuPy gets a kernel cache of its own, so that the kernel is compiled
// under the shim and not loaded from a cubin cached by the reference run). A loop of nanosleeps
// with a uniform trip count (numba; cupy-sleep: `--spin sleep`) has a mid-block site, so the
// default (PTXMIG_MID_BLOCK=auto) launches its mid-block twin for the one-wave grid and for the
// many-block grid once its first launch timed 3 s blocks: both must stop inside their blocks.
// CuPy's clock-bound spin (`--spin clock`: each thread leaves it on its own clock) has a
// thread-loop site (the kernel has no barrier or warp collective, so each thread stops by itself,
// its start time rebased; ptx analyze): it must stop inside its blocks too. Recorded: the quiesce,
// the lock, and what the shim did with the launch.
func TestJITLongKernels(t *testing.T) {
	need(t, 1)
	for _, c := range []struct {
		name, fw string
		args     []string
		mid      bool // a mid-block site: must stop inside its blocks
	}{
		{"cupy", "cupy", []string{"--spin", "clock"}, true},
		{"cupy-sleep", "cupy", []string{"--spin", "sleep"}, true},
		{"numba", "numba", nil, true},
	} {
		fw := c.fw
		for _, wave := range []string{"many-blocks", "one-wave"} {
			t.Run(c.name+"/"+wave, func(t *testing.T) {
				args := append([]string{fw, "--steps", "3", "--sleep-ms", "0", "--long-ms", "3000"}, c.args...)
				env := []string{"CUPY_CACHE_DIR=" + t.TempDir()}
				if wave != "many-blocks" {
					args = append(args, "--one-wave")
				}
				fwAvailable(t, fw)
				// The reference first, not beside: two processes' multi-second kernels on one GPU
				// share it by time slices (each launch then takes about twice as long), and a
				// restored process among them can be killed by Xid 109 (docs/PLATFORM.md).
				want := <-fwReference(t, nil, args...)
				p := fwStart(t, env, nil, "step 1 ", args...)
				time.Sleep(time.Second) // into the second launch
				so, se, code := ptxmig(t, "--json", "checkpoint", "--leave-running", "--lock-timeout", "10s",
					"--name", fmt.Sprintf("jit-%s-%s-%d", c.name, wave, time.Now().UnixNano()), strconv.Itoa(p.pid))
				if code != 0 {
					t.Fatalf("checkpoint --leave-running in a long %s kernel: exit %d\n%s", fw, code, se)
				}
				var res checkpoint.Result
				if err := json.Unmarshal([]byte(so), &res); err != nil {
					t.Fatalf("checkpoint --json: %v\n%s", err, so)
				}
				what := "no shim report"
				preempted := 0
				q, _ := quiesceOf(&res)
				for _, r := range res.Preemption {
					if r.Quiesce == nil {
						continue
					}
					var why []string
					for _, o := range r.Quiesce.Originals {
						why = append(why, o.Kernel+": "+o.Reason)
					}
					var still []string
					for _, o := range r.Quiesce.NotStopped {
						still = append(still, o.Kernel+": "+o.Reason)
					}
					preempted += len(r.Quiesce.Preempted)
					what = fmt.Sprintf("%d launch(es) preempted, %d still stopping after the budget (stop wait %s) %q, originals: %q",
						len(r.Quiesce.Preempted), len(r.Quiesce.Stopping), r.StopWait.Round(time.Millisecond), still, why)
				}
				if c.mid {
					mid := false
					for _, r := range res.Preemption {
						if r.Quiesce != nil {
							for _, l := range r.Quiesce.Preempted {
								mid = mid || l.MidBlockStop()
							}
						}
					}
					if !mid {
						t.Errorf("%s %s: no launch stopped inside its blocks (the default's mid-block twin): %s", c.name, wave, what)
					}
				}
				if wave == "many-blocks" && preempted == 0 {
					// Read the stopping twins too: a twin raised within the budget but still
					// finishing its blocks ends up preempted after the reply.
					stopped := false
					for _, r := range res.Preemption {
						stopped = stopped || (r.Quiesce != nil && len(r.Quiesce.Stopping) > 0)
					}
					if !stopped {
						t.Errorf("%s many blocks: the long kernel ran as the original (no twin from the JIT compiler's PTX): %s", fw, what)
					}
				}
				waitExit(t, p.pid, 5*time.Minute)
				if got := results(p.log); !slices.Equal(got, want) {
					l := lines(p.log)
					t.Logf("the process's log, last lines:\n%s", strings.Join(l[max(0, len(l)-30):], "\n"))
				}
				sameResults(t, results(p.log), want)
				record(t, "%s %s (3 s a block): quiesce %s, lock %s, checkpoint %s; %s; identical output",
					c.name, wave, q, res.Timings.Of(driverstep.StepLock).Round(time.Millisecond), res.Total.Round(time.Millisecond), what)
			})
		}
	}
}
