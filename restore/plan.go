// Package restore brings images back as running processes (Restore) and moves live CUDA
// processes between GPUs in place (Migrate), with preflight checks that refuse before anything is
// touched and rollback when a later step fails.
package restore

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/store"
)

// Preflight sentinels (each also wraps checkpoint.ErrRefused when returned by Restore/Migrate).
var (
	ErrChipMismatch = errors.New("target GPU is a different chip type")
	ErrNoRoom       = errors.New("not enough free GPU memory")
	ErrBadTarget    = errors.New("bad GPU target")
	ErrPIDInUse     = errors.New("the original PID is in use")
)

// Pair maps one checkpointed (or current) GPU onto a target GPU.
type Pair struct {
	From store.GPU  `json:"from"`
	To   gpu.Device `json:"to"`
}

// Identity reports whether the pair keeps the GPU.
func (p Pair) Identity() bool { return strings.EqualFold(p.From.UUID, p.To.UUID) }

// PlanPairs decides where each source GPU goes and checks the targets, without side effects.
//
//   - gpuMap (old UUID or index → new UUID or index) or targets (one target index per source
//     GPU, in source order; a single target is accepted for a single source GPU) choose targets;
//     giving both is an error;
//   - with neither, each GPU maps to the GPU with its UUID, else (another host) the GPU with its
//     index;
//   - every target must exist, be the same chip (name and compute capability) and be distinct;
//   - each target needs the source's recorded memory free, unless live and unmoved (a live
//     process already holds that memory).
func PlanPairs(src []store.GPU, devs []gpu.Device, targets []int, gpuMap map[string]string, live bool) ([]Pair, error) {
	if len(targets) > 0 && len(gpuMap) > 0 {
		return nil, fmt.Errorf("%w: give --gpu or --gpu-map, not both", ErrBadTarget)
	}
	if len(src) == 0 {
		if len(targets) > 0 || len(gpuMap) > 0 {
			return nil, fmt.Errorf("%w: no GPUs were recorded for this process, so there is nothing to remap", ErrBadTarget)
		}
		return nil, nil
	}
	if len(targets) > 0 && len(targets) != len(src) {
		if len(targets) == 1 {
			return nil, fmt.Errorf("%w: the process used %d GPUs (%s); give one target per GPU, e.g. --gpu %s",
				ErrBadTarget, len(src), srcList(src), exampleTargets(len(src)))
		}
		return nil, fmt.Errorf("%w: %d targets for %d GPUs (%s)", ErrBadTarget, len(targets), len(src), srcList(src))
	}
	used := map[string]bool{}
	for k := range gpuMap {
		found := false
		for _, s := range src {
			if strings.EqualFold(k, s.UUID) || k == strconv.Itoa(s.Index) {
				found = true
			}
		}
		if !found {
			return nil, fmt.Errorf("%w: --gpu-map names %s, which the process did not use (it used %s)", ErrBadTarget, k, srcList(src))
		}
	}
	pairs := make([]Pair, 0, len(src))
	for i, s := range src {
		var to gpu.Device
		var err error
		switch {
		case len(targets) > 0:
			to, err = gpu.Find(devs, strconv.Itoa(targets[i]))
		case len(gpuMap) > 0 && mapped(gpuMap, s) != "":
			to, err = gpu.Find(devs, mapped(gpuMap, s))
		default:
			to, err = gpu.Find(devs, s.UUID)
			if err != nil || s.UUID == "" {
				to, err = gpu.Find(devs, strconv.Itoa(s.Index))
			}
		}
		if err != nil {
			return nil, fmt.Errorf("GPU %d (%s) of the process: %w", s.Index, s.UUID, err)
		}
		if !sameChip(s, to) {
			return nil, fmt.Errorf("%w: GPU %d was %s (compute %s, %s); target GPU %d is %s (compute %s, %s): "+
				"the driver restores only onto the same chip type", ErrChipMismatch,
				s.Index, s.Name, s.ComputeCap, s.UUID, to.Index, to.Name, to.ComputeCap, to.UUID)
		}
		if used[to.UUID] {
			return nil, fmt.Errorf("%w: GPU %d (%s) is the target of two GPUs", ErrBadTarget, to.Index, to.UUID)
		}
		used[to.UUID] = true
		pairs = append(pairs, Pair{From: s, To: to})
	}
	for _, p := range pairs {
		if live && p.Identity() {
			continue
		}
		if need := p.From.MemoryBytes; need > p.To.MemoryFree() {
			return nil, fmt.Errorf("%w: GPU %d (%s) has %s free, the process needs %s (it used that much on GPU %d)",
				ErrNoRoom, p.To.Index, p.To.UUID, human(p.To.MemoryFree()), human(need), p.From.Index)
		}
	}
	return pairs, nil
}

func mapped(m map[string]string, s store.GPU) string {
	for k, v := range m {
		if strings.EqualFold(k, s.UUID) || k == strconv.Itoa(s.Index) {
			return v
		}
	}
	return ""
}

func sameChip(s store.GPU, d gpu.Device) bool {
	if s.Name != "" && !strings.EqualFold(s.Name, d.Name) {
		return false
	}
	return s.ComputeCap == "" || s.ComputeCap == d.ComputeCap
}

func srcList(src []store.GPU) string {
	parts := make([]string, len(src))
	for i, s := range src {
		parts[i] = fmt.Sprintf("GPU %d %s", s.Index, s.UUID)
	}
	return strings.Join(parts, ", ")
}

func exampleTargets(n int) string {
	parts := make([]string, n)
	for i := range parts {
		parts[i] = strconv.Itoa(i)
	}
	return strings.Join(parts, ",")
}

// DriverPairs converts a plan into the driver's UUID pairs; nil when no GPU moves (so drivers
// older than 580, which cannot remap, work for same-GPU restores).
func DriverPairs(pairs []Pair) ([]cudackpt.Pair, error) {
	moves := false
	for _, p := range pairs {
		if !p.Identity() {
			moves = true
		}
	}
	if !moves {
		return nil, nil
	}
	out := make([]cudackpt.Pair, 0, len(pairs))
	for _, p := range pairs {
		o, err := cudackpt.ParseUUID(p.From.UUID)
		if err != nil {
			return nil, fmt.Errorf("%w: recorded GPU %d: %w", ErrBadTarget, p.From.Index, err)
		}
		n, err := cudackpt.ParseUUID(p.To.UUID)
		if err != nil {
			return nil, fmt.Errorf("%w: target GPU %d: %w", ErrBadTarget, p.To.Index, err)
		}
		out = append(out, cudackpt.Pair{Old: o, New: n})
	}
	return out, nil
}

// ParseGPUList parses "1" or "1,0" into indexes.
func ParseGPUList(s string) ([]int, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 0 {
			return nil, fmt.Errorf("GPU index %q: want a non-negative integer", f)
		}
		out = append(out, n)
	}
	return out, nil
}

// ParseGPUMap parses "OLD=NEW,..." where each side is a GPU UUID or index.
func ParseGPUMap(s string) (map[string]string, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	m := map[string]string{}
	for _, f := range strings.Split(s, ",") {
		old, nw, ok := strings.Cut(strings.TrimSpace(f), "=")
		if !ok || old == "" || nw == "" {
			return nil, fmt.Errorf("GPU mapping %q: want OLD=NEW (UUIDs or indexes)", f)
		}
		if _, dup := m[old]; dup {
			return nil, fmt.Errorf("GPU mapping: %s mapped twice", old)
		}
		m[old] = nw
	}
	return m, nil
}

func human(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
