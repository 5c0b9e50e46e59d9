// Package shimstep holds the operations' steps that go through the ptxmig shim of a process
// (preemption: align, quiesce, detach, resume; owned device memory: save, load), with their undos
// and the step kinds a crash recovery rebuilds them by.
package shimstep

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/shimctl"
)

// Step names of the preemption steps (processes running under the shim only).
const (
	StepQuiesce = "quiesce"
	StepDetach  = "detach"
	StepResume  = "resume"
)

// DefaultPreemptBudget is how long a quiesce may wait for preemptible kernels to stop.
const DefaultPreemptBudget = 10 * time.Millisecond

// PreemptReport is what the shim of one process said around an operation.
type PreemptReport struct {
	PID        int              `json:"pid"`
	Shim       bool             `json:"shim"` // a control socket answered
	Proto      int              `json:"proto,omitempty"`
	Note       string           `json:"note,omitempty"` // why nothing was quiesced, or what went wrong
	Quiesce    *shimctl.Quiesce `json:"quiesce,omitempty"`
	QuiesceDur time.Duration    `json:"quiesce_ns"`             // round trip of the quiesce request
	StopWait   time.Duration    `json:"stop_wait_ns,omitempty"` // then, waiting for twins still stopping
	Resume     *shimctl.Resume  `json:"resume,omitempty"`
	Align      *AlignReport     `json:"align,omitempty"`        // a job's process stopped after a collective first (AlignStep)
	Owned      *OwnedMemory     `json:"owned_memory,omitempty"` // device memory the shim owns (--owned-memory)
	// PeerOff: the process's peer access, turned off after the quiesce (a resume turns it on).
	PeerOff *shimctl.PeerSet `json:"peer_off,omitempty"`
}

// Preemption quiesces the CUDA processes of an operation that run under the shim before the
// driver lock, so that preemptible kernels stop at block boundaries instead of holding the lock,
// and resumes them afterwards (or on rollback). Processes without the shim are left as they are:
// the driver lock then waits for their kernels, as before. A shim that cannot be reached, or
// fails, never fails the operation: the report says so and the lock decides.
type Preemption struct {
	Budget  time.Duration // per quiesce; 0 means DefaultPreemptBudget
	Reports []*PreemptReport
	leases  map[int]*shimctl.Client // open quiesce leases by pid
	aligned map[int]*shimctl.Client // armed by AlignStep: the quiesce takes the connection over
	log     func(msg string, args ...any)
	note    func(format string, a ...any) // a recovery's report (nil in-process)
	// dialer reaches a pid's shim (nil: dial, through the socket directory in its environment);
	// tests serve several fake shims from one process.
	dialer func(ctx context.Context, pid int) (*shimctl.Client, error)
	// KeepTarget (migrate; nil: none) allocates device memory of bytes on the GPU pid moves to,
	// for its owned memory's device-to-device copy (PrepareStashStep); kept holds it until the
	// unstash or Close.
	KeepTarget func(pid int, bytes uint64) (*cudackpt.Kept, error)
	kept       map[int]*keptTarget
}

// keptTarget is the memory kept for one process's device-to-device copy, with the descriptors
// the stash and the unstash hand its shim, exported while the process still runs.
type keptTarget struct {
	k              *cudackpt.Kept
	stash, unstash *os.File
}

// NewPreemption prepares the preemption of an operation.
func NewPreemption(env *op.Env, budget time.Duration) *Preemption {
	if budget <= 0 {
		budget = DefaultPreemptBudget
	}
	return &Preemption{Budget: budget, leases: map[int]*shimctl.Client{}, log: env.Logger().Info}
}

func (p *Preemption) report(pid int) *PreemptReport {
	for _, r := range p.Reports {
		if r.PID == pid {
			return r
		}
	}
	r := &PreemptReport{PID: pid}
	p.Reports = append(p.Reports, r)
	return r
}

// dial reaches pid's shim (see dialer).
func (p *Preemption) dial(ctx context.Context, pid int) (*shimctl.Client, error) {
	if p.dialer != nil {
		return p.dialer(ctx, pid)
	}
	return dial(ctx, pid)
}

// dial reaches pid's shim in the socket directory of pid's own environment.
func dial(ctx context.Context, pid int) (*shimctl.Client, error) { return op.DialShim(ctx, pid) }

// KindQuiesce is the quiesce step's kind (see op.Kind): its journal data is the pids.
const KindQuiesce = "shim.quiesce"

type pidsData struct {
	PIDs []int `json:"pids"`
}

func init() {
	// After a crash: resume the recorded processes still alive as themselves whose shim can be
	// reached (a quiesce that ptxmig detached stays until resumed; an attached one ended when
	// ptxmig's connection closed).
	op.RegisterKind(op.Kind{ID: KindQuiesce, Rebuild: func(r *op.Rec, data json.RawMessage) (op.Recovery, error) {
		var x pidsData
		if err := json.Unmarshal(data, &x); err != nil {
			return op.Recovery{}, err
		}
		return op.Recovery{Undo: func(ctx context.Context) error {
			p := &Preemption{leases: map[int]*shimctl.Client{}, log: r.Log.Info, note: r.Note}
			return p.resumeAll(ctx, r.Alive(x.PIDs), false)
		}}, nil
	}})
}

// QuiesceStep quiesces every pid that runs under a preemption-capable shim; its undo resumes them.
func (p *Preemption) QuiesceStep(pids []int) op.Step {
	return op.Step{Name: StepQuiesce, Kind: KindQuiesce, Data: pidsData{PIDs: pids},
		Do: func(ctx context.Context) error {
			for _, pid := range pids {
				p.quiesce(ctx, pid)
				if err := p.peerOff(ctx, pid); err != nil {
					return undoPartial(ctx, err, true, func(ctx context.Context) error { return p.resumeAll(ctx, pids, true) },
						"resume the processes quiesced")
				}
			}
			return nil
		},
		Undo: func(ctx context.Context) error { return p.resumeAll(ctx, pids, true) }}
}

// peerOffTimeout bounds peer-off, which first waits for the work queued in the contexts with a
// peer link (a kernel without a twin still running).
const peerOffTimeout = 30 * time.Second

// peerOff turns a quiesced process's peer access off (the driver restores it only so; the resume
// turns it on again). A process without links, or whose shim predates peer-off, is left as it
// is: preflight refuses a process with links under such a shim (op.RefuseUnrestorable).
func (p *Preemption) peerOff(ctx context.Context, pid int) error {
	c, ok := p.leases[pid]
	if !ok {
		// Not quiesced (no shim, or its quiesce failed): a shim that reports links must not be
		// checkpointed with them on.
		if r := p.report(pid); r.Shim {
			if st, err := op.ShimStatus(ctx, pid); err == nil && st != nil && st.PeerAccess > 0 {
				return fmt.Errorf("pid %d has peer access enabled and was not quiesced (%s), so it cannot be turned off for the checkpoint", pid, r.Note)
			}
		}
		return nil
	}
	if r := p.report(pid); r.Quiesce == nil || r.Quiesce.PeerLinks == 0 {
		return nil
	}
	pctx, cancel := context.WithTimeout(ctx, peerOffTimeout)
	defer cancel()
	x, err := c.PeerOff(pctx)
	switch {
	case errors.Is(err, shimctl.ErrNoPeerToggle):
		return nil
	case err != nil:
		// The shim may still be waiting for the contexts' work: its late reply must not be read
		// as the resume's. Closing the lease makes the shim enable the links again and resume
		// once it is done; the rollback's resume comes on a connection of its own.
		c.Close()
		delete(p.leases, pid)
		return fmt.Errorf("pid %d: turn its peer access off for the checkpoint: %w", pid, err)
	}
	p.report(pid).PeerOff = x
	if x.Links > 0 && x.LargestDeviceAlloc > op.PeerAllocLimit {
		// Allocated since the preflight: the driver would not give the links back after its
		// restore. The rollback's resume turns them on again here, where nothing was restored.
		return fmt.Errorf("pid %d has peer access enabled between its GPUs (%d link(s)) and, since the preflight, a cudaMalloc "+
			"allocation of %d MiB: after a restore the NVIDIA driver cannot turn peer access toward a context holding one over "+
			"%d MiB back on (driver 580.159.04), so it is not checkpointed. Start it with `ptxmig run --no-peer-access`",
			pid, x.Links, x.LargestDeviceAlloc>>20, op.PeerAllocLimit>>20)
	}
	return nil
}

func (p *Preemption) quiesce(ctx context.Context, pid int) {
	r := p.report(pid)
	c, err := p.aligned[pid], error(nil)
	if c != nil {
		delete(p.aligned, pid) // the arming lease becomes the quiesce lease
	} else {
		dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		c, err = dial(dctx, pid)
		cancel()
	}
	if err != nil {
		if errors.Is(err, shimctl.ErrNoShim) {
			r.Note = "not running under the ptxmig shim: the driver lock waits for its kernels"
		} else {
			r.Note = fmt.Sprintf("shim unreachable (%v): the driver lock waits for its kernels", err)
		}
		return
	}
	r.Shim = true
	qctx, cancel := context.WithTimeout(ctx, p.Budget+5*time.Second)
	defer cancel()
	t0 := time.Now()
	q, err := c.Quiesce(qctx, p.Budget)
	r.QuiesceDur, r.Proto = time.Since(t0), c.Proto()
	if err != nil {
		c.Close() // ends the lease if there was one: the shim resumes by itself
		if errors.Is(err, shimctl.ErrNoPreemption) {
			r.Note = "the shim has no preemption (protocol 1): the driver lock waits for its kernels"
		} else {
			r.Note = fmt.Sprintf("quiesce failed (%v): the driver lock waits for its kernels", err)
			p.log("quiesce failed; falling back to the driver lock", "pid", pid, "err", err)
		}
		return
	}
	r.Quiesce = q
	p.leases[pid] = c
	if len(q.Stopping) > 0 {
		// Twins still stopping when the budget ran out: the shim keeps raising their flags, but
		// the driver lock would block its raises, so wait for them to end first (bounded).
		t1 := time.Now()
		left, err := waitStopped(ctx, c, stopWaitMax)
		r.StopWait = time.Since(t1)
		if err != nil || left > 0 {
			r.Note = fmt.Sprintf("%d twin(s) still stopping after %s (%v): the driver lock may wait for them", left, r.StopWait.Round(time.Millisecond), err)
		}
	}
}

// stopWaitMax bounds the wait for twins that were still stopping when a quiesce replied.
const stopWaitMax = 10 * time.Second

// waitStopped polls status until no twin is stopping; it returns how many are left. The polls
// start 0.5 ms apart (twins stop within milliseconds) and back off to 50 ms, so that a process
// whose twins never stop costs ptxmig few status decodes.
func waitStopped(ctx context.Context, c *shimctl.Client, max time.Duration) (int, error) {
	deadline := time.Now().Add(max)
	pause := 500 * time.Microsecond
	for {
		sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		st, err := c.Status(sctx)
		cancel()
		if err != nil {
			return -1, err
		}
		if st.Preempt == nil || st.Preempt.Stopping == 0 {
			return 0, nil
		}
		if time.Now().After(deadline) {
			return st.Preempt.Stopping, nil
		}
		time.Sleep(pause)
		pause = min(2*pause, 50*time.Millisecond)
	}
}

// DetachStep keeps every quiesced process quiesced after ptxmig's connections close: it runs
// after the driver lock and before the driver checkpoint, which leaves the processes stopped
// (package hold), so their shims could not answer after it; and CRIU must find no connection
// open. No undo: the quiesce step's undo resumes (through a new connection).
func (p *Preemption) DetachStep() op.Step {
	return op.Step{Name: StepDetach, Do: func(ctx context.Context) error {
		var errs []error
		for pid, c := range p.leases {
			dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			if err := c.Detach(dctx); err != nil {
				errs = append(errs, fmt.Errorf("detach pid %d: %w", pid, err))
			}
			cancel()
			c.Close()
			delete(p.leases, pid)
		}
		return errors.Join(errs...)
	}}
}

// ResumeStep resumes the processes this operation quiesced (after --leave-running, after a
// migrate); with restored set, every pid whose shim can be reached (a restored process was
// quiesced by the checkpoint that made its image). A process without the shim is skipped.
func (p *Preemption) ResumeStep(pids func() []int, restored bool) op.Step {
	return op.Step{Name: StepResume, Do: func(ctx context.Context) error { return p.resumeAll(ctx, pids(), !restored) }}
}

// resumeAll resumes through the open lease, or a new connection after a detach or a restore;
// onlyQuiesced skips the pids this operation did not quiesce.
func (p *Preemption) resumeAll(ctx context.Context, pids []int, onlyQuiesced bool) error {
	var errs []error
	for _, pid := range pids {
		r := p.report(pid)
		if onlyQuiesced && r.Quiesce == nil {
			continue
		}
		c, ok := p.leases[pid]
		if !ok {
			dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			var err error
			c, err = dial(dctx, pid)
			cancel()
			if err != nil {
				if !errors.Is(err, shimctl.ErrNoShim) {
					errs = append(errs, fmt.Errorf("resume pid %d: %w", pid, err))
				}
				continue
			}
		}
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		res, err := c.Resume(rctx)
		cancel()
		c.Close()
		delete(p.leases, pid)
		switch {
		case errors.Is(err, shimctl.ErrNoPreemption):
		case err != nil:
			errs = append(errs, fmt.Errorf("resume pid %d: %w", pid, err))
		default:
			r.Shim, r.Resume = true, res
			if p.note != nil {
				p.note("shim resume of pid %d (was %s, %d kernels relaunched)", pid, res.Was, res.Relaunched)
			}
			for _, e := range res.Errors {
				errs = append(errs, fmt.Errorf("resume pid %d: relaunch of %s failed: CUresult %d", pid, e.Kernel, e.Error))
			}
		}
	}
	return errors.Join(errs...)
}

// Close ends any lease still open (the shim then resumes, or disarms, by itself).
func (p *Preemption) Close() {
	for _, m := range []map[int]*shimctl.Client{p.leases, p.aligned} {
		for pid, c := range m {
			c.Close()
			delete(m, pid)
		}
	}
	for pid := range p.kept {
		p.dropTarget(pid)
	}
}

// LockHint names what may hold the driver lock after a quiesce: kernels without a twin, twins
// that did not stop within the budget, and shims that could not quiesce ("" when nothing was left
// running).
func (p *Preemption) LockHint() string {
	var parts []string
	for _, r := range p.Reports {
		if r.Quiesce == nil {
			if r.Shim && r.Note != "" {
				parts = append(parts, fmt.Sprintf("pid %d: %s", r.PID, r.Note))
			}
			continue
		}
		for _, n := range r.Quiesce.NotStopped {
			parts = append(parts, fmt.Sprintf("pid %d %s (%s)", r.PID, n.Kernel, n.Reason))
		}
		for _, n := range r.Quiesce.Originals {
			parts = append(parts, fmt.Sprintf("pid %d %s (%s)", r.PID, n.Kernel, n.Reason))
		}
	}
	if len(parts) == 0 {
		return ""
	}
	return "not preempted: " + strings.Join(parts, "; ")
}

// ExplainLock decorates a lock step's failure with LockHint.
func (p *Preemption) ExplainLock(s op.Step) op.Step {
	do := s.Do
	s.Do = func(ctx context.Context) error {
		err := do(ctx)
		if err != nil {
			if h := p.LockHint(); h != "" {
				return fmt.Errorf("%w; %s", err, h)
			}
		}
		return err
	}
	return s
}
