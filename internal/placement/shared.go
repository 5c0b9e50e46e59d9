package placement

import (
	"fmt"
	"sort"
	"strings"

	"github.com/ptxmig/ptxmig/internal/gpu"
)

// SharedGPUWarning says which of the GPUs a process will run on after a driver restore also run
// other processes ("" when none does). Driver 580 restores contexts that do not always survive
// sharing: a process restored by the driver was killed by Xid 109 (CTX SWITCH TIMEOUT) when its
// multi-second kernels ran beside another process's kernels on the same H100 (docs/PLATFORM.md),
// so an operator should know before moving a process next to others. own reports the pids of the
// process being moved, which NVML may already list on a target (a process on two GPUs).
func SharedGPUWarning(targets []gpu.Device, own func(pid int) bool) string {
	var parts []string
	seen := map[string]bool{}
	for _, d := range targets {
		if seen[d.UUID] {
			continue
		}
		seen[d.UUID] = true
		var pids []int
		for _, p := range d.Processes {
			if own == nil || !own(p.PID) {
				pids = append(pids, p.PID)
			}
		}
		if len(pids) == 0 {
			continue
		}
		sort.Ints(pids)
		s := make([]string, len(pids))
		for i, p := range pids {
			s[i] = fmt.Sprint(p)
		}
		parts = append(parts, fmt.Sprintf("GPU %d also runs pid %s", d.Index, strings.Join(s, ", ")))
	}
	if len(parts) == 0 {
		return ""
	}
	return strings.Join(parts, "; ") + ": on driver 580 a process restored by the driver was killed by Xid 109 " +
		"(CTX SWITCH TIMEOUT) when its multi-second kernels shared the GPU with another process's kernels " +
		"(measured on H100, not every time; docs/PLATFORM.md)"
}

// UsedTargets returns the target GPUs of the pairs the process uses.
func UsedTargets(pairs []Pair) []gpu.Device {
	var out []gpu.Device
	for _, p := range pairs {
		if p.Used {
			out = append(out, p.To)
		}
	}
	return out
}
