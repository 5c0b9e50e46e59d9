package checkpoint_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/restore"
	"github.com/ptxmig/ptxmig/store"
)

// stallBound is the CRIU stall bound these tests set: short, so that a stalled CRIU is ended soon.
const stallBound = 1500 * time.Millisecond

// stopCRIU watches for a CRIU started by parent and sends it SIGSTOP once its log
// (found through its open descriptors) holds marker: CRIU then hangs mid-operation as it did on a
// VM whose hardware breakpoints never fired. The returned channel gives the stopped CRIU's pid
// (0 when none was stopped within 30 s, or CRIU was done before its log said marker).
func stopCRIU(parent int, marker string) <-chan int {
	out := make(chan int, 1)
	go func() {
		defer close(out)
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			for _, s := range proc.Group(0) {
				if s.Comm != "criu" || s.PPID != parent || s.PGID != s.PID {
					continue
				}
				if log := criuLog(s.PID); log != "" {
					if b, err := os.ReadFile(log); err == nil && strings.Contains(string(b), marker) {
						if syscall.Kill(s.PID, syscall.SIGSTOP) == nil {
							out <- s.PID
						}
						return
					}
				}
			}
		}
	}()
	return out
}

// criuLog is the path of the *.log file CRIU pid has open ("" when none yet).
func criuLog(pid int) string {
	dir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if t, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && strings.HasSuffix(t, ".log") && strings.HasPrefix(t, "/") {
			return t
		}
	}
	return ""
}

// goneSoon fails unless pid (a CRIU the watchdog killed) is gone within a few seconds.
func goneSoon(t *testing.T, pid int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		reapZombies()
		if s, err := proc.ReadStat(pid); err != nil || s.Zombie() {
			return
		}
		if time.Now().After(deadline) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("CRIU (pid %d) still exists after its watchdog fired", pid)
		}
	}
}

// TestCRIUStallDump stops CRIU with SIGSTOP while it moves the tree's pages: its watchdog ends
// it once it has made no progress for the bound, the checkpoint rolls back (the tree runs on,
// exactly, nothing is stored, no CRIU is left) and says why; a second checkpoint then succeeds.
// Streamed and staged.
func TestCRIUStallDump(t *testing.T) {
	for _, noStream := range []bool{false, true} {
		t.Run(map[bool]string{false: "stream", true: "no-stream"}[noStream], func(t *testing.T) {
			f := setup(t)
			f.env.CRIUStall = stallBound
			p, m := f.startMiB(t, "state", 256)
			stopped := stopCRIU(os.Getpid(), "page-xfer")
			t0 := time.Now()
			_, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: p.PID, Name: "stalled", StagingRoot: f.stage,
				NoStream: noStream, LeaveRunning: true})
			took := time.Since(t0)
			cpid := <-stopped
			if cpid == 0 {
				t.Fatalf("no CRIU was stopped mid-dump (the dump of 256 MiB ended before its log said page-xfer?): %v", err)
			}
			var se *op.StepError
			if !errors.Is(err, criu.ErrStalled) || !errors.As(err, &se) || se.Step != checkpoint.StepDump || !se.RolledBack() {
				t.Fatalf("checkpoint with a stopped CRIU: %v; want a rolled-back dump step with criu.ErrStalled", err)
			}
			if !strings.Contains(err.Error(), "made no progress for 1.5s") {
				t.Errorf("the error does not give the bound: %v", err)
			}
			// Not a speed target: a rollback that waited for anything but the watchdog (a package
			// timeout, the guardian's 10 minutes) would take far longer than this.
			if took > stallBound+20*time.Second {
				t.Errorf("the rollback took %s with a %s bound", took, stallBound)
			}
			goneSoon(t, cpid)
			noneStoppedPIDs(t, []int{p.PID})
			now, _ := testproc.ReadState(p.StateFile)
			advancesExactly(t, p.StateFile, m, now.Step, 5)
			if _, err := f.st.Get("stalled"); !errors.Is(err, store.ErrNotFound) {
				t.Fatalf("image after the stalled dump: %v", err)
			}
			if ents, _ := os.ReadDir(f.stage); len(ents) != 0 {
				t.Errorf("staging not cleaned: %v", ents)
			}
			if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: p.PID, Name: "after", StagingRoot: f.stage,
				NoStream: noStream, LeaveRunning: true}); err != nil {
				t.Fatalf("checkpoint after the stall: %v", err)
			}
		})
	}
}

// TestCRIUStallRestore stops CRIU with SIGSTOP while it restores the tree's memory: the watchdog
// ends it, whatever it had restored is ended, the restore rolls back (exit status 4's condition),
// the image stays, and a second restore continues the process exactly.
func TestCRIUStallRestore(t *testing.T) {
	for _, noStream := range []bool{false, true} {
		t.Run(map[bool]string{false: "stream", true: "no-stream"}[noStream], func(t *testing.T) {
			f := setup(t)
			f.env.CRIUStall = stallBound
			p, m := f.startMiB(t, "state", 256)
			if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: p.PID, Name: "img", StagingRoot: f.stage}); err != nil {
				t.Fatal(err)
			}
			<-p.Exited()
			at, _ := testproc.ReadState(p.StateFile)
			stopped := stopCRIU(os.Getpid(), "Opened local page read")
			_, err := restore.Run(context.Background(), f.env, restore.Options{Image: "img", StagingRoot: f.stage, NoStream: noStream})
			cpid := <-stopped
			if cpid == 0 {
				t.Fatalf("no CRIU was stopped mid-restore: %v", err)
			}
			var se *op.StepError
			if !errors.Is(err, criu.ErrStalled) || !errors.As(err, &se) || se.Step != restore.StepCRIURestore || !se.RolledBack() {
				t.Fatalf("restore with a stopped CRIU: %v; want a rolled-back criu-restore step with criu.ErrStalled", err)
			}
			goneSoon(t, cpid)
			for deadline := time.Now().Add(10 * time.Second); proc.Exists(p.PID); time.Sleep(10 * time.Millisecond) {
				reapZombies()
				if time.Now().After(deadline) {
					t.Fatalf("pid %d (half restored) still exists after the stalled restore rolled back", p.PID)
				}
			}
			if _, err := f.st.Get("img"); err != nil {
				t.Fatalf("the image is gone after a failed restore: %v", err)
			}
			f.env.CRIUStall = 0
			r := f.restore(t, "img")
			if r.PID != p.PID {
				t.Fatalf("restored pid %d, want %d", r.PID, p.PID)
			}
			advancesExactly(t, p.StateFile, m, at.Step, 5)
		})
	}
}

// TestGuardianEndsStalledCRIU: ptxmig is killed while its CRIU hangs mid-dump (stopped): the
// guardian holds CRIU to the operation's bound (--criu-stall, recorded in the journal), kills it,
// and rolls the checkpoint back; the process runs on exactly, no CRIU is left.
func TestGuardianEndsStalledCRIU(t *testing.T) {
	r := newFaultRig(t)
	f := r.f
	p, m := f.startMiB(t, "state", 256)
	cmd := exec.Command(r.bin, "--store", f.st.Dir(), "checkpoint", "--criu-stall", "2s", "--name", "guarded", strconv.Itoa(p.PID))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	cpid := <-stopCRIU(cmd.Process.Pid, "page-xfer")
	_ = cmd.Process.Signal(syscall.SIGKILL)
	_ = cmd.Wait()
	if cpid == 0 {
		t.Fatalf("no CRIU was stopped mid-dump:\n%s", out.String())
	}
	r.settle(t)
	goneSoon(t, cpid)
	if rep := lastReport(); !strings.Contains(rep, "no progress for 2s") {
		t.Errorf("the recovery report does not say that CRIU was ended for making no progress:\n%s", rep)
	}
	if !aliveReaped(p.PID) {
		t.Fatalf("the process died:\n%s", lastReport())
	}
	noneStoppedPIDs(t, []int{p.PID})
	now, _ := testproc.ReadState(p.StateFile)
	advancesExactly(t, p.StateFile, m, now.Step, 5)
	if _, err := f.st.Get("guarded"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("image after the rolled-back checkpoint: %v", err)
	}
}

// TestCgroupKillThenRecover: a service manager kills the whole cgroup of a ptxmig checkpoint
// (`systemctl stop`, a unit's timeout) after the dump stopped the process and before the image
// was stored, and the guardian dies too: it lives in proc.KeepCgroup, out of that kill's reach
// (TestGuardianSurvivesGroupKill), so here it is killed beside it, as a kill of a container's
// whole cgroup or a host without cgroup v2 would take it. Nothing is left to roll it back: the
// process stays stopped with no image. What ptxmig-recover.service runs (`ptxmig recover`, from
// the failed unit's OnFailure=) then resumes it exactly; no image is left.
func TestCgroupKillThenRecover(t *testing.T) {
	r := newFaultRig(t)
	dir, cgFD := testproc.ServiceCgroup(t)
	p, m := r.f.startMiB(t, "state", 4)
	cmd := exec.Command(r.bin, "--store", r.f.st.Dir(), "checkpoint", "--name", "killed", strconv.Itoa(p.PID))
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: cgFD}
	exited, _ := startStopped(t, cmd, checkpoint.StepDump, 30*time.Second)
	guardian := 0
	for _, c := range proc.Children(cmd.Process.Pid) {
		if proc.Comm(c) == "ptxmig-guardian" {
			guardian = c
		}
	}
	if cg, err := proc.Cgroup(guardian); guardian == 0 || err != nil || cg != proc.KeepCgroup {
		t.Fatalf("ptxmig's guardian (pid %d) is in cgroup %q (%v), want %s", guardian, cg, err, proc.KeepCgroup)
	}
	if err := syscall.Kill(guardian, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := testproc.KillCgroup(dir); err != nil {
		t.Fatal(err)
	}
	<-exited
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		reapZombies()
		if b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs")); len(strings.TrimSpace(string(b))) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the cgroup is not empty after cgroup.kill")
		}
	}
	if st := realState(p.PID); st != "stopped" {
		t.Fatalf("after the cgroup kill the process is %s; this test is about the one left stopped", st)
	}
	if so, code := r.cli(t, "recover"); code != 0 {
		t.Fatalf("ptxmig recover: exit %d\n%s", code, so)
	}
	if st := realState(p.PID); st != "running" {
		t.Fatalf("after ptxmig recover the process is %s", st)
	}
	now, _ := testproc.ReadState(p.StateFile)
	advancesExactly(t, p.StateFile, m, now.Step, 5)
	if _, err := r.f.st.Get("killed"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("image after the recovery: %v", err)
	}
	r.settle(t)
}
