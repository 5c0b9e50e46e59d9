//go:build gpu

package gputest

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"
)

// hazardParams waits for the hazards workload's params line and returns the arguments that
// repeat its work exactly (blocks, work, eblocks, only).
func hazardParams(t *testing.T, p *proc) []string {
	t.Helper()
	l := waitLine(t, p.log, "params ", 3*time.Minute)
	var blocks, work, eblocks int
	var only string
	if _, err := fmt.Sscanf(l, "params blocks=%d work=%d eblocks=%d only=%s", &blocks, &work, &eblocks, &only); err != nil {
		t.Fatalf("params line %q: %v", l, err)
	}
	args := []string{"--blocks", strconv.Itoa(blocks), "--work", strconv.Itoa(work), "--eblocks", strconv.Itoa(eblocks)}
	if only != "" {
		args = append(args, "--only", strings.Join(strings.Split(only, ""), ","))
	}
	return args
}

// hazardResults are the lines a hazards run must reproduce exactly: every part, the combined
// result, and that it got to the end (a failed check prints "check FAILED" and no "done").
func hazardResults(t *testing.T, path string) []string {
	t.Helper()
	var out []string
	done := false
	for _, l := range lines(path) {
		switch {
		case strings.HasPrefix(l, "part "), strings.HasPrefix(l, "result "), strings.HasPrefix(l, "check FAILED"):
			out = append(out, l)
		case l == "done":
			done = true
		}
	}
	if !done {
		t.Errorf("%s did not finish (no \"done\"):\n%s", path, strings.Join(lines(path), "\n"))
	}
	return out
}

// TestPreemptHazards checkpoints the hazards workload (testdata/workloads/hazards.cu: one long
// many-block kernel L with the preemption hazards of preemption-runtime.md §4 built around it)
// while L runs, under `ptxmig run --preempt always`, and compares every part with an
// uninterrupted run of the same work without the shim. The shim holds every submission that would
// queue behind a twin in flight (the thread waits in the shim), so L is always its stream's tail:
//   - only=e: L, and the two helper threads' kernels on their own streams (their folds held);
//   - all hazards: L, with the fold, copy, event, host function, the second stream's wait and the
//     legacy-stream work held behind it, and a thread inside cudaStreamSynchronize(s1).
//
// Each case: a --leave-running checkpoint mid-kernel (every long kernel preempted within the
// budget, nothing waits for L), a rollback on purpose (the dump fails after the driver
// checkpoint: the process resumes), then a checkpoint that ends the process mid-kernel and a
// restore; every part must equal the uninterrupted run's.
func TestPreemptHazards(t *testing.T) {
	need(t, 1)
	for i, tc := range []struct {
		name      string
		args      []string
		preempted int // long kernels in flight at the checkpoint
	}{
		{"only e", []string{"--seconds", "20", "--only", "e"}, 3},
		{"all hazards", []string{"--seconds", "20"}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startShimmed(t, "always", "hazards", tc.args...)
			fixed := hazardParams(t, p)
			waitLine(t, p.log, "started", 3*time.Minute)
			time.Sleep(3 * time.Second)
			t0 := time.Now()
			so, se, code := ptxmig(t, "--json", "checkpoint", "--leave-running", "--lock-timeout", "10s", "--name", fmt.Sprintf("hz-lr-%d", i), strconv.Itoa(p.pid))
			took := time.Since(t0)
			if code != 0 {
				t.Fatalf("checkpoint --leave-running: exit %d after %s: %s", code, took, se)
			}
			var r ckptJSON
			if err := json.Unmarshal([]byte(so), &r); err != nil || len(r.Preemption) != 1 || r.Preemption[0].Quiesce == nil {
				t.Fatalf("no quiesce report: %v\n%s", err, so)
			}
			q := r.Preemption[0].Quiesce
			t.Logf("--leave-running checkpoint: %s, quiesce %d µs, preempted %d, report %+v", took, q.ElapsedUS, len(q.Preempted), q)
			if len(q.Preempted) != tc.preempted || len(q.NotStopped) != 0 || took > 10*time.Second {
				t.Errorf("want %d long kernels preempted and none left to the lock, got %d preempted, %d not stopped, in %s",
					tc.preempted, len(q.Preempted), len(q.NotStopped), took)
			}
			// Rollback on purpose: the dump fails after the driver checkpoint; the process resumes.
			time.Sleep(time.Second)
			rollbackOnPurpose(t, p.pid, fmt.Sprintf("hz-rollback-%d", i))
			// Checkpoint mid-kernel (the process ends), then restore: each remainder runs once.
			time.Sleep(time.Second)
			so, se, code = ptxmig(t, "--json", "checkpoint", "--name", fmt.Sprintf("hz-mid-%d", i), strconv.Itoa(p.pid))
			if code != 0 {
				t.Fatalf("checkpoint mid-kernel: exit %d: %s", code, se)
			}
			if err := json.Unmarshal([]byte(so), &r); err == nil && len(r.Preemption) == 1 && r.Preemption[0].Quiesce != nil {
				t.Logf("mid-kernel checkpoint: preempted %+v", r.Preemption[0].Quiesce.Preempted)
				if len(r.Preemption[0].Quiesce.Preempted) == 0 {
					t.Errorf("the checkpoint that ends the process preempted nothing (L finished too early?)")
				}
			}
			<-p.done
			if so, se, code = ptxmig(t, "--json", "restore", fmt.Sprintf("hz-mid-%d", i)); code != 0 {
				t.Fatalf("restore: exit %d: %s\n%s", code, se, so)
			}
			waitExit(t, p.pid, 3*time.Minute)
			// The reference runs after the shimmed process, not beside it (see TestPreemptLongKernel).
			plain := start(t, "hazards", fixed...)
			select {
			case <-plain.done:
			case <-time.After(3 * time.Minute):
				t.Fatal("the reference run did not finish")
			}
			sameResults(t, hazardResults(t, p.log), hazardResults(t, plain.log))
		})
	}
}
