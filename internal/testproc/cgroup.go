package testproc

import (
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

var serviceSeq atomic.Int64

// ServiceCgroup creates a cgroup in the unified (v2) hierarchy for a test's stand-in of ptxmig,
// as a service manager gives each unit one, and returns its directory (write "1" to its
// cgroup.kill to kill all of it at once) and an fd of it to start processes in
// (SysProcAttr.UseCgroupFD). It skips the test (testreq: root, cgroup2), saying why, where there
// is none to be had. At
// the end every process left in it is killed, it is removed, and so is proc.KeepCgroup when
// empty.
func ServiceCgroup(tb testing.TB) (dir string, fd int) {
	tb.Helper()
	if os.Geteuid() != 0 {
		testreq.Skip(tb, "root", "cgroups need root")
	}
	mounts, err := proc.CgroupMounts()
	if err != nil {
		tb.Fatal(err)
	}
	v2, ok := proc.UnifiedMount(mounts)
	if !ok {
		testreq.Skip(tb, "cgroup2", "no cgroup v2 hierarchy mounted: a group kill cannot be made here")
	}
	name := fmt.Sprintf("/ptxmig-test-service-%d-%d", os.Getpid(), serviceSeq.Add(1))
	if err := v2.Create(name); err != nil {
		testreq.Skip(tb, "cgroup2", "cannot create a cgroup at %s (a cgroup namespace, a read-only mount): %v", v2.Dir, err)
	}
	dir, _ = v2.Path(name)
	tb.Cleanup(func() {
		_ = os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0)
		for i := 0; i < 200 && os.Remove(dir) != nil; i++ {
			time.Sleep(10 * time.Millisecond)
		}
		if k, err := v2.Path(proc.KeepCgroup); err == nil {
			_ = os.Remove(k) // only when empty
		}
	})
	if _, err := os.Stat(filepath.Join(dir, "cgroup.kill")); err != nil {
		testreq.Skip(tb, "cgroup2", "this kernel has no cgroup.kill (Linux < 5.14): %v", err)
	}
	fd, err = unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { unix.Close(fd) })
	return dir, fd
}

// KillCgroup kills every process of the cgroup at dir at once (cgroup.kill).
func KillCgroup(dir string) error {
	return os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0)
}
