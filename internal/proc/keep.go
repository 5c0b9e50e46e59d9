package proc

import (
	"errors"
	"os"
	"os/exec"
	"syscall"

	"golang.org/x/sys/unix"
)

// KeepCgroup is the cgroup, at the top of the hierarchy (of ptxmig's cgroup namespace), that
// ptxmig starts the processes in that must outlive it: an operation's guardian, which rolls the
// operation back when ptxmig dies, and the holder of a process's threads, which stops the
// process when ptxmig dies while the driver has its device memory. A service manager stopping
// ptxmig's unit, `systemctl kill`, `cgroup.kill` or an OOM group kill ends every process of
// ptxmig's cgroup at once; started in its own cgroup, the guardian and the holder survive it.
const KeepCgroup = "/ptxmig.keep"

// StartKept starts the command mk builds in KeepCgroup, where ptxmig's own cgroup is not the top
// of the hierarchy (there, no group kill can spare anything). In the unified (v2) hierarchy it is
// born there (CLONE_INTO_CGROUP: no moment in ptxmig's cgroup); in the name=systemd v1 hierarchy,
// which systemd tracks units by on hosts with cgroup v1 or the hybrid layout, it is moved right
// after. Where that cannot be done (no cgroup v2 mount, no permission, a kernel before 5.7, a
// cgroup namespace that ends at ptxmig's cgroup) it starts where ptxmig is, as exec.Cmd.Start
// would: kept reports which. mk may be called twice (a refused clone is tried again with a new
// command), so its files must be the caller's (os.File), not exec's pipes, which a failed Start
// closes; the cgroup fields of SysProcAttr are set here.
func StartKept(mk func() *exec.Cmd) (cmd *exec.Cmd, kept bool, err error) {
	mounts, _ := CgroupMounts()
	own, _ := Cgroups(os.Getpid())
	var v2, v1 *CgroupMount
	for _, e := range own {
		m, ok := MountOf(mounts, e)
		if !ok || e.Path == "/" {
			continue
		}
		switch {
		case e.V2():
			v2 = &m
		case e.Controllers == "name=systemd":
			v1 = &m
		}
	}
	if v2 != nil {
		if fd, ferr := keepDirFD(*v2); ferr == nil {
			cmd = mk()
			if cmd.SysProcAttr == nil {
				cmd.SysProcAttr = &syscall.SysProcAttr{}
			}
			cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, fd
			err = cmd.Start()
			unix.Close(fd)
			switch {
			case err == nil:
				kept = true
			case !cgroupRefusal(err):
				return nil, false, err
			default:
				cmd = nil
			}
		}
	}
	if cmd == nil {
		cmd = mk()
		if err := cmd.Start(); err != nil {
			return nil, false, err
		}
	}
	if v1 != nil && v1.Create(KeepCgroup) == nil && v1.Move(KeepCgroup, cmd.Process.Pid) == nil {
		kept = true
	}
	return cmd, kept, nil
}

// keepDirFD creates KeepCgroup in m and opens its directory for CLONE_INTO_CGROUP.
func keepDirFD(m CgroupMount) (int, error) {
	if err := m.Create(KeepCgroup); err != nil {
		return -1, err
	}
	dir, err := m.Path(KeepCgroup)
	if err != nil {
		return -1, err
	}
	return unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
}

// cgroupRefusal: a clone into a cgroup failed for the cgroup's sake (the kernel has no
// CLONE_INTO_CGROUP, the cgroup cannot take processes or is not ours to write), not the
// program's; the start is tried again where ptxmig is.
func cgroupRefusal(err error) bool {
	for _, e := range []error{unix.ENOSYS, unix.EINVAL, unix.E2BIG, unix.EBUSY, unix.EOPNOTSUPP, unix.EACCES, unix.EPERM, unix.EBADF, unix.ENODEV} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}
