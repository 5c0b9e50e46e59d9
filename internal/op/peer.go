package op

import (
	"context"
	"time"
)

// RefusePeerAccess refuses an operation on a process that runs under the ptxmig shim and has
// enabled peer access between its GPU contexts (the shim counts cuCtxEnablePeerAccess links in
// its status). Driver 580 checkpoints such a process, but cuCheckpointProcessRestore then fails
// with CUDA_ERROR_INVALID_VALUE, in place as well as onto other GPUs (measured on 2x H100, driver
// 580.159.04; docs/PLATFORM.md): the process could be neither restored nor rolled back. A
// process without the shim cannot be asked; the operation goes ahead as before.
func RefusePeerAccess(ctx context.Context, pids []int) error {
	for _, pid := range pids {
		if n := peerLinks(ctx, pid); n > 0 {
			return Refusef("pid %d has enabled peer access between its GPUs (%d link(s), reported by the ptxmig shim): "+
				"the NVIDIA driver checkpoints such a process but cannot restore it (cuCheckpointProcessRestore fails with "+
				"CUDA_ERROR_INVALID_VALUE, in place or onto other GPUs; measured with driver 580.159.04), so it would be lost; "+
				"nothing was touched. Have the application disable peer access first (cuCtxDisablePeerAccess / "+
				"cudaDeviceDisablePeerAccess; NCCL: NCCL_P2P_DISABLE=1)", pid, n)
		}
	}
	return nil
}

// peerLinks returns the peer links pid's shim reports (0 without a shim or an answer).
func peerLinks(ctx context.Context, pid int) int {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	c, err := dial(ctx, pid)
	if err != nil {
		return 0
	}
	defer c.Close()
	st, err := c.Status(ctx)
	if err != nil {
		return 0
	}
	return st.PeerAccess
}
