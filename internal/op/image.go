package op

import (
	"encoding/json"
	"fmt"
	"strings"

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
	ExtraNetworkLock    = "criu.network_lock" // how the dump blocked the connections: the restore does the same
	ExtraComm           = "comm"
	ExtraLeftRunning    = "left_running"
	ExtraTree           = "tree" // JSON list of TreeProc: the checkpointed process tree
	// ExtraCgroup is the root process's cgroup v2 path at checkpoint ("/system.slice/job.service").
	ExtraCgroup = "cgroup"
	// ExtraCgroupV1 is a JSON object of the root process's cgroup v1 paths at checkpoint, by
	// hierarchy (its controllers as /proc/PID/cgroup names them: "memory", "cpu,cpuacct",
	// "name=systemd").
	ExtraCgroupV1 = "cgroup.v1"
	// ExtraHostFiles is a JSON list of hostreq.File: what the target host must provide (absent
	// when it did not fit: restore then reads CRIU's files.img from the image).
	ExtraHostFiles = "host.files"
	// ExtraCarried is a JSON list of hostreq.Carried: files the image carries (--carry-files).
	ExtraCarried = "host.carried"
)

// TreeProc is one process of a checkpointed tree, as recorded in the image.
type TreeProc struct {
	PID    int    `json:"pid"`
	PPID   int    `json:"ppid"`
	Comm   string `json:"comm"`
	CUDA   bool   `json:"cuda,omitempty"`
	Cgroup string `json:"cgroup,omitempty"` // its cgroup v2 path at checkpoint
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
		if p.Cgroup != "" {
			if err := proc.ValidCgroupPath(p.Cgroup); err != nil {
				return nil, fmt.Errorf("image process tree: pid %d: %w", p.PID, err)
			}
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

// EncodeCgroupsV1 renders the cgroup v1 entries of a process for Meta.Extra ("" when it has none).
func EncodeCgroupsV1(es []proc.CgroupEntry) string {
	m := map[string]string{}
	for _, e := range es {
		if !e.V2() && e.Controllers != "" {
			m[e.Controllers] = e.Path
		}
	}
	if len(m) == 0 {
		return ""
	}
	b, _ := json.Marshal(m) // cannot fail: strings
	return string(b)
}

// maxCgroupsV1 bounds the hierarchies an image may name.
const maxCgroupsV1 = 64

// ImageCgroups reads and validates the cgroups recorded in m: the root's v2 path ("" when none
// was recorded) and its v1 paths by hierarchy.
func ImageCgroups(m store.Metadata) (string, map[string]string, error) {
	v2 := m.Extra[ExtraCgroup]
	if v2 != "" {
		if err := proc.ValidCgroupPath(v2); err != nil {
			return "", nil, fmt.Errorf("image cgroup: %w", err)
		}
	}
	s, ok := m.Extra[ExtraCgroupV1]
	if !ok {
		return v2, nil, nil
	}
	var v1 map[string]string
	if err := json.Unmarshal([]byte(s), &v1); err != nil {
		return "", nil, fmt.Errorf("image cgroups (v1): %w", err)
	}
	if len(v1) > maxCgroupsV1 {
		return "", nil, fmt.Errorf("image cgroups (v1): %d hierarchies", len(v1))
	}
	for k, p := range v1 {
		if k == "" || len(k) > 256 || strings.ContainsAny(k, ":/\n") {
			return "", nil, fmt.Errorf("image cgroups (v1): bad hierarchy %q", k)
		}
		if err := proc.ValidCgroupPath(p); err != nil {
			return "", nil, fmt.Errorf("image cgroups (v1): %s: %w", k, err)
		}
	}
	return v2, v1, nil
}
