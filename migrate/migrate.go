// Package migrate moves a live CUDA process to other GPUs of this host, in place: lock →
// checkpoint → restore with GPU pairs → unlock, with no image and no CRIU. PlanMigrate checks
// the targets without touching anything; Execute runs the plan as one transaction of the
// operation core (internal/op): if anything fails after the lock, the process is restored onto
// its source GPUs and unlocked.
package migrate

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/internal/placement"
	"github.com/ptxmig/ptxmig/internal/probe"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimctl"
	"github.com/ptxmig/ptxmig/internal/shimstep"
)

// Step names of a migration.
const (
	StepLock       = driverstep.StepLock
	StepCheckpoint = driverstep.StepCheckpoint
	StepRestore    = driverstep.StepDriverRestore
	StepUnlock     = driverstep.StepUnlock
)

// Options of one in-place migration.
type Options struct {
	PID    int
	GPUs   []int             // target index per GPU the process uses (or one, for one GPU)
	GPUMap map[string]string // old UUID (or index) → new UUID (or index)
	// AllowModelChange: see restore.Options.
	AllowModelChange bool
	LockTimeout      time.Duration // driver lock timeout; 0 waits for running kernels forever
	// PreemptBudget: how long the quiesce of a process under the shim waits for preemptible
	// kernels to stop (0: shimstep.DefaultPreemptBudget).
	PreemptBudget time.Duration
	OpLockWait    time.Duration // wait for another ptxmig operation on the PID; 0 fails at once
	// Rehearse runs the whole move with the process's own GPUs as its targets (GPUs and GPUMap
	// empty): it proves that the process can be moved and measures the downtime, also on a host
	// with one GPU. The driver gets no pairs.
	Rehearse bool
	// NoPrecopy: owned memory is not pre-copied while the process runs; the stop copies all of it.
	NoPrecopy bool
	// NoDeviceCopy: owned memory goes through the process's host stash only; by default it is also
	// copied device to device into memory ptxmig keeps on the target GPU, and put back from there.
	NoDeviceCopy bool
}

// GPURef names a GPU.
type GPURef struct {
	Index int    `json:"index"`
	UUID  string `json:"uuid"`
	Name  string `json:"name"`
}

// Plan is a checked migration. Source and Target are the GPUs the process uses, before and after;
// Pairs is what the driver gets: one pair per GPU the process sees.
type Plan struct {
	PID int `json:"pid"`
	// PIDs are the CUDA processes that move: the process itself, or a job's ranks (every CUDA
	// process of the tree below PID: torchrun, mp.spawn).
	PIDs     []int            `json:"pids"`
	Source   []GPURef         `json:"source"`
	Target   []GPURef         `json:"target"`
	Pairs    []placement.Pair `json:"gpu_pairs"` // every GPU of the host, used ones first
	GPUBytes uint64           `json:"gpu_bytes"`
	Steps    []op.PlanStep    `json:"steps"`
	Warnings []string         `json:"warnings,omitempty"` // what the operator should know; nothing refused

	opts   Options
	dpairs []cudackpt.Pair
	// moves: per CUDA process that uses one GPU, where it goes (the device-to-device copy of its
	// owned memory needs exactly one).
	moves map[int]move
}

// move is where one process's GPU goes: To, and whether it is the GPU it is on (a rehearsal or
// a pair to itself); Bytes is what the process holds there.
type move struct {
	To    gpu.Device
	Same  bool
	Bytes uint64
}

// Result reports a migration. Downtime runs from the start of the quiesce (the lock without
// the shim) to the end of the resume: the time the process could not use CUDA.
type Result struct {
	PID        int                       `json:"pid"`
	PIDs       []int                     `json:"pids"`
	Source     []GPURef                  `json:"source"`
	Target     []GPURef                  `json:"target"`
	Pairs      []placement.Pair          `json:"gpu_pairs"`
	Preemption []*shimstep.PreemptReport `json:"preemption,omitempty"`
	Timings    op.Timings                `json:"timings"`
	Lock       time.Duration             `json:"lock_ns"`
	Checkpoint time.Duration             `json:"checkpoint_ns"`
	Restore    time.Duration             `json:"restore_ns"`
	Unlock     time.Duration             `json:"unlock_ns"`
	// Stash and Unstash: owned memory parked in the processes' own host memory and put back
	// (0 without owned memory).
	Stash     time.Duration `json:"stash_ns,omitempty"`
	Unstash   time.Duration `json:"unstash_ns,omitempty"`
	Downtime  time.Duration `json:"downtime_ns"`
	Rehearsal bool          `json:"rehearsal,omitempty"` // moved onto its own GPUs (Options.Rehearse)
	Warnings  []string      `json:"warnings,omitempty"`
}

// Run plans and executes a migration.
func Run(ctx context.Context, env *op.Env, o Options) (*Result, error) {
	p, err := PlanMigrate(ctx, env, o)
	if err != nil {
		return nil, err
	}
	return Execute(ctx, env, p)
}

// PlanMigrate checks the process and the targets; every failure is a refusal (op.ErrRefused)
// and nothing is touched.
func PlanMigrate(ctx context.Context, env *op.Env, o Options) (*Plan, error) {
	if err := env.RequireRoot("ptxmig migrate"); err != nil {
		return nil, err
	}
	if err := env.DriverTooOld(probe.DriverGPURemap); err != nil {
		return nil, op.Refusef("migrate: %w", err)
	}
	if env.Driver == nil {
		return nil, op.Refusef("no usable NVIDIA driver: %v", env.DriverErr)
	}
	if env.GPUs == nil {
		return nil, op.Refusef("NVML is not available to find the process's GPUs")
	}
	pid := o.PID
	if pid <= 1 || !proc.Alive(pid) {
		return nil, op.Refusef("no running process with pid %d", pid)
	}
	pids, err := cudaProcesses(env, pid)
	if err != nil {
		return nil, err
	}
	shims, err := op.CheckRestorable(ctx, pids)
	if err != nil {
		return nil, err
	}
	if o.Rehearse && (len(o.GPUs) > 0 || len(o.GPUMap) > 0) {
		return nil, op.Refusef("migrate pid %d: a rehearsal moves the process back onto its own GPUs: give no target", pid)
	}
	if !o.Rehearse && len(o.GPUs) == 0 && len(o.GPUMap) == 0 {
		return nil, op.Refusef("migrate pid %d: no target: give --gpu N (or --rehearse)", pid)
	}
	devs, err := env.GPUs.Devices()
	if err != nil {
		return nil, op.Refusef("list GPUs: %w", err)
	}
	src, visible, err := env.TreeGPUs(pids)
	if err != nil {
		return nil, op.Refusef("migrate pid %d: %w", pid, err)
	}
	if len(src) == 0 {
		return nil, op.Refusef("pid %s holds no GPU memory according to NVML: nothing to migrate", op.PIDText(pids))
	}
	targets := o.GPUs
	if o.Rehearse {
		targets = nil
		for _, g := range src {
			targets = append(targets, g.Index)
		}
	}
	// Pairs cover every GPU of the host (see gpu.DriverSet; TreeGPUs refuses MIG), the same for
	// every rank of a job: each takes its GPUs where the map says.
	pairs, err := placement.PlanPairs(src, visible, devs, targets, o.GPUMap, true)
	if err == nil {
		err = placement.CheckModelChanges(pairs, o.AllowModelChange)
	}
	if err != nil {
		return nil, op.Refusef("migrate pid %d: %w", pid, err)
	}
	if err := refuseNoPeerPath(env, shims, pairs); err != nil {
		return nil, err
	}
	p := &Plan{PID: pid, PIDs: pids, Pairs: pairs, opts: o}
	for _, pr := range pairs {
		if pr.Used {
			p.Source = append(p.Source, GPURef{Index: pr.From.Index, UUID: pr.From.UUID, Name: pr.From.Name})
			p.Target = append(p.Target, GPURef{Index: pr.To.Index, UUID: pr.To.UUID, Name: pr.To.Name})
			p.GPUBytes += pr.From.MemoryBytes
		}
	}
	if !placement.AnyMove(pairs) && !o.Rehearse {
		return nil, op.Refusef("pid %s already runs on GPU %s: nothing to migrate", op.PIDText(pids), indexes(p.Target))
	}
	if err := op.CheckHostMemory(p.GPUBytes); err != nil {
		return nil, fmt.Errorf("migrate pid %s: %w", op.PIDText(pids), err)
	}
	p.Warnings = append(p.Warnings, op.Unchecked(pids, len(src) > 1)...)
	if w := placement.SharedGPUWarning(placement.UsedTargets(pairs), func(q int) bool { return slices.Contains(pids, q) }); w != "" {
		p.Warnings = append(p.Warnings, w)
	}
	if p.dpairs, err = placement.DriverPairs(pairs); err != nil {
		return nil, op.Refusef("migrate pid %d: %w", pid, err)
	}
	p.moves = moves(devs, pids, pairs)
	who := fmt.Sprintf("pid %d", pid)
	if len(pids) > 1 || pids[0] != pid {
		who = fmt.Sprintf("the job's CUDA processes (pid %s)", op.PIDText(pids))
	}
	prepare := "under the shim with owned memory: ready the host memory that memory will be stashed in, and pre-copy it in rounds while the process runs"
	if o.NoPrecopy {
		prepare = "under the shim with owned memory: ready the host memory that memory will be stashed in, while the process runs"
	}
	stash := "under the shim with owned memory (ptxmig run --owned-memory): copy into the process's own host memory what it does not hold yet, and release it, so the driver moves only the rest"
	unstash := "stashed owned memory: re-create it at the same addresses on the target and copy it back"
	if !o.NoDeviceCopy {
		prepare += "; keep memory of its size on the target GPU for a device-to-device copy"
		stash += "; copy it device to device into the memory kept on the target GPU too"
		unstash = "stashed owned memory: re-create it at the same addresses on the target and copy it back from the memory kept there (device to device), else from the stash"
	}
	steps := []op.PlanStep{{Step: shimstep.StepPrepareStash, Action: prepare}}
	if len(pids) > 1 {
		steps = append(steps, op.PlanStep{Step: shimstep.StepAlign, Action: fmt.Sprintf("processes under the shim that launch collectives (NCCL ranks): stop each right after the same collective (waits up to %s)", lockTimeoutText(o.LockTimeout))})
	}
	restoreAction := fmt.Sprintf("restore with %d GPU pairs, one per GPU of the host: %s", len(pairs), placement.PairText(pairs))
	if len(p.dpairs) == 0 {
		restoreAction = fmt.Sprintf("restore onto the same GPU %s (a rehearsal: no pairs)", indexes(p.Source))
	}
	p.Steps = append(steps,
		op.PlanStep{Step: shimstep.StepQuiesce, Action: "if it runs under the ptxmig shim: stop preemptible kernels between blocks, hold new launches"},
		op.PlanStep{Step: shimstep.StepStashMemory, Action: stash},
		op.PlanStep{Step: StepLock, Action: fmt.Sprintf("lock %s (timeout %s)", who, lockTimeoutText(o.LockTimeout))},
		op.PlanStep{Step: StepCheckpoint, Action: fmt.Sprintf("checkpoint: copy its GPU memory (up to %s, less what was stashed) to host memory", bytesize.FormatU(p.GPUBytes))},
		op.PlanStep{Step: StepRestore, Action: restoreAction},
		op.PlanStep{Step: StepUnlock, Action: fmt.Sprintf("unlock %s", who)},
		op.PlanStep{Step: shimstep.StepUnstashMemory, Action: unstash},
		op.PlanStep{Step: shimstep.StepResume, Action: "under the shim: relaunch preempted kernels on the target, release held launches"},
		op.PlanStep{Step: "on failure", Action: fmt.Sprintf("restore without pairs (back onto GPU %s) and unlock", indexes(p.Source))},
	)
	return p, nil
}

// moves maps each process of pids that uses exactly one GPU to that GPU's pair.
func moves(devs []gpu.Device, pids []int, pairs []placement.Pair) map[int]move {
	out := map[int]move{}
	for _, pid := range pids {
		uses := gpu.UsedBy(devs, pid)
		if len(uses) != 1 {
			continue
		}
		for _, pr := range pairs {
			if strings.EqualFold(pr.From.UUID, uses[0].Device.UUID) {
				out[pid] = move{To: pr.To, Same: strings.EqualFold(pr.From.UUID, pr.To.UUID), Bytes: uses[0].Memory}
			}
		}
	}
	return out
}

// keepMargin is what the device-to-device copy leaves free on the target besides the kept memory
// and the process: ptxmig's own context there, and room for the driver's restore.
const keepMargin = 1 << 30

// keeper returns the device-to-device copy's allocator (shimstep.Preemption.KeepTarget) for the
// plan, or nil when the driver cannot keep memory or the copy is off. It refuses a process that
// does not use exactly one GPU, and a target without room for the kept memory beside the process
// (the process re-creates its memory there while the copy is still kept).
func (p *Plan) keeper(env *op.Env) func(pid int, bytes uint64) (*cudackpt.Kept, error) {
	drv, ok := env.Driver.(interface {
		Keep(cudackpt.UUID, uint64) (*cudackpt.Kept, error)
	})
	if !ok || p.opts.NoDeviceCopy {
		return nil
	}
	return func(pid int, bytes uint64) (*cudackpt.Kept, error) {
		m, ok := p.moves[pid]
		if !ok {
			return nil, fmt.Errorf("pid %d does not use exactly one GPU", pid)
		}
		devs, err := env.GPUs.Devices()
		if err != nil {
			return nil, fmt.Errorf("read GPU memory: %w", err)
		}
		free := uint64(0)
		for _, d := range devs {
			if strings.EqualFold(d.UUID, m.To.UUID) {
				free = d.MemoryFree()
			}
		}
		need := bytes + keepMargin
		if !m.Same {
			need += m.Bytes
		}
		if free < need {
			return nil, fmt.Errorf("GPU %d has %s free, the copy needs %s there", m.To.Index, bytesize.FormatU(free), bytesize.FormatU(need))
		}
		u, err := cudackpt.ParseUUID(m.To.UUID)
		if err != nil {
			return nil, err
		}
		return drv.Keep(u, bytes)
	}
}

// cudaProcesses is what a migrate of pid moves: every process of its tree whose GPU state the
// driver holds (env.DriverProcess: running, else refused). That is pid itself, or the ranks of a
// job (a launcher such as mp.spawn's parent, and one rank per GPU), which move together. A tree
// without a CUDA process is refused.
func cudaProcesses(env *op.Env, pid int) ([]int, error) {
	tree, err := proc.Tree(pid)
	if err != nil {
		return nil, op.Refusef("pid %d: read its process tree: %w", pid, err)
	}
	var pids []int
	for _, s := range tree {
		cuda, err := env.DriverProcess(s.PID)
		if err != nil {
			return nil, err
		}
		if cuda {
			pids = append(pids, s.PID)
		}
	}
	if len(pids) == 0 {
		return nil, op.Refusef("pid %d does not use CUDA, nor does any process below it: nothing to migrate", pid)
	}
	return pids, nil
}

// Execute runs the plan, journaled with a guardian (op.Begin): quiesce (under the shim) → stash
// owned memory → lock → checkpoint → restore with pairs → unlock → unstash → resume. If the
// restore onto the targets fails, the checkpoint's undo restores onto the source GPUs and the
// lock's undo unlocks; the stash's undo then puts the owned memory back on the source. That restore passes no pairs: the driver then puts every GPU back where it was
// checkpointed (the identity), which needs no bijection and works on every driver.
func Execute(ctx context.Context, env *op.Env, p *Plan) (*Result, error) {
	o := p.opts
	locks, err := oplock.AcquireAll(append([]int{p.PID}, p.PIDs...), "migrate", o.OpLockWait)
	if err != nil {
		return nil, err
	}
	defer locks.Release()

	// Re-read free memory right before the driver restore: on driver 580 a restore that runs
	// out of memory on the target leaves the process CHECKPOINTED for good (every later restore
	// fails with CUDA_ERROR_OPERATING_SYSTEM, measured), so a target that filled up since
	// preflight must be caught here, while restoring onto the source still works.
	recheck := func() error {
		devs, err := env.GPUs.Devices()
		if err != nil {
			return fmt.Errorf("re-read GPU memory before restore: %w", err)
		}
		return placement.CheckRoom(p.Pairs, devs, true)
	}
	pre := shimstep.NewPreemption(env, o.PreemptBudget)
	pre.KeepTarget = p.keeper(env)
	defer pre.Close()
	driver := Steps(env.Driver, p.PIDs, p.dpairs, o.LockTimeout, recheck)
	driver[0] = pre.ExplainLock(driver[0])
	steps := []op.Step{pre.PrepareStashStep(p.PIDs, !o.NoPrecopy)} // while the processes run: not downtime
	if len(p.PIDs) > 1 {
		// A job: every rank stops right after the same collective before any is locked, so no
		// rank's collective kernel waits for a rank already locked.
		steps = append(steps, pre.AlignStep(p.PIDs, o.LockTimeout))
	}
	steps = append(append(append(steps, pre.QuiesceStep(p.PIDs), pre.StashMemoryStep()), driver...),
		pre.UnstashMemoryStep(), pre.ResumeStep(op.Fixed(p.PIDs), false))
	steps[len(steps)-1].Commit = true
	tree := p.PIDs
	if !slices.Contains(tree, p.PID) {
		tree = append([]int{p.PID}, tree...) // the journal's tree starts at its root
	}
	txn, err := env.Begin(ctx, op.TxnSpec{Op: journal.OpMigrate, Root: p.PID, Tree: tree, CUDA: p.PIDs, Steps: steps})
	if err != nil {
		return nil, err
	}
	res := &Result{PID: p.PID, PIDs: p.PIDs, Source: p.Source, Target: p.Target, Pairs: p.Pairs, Warnings: p.Warnings, Rehearsal: o.Rehearse}
	t0 := time.Now()
	timings, err := txn.Execute(ctx, steps, env.Hook, 0)
	txn.End(err, false)
	res.Timings, res.Preemption = timings, pre.Reports
	res.Lock, res.Checkpoint = timings.Of(StepLock), timings.Of(StepCheckpoint)
	res.Restore, res.Unlock = timings.Of(StepRestore), timings.Of(StepUnlock)
	if slices.ContainsFunc(pre.Reports, func(r *shimstep.PreemptReport) bool { return r.Owned != nil && r.Owned.Stash != nil }) {
		res.Stash, res.Unstash = timings.Of(shimstep.StepStashMemory), timings.Of(shimstep.StepUnstashMemory)
	}
	if err != nil {
		return res, env.NewFailure(err, "migrate", p.PID, nil, p.PIDs, p.PIDs)
	}
	res.Downtime = time.Since(t0) - timings.Of(shimstep.StepPrepareStash)
	return res, nil
}

// Steps is the migration transaction's driver part for the processes that move (see Execute):
// each step acts on every process and undoes its own part if it fails for one; recheck (may
// be nil) runs just before the restore onto the targets, and its error fails that step.
func Steps(drv op.Driver, pids []int, dpairs []cudackpt.Pair, lockTimeout time.Duration, recheck func() error) []op.Step {
	if len(dpairs) == 0 {
		recheck = nil
	}
	return []op.Step{
		driverstep.LockStep(drv, pids, lockTimeout),
		driverstep.CheckpointStep(drv, pids),
		driverstep.RestoreStep(drv, op.Fixed(pids), dpairs, recheck, false),
		driverstep.UnlockStep(drv, op.Fixed(pids)),
	}
}

func indexes(refs []GPURef) string {
	parts := make([]string, len(refs))
	for i, r := range refs {
		parts[i] = fmt.Sprint(r.Index)
	}
	return strings.Join(parts, ",")
}

func lockTimeoutText(d time.Duration) string {
	if d <= 0 {
		return "none"
	}
	return d.String()
}

// refuseNoPeerPath refuses to move a process with peer links between its GPUs (its shim reports
// them) onto GPUs between which this host has no peer path: the shim turns peer access off for
// the move and enables it again at the resume, which would fail there, and the migrate would roll
// back after the whole move. Without NVML's answer (a Lister that cannot tell, an error) nothing
// is refused. shims: the processes' shim statuses (op.CheckRestorable).
func refuseNoPeerPath(env *op.Env, shims map[int]*shimctl.Status, pairs []placement.Pair) error {
	pp, ok := env.GPUs.(gpu.PeerPather)
	if !ok {
		return nil
	}
	for _, pid := range slices.Sorted(maps.Keys(shims)) {
		st := shims[pid]
		if st.PeerAccess == 0 {
			continue
		}
		own, _, err := env.TreeGPUs([]int{pid})
		if err != nil {
			continue
		}
		var to []gpu.Device
		for _, pr := range pairs {
			if pr.Used && slices.ContainsFunc(own, func(g imagedesc.GPU) bool { return strings.EqualFold(g.UUID, pr.From.UUID) }) {
				to = append(to, pr.To)
			}
		}
		for i := range to {
			for j := i + 1; j < len(to); j++ {
				if strings.EqualFold(to[i].UUID, to[j].UUID) {
					continue
				}
				path, err := pp.PeerPath(to[i].UUID, to[j].UUID)
				if err != nil || path {
					continue
				}
				return op.Refusef("pid %d has enabled peer access between its GPUs (%d link(s), reported by the ptxmig shim), "+
					"and its targets GPU %d and GPU %d have no peer path between them (NVML): peer access could not be "+
					"enabled again after the move; nothing was touched. Choose targets with a peer path (`nvidia-smi topo -p2p r` "+
					"shows them), or start the process with `ptxmig run --no-peer-access`", pid, st.PeerAccess, to[i].Index, to[j].Index)
			}
		}
	}
	return nil
}
