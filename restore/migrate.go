package restore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/store"
)

// Step names of a migration.
const (
	MigrateLock       = "lock"
	MigrateCheckpoint = "checkpoint"
	MigrateRestore    = "restore"
	MigrateUnlock     = "unlock"
)

// MigrateOptions of one in-place migration.
type MigrateOptions struct {
	PID         int
	GPUs        []int             // target index per GPU the process uses (or one, for one GPU)
	GPUMap      map[string]string // old UUID (or index) → new UUID (or index)
	DryRun      bool              // plan and check only
	LockTimeout time.Duration     // driver lock timeout; 0 waits for running kernels forever
	OpLockWait  time.Duration     // wait for another ptxmig operation on the PID; 0 fails at once
}

// GPURef names a GPU.
type GPURef struct {
	Index int    `json:"index"`
	UUID  string `json:"uuid"`
	Name  string `json:"name"`
}

// MigrateResult reports a migration. Source and Target are the GPUs the process uses, before and
// after; Pairs is what the driver gets: one pair per GPU the process sees. Downtime runs from the start of the lock to the end of the
// unlock: the time the process could not use CUDA.
type MigrateResult struct {
	PID        int           `json:"pid"`
	DryRun     bool          `json:"dry_run"`
	Source     []GPURef      `json:"source"`
	Target     []GPURef      `json:"target"`
	Pairs      []Pair        `json:"gpu_pairs"` // every GPU of the host, used ones first
	Plan       []string      `json:"plan"`
	Lock       time.Duration `json:"lock_ns"`
	Checkpoint time.Duration `json:"checkpoint_ns"`
	Restore    time.Duration `json:"restore_ns"`
	Unlock     time.Duration `json:"unlock_ns"`
	Downtime   time.Duration `json:"downtime_ns"`
}

// Migrate moves a live CUDA process to other GPUs of this host with the real driver and NVML.
// Errors: preflight refusals wrap checkpoint.ErrRefused (nothing touched); failures after the
// lock are *checkpoint.StepError, RolledBack() when the process runs on its source GPUs again.
func Migrate(ctx context.Context, opts MigrateOptions) (*MigrateResult, error) {
	env := &checkpoint.Env{Log: slog.Default(), Euid: os.Geteuid()}
	d, err := cudackpt.Open()
	if err != nil {
		return nil, refusef("migrate pid %d: %w", opts.PID, err)
	}
	env.Driver = d
	inv, err := gpu.Open()
	if err != nil {
		return nil, refusef("migrate pid %d: %w", opts.PID, err)
	}
	defer inv.Close()
	env.GPUs = inv
	return MigrateWith(ctx, env, opts)
}

// MigrateWith is Migrate over the given components (tests inject failures through env.Hook).
func MigrateWith(ctx context.Context, env *checkpoint.Env, o MigrateOptions) (*MigrateResult, error) {
	if env.Log == nil {
		env.Log = slog.Default()
	}
	if env.Euid != 0 {
		return nil, refusef("ptxmig migrate must run as root")
	}
	if env.Driver == nil {
		return nil, refusef("no usable NVIDIA driver: %v", env.DriverErr)
	}
	if env.GPUs == nil {
		return nil, refusef("NVML is not available to find the process's GPUs")
	}
	pid := o.PID
	if pid <= 1 || !checkpoint.ProcessAlive(pid) {
		return nil, refusef("no running process with pid %d", pid)
	}
	if cuda, _, err := gpu.MapsCUDA(pid); err != nil || !cuda {
		return nil, refusef("pid %d does not use CUDA: nothing to migrate", pid)
	}
	st, err := env.Driver.State(pid)
	if err != nil {
		return nil, refusef("pid %d: checkpoint state: %w", pid, err)
	}
	if st != cudackpt.Running {
		return nil, refusef("pid %d is %s, not running: another tool (or a failed operation) holds it", pid, st)
	}
	devs, err := env.GPUs.Devices()
	if err != nil {
		return nil, refusef("list GPUs: %w", err)
	}
	var src []store.GPU
	mem := map[string]uint64{}
	for _, u := range gpu.UsedBy(devs, pid) {
		src = append(src, store.GPU{Index: u.Device.Index, UUID: u.Device.UUID, Name: u.Device.Name, ComputeCap: u.Device.ComputeCap, MemoryBytes: u.Memory})
		mem[strings.ToLower(u.Device.UUID)] = u.Memory
	}
	if len(src) == 0 {
		return nil, refusef("pid %d holds no GPU memory according to NVML: nothing to migrate", pid)
	}
	if len(o.GPUs) == 0 && len(o.GPUMap) == 0 {
		return nil, refusef("migrate pid %d: no target: give --gpu N", pid)
	}
	// Pairs cover every GPU of the host (see gpu.DriverSet); only MIG is refused.
	if _, err := gpu.VisibleTo(pid, devs); errors.Is(err, gpu.ErrMIG) {
		return nil, refusef("migrate pid %d: %w", pid, err)
	}
	visDevs := gpu.DriverSet(devs)
	pairs, err := PlanPairs(src, StoreGPUs(visDevs, mem), devs, o.GPUs, o.GPUMap, true)
	if err != nil {
		return nil, refusef("migrate pid %d: %w", pid, err)
	}
	res := &MigrateResult{PID: pid, DryRun: o.DryRun, Pairs: pairs}
	for _, p := range pairs {
		if p.Used {
			res.Source = append(res.Source, GPURef{Index: p.From.Index, UUID: p.From.UUID, Name: p.From.Name})
			res.Target = append(res.Target, GPURef{Index: p.To.Index, UUID: p.To.UUID, Name: p.To.Name})
		}
	}
	if !anyMove(pairs) {
		return nil, refusef("pid %d already runs on GPU %s: nothing to migrate", pid, indexes(res.Target))
	}
	dpairs, err := DriverPairs(pairs)
	if err != nil {
		return nil, refusef("migrate pid %d: %w", pid, err)
	}
	res.Plan = []string{
		fmt.Sprintf("lock pid %d (timeout %s)", pid, lockTimeoutText(o.LockTimeout)),
		fmt.Sprintf("checkpoint: copy its GPU memory (%s) to host memory", human(sum(src))),
		fmt.Sprintf("restore with %d GPU pairs, one per GPU of the host: %s", len(pairs), pairText(pairs)),
		fmt.Sprintf("unlock pid %d", pid),
		fmt.Sprintf("on failure: restore without pairs (back onto GPU %s) and unlock", indexes(res.Source)),
	}
	if o.DryRun {
		return res, nil
	}
	lk, err := oplock.Acquire(pid, "migrate", o.OpLockWait)
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
		return CheckRoom(pairs, devs, true)
	}
	steps := migrateSteps(env.Driver, pid, dpairs, o.LockTimeout, recheck)
	t0 := time.Now()
	timings, err := checkpoint.Execute(ctx, steps, env.Hook, 0, env.Log)
	res.Lock, res.Checkpoint = timings.Of(MigrateLock), timings.Of(MigrateCheckpoint)
	res.Restore, res.Unlock = timings.Of(MigrateRestore), timings.Of(MigrateUnlock)
	if err != nil {
		return res, err
	}
	res.Downtime = time.Since(t0)
	return res, nil
}

func sum(src []store.GPU) uint64 {
	var n uint64
	for _, s := range src {
		n += s.MemoryBytes
	}
	return n
}

func indexes(refs []GPURef) string {
	parts := make([]string, len(refs))
	for i, r := range refs {
		parts[i] = fmt.Sprint(r.Index)
	}
	return strings.Join(parts, ",")
}

func pairText(pairs []Pair) string {
	parts := make([]string, len(pairs))
	for i, p := range pairs {
		parts[i] = p.String()
	}
	return strings.Join(parts, "; ")
}

func lockTimeoutText(d time.Duration) string {
	if d <= 0 {
		return "none"
	}
	return d.String()
}

// migrateSteps is the migration transaction: lock → checkpoint → restore with pairs → unlock.
// If the restore onto the targets fails, the checkpoint's undo restores onto the source GPUs
// and the lock's undo unlocks. That restore passes no pairs: the driver then puts every GPU back
// where it was checkpointed (the identity), which needs no bijection and works on every driver.
//
// recheck (may be nil) runs just before the restore onto the targets; its error fails that step.
func migrateSteps(drv checkpoint.Driver, pid int, dpairs []cudackpt.Pair, lockTimeout time.Duration, recheck func() error) []checkpoint.Step {
	return []checkpoint.Step{
		{Name: MigrateLock,
			Do: func(context.Context) error { return drv.Lock(pid, lockTimeout) },
			Undo: func(context.Context) error {
				if st, err := drv.State(pid); err == nil && st != cudackpt.Locked {
					return nil
				}
				return drv.Unlock(pid)
			}},
		{Name: MigrateCheckpoint,
			Do: func(context.Context) error { return drv.Checkpoint(pid) },
			Undo: func(context.Context) error {
				st, err := drv.State(pid)
				if err == nil && st == cudackpt.Locked {
					return nil // the restore happened; the lock's undo unlocks
				}
				if rerr := drv.Restore(pid, nil); rerr != nil { // back onto the source GPUs
					return fmt.Errorf("restore onto source GPUs (state %v, %v): %w", st, err, rerr)
				}
				return nil
			}},
		{Name: MigrateRestore, Do: func(context.Context) error {
			if recheck != nil && len(dpairs) > 0 {
				if err := recheck(); err != nil {
					return err
				}
			}
			return drv.Restore(pid, dpairs)
		}},
		{Name: MigrateUnlock, Do: func(context.Context) error { return drv.Unlock(pid) }},
	}
}
