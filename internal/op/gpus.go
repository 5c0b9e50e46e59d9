package op

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/probe"
	"github.com/ptxmig/ptxmig/internal/proc"
)

// TreeGPUs lists the GPUs the CUDA processes use (NVML's compute processes; else their open
// /dev/nvidiaN), with the memory each uses (MemoryBytes: what a restore needs free), and the GPUs
// their CUDA driver enumerates (visible), which a restore onto other GPUs must all pair. MIG
// (CUDA_VISIBLE_DEVICES naming MIG instances) is refused.
func (env *Env) TreeGPUs(pids []int) (used, visible []imagedesc.GPU, err error) {
	if env.GPUs == nil {
		return nil, nil, nil
	}
	devs, err := env.GPUs.Devices()
	if err != nil {
		return nil, nil, err
	}
	byUUID := map[string]*imagedesc.GPU{}
	add := func(d gpu.Device, mem uint64) {
		k := strings.ToLower(d.UUID)
		if g, ok := byUUID[k]; ok {
			g.MemoryBytes += mem
			return
		}
		byUUID[k] = &imagedesc.GPU{Index: d.Index, UUID: d.UUID, Name: d.Name, ComputeCap: d.ComputeCap, MemoryBytes: mem}
	}
	for _, pid := range pids {
		// The driver's restore needs a pair for every GPU of the host (see gpu.DriverSet), so the
		// environment matters only for MIG, which cannot be paired.
		if _, err := gpu.VisibleTo(pid, devs); errors.Is(err, gpu.ErrMIG) {
			return nil, nil, fmt.Errorf("pid %d: %w", pid, err)
		}
		uses := gpu.UsedBy(devs, pid)
		for _, u := range uses {
			add(u.Device, u.Memory)
		}
		if len(uses) == 0 {
			if pi, ok := gpu.Inspect(pid); ok {
				for _, m := range pi.Minors {
					for _, d := range devs {
						if d.Minor == m {
							add(d, 0)
						}
					}
				}
			}
		}
	}
	for _, g := range byUUID {
		used = append(used, *g)
	}
	sort.Slice(used, func(i, j int) bool { return used[i].Index < used[j].Index })
	mem := map[string]uint64{}
	for _, u := range used {
		mem[strings.ToLower(u.UUID)] = u.MemoryBytes
	}
	for _, d := range gpu.DriverSet(devs) {
		visible = append(visible, imagedesc.GPU{Index: d.Index, UUID: d.UUID, Name: d.Name, ComputeCap: d.ComputeCap, MemoryBytes: mem[strings.ToLower(d.UUID)]})
	}
	return used, visible, nil
}

// DriverProcess decides whether pid's GPU state must go through the driver: libcuda is loaded and the
// driver knows a CUDA context in the running state.
func (env *Env) DriverProcess(pid int) (bool, error) {
	cuda, err := env.IsCUDA(pid)
	if err != nil {
		return false, Refusef("pid %d: find out whether it uses CUDA: %w", pid, err)
	}
	if !cuda {
		return false, nil
	}
	env.OpenGPU() // a tree of CPU processes never needs the driver or NVML
	if err := env.DriverTooOld(probe.DriverCheckpoint); err != nil {
		return false, Refusef("pid %d uses CUDA, but %w", pid, err)
	}
	if env.Driver == nil {
		return false, Refusef("pid %d uses CUDA but the NVIDIA driver cannot be used: %v", pid, env.DriverErr)
	}
	st, err := env.Driver.State(pid)
	switch {
	case errors.Is(err, cudackpt.ErrNotCUDA), errors.Is(err, cudackpt.ErrNotInitialized):
		// libcuda loaded, no CUDA state the driver can checkpoint (CUDA_ERROR_NOT_INITIALIZED for
		// torch.compile's Inductor workers; H200, driver 580.159.04). CRIU dumps such a process
		// like any other, unless it maps the GPU's device files: CRIU cannot dump those mappings
		// (its dump failed, "handle_device_vma plugin failed"), so that is refused up front.
		maps := env.MapsDevice
		if maps == nil {
			maps = gpu.MapsDevice
		}
		if dev, merr := maps(pid); merr == nil && dev != "" {
			return false, Refusef("pid %d (%s) maps %s but holds no CUDA state the driver can checkpoint (%v): CRIU cannot dump "+
				"that mapping, and nothing was touched. A torch.compile worker pool does this: start the job with "+
				"TORCHINDUCTOR_COMPILE_THREADS=1 (Inductor then compiles in the process itself)", pid, proc.Comm(pid), dev, err)
		}
		env.Logger().Info("libcuda is loaded but the driver knows no CUDA state; checkpointing with CRIU alone", "pid", pid, "driver", err)
		return false, nil
	case err != nil:
		return false, Refusef("pid %d: checkpoint state: %w", pid, err)
	case st != cudackpt.Running:
		return false, Refusef("pid %d is %s, not running: another tool (or a failed checkpoint) holds it; "+
			"ptxmig only starts from a running process", pid, st)
	}
	return true, nil
}
