package op

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
)

// Step is one action on a live process and the action that undoes it. Execute runs steps in
// order; when one fails, or the context is cancelled (SIGINT/SIGTERM), it runs the Undo of every
// completed step in reverse order, with a fresh context, so a process is never left locked,
// checkpointed or stopped. An Undo should look at the process's actual state and do only what is
// still needed: it may run after a step that partly happened.
//
// A step marked Commit makes the operation's result final once it completes (the image is
// stored, the restored tree runs): the steps after it run even if the context is cancelled,
// and their failure rolls nothing back (the error says the operation committed).
//
// Kind and Data are what the operation's journal records of the step (see Kind): a recovery
// rebuilds the step's undo, or its finish, from them when ptxmig dies. A step with an Undo, or
// one that must be finished after a commit, has a Kind; its package builds Undo with the same
// function its kind's Rebuild uses.
type Step struct {
	Name   string
	Kind   string // a registered Kind's id ("": nothing for a recovery to undo or finish)
	Data   any    // journaled with the step (JSON), for Kind.Rebuild
	Do     func(ctx context.Context) error
	Undo   func(ctx context.Context) error // nil: nothing to undo
	Commit bool
}

// Fixed returns a pid list known in advance, for the steps that take their pids when they run
// (a restore's pids are known once CRIU restored them).
func Fixed(pids []int) func() []int { return func() []int { return pids } }

// Timing is how long one step took.
type Timing struct {
	Step     string        `json:"step"`
	Duration time.Duration `json:"duration_ns"`
}

// Timings is the ordered list of completed steps.
type Timings []Timing

// Of returns the duration of the named step (0 when it did not run).
func (t Timings) Of(name string) time.Duration {
	for _, s := range t {
		if s.Step == name {
			return s.Duration
		}
	}
	return 0
}

// StepError is a failed transaction: which step failed, why, and how the rollback went.
type StepError struct {
	Step      string   // the step that failed ("" when cancelled between steps)
	Err       error    // its error, or the context's
	Undone    []string // steps rolled back, in the order they were undone
	UndoErr   error    // rollback failures (nil: the rollback completed)
	Touched   bool     // some step had completed, so the process was touched
	Cancelled bool     // the context was cancelled
	// Committed: the operation's result was final (a Commit step completed) before this step
	// failed; nothing was rolled back.
	Committed bool
}

func (e *StepError) Error() string {
	var b strings.Builder
	switch {
	case e.Cancelled && e.Step == "":
		b.WriteString("interrupted")
	case e.Cancelled:
		fmt.Fprintf(&b, "%s (interrupted by a signal)", e.Step)
	default:
		fmt.Fprintf(&b, "%s", e.Step)
	}
	fmt.Fprintf(&b, ": %v", e.Err)
	switch {
	case e.Committed:
		b.WriteString("; the operation had committed: nothing was rolled back")
	case e.UndoErr != nil:
		fmt.Fprintf(&b, "; ROLLBACK FAILED: %v", e.UndoErr)
	case len(e.Undone) > 0:
		fmt.Fprintf(&b, "; rolled back (%s)", strings.Join(e.Undone, ", "))
	}
	return b.String()
}

func (e *StepError) Unwrap() error { return e.Err }

// RolledBack reports whether the process was touched and the rollback completed (never after a
// commit: then nothing was rolled back).
func (e *StepError) RolledBack() bool { return e.Touched && e.UndoErr == nil && !e.Committed }

// StepUndid marks the error of a step that had begun to act on the process before it failed and
// undid its own part (a dump that CRIU began: the tree was frozen, then resumed); undoErr says how
// that went (nil: it completed). The transaction counts the process as touched and the step as
// undone, so that a complete rollback reads as one (exit status 4), and reports a failure of the
// step's own undo as a failed rollback. A step that fails before touching anything returns its
// error as it is.
func StepUndid(err, undoErr error) error { return &undidError{err: err, undo: undoErr} }

type undidError struct{ err, undo error }

func (e *undidError) Error() string { return e.err.Error() }
func (e *undidError) Unwrap() error { return e.err }

// Hook runs before each step's Do; an error it returns fails that step. Tests use it to inject
// failures; the GPU tests use it to change the world between steps.
type Hook func(ctx context.Context, step string) error

// Execute runs the steps as one transaction (see Step). RollbackTimeout bounds the whole
// rollback; 0 means 5 minutes.
func Execute(ctx context.Context, steps []Step, hook Hook, rollbackTimeout time.Duration, log *slog.Logger) (Timings, error) {
	return execute(ctx, steps, hook, rollbackTimeout, log, nil)
}

// observer is told of every step as it happens (the operation's journal, see Txn). An error
// from begin fails the step before its Do runs: an action the journal does not know of could
// not be rolled back by the guardian.
type observer interface {
	begin(step Step) error
	end(step string, err error)
	undo(step string)
	undone(step string, err error)
	commit() error
}

func execute(ctx context.Context, steps []Step, hook Hook, rollbackTimeout time.Duration, log *slog.Logger, obs observer) (Timings, error) {
	if log == nil {
		log = slog.Default()
	}
	var done []Step
	var timings Timings
	committed := false
	for _, s := range steps {
		sctx := ctx
		if committed {
			sctx = context.WithoutCancel(ctx) // the result is final: finish it
		} else if err := ctx.Err(); err != nil {
			return timings, rollback(ctx, done, &StepError{Err: err, Cancelled: true}, rollbackTimeout, log, obs)
		}
		t0 := time.Now()
		var err error
		if obs != nil {
			err = obs.begin(s)
		}
		if err == nil && hook != nil {
			err = hook(sctx, s.Name)
		}
		if err == nil {
			err = s.Do(sctx)
		}
		if obs != nil {
			obs.end(s.Name, err)
		}
		if err != nil {
			log.Warn("step failed", "step", s.Name, "err", err)
			if committed {
				return timings, &StepError{Step: s.Name, Err: err, Touched: true, Committed: true}
			}
			return timings, rollback(ctx, done, &StepError{Step: s.Name, Err: err, Cancelled: ctx.Err() != nil}, rollbackTimeout, log, obs)
		}
		d := time.Since(t0)
		log.Debug("step done", "step", s.Name, "duration", d)
		timings = append(timings, Timing{Step: s.Name, Duration: d})
		done = append(done, s)
		if s.Commit && !committed {
			committed = true
			if obs != nil {
				if err := obs.commit(); err != nil {
					log.Warn("cannot record the commit in the journal", "err", err)
				}
			}
		}
	}
	return timings, nil
}

func rollback(ctx context.Context, done []Step, e *StepError, timeout time.Duration, log *slog.Logger, obs observer) error {
	e.Touched = len(done) > 0
	var errs []error
	if ue := (*undidError)(nil); errors.As(e.Err, &ue) {
		e.Touched = true
		if ue.undo != nil {
			errs = append(errs, fmt.Errorf("undo %s: %w", e.Step, ue.undo))
		} else {
			e.Undone = append(e.Undone, e.Step)
		}
	}
	if timeout <= 0 {
		timeout = 5 * time.Minute
	}
	// The caller's context may be cancelled (that may be why we are here); the rollback must run.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer cancel()
	for i := len(done) - 1; i >= 0; i-- {
		s := done[i]
		if s.Undo == nil {
			continue
		}
		log.Info("rolling back", "step", s.Name)
		if obs != nil {
			obs.undo(s.Name)
		}
		err := s.Undo(rctx)
		if obs != nil {
			obs.undone(s.Name, err)
		}
		if err != nil {
			log.Error("rollback step failed", "step", s.Name, "err", err)
			errs = append(errs, fmt.Errorf("undo %s: %w", s.Name, err))
			continue
		}
		e.Undone = append(e.Undone, s.Name)
	}
	e.UndoErr = errors.Join(errs...)
	return e
}
