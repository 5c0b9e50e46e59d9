package checkpoint_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/cudackpt/cudackpttest"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/store"
)

// The crash helper: a checkpoint of HELPER_PID (app_owned under the shim) into the store at
// HELPER_STORE, run by this test binary in a child process that stops itself after a step
// (op.FaultStopAfter), so that the test can SIGKILL it there, as ptxmig killed at that point.
const crashHelperEnv = "PTXMIG_TEST_CRASH_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(crashHelperEnv) == "1" {
		os.Exit(crashHelper())
	}
	if os.Getenv(denyIOURingEnv) == "1" {
		os.Exit(denyIOURingExec())
	}
	os.Exit(m.Run())
}

func crashHelper() int {
	pid, err := strconv.Atoi(os.Getenv("HELPER_PID"))
	if err != nil {
		return 2
	}
	ctx := context.Background()
	d, text, err := criu.NewDumper(ctx)
	if err != nil {
		return 3
	}
	st, err := store.Open(os.Getenv("HELPER_STORE"))
	if err != nil {
		return 4
	}
	env := &op.Env{CRIU: d, CRIUVersion: text, Store: st, Euid: 0, Host: op.ReadHostInfo(nil),
		Log:      slog.New(slog.NewTextHandler(os.Stderr, nil)),
		Driver:   cudackpttest.NewReal("GPU-00000000-0000-0000-0000-000000000000", nil, pid),
		UsesCUDA: func(p int) (bool, error) { return p == pid, nil }}
	_, err = checkpoint.Run(ctx, env, checkpoint.Options{PID: pid, Name: os.Getenv("HELPER_NAME"), StagingRoot: os.Getenv("HELPER_STAGING")})
	if err != nil {
		return 1
	}
	return 0
}

// TestOwnedMemoryCrashAfterRelease: ptxmig killed after it saved a process's owned device memory
// into the image being written and released it, before the image committed (the memory's only
// copy is then in the store's staged chunks). The recovery (what the guardian and `ptxmig
// recover` run) loads it back from the rescue record the save step left, and the process runs on
// with all its memory. The image is the second of the app (region B comes by reference from the
// first, region A from the staged chunks), so both kinds of chunk are read back.
func TestOwnedMemoryCrashAfterRelease(t *testing.T) {
	f := setup(t)
	a := startOwned(t, f, "owned")
	drv := cudackpttest.NewReal("GPU-00000000-0000-0000-0000-000000000000", nil, a.pid)
	f.env.Driver, f.env.DriverErr = drv, nil
	f.env.UsesCUDA = func(pid int) (bool, error) { return pid == a.pid, nil }
	if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: a.pid, Name: "base", LeaveRunning: true, StagingRoot: f.stage}); err != nil {
		t.Fatalf("first checkpoint: %v", err)
	}
	a.waitSteps(t, 3)
	jdir := filepath.Join(f.dir, "journal")
	if err := os.Mkdir(jdir, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PTXMIG_JOURNAL_DIR", jdir)

	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), crashHelperEnv+"=1", "HELPER_PID="+strconv.Itoa(a.pid), "HELPER_STORE="+f.st.Dir(),
		"HELPER_NAME=crash", "HELPER_STAGING="+f.stage)
	exited, _ := startStopped(t, cmd, shimstep.StepSaveMemory, 60*time.Second)
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-exited

	// Killed: the app is held, its memory released (its only copy in the uncommitted image).
	held := a.step(t)
	time.Sleep(300 * time.Millisecond) // 15 steps of the app, were it running
	if st := memStatus(t, a.pid); !st.Released || a.step(t) != held {
		t.Fatalf("after the kill: shim %+v, app at step %d (was %d); want it held with its memory released", st, a.step(t), held)
	}
	if _, err := f.st.Get("crash"); err == nil {
		t.Fatal("the image committed: the kill came too late to test anything")
	}

	rep, err := op.Recover(context.Background(), op.RecoverOptions{Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Driver: func() (op.Driver, error) { return drv, nil }})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Operations) != 1 || rep.Operations[0].Outcome != op.RecoveredRolledBack {
		t.Fatalf("recovery: %+v", rep)
	}
	t.Logf("recovery: %q", rep.Operations[0].Actions)
	a.waitSteps(t, 5) // running again, every region checked by the app each step
	if st := memStatus(t, a.pid); st.Released {
		t.Fatalf("after the recovery: shim %+v", st)
	}
	if _, err := f.st.ReadRescue(context.Background(), "crash", store.RescueKey(a.pid)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the rescue record after the recovery that used it: %v, want it removed", err)
	}
	// The next checkpoint works as ever.
	if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: a.pid, Name: "after", LeaveRunning: true, StagingRoot: f.stage}); err != nil {
		t.Fatalf("checkpoint after the recovery: %v", err)
	}
	a.waitSteps(t, 3)
	if _, err := f.st.Verify(context.Background(), "after"); err != nil {
		t.Fatalf("verify: %v", err)
	}
}
