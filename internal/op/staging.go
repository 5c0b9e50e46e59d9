package op

import (
	"os"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/internal/proc"
)

// StagingTmpfs and StagingDisk are the default staging roots; $PTXMIG_STAGING_DIR replaces both.
const (
	StagingTmpfs = "/dev/shm/ptxmig"
	StagingDisk  = "/var/tmp/ptxmig"
)

// StagingRoots are the staging roots in use.
func StagingRoots() []string {
	if d := os.Getenv("PTXMIG_STAGING_DIR"); d != "" {
		return []string{d}
	}
	return []string{StagingTmpfs, StagingDisk}
}

// FreeBytes is the space an unprivileged writer could still use in dir's file system.
func FreeBytes(dir string) (uint64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return st.Bavail * uint64(st.Bsize), nil
}

// ChooseStaging picks where CRIU's images go: an explicit root (or $PTXMIG_STAGING_DIR), else tmpfs when they fit in
// memory with extraMem to spare (a checkpointed process's host memory grows by its GPU memory; a
// restore holds the image twice), else disk. The root must have need bytes free, and must be a
// directory private to ptxmig (see oplock.PrivateDir): the defaults lie in world-writable
// /dev/shm and /var/tmp. Failures are refusals.
func ChooseStaging(explicit string, need, extraMem uint64) (string, error) {
	if explicit == "" {
		explicit = os.Getenv("PTXMIG_STAGING_DIR")
	}
	if explicit != "" {
		return ensureStagingRoot(explicit, need)
	}
	if avail := proc.MemAvailable(); avail > 0 && avail > need+extraMem+1<<30 {
		if root, err := ensureStagingRoot(StagingTmpfs, need); err == nil {
			return root, nil
		}
	}
	return ensureStagingRoot(StagingDisk, need)
}

func ensureStagingRoot(root string, need uint64) (string, error) {
	if err := oplock.PrivateDir(root); err != nil {
		return "", Refusef("staging %s: %w", root, err)
	}
	free, err := FreeBytes(root)
	if err != nil {
		return "", Refusef("staging %s: %w", root, err)
	}
	if free < need {
		return "", Refusef("staging %s has %s free, CRIU's images may need %s", root, bytesize.Format(int64(free)), bytesize.Format(int64(need)))
	}
	return root, nil
}

// StreamStagingBytes is the staging space a streamed dump or restore needs: CRIU's log and
// statistics only, the image files go through the streamer socket.
const StreamStagingBytes = 64 << 20

// hostReserve is host memory left to everything else when the driver's checkpoint copies GPU
// memory into a process's host memory.
const hostReserve = 1 << 30

// CheckHostMemory refuses a driver checkpoint of gpuBytes of device memory that the host's
// available memory cannot take: the driver copies the device memory into the process's own host
// memory, and past what is available its checkpoint fails (CUDA_ERROR_OPERATING_SYSTEM) or the
// kernel's OOM killer ends the process. (JAX preallocates 75 % of a GPU by default: 105 GB of an
// H200's, against 128 GiB of host memory.) Memory the shim owns (--owned-memory) is counted too,
// though it goes to the image first: the plan cannot tell it apart.
func CheckHostMemory(gpuBytes uint64) error { return checkHostMemory(gpuBytes, proc.MemAvailable()) }

func checkHostMemory(gpuBytes, avail uint64) error {
	if avail == 0 || gpuBytes == 0 || gpuBytes+hostReserve <= avail {
		return nil // unknown (no /proc/meminfo): the driver decides, as before
	}
	return Refusef("the driver's checkpoint copies %s of GPU memory into host memory, and the host has %s available (%s kept "+
		"for the rest): the copy would fail or the OOM killer would end the process; nothing was touched. Free host memory, "+
		"or have the process hold less GPU memory (JAX: XLA_PYTHON_CLIENT_PREALLOCATE=false, or a smaller "+
		"XLA_PYTHON_CLIENT_MEM_FRACTION; PyTorch: torch.cuda.empty_cache())",
		bytesize.FormatU(gpuBytes), bytesize.FormatU(avail), bytesize.FormatU(hostReserve))
}
