package op

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/shimctl"
)

// RefuseUnrestorable refuses, before anything is touched, an operation on a process that runs
// under the ptxmig shim and holds GPU state the NVIDIA driver can checkpoint but not restore, as
// its shim reports it:
//   - peer access enabled between its GPU contexts (cuCtxEnablePeerAccess links), under a shim
//     that cannot turn it off for the checkpoint (one that can says peer_toggle; the quiesce step
//     turns it off, the resume on): driver 580 checkpoints such a process, but
//     cuCheckpointProcessRestore then failed with CUDA_ERROR_INVALID_VALUE, in place as well as
//     onto other GPUs (measured on 2x H100, driver 580.159.04; docs/PLATFORM.md);
//   - peer access the shim would turn off for the checkpoint, in a process holding a cuMemAlloc
//     allocation over PeerAllocLimit: after the driver's restore, cuCtxEnablePeerAccess toward a
//     context holding such an allocation fails (CUDA_ERROR_INVALID_HANDLE, 512 MiB and 1 GiB; 256
//     MiB and 1 GiB in 64 MiB pieces were fine; 2x H200, driver 580.159.04, scripts/probe-peer.sh
//     peer-toggle-big), and the process, which may use the link, would be left held. The shim
//     reports the largest allocation of the process, not per context: a process whose large
//     allocation is on a GPU no link reaches is refused too;
//   - GPU memory shared with another process, exported (CUDA IPC, VMM shareable handles, memory
//     pools) or imported: cuCheckpointProcessRestore fails with CUDA_ERROR_NOT_SUPPORTED, so a
//     --leave-running checkpoint cannot roll back either (measured on 2x H200, driver 580.159.04,
//     a PyTorch DDP rank with NCCL's default transports).
//
// Either way the process could be neither restored nor rolled back. A process without the shim
// cannot be asked; the operation goes ahead as before, and a shim that predates the "ipc" counts
// is asked about peer links only. One whose shim does not answer is refused.
func RefuseUnrestorable(ctx context.Context, pids []int) error {
	_, err := CheckRestorable(ctx, pids)
	return err
}

// CheckRestorable is RefuseUnrestorable that also returns the shim statuses it read, by pid (a
// pid without the shim has none), for checks that need them after it.
func CheckRestorable(ctx context.Context, pids []int) (map[int]*shimctl.Status, error) {
	sts := map[int]*shimctl.Status{}
	for _, pid := range pids {
		st, err := ShimStatus(ctx, pid)
		if err != nil {
			return nil, Refusef("pid %d runs under the ptxmig shim, which did not say whether it shares GPU memory with other "+
				"processes or enabled peer access (%v): the driver could checkpoint it and then not restore it; nothing was "+
				"touched. Try again; `ptxmig ps` shows the shim's state", pid, err)
		}
		if st == nil {
			continue
		}
		sts[pid] = st
		var found, fixes []string
		if n := st.PeerAccess; n > 0 && !st.PeerToggle {
			found = append(found, fmt.Sprintf("has enabled peer access between its GPUs (%d link(s), reported by the ptxmig shim): "+
				"the NVIDIA driver checkpoints such a process but cannot restore it (cuCheckpointProcessRestore fails with "+
				"CUDA_ERROR_INVALID_VALUE, in place or onto other GPUs; measured with driver 580.159.04)", n))
			fixes = append(fixes, "Start it with `ptxmig run --no-peer-access` (its GPUs then answer as a pair without a "+
				"peer path: frameworks such as JAX and PyTorch copy between them through host memory), or have the "+
				"application disable peer access first (cuCtxDisablePeerAccess / cudaDeviceDisablePeerAccess; NCCL: "+
				"NCCL_P2P_DISABLE=1)")
		}
		if n := st.PeerAccess; n > 0 && st.PeerToggle && st.LargestDeviceAlloc > PeerAllocLimit {
			found = append(found, fmt.Sprintf("has enabled peer access between its GPUs (%d link(s)) and holds a cudaMalloc "+
				"allocation of %d MiB (reported by the ptxmig shim): after a restore the NVIDIA driver cannot turn peer access "+
				"to a GPU context holding an allocation over %d MiB back on (cuCtxEnablePeerAccess fails with "+
				"CUDA_ERROR_INVALID_HANDLE; measured with driver 580.159.04), and the process would be left held",
				n, st.LargestDeviceAlloc>>20, PeerAllocLimit>>20))
			fixes = append(fixes, fmt.Sprintf("Start it with `ptxmig run --no-peer-access` (its GPUs then answer as a pair "+
				"without a peer path), or have it allocate GPU memory in pieces of at most %d MiB (JAX's preallocation is one "+
				"allocation: XLA_PYTHON_CLIENT_PREALLOCATE=false avoids it, which is enough only while its buffers stay small)",
				PeerAllocLimit>>20))
		}
		if s := st.IPC; s != nil && (s.Exported > 0 || s.Imported > 0) {
			found = append(found, fmt.Sprintf("shares GPU memory with other processes (%s; reported by the ptxmig shim): "+
				"the NVIDIA driver cannot restore a process whose GPU memory another process maps, or that maps another "+
				"process's (cuCheckpointProcessRestore fails with CUDA_ERROR_NOT_SUPPORTED, so a --leave-running checkpoint "+
				"cannot roll back either; measured on 2x H200, driver 580.159.04, with a PyTorch DDP rank using NCCL's "+
				"default transports)", describeSharing(s)))
			fixes = append(fixes, "For NCCL, start the job with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_CUMEM_ENABLE=0 "+
				"(`ptxmig run --nccl-sockets` sets them), so that ranks exchange data through sockets; for another application, "+
				"stop sharing GPU memory between processes (CUDA IPC, cuMemExportToShareableHandle, exported memory pools)")
		}
		if len(found) > 0 {
			return nil, Refusef("pid %d %s, so it would be lost; nothing was touched. %s", pid,
				strings.Join(found, "; it also "), strings.Join(fixes, ". "))
		}
	}
	return sts, nil
}

// PeerAllocLimit: the largest cuMemAlloc allocation for which driver 580 was seen to enable peer
// access toward its context again after a restore (256 MiB did, 512 MiB did not). Preflight
// checks it, and the quiesce step again with the process quiesced.
const PeerAllocLimit = 256 << 20

// describeSharing says what the shim counted: "exported 2 (CUDA IPC: 1, VMM shareable handles:
// 1); imported 1 (memory pools: 1)".
func describeSharing(s *shimctl.IPC) string {
	kinds := []struct {
		name string
		c    shimctl.ShareCount
	}{{"CUDA IPC", s.IPCMem}, {"VMM shareable handles", s.VMM}, {"memory pools", s.Pool}, {"memory pool pointers", s.PoolPointer}}
	dir := func(what string, total int, of func(shimctl.ShareCount) int) string {
		var by []string
		for _, k := range kinds {
			if n := of(k.c); n > 0 {
				by = append(by, fmt.Sprintf("%s: %d", k.name, n))
			}
		}
		if len(by) == 0 {
			return fmt.Sprintf("%s %d", what, total)
		}
		return fmt.Sprintf("%s %d (%s)", what, total, strings.Join(by, ", "))
	}
	var out []string
	if s.Exported > 0 {
		out = append(out, dir("exported", s.Exported, func(c shimctl.ShareCount) int { return c.Exported }))
	}
	if s.Imported > 0 {
		out = append(out, dir("imported", s.Imported, func(c shimctl.ShareCount) int { return c.Imported }))
	}
	return strings.Join(out, "; ")
}

// ShimStatus returns pid's shim status (brief); nil without a shim. A process that has the shim mapped
// but whose status cannot be read is an error: it may share GPU memory, and going ahead could
// lose it (seen on 2x H200: a DDP rank on NCCL's default transports was checkpointed and could
// not be restored when its shim was not asked).
func ShimStatus(ctx context.Context, pid int) (*shimctl.Status, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c, err := DialShim(ctx, pid)
	if err == nil {
		defer c.Close()
		var st *shimctl.Status
		if st, err = c.StatusBrief(ctx); err == nil {
			return st, nil
		}
	}
	if mapped, merr := shimctl.MapsHaveShim(pid); merr != nil || !mapped {
		return nil, nil // no shim (or gone): nothing to ask
	}
	return nil, err
}

// Unchecked says what RefuseUnrestorable could not check (nil when nothing): the processes of
// pids that do not run under the ptxmig shim cannot be asked whether they share GPU memory with
// other processes or enabled peer access, which the driver checkpoints but cannot restore. It
// matters where sharing is likely: several CUDA processes (a job's ranks), or one process using
// several GPUs (multiGPU). A warning, not a refusal: most such processes share nothing.
func Unchecked(pids []int, multiGPU bool) []string {
	var plain []int
	for _, pid := range pids {
		if mapped, err := shimctl.MapsHaveShim(pid); err == nil && !mapped {
			plain = append(plain, pid)
		}
	}
	switch {
	case len(plain) == 0:
		return nil
	case len(pids) > 1:
		return []string{fmt.Sprintf("pid %s not under the ptxmig shim: ptxmig cannot check whether they share GPU memory "+
			"with each other or another process (CUDA IPC, VMM shareable handles: NCCL's default transports), which the "+
			"driver checkpoints but cannot restore; if they do, a restore (or a rollback) fails. Start them with "+
			"`ptxmig run` (a job: `ptxmig run --nccl-sockets`) to have it checked", PIDText(plain))}
	case multiGPU:
		return []string{fmt.Sprintf("pid %d is not under the ptxmig shim: ptxmig cannot check whether it enabled peer access "+
			"between its GPUs, which the driver checkpoints but cannot restore; if it did, a restore (or a rollback) fails. "+
			"Start it with `ptxmig run` to have it checked", plain[0])}
	}
	return nil
}

// DialShim reaches pid's shim in the socket directory of pid's own environment.
func DialShim(ctx context.Context, pid int) (*shimctl.Client, error) {
	dir := ""
	if e, err := gpu.ProcessEnviron("/proc", pid); err == nil {
		dir = e["PTXMIG_SOCKET_DIR"]
	}
	return shimctl.DialPID(ctx, shimctl.SocketDir(dir), pid)
}
