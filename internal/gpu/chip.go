package gpu

import "strings"

// SameChip is ptxmig's one rule for "the driver may restore a process onto this GPU": the same
// compute capability, whatever the product name. Measured on driver 580.159.04
// (docs/PLATFORM.md, "Another GPU model"): a process checkpointed on an H100 80GB HBM3 restored
// exactly onto an H200 and the reverse (both GH100, compute capability 9.0); the driver's "same
// chip type" is not the product name. One capability can span several chips (8.6: GA102 to
// GA107), so a change of model that was not measured is refused unless asked for
// (placement.CheckModelChanges). An empty recorded capability (older images) falls back to the
// name; an empty recorded name matches anything. The rebalancer, which moves processes
// unattended, keeps to SameModel.
func SameChip(name, computeCap, targetName, targetComputeCap string) bool {
	if computeCap != "" && targetComputeCap != "" {
		return computeCap == targetComputeCap
	}
	return name == "" || strings.EqualFold(name, targetName)
}

// SameModel is SameChip with the same product name too (case-insensitive).
func SameModel(name, computeCap, targetName, targetComputeCap string) bool {
	return SameChip(name, computeCap, targetName, targetComputeCap) && (name == "" || strings.EqualFold(name, targetName))
}

// ModelChange reports whether a move that SameChip allows changes the GPU model (the names
// differ).
func ModelChange(name, targetName string) bool {
	return name != "" && targetName != "" && !strings.EqualFold(name, targetName)
}

// measuredModelChanges are the model changes a restore was measured to bring back exactly
// (lower-case names, both directions).
var measuredModelChanges = [][2]string{
	{"nvidia h100 80gb hbm3", "nvidia h200"}, // driver 580.159.04, 2026-11-25: counter, exact checksum, both ways
}

// MeasuredModelChange reports whether a restore from model name onto model targetName was
// measured to work (either direction).
func MeasuredModelChange(name, targetName string) bool {
	a, b := strings.ToLower(name), strings.ToLower(targetName)
	for _, p := range measuredModelChanges {
		if (a == p[0] && b == p[1]) || (a == p[1] && b == p[0]) {
			return true
		}
	}
	return false
}

// ChipKey groups GPUs that SameModel considers interchangeable.
func ChipKey(name, computeCap string) string { return strings.ToLower(name) + "\x00" + computeCap }
