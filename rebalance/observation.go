package rebalance

import (
	"fmt"
	"time"
)

// GPU is one device as observed over the sampling window.
type GPU struct {
	Index      int    `json:"index"`
	UUID       string `json:"uuid"`
	Name       string `json:"name"`
	ComputeCap string `json:"compute_cap"` // "9.0"
	MemTotal   uint64 `json:"mem_total_bytes"`
	MemUsed    uint64 `json:"mem_used_bytes"`
	// Util is the mean utilization over the window, 0..1 (NVML "GPU" utilization: the share of
	// time a kernel was running).
	Util float64 `json:"util"`
	// PowerW is the mean power draw over the window; PowerLimitW the enforced limit (0: unknown).
	PowerW      float64 `json:"power_w"`
	PowerLimitW float64 `json:"power_limit_w"`
	Samples     int     `json:"samples"`
}

// MemFree is the memory not in use, in bytes.
func (g GPU) MemFree() uint64 {
	if g.MemUsed >= g.MemTotal {
		return 0
	}
	return g.MemTotal - g.MemUsed
}

// Chip names the chip type: processes only move between GPUs with equal Chip.
func (g GPU) Chip() string { return fmt.Sprintf("%s (sm %s)", g.Name, g.ComputeCap) }

// Process is one CUDA compute process with what NVML and /proc say about it.
type Process struct {
	PID  int      `json:"pid"`
	GPUs []string `json:"gpus"` // UUIDs of the GPUs it holds a context on
	// MemBytes is the GPU memory it uses (NVML UsedGpuMemory, context included); MemKnown is false
	// when NVML did not report it.
	MemBytes uint64 `json:"mem_bytes"`
	MemKnown bool   `json:"mem_known"`
	// Util is its share of its GPU's time, 0..1. UtilKnown is false when NVML had no per-process
	// samples and the share was estimated (the GPU's load split evenly among such processes).
	Util      float64 `json:"util"`
	UtilKnown bool    `json:"util_known"`
	// From /proc. InfoErr explains missing information (the process exited, no permission).
	Comm       string    `json:"comm,omitempty"`
	Cmdline    []string  `json:"cmdline,omitempty"`
	StartTicks uint64    `json:"start_ticks,omitempty"`
	StartTime  time.Time `json:"start_time,omitzero"`
	EnvPin     bool      `json:"env_pin"`   // PTXMIG_PIN=1 in its environment
	EnvKnown   bool      `json:"env_known"` // the environment could be read
	UnderShim  bool      `json:"under_shim"`
	Session    int       `json:"session,omitempty"` // 0: unknown (or a session led outside this PID namespace)
	InfoErr    string    `json:"info_error,omitempty"`
}

// Key identifies the process across runs: PID plus start time, so a reused PID is a new process.
func (p Process) Key() string { return procKey(p.PID, p.StartTicks) }

func procKey(pid int, startTicks uint64) string { return fmt.Sprintf("%d@%d", pid, startTicks) }

// Observation is one sampled picture of the node.
type Observation struct {
	Time   time.Time     `json:"time"`
	Window time.Duration `json:"window_ns"`
	GPUs   []GPU         `json:"gpus"`
	Procs  []Process     `json:"processes"`
}

// gpuByUUID returns the index into o.GPUs of the GPU with uuid, or -1.
func (o *Observation) gpuByUUID(uuid string) int {
	for i := range o.GPUs {
		if o.GPUs[i].UUID == uuid {
			return i
		}
	}
	return -1
}
