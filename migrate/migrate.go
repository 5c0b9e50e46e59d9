// Package migrate moves a live CUDA process to other GPUs of this host, in place: lock →
// checkpoint → restore with GPU pairs → unlock, with no image and no CRIU. PlanMigrate checks
// the targets without touching anything; Execute runs the plan as one transaction of the
// operation core (internal/op): if anything fails after the lock, the process is restored onto
// its source GPUs and unlocked.
package migrate

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/internal/placement"
	"github.com/ptxmig/ptxmig/internal/probe"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/store"
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
	PID      int              `json:"pid"`
	Source   []GPURef         `json:"source"`
	Target   []GPURef         `json:"target"`
	Pairs    []placement.Pair `json:"gpu_pairs"` // every GPU of the host, used ones first
	GPUBytes uint64           `json:"gpu_bytes"`
	Steps    []op.PlanStep    `json:"steps"`
	Warnings []string         `json:"warnings,omitempty"` // what the operator should know; nothing refused

	opts   Options
	dpairs []cudackpt.Pair
}

// Result reports a migration. Downtime runs from the start of the lock to the end of the
// unlock: the time the process could not use CUDA.
type Result struct {
	PID        int                       `json:"pid"`
	Source     []GPURef                  `json:"source"`
	Target     []GPURef                  `json:"target"`
	Pairs      []placement.Pair          `json:"gpu_pairs"`
	Preemption []*shimstep.PreemptReport `json:"preemption,omitempty"`
	Timings    op.Timings                `json:"timings"`
	Lock       time.Duration             `json:"lock_ns"`
	Checkpoint time.Duration             `json:"checkpoint_ns"`
	Restore    time.Duration             `json:"restore_ns"`
	Unlock     time.Duration             `json:"unlock_ns"`
	Downtime   time.Duration             `json:"downtime_ns"`
	Warnings   []string                  `json:"warnings,omitempty"`
}

// Run plans and executes a migration.
func Run(ctx context.Context, env *op.Env, o Options) (*Result, error) {
	p, err := PlanMigrate(env, o)
	if err != nil {
		return nil, err
	}
	return Execute(ctx, env, p)
}

// PlanMigrate checks the process and the targets; every failure is a refusal (op.ErrRefused)
// and nothing is touched.
func PlanMigrate(env *op.Env, o Options) (*Plan, error) {
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
	if cuda, err := env.IsCUDA(pid); err != nil || !cuda {
		return nil, op.Refusef("pid %d does not use CUDA: nothing to migrate%s", pid, cudaDescendants(env, pid))
	}
	st, err := env.Driver.State(pid)
	if err != nil {
		return nil, op.Refusef("pid %d: checkpoint state: %w", pid, err)
	}
	if st != cudackpt.Running {
		return nil, op.Refusef("pid %d is %s, not running: another tool (or a failed operation) holds it", pid, st)
	}
	if err := op.RefuseFrameworks([]int{pid}, false); err != nil {
		return nil, err
	}
	if err := op.RefuseUnrestorable(context.Background(), []int{pid}); err != nil {
		return nil, err
	}
	if len(o.GPUs) == 0 && len(o.GPUMap) == 0 {
		return nil, op.Refusef("migrate pid %d: no target: give --gpu N", pid)
	}
	devs, err := env.GPUs.Devices()
	if err != nil {
		return nil, op.Refusef("list GPUs: %w", err)
	}
	var src []store.GPU
	mem := map[string]uint64{}
	for _, u := range gpu.UsedBy(devs, pid) {
		src = append(src, store.GPU{Index: u.Device.Index, UUID: u.Device.UUID, Name: u.Device.Name, ComputeCap: u.Device.ComputeCap, MemoryBytes: u.Memory})
		mem[strings.ToLower(u.Device.UUID)] = u.Memory
	}
	if len(src) == 0 {
		return nil, op.Refusef("pid %d holds no GPU memory according to NVML: nothing to migrate", pid)
	}
	// Pairs cover every GPU of the host (see gpu.DriverSet); only MIG is refused.
	if _, err := gpu.VisibleTo(pid, devs); errors.Is(err, gpu.ErrMIG) {
		return nil, op.Refusef("migrate pid %d: %w", pid, err)
	}
	pairs, err := placement.PlanPairs(src, placement.StoreGPUs(gpu.DriverSet(devs), mem), devs, o.GPUs, o.GPUMap, true)
	if err == nil {
		err = placement.CheckModelChanges(pairs, o.AllowModelChange)
	}
	if err != nil {
		return nil, op.Refusef("migrate pid %d: %w", pid, err)
	}
	p := &Plan{PID: pid, Pairs: pairs, opts: o}
	for _, pr := range pairs {
		if pr.Used {
			p.Source = append(p.Source, GPURef{Index: pr.From.Index, UUID: pr.From.UUID, Name: pr.From.Name})
			p.Target = append(p.Target, GPURef{Index: pr.To.Index, UUID: pr.To.UUID, Name: pr.To.Name})
			p.GPUBytes += pr.From.MemoryBytes
		}
	}
	if !placement.AnyMove(pairs) {
		return nil, op.Refusef("pid %d already runs on GPU %s: nothing to migrate", pid, indexes(p.Target))
	}
	if w := placement.SharedGPUWarning(placement.UsedTargets(pairs), func(q int) bool { return q == pid }); w != "" {
		p.Warnings = append(p.Warnings, w)
	}
	if p.dpairs, err = placement.DriverPairs(pairs); err != nil {
		return nil, op.Refusef("migrate pid %d: %w", pid, err)
	}
	p.Steps = []op.PlanStep{
		{Step: shimstep.StepQuiesce, Action: "if it runs under the ptxmig shim: stop preemptible kernels between blocks, hold new launches"},
		{Step: StepLock, Action: fmt.Sprintf("lock pid %d (timeout %s)", pid, lockTimeoutText(o.LockTimeout))},
		{Step: StepCheckpoint, Action: fmt.Sprintf("checkpoint: copy its GPU memory (%s) to host memory", bytesize.FormatU(p.GPUBytes))},
		{Step: StepRestore, Action: fmt.Sprintf("restore with %d GPU pairs, one per GPU of the host: %s", len(pairs), placement.PairText(pairs))},
		{Step: StepUnlock, Action: fmt.Sprintf("unlock pid %d", pid)},
		{Step: shimstep.StepResume, Action: "under the shim: relaunch preempted kernels on the target, release held launches"},
		{Step: "on failure", Action: fmt.Sprintf("restore without pairs (back onto GPU %s) and unlock", indexes(p.Source))},
	}
	return p, nil
}

// cudaDescendants names the CUDA processes below pid, for a refusal that points at them.
func cudaDescendants(env *op.Env, pid int) string {
	tree, err := proc.Tree(pid)
	if err != nil {
		return ""
	}
	var found []string
	for _, s := range tree[1:] {
		if c, err := env.IsCUDA(s.PID); err == nil && c {
			found = append(found, fmt.Sprint(s.PID))
		}
	}
	if len(found) == 0 {
		return ""
	}
	return fmt.Sprintf(" (its CUDA descendants: pid %s; migrate those)", strings.Join(found, ", "))
}

// Execute runs the plan, journaled with a guardian (op.Begin): quiesce (under the shim) → lock →
// checkpoint → restore with pairs → unlock → resume. If the restore onto
// the targets fails, the checkpoint's undo restores onto the source GPUs and the lock's undo
// unlocks. That restore passes no pairs: the driver then puts every GPU back where it was
// checkpointed (the identity), which needs no bijection and works on every driver.
func Execute(ctx context.Context, env *op.Env, p *Plan) (*Result, error) {
	o := p.opts
	lk, err := oplock.Acquire(p.PID, "migrate", o.OpLockWait)
	if err != nil {
		return nil, err
	}
	defer lk.Release()

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
	defer pre.Close()
	steps := Steps(env.Driver, p.PID, p.dpairs, o.LockTimeout, recheck)
	steps[0] = pre.ExplainLock(steps[0])
	steps = append(append([]op.Step{pre.QuiesceStep([]int{p.PID})}, steps...), pre.ResumeStep(op.Fixed([]int{p.PID}), false))
	steps[len(steps)-1].Commit = true
	txn, err := env.Begin(ctx, op.TxnSpec{Op: journal.OpMigrate, Root: p.PID, Tree: []int{p.PID}, CUDA: []int{p.PID},
		Steps: steps})
	if err != nil {
		return nil, err
	}
	res := &Result{PID: p.PID, Source: p.Source, Target: p.Target, Pairs: p.Pairs, Warnings: p.Warnings}
	t0 := time.Now()
	timings, err := txn.Execute(ctx, steps, env.Hook, 0)
	txn.End(err, false)
	res.Timings, res.Preemption = timings, pre.Reports
	res.Lock, res.Checkpoint = timings.Of(StepLock), timings.Of(StepCheckpoint)
	res.Restore, res.Unlock = timings.Of(StepRestore), timings.Of(StepUnlock)
	if err != nil {
		return res, env.NewFailure(err, "migrate", p.PID, nil, []int{p.PID}, []int{p.PID})
	}
	res.Downtime = time.Since(t0)
	return res, nil
}

// Steps is the migration transaction for one process (see Execute); recheck (may be nil) runs
// just before the restore onto the targets, and its error fails that step.
func Steps(drv op.Driver, pid int, dpairs []cudackpt.Pair, lockTimeout time.Duration, recheck func() error) []op.Step {
	pids := []int{pid}
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
