//go:build gpu

package gputest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/shimctl"
	"github.com/ptxmig/ptxmig/internal/shimstep"
)

// Preemption on a real GPU: longgrid (testdata/workloads) runs one many-block kernel of about
// 30 s under `ptxmig run --preempt always`; ptxmig checkpoints it mid-kernel. Without the shim's
// quiesce the driver lock would wait for the kernel (10 s lock timeout: exit 1).

// startShimmed runs a workload under `ptxmig run` with a private socket directory.
func startShimmed(t *testing.T, mode, name string, args ...string) *proc {
	t.Helper()
	return startShimmedCache(t, []string{"--preempt", mode}, filepath.Join(out, "gputest", "ptxcache"), filepath.Join(workloads, name), args...)
}

// startShimmedCache runs the program at path under `ptxmig run` with runFlags (--preempt MODE,
// --mid-block) and the instrumentation cache dir.
func startShimmedCache(t *testing.T, runFlags []string, cache, path string, args ...string) *proc {
	t.Helper()
	shim := os.Getenv("PTXMIG_SHIM")
	if shim == "" {
		t.Skip("PTXMIG_SHIM not set (run through gpu-e2e.sh)")
	}
	sock := filepath.Join(t.TempDir(), "sock")
	runArgs := append(append(append([]string{"run", "--shim", shim, "--socket-dir", sock}, runFlags...), "--", path), args...)
	return startEnv(t, []string{"PTXMIG_PTX_CACHE=" + cache}, bin, runArgs...)
}

// longgridParams waits for the params line and returns the fixed-size arguments that repeat it.
func longgridParams(t *testing.T, p *proc) []string {
	t.Helper()
	l := waitLine(t, p.log, "params ", 3*time.Minute)
	var blocks, work, repeat int
	if _, err := fmt.Sscanf(l, "params blocks=%d work=%d repeat=%d", &blocks, &work, &repeat); err != nil {
		t.Fatalf("params line %q: %v", l, err)
	}
	return []string{"--blocks", strconv.Itoa(blocks), "--work", strconv.Itoa(work), "--repeat", strconv.Itoa(repeat)}
}

// waitStarted waits until the workload has printed n "started" lines.
func waitStarted(t *testing.T, p *proc, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		c := 0
		for _, l := range lines(p.log) {
			if l == "started" {
				c++
			}
		}
		if c >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d 'started' lines after %s, want %d; log:\n%s", c, timeout, n, strings.Join(lines(p.log), "\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

type ckptJSON struct {
	Preemption []*shimstep.PreemptReport `json:"preemption"`
	Timings    op.Timings                `json:"timings"`
}

// TestPreemptLongKernel: checkpoints of a process in the middle of a ~30 s kernel do not wait
// for the kernel. (1) 20 checkpoints with --leave-running: each quiesces, preempts the twin,
// checkpoints, resumes; quiesce and quiesce+lock times are recorded (P1). (2) A failure injected
// after the driver checkpoint rolls back and resumes the kernel. (3) A checkpoint that ends the
// process mid-kernel, then restore: the kernel's remainder runs after the restore. The results
// match an uninterrupted run bit for bit.
func TestPreemptLongKernel(t *testing.T) {
	need(t, 1)
	// PTXMIG_PREEMPT_BUDGET overrides ptxmig's default budget for this test (to measure how long
	// preemption takes when the default is too short).
	budget := os.Getenv("PTXMIG_PREEMPT_BUDGET")
	if budget == "" {
		budget = shimstep.DefaultPreemptBudget.String()
	}
	p := startShimmed(t, "always", "longgrid", "--seconds", "30", "--block-ms", "0.25", "--repeat", "2")
	fixed := longgridParams(t, p)
	// The reference (same work, no shim, uninterrupted) runs after the shimmed process, not beside
	// it: with two contexts on the GPU, the restored context's relaunched kernel hit Xid 109 (CTX
	// SWITCH TIMEOUT) on an H100, driver 580 (see docs/BENCHMARKS.md, 2026-11-25).

	// PTXMIG_PREEMPT_ONLY=restore runs only (3): a checkpoint in the first kernel, then restore.
	restoreOnly := os.Getenv("PTXMIG_PREEMPT_ONLY") == "restore"
	if !restoreOnly {
		// (1) P1: 20 --leave-running checkpoints inside the first repeat's kernel.
		waitStarted(t, p, 1, 2*time.Minute)
		time.Sleep(3 * time.Second)
		shimDiagnostics(t, p.pid)
		var quiesce, toLock []time.Duration
		for i := 0; i < 20; i++ {
			t0 := time.Now()
			so, se, code := ptxmig(t, "--json", "checkpoint", "--leave-running", "--preempt-budget", budget, "--name", fmt.Sprintf("pre-lr-%d", i), strconv.Itoa(p.pid))
			if code != 0 {
				t.Fatalf("checkpoint --leave-running %d: exit %d after %s: %s", i, code, time.Since(t0), se)
			}
			var r ckptJSON
			if err := json.Unmarshal([]byte(so), &r); err != nil || len(r.Preemption) != 1 || r.Preemption[0].Quiesce == nil {
				t.Fatalf("checkpoint %d: no quiesce report: %v\n%s", i, err, so)
			}
			q := r.Preemption[0].Quiesce
			if i == 0 && len(q.Preempted) == 0 {
				t.Fatalf("first checkpoint preempted nothing: %+v", q)
			}
			quiesce = append(quiesce, time.Duration(q.ElapsedUS)*time.Microsecond)
			toLock = append(toLock, r.Timings.Of(shimstep.StepQuiesce)+r.Timings.Of(driverstep.StepLock))
			if r.Preemption[0].Resume == nil {
				t.Fatalf("checkpoint %d: not resumed", i)
			}
			time.Sleep(200 * time.Millisecond)
		}
		writeP1(t, quiesce, toLock)

		// (2) Rollback on purpose: the dump fails after the driver checkpoint.
		rollbackOnPurpose(t, p.pid, "pre-rollback")

	}

	// (3) Checkpoint mid-kernel in the second repeat (the process ends), then restore.
	n := 2
	if restoreOnly {
		n = 1
	}
	waitStarted(t, p, n, 3*time.Minute)
	time.Sleep(3 * time.Second)
	so, se, code := ptxmig(t, "--json", "checkpoint", "--preempt-budget", budget, "--name", "pre-mid", strconv.Itoa(p.pid))
	if code != 0 {
		t.Fatalf("checkpoint mid-kernel: exit %d: %s", code, se)
	}
	var r ckptJSON
	if err := json.Unmarshal([]byte(so), &r); err != nil || len(r.Preemption) != 1 || r.Preemption[0].Quiesce == nil || len(r.Preemption[0].Quiesce.Preempted) == 0 {
		t.Fatalf("mid-kernel checkpoint preempted nothing: %v\n%s", err, so)
	}
	<-p.done
	so, se, code = ptxmig(t, "--json", "restore", "pre-mid")
	if code != 0 {
		t.Fatalf("restore: exit %d: %s", code, se)
	}
	if !strings.Contains(so, `"relaunched": 1`) {
		t.Errorf("restore did not relaunch the preempted kernel:\n%s", so)
	}
	waitExit(t, p.pid, 4*time.Minute)
	plain := start(t, "longgrid", fixed...)
	// (0) The baseline: without the shim the driver lock waits for the kernel and times out;
	// the process is not hurt (its result is the reference).
	waitStarted(t, plain, 1, 2*time.Minute)
	time.Sleep(2 * time.Second)
	t0 := time.Now()
	_, se0, code0 := ptxmig(t, "checkpoint", "--leave-running", "--lock-timeout", "2s", "--name", "plain-lr", strconv.Itoa(plain.pid))
	t.Logf("plain process (no shim): checkpoint --leave-running --lock-timeout 2s: exit %d after %s: %s", code0, time.Since(t0), strings.TrimSpace(se0))
	if code0 == 0 {
		t.Errorf("checkpoint of a process in a long kernel without the shim succeeded; the kernel was not long enough to show the difference")
	}
	select {
	case <-plain.done:
	case <-time.After(4 * time.Minute):
		t.Fatal("the reference run did not finish")
	}
	sameResults(t, results(p.log), results(plain.log))
}

// shimDiagnostics logs what the shim of pid says about preemption: its status, its kernels, and
// a quiesce and resume made directly (so a failing checkpoint can be told apart from a shim that
// has no twin running).
func shimDiagnostics(t *testing.T, pid int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := ""
	if e, err := gpu.ProcessEnviron("/proc", pid); err == nil {
		dir = e["PTXMIG_SOCKET_DIR"]
	}
	c, err := shimctl.DialPID(ctx, dir, pid)
	if err != nil {
		t.Fatalf("shim of pid %d (socket dir %q): %v", pid, dir, err)
	}
	defer c.Close()
	raw, err := c.Raw(ctx, "status", nil)
	if err != nil {
		t.Fatalf("status: %v", err)
	}
	var st struct {
		Preempt json.RawMessage `json:"preempt"`
		Modules json.RawMessage `json:"modules"`
	}
	_ = json.Unmarshal(raw, &st)
	t.Logf("shim status.preempt: %s", st.Preempt)
	t.Logf("shim status.modules: %s", st.Modules)
	if raw, err := c.Raw(ctx, "kernels", nil); err == nil {
		t.Logf("shim kernels: %s", raw)
	}
	q, err := c.Quiesce(ctx, 10*time.Millisecond)
	t.Logf("direct quiesce (10 ms): %+v %v", q, err)
	r, err := c.Resume(ctx)
	t.Logf("direct resume: %+v %v", r, err)
	time.Sleep(500 * time.Millisecond)
	q, err = c.Quiesce(ctx, 200*time.Millisecond)
	t.Logf("direct quiesce (200 ms): %+v %v", q, err)
	logThreads(t, pid)
	if d, err := cudackpt.Open(); err != nil {
		t.Logf("driver: %v", err)
	} else {
		t0 := time.Now()
		err := d.Lock(pid, 5*time.Second)
		t.Logf("driver lock after the quiesce: %v after %s", err, time.Since(t0))
		logThreads(t, pid)
		if err == nil {
			t.Logf("driver unlock: %v", d.Unlock(pid))
		}
		// The same with a driver checkpoint and restore in between (what --leave-running does),
		// twice, each followed by a resume and a new quiesce.
		for i := 0; i < 2; i++ {
			r, err = c.Resume(ctx)
			t.Logf("cycle %d: resume: %+v %v", i, r, err)
			time.Sleep(time.Second)
			q, err = c.Quiesce(ctx, 200*time.Millisecond)
			t.Logf("cycle %d: quiesce (200 ms): %+v %v", i, q, err)
			err := d.Lock(pid, 5*time.Second)
			t.Logf("cycle %d: lock %v", i, err)
			if err != nil {
				t.Errorf("cycle %d (quiesce, lock, driver checkpoint, restore, unlock, resume): lock failed: %v", i, err)
				break
			}
			t.Logf("cycle %d: checkpoint %v, restore %v, unlock %v", i, d.Checkpoint(pid), d.Restore(pid, nil), d.Unlock(pid))
		}
	}
	r, err = c.Resume(ctx)
	t.Logf("direct resume: %+v %v", r, err)
	time.Sleep(time.Second)
	q, err = c.Quiesce(ctx, 200*time.Millisecond)
	t.Logf("after the cycles: quiesce (200 ms): %+v %v", q, err)
	r, err = c.Resume(ctx)
	t.Logf("after the cycles: resume: %+v %v", r, err)
	if out, err := exec.Command("dmesg").CombinedOutput(); err == nil {
		ls := strings.Split(strings.TrimSpace(string(out)), "\n")
		t.Logf("dmesg tail:\n%s", strings.Join(ls[max(0, len(ls)-8):], "\n"))
	}
}

// logThreads logs where each thread of pid waits.
func logThreads(t *testing.T, pid int) {
	t.Helper()
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	var parts []string
	for _, e := range tasks {
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/comm", pid, e.Name()))
		wchan, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/wchan", pid, e.Name()))
		stack, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/syscall", pid, e.Name()))
		parts = append(parts, fmt.Sprintf("%s %s wchan=%s syscall=%.20s", e.Name(), strings.TrimSpace(string(comm)), wchan, stack))
	}
	t.Logf("threads of %d: %s", pid, strings.Join(parts, " | "))
}

// writeP1 records the P1 distribution under $PTXMIG_OUT/preempt-p1.txt and in the test log.
func writeP1(t *testing.T, quiesce, toLock []time.Duration) {
	t.Helper()
	writeQuiesceTimes(t, "preempt-p1.txt", "a ~30 s kernel", quiesce, toLock)
}

// writeQuiesceTimes logs quiesce and quiesce+lock percentiles and writes them to $OUT/file.
func writeQuiesceTimes(t *testing.T, file, what string, quiesce, toLock []time.Duration) {
	t.Helper()
	pct := func(d []time.Duration, q float64) time.Duration {
		s := append([]time.Duration(nil), d...)
		sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
		return s[min(len(s)-1, int(q*float64(len(s))))]
	}
	text := fmt.Sprintf("P1 over %d checkpoints --leave-running of %s (preempt budget %s): quiesce p50 %s p99 %s max %s; "+
		"quiesce+lock p50 %s p99 %s max %s\nquiesce: %v\nquiesce+lock: %v\n", len(quiesce), what, os.Getenv("PTXMIG_PREEMPT_BUDGET"),
		pct(quiesce, .5), pct(quiesce, .99), pct(quiesce, 1), pct(toLock, .5), pct(toLock, .99), pct(toLock, 1), quiesce, toLock)
	t.Log(text)
	_ = os.WriteFile(filepath.Join(out, file), []byte(text), 0o644)
}

// rollbackOnPurpose checkpoints pid with --leave-running semantics through the checkpoint package
// with the CRIU dump failing on purpose after the driver checkpoint: the operation must roll back
// (driver restore and unlock, the shim's resume), leaving the process running.
func rollbackOnPurpose(t *testing.T, pid int, name string) {
	t.Helper()
	env, closeEnv, err := op.NewEnv(context.Background(), filepath.Join(out, "gputest", "store"), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	defer closeEnv()
	injected := errors.New("injected dump failure")
	env.Hook = func(_ context.Context, step string) error {
		if step == checkpoint.StepDump {
			return injected
		}
		return nil
	}
	_, err = checkpoint.Run(context.Background(), env, checkpoint.Options{PID: pid, Name: name, LeaveRunning: true, LockTimeout: 10 * time.Second, PreemptBudget: shimstep.DefaultPreemptBudget})
	var fl *op.Failure
	if !errors.As(err, &fl) || !fl.RolledBack() {
		t.Fatalf("injected failure: %v, want a rolled-back failure", err)
	}
	t.Logf("rolled back: %v", err)
}
