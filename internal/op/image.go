package op

import (
	"encoding/json"
	"fmt"

	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/store"
)

// PlanStep is one step of an operation's plan, as --dry-run prints it.
type PlanStep struct {
	Step   string `json:"step"`
	Action string `json:"action"`
}

// Kinds of process images.
const (
	KindCUDA = "cuda"
	KindCPU  = "cpu"
)

// Keys checkpoint records in a manifest's Meta.Extra and restore reads back.
const (
	ExtraShellJob       = "criu.shell_job"
	ExtraTTY            = "criu.tty" // a process had a controlling terminal (restore needs one to inherit)
	ExtraTCPEstablished = "criu.tcp_established"
	ExtraComm           = "comm"
	ExtraLeftRunning    = "left_running"
	ExtraTree           = "tree" // JSON list of TreeProc: the checkpointed process tree
)

// TreeProc is one process of a checkpointed tree, as recorded in the image.
type TreeProc struct {
	PID  int    `json:"pid"`
	PPID int    `json:"ppid"`
	Comm string `json:"comm"`
	CUDA bool   `json:"cuda,omitempty"`
}

// maxPID is the kernel's largest pid (PID_MAX_LIMIT).
const maxPID = 1 << 22

// EncodeTree renders a tree for Meta.Extra.
func EncodeTree(t []TreeProc) string {
	b, _ := json.Marshal(t) // cannot fail: plain structs
	return string(b)
}

// ImageTree reads and validates the tree recorded in m. Images made before trees were recorded
// hold just their root: the tree is then the recorded pid alone (CUDA when the image is).
func ImageTree(m store.Metadata) ([]TreeProc, error) {
	s, ok := m.Extra[ExtraTree]
	if !ok {
		return []TreeProc{{PID: m.PID, Comm: m.Extra[ExtraComm], CUDA: m.Kind == KindCUDA}}, nil
	}
	var t []TreeProc
	if err := json.Unmarshal([]byte(s), &t); err != nil {
		return nil, fmt.Errorf("image process tree: %w", err)
	}
	if len(t) == 0 || t[0].PID != m.PID {
		return nil, fmt.Errorf("image process tree does not start at the image's pid %d", m.PID)
	}
	seen := map[int]bool{}
	for i, p := range t {
		if p.PID <= 1 || p.PID >= maxPID || p.PPID < 0 || p.PPID >= maxPID || seen[p.PID] {
			return nil, fmt.Errorf("image process tree: bad or repeated pid %d (ppid %d)", p.PID, p.PPID)
		}
		if i > 0 && !seen[p.PPID] {
			return nil, fmt.Errorf("image process tree: pid %d's parent %d is not listed before it", p.PID, p.PPID)
		}
		seen[p.PID] = true
	}
	return t, nil
}

// TreePIDs lists the pids of a tree; cudaOnly keeps the CUDA processes.
func TreePIDs(t []TreeProc, cudaOnly bool) []int {
	var out []int
	for _, p := range t {
		if !cudaOnly || p.CUDA {
			out = append(out, p.PID)
		}
	}
	return out
}

// TreeOf converts /proc stats into a tree record; cuda marks the CUDA processes.
func TreeOf(stats []proc.Stat, cuda map[int]bool) []TreeProc {
	out := make([]TreeProc, len(stats))
	for i, s := range stats {
		out[i] = TreeProc{PID: s.PID, PPID: s.PPID, Comm: s.Comm, CUDA: cuda[s.PID]}
	}
	if len(out) > 0 {
		out[0].PPID = 0 // the root's parent is outside the image
	}
	return out
}
