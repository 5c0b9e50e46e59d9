package criu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/ptxmig/ptxmig/internal/proc"
)

// Breakpoints says whether CRIU found ptrace hardware breakpoints working on this machine.
type Breakpoints string

// What `criu check --feature breakpoints` answered.
const (
	BreakpointsWork    Breakpoints = "work"    // CRIU traps the parasite's return with them
	BreakpointsBroken  Breakpoints = "broken"  // they do not fire: CRIU >= 4.2 traps without them, older CRIU hangs
	BreakpointsUnknown Breakpoints = "unknown" // this CRIU cannot tell (< 4.2)
)

// SelfTest is the result of a real dump and restore of a tiny process.
type SelfTest struct {
	Dump        time.Duration
	Restore     time.Duration
	Breakpoints Breakpoints
}

// RunSelfTest proves that CRIU works on this machine instead of trusting `criu check`, which
// says "Looks good" where every dump hangs: it starts a sleeping process in a session of its
// own, dumps it into a scratch directory under dir, restores it, checks that it runs, and ends
// it. Each CRIU is held to stall (0: DefaultStall), the whole to ctx. The scratch directory is
// removed; nothing else is left behind.
func RunSelfTest(ctx context.Context, bin, dir string, stall time.Duration) (*SelfTest, error) {
	if stall <= 0 {
		stall = DefaultStall
	}
	res := &SelfTest{Breakpoints: HaveBreakpoints(ctx, bin)}
	scratch, err := os.MkdirTemp(dir, "ptxmig-criu-selftest-")
	if err != nil {
		return res, fmt.Errorf("scratch directory: %w", err)
	}
	defer os.RemoveAll(scratch)
	images := filepath.Join(scratch, "images")
	if err := os.Mkdir(images, 0o700); err != nil {
		return res, err
	}
	cmd := exec.Command("sleep", "600")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true} // no shell job: CRIU dumps it as a daemon
	if err := cmd.Start(); err != nil {
		return res, fmt.Errorf("start the test process: %w", err)
	}
	pid := cmd.Process.Pid
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	defer func() { _ = proc.Kill([]int{pid}, 5*time.Second) }()

	d := &Dumper{Bin: bin}
	r, err := d.Dump(ctx, DumpOptions{PID: pid, ImagesDir: images, Stall: stall})
	if err != nil {
		return res, fmt.Errorf("dump of a sleeping process: %w", err)
	}
	res.Dump = r.Duration
	// CRIU ends the dumped process; its pid must be free (reaped) before the restore takes it.
	select {
	case <-exited:
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(10 * time.Second):
		return res, fmt.Errorf("the dumped test process (pid %d) still runs 10 s after the dump", pid)
	}
	rr, err := d.Restore(ctx, RestoreOptions{ImagesDir: images, Stall: stall})
	if err != nil {
		return res, fmt.Errorf("restore of the dumped process: %w", err)
	}
	res.Restore = rr.Duration
	if rr.PID != pid {
		_ = proc.Kill([]int{rr.PID}, 5*time.Second)
		return res, fmt.Errorf("restore gave pid %d, want %d", rr.PID, pid)
	}
	if s, err := proc.ReadStat(pid); err != nil || s.Zombie() || s.Stopped() || s.Comm != "sleep" {
		return res, fmt.Errorf("the restored test process does not run (pid %d: %+v, %v)", pid, s, err)
	}
	return res, nil
}

// HaveBreakpoints asks CRIU (>= 4.2 can tell) whether ptrace hardware breakpoints fire here.
func HaveBreakpoints(ctx context.Context, bin string) Breakpoints {
	out, err := output(ctx, bin, "check", "--feature", "breakpoints")
	text := string(out)
	switch {
	case err == nil && strings.Contains(text, "is supported"):
		return BreakpointsWork
	case strings.Contains(text, "Unknown feature"):
		return BreakpointsUnknown
	case err != nil && errors.As(err, new(*exec.ExitError)):
		return BreakpointsBroken
	}
	return BreakpointsUnknown
}
