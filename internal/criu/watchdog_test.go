package criu

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/proc"
)

func TestBound(t *testing.T) {
	for in, want := range map[time.Duration]time.Duration{0: DefaultStall, -1: 0, -time.Hour: 0, time.Second: time.Second} {
		if got := Bound(in); got != want {
			t.Errorf("Bound(%s) = %s, want %s", in, got, want)
		}
	}
}

func TestIdleObserve(t *testing.T) {
	t0 := time.Unix(1000, 0)
	var i Idle
	steps := []struct {
		v    uint64
		at   time.Duration
		want time.Duration
	}{
		{5, 0, 0},
		{5, time.Second, time.Second},
		{5, 3 * time.Second, 3 * time.Second},
		{6, 4 * time.Second, 0}, // moved: idle again from here
		{6, 9 * time.Second, 5 * time.Second},
		{2, 10 * time.Second, 0}, // a change either way is progress (a helper exited)
	}
	for _, s := range steps {
		if got := i.Observe(s.v, t0.Add(s.at)); got != s.want {
			t.Fatalf("Observe(%d) at +%s = %s, want %s", s.v, s.at, got, s.want)
		}
	}
}

// startGroup starts a shell command as the leader of its own process group, as CRIU is started.
func startGroup(t *testing.T, script string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sh", "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); _ = cmd.Wait() })
	return cmd
}

// TestWatchdogKillsAStall: a process group that uses no CPU and writes no log (here a sleep, as
// a CRIU waiting for a trap that never fires) is killed once the bound has passed, group and all,
// and the error names the bound and the log's last line.
func TestWatchdogKillsAStall(t *testing.T) {
	log := filepath.Join(t.TempDir(), "dump.log")
	if err := os.WriteFile(log, []byte("(00.1) pie: 42: new_sp=0x1 ip 0x2\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := startGroup(t, "sleep 600 & sleep 600")
	w := watch(cmd.Process.Pid, log, 300*time.Millisecond, nil)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("the watchdog did not end a process group without progress")
	}
	err := w.stop()
	var se *StallError
	if !errors.As(err, &se) || !errors.Is(err, ErrStalled) || se.Bound != 300*time.Millisecond || !strings.Contains(se.Last, "new_sp") {
		t.Fatalf("stop = %v, want a *StallError with the bound and the log's last line", err)
	}
	for deadline := time.Now().Add(5 * time.Second); len(proc.Group(cmd.Process.Pid)) > 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the group's other process survived the watchdog: %+v", proc.Group(cmd.Process.Pid))
		}
	}
}

// TestWatchdogSparesProgress: a group that keeps working (CPU time, a growing log, the caller's
// counter) runs past several bounds; the watchdog stops without a word.
func TestWatchdogSparesProgress(t *testing.T) {
	for _, tc := range []struct {
		name   string
		script string
		extra  func() int64
	}{
		{"cpu", "while :; do :; done", nil},
		{"log", "while :; do echo step >> \"$LOG\"; sleep 0.05; done", nil},
		{"counter", "sleep 600", func() func() int64 {
			var n int64
			return func() int64 { n++; return n }
		}()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			log := filepath.Join(t.TempDir(), "dump.log")
			t.Setenv("LOG", log)
			cmd := startGroup(t, tc.script)
			w := watch(cmd.Process.Pid, log, 500*time.Millisecond, tc.extra)
			time.Sleep(2 * time.Second)
			if err := syscall.Kill(cmd.Process.Pid, 0); err != nil {
				t.Fatalf("a process making progress was killed: %v", err)
			}
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			_ = cmd.Wait()
			if err := w.stop(); err != nil {
				t.Fatalf("stop = %v after progress", err)
			}
		})
	}
}

// TestWatchdogOff: a negative stall option watches nothing.
func TestWatchdogOff(t *testing.T) {
	cmd := startGroup(t, "sleep 600")
	w := watch(cmd.Process.Pid, "", -1, nil)
	time.Sleep(200 * time.Millisecond)
	if err := syscall.Kill(cmd.Process.Pid, 0); err != nil {
		t.Fatalf("killed without a bound: %v", err)
	}
	if err := w.stop(); err != nil {
		t.Fatal(err)
	}
}

// TestSelfTest runs doctor's proof that CRIU works here: a real dump and restore of a sleeping
// process, which ends running, then gone; and CRIU (>= 4.2) says whether breakpoints fire.
func TestSelfTest(t *testing.T) {
	d := usableCRIU(t)
	_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) // the restored process comes back to this test
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dir := t.TempDir()
	res, err := RunSelfTest(ctx, d.Bin, dir, 10*time.Second)
	if err != nil {
		t.Fatalf("self-test: %v", err)
	}
	if res.Dump <= 0 || res.Restore <= 0 || res.Breakpoints == "" {
		t.Fatalf("result %+v", res)
	}
	if v, _, err := Version(ctx, d.Bin); err == nil && v >= 40200 && res.Breakpoints == BreakpointsUnknown {
		t.Errorf("CRIU %d answers `check --feature breakpoints`, but the self-test read no answer", v)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("scratch left behind: %v", ents)
	}
	for _, s := range proc.Group(0) {
		if s.PPID == os.Getpid() && s.Comm == "sleep" {
			t.Errorf("the test process (pid %d) outlived the self-test", s.PID)
		}
	}
	t.Logf("dump %s, restore %s, hardware breakpoints: %s", res.Dump, res.Restore, res.Breakpoints)
}
