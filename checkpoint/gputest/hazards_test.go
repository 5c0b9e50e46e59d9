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
// uninterrupted run of the same work without the shim.
//   - only=e: L is the tail of its stream (the helper threads' kernels are on their own streams),
//     so the quiesce preempts it: a --leave-running checkpoint must not wait for L, and a
//     checkpoint that ends the process mid-kernel, then restore, finishes L exactly once.
//   - all hazards: work is queued behind L (the tail rule drains L instead of preempting it), so
//     a --leave-running checkpoint with a lock timeout longer than L succeeds once L has drained,
//     and names L as left to the lock; nothing behind L may run early, so every part is exact.
func TestPreemptHazards(t *testing.T) {
	need(t, 1)
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"only e", []string{"--seconds", "20", "--only", "e"}},
		{"all hazards", []string{"--seconds", "20"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startShimmed(t, "always", "hazards", tc.args...)
			fixed := hazardParams(t, p)
			waitLine(t, p.log, "queued", 3*time.Minute)
			time.Sleep(2 * time.Second)
			all := tc.name == "all hazards"
			lockTimeout := "10s"
			if all {
				lockTimeout = "120s" // L drains (20 s) before the lock is granted
			}
			t0 := time.Now()
			so, se, code := ptxmig(t, "--json", "checkpoint", "--leave-running", "--lock-timeout", lockTimeout, "--name", "hz-lr", strconv.Itoa(p.pid))
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
			if !all && (len(q.Preempted) == 0 || took > 10*time.Second) {
				t.Errorf("only=e: L was not preempted (took %s)", took)
			}
			if !all {
				// Checkpoint mid-kernel (the process ends), then restore: L's remainder runs once.
				time.Sleep(time.Second)
				so, se, code = ptxmig(t, "--json", "checkpoint", "--name", "hz-mid", strconv.Itoa(p.pid))
				if code != 0 {
					t.Fatalf("checkpoint mid-kernel: exit %d: %s", code, se)
				}
				<-p.done
				if so, se, code = ptxmig(t, "--json", "restore", "hz-mid"); code != 0 {
					t.Fatalf("restore: exit %d: %s\n%s", code, se, so)
				}
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
