package op

import (
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/proc"
)

// PlanStep is one step of an operation's plan, as --dry-run prints it.
type PlanStep struct {
	Step   string `json:"step"`
	Action string `json:"action"`
}

// Kinds of process images (internal/imagedesc, which holds what an image records).
const (
	KindCUDA = imagedesc.KindCUDA
	KindCPU  = imagedesc.KindCPU
)

// TreeProc is one process of a checkpointed tree, as recorded in the image.
type TreeProc = imagedesc.TreeProc

// TreePIDs lists the pids of a tree; cudaOnly keeps the CUDA processes.
func TreePIDs(t []TreeProc, cudaOnly bool) []int { return imagedesc.TreePIDs(t, cudaOnly) }

// TreeOf converts /proc stats into a tree record; cuda marks the CUDA processes.
func TreeOf(stats []proc.Stat, cuda map[int]bool) []TreeProc { return imagedesc.TreeOf(stats, cuda) }
