package main

import (
	"encoding/json"
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

// TestAnotherHostCLI: the move to another host with ptxmig's commands only, two stores standing
// in for the two hosts: checkpoint --carry-files → image export → image import → restore, with
// the job's log directory absent "there". The dry run names the file it will put in place; the
// restored job appends to it, counting on.
func TestAnotherHostCLI(t *testing.T) {
	dir := criuCLITest(t, "checkpoint needs root (CRIU)")
	log := filepath.Join(dir, "job", "job.log")
	if err := os.Mkdir(filepath.Dir(log), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bash", "-c", `exec 3>>"$1"; i=0; while :; do i=$((i+1)); echo $i >&3; sleep 0.05; done`, "bash", log)
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
	last := func() int {
		b, _ := os.ReadFile(log)
		f := strings.Fields(string(b))
		if len(f) == 0 {
			return 0
		}
		n, _ := strconv.Atoi(f[len(f)-1])
		return n
	}
	waitFor(t, "the job", func() bool { return last() >= 3 })
	a, b := filepath.Join(dir, "storeA"), filepath.Join(dir, "storeB")
	exp := filepath.Join(dir, "job.ptxmig")
	for _, args := range [][]string{
		{"--store", a, "checkpoint", "--carry-files", "--name", "job", strconv.Itoa(pid)},
		{"--store", a, "image", "export", "job", "-o", exp},
		{"--store", b, "image", "import", exp},
	} {
		if so, se, code := runCLI(t, args...); code != 0 {
			t.Fatalf("ptxmig %q: exit %d\n%s%s", args, code, so, se)
		}
	}
	at := last()
	if err := os.Rename(filepath.Dir(log), filepath.Join(dir, "job.source-host")); err != nil {
		t.Fatal(err)
	}
	so, se, code := runCLI(t, "--store", b, "restore", "--dry-run", "job")
	if code != 0 || !strings.Contains(so, "put the carried "+log) {
		t.Fatalf("dry run: exit %d\n%s%s", code, so, se)
	}
	so, se, code = runCLI(t, "--store", b, "--json", "restore", "job")
	if code != 0 {
		t.Fatalf("restore: exit %d\n%s%s", code, so, se)
	}
	var res struct {
		PID    int  `json:"pid"`
		Stream bool `json:"stream"`
		Placed []struct {
			Path string `json:"path"`
		} `json:"placed_files"`
	}
	if err := json.Unmarshal([]byte(so), &res); err != nil || res.PID != pid || !res.Stream || len(res.Placed) != 1 || res.Placed[0].Path != log {
		t.Fatalf("restore result %s (%v)", so, err)
	}
	waitFor(t, "the restored job", func() bool { return last() >= at+5 })
	b2, _ := os.ReadFile(log)
	for i, f := range strings.Fields(string(b2)) {
		if f != strconv.Itoa(i+1) {
			t.Fatalf("log line %d is %q:\n%s", i+1, f, b2)
		}
	}
}
