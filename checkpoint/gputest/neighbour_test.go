//go:build gpu

package gputest

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestPreemptNeighbour: preemption while another process keeps the GPU busy. A longgrid under
// `ptxmig run` with the default policy (auto: its first, untimed launch and its later long ones
// run as twins) and a plain longgrid doing the same work beside it, on the same GPU, both
// started together so that their long kernels overlap. The shimmed one is checkpointed with
// --leave-running five times in its first kernel, then checkpointed mid-kernel (it ends) and
// restored while the neighbour still runs. Both must finish with the same results: the plain
// one is the reference. This is the case that once hit Xid 109 (CTX SWITCH TIMEOUT) on an H100
// (docs/BENCHMARKS.md, 2026-11-25): the Xid lines the kernel log gained during the test are
// written to $PTXMIG_OUT/neighbour-xid.txt and fail the test.
func TestPreemptNeighbour(t *testing.T) {
	need(t, 1)
	xidBefore := xidLines()
	var report []string
	// Whatever the outcome, the Xid lines the test added and the steps so far are written out (a
	// failed checkpoint is exactly when they are needed).
	t.Cleanup(func() {
		xid := newLines(xidBefore, xidLines())
		text := strings.Join(append(append(report, fmt.Sprintf("Xid lines added to the kernel log: %d", len(xid))), xid...), "\n") + "\n"
		t.Log(text)
		_ = os.WriteFile(filepath.Join(out, "neighbour-xid.txt"), []byte(text), 0o644)
		if len(xid) > 0 {
			t.Errorf("the GPU reported Xid errors during the test:\n%s", strings.Join(xid, "\n"))
		}
	})
	p := startShimmed(t, "auto", "longgrid", "--seconds", "15", "--block-ms", "0.25", "--repeat", "2")
	fixed := longgridParams(t, p)
	plain := start(t, "longgrid", fixed...)
	waitStarted(t, p, 1, 2*time.Minute)
	waitStarted(t, plain, 1, 2*time.Minute)
	time.Sleep(2 * time.Second)

	for i := 0; i < 5; i++ {
		t0 := time.Now()
		so, se, code := ptxmig(t, "--json", "checkpoint", "--leave-running", "--name", fmt.Sprintf("nb-lr-%d", i), strconv.Itoa(p.pid))
		if code != 0 {
			t.Fatalf("checkpoint --leave-running %d beside a busy neighbour: exit %d after %s: %s", i, code, time.Since(t0), se)
		}
		var r ckptJSON
		if err := json.Unmarshal([]byte(so), &r); err != nil || len(r.Preemption) != 1 || r.Preemption[0].Quiesce == nil {
			t.Fatalf("checkpoint %d: no quiesce report: %v\n%s", i, err, so)
		}
		q := r.Preemption[0].Quiesce
		if len(q.Preempted) == 0 {
			t.Fatalf("checkpoint %d preempted nothing (auto should run the long kernel as a twin): %s", i, so)
		}
		report = append(report, fmt.Sprintf("leave-running %d: quiesce %d us, preempted %d, total %s", i, q.ElapsedUS, len(q.Preempted), time.Since(t0).Round(time.Millisecond)))
		time.Sleep(500 * time.Millisecond)
	}

	waitStarted(t, p, 2, 3*time.Minute)
	time.Sleep(2 * time.Second)
	t0 := time.Now()
	so, se, code := ptxmig(t, "--json", "checkpoint", "--name", "nb-mid", strconv.Itoa(p.pid))
	if code != 0 {
		t.Fatalf("checkpoint mid-kernel beside a busy neighbour: exit %d: %s", code, se)
	}
	var r ckptJSON
	if err := json.Unmarshal([]byte(so), &r); err != nil || len(r.Preemption) != 1 || r.Preemption[0].Quiesce == nil || len(r.Preemption[0].Quiesce.Preempted) == 0 {
		t.Fatalf("mid-kernel checkpoint preempted nothing: %v\n%s", err, so)
	}
	report = append(report, fmt.Sprintf("checkpoint (ends the process): quiesce %d us, total %s", r.Preemption[0].Quiesce.ElapsedUS, time.Since(t0).Round(time.Millisecond)))
	<-p.done
	t0 = time.Now()
	so, se, code = ptxmig(t, "--json", "restore", "nb-mid")
	if code != 0 {
		t.Fatalf("restore beside a busy neighbour: exit %d: %s", code, se)
	}
	if !strings.Contains(so, `"relaunched": 1`) {
		t.Errorf("restore did not relaunch the preempted kernel:\n%s", so)
	}
	report = append(report, fmt.Sprintf("restore: total %s", time.Since(t0).Round(time.Millisecond)))
	waitExit(t, p.pid, 4*time.Minute)
	select {
	case <-plain.done:
	case <-time.After(4 * time.Minute):
		t.Fatal("the neighbour did not finish")
	}
	sameResults(t, results(p.log), results(plain.log))
}

// xidLines returns the kernel log's NVRM Xid lines (nil when dmesg cannot be read).
func xidLines() []string {
	b, err := exec.Command("dmesg").Output()
	if err != nil {
		return nil
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "Xid") {
			out = append(out, l)
		}
	}
	return out
}

// newLines returns the lines of after beyond the first len(before) (the log only grows).
func newLines(before, after []string) []string {
	if len(after) <= len(before) {
		return nil
	}
	return after[len(before):]
}
