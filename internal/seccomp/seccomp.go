// Package seccomp installs the one seccomp filter ptxmig uses: io_uring_setup(2) fails with
// ENOSYS, as on a kernel built without io_uring, and every other system call is left alone.
//
// CRIU (4.2.1) cannot checkpoint an io_uring instance, and libuv (in PyTorch's TCPStore and
// torchrun's agent) creates one whenever the kernel offers it. Programs that use io_uring when it
// is there fall back to epoll or plain reads and writes when io_uring_setup says ENOSYS (libuv
// does). The filter is inherited by every child and across exec, and CRIU checkpoints and
// restores it with the process.
package seccomp

import (
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ErrNotSupported: the kernel or the architecture gives no seccomp filters.
var ErrNotSupported = errors.New("seccomp filters not supported")

// sysIOURingSetup is io_uring_setup's number. It came after the system call tables were unified
// (Linux 5.1), so it is 425 on every architecture ptxmig is built for, also for 32-bit (i386, arm)
// processes; x32 marks its calls with bit 30.
const (
	sysIOURingSetup = 425
	x32Bit          = 0x40000000
)

// arches are the GOARCH values whose kernel numbers io_uring_setup 425.
var arches = map[string]bool{"amd64": true, "arm64": true, "386": true, "arm": true, "riscv64": true,
	"ppc64le": true, "ppc64": true, "s390x": true, "loong64": true}

// Filter is the classic BPF program: seccomp_data.nr (offset 0) is io_uring_setup (native or
// x32) → ERRNO(ENOSYS), else ALLOW.
func Filter() []unix.SockFilter {
	const (
		ldAbsW = unix.BPF_LD | unix.BPF_W | unix.BPF_ABS
		jeqK   = unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K
		retK   = unix.BPF_RET | unix.BPF_K
	)
	return []unix.SockFilter{
		{Code: ldAbsW, K: 0},                                          // 0: A = nr
		{Code: jeqK, Jt: 2, Jf: 0, K: sysIOURingSetup},                // 1: → 4
		{Code: jeqK, Jt: 1, Jf: 0, K: x32Bit | sysIOURingSetup},       // 2: → 4
		{Code: retK, K: unix.SECCOMP_RET_ALLOW},                       // 3
		{Code: retK, K: unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)}, // 4
	}
}

// DenyIOURing installs Filter on every thread of the calling process (SECCOMP_FILTER_FLAG_TSYNC),
// for it and everything it execs or forks from then on. Without CAP_SYS_ADMIN the kernel asks for
// no_new_privs first; DenyIOURing then sets it (a setuid program started afterwards no longer
// gains privileges) and says so in newPrivs = false.
func DenyIOURing() (newPrivs bool, err error) {
	if !arches[runtime.GOARCH] {
		return true, fmt.Errorf("%w: io_uring_setup's number is not known on %s", ErrNotSupported, runtime.GOARCH)
	}
	// no_new_privs is a thread's own: the prctl and the retry must run on the same thread.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	f := Filter()
	prog := unix.SockFprog{Len: uint16(len(f)), Filter: &f[0]}
	install := func() error {
		r, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC,
			uintptr(unsafe.Pointer(&prog)))
		runtime.KeepAlive(f)
		if e != 0 {
			return e
		}
		if r != 0 {
			// TSYNC's refusal is no errno: the kernel installed the filter nowhere and returns the
			// id of a thread that cannot take it (one with a seccomp filter or mode of its own).
			return fmt.Errorf("thread %d of this process cannot take it (a seccomp filter of its own)", r)
		}
		return nil
	}
	err = install()
	if errors.Is(err, unix.EACCES) {
		if perr := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); perr != nil {
			return true, fmt.Errorf("set no_new_privs for the seccomp filter: %w", perr)
		}
		newPrivs = false
		err = install()
	} else {
		newPrivs = true
	}
	switch {
	case err == nil:
		return newPrivs, nil
	case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOSYS):
		return newPrivs, fmt.Errorf("%w: %v (a kernel with CONFIG_SECCOMP_FILTER is needed)", ErrNotSupported, err)
	}
	return newPrivs, fmt.Errorf("install the seccomp filter: %w", err)
}
