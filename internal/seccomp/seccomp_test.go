package seccomp

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
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
	case "conflict":
		os.Exit(conflict())
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

// conflict gives one thread a filter of its own (no TSYNC), which the other threads lack, and
// then calls DenyIOURing from another thread: TSYNC cannot bring that thread onto the new filter,
// so the kernel refuses the whole filter, and DenyIOURing must say so.
func conflict() int {
	ready := make(chan error)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread keeps its filter and stays
		err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
		if err == nil {
			allow := []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW}}
			prog := unix.SockFprog{Len: 1, Filter: &allow[0]}
			if _, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, uintptr(unsafe.Pointer(&prog))); e != 0 {
				err = e
			}
		}
		ready <- err
		select {}
	}()
	if err := <-ready; err != nil {
		fmt.Println("install:", fmt.Errorf("%w: a thread's own filter: %v", ErrNotSupported, err))
		return 1
	}
	_, err := DenyIOURing()
	fmt.Println("deny:", err)
	fmt.Println("self:", setup())
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

// runHelper runs this test binary as the helper of mode and returns its output; it skips where
// the kernel has no seccomp filters.
func runHelper(t *testing.T, mode string) []byte {
	t.Helper()
	c := exec.Command(os.Args[0], "-test.run=^$")
	c.Env = append(os.Environ(), helperEnv+"="+mode)
	out, err := c.CombinedOutput()
	if err != nil {
		if strings.Contains(string(out), ErrNotSupported.Error()) {
			t.Skipf("no seccomp filters here: %s", out)
		}
		t.Fatalf("helper %s: %v\n%s", mode, err, out)
	}
	return out
}

// TestDenyIOURing: with the filter, io_uring_setup says ENOSYS in the process and in what it
// starts afterwards, and other calls still work. The kernel must offer io_uring without the
// filter, else the test proves nothing.
func TestDenyIOURing(t *testing.T) {
	if got := setup(); got != "ok" {
		t.Skipf("this kernel gives no io_uring without the filter (%s: sysctl kernel.io_uring_disabled, or a seccomp profile): nothing to deny", got)
	}
	out := runHelper(t, "deny")
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

// TestDenyIOURingTSYNCRefused: when a thread of the process cannot take the filter (it has a
// filter of its own), the kernel installs it nowhere and returns that thread's id, not an errno;
// DenyIOURing must report an error, not a filter that is not there.
func TestDenyIOURingTSYNCRefused(t *testing.T) {
	if got := setup(); got != "ok" {
		t.Skipf("this kernel gives no io_uring without the filter (%s): nothing to deny", got)
	}
	out := runHelper(t, "conflict")
	if strings.Contains(string(out), "deny: <nil>\n") {
		t.Fatalf("DenyIOURing reported success though a thread could not take the filter:\n%s", out)
	}
	if !strings.Contains(string(out), "thread") {
		t.Errorf("the error does not name the thread that refused:\n%s", out)
	}
	if !strings.Contains(string(out), "self: ok\n") {
		t.Errorf("the kernel installed the filter after all, the test proves nothing:\n%s", out)
	}
}
