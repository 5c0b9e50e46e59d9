package op

import (
	"bytes"

	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimctl"
)

// Frameworks ptxmig cannot yet checkpoint, found by the libraries a process maps, each refused by
// name before anything is touched (a checkpoint must never kill a process).

// jaxMarker is in the path of every library of JAX's runtime (jaxlib, its CUDA plugin). A string
// variable, so that a diagnostic build can take the refusal away (scripts/probe-jax.sh:
// -ldflags "-X github.com/ptxmig/ptxmig/internal/op.jaxMarker=/none/").
var jaxMarker = "/jaxlib/"

// RefuseFrameworks refuses the CUDA processes that ptxmig is known to lose. JAX (XLA), measured
// on an H200, driver 580.159.04: with JAX 0.11 under the shim the driver checkpoint failed with
// CUDA_ERROR_OPERATING_SYSTEM (304) and the process died; without it the checkpoint succeeded
// but the driver did not know the process CRIU restored from the image
// (cuCheckpointProcessGetState: CUDA_ERROR_NOT_INITIALIZED). With JAX 0.11.2 (2026-11-28,
// scripts/probe-jax.sh and TestFrameworks) the same cases worked once each, but the second
// `--leave-running` checkpoint of one process under the shim lost it: its driver restore failed
// with CUDA_ERROR_OPERATING_SYSTEM, then every call with CUDA_ERROR_NOT_INITIALIZED. The cause is
// not known; the bare driver calls in place (lock, checkpoint, restore, unlock) worked every time,
// under the shim too: a migrate (imageOnly false) of a JAX process goes ahead unless the shim
// preempts.
func RefuseFrameworks(pids []int, imageOnly bool) error {
	for _, pid := range pids {
		maps, err := proc.ReadFile("", pid, "maps", 64<<20)
		if err != nil || !bytes.Contains(maps, []byte(jaxMarker)) {
			continue
		}
		shim, _ := shimctl.MapsListingHasShim(bytes.NewReader(maps))
		if env, err := gpu.ProcessEnviron("/proc", pid); err == nil && env["PTXMIG_PREEMPT"] == "off" {
			shim = false // the death was with preemption on (`ptxmig run`'s default); --preempt off checkpointed
		}
		switch {
		case shim:
			return Refusef("pid %d runs JAX (XLA) under the ptxmig shim with preemption on: the NVIDIA driver's checkpoint of such a "+
				"process failed with CUDA_ERROR_OPERATING_SYSTEM and the process died (H200, driver 580.159.04, JAX 0.11); "+
				"nothing was touched. Not fixed yet: start JAX with `ptxmig run --preempt off`, or without it, to migrate it", pid)
		case imageOnly:
			return Refusef("pid %d runs JAX (XLA): its image would not restore (the driver did not know the process CRIU "+
				"restored: CUDA_ERROR_NOT_INITIALIZED; H200, driver 580.159.04, JAX 0.11); nothing was touched. Not fixed "+
				"yet; `ptxmig migrate` (no image) works for a JAX process started without `ptxmig run`", pid)
		}
	}
	return nil
}
