package checkpoint

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/devmem"
	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/store"
)

// Sizes of a stored image, in bytes.
type Sizes struct {
	Logical int64 `json:"logical_bytes"` // CRIU's images as written
	Written int64 `json:"written_bytes"` // new bytes written to the store
	Zero    int64 `json:"zero_bytes"`
	Dedup   int64 `json:"dedup_bytes"`
	Stored  int64 `json:"stored_bytes"`
}

// Result of a checkpoint.
type Result struct {
	Image          string          `json:"image"`
	ImageID        string          `json:"image_id"`
	PID            int             `json:"pid"`
	Kind           string          `json:"kind"`
	Tree           []op.TreeProc   `json:"tree"` // every process saved, root first
	GPUs           []imagedesc.GPU `json:"gpus,omitempty"`
	Visible        []imagedesc.GPU `json:"visible_gpus,omitempty"` // every GPU the process's CUDA driver enumerated
	ShellJob       bool            `json:"shell_job"`
	ShellJobReason string          `json:"shell_job_reason,omitempty"`
	LeftRunning    bool            `json:"left_running"`
	// Stream: CRIU's files went straight into the store; StreamOff says why not.
	Stream    bool   `json:"stream"`
	StreamOff string `json:"stream_off,omitempty"`
	// Preemption is what the shim of each CUDA process reported (quiesce before the lock, resume
	// after a --leave-running checkpoint).
	Preemption []*shimstep.PreemptReport `json:"preemption,omitempty"`
	Timings    op.Timings                `json:"timings"`
	Total      time.Duration             `json:"total_ns"`
	Sizes      Sizes                     `json:"sizes"`
	StagingDir string                    `json:"staging_dir,omitempty"` // kept (--keep-staging)
	Warnings   []string                  `json:"warnings,omitempty"`
}

// Run plans and executes a checkpoint of o.PID's process tree.
func Run(ctx context.Context, env *op.Env, o Options) (*Result, error) {
	p, err := PlanCheckpoint(ctx, env, o)
	if err != nil {
		return nil, err
	}
	return Execute(ctx, env, p)
}

// Execute runs a plan: quiesce → lock → checkpoint → detach (CUDA processes; quiesce and detach
// only for those under the shim) → dump (the tree) → store → finish (end the tree; or, with
// LeaveRunning, driver restore + unlock + resume before the store). Any failure rolls back: every
// process the dump stopped is resumed, the GPUs restored and unlocked, preempted kernels
// relaunched. A failure's CRIU log is kept (op.KeepLogs) and named in the error (*op.Failure).
func Execute(ctx context.Context, env *op.Env, p *Plan) (*Result, error) {
	t0 := time.Now()
	o := p.opts
	locks, err := oplock.AcquireAll(append([]int{p.PID}, p.CUDAPIDs...), "checkpoint", 0)
	if err != nil {
		return nil, err
	}
	defer locks.Release()

	res := &Result{PID: p.PID, Kind: p.Kind, Tree: p.Tree, GPUs: p.GPUs, Visible: p.Visible, LeftRunning: p.LeaveRunning, Warnings: p.Warnings,
		ShellJob: p.ShellJob, ShellJobReason: p.ShellJobReason, Stream: p.Stream, StreamOff: p.StreamOff}
	var manifest *store.Manifest
	var stats *store.Stats
	tr := &treeTracker{root: p.PID, known: op.TreePIDs(p.Tree, false)}
	pre := shimstep.NewPreemption(env, o.PreemptBudget)
	defer pre.Close()
	stored := func(m *store.Manifest, s *store.Stats) { manifest, stats = m, s }
	// The steps are built once the staging directory (named after the journal) is known, and
	// journaled before anything is touched.
	var images string
	cleanup := func() {}
	txn, err := env.Begin(ctx, op.TxnSpec{Op: journal.OpCheckpoint, Root: p.PID, Tree: op.TreePIDs(p.Tree, false),
		CUDA: p.CUDAPIDs, LeaveRunning: p.LeaveRunning, StagingRoot: p.StagingRoot, Store: env.Store.Dir(), Image: p.Image,
		Build: func(t *op.Txn) []op.Step {
			images = filepath.Join(t.Staging(), "images")
			var steps []op.Step
			steps, cleanup = buildSteps(env, p, newSink(env, p, images), images, tr, pre, t.Helper, stored, t0)
			return steps
		}})
	if err != nil {
		return nil, err
	}
	staging := txn.Staging()
	if err := os.Mkdir(images, 0o700); err != nil {
		err = op.Refusef("staging: %w", err)
		txn.End(err, false)
		return nil, err
	}
	timings, err := txn.Execute(ctx, txn.Steps(), env.Hook, 0)
	cleanup()
	cleanup = func() {}
	res.Timings, res.Preemption = timings, pre.Reports
	if err != nil {
		// Keep CRIU's log before the staging directory goes.
		ferr := env.NewFailure(err, "checkpoint", p.PID, []string{filepath.Join(images, "dump.log")}, tr.pids(), p.CUDAPIDs)
		txn.End(err, o.KeepStaging)
		return nil, ferr
	}
	txn.End(nil, o.KeepStaging)
	if manifest != nil {
		res.Image, res.ImageID = manifest.Name, manifest.ID
	}
	if stats != nil {
		res.Sizes = Sizes{Logical: stats.LogicalBytes, Written: stats.WrittenBytes, Zero: stats.ZeroBytes, Dedup: stats.DedupBytes, Stored: stats.StoredBytes}
	}
	if o.KeepStaging {
		res.StagingDir = staging
	}
	res.Tree = tr.tree
	res.Total = time.Since(t0)
	return res, nil
}

// treeTracker follows the tree through the checkpoint: the plan's tree, then the tree as dumped
// (read again once CRIU has stopped it, so a process forked since the plan is ended or resumed
// too).
type treeTracker struct {
	root  int
	known []int
	tree  []op.TreeProc
}

// refresh adds every process now in the root's tree.
func (t *treeTracker) refresh() {
	if stats, err := proc.Tree(t.root); err == nil {
		for _, s := range stats {
			if !slices.Contains(t.known, s.PID) {
				t.known = append(t.known, s.PID)
			}
		}
	}
}

func (t *treeTracker) pids() []int {
	t.refresh()
	return t.known
}

// buildSteps assembles the transaction over sink, the image's data path (streamed or staged),
// and a cleanup to run after it whatever happened (it drops what the sink holds uncommitted).
// Without LeaveRunning the tree is dumped and left stopped, stored, then ended: a store failure
// rolls back to a running tree. With LeaveRunning, CRIU resumes the tree after the dump and the
// driver restores and unlocks before the (slow) store, so it runs while the image is written.
// The store step commits: once the image is stored the checkpoint has happened, whatever comes
// after (a signal included). helper (may be nil) is told CRIU's pid; t0 is when the operation
// began.
func buildSteps(env *op.Env, p *Plan, sink imageSink, images string, tr *treeTracker, qs *shimstep.Preemption, helper func(int),
	stored func(*store.Manifest, *store.Stats), t0 time.Time) ([]op.Step, func()) {
	o := p.opts
	rec := &criuRecord{}
	// dropEarly frees the sink's work at a failure, unless a rollback must still load owned
	// memory back from it (the cleanup after the transaction drops it then).
	dropEarly := func() {
		if len(qs.Saved()) == 0 {
			sink.Close()
		}
	}
	d := env.Driver
	var steps []op.Step
	if len(p.CUDAPIDs) > 0 {
		if len(p.CUDAPIDs) > 1 {
			// A job (NCCL ranks): stop every rank right after the same collective first, so that
			// no rank's collective kernel waits for one already locked.
			steps = append(steps, qs.AlignStep(p.CUDAPIDs, o.LockTimeout))
		}
		steps = append(steps, qs.QuiesceStep(p.CUDAPIDs), qs.SaveMemoryStep(p.CUDAPIDs, sink.Memory, prevMemory(env)),
			qs.ExplainLock(driverstep.LockStep(d, p.CUDAPIDs, o.LockTimeout)), qs.DetachStep(), driverstep.CheckpointStep(d, p.CUDAPIDs))
	}
	criuRan := false // CRIU started: it has touched the tree, whatever it did then
	dump := criu.DumpOptions{PID: p.PID, ImagesDir: images, LeaveRunning: o.LeaveRunning, LeaveStopped: !o.LeaveRunning,
		ShellJob: p.ShellJob, TCPEstablished: o.TCPEstablished, NetworkLock: p.meta.NetworkLock, Stream: sink.Streamed(), Stall: env.CRIUStall,
		OnStart: func(pid int) {
			criuRan = true
			if helper != nil {
				helper(pid)
			}
		}}
	// Streamed, CRIU splices the tree's pages into the store's pipes: the pipes hold references to
	// the live pages, not copies, until the store has read them. A tree CRIU resumed at the end
	// of its dump (--leave-running) would write into pages still waiting in a pipe, and the image
	// would mix memory from before and after (TestLeaveRunningBusy caught it). So CRIU leaves the
	// tree stopped, and it is resumed here once the stream has been read to the end.
	resumeAfterStream := sink.Streamed() && o.LeaveRunning
	if resumeAfterStream {
		dump.LeaveRunning, dump.LeaveStopped = false, true
	}
	steps = append(steps, op.Step{Name: StepDump, Kind: KindDump,
		Do: func(ctx context.Context) error {
			// Resumed as CRIU's --leave-running would: every process but those that were stopped
			// already.
			was := stoppedNow(tr.pids())
			resume := func() error {
				var run []int
				for _, pid := range tr.pids() {
					if !was[pid] {
						run = append(run, pid)
					}
				}
				if err := proc.Continue(run, 5*time.Second); err != nil {
					return fmt.Errorf("resume the tree after the dump: %w", err)
				}
				return nil
			}
			err := sink.Dump(ctx, dump, rec)
			if resumeAfterStream {
				// (CRIU resumes the tree itself when its dump fails; SIGCONT then changes nothing,
				// and a failure to resume is reported either way.)
				if rerr := resume(); rerr != nil {
					if err == nil {
						return rerr
					}
					dropEarly()
					return op.StepUndid(err, rerr)
				}
			}
			if err != nil {
				dropEarly()
				if !criuRan {
					return err
				}
				// A failed step leaves nothing behind: CRIU resumes the tree when its dump fails,
				// but a CRIU its watchdog killed could not, and what it had stopped stays so.
				var rerr error
				if !resumeAfterStream {
					rerr = resume()
				}
				return op.StepUndid(err, rerr)
			}
			tr.refresh() // the tree as dumped (stopped, unless left running)
			return nil
		},
		Undo: func(context.Context) error {
			if o.LeaveRunning {
				return nil
			}
			return resumeTree(tr.pids(), p.CUDAPIDs, nil)
		}})
	if o.LeaveRunning && len(p.CUDAPIDs) > 0 {
		// The owned memory goes back from the sink (not committed yet: the store step comes last).
		steps = append(steps, driverstep.RestoreStep(d, op.Fixed(p.CUDAPIDs), nil, nil, false), driverstep.UnlockStep(d, op.Fixed(p.CUDAPIDs)),
			qs.LoadMemoryStep(op.Fixed(p.CUDAPIDs), sink, sink.Has), qs.ResumeStep(op.Fixed(p.CUDAPIDs), false))
	}
	steps = append(steps, op.Step{Name: StepStore, Kind: KindStore, Commit: true, Do: func(ctx context.Context) error {
		meta := p.meta
		tr.tree = dumpedTree(p.Tree, tr.known)
		meta.Tree = tr.tree
		if saved := qs.Saved(); len(saved) > 0 {
			meta.Devmem = saved
		}
		err := recordHost(env, p, rec, &meta, sink.AddFile)
		var raw store.Metadata
		if err == nil {
			raw, err = meta.Encode()
		}
		if err != nil {
			dropEarly()
			return err
		}
		m, s, err := sink.Commit(ctx, raw)
		if err != nil {
			dropEarly()
			// A Put interrupted (by a signal) after it wrote the manifest has stored the image:
			// the checkpoint happened, and must say so.
			if m, ok := imageIn(env.Store, p.Image, p.PID, t0); ok {
				env.Logger().Warn("the store reported an error after the image was stored; the image stands", "image", p.Image, "err", err)
				stored(m, nil)
				return nil
			}
			return fmt.Errorf("store image %q: %w", p.Image, err)
		}
		sink.Close()
		stored(m, s)
		return nil
	}})
	if !o.LeaveRunning {
		steps = append(steps, op.Step{Name: StepFinish, Kind: KindFinish, Do: func(context.Context) error {
			return endTree(tr.pids(), nil)
		}})
	}
	return steps, sink.Close
}

// prevMemory finds the previous image holding a process's owned memory (by its instance).
func prevMemory(env *op.Env) func(pid int, instance string) *devmem.Prev {
	return func(pid int, instance string) *devmem.Prev {
		ms, err := env.Store.List()
		if err != nil {
			return nil
		}
		return devmem.FindPrev(ms, pid, instance, func(m *store.Manifest, name string) ([]byte, error) {
			rd, err := env.Store.OpenImage(context.Background(), m.ID, store.GetOptions{})
			if err != nil {
				return nil, err
			}
			defer rd.Close()
			return devmem.ReadIndexBytes(context.Background(), rd, name)
		})
	}
}

// stoppedNow returns the processes among pids that are stopped (job control, a debugger).
func stoppedNow(pids []int) map[int]bool {
	m := map[int]bool{}
	for _, pid := range pids {
		if s, err := proc.ReadStat(pid); err == nil && s.Stopped() {
			m[pid] = true
		}
	}
	return m
}

// dumpedTree is the planned tree plus the processes found in it after the dump (forked between
// plan and dump), read from /proc while they are stopped.
func dumpedTree(planned []op.TreeProc, pids []int) []op.TreeProc {
	out := append([]op.TreeProc(nil), planned...)
	for _, pid := range pids {
		if slices.ContainsFunc(out, func(t op.TreeProc) bool { return t.PID == pid }) {
			continue
		}
		if s, err := proc.ReadStat(pid); err == nil {
			cg, _ := proc.Cgroup(pid)
			out = append(out, op.TreeProc{PID: s.PID, PPID: s.PPID, Comm: s.Comm, Cgroup: cg})
		}
	}
	return out
}
