package proc

import (
	"errors"
	"fmt"
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
	v2, v1 := keepHierarchies(own, mounts)
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

// keepHierarchies are the hierarchies StartKept uses: the unified one and systemd's v1 one, each
// where ptxmig is not at its top (own: ptxmig's cgroups) and it is mounted.
func keepHierarchies(own []CgroupEntry, mounts []CgroupMount) (v2, v1 *CgroupMount) {
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
	return v2, v1
}

// KeepReport says, for `ptxmig doctor`, whether a kill of ptxmig's cgroup would spare the
// processes StartKept starts: ok is false where it would not (a fix is then needed).
func KeepReport() (msg string, ok bool) {
	mounts, err := CgroupMounts()
	if err != nil {
		return "cannot read the cgroup mounts: " + err.Error(), false
	}
	own, err := Cgroups(os.Getpid())
	if err != nil {
		return "cannot read ptxmig's cgroups: " + err.Error(), false
	}
	v2, v1 := keepHierarchies(own, mounts)
	cg, _ := Cgroup(os.Getpid())
	_, unified := UnifiedMount(mounts)
	switch {
	case v2 != nil:
		if unix.Access(v2.Dir, unix.W_OK) != nil {
			return fmt.Sprintf("ptxmig runs in cgroup %s, and %s is not writable here: a kill of that cgroup would take the guardian and the holder too", cg, v2.Dir), false
		}
		return fmt.Sprintf("ptxmig runs in cgroup %s; guardians and holders start in %s (cgroup v2 at %s), out of reach of a kill of ptxmig's cgroup", cg, KeepCgroup, v2.Dir), true
	case v1 != nil:
		return fmt.Sprintf("no cgroup v2 where ptxmig is: guardians and holders move to %s in systemd's v1 hierarchy after they start (a kill in that moment takes them)", KeepCgroup), true
	case unified || len(own) > 0:
		return "ptxmig runs at the top of its cgroup hierarchy (a container's cgroup namespace, or no service cgroup): a kill of the whole container takes the guardian with it", true
	}
	return "no cgroup hierarchy mounted: guardians and holders start where ptxmig is", false
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
