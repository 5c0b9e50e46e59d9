//go:build gpu

package gputest

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/op"
	procfs "github.com/ptxmig/ptxmig/internal/proc"
)

// The guardian on a GPU: ptxmig is killed with SIGKILL right after the driver lock, and right
// after the driver checkpoint, of the counter workload (ptxmig stops itself there:
// op.FaultStopAfter). Its guardian must restore and unlock the process: it runs again within
// seconds, is left neither stopped nor locked, and finishes with the checksum of an uninterrupted
// run. What only a GPU shows: that the driver lets a process other than the one that locked (and
// checkpointed) it restore and unlock it, and that the workload's results are exact after that.

// TestGuardianKillAfterLock kills `ptxmig checkpoint` right after the driver lock.
func TestGuardianKillAfterLock(t *testing.T) {
	guardianKill(t, "checkpoint", driverstep.StepLock, cudackpt.Locked)
}

// TestGuardianKillAfterCheckpoint kills `ptxmig checkpoint` right after the driver checkpoint
// (the GPU memory is in host memory, the GPU released).
func TestGuardianKillAfterCheckpoint(t *testing.T) {
	guardianKill(t, "checkpoint", driverstep.StepCheckpoint, cudackpt.Checkpointed)
}

// TestGuardianKillMigrateAfterCheckpoint kills `ptxmig migrate --gpu 1` right after the driver
// checkpoint: the guardian restores the process onto its source GPU.
func TestGuardianKillMigrateAfterCheckpoint(t *testing.T) {
	guardianKill(t, "migrate", driverstep.StepCheckpoint, cudackpt.Checkpointed)
}

func guardianKill(t *testing.T, verb, step string, wantState cudackpt.State) {
	gpus := 1
	if verb == "migrate" {
		gpus = 2
	}
	need(t, gpus)
	ref := referenceAsync(t, "counter", "--mib", "256", "--steps", "60", "--interval-ms", "0", "--device", "0")
	p := start(t, "counter", counterArgs(60, 0)...)
	waitLine(t, p.log, "step 10 ", 60*time.Second)

	dir := filepath.Join(out, "gputest", t.Name())
	jdir, logs := filepath.Join(dir, "journal"), filepath.Join(dir, "logs")
	args := []string{"--store", filepath.Join(out, "gputest", "store"), verb}
	if verb == "migrate" {
		args = append(args, "--gpu", "1")
	} else {
		args = append(args, "--name", fmt.Sprintf("guardian-%s-%d", step, time.Now().UnixNano()))
	}
	drv, err := cudackpt.Open()
	if err != nil {
		t.Fatal(err)
	}
	t0 := killAfterStep(t, append(args, strconv.Itoa(p.pid)), step, jdir, logs, func() {
		st, err := drv.State(p.pid)
		if wantState == cudackpt.Checkpointed {
			// A checkpointed process is left stopped, the thread the driver would ask too (package
			// hold): the driver's state is not asked for, so that the call cannot hang.
			if !errors.Is(err, cudackpt.ErrStopped) {
				t.Fatalf("after %s the workload is %v (%v), want stopped, its GPU state checkpointed", step, st, err)
			}
			return
		}
		if err != nil || st != wantState {
			t.Fatalf("after %s the workload is %v (%v), want %v", step, st, err, wantState)
		}
	})
	// The guardian: the journal goes once it has restored and unlocked the process.
	for {
		js, err := journal.List(jdir)
		st, serr := drv.State(p.pid)
		if err == nil && len(js) == 0 && serr == nil && st == cudackpt.Running {
			break
		}
		if time.Since(t0) > 60*time.Second {
			t.Fatalf("60 s after the kill: journals %v (%v), workload %v (%v)", js, err, st, serr)
		}
		time.Sleep(10 * time.Millisecond)
	}
	back := time.Since(t0)
	t.Logf("SIGKILL of ptxmig %s right after %s: the workload runs again %s later", verb, step, back.Round(time.Millisecond))
	if back > 10*time.Second {
		t.Errorf("the guardian took %s to bring the workload back", back)
	}
	if s, err := procfs.ReadStat(p.pid); err != nil || s.Stopped() {
		t.Fatalf("workload %d after the guardian: %+v, %v", p.pid, s, err)
	}
	if g := gpuOf(t, p.pid); g != 0 {
		t.Errorf("workload on GPU %d after the guardian, want its source GPU 0", g)
	}
	reports, _ := filepath.Glob(filepath.Join(logs, "recovered-*", "report.txt"))
	for _, r := range reports {
		b, _ := os.ReadFile(r)
		t.Logf("guardian's report %s:\n%s", r, b)
		if !strings.Contains(string(b), "rolled-back") {
			t.Errorf("report %s does not say rolled back", r)
		}
	}
	if len(reports) != 1 {
		t.Errorf("%d guardian reports, want 1", len(reports))
	}
	_ = os.WriteFile(filepath.Join(out, "guardian-"+verb+"-"+step+".txt"),
		[]byte(fmt.Sprintf("SIGKILL of ptxmig %s right after %s: running again after %s\n", verb, step, back)), 0o644)
	waitExit(t, p.pid, 3*time.Minute)
	sameResults(t, results(p.log), <-ref)
}

// killAfterStep runs ptxmig with args, stopping itself right after step (op.FaultStopAfter), its
// journal in jdir and logs in logs; once it is stopped it runs check (may be nil), then kills it
// with SIGKILL and returns the time of the kill, when the guardian takes over.
func killAfterStep(t *testing.T, args []string, step, jdir, logs string, check func()) time.Time {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), op.FaultStopAfter+"="+step, "PTXMIG_JOURNAL_DIR="+jdir, "PTXMIG_LOG_DIR="+logs)
	var so bytes.Buffer
	cmd.Stdout, cmd.Stderr = &so, &so
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(5 * time.Millisecond) {
		if s, err := procfs.ReadStat(cmd.Process.Pid); err == nil && s.Stopped() {
			break
		}
		select {
		case <-exited:
			t.Fatalf("ptxmig %v exited before stopping after %s:\n%s", args, step, so.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("ptxmig %v did not stop after %s", args, step)
		}
	}
	if check != nil {
		check()
	}
	t0 := time.Now()
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-exited
	return t0
}
