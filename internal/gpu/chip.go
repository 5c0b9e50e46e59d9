package gpu

import "strings"

// SameChip is ptxmig's one rule for "the driver restores a process onto this GPU": the same
// product name (case-insensitive) and compute capability. An empty recorded name or capability
// (older images) matches anything on that field. Restore, migrate and the rebalancer all use it.
func SameChip(name, computeCap, targetName, targetComputeCap string) bool {
	if name != "" && !strings.EqualFold(name, targetName) {
		return false
	}
	return computeCap == "" || computeCap == targetComputeCap
}

// ChipKey groups GPUs that SameChip considers interchangeable.
func ChipKey(name, computeCap string) string { return strings.ToLower(name) + "\x00" + computeCap }
