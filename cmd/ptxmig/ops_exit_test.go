package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/ptxmig/ptxmig/internal/testreq"
)

// TestCheckpointExitCodes checks usage errors and preflight refusals through the CLI.
func TestCheckpointExitCodes(t *testing.T) {
	t.Setenv("PTXMIG_LOCK_DIR", t.TempDir())
	store := filepath.Join(t.TempDir(), "store")
	tests := []struct {
		args []string
		want int
		msg  string
	}{
		{[]string{"checkpoint"}, 2, "want PID, got 0"},
		{[]string{"checkpoint", "abc"}, 2, "positive integer"},
		{[]string{"checkpoint", "abc", "--leave-running"}, 2, "positive integer"},
		{[]string{"checkpoint", "4194304", "--bogus"}, 2, "flag provided but not defined: -bogus"},
		{[]string{"checkpoint", "--lock-timeout", "-1s", "42"}, 2, "--lock-timeout"},
		{[]string{"migrate", "--lock-timeout", "-1s", "--gpu", "1", "42"}, 2, "--lock-timeout"},
		{[]string{"--store", store, "checkpoint", "4194304"}, 6, "no running process"},
		{[]string{"--store", store, "checkpoint", "4194304", "--name", "abcd"}, 2, "image id"},
		{[]string{"restore", "--gpu", "x", "img"}, 2, "--gpu"},
		{[]string{"restore", "--gpu-map", "a", "img"}, 2, "--gpu-map"},
		{[]string{"--store", store, "restore", "no-such-image"}, 6, "does not exist"},
		{[]string{"restore", "--cgroup", "system.slice", "img"}, 2, "--cgroup: cgroup path \"system.slice\" is not absolute"},
		{[]string{"restore", "img", "--cgroup", "/a/../b"}, 2, "not clean"},
		{[]string{"--store", store, "restore", "--cgroup", "/ptxmig-no-such-cgroup", "no-such-image"}, 6, "does not exist"},
		{[]string{"migrate", "--gpu", "1", "0"}, 2, "positive integer"},
	}
	for _, tt := range tests {
		_, stderr, code := runCLI(t, tt.args...)
		if code != tt.want || !strings.Contains(stderr, tt.msg) {
			t.Errorf("ptxmig %v: exit %d, stderr %q; want %d and %q", tt.args, code, stderr, tt.want, tt.msg)
		}
	}
}

// TestCheckpointNonRoot runs the real binary as an unprivileged user: preflight refuses (3).
func TestCheckpointNonRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "switching to an unprivileged user needs root")
	}
	// t.TempDir's parent is private to root; the unprivileged user must reach the binary.
	dir, err := os.MkdirTemp("", "ptxmig-nonroot-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "ptxmig")
	if _, err := exec.LookPath("go"); err != nil {
		testreq.Skip(t, "go", "building ptxmig needs the go command: %v", err)
	}
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("cannot build ptxmig: %v: %s", err, out)
	}
	sleeper := exec.Command("sleep", "30")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sleeper.Process.Kill(); _ = sleeper.Wait() }()
	cmd := exec.Command(bin, "--store", filepath.Join(dir, "store"), "checkpoint", itoa(sleeper.Process.Pid))
	cmd.Env = append(os.Environ(), "PTXMIG_LOCK_DIR="+filepath.Join(dir, "locks"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	ee, ok := err.(*exec.ExitError)
	if !ok || ee.ExitCode() != 3 {
		t.Fatalf("non-root checkpoint: %v, output %s; want exit 3", err, out)
	}
	if !strings.Contains(string(out), "must run as root") {
		t.Errorf("message does not say root is needed: %s", out)
	}
	if _, err := os.Stat(filepath.Join(dir, "store")); !os.IsNotExist(err) {
		t.Errorf("a refused run created the store (%v)", err)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
