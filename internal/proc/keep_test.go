package proc_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testproc"
)

// keepHelperEnv makes this test binary the "ptxmig" of TestStartKeptSurvivesGroupKill: it starts
// `sleep` with StartKept, prints "PID KEPT" and waits on stdin.
const keepHelperEnv = "PTXMIG_TEST_KEEP_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(keepHelperEnv) == "1" {
		cmd, kept, err := proc.StartKept(func() *exec.Cmd {
			c := exec.Command("sleep", "120")
			c.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
			return c
		})
		if err != nil {
			fmt.Println("error", err)
			os.Exit(1)
		}
		fmt.Println(cmd.Process.Pid, kept)
		_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestStartKeptSurvivesGroupKill: a "ptxmig" in a cgroup of its own (a service's) starts a
// process with StartKept; the whole cgroup is then killed (cgroup.kill, as systemd's stop or an
// OOM group kill does): ptxmig dies, the kept process lives on, in KeepCgroup. Started with
// exec.Cmd.Start instead, it dies with the cgroup.
func TestStartKeptSurvivesGroupKill(t *testing.T) {
	svc, fd := testproc.ServiceCgroup(t)
	helper := exec.Command(os.Args[0], "-test.run=^$")
	helper.Env = append(os.Environ(), keepHelperEnv+"=1")
	helper.SysProcAttr = &syscall.SysProcAttr{Setsid: true, UseCgroupFD: true, CgroupFD: fd}
	stdin, err := helper.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stdin.Close()
	out, err := helper.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := helper.Start(); err != nil {
		t.Fatalf("start a process in a new cgroup (CLONE_INTO_CGROUP): %v", err)
	}
	t.Cleanup(func() { // before the cgroups are removed (ServiceCgroup's cleanup runs after)
		_ = helper.Process.Kill()
		_ = helper.Wait()
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("helper: %v (%q)", err, line)
	}
	var pid int
	var kept bool
	if _, err := fmt.Sscan(line, &pid, &kept); err != nil {
		t.Fatalf("helper said %q: %v", line, err)
	}
	t.Cleanup(func() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		_ = proc.WaitGone(context.Background(), pid, 5*time.Second)
	})
	if !kept {
		t.Fatalf("StartKept from cgroup %s did not keep the process (pid %d)", svc, pid)
	}
	if got, err := proc.Cgroup(pid); err != nil || got != proc.KeepCgroup {
		t.Fatalf("the kept process is in cgroup %q (%v), want %s", got, err, proc.KeepCgroup)
	}
	if err := testproc.KillCgroup(svc); err != nil {
		t.Fatal(err)
	}
	werr := helper.Wait()
	if ws, ok := helper.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("the helper was not killed with its cgroup: %v", werr)
	}
	time.Sleep(100 * time.Millisecond)
	if st, err := proc.ReadStat(pid); err != nil || st.Zombie() {
		t.Fatalf("the kept process died with ptxmig's cgroup: %+v %v", st, err)
	}
}
