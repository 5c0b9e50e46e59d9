package checkpoint_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testproc"
)

// What ptxmig reports must match what happened: for each kind of failure the real binary runs on a
// real process with real CRIU, and the exit status, the --json document's kind, rolled_back and
// process_state, and the process's real state (read from /proc) must agree.

// errDoc is the --json error document.
type errDoc struct {
	ExitCode     int    `json:"exit_code"`
	Kind         string `json:"kind"`
	RolledBack   bool   `json:"rolled_back"`
	ProcessState string `json:"process_state"`
	Error        string `json:"error"`
}

// jsonRun runs ptxmig --json with args; it sends sig to ptxmig once it has started the operation's
// CRIU (0: no signal). It returns the exit status and the document on stdout.
func (r *faultRig) jsonRun(t *testing.T, sig syscall.Signal, args ...string) (int, errDoc, string) {
	t.Helper()
	cmd := exec.Command(r.bin, append([]string{"--store", r.f.st.Dir(), "--json"}, args...)...)
	var so, se bytes.Buffer
	cmd.Stdout, cmd.Stderr = &so, &se
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if sig != 0 {
		go func() {
			for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
				for _, s := range proc.Group(0) {
					if s.Comm == "criu" && s.PPID == cmd.Process.Pid && s.PGID == s.PID { // the operation's CRIU, not a probe
						_ = cmd.Process.Signal(sig)
						return
					}
				}
			}
		}()
	}
	err := cmd.Wait()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	var d errDoc
	if code != 0 {
		if jerr := json.Unmarshal(so.Bytes(), &d); jerr != nil {
			t.Fatalf("ptxmig %v: exit %d without a JSON error document (%v):\n%s\n%s", args, code, jerr, so.String(), se.String())
		}
		if d.ExitCode != code {
			t.Fatalf("ptxmig %v: exit %d, document says %d", args, code, d.ExitCode)
		}
	}
	return code, d, se.String()
}

// realState is what /proc says of pid: running, stopped or gone.
func realState(pid int) string {
	reapZombies()
	s, err := proc.ReadStat(pid)
	switch {
	case err != nil || s.Zombie():
		return "gone"
	case s.Stopped():
		return "stopped"
	}
	return "running"
}

// TestExitStatusMatchesState: refused (3), rolled back after a stalled CRIU (4), a restore
// interrupted by SIGINT once CRIU runs (130 before anything was touched, else 4) and a missing
// process (6): each status, document and real state agree, and nothing is lost.
func TestExitStatusMatchesState(t *testing.T) {
	r := newFaultRig(t)
	p, m := r.f.startMiB(t, "state", 256)
	pid := strconv.Itoa(p.PID)
	if code, _, se := r.jsonRun(t, 0, "checkpoint", "--leave-running", "--name", "taken", pid); code != 0 {
		t.Fatalf("first checkpoint: exit %d\n%s", code, se)
	}

	// Refused before anything: the name is taken.
	code, d, _ := r.jsonRun(t, 0, "checkpoint", "--name", "taken", pid)
	if code != 3 || d.Kind != "refused" || d.RolledBack || realState(p.PID) != "running" {
		t.Fatalf("refused: exit %d, %+v, process %s", code, d, realState(p.PID))
	}

	// Rolled back: CRIU stalls mid-dump (stopped), the watchdog ends it, the tree runs on.
	cmdDone := make(chan struct{})
	go func() {
		defer close(cmdDone)
		code, d, _ = r.jsonRun(t, 0, "checkpoint", "--criu-stall", "1s", "--name", "stalled", pid)
	}()
	// The CRIU to stop is the child of the ptxmig just started.
	stopped := 0
	for deadline := time.Now().Add(30 * time.Second); stopped == 0 && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		for _, s := range proc.Group(0) {
			if s.Comm == "criu" && s.PGID == s.PID && proc.Comm(s.PPID) == "ptxmig" {
				if log := criuLog(s.PID); log != "" && strings.HasSuffix(log, "dump.log") {
					if syscall.Kill(s.PID, syscall.SIGSTOP) == nil {
						stopped = s.PID
					}
				}
			}
		}
	}
	<-cmdDone
	if stopped == 0 {
		t.Fatal("no CRIU was stopped")
	}
	if code != 4 || d.Kind != "rolled-back" || !d.RolledBack || !strings.Contains(d.ProcessState, "running") ||
		!strings.Contains(d.Error, "made no progress") || realState(p.PID) != "running" {
		t.Fatalf("stalled CRIU: exit %d, %+v, process %s", code, d, realState(p.PID))
	}
	now, _ := testproc.ReadState(p.StateFile)
	advancesExactly(t, p.StateFile, m, now.Step, 3)

	// A restore interrupted once its CRIU runs: 130 if nothing was touched, 4 after a rollback;
	// never a bare failure. The process is not left half-restored, the image restores after.
	if code, _, se := r.jsonRun(t, 0, "checkpoint", "--name", "img", pid); code != 0 {
		t.Fatalf("checkpoint: exit %d\n%s", code, se)
	}
	<-p.Exited()
	at, _ := testproc.ReadState(p.StateFile)
	code, d, se := r.jsonRun(t, syscall.SIGINT, "restore", "img")
	r.settle(t)
	switch {
	case code == 0:
		t.Logf("the restore was done before SIGINT landed")
	case code == 130 && d.Kind == "interrupted" && realState(p.PID) == "gone":
		t.Logf("restore interrupted before it touched anything: exit 130")
	case code == 4 && d.Kind == "rolled-back" && d.RolledBack && realState(p.PID) == "gone" && strings.Contains(d.Error, "interrupted"):
		t.Logf("restore interrupted and rolled back: exit 4: %s", d.Error)
	default:
		t.Fatalf("interrupted restore: exit %d, %+v, process %s\n%s", code, d, realState(p.PID), se)
	}
	if code != 0 {
		if code, _, se := r.jsonRun(t, 0, "restore", "img"); code != 0 {
			t.Fatalf("restore after the interrupted one: exit %d\n%s", code, se)
		}
	}
	t.Cleanup(func() { _ = testproc.KillPID(p.PID, 10*time.Second) })
	advancesExactly(t, p.StateFile, m, at.Step, 3)

	// No such process.
	if code, d, _ := r.jsonRun(t, 0, "checkpoint", "999999"); code != 6 || d.Kind != "not-found" {
		t.Fatalf("missing process: exit %d, %+v", code, d)
	}
}
