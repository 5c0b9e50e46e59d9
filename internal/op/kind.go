package op

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/proc"
)

// A step's kind says what the step does, in the terms a crash recovery needs: each step is
// journaled, before the operation begins, with its kind and the data its kind needs (Step.Kind,
// Step.Data), and the package that defines the step registers, under the kind's id, how to rebuild
// the step's undo (and its finish) from that record (RegisterKind). A recovery knows no
// operation: it reads the journal, rebuilds every planned step from its record, and runs the
// rebuilt undos of the steps that began, in reverse, or, once the operation had committed, the
// rebuilt finishes (see Recover). The undo a step runs in-process and the one a recovery
// rebuilds are built by the same function of the step's package.

// Kind is a registered step kind.
type Kind struct {
	ID string // recorded in the journal: "package.step", e.g. "driver.lock"
	// Helper is the command name (comm) of a helper process the step starts (CRIU): a recovery
	// ends such helpers, journaled or not, before it rebuilds anything (see endHelpers).
	Helper string
	// Rebuild makes the step's Recovery from its journaled data; r is the interrupted operation.
	Rebuild func(r *Rec, data json.RawMessage) (Recovery, error)
}

// Recovery is what a recovery can do about one step of an interrupted operation.
type Recovery struct {
	Undo   func(ctx context.Context) error // rolls back what the step did, or may have done (nil: nothing)
	Finish func(ctx context.Context) error // completes the step after the operation committed (nil: nothing)
	// Done, for a commit step that began but whose end was not journaled, reports whether its
	// result is in place all the same (the image's manifest was written): the operation had
	// committed then.
	Done func() bool
}

var kinds sync.Map // id → Kind

// RegisterKind registers a step kind (from an init function of the package that owns it). A
// kind registered twice panics: two packages claiming one id is a programming error.
func RegisterKind(k Kind) {
	if k.ID == "" || k.Rebuild == nil {
		panic("op: incomplete step kind " + k.ID)
	}
	if _, dup := kinds.LoadOrStore(k.ID, k); dup {
		panic("op: step kind registered twice: " + k.ID)
	}
}

func lookupKind(id string) (Kind, bool) {
	k, ok := kinds.Load(id)
	if !ok {
		return Kind{}, false
	}
	return k.(Kind), true
}

// MarshalData encodes a step's data for the journal.
func marshalData(v any) (json.RawMessage, error) {
	if v == nil {
		return nil, nil
	}
	if b, ok := v.(json.RawMessage); ok {
		return b, nil
	}
	return json.Marshal(v)
}

// Rec is what a step kind's Rebuild sees of the interrupted operation: its journal, the state of
// the step, what to report with, and the driver (opened on first use). Every process is acted
// on only while it is the one the journal recorded (Alive, Tree).
type Rec struct {
	Header *journal.Header
	// Step is the journaled state of the step being rebuilt (nil: it never began; only its
	// Finish can run then).
	Step *journal.StepState
	Log  *slog.Logger
	drv  *driverOpener
	rb   *journalRollback
}

// Note adds a line to the recovery's report (what was done, in order).
func (r *Rec) Note(format string, a ...any) { r.rb.note(format, a...) }

// Driver opens the NVIDIA driver (once per recovery).
func (r *Rec) Driver() (Driver, error) { return r.drv.get() }

// BeganAt is when the step began (CLOCK_BOOTTIME); 0 when it never began.
func (r *Rec) BeganAt() time.Duration {
	if r.Step == nil {
		return 0
	}
	return r.Step.At
}

// Alive returns those of pids that the journal recorded in the tree and that are still alive as
// the recorded process (same start time).
func (r *Rec) Alive(pids []int) []int {
	var out []int
	for _, pid := range pids {
		for _, p := range r.Header.Tree {
			if p.PID == pid && p.Start != 0 && proc.Same(pid, p.Start) && !slices.Contains(out, pid) {
				out = append(out, pid)
			}
		}
	}
	return out
}

// Tree is the recorded processes still alive as themselves, plus whatever their trees hold now
// (forked since the plan). Each recorded process's tree is walked, not only the root's, so that a
// process forked since the plan is found even when the root is gone.
func (r *Rec) Tree() []int {
	var recorded []int
	for _, p := range r.Header.Tree {
		if p.Start != 0 && proc.Same(p.PID, p.Start) {
			recorded = append(recorded, p.PID)
		}
	}
	out := slices.Clone(recorded)
	walked := map[int]bool{} // in the tree of a recorded process walked already: its own tree is in out
	for _, pid := range recorded {
		if walked[pid] {
			continue
		}
		if stats, err := proc.Tree(pid); err == nil {
			for _, s := range stats {
				walked[s.PID] = true
				if !slices.Contains(out, s.PID) {
					out = append(out, s.PID)
				}
			}
		}
	}
	return out
}

// rebuilt is one planned step of an interrupted operation, rebuilt from its journal record.
type rebuilt struct {
	plan  journal.Step
	kind  Kind
	state *journal.StepState // nil: never began
	rec   Recovery
}

// errUnknownKind marks a journal with a step of a kind this program does not know (a newer
// ptxmig's, or a program that does not import the operation's package): it is left as it is, for
// a ptxmig that knows the kind.
var errUnknownKind = errors.New("a step kind this ptxmig does not know")

// rebuild rebuilds every planned step of the journal. A step of a kind this ptxmig does not know
// (errUnknownKind) makes the whole journal unrecoverable here; data its kind cannot read makes it
// invalid (journal.ErrInvalid). Either way nothing has been touched.
func (rb *journalRollback) rebuild() ([]*rebuilt, error) {
	h := &rb.st.Header
	var out []*rebuilt
	for _, s := range h.Steps {
		x := &rebuilt{plan: s, state: rb.st.Step(s.Name)}
		if s.Kind == "" {
			out = append(out, x)
			continue
		}
		k, ok := lookupKind(s.Kind)
		if !ok {
			return nil, fmt.Errorf("%w: step %s is of kind %q", errUnknownKind, s.Name, s.Kind)
		}
		x.kind = k
		rec, err := k.Rebuild(&Rec{Header: h, Step: x.state, Log: rb.log, drv: rb.drv, rb: rb}, s.Data)
		if err != nil {
			return nil, fmt.Errorf("%w: step %s (%s): %v", journal.ErrInvalid, s.Name, s.Kind, err)
		}
		x.rec = rec
		out = append(out, x)
	}
	return out, nil
}

// committed reports whether the interrupted operation had committed: the commit was journaled, a
// commit step completed, a step after a commit step began, or a commit step that began finds its
// result in place (Recovery.Done).
func committed(st *journal.State, steps []*rebuilt) bool {
	if st.Committed {
		return true
	}
	for i, s := range steps {
		if !s.plan.Commit || s.state == nil {
			continue
		}
		if s.state.Done || slices.ContainsFunc(steps[i+1:], func(n *rebuilt) bool { return n.state != nil }) {
			return true
		}
		if s.rec.Done != nil && s.rec.Done() {
			return true
		}
	}
	return false
}

// undoSteps are the rebuilt undos of the steps that began (done, failed or cut short: every undo
// looks at the actual state and does only what is still needed), in the order they began, as
// Steps for the one rollback (rollback).
func undoSteps(st *journal.State, steps []*rebuilt) []Step {
	var out []Step
	for _, js := range st.Steps {
		for _, s := range steps {
			if s.plan.Name == js.Name {
				out = append(out, Step{Name: s.plan.Name, Undo: s.rec.Undo})
			}
		}
	}
	return out
}

// finishAll runs the rebuilt finishes of the operation's steps, in order.
func finishAll(ctx context.Context, steps []*rebuilt) error {
	var errs []error
	for _, s := range steps {
		if s.rec.Finish == nil {
			continue
		}
		if err := s.rec.Finish(ctx); err != nil {
			errs = append(errs, fmt.Errorf("finish %s: %w", s.plan.Name, err))
		}
	}
	return errors.Join(errs...)
}

// driverOpener caches the driver of a recovery.
type driverOpener struct {
	open func() (Driver, error)
	d    Driver
	err  error
	done bool
}

func (d *driverOpener) get() (Driver, error) {
	if !d.done {
		d.done = true
		if d.open != nil {
			d.d, d.err = d.open()
		} else if drv, err := cudackpt.Open(); err != nil {
			d.err = err
		} else {
			d.d = drv
		}
		if d.err == nil && d.d == nil {
			d.err = errors.New("no driver")
		}
	}
	return d.d, d.err
}

// PIDText lists pids for a report: "1, 2, 3".
func PIDText(pids []int) string { return pidText(pids) }
