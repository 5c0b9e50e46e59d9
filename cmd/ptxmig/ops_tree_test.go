package main

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

// TestTreeReprosCLI replays the operation-core issue's repros through the CLI with real CRIU: a
// shell-started counter tree checkpoints with no stopped strays and restores counting on; every
// refusal exits 3 before anything is frozen or written.
func TestTreeReprosCLI(t *testing.T) {
	dir := criuCLITest(t, "checkpoint needs root (CRIU)")
	store := filepath.Join(dir, "store")
	count := filepath.Join(dir, "c")
	start := func() int {
		// The count is written in place at a fixed width (`1<>`: no truncation), so the file has
		// the same size whenever CRIU records it open: a dump that catches the shell mid-write
		// must not leave an image whose recorded size the file has lost (restore would refuse).
		cmd := exec.Command("bash", "-c", "i=0; while :; do i=$((i+1)); printf '%010d\\n' $i 1<>"+count+"; sleep 0.05; done")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go func() { _ = cmd.Wait() }()
		pid := cmd.Process.Pid
		t.Cleanup(func() {
			if tr, err := proc.Tree(pid); err == nil {
				_ = proc.Kill(proc.PIDs(tr), 5*time.Second)
			}
		})
		waitFor(t, "the counter", func() bool { return readInt(count) >= 3 })
		return pid
	}
	cli := func(args ...string) (string, string, int) {
		return runCLI(t, append([]string{"--store", store}, args...)...)
	}
	pid := start()
	treeBefore, _ := proc.Tree(pid)

	// Refusals before anything: the process is never stopped, no image is written.
	so, se, code := cli("checkpoint", "--dry-run", strconv.Itoa(pid))
	if code != 0 || !strings.Contains(so, "dry run") || !strings.Contains(so, "end every process of the tree") {
		t.Fatalf("dry run: exit %d\n%s%s", code, so, se)
	}
	for _, tt := range []struct {
		args []string
		code int
	}{
		{[]string{"checkpoint", "--name", "", strconv.Itoa(pid)}, 2},
		{[]string{"checkpoint", "--name", "abcdef12", strconv.Itoa(pid)}, 2},
		{[]string{"checkpoint", strconv.Itoa(pid), "--name", "../x"}, 2},
		{[]string{"checkpoint", strconv.Itoa(os.Getppid())}, 3},
	} {
		if _, se, code := cli(tt.args...); code != tt.code {
			t.Errorf("ptxmig %q: exit %d (%s), want %d", tt.args, code, se, tt.code)
		}
	}
	so, _, code = cli("--json", "checkpoint", "--name", "c1", strconv.Itoa(pid))
	if code != 0 {
		t.Fatalf("checkpoint: exit %d: %s", code, so)
	}
	var res struct {
		Tree []struct{ PID int } `json:"tree"`
	}
	if err := json.Unmarshal([]byte(so), &res); err != nil || len(res.Tree) < 2 {
		t.Fatalf("checkpoint result %s (%v), want the shell and its children", so, err)
	}
	for _, p := range append(res.Tree, struct{ PID int }{treeBefore[0].PID}) {
		if proc.Alive(p.PID) {
			t.Errorf("pid %d survived the checkpoint (state %c)", p.PID, proc.State(p.PID))
		}
	}
	atDump := readInt(count)

	// The name is taken now: refused before the second tree is frozen.
	pid2 := start()
	if _, se, code := cli("checkpoint", "--name", "c1", strconv.Itoa(pid2)); code != 3 || !strings.Contains(se, "exists") ||
		!strings.Contains(se, "remove it with: ptxmig --store "+store+" image rm c1") {
		t.Errorf("taken name: exit %d (%s), want 3", code, se)
	}
	if s, err := proc.ReadStat(pid2); err != nil || s.Stopped() {
		t.Errorf("the refused checkpoint touched pid %d: %+v %v", pid2, s, err)
	}
	if tr, err := proc.Tree(pid2); err == nil {
		_ = proc.Kill(proc.PIDs(tr), 5*time.Second)
	}

	// --cgroup: a cgroup that does not exist is refused (3); one that does is the plan's target.
	if _, se, code := cli("restore", "--cgroup", "/ptxmig-test-no-such-cgroup", "c1"); code != 3 || !strings.Contains(se, "does not exist") {
		t.Errorf("restore --cgroup (missing): exit %d (%s), want 3", code, se)
	}
	if own, err := proc.Cgroup(os.Getpid()); err == nil && own != "" {
		so, se, code := cli("--json", "restore", "--dry-run", "c1", "--cgroup", own)
		var dry struct {
			Plan struct {
				Cgroup       string `json:"cgroup"`
				CgroupReason string `json:"cgroup_reason"`
			} `json:"plan"`
		}
		if err := json.Unmarshal([]byte(so), &dry); code != 0 || err != nil || dry.Plan.Cgroup != own || dry.Plan.CgroupReason != "as asked" {
			t.Errorf("restore --dry-run --cgroup %s: exit %d, plan %+v (%v)\n%s%s", own, code, dry.Plan, err, so, se)
		}
	}
	if so, se, code := cli("restore", "c1"); code != 0 {
		t.Fatalf("restore: exit %d\n%s%s", code, so, se)
	}
	waitFor(t, "the restored counter", func() bool { return readInt(count) >= atDump+5 })
	for _, p := range res.Tree {
		if s, err := proc.ReadStat(p.PID); err == nil && s.Stopped() {
			t.Errorf("restored pid %d is stopped", p.PID)
		}
	}
}

// criuCLITest prepares a test that runs checkpoints and restores through the CLI with real CRIU
// (skipping, with why, without root or CRIU): restored trees become the test's to reap, locks
// and failure logs go to its temporary directory, which it returns.
func criuCLITest(t *testing.T, why string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "%s", why)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, _, err := criu.Check(ctx); err != nil {
		testreq.Skip(t, "criu", "no usable CRIU: %v", err)
	}
	_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	dir := t.TempDir()
	t.Setenv("PTXMIG_LOCK_DIR", filepath.Join(dir, "locks"))
	t.Setenv("PTXMIG_LOG_DIR", filepath.Join(dir, "logs"))
	return dir
}

func readInt(path string) int {
	b, _ := os.ReadFile(path)
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}
