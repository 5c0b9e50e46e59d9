package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/cudackpt/cudackpttest"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testreq"
	"github.com/ptxmig/ptxmig/migrate"
	"github.com/ptxmig/ptxmig/restore"
	"github.com/ptxmig/ptxmig/store"
)

// roomyLister is two H200s with room to spare; pid runs on GPU 0.
type roomyLister struct{ pid int }

func (f roomyLister) Devices() ([]gpu.Device, error) {
	devs, _ := fakeLister(f).Devices()
	for i := range devs {
		devs[i].MemoryTotal = 100 << 30
	}
	return devs, nil
}

// setsidSleeper starts sleep(1) in a session of its own (no controlling terminal).
func setsidSleeper(t *testing.T) int {
	t.Helper()
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		testreq.Skip(t, "sleep", "no sleep(1) on this host")
	}
	cmd := exec.Command(sleep, "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd.Process.Pid
}

// TestPreflightDriverVersion: checkpoint, restore and migrate refuse up front, naming the
// minimum driver version, when the driver is known to be too old for what they would ask of it
// (>= 570 for a CUDA process, >= 580 when a GPU moves); a supported or unreadable version plans
// as before.
func TestPreflightDriverVersion(t *testing.T) {
	pid := setsidSleeper(t)
	const u0 = "GPU-00000000-0000-0000-0000-000000000000"

	dir := t.TempDir()
	t.Setenv("PTXMIG_LOCK_DIR", filepath.Join(dir, "locks"))
	st, err := store.Open(filepath.Join(dir, "store"))
	if err != nil {
		t.Fatal(err)
	}
	// A CUDA image of a pid that is free here, checkpointed on GPU 0 of two.
	src := filepath.Join(dir, "src")
	os.MkdirAll(src, 0o700)
	os.WriteFile(filepath.Join(src, "core-1.img"), []byte("x"), 0o600)
	const imgPID = 4194303
	devs, _ := roomyLister{pid}.Devices()
	var visible []imagedesc.GPU
	for _, d := range devs {
		visible = append(visible, imagedesc.GPU{Index: d.Index, UUID: d.UUID, Name: d.Name, ComputeCap: d.ComputeCap})
	}
	used := visible[0]
	used.MemoryBytes = 3 << 20
	meta, err := (&imagedesc.Description{Kind: op.KindCUDA, PID: imgPID, GPUs: []imagedesc.GPU{used}, Visible: visible,
		Tree: []op.TreeProc{{PID: imgPID, PPID: 1, Comm: "app", CUDA: true}}}).Encode()
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := st.Put(context.Background(), src, store.PutOptions{Name: "img", Meta: meta}); err != nil {
		t.Fatal(err)
	}

	newEnv := func(version string, verr error) *op.Env {
		return &op.Env{Driver: cudackpttest.New(u0, nil, pid), GPUs: roomyLister{pid}, CRIU: &criu.Dumper{Bin: "/nonexistent/criu"},
			Store: st, Euid: 0, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
			UsesCUDA:      func(p int) (bool, error) { return p == pid, nil },
			DriverVersion: func() (string, error) { return version, verr }}
	}
	plans := []struct {
		name string
		plan func(env *op.Env) error
	}{
		{"checkpoint", func(env *op.Env) error {
			_, err := PlanCheckpoint(context.Background(), env, Options{PID: pid, Name: "ck", StagingRoot: filepath.Join(dir, "staging")})
			return err
		}},
		{"restore onto its GPU", func(env *op.Env) error {
			_, err := restore.PlanRestore(context.Background(), env, restore.Options{Image: "img", StagingRoot: filepath.Join(dir, "staging")})
			return err
		}},
		{"restore onto another GPU", func(env *op.Env) error {
			_, err := restore.PlanRestore(context.Background(), env, restore.Options{Image: "img", GPUs: []int{1}, StagingRoot: filepath.Join(dir, "staging")})
			return err
		}},
		{"migrate", func(env *op.Env) error {
			_, err := migrate.PlanMigrate(context.Background(), env, migrate.Options{PID: pid, GPUs: []int{1}})
			return err
		}},
	}
	const ok = ""
	tests := []struct {
		version string
		err     error
		want    [4]string // per plan: "" plans, else the refusal's text
	}{
		{"550.54.14", nil, [4]string{"needs NVIDIA driver >= 570 (found 550.54.14)", "needs NVIDIA driver >= 570 (found 550.54.14)",
			"needs NVIDIA driver >= 570 (found 550.54.14)", "needs NVIDIA driver >= 580 (found 550.54.14)"}},
		{"575.51.03", nil, [4]string{ok, ok, "image img: restore onto another GPU (GPU pairs: restore --gpu, migrate, rebalance) needs NVIDIA driver >= 580 (found 575.51.03)", "migrate: restore onto another GPU (GPU pairs: restore --gpu, migrate, rebalance) needs NVIDIA driver >= 580 (found 575.51.03)"}},
		{"580.95.05", nil, [4]string{ok, ok, ok, ok}},
		{"", gpu.ErrNoDriver, [4]string{ok, ok, ok, ok}}, // cannot tell: the driver's calls decide, as before
		{"unparsable", nil, [4]string{ok, ok, ok, ok}},
	}
	for _, tt := range tests {
		for i, p := range plans {
			err := p.plan(newEnv(tt.version, tt.err))
			switch want := tt.want[i]; {
			case want == ok && err != nil:
				t.Errorf("driver %q (%v), %s: %v; want a plan", tt.version, tt.err, p.name, err)
			case want != ok && (!errors.Is(err, op.ErrRefused) || !strings.Contains(err.Error(), want)):
				t.Errorf("driver %q, %s: %v; want a refusal with %q", tt.version, p.name, err, want)
			}
		}
	}
}

// TestTakenNameHint: the refusal of a taken --name prints the command that removes the image,
// with --store when the store is not the default one.
func TestTakenNameHint(t *testing.T) {
	pid := setsidSleeper(t)
	dir := t.TempDir()
	st, err := store.Open(filepath.Join(dir, "store"))
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(dir, "src")
	os.MkdirAll(src, 0o700)
	if _, _, err := st.Put(context.Background(), src, store.PutOptions{Name: "taken"}); err != nil {
		t.Fatal(err)
	}
	env := &op.Env{CRIU: &criu.Dumper{Bin: "/nonexistent/criu"}, Store: st, Euid: 0, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		UsesCUDA: func(int) (bool, error) { return false, nil }}
	_, err = PlanCheckpoint(context.Background(), env, Options{PID: pid, Name: "taken", StagingRoot: filepath.Join(dir, "staging")})
	want := "remove it with `ptxmig --store " + st.Dir() + " image rm taken`"
	if !errors.Is(err, op.ErrRefused) || !strings.Contains(err.Error(), want) {
		t.Errorf("taken name: %v; want a refusal with %s", err, want)
	}
}

// TestPlanChildEnded: a child that ends between reading the tree and reading its maps (a shell
// job's short-lived command) is left out of the plan, not a refusal; the same error on the root
// is still one.
func TestPlanChildEnded(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		testreq.Skip(t, "bash", "no bash on this host")
	}
	cmd := exec.Command(bash, "-c", "sleep 60 & wait; sleep 60 & wait")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); _ = cmd.Wait() })
	root := cmd.Process.Pid
	var child int
	for deadline := time.Now().Add(5 * time.Second); child == 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if tr, err := proc.Tree(root); err == nil && len(tr) == 2 {
			child = tr[1].PID
		}
	}
	if child == 0 {
		t.Fatal("bash did not start its child")
	}
	dir := t.TempDir()
	st, err := store.Open(filepath.Join(dir, "store"))
	if err != nil {
		t.Fatal(err)
	}
	gone := func(pid int) (bool, error) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		for deadline := time.Now().Add(5 * time.Second); proc.Alive(pid) && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
		}
		return false, fmt.Errorf("read /proc/%d/maps: %w", pid, syscall.ESRCH)
	}
	env := &op.Env{CRIU: &criu.Dumper{Bin: "/nonexistent/criu"}, Store: st, Euid: 0, Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	env.UsesCUDA = func(pid int) (bool, error) {
		if pid == child {
			return gone(pid)
		}
		return false, nil
	}
	p, err := PlanCheckpoint(context.Background(), env, Options{PID: root, Name: "ck", StagingRoot: filepath.Join(dir, "staging")})
	if err != nil {
		t.Fatalf("plan with a child that ended: %v", err)
	}
	if len(p.Tree) != 1 || p.Tree[0].PID != root {
		t.Errorf("tree %+v; want the root only", p.Tree)
	}
	// The same error on a child that is still there, or on the root, refuses.
	for _, who := range []string{"live child", "root"} {
		env.UsesCUDA = func(pid int) (bool, error) {
			if who == "root" || pid != root {
				return false, fmt.Errorf("read /proc/%d/maps: %w", pid, syscall.EACCES)
			}
			return false, nil
		}
		if who == "live child" {
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				// The first child, killed above, may still be listed until bash reaps it.
				if tr, err := proc.Tree(root); err == nil && len(tr) == 2 && tr[1].PID != child {
					break // bash started its second sleep
				}
				if time.Now().After(deadline) {
					t.Fatal("bash did not start its second child")
				}
			}
		}
		if _, err := PlanCheckpoint(context.Background(), env, Options{PID: root, Name: "ck", StagingRoot: filepath.Join(dir, "staging")}); !errors.Is(err, op.ErrRefused) {
			t.Errorf("%s's maps unreadable: %v; want a refusal", who, err)
		}
	}
}
