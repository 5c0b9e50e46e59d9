//go:build gpu

package gputest

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/shimstep"
)

// TestPreemptMidBlock: longkernel (testdata/workloads) runs one kernel of about 30 s in which every
// thread loops for the whole kernel: one wave, no block ends before the kernel does, so a twin
// that stops between blocks could not stop it sooner than the kernel itself. Under `ptxmig run
// --mid-block` each checkpoint stops it inside its blocks within the preempt budget:
// (1) 20 checkpoints with --leave-running, each reporting a mid-block stop, quiesce times
// recorded; (2) a rollback on purpose; (3) a checkpoint that ends the process mid-kernel, then
// restore. The result matches an uninterrupted run bit for bit.
func TestPreemptMidBlock(t *testing.T) {
	need(t, 1)
	budget := os.Getenv("PTXMIG_PREEMPT_BUDGET")
	if budget == "" {
		budget = shimstep.DefaultPreemptBudget.String()
	}
	p := startShimmedCache(t, midAlways, filepath.Join(out, "gputest", "ptxcache"), filepath.Join(workloads, "longkernel"), "--seconds", "30", "--device", "0")
	iters := strings.TrimPrefix(waitLine(t, p.log, "iters ", 3*time.Minute), "iters ")
	time.Sleep(3 * time.Second)
	checkpointOnce := func(name string, leave bool) ckptJSON {
		t.Helper()
		args := []string{"--json", "checkpoint", "--preempt-budget", budget, "--name", name}
		if leave {
			args = append(args, "--leave-running")
		}
		t0 := time.Now()
		so, se, code := ptxmig(t, append(args, strconv.Itoa(p.pid))...)
		if code != 0 {
			t.Fatalf("checkpoint %s: exit %d after %s: %s", name, code, time.Since(t0), se)
		}
		var r ckptJSON
		if err := json.Unmarshal([]byte(so), &r); err != nil || len(r.Preemption) != 1 || r.Preemption[0].Quiesce == nil {
			t.Fatalf("checkpoint %s: no quiesce report: %v\n%s", name, err, so)
		}
		q := r.Preemption[0].Quiesce
		if len(q.Preempted) != 1 || !q.Preempted[0].MidBlockStop() || len(q.NotStopped)+len(q.Originals) != 0 {
			shimDiagnostics(t, p.pid)
			t.Fatalf("checkpoint %s: want one launch stopped mid-block and nothing left to the lock: %+v", name, q)
		}
		return r
	}
	var quiesce, toLock []time.Duration
	for i := 0; i < 20; i++ {
		r := checkpointOnce(fmt.Sprintf("mid-lr-%d", i), true)
		q := r.Preemption[0].Quiesce
		if i == 0 {
			t.Logf("first stop: %+v", q.Preempted[0])
		}
		quiesce = append(quiesce, time.Duration(q.ElapsedUS)*time.Microsecond)
		toLock = append(toLock, r.Timings.Of(shimstep.StepQuiesce)+r.Timings.Of(driverstep.StepLock))
		if r.Preemption[0].Resume == nil || r.Preemption[0].Resume.Relaunched != 1 {
			t.Fatalf("checkpoint %d: not resumed: %+v", i, r.Preemption[0].Resume)
		}
		time.Sleep(200 * time.Millisecond)
	}
	writeQuiesceTimes(t, "preempt-midblock-p1.txt", "longkernel (one ~30 s wave, mid-block twin)", quiesce, toLock)
	rollbackOnPurpose(t, p.pid, "mid-rollback")
	time.Sleep(time.Second)
	checkpointOnce("mid-end", false)
	<-p.done
	so, se, code := ptxmig(t, "--json", "restore", "mid-end")
	if code != 0 {
		t.Fatalf("restore: exit %d: %s", code, se)
	}
	if !strings.Contains(so, `"relaunched": 1`) {
		t.Errorf("restore did not relaunch the preempted kernel:\n%s", so)
	}
	waitExit(t, p.pid, 4*time.Minute)
	// The reference runs after the shimmed process, not beside it (see TestPreemptLongKernel).
	plain := start(t, "longkernel", "--iters", iters, "--device", "0")
	select {
	case <-plain.done:
	case <-time.After(4 * time.Minute):
		t.Fatal("the reference run did not finish")
	}
	got, want := results(p.log), results(plain.log)
	if len(want) != 1 {
		t.Fatalf("reference printed no result: %v", lines(plain.log))
	}
	sameResults(t, got, want)
}
