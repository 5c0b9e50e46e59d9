package checkpoint_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/cudackpt/cudackpttest"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/internal/testreq"
	"github.com/ptxmig/ptxmig/restore"
	"github.com/ptxmig/ptxmig/store"
)

// shellCounter starts the repro: a bash loop that counts into a file and forks a sleep
// child every 50 ms. setsid makes the shell a session leader; without it the tree belongs to
// the test's session (a shell job).
func shellCounter(t *testing.T, dir string, setsid bool) (pid int, counter string) {
	t.Helper()
	counter = filepath.Join(dir, "count")
	script := `i=0; while :; do i=$((i+1)); echo $i > ` + counter + `; sleep 0.05; done`
	cmd := exec.Command("bash", "-c", script)
	null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	cmd.Stdin, cmd.Stdout, cmd.Stderr = null, null, null
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: setsid}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait() }()
	pid = cmd.Process.Pid
	t.Cleanup(func() { killTree(pid) })
	waitCount(t, counter, 3)
	return pid, counter
}

func killTree(root int) {
	if tree, err := proc.Tree(root); err == nil {
		_ = proc.Kill(proc.PIDs(tree), 5*time.Second)
	}
}

// readCount is the last number in a counter file (one number) or a log (one a line).
func readCount(path string) int {
	b, _ := os.ReadFile(path)
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	n, _ := strconv.Atoi(f[len(f)-1])
	return n
}

// waitCount waits until the counter reaches at least n and returns it.
func waitCount(t *testing.T, path string, n int) int {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		if c := readCount(path); c >= n {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("counter %s stuck at %d, want >= %d", path, readCount(path), n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// noneStopped fails when a pid of tree is left stopped (the bug: children left in state T).
func noneStopped(t *testing.T, tree []op.TreeProc) {
	t.Helper()
	for _, p := range tree {
		if s, err := proc.ReadStat(p.PID); err == nil && s.Stopped() {
			t.Errorf("pid %d (%s) left stopped", p.PID, p.Comm)
		}
	}
}

// TestShellTreeCheckpointRestore: a shell with children checkpoints (the whole tree is saved and
// ended: no stopped strays), restores under the same pids, and keeps counting from where it was.
func TestShellTreeCheckpointRestore(t *testing.T) {
	for _, setsid := range []bool{true, false} {
		t.Run(map[bool]string{true: "session leader", false: "shell job"}[setsid], func(t *testing.T) {
			f := setup(t)
			pid, counter := shellCounter(t, f.dir, setsid)
			res, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: "tree", StagingRoot: f.stage})
			if self, _ := proc.ReadStat(os.Getpid()); !setsid && self.SID == 0 {
				// This test runs in a session whose leader is outside its PID namespace (a CI
				// runner, docker exec), and so does the shell job: CRIU cannot dump it, and the
				// preflight must refuse it before anything is frozen.
				if !errors.Is(err, op.ErrRefused) || !strings.Contains(err.Error(), "outside this PID namespace") {
					t.Fatalf("shell job in session 0: %v, want a refusal", err)
				}
				before := readCount(counter)
				waitCount(t, counter, before+3)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if res.ShellJob == setsid || (res.ShellJobReason == "") == !setsid {
				t.Errorf("shell job %v (%q), want %v", res.ShellJob, res.ShellJobReason, !setsid)
			}
			if res.Tree[0].PID != pid {
				t.Fatalf("tree %+v does not start at %d", res.Tree, pid)
			}
			for _, p := range res.Tree {
				if proc.Alive(p.PID) {
					t.Errorf("pid %d (%s) still alive after the checkpoint", p.PID, p.Comm)
				}
			}
			atDump := readCount(counter)
			time.Sleep(200 * time.Millisecond)
			if c := readCount(counter); c != atDump {
				t.Fatalf("counter moved from %d to %d after the checkpoint ended the tree", atDump, c)
			}
			m, err := f.st.Get("tree")
			if err != nil {
				t.Fatal(err)
			}
			d, err := imagedesc.Read(m)
			tree := d.Processes()
			if err != nil || len(tree) != len(res.Tree) {
				t.Fatalf("manifest tree %+v (%v), want %d processes", tree, err, len(res.Tree))
			}
			r := f.restore(t, "tree")
			t.Cleanup(func() { killTree(r.PID) })
			if r.PID != pid {
				t.Fatalf("restored as %d, want %d", r.PID, pid)
			}
			if c := waitCount(t, counter, atDump+5); c < atDump {
				t.Fatalf("counter restarted: %d < %d", c, atDump)
			}
			noneStopped(t, r.Tree)
		})
	}
}

// TestShellTreeRollback: a store failure after the dump resumes every process of the tree, not
// just the root, and the counter keeps counting.
func TestShellTreeRollback(t *testing.T) {
	f := setup(t)
	pid, counter := shellCounter(t, f.dir, true)
	f.env.Hook = func(_ context.Context, step string) error {
		if step == checkpoint.StepStore {
			return errors.New("injected store failure")
		}
		return nil
	}
	_, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: "never", StagingRoot: f.stage})
	var fl *op.Failure
	if !errors.As(err, &fl) || !fl.RolledBack() {
		t.Fatalf("err = %v, want a rolled-back failure", err)
	}
	tree, _ := proc.Tree(pid)
	noneStopped(t, op.TreeOf(tree, nil))
	c := readCount(counter)
	waitCount(t, counter, c+5)
}

// TestFakeDriverSteps runs checkpoint and restore of a real process through real CRIU with the
// fake driver standing in for its CUDA state: every failure point ends with the process running
// and the driver's state back at running, and the driver calls are the ones the design says.
// The process has a second thread that reads a mapping the fake driver takes away at its
// checkpoint and gives back at its restore, as the driver does with a CUDA process's device
// mappings (a JAX process died of it): the process survives every case only if no thread of it
// but the driver's runs between the two (package hold).
func TestFakeDriverSteps(t *testing.T) {
	injected := errors.New("injected")
	tests := []struct {
		name         string
		leaveRunning bool
		driverFail   string // fake driver call that fails once
		hookFail     string // step failed by the hook
		wantCalls    []string
		wantErr      bool
	}{
		{name: "checkpoint and end", wantCalls: []string{"lock", "checkpoint"}},
		{name: "leave running", leaveRunning: true, wantCalls: []string{"lock", "checkpoint", "restore", "unlock"}},
		{name: "lock fails", driverFail: "lock", wantErr: true, wantCalls: []string{"lock"}},
		{name: "checkpoint fails", driverFail: "checkpoint", wantErr: true, wantCalls: []string{"lock", "checkpoint", "unlock"}},
		{name: "dump fails", hookFail: checkpoint.StepDump, wantErr: true, wantCalls: []string{"lock", "checkpoint", "restore", "unlock"}},
		{name: "store fails", hookFail: checkpoint.StepStore, wantErr: true, wantCalls: []string{"lock", "checkpoint", "restore", "unlock"}},
		{name: "leave running, store fails", leaveRunning: true, hookFail: checkpoint.StepStore, wantErr: true,
			wantCalls: []string{"lock", "checkpoint", "restore", "unlock"}},
	}
	// Streamed (the default), and staged (--no-stream: CRIU's own --leave-running keeps a process
	// that was stopped before the dump stopped after it).
	for _, staged := range []bool{false, true} {
		for _, tt := range tests {
			if staged {
				tt.name += ", staged"
			}
			t.Run(tt.name, func(t *testing.T) {
				fakeDriverCase(t, staged, tt.leaveRunning, tt.driverFail, tt.hookFail, tt.wantCalls, tt.wantErr, injected)
			})
		}
	}
}

func fakeDriverCase(t *testing.T, staged, leaveRunning bool, driverFail, hookFail string, wantCalls []string, wantErr bool, injected error) {
	t.Helper()
	{
		{
			f := setup(t)
			p, err := testproc.StartUVM(f.bin, f.dir, testproc.Options{MiB: 2, IntervalMs: 5})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = p.Kill() })
			m := testproc.NewModel(2)
			drv := cudackpttest.NewReal("GPU-00000000-0000-0000-0000-000000000000", nil, p.PID)
			drv.Procs[p.PID].UVM = p.UVM
			f.env.Driver, f.env.DriverErr = drv, nil
			f.env.UsesCUDA = func(pid int) (bool, error) { return pid == p.PID, nil }
			if driverFail != "" {
				drv.FailNext[driverFail] = injected
			}
			f.env.Hook = func(_ context.Context, step string) error {
				if step == hookFail {
					return injected
				}
				return nil
			}
			res, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: p.PID, Name: "fake", LeaveRunning: leaveRunning, StagingRoot: f.stage, NoStream: staged})
			if !leaveRunning && !wantErr {
				select {
				case <-p.Exited():
				case <-time.After(10 * time.Second):
					t.Fatal("the checkpointed process did not end")
				}
			}
			if (err != nil) != wantErr {
				t.Fatalf("err = %v, wantErr %v", err, wantErr)
			}
			if !reflect.DeepEqual(drv.Calls, wantCalls) {
				t.Errorf("driver calls %q, want %q", drv.Calls, wantCalls)
			}
			if wantErr || leaveRunning {
				if st := drv.Get(p.PID).State; st != cudackpt.Running {
					t.Errorf("driver state %v after the checkpoint, want running", st)
				}
				now, _ := testproc.ReadState(p.StateFile)
				advancesExactly(t, p.StateFile, m, now.Step, 5)
				return
			}
			if res.Kind != op.KindCUDA || len(res.Tree) != 1 || !res.Tree[0].CUDA {
				t.Errorf("result kind %s tree %+v", res.Kind, res.Tree)
			}
			<-p.Exited()
			atDump, _ := testproc.ReadState(p.StateFile)
			// A failed driver restore kills the restored process and leaves the image intact.
			drv.FailNext["restore"] = injected
			_, err = restore.Run(context.Background(), f.env, restore.Options{Image: "fake", StagingRoot: f.stage, NoStream: staged})
			var fl *op.Failure
			if !errors.As(err, &fl) || !fl.RolledBack() || testproc.Alive(p.PID) {
				t.Fatalf("failed driver restore: err %v, alive %v; want rolled back, nothing running", err, testproc.Alive(p.PID))
			}
			drv.Procs[p.PID].State = cudackpt.Checkpointed // the process restored again is checkpointed again
			r := f.restore(t, "fake")
			if st := drv.Get(r.PID).State; st != cudackpt.Running {
				t.Errorf("driver state %v after restore, want running", st)
			}
			advancesExactly(t, p.StateFile, m, atDump.Step, 5)
		}
	}
}

// TestRestoreRefusesTTYImage: an image whose processes had a controlling terminal is refused
// before anything is materialized (CRIU would need the restorer's own terminal to hand them).
func TestRestoreRefusesTTYImage(t *testing.T) {
	f := setup(t)
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "core-1.img"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	// In the layout ptxmig wrote before typed descriptions, and in the current one.
	metas := map[string]store.Metadata{
		"tty-legacy": store.Metadata(`{"kind":"cpu","pid":4000000,"extra":{"criu.shell_job":"true","criu.tty":"true"}}`),
	}
	var err error
	if metas["tty"], err = (&imagedesc.Description{Kind: op.KindCPU, PID: 4000000, TTY: true, ShellJob: true}).Encode(); err != nil {
		t.Fatal(err)
	}
	for name, meta := range metas {
		if _, _, err := f.st.Put(context.Background(), src, store.PutOptions{Name: name, Meta: meta}); err != nil {
			t.Fatal(err)
		}
		_, err := restore.Run(context.Background(), f.env, restore.Options{Image: name, StagingRoot: f.stage})
		if !errors.Is(err, op.ErrRefused) || !strings.Contains(err.Error(), "controlling terminal") {
			t.Fatalf("restore of a tty image (%s): %v, want a refusal naming the terminal", name, err)
		}
	}
	if ents, _ := os.ReadDir(f.stage); len(ents) != 0 {
		t.Errorf("the refusal left staging: %v", ents)
	}
}

// TestCheckpointRefusesTTY: a process with a controlling terminal (here under script(1)) is
// refused before anything is frozen, since its image could not be restored.
func TestCheckpointRefusesTTY(t *testing.T) {
	f := setup(t)
	script, err := exec.LookPath("script")
	if err != nil {
		testreq.Skip(t, "script", "script(1) (util-linux) makes the pseudo-terminal: %v", err)
	}
	cmd := exec.Command(script, "-qfc", "sleep 60", "/dev/null")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { killTree(cmd.Process.Pid); _ = cmd.Wait() })
	var sleeper int
	for deadline := time.Now().Add(10 * time.Second); sleeper == 0; time.Sleep(20 * time.Millisecond) {
		if tree, err := proc.Tree(cmd.Process.Pid); err == nil && len(tree) > 1 && tree[1].TTY != 0 {
			sleeper = tree[1].PID
		}
		if time.Now().After(deadline) {
			t.Fatal("script(1) started no process on a terminal")
		}
	}
	_, err = checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: sleeper, Name: "tty", StagingRoot: f.stage})
	if !errors.Is(err, op.ErrRefused) || !strings.Contains(err.Error(), "controlling terminal") {
		t.Fatalf("checkpoint of a process on a terminal: %v, want a refusal", err)
	}
	if s, err := proc.ReadStat(sleeper); err != nil || s.Stopped() {
		t.Errorf("the refusal touched pid %d: %+v %v", sleeper, s, err)
	}
}
