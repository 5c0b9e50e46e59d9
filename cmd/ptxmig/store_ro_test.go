package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/proc"
)

// TestReadOnlyStoreCLI: a shared store mounted read-only serves every read — images, inspect,
// verify, extract, export and a restore's plan (which materializes nothing but reads the image) —
// while writes are refused (exit 3). The real binary runs in a private mount namespace where the
// store is bind-mounted read-only.
func TestReadOnlyStoreCLI(t *testing.T) {
	dir := criuCLITest(t, "a read-only bind mount and a checkpoint need root")
	st := filepath.Join(dir, "store")
	bin := filepath.Join(dir, "ptxmig")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	// A real process image: a sleeper checkpointed (it ends).
	sleeper := exec.Command("sleep", "300")
	sleeper.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = sleeper.Wait() }()
	pid := sleeper.Process.Pid
	t.Cleanup(func() { _ = proc.Kill([]int{pid}, 5*time.Second) })
	if out, errOut, code := runCLI(t, "--store", st, "checkpoint", "--name", "sleeper", strconv.Itoa(pid)); code != 0 {
		t.Fatalf("checkpoint: exit %d\n%s%s", code, out, errOut)
	}
	for deadline := time.Now().Add(10 * time.Second); proc.Alive(pid) && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	src := t.TempDir()
	os.WriteFile(filepath.Join(src, "f"), []byte("x"), 0o600)

	cases := []struct {
		args string
		code int
	}{
		{"images", 0},
		{"image inspect sleeper", 0},
		{"image verify", 0},
		{"image extract sleeper " + filepath.Join(dir, "out"), 0},
		{"image export -o " + filepath.Join(dir, "exp") + " sleeper", 0},
		{"restore --dry-run sleeper", 0},
		{"doctor", -1}, // any status: it must name the store read-only
		{"image rm sleeper", 3},
		{"image gc", 3},
		{"image add x " + src, 3},
		{"checkpoint --dry-run " + strconv.Itoa(os.Getpid()), 3},
	}
	script := fmt.Sprintf("mount --bind %[1]s %[1]s && mount -o remount,bind,ro %[1]s || exit 99\n", st)
	for i, c := range cases {
		script += fmt.Sprintf("%s --store %s %s >%s/out.%d 2>&1; echo \"$?\" >%s/rc.%d\n", bin, st, c.args, dir, i, dir, i)
	}
	cmd := exec.Command("sh", "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("read-only namespace: %v\n%s", err, out)
	}
	for i, c := range cases {
		rc, _ := os.ReadFile(filepath.Join(dir, fmt.Sprintf("rc.%d", i)))
		out, _ := os.ReadFile(filepath.Join(dir, fmt.Sprintf("out.%d", i)))
		code, _ := strconv.Atoi(strings.TrimSpace(string(rc)))
		switch {
		case c.code >= 0 && code != c.code:
			t.Errorf("read-only store: %s: exit %d, want %d\n%s", c.args, code, c.code, out)
		case c.code == 3 && !strings.Contains(string(out), "read-only"):
			t.Errorf("read-only store: %s: the refusal does not say why:\n%s", c.args, out)
		case c.args == "doctor" && !strings.Contains(string(out), "read-only"):
			t.Errorf("doctor does not report the read-only store:\n%s", out)
		}
	}
	// The store is untouched by all this: the image is still there, writable again outside.
	if _, errOut, code := runCLI(t, "--store", st, "image", "verify", "sleeper"); code != 0 {
		t.Errorf("verify afterwards: %s", errOut)
	}
}
