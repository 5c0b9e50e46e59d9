// Package restore brings an image back as a running process tree: Plan verifies the image's
// record and the targets (GPUs, pids) without touching anything; Execute materializes the image,
// restores the tree with CRIU, then the GPU state of its CUDA processes through the driver, as
// one transaction of the operation core (internal/op). A failure kills the half-restored tree;
// the image stays intact.
package restore

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/hostreq"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/internal/placement"
	"github.com/ptxmig/ptxmig/internal/probe"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/store"
)

// ErrPIDInUse: a pid of the image's tree is taken (CRIU restores every process under its pid).
var ErrPIDInUse = errors.New("a pid of the image is in use")

// Options of one restore.
type Options struct {
	Image       string            // name or id
	GPUs        []int             // target index per checkpointed GPU (or one, for one GPU)
	GPUMap      map[string]string // old UUID/index → new UUID/index
	KeepStaging bool
	StagingRoot string        // default: tmpfs when memory allows, else /var/tmp/ptxmig
	PIDWait     time.Duration // how long to wait for a dying process to free a pid; default 10 s
	// Cgroup is the cgroup v2 path (as /proc/PID/cgroup shows it) the whole tree goes to; it
	// must exist. "" puts each process back in its recorded cgroup, else DefaultCgroup.
	Cgroup string
	// NoStream materializes the image into the staging directory before CRIU reads it, instead
	// of streaming it to CRIU straight out of the store.
	NoStream bool
	// AllowModelChange tries a GPU pair that changes the model within one compute capability
	// although that change was not measured (placement.CheckModelChanges).
	AllowModelChange bool
	// OverwriteFiles lets a file the image carries replace a different one at its path (moved
	// aside, not deleted).
	OverwriteFiles bool
}

// Plan is a checked restore.
type Plan struct {
	Image    string           `json:"image"`
	ImageID  string           `json:"image_id"`
	PID      int              `json:"pid"`
	Kind     string           `json:"kind"`
	Tree     []op.TreeProc    `json:"tree"`
	Pairs    []placement.Pair `json:"gpu_pairs,omitempty"` // every visible GPU; the driver gets them only when one moves
	Remapped bool             `json:"remapped"`
	ShellJob bool             `json:"shell_job"`
	Bytes    int64            `json:"bytes"` // the image's logical size
	Staging  string           `json:"staging_root"`
	// Stream: CRIU reads the image straight out of the store; otherwise StreamOff says why not.
	Stream    bool   `json:"stream"`
	StreamOff string `json:"stream_off,omitempty"`
	// HostFiles is how many files the image needs on this host (all checked); Place the carried
	// copies restore puts in place first.
	HostFiles int         `json:"host_files"`
	Place     []Placement `json:"place_files,omitempty"`
	Warnings  []string    `json:"warnings,omitempty"` // what differs from the source host without being refused
	// Cgroup is the cgroup v2 path the tree's root goes to ("" on a host without cgroup v2),
	// CgroupReason why (recorded at checkpoint, the default, as asked).
	Cgroup       string        `json:"cgroup,omitempty"`
	CgroupReason string        `json:"cgroup_reason"`
	Steps        []op.PlanStep `json:"steps"`

	opts     Options
	meta     *imagedesc.Description
	dpairs   []cudackpt.Pair
	cudaPIDs []int
	cgroups  *cgroupPlan
	// listeners: the image's listening TCP sockets (planPorts), whose ports the CRIU step frees
	// of connections left in TIME_WAIT.
	listeners      []hostreq.Listener
	portsUnchecked bool // the host's listening sockets could not be listed
}

// Result of a restore.
type Result struct {
	Image       string                    `json:"image"`
	ImageID     string                    `json:"image_id"`
	PID         int                       `json:"pid"`
	Kind        string                    `json:"kind"`
	Tree        []op.TreeProc             `json:"tree"`
	Pairs       []placement.Pair          `json:"gpu_pairs,omitempty"`
	Remapped    bool                      `json:"remapped"`             // the driver got the pairs (a GPU moved)
	Stream      bool                      `json:"stream"`               // CRIU read the image straight out of the store
	StreamOff   string                    `json:"stream_off,omitempty"` // why it did not
	Preemption  []*shimstep.PreemptReport `json:"preemption,omitempty"` // resume of preempted kernels, per CUDA process under the shim
	Materialize time.Duration             `json:"materialize_ns"`
	Timings     op.Timings                `json:"timings"`
	Total       time.Duration             `json:"total_ns"`
	Bytes       int64                     `json:"bytes"`
	Cgroup      string                    `json:"cgroup,omitempty"` // the root's cgroup v2 path after the restore
	Placed      []Placement               `json:"placed_files,omitempty"`
	// ClosingEnded: connections still closing (TIME_WAIT and the states before it, no process
	// holding them) on the image's listening ports, ended so that CRIU could bind them.
	ClosingEnded int    `json:"closing_ended,omitempty"`
	StagingDir   string `json:"staging_dir,omitempty"`
}

// Run plans and executes a restore.
func Run(ctx context.Context, env *op.Env, o Options) (*Result, error) {
	p, err := PlanRestore(ctx, env, o)
	if err != nil {
		return nil, err
	}
	return Execute(ctx, env, p)
}

// PlanRestore checks the image and the targets; every failure is a refusal and nothing is
// touched. It waits (up to o.PIDWait) for dying processes that still hold the image's pids.
func PlanRestore(ctx context.Context, env *op.Env, o Options) (*Plan, error) {
	if err := env.RequireRoot("ptxmig restore"); err != nil {
		return nil, err
	}
	if env.CRIU == nil {
		return nil, op.Refusef("CRIU is not usable: %v", env.CRIUErr)
	}
	if env.Store == nil {
		return nil, op.Refusef("no image store")
	}
	m, err := env.Store.Get(o.Image)
	if err != nil {
		return nil, op.Refusef("image %q: %w", o.Image, err)
	}
	// A missing or truncated chunk file is refused here (one stat per chunk), not met part-way.
	if err := env.Store.CheckChunkFiles(ctx, m); err != nil {
		return nil, op.Refusef("%w", err)
	}
	// What the image records, every field validated; the problems are refused below, each where
	// its field is used (the host files and cgroups as the host is planned).
	meta, derr := imagedesc.Read(m)
	if meta.PID <= 1 {
		return nil, op.Refusef("image %s records no valid pid (%d): not a process image", m.Name, meta.PID)
	}
	if meta.Kind != op.KindCUDA && meta.Kind != op.KindCPU {
		return nil, op.Refusef("image %s is of kind %q, not a process checkpoint", m.Name, meta.Kind)
	}
	if meta.TTY {
		return nil, op.Refusef("image %s holds processes that had a controlling terminal: CRIU restores them only by "+
			"handing them the restoring process's own terminal, which ptxmig does not do yet; checkpoint such a job "+
			"started without a terminal (setsid, nohup, a service manager) instead", m.Name)
	}
	switch nl := meta.NetworkLock; nl {
	case "", criu.NetworkLockIptables, criu.NetworkLockNftables:
	default:
		return nil, op.Refusef("image %s records an unknown CRIU network lock method %q", m.Name, nl)
	}
	if err := meta.Problem(imagedesc.FieldTree); err != nil {
		return nil, op.Refusef("image %s: %w", m.Name, err)
	}
	if err := planProblem(derr); err != nil {
		return nil, op.Refusef("image %s: %w", m.Name, err)
	}
	tree := meta.Processes()
	p := &Plan{Image: m.Name, ImageID: m.ID, PID: meta.PID, Kind: meta.Kind, Tree: tree, opts: o, meta: meta,
		ShellJob: meta.ShellJob, Bytes: m.LogicalBytes()}
	if meta.Kind == op.KindCUDA {
		env.OpenGPU() // a CPU image never needs the driver or NVML
		p.cudaPIDs = op.TreePIDs(tree, true)
		if err := p.planGPUs(env, m.Name); err != nil {
			return nil, err
		}
	} else if len(o.GPUs) > 0 || len(o.GPUMap) > 0 {
		return nil, op.Refusef("image %s is a CPU process: --gpu/--gpu-map do not apply", m.Name)
	}
	if err := p.planHost(ctx, env, m); err != nil {
		return nil, err
	}
	if p.cgroups, err = planCgroups(p, o); err != nil {
		return nil, err
	}
	p.Cgroup, p.CgroupReason = p.cgroups.target, p.cgroups.why
	for _, t := range tree {
		if err := waitPIDFree(ctx, t.PID, o.PIDWait); err != nil {
			return nil, err
		}
	}
	// After the pid wait: the image's own process, still dying, may hold its ports.
	if err := p.planPorts(ctx, env, m); err != nil {
		return nil, err
	}
	var gpuBytes uint64
	for _, g := range meta.GPUs {
		gpuBytes += g.MemoryBytes
	}
	// Materialized, the image takes its logical bytes on the staging file system and, on tmpfs,
	// is also read back into the restored processes' memory. Streamed, staging holds CRIU's log.
	need := uint64(p.Bytes)
	switch {
	case o.NoStream:
		p.StreamOff = "--no-stream"
	case o.KeepStaging:
		p.StreamOff = "--keep-staging keeps the image's files, so they are materialized into the staging directory"
	default:
		need = op.StreamStagingBytes
	}
	if p.Staging, err = op.ChooseStaging(o.StagingRoot, need, uint64(p.Bytes)+gpuBytes); err != nil {
		return nil, err
	}
	p.Stream = p.StreamOff == ""
	p.Steps = p.describe()
	return p, nil
}

// planProblem is the first problem of an image's description (derr, from imagedesc.Read) that
// is refused before the targets are planned: all but the host files, carried files and cgroups,
// which planHost and planCgroups refuse.
func planProblem(derr error) error {
	var inv *imagedesc.InvalidError
	if !errors.As(derr, &inv) {
		return derr
	}
	for _, pr := range inv.Problems {
		switch pr.Field {
		case imagedesc.FieldHostFiles, imagedesc.FieldCarried, imagedesc.FieldCgroups:
		default:
			return pr.Err
		}
	}
	return nil
}

func (p *Plan) planGPUs(env *op.Env, name string) error {
	meta, o := p.meta, p.opts
	if err := env.DriverTooOld(probe.DriverCheckpoint); err != nil {
		return op.Refusef("image %s holds a CUDA process, but %w", name, err)
	}
	if env.Driver == nil {
		return op.Refusef("image %s holds a CUDA process but the NVIDIA driver cannot be used: %v", name, env.DriverErr)
	}
	if env.GPUs == nil {
		if len(meta.GPUs) > 0 || len(o.GPUs) > 0 || len(o.GPUMap) > 0 {
			return op.Refusef("image %s needs GPUs but NVML is not available to check them", name)
		}
		return nil
	}
	devs, err := env.GPUs.Devices()
	if err != nil {
		return op.Refusef("list GPUs: %w", err)
	}
	visible, assumed := placement.RecordedVisible(meta, devs)
	pairs, err := placement.PlanPairs(meta.GPUs, visible, devs, o.GPUs, o.GPUMap, false)
	if err != nil {
		return op.Refusef("image %s: %w", name, err)
	}
	p.Pairs = pairs
	if w := placement.SharedGPUWarning(placement.UsedTargets(pairs), nil); w != "" {
		p.Warnings = append(p.Warnings, w)
	}
	if p.dpairs, err = placement.DriverPairs(pairs); err != nil {
		return op.Refusef("image %s: %w", name, err)
	}
	p.Remapped = p.dpairs != nil
	if p.Remapped {
		if err := env.DriverTooOld(probe.DriverGPURemap); err != nil {
			return op.Refusef("image %s: %w", name, err) // a GPU moves: the driver needs the pairs
		}
	}
	if err := placement.CheckModelChanges(pairs, o.AllowModelChange); err != nil {
		return op.Refusef("image %s: %w", name, err)
	}
	if assumed && p.dpairs != nil {
		env.Logger().Warn("image records no visible-GPU set (made by an older ptxmig): assuming the process saw every GPU "+
			"of this host; if it ran with CUDA_VISIBLE_DEVICES the driver will refuse the pairs and the restore rolls back",
			"image", name, "pairs", placement.PairText(pairs))
	}
	return nil
}

func (p *Plan) describe() []op.PlanStep {
	var s []op.PlanStep
	add := func(step, format string, a ...any) {
		s = append(s, op.PlanStep{Step: step, Action: fmt.Sprintf(format, a...)})
	}
	pids := op.TreePIDs(p.Tree, false)
	if p.Stream {
		add(StepMaterialize, "verify the image's metadata files; its memory pages (%s in all) are verified as CRIU reads them "+
			"straight out of the store", bytesize.Format(p.Bytes))
	} else {
		add(StepMaterialize, "verify and write the image (%s) into %s (not streamed: %s)", bytesize.Format(p.Bytes), p.Staging, p.StreamOff)
	}
	placed := ""
	for _, pl := range p.Place {
		how := "missing here"
		if pl.Replace {
			how = "replacing the different file there, moved aside"
		}
		placed += fmt.Sprintf("; put the carried %s (%s) in place (%s)", pl.Path, bytesize.Format(pl.Size), how)
	}
	placed += p.portsText()
	add("host", "%d files the processes had open or mapped are here with the size, mode and build-ID CRIU recorded%s", p.HostFiles-len(p.Place), placed)
	sj := ""
	if p.ShellJob {
		sj = " as a shell job (into ptxmig's session)"
	}
	add(StepCRIURestore, "CRIU restore of the tree, pid %v%s, detached, into %s", pids, sj, p.cgroups.describe())
	if len(p.cudaPIDs) > 0 {
		where := "onto the GPUs it was checkpointed on"
		if p.Remapped {
			where = "with GPU pairs " + placement.PairText(p.Pairs)
		}
		add(StepDriverRestore, "driver restore of pid %v %s", p.cudaPIDs, where)
		add(StepUnlock, "driver unlock of pid %v", p.cudaPIDs)
		add(shimstep.StepResume, "processes under the ptxmig shim: relaunch kernels preempted at the checkpoint, release held launches")
	}
	add("on failure", "kill the restored processes; the image stays as it is (also if ptxmig dies: its guardian does it)")
	return s
}

// Execute runs a plan: materialize (or open the image for streaming) → CRIU restore (detached,
// under the original pids, into the planned cgroups) → driver restore with GPU pairs → unlock →
// resume (under the shim). The last step commits; any failure before kills the restored tree,
// and so does the guardian if ptxmig dies before the commit.
func Execute(ctx context.Context, env *op.Env, p *Plan) (*Result, error) {
	t0 := time.Now()
	o, meta := p.opts, p.meta
	lk, err := oplock.Acquire(meta.PID, "restore of "+p.Image, 0)
	if err != nil {
		return nil, err
	}
	defer lk.Release()

	if len(p.cudaPIDs) > 0 {
		env.StartDriver() // cuInit overlaps CRIU's restore; the driver steps come after it
	}
	res := &Result{Image: p.Image, ImageID: p.ImageID, PID: meta.PID, Kind: meta.Kind, Tree: p.Tree, Pairs: p.Pairs, Remapped: p.Remapped,
		Stream: p.Stream, StreamOff: p.StreamOff}
	treePIDs := op.TreePIDs(p.Tree, false)
	// The steps are built once the staging directory (named after the journal) is known, and
	// journaled before anything is touched.
	var src imageSource
	var images, work string
	var pre *shimstep.Preemption
	txn, err := env.Begin(ctx, op.TxnSpec{Op: journal.OpRestore, Root: meta.PID, Tree: treePIDs, CUDA: p.cudaPIDs,
		StagingRoot: p.Staging, Store: env.Store.Dir(), Image: p.Image,
		Build: func(t *op.Txn) []op.Step {
			images, work = filepath.Join(t.Staging(), "images"), filepath.Join(t.Staging(), "work")
			src = newSource(env, p, images)
			// An image of established TCP connections is restored with them, locked the way the
			// dump locked them (PlanRestore checked the method): no flag to remember.
			ropts := criu.RestoreOptions{ImagesDir: images, WorkDir: work, ShellJob: p.ShellJob, TCPEstablished: meta.TCPEstablished,
				NetworkLock: meta.NetworkLock, IgnoreCgroups: true, Stream: p.Stream, Stall: env.CRIUStall}
			var steps []op.Step
			steps, pre = buildSteps(env, p, res, src, ropts, t.Helper)
			return steps
		}})
	if err != nil {
		return nil, err
	}
	defer src.Close()
	if pre != nil {
		defer func() { res.Preemption = pre.Reports }()
	}
	staging := txn.Staging()
	dirs := []string{work}
	if p.Stream {
		dirs = append(dirs, images) // CRIU's streamer socket (materialized, the store makes it)
	}
	for _, dir := range dirs {
		if err := os.Mkdir(dir, 0o700); err != nil {
			err = op.Refusef("staging: %w", err)
			txn.End(err, false)
			return nil, err
		}
	}
	tm := time.Now()
	res.Bytes, err = src.Open(ctx)
	res.Materialize = time.Since(tm)
	if err != nil {
		if errors.Is(err, store.ErrCorrupt) {
			err = op.Refusef("image %s is corrupt, nothing was restored: %w", p.Image, err)
		}
		txn.End(err, o.KeepStaging)
		return nil, err
	}
	res.Timings, err = txn.Execute(ctx, txn.Steps(), env.Hook, 0)
	if p.Stream {
		res.Bytes = p.Bytes
	}
	if err != nil {
		ferr := env.NewFailure(err, "restore", meta.PID, []string{filepath.Join(work, "restore.log")}, treePIDs, p.cudaPIDs)
		txn.End(err, o.KeepStaging)
		return nil, ferr
	}
	txn.End(nil, o.KeepStaging)
	res.Cgroup, _ = proc.Cgroup(meta.PID)
	if o.KeepStaging {
		res.StagingDir = staging
	}
	res.Total = time.Since(t0)
	return res, nil
}

// buildSteps assembles the restore's transaction over src, the image's data path (streamed or
// staged), and returns the state of the shim's steps (nil for a tree without CUDA). helper is
// told CRIU's pid.
func buildSteps(env *op.Env, p *Plan, res *Result, src imageSource, ropts criu.RestoreOptions, helper func(int)) ([]op.Step, *shimstep.Preemption) {
	meta := p.meta
	treePIDs := op.TreePIDs(p.Tree, false)
	var restored bool
	var steps []op.Step
	if len(p.Place) > 0 {
		var unplace func()
		// The undo puts back what it moved aside; a recovery cannot (what was moved is known
		// in-process only): its rebuilt undo says where the replaced files are (KindPlaceFiles).
		steps = append(steps, op.Step{Name: StepPlaceFiles, Kind: KindPlaceFiles,
			Do: func(ctx context.Context) error {
				var err error
				unplace, err = placeFiles(ctx, env.Logger(), src, p.Place)
				if err != nil {
					return fmt.Errorf("image %s: carried files: %w", p.Image, err)
				}
				res.Placed = p.Place
				return nil
			},
			Undo: func(context.Context) error {
				unplace() // the host as it was: carried files put in place go again
				res.Placed = nil
				return nil
			}})
	}
	var began time.Duration // when the CRIU restore began (CLOCK_BOOTTIME): what it restored started since
	steps = append(steps, op.Step{
		Name: StepCRIURestore, Kind: KindCRIURestore,
		Do: func(ctx context.Context) error {
			dir, err := p.cgroups.prepare()
			if err != nil {
				return err
			}
			ended, err := freePorts(ctx, env.Logger(), p.listeners)
			res.ClosingEnded += ended
			if err != nil {
				env.Logger().Warn("cannot free the image's listening ports of connections in TIME_WAIT; CRIU may fail to bind them", "err", err)
			}
			began = proc.SinceBoot()
			criuRan := false // CRIU started: it may have created processes, whatever it did then
			ropts.CgroupDir, ropts.OnStart = dir, func(pid int) { criuRan = true; helper(pid) }
			r, err := src.Restore(ctx, ropts)
			if errors.Is(err, criu.ErrStart) && dir != "" {
				// CLONE_INTO_CGROUP refused (an old kernel, a cgroup that cannot hold processes):
				// start CRIU where ptxmig is and move the processes after.
				env.Logger().Warn("cannot start CRIU in the target cgroup; moving the restored processes after", "cgroup", p.cgroups.target, "err", err)
				ropts.CgroupDir = ""
				r, err = src.Restore(ctx, ropts)
			}
			if r != nil && r.PID > 0 {
				restored = true
			}
			if err == nil && r.PID != meta.PID {
				err = fmt.Errorf("criu restored pid %d, expected %d", r.PID, meta.PID)
			}
			if err == nil {
				if perr := p.cgroups.place(restoredTree(meta.PID, treePIDs), env.Logger()); perr != nil {
					err = fmt.Errorf("place the restored processes: %w", perr)
				}
			}
			if err != nil && criuRan {
				// The step leaves nothing behind. CRIU kills what it restored when it fails, but
				// not one its watchdog killed, nor a tree restored wrong: what is there is ended,
				// the image's tree born since the step began.
				restored = false
				left := restoredTree(meta.PID, treePIDs)
				if r != nil && r.PID > 0 && r.PID != meta.PID {
					left = append(left, r.PID)
				}
				return op.StepUndid(err, proc.Kill(bornSince(left, began), 10*time.Second))
			}
			return err
		},
		Undo: func(context.Context) error {
			if !restored {
				return nil
			}
			return killRestored(treePIDs, began, nil)
		},
	})
	var pre *shimstep.Preemption
	if len(p.cudaPIDs) > 0 {
		recheck := func() error {
			if !p.Remapped || env.GPUs == nil {
				return nil
			}
			devs, err := env.GPUs.Devices()
			if err != nil {
				return fmt.Errorf("re-read GPU memory before the driver restore: %w", err)
			}
			return placement.CheckRoom(p.Pairs, devs, false)
		}
		pre = shimstep.NewPreemption(env, 0)
		steps = append(steps,
			driverstep.RestoreStep(env.Driver, op.Fixed(p.cudaPIDs), p.dpairs, recheck, true),
			driverstep.UnlockStep(env.Driver, op.Fixed(p.cudaPIDs)),
			pre.LoadMemoryStep(op.Fixed(p.cudaPIDs), src, src.Has),
			pre.ResumeStep(op.Fixed(p.cudaPIDs), true))
	}
	steps[len(steps)-1].Commit = true
	return steps, pre
}

// restoredTree is every process to kill when a restore rolls back: the recorded pids and whatever
// the root's tree holds now.
func restoredTree(root int, recorded []int) []int {
	out := append([]int(nil), recorded...)
	if stats, err := proc.Tree(root); err == nil {
		for _, s := range stats {
			found := false
			for _, r := range out {
				found = found || r == s.PID
			}
			if !found {
				out = append(out, s.PID)
			}
		}
	}
	return out
}

// bornSince is those of pids that are processes started at or after t (CLOCK_BOOTTIME): the ones
// an operation begun at t created, not older processes that took a pid since.
func bornSince(pids []int, t time.Duration) []int {
	var out []int
	for _, pid := range pids {
		if s, err := proc.ReadStat(pid); err == nil && s.StartedSince(t) {
			out = append(out, pid)
		}
	}
	return out
}

// waitPIDFree waits for a dying process with one of the image's pids to go away, then refuses if
// the pid is still taken.
func waitPIDFree(ctx context.Context, pid int, wait time.Duration) error {
	if wait <= 0 {
		wait = 10 * time.Second
	}
	if !proc.Exists(pid) {
		return nil
	}
	comm := proc.Comm(pid)
	if proc.Alive(pid) {
		// A live process will not go away by waiting: refuse at once.
		return op.Refuse(fmt.Errorf("%w: pid %d is taken by a running process (%s); CRIU restores every process "+
			"under its original pid: stop that process, or restore in another pid namespace", ErrPIDInUse, pid, comm))
	}
	if err := proc.WaitGone(ctx, pid, wait); err != nil {
		return op.Refuse(fmt.Errorf("%w: pid %d is a zombie (%s) not reaped by its parent within %s", ErrPIDInUse, pid, comm, wait))
	}
	return nil
}
