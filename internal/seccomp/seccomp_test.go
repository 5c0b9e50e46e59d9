package seccomp

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The helper: this test binary started again with helperEnv set installs the filter, tries
// io_uring_setup itself and in a child started after the filter (through exec), and prints what
// each got.
const helperEnv = "PTXMIG_TEST_SECCOMP_HELPER"

func TestMain(m *testing.M) {
	switch os.Getenv(helperEnv) {
	case "deny":
		os.Exit(helper())
	case "probe":
		fmt.Println(setup())
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// setup calls io_uring_setup(4, &params) and names its outcome: "ok" (an instance, closed
// again) or the errno's name.
func setup() string {
	var params [120]byte // struct io_uring_params
	fd, _, e := unix.Syscall(sysIOURingSetup, 4, uintptr(unsafe.Pointer(&params[0])), 0)
	if e != 0 {
		return unix.ErrnoName(e)
	}
	unix.Close(int(fd))
	return "ok"
}

func helper() int {
	newPrivs, err := DenyIOURing()
	if err != nil {
		fmt.Println("install:", err)
		return 1
	}
	fmt.Println("new privileges:", newPrivs)
	fmt.Println("self:", setup())
	fmt.Println("getpid works:", unix.Getpid() == os.Getpid())
	c := exec.Command(os.Args[0])
	c.Env = append(os.Environ(), helperEnv+"=probe")
	out, err := c.Output()
	if err != nil {
		fmt.Println("child:", err)
		return 1
	}
	fmt.Print("child: ", string(out))
	return 0
}

func TestFilterShape(t *testing.T) {
	f := Filter()
	// The one denial returns ENOSYS; the fall-through allows.
	last, allow := f[len(f)-1], f[len(f)-2]
	if last.K != unix.SECCOMP_RET_ERRNO|uint32(unix.ENOSYS) || allow.K != unix.SECCOMP_RET_ALLOW {
		t.Fatalf("filter ends %+v, %+v", allow, last)
	}
	// Every jump lands inside the program.
	for i, ins := range f {
		if ins.Code&0x07 == unix.BPF_JMP && (i+1+int(ins.Jt) >= len(f) || i+1+int(ins.Jf) >= len(f)) {
			t.Errorf("instruction %d jumps out of the program: %+v", i, ins)
		}
	}
}

// TestDenyIOURing: with the filter, io_uring_setup says ENOSYS in the process and in what it
// starts afterwards, and other calls still work. The kernel must offer io_uring without the
// filter, else the test proves nothing.
func TestDenyIOURing(t *testing.T) {
	if got := setup(); got != "ok" {
		t.Skipf("this kernel gives no io_uring without the filter (%s: sysctl kernel.io_uring_disabled, or a seccomp profile): nothing to deny", got)
	}
	c := exec.Command(os.Args[0], "-test.run=^$")
	c.Env = append(os.Environ(), helperEnv+"=deny")
	out, err := c.CombinedOutput()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) && strings.Contains(string(out), ErrNotSupported.Error()) {
			t.Skipf("no seccomp filters here: %s", out)
		}
		t.Fatalf("helper: %v\n%s", err, out)
	}
	for _, want := range []string{"self: ENOSYS", "getpid works: true", "child: ENOSYS"} {
		if !strings.Contains(string(out), want+"\n") {
			t.Errorf("helper output lacks %q:\n%s", want, out)
		}
	}
	if os.Geteuid() == 0 && !strings.Contains(string(out), "new privileges: true") {
		t.Errorf("as root the filter needs no no_new_privs:\n%s", out)
	}
	// The test process itself has no filter.
	if got := setup(); got != "ok" {
		t.Errorf("the filter leaked into the test process: io_uring_setup %s", got)
	}
}
