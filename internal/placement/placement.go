// Package placement decides where each GPU of a process goes when it is restored or migrated:
// the pairs the driver needs (one per GPU the process sees, a bijection onto same-chip GPUs) and
// the checks on the targets (present, same chip, free memory). Pure functions of their inputs.
package placement

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
)

// Preflight sentinels (each also wraps op.ErrRefused when returned by restore or migrate).
var (
	ErrChipMismatch = errors.New("target GPU is of another chip family")
	ErrNoRoom       = errors.New("not enough free GPU memory")
	ErrBadTarget    = errors.New("bad GPU target")
	// ErrTooFewGPUs: the process saw more GPUs than the target host has of the same chip, and the
	// driver needs a distinct target for every GPU the process saw.
	ErrTooFewGPUs = errors.New("too few GPUs to pair every GPU of the source host")
	// ErrVisibleUnknown: a move needs the process's visible-GPU set, which is unknown or
	// inconsistent with the GPUs it uses.
	ErrVisibleUnknown = errors.New("the GPUs visible to the process are unknown")
)

// Pair maps one checkpointed (or current) GPU onto a target GPU. Used pairs carry the process's
// memory; the others are GPUs the process could see but did not use, which the driver needs
// paired too.
type Pair struct {
	From imagedesc.GPU `json:"from"`
	To   gpu.Device    `json:"to"`
	Used bool          `json:"used"`
	// ModelChange: the target is another GPU model of the same chip family (gpu.SameChip);
	// ModelChangeMeasured: that model change was measured to restore exactly.
	ModelChange         bool `json:"model_change,omitempty"`
	ModelChangeMeasured bool `json:"model_change_measured,omitempty"`
}

// newPair pairs s with d, noting a change of GPU model.
func newPair(s imagedesc.GPU, d gpu.Device, used bool) Pair {
	p := Pair{From: s, To: d, Used: used}
	if gpu.ModelChange(s.Name, d.Name) {
		p.ModelChange, p.ModelChangeMeasured = true, gpu.MeasuredModelChange(s.Name, d.Name)
	}
	return p
}

// CheckModelChanges refuses a pair that changes the GPU model when that change was not measured
// to restore (gpu.MeasuredModelChange) and allow is false: one compute capability spans several
// chips (8.6: GA102 to GA107), and whether the driver restores across them is unknown.
func CheckModelChanges(pairs []Pair, allow bool) error {
	for _, p := range pairs {
		if p.ModelChange && !p.ModelChangeMeasured && !allow {
			return fmt.Errorf("%w: GPU %d (%s) would go to GPU %d (%s), another model of compute capability %s; "+
				"a restore across these two models was not measured: --allow-model-change tries it (if the driver refuses, "+
				"the operation rolls back)", ErrChipMismatch, p.From.Index, p.From.Name, p.To.Index, p.To.Name, p.To.ComputeCap)
		}
	}
	return nil
}

// ModelChanges lists the pairs that carry memory onto another GPU model.
func ModelChanges(pairs []Pair) []Pair {
	var out []Pair
	for _, p := range pairs {
		if p.Used && p.ModelChange {
			out = append(out, p)
		}
	}
	return out
}

// Identity reports whether the pair keeps the GPU.
func (p Pair) Identity() bool { return strings.EqualFold(p.From.UUID, p.To.UUID) }

// String is "GPU 0 (GPU-…) -> GPU 1 (GPU-…) [used]".
func (p Pair) String() string {
	role := "visible"
	if p.Used {
		role = "used"
	}
	out := fmt.Sprintf("GPU %d (%s) -> GPU %d (%s) [%s]", p.From.Index, p.From.UUID, p.To.Index, p.To.UUID, role)
	if p.ModelChange {
		how := "not measured"
		if p.ModelChangeMeasured {
			how = "measured"
		}
		out += fmt.Sprintf(" [model %s -> %s, same chip family %s, %s]", p.From.Name, p.To.Name, p.To.ComputeCap, how)
	}
	return out
}

// PlanPairs decides where each GPU of the process goes and checks the targets, without side
// effects. used are the GPUs the process uses (with their memory), visible the GPUs its CUDA
// driver enumerated (a superset of used; nil when unknown), devs the target host's GPUs.
//
// The used GPUs go where the operator asked:
//   - gpuMap (old UUID or index → new UUID or index) or targets (one target index per used GPU,
//     in order; a single target is accepted for a single GPU) choose targets; giving both is an
//     error;
//   - with neither, each GPU maps to the GPU with its UUID, else (another host) the GPU with its
//     index;
//   - every target must exist, be of the same chip family (gpu.SameChip: compute capability; the
//     model may change, which the pair notes) and be distinct;
//   - each target needs the used GPU's recorded memory free, unless live and unmoved (a live
//     process already holds that memory).
//
// When a used GPU moves, the driver needs a pair for every visible GPU, and the pairs must be a
// bijection (each old UUID once, each new UUID once): the other visible GPUs keep their GPU (same
// UUID, else same index) unless it is taken, and the rest take the remaining same-chip GPUs in
// index order, GPUs the process already sees first. Moving 0→1 on two GPUs gives {0→1, 1→0};
// moving 0→2 on four gives {0→2, 1→1, 2→0, 3→3}; with CUDA_VISIBLE_DEVICES=1,3 moving 1→3 gives
// {1→3, 3→1}. They need no free memory: the process holds none there.
//
// The result lists the used pairs first (in used order), then the other visible GPUs by index.
// When nothing moves it still lists the visible GPUs that are present (DriverPairs then passes
// none).
func PlanPairs(used, visible []imagedesc.GPU, devs []gpu.Device, targets []int, gpuMap map[string]string, live bool) ([]Pair, error) {
	pairs, err := planUsed(used, devs, targets, gpuMap)
	if err != nil || len(pairs) == 0 {
		return pairs, err
	}
	moves := AnyMove(pairs)
	rest, err := completeVisible(pairs, visible, devs)
	switch {
	case err == nil:
		pairs = append(pairs, rest...)
	case moves:
		return nil, err
	default:
		// Nothing moves, so the driver gets no pairs; a visible GPU missing from this host does
		// not matter then.
	}
	if err := CheckRoom(pairs, devs, live); err != nil {
		return nil, err
	}
	return pairs, nil
}

// CheckRoom verifies that every target receiving used memory has that much free in devs (a
// fresh NVML reading). A live process (live: migrate, in place) gives its memory back when it is
// checkpointed, before any restore: a GPU's room is then its free memory plus what the moved
// processes hold on it, so GPUs swapped between the ranks of a job, or between the two GPUs of
// one process, fit wherever the memory of both fits. A live process's unmoved GPUs take
// nothing new.
func CheckRoom(pairs []Pair, devs []gpu.Device, live bool) error {
	free := map[string]uint64{}
	for _, d := range devs {
		free[strings.ToLower(d.UUID)] = d.MemoryFree()
	}
	need := map[string]uint64{}
	var order []Pair // the first pair landing on each target, for the message
	for _, p := range pairs {
		if !p.Used {
			continue
		}
		if live {
			if p.Identity() {
				continue // it takes back what it gives up
			}
			free[strings.ToLower(p.From.UUID)] += p.From.MemoryBytes
		}
		to := strings.ToLower(p.To.UUID)
		if _, ok := need[to]; !ok {
			order = append(order, p)
		}
		need[to] += p.From.MemoryBytes
	}
	for _, p := range order {
		to := strings.ToLower(p.To.UUID)
		avail, ok := free[to]
		if !ok {
			return fmt.Errorf("%w: GPU %d (%s) is gone", ErrBadTarget, p.To.Index, p.To.UUID)
		}
		if n := need[to]; n > avail {
			what := "it used that much on GPU " + fmt.Sprint(p.From.Index)
			if live {
				what += ", counting the memory it gives back there"
			}
			return fmt.Errorf("%w: GPU %d (%s) has %s free, the process needs %s (%s)",
				ErrNoRoom, p.To.Index, p.To.UUID, human(avail), human(n), what)
		}
	}
	return nil
}

// planUsed maps the used GPUs as the operator asked.
func planUsed(src []imagedesc.GPU, devs []gpu.Device, targets []int, gpuMap map[string]string) ([]Pair, error) {
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
	taken := map[string]bool{}
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
				"the driver restores only onto a GPU of the same chip family (compute capability)", ErrChipMismatch,
				s.Index, s.Name, s.ComputeCap, s.UUID, to.Index, to.Name, to.ComputeCap, to.UUID)
		}
		if taken[strings.ToLower(to.UUID)] {
			return nil, fmt.Errorf("%w: GPU %d (%s) is the target of two GPUs", ErrBadTarget, to.Index, to.UUID)
		}
		taken[strings.ToLower(to.UUID)] = true
		pairs = append(pairs, newPair(s, to, true))
	}
	return pairs, nil
}

// completeVisible pairs the visible GPUs the process does not use, so that together with the
// used pairs every visible GPU has a distinct same-chip target.
func completeVisible(usedPairs []Pair, visible []imagedesc.GPU, devs []gpu.Device) ([]Pair, error) {
	if visible == nil {
		return nil, fmt.Errorf("%w: the driver needs a pair for every GPU the process sees, and this image does not "+
			"record them (it was made by an older ptxmig on another host); restore it without moving, or checkpoint "+
			"the process again with this version", ErrVisibleUnknown)
	}
	key := func(u string) string { return strings.ToLower(u) }
	usedSrc, taken := map[string]bool{}, map[string]bool{}
	for _, p := range usedPairs {
		usedSrc[key(p.From.UUID)] = true
		taken[key(p.To.UUID)] = true
	}
	seen := map[string]bool{}
	var others []imagedesc.GPU
	for _, v := range visible {
		k := key(v.UUID)
		if v.UUID == "" || seen[k] {
			return nil, fmt.Errorf("%w: the visible set (%s) has a GPU without a UUID or listed twice", ErrVisibleUnknown, srcList(visible))
		}
		seen[k] = true
		if !usedSrc[k] {
			others = append(others, v)
		}
	}
	for _, p := range usedPairs {
		if !seen[key(p.From.UUID)] {
			return nil, fmt.Errorf("%w: the process uses GPU %d (%s), which is not among the GPUs its environment makes "+
				"visible (%s); did it change CUDA_VISIBLE_DEVICES after it started?", ErrVisibleUnknown, p.From.Index, p.From.UUID, srcList(visible))
		}
	}
	sort.SliceStable(others, func(i, j int) bool { return others[i].Index < others[j].Index })

	out := make([]Pair, len(others))
	var fill []int // positions in others still without a target
	for i, s := range others {
		if d, ok := identityTarget(s, devs); ok && !taken[key(d.UUID)] && sameChip(s, d) {
			out[i] = newPair(s, d, false)
			taken[key(d.UUID)] = true
			continue
		}
		fill = append(fill, i)
	}
	// Remaining targets: first the GPUs the process already sees (the ones its used GPUs left),
	// so that it stays on its own set of GPUs where it can; then the others; each in index order.
	byIndex := append([]gpu.Device(nil), devs...)
	sort.SliceStable(byIndex, func(i, j int) bool {
		si, sj := seen[key(byIndex[i].UUID)], seen[key(byIndex[j].UUID)]
		if si != sj {
			return si
		}
		return byIndex[i].Index < byIndex[j].Index
	})
	for _, i := range fill {
		s := others[i]
		found := false
		for _, d := range byIndex {
			if !taken[key(d.UUID)] && sameChip(s, d) {
				out[i] = newPair(s, d, false)
				taken[key(d.UUID)] = true
				found = true
				break
			}
		}
		if !found {
			free := 0
			for _, d := range devs {
				if !taken[key(d.UUID)] {
					free++
				}
			}
			sentinel := ErrTooFewGPUs
			if free > 0 {
				sentinel = ErrChipMismatch
			}
			return nil, fmt.Errorf("%w: the process sees %d GPUs (%s) and the driver needs a distinct target of the same chip "+
				"for each; none is left for GPU %d (%s, %s) on this host (%s)",
				sentinel, len(visible), srcList(visible), s.Index, s.UUID, s.Name, devList(devs))
		}
	}
	return out, nil
}

// identityTarget is the GPU a visible GPU keeps: the one with its UUID, else (another host) the
// one with its index.
func identityTarget(s imagedesc.GPU, devs []gpu.Device) (gpu.Device, bool) {
	for _, d := range devs {
		if strings.EqualFold(d.UUID, s.UUID) {
			return d, true
		}
	}
	for _, d := range devs {
		if d.Index == s.Index {
			return d, true
		}
	}
	return gpu.Device{}, false
}

// AssumeVisible is the visible set for an image that does not record one: every GPU of this
// host, as if the process had run here without CUDA_VISIBLE_DEVICES. It holds only when the
// image was made on this host (its used GPUs are here); otherwise ok is false. Callers should
// warn: a process that ran with CUDA_VISIBLE_DEVICES saw fewer GPUs, and the driver then refuses
// the pairs (the restore rolls back).
func AssumeVisible(used []imagedesc.GPU, devs []gpu.Device) ([]imagedesc.GPU, bool) {
	mem := map[string]uint64{}
	for _, u := range used {
		if _, err := gpu.Find(devs, u.UUID); err != nil || u.UUID == "" {
			return nil, false
		}
		mem[strings.ToLower(u.UUID)] = u.MemoryBytes
	}
	return StoreGPUs(devs, mem), true
}

// StoreGPUs converts devices into recorded GPUs, with the memory a process used on each (by
// lower-case UUID), sorted by index.
func StoreGPUs(devs []gpu.Device, mem map[string]uint64) []imagedesc.GPU {
	out := make([]imagedesc.GPU, 0, len(devs))
	for _, d := range devs {
		out = append(out, imagedesc.GPU{Index: d.Index, UUID: d.UUID, Name: d.Name, ComputeCap: d.ComputeCap, MemoryBytes: mem[strings.ToLower(d.UUID)]})
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Index < out[j].Index })
	return out
}

func devList(devs []gpu.Device) string {
	if len(devs) == 0 {
		return "no GPUs"
	}
	parts := make([]string, len(devs))
	for i, d := range devs {
		parts[i] = fmt.Sprintf("GPU %d %s %s", d.Index, d.UUID, d.Name)
	}
	return strings.Join(parts, ", ")
}

func mapped(m map[string]string, s imagedesc.GPU) string {
	for k, v := range m {
		if strings.EqualFold(k, s.UUID) || k == strconv.Itoa(s.Index) {
			return v
		}
	}
	return ""
}

func sameChip(s imagedesc.GPU, d gpu.Device) bool {
	return gpu.SameChip(s.Name, s.ComputeCap, d.Name, d.ComputeCap)
}

func srcList(src []imagedesc.GPU) string {
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
// older than 580, which cannot remap, work for same-GPU restores). When a GPU moves, the plan
// must pair every visible GPU as a bijection (PlanPairs makes it so; DriverPairs re-checks):
// driver 580 refuses a partial array with CUDA_ERROR_INVALID_VALUE.
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
	olds, news := map[cudackpt.UUID]bool{}, map[cudackpt.UUID]bool{}
	for _, p := range pairs {
		o, err := cudackpt.ParseUUID(p.From.UUID)
		if err != nil {
			return nil, fmt.Errorf("%w: recorded GPU %d: %w", ErrBadTarget, p.From.Index, err)
		}
		n, err := cudackpt.ParseUUID(p.To.UUID)
		if err != nil {
			return nil, fmt.Errorf("%w: target GPU %d: %w", ErrBadTarget, p.To.Index, err)
		}
		if olds[o] || news[n] {
			return nil, fmt.Errorf("%w: the pairs are not a one-to-one mapping (%s)", ErrBadTarget, PairText(pairs))
		}
		olds[o], news[n] = true, true
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

// human formats n like the rest of ptxmig's output.
func human(n uint64) string { return bytesize.FormatU(n) }

// PairText lists pairs on one line.
func PairText(pairs []Pair) string {
	parts := make([]string, len(pairs))
	for i, p := range pairs {
		parts[i] = p.String()
	}
	return strings.Join(parts, "; ")
}

// AnyMove reports whether some pair changes GPU.
func AnyMove(pairs []Pair) bool {
	for _, p := range pairs {
		if !p.Identity() {
			return true
		}
	}
	return false
}

// RecordedVisible is the image's visible-GPU set; for images without one (older ptxmig), every
// GPU of this host when the image was made here (assumed is then true), else nil (a move is
// then refused: the other host's GPUs cannot be named).
func RecordedVisible(meta *imagedesc.Description, devs []gpu.Device) (visible []imagedesc.GPU, assumed bool) {
	if len(meta.Visible) > 0 {
		return meta.Visible, false
	}
	v, ok := AssumeVisible(meta.GPUs, devs)
	if !ok {
		return nil, false
	}
	return v, true
}
