package checkpoint_test

import (
	"context"
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

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/cudackpt/cudackpttest"
	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

// Owned device memory through the real shim, the fake driver (its VMM modelled on host memory:
// an access to released memory fails the app), real CRIU and the real store, with the driver
// steps faked (cudackpttest): the app (shim/tests/apps/app_owned.c) checks all its memory every
// step, so a region lost, stale or mixed up ends it with "BAD".

type ownedApp struct {
	pid   int
	state string
	out   string
}

// ownedBuild builds the shim, the fake driver and the app with shim/Makefile.
func ownedBuild(t *testing.T) (shim, fake, app string) {
	t.Helper()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := exec.LookPath("cc"); err != nil {
		testreq.Skip(t, "cc", "no C compiler for the shim and the fake driver")
	}
	cmd := exec.Command("make", "-s", "-C", filepath.Join(root, "shim"), "../bin/libptxmig.so", "build/app_owned")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build the shim and app_owned: %v\n%s", err, out)
	}
	return filepath.Join(root, "bin", "libptxmig.so"), filepath.Join(root, "shim", "build", "fake"), filepath.Join(root, "shim", "build", "app_owned")
}

// startOwned starts app_owned under the shim and the fake driver (env: more of its environment).
func startOwned(t *testing.T, f *fixture, name string, env ...string) *ownedApp {
	t.Helper()
	shim, fake, app := ownedBuild(t)
	dir := filepath.Join(f.dir, name)
	if err := os.MkdirAll(filepath.Join(dir, "sock"), 0o700); err != nil {
		t.Fatal(err)
	}
	a := &ownedApp{state: filepath.Join(dir, "state"), out: filepath.Join(dir, "out")}
	out, err := os.Create(a.out)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	null, _ := os.Open(os.DevNull)
	defer null.Close()
	cmd := exec.Command(app)
	cmd.Env = append(os.Environ(), "LD_PRELOAD="+shim, "LD_LIBRARY_PATH="+fake, "PTXMIG_LIBCUDA="+filepath.Join(fake, "libcuda.so.1"),
		"PTXMIG_OWNED_MEMORY=1", "PTXMIG_PREEMPT=off", "PTXMIG_SOCKET_DIR="+filepath.Join(dir, "sock"),
		"APP_STATE="+a.state, "STEP_MS=20")
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = null, out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait() }()
	a.pid = cmd.Process.Pid
	t.Cleanup(func() { _ = testproc.KillPID(a.pid, 5*time.Second) })
	a.waitSteps(t, 3)
	return a
}

// step returns the app's last step, failing the test when it reported bad memory.
func (a *ownedApp) step(t *testing.T) int {
	t.Helper()
	b, _ := os.ReadFile(a.state)
	f := strings.Fields(string(b))
	if len(f) >= 3 && f[2] == "BAD" {
		out, _ := os.ReadFile(a.out)
		t.Fatalf("app_owned: %s (output: %s)", strings.TrimSpace(string(b)), out)
	}
	if len(f) < 2 {
		return 0
	}
	n, _ := strconv.Atoi(f[1])
	return n
}

func (a *ownedApp) waitSteps(t *testing.T, n int) int {
	t.Helper()
	from := a.step(t)
	deadline := time.Now().Add(20 * time.Second)
	for {
		if s := a.step(t); s >= from+n {
			return s
		}
		if time.Now().After(deadline) {
			out, _ := os.ReadFile(a.out)
			t.Fatalf("app_owned stuck at step %d (output: %s)", a.step(t), out)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func ownedOf(t *testing.T, reports []*shimstep.PreemptReport, pid int) *shimstep.OwnedMemory {
	t.Helper()
	for _, r := range reports {
		if r.PID == pid && r.Owned != nil {
			return r.Owned
		}
	}
	t.Fatalf("no owned-memory report for pid %d", pid)
	return nil
}

// TestOwnedMemoryCheckpointRestore: --leave-running (everything copied, then loaded back from the
// image being written), again (region B and the pitched region unchanged: referenced, not
// copied), then a checkpoint that ends the app and a restore that loads it back.
func TestOwnedMemoryCheckpointRestore(t *testing.T) {
	f := setup(t)
	a := startOwned(t, f, "owned")
	out, _ := os.ReadFile(a.out)
	for _, want := range []string{"range A base 6291456", "ipc B 801"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("app output lacks %q (pointer queries of owned memory):\n%s", want, out)
		}
	}
	drv := cudackpttest.NewReal("GPU-00000000-0000-0000-0000-000000000000", nil, a.pid)
	f.env.Driver, f.env.DriverErr = drv, nil
	f.env.UsesCUDA = func(pid int) (bool, error) { return pid == a.pid, nil }
	ck := func(name string, leave bool) *checkpoint.Result {
		t.Helper()
		res, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: a.pid, Name: name, LeaveRunning: leave, StagingRoot: f.stage})
		if err != nil {
			t.Fatalf("checkpoint %s: %v", name, err)
		}
		return res
	}
	r1 := ck("own-1", true)
	m1 := ownedOf(t, r1.Preemption, a.pid)
	// A 6 MiB, B 10 MiB, P 300 rows of 4096 bytes (1.2 MiB): owned; C (4 KiB) is the driver's.
	const owned = 6<<20 + 10<<20 + 300*4096
	if m1.Save == nil || m1.Save.OwnedBytes != owned || m1.Save.CopiedBytes != owned || m1.Save.Regions != 3 || m1.Load == nil || m1.Load.Bytes != owned || m1.Released {
		t.Fatalf("first checkpoint: %+v, save %+v, load %+v", m1, m1.Save, m1.Load)
	}
	a.waitSteps(t, 3)
	r2 := ck("own-2", true)
	m2 := ownedOf(t, r2.Preemption, a.pid)
	if m2.Save.Prev != "own-1" || m2.Save.SkippedBytes != 10<<20+300*4096 || m2.Save.CopiedBytes != 6<<20 {
		t.Fatalf("second checkpoint: save %+v; want A copied, B and P referenced from own-1", m2.Save)
	}
	a.waitSteps(t, 3)
	ck("own-3", false)
	waitGone(t, a.pid)
	res := f.restore(t, "own-3")
	lm := ownedOf(t, res.Preemption, a.pid)
	if lm.Load == nil || lm.Load.Bytes != owned {
		t.Fatalf("restore: owned memory %+v", lm)
	}
	a.waitSteps(t, 5)
	// The images verify; the second holds B by reference.
	for _, name := range []string{"own-1", "own-2", "own-3"} {
		if _, err := f.st.Verify(context.Background(), name); err != nil {
			t.Fatalf("verify %s: %v", name, err)
		}
	}
}

// TestOwnedMemoryRollback: a failure after the owned memory was saved and released (at the
// lock, the dump, the store) rolls back to a running app with all its memory, loaded back from
// the image that was being written; the driver is back to running.
func TestOwnedMemoryRollback(t *testing.T) {
	injected := errors.New("injected")
	for _, step := range []string{driverstep.StepLock, checkpoint.StepDump, checkpoint.StepStore} {
		for _, leave := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/leave=%v", step, leave), func(t *testing.T) {
				f := setup(t)
				a := startOwned(t, f, "owned")
				drv := cudackpttest.NewReal("GPU-00000000-0000-0000-0000-000000000000", nil, a.pid)
				f.env.Driver, f.env.DriverErr = drv, nil
				f.env.UsesCUDA = func(pid int) (bool, error) { return pid == a.pid, nil }
				f.env.Hook = func(_ context.Context, s string) error {
					if s == step {
						return injected
					}
					return nil
				}
				_, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: a.pid, Name: "fail", LeaveRunning: leave, StagingRoot: f.stage})
				if !errors.Is(err, injected) {
					t.Fatalf("err = %v, want the injected failure", err)
				}
				if st := drv.Get(a.pid).State; st != cudackpt.Running {
					t.Errorf("driver state %v, want running", st)
				}
				a.waitSteps(t, 5)
			})
		}
	}
}

func waitGone(t *testing.T, pid int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		var ws syscall.WaitStatus
		_, _ = syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err != nil {
			return
		}
	}
	t.Fatalf("pid %d still there after the checkpoint", pid)
}
