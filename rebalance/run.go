package rebalance

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// Migrator moves a live process from one GPU to another. The real one is restore.Migrate, which
// rolls the process back onto its source GPU when the move fails.
type Migrator interface {
	Migrate(ctx context.Context, m Move, lockTimeout time.Duration) error
}

// Errors a run can end with (wrapped with context).
var (
	// ErrMoveFailed: the migrator reported a failure; the process stays on its source GPU.
	ErrMoveFailed = errors.New("migration failed")
	// ErrVerify: the migrator reported success but the process is not alive on the target GPU.
	ErrVerify = errors.New("migration not verified")
)

// MoveResult is the outcome of one executed move.
type MoveResult struct {
	Move     Move     `json:"move"`
	OK       bool     `json:"ok"`
	Seconds  float64  `json:"seconds"`
	Error    string   `json:"error,omitempty"`
	Location Location `json:"location"` // where the process was found afterwards
}

// Report is everything one run did and saw.
type Report struct {
	Start       time.Time          `json:"start"`
	DryRun      bool               `json:"dry_run"`
	Policy      Policy             `json:"policy"`
	Observation Observation        `json:"observation"`
	Plan        Plan               `json:"plan"`
	Results     []MoveResult       `json:"results"`
	Moved       int                `json:"moved"`
	Failed      int                `json:"failed"`
	Durations   map[string]float64 `json:"durations_seconds"` // observe, plan, migrate, total
	Warnings    []string           `json:"warnings,omitempty"`
	Error       string             `json:"error,omitempty"`
	Totals      Totals             `json:"totals"`
}

// Runner is one rebalance pass.
type Runner struct {
	Dir      string // state directory: state.json and the lock live here
	Policy   Policy
	DryRun   bool
	Observer Observer
	Migrator Migrator // may be nil for a dry run
	Clock    Clock
	Log      *slog.Logger
	// VerifyTimeout bounds the wait for NVML to list the moved process on its target (default
	// 10 s, polled every VerifyInterval, default 250 ms).
	VerifyTimeout  time.Duration
	VerifyInterval time.Duration
}

// Run takes the global lock, observes, plans and (unless DryRun) executes the plan one move at a
// time, stopping at the first failure. A run that finds the lock held returns an error wrapping
// ErrBusy and no report. Otherwise the report is returned even with an error, for output and
// metrics.
func (r *Runner) Run(ctx context.Context) (*Report, error) {
	if err := r.Policy.Validate(); err != nil {
		return nil, err
	}
	if !r.DryRun && r.Migrator == nil {
		return nil, errors.New("rebalance: no migrator: live migration is not available")
	}
	log := r.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := EnsureDir(r.Dir); err != nil {
		return nil, err
	}
	lock, err := TryLock(r.Dir)
	if err != nil {
		return nil, err
	}
	defer lock.Unlock()

	t0 := r.Clock.Now()
	rep := &Report{Start: t0, DryRun: r.DryRun, Policy: r.Policy, Durations: map[string]float64{}}
	st, warn, err := LoadState(r.Dir, t0, !r.DryRun, log)
	if err != nil {
		return nil, err
	}
	if warn != "" {
		rep.Warnings = append(rep.Warnings, warn)
	}
	finish := func(err error) (*Report, error) {
		rep.Durations["total"] = r.Clock.Now().Sub(t0).Seconds()
		if err != nil {
			rep.Error = err.Error()
		}
		if !r.DryRun {
			st.Totals.Runs++
			st.Totals.LastRun = t0
			if err == nil {
				st.Totals.LastSuccess = t0
			}
			st.Prune(r.Clock.Now(), max(time.Duration(r.Policy.ReturnWindow), time.Duration(r.Policy.Cooldown)))
			if serr := SaveState(r.Dir, st); serr != nil {
				err = errors.Join(err, serr)
				rep.Error = err.Error()
			}
		}
		rep.Totals = st.Totals
		return rep, err
	}

	obs, err := r.Observer.Observe(ctx, time.Duration(r.Policy.Window))
	rep.Durations["observe"] = r.Clock.Now().Sub(t0).Seconds()
	if err != nil {
		return finish(fmt.Errorf("observe GPUs: %w", err))
	}
	rep.Observation = obs

	tp := r.Clock.Now()
	rep.Plan = MakePlan(obs, r.Policy, st.History, tp)
	rep.Durations["plan"] = r.Clock.Now().Sub(tp).Seconds()
	for _, m := range rep.Plan.Moves {
		log.Info("planned move", "pid", m.PID, "from", m.From.Index, "to", m.To.Index, "score", m.Score)
	}
	if r.DryRun || len(rep.Plan.Moves) == 0 {
		return finish(nil)
	}

	tm := r.Clock.Now()
	for _, m := range rep.Plan.Moves {
		if err := ctx.Err(); err != nil {
			return finish(fmt.Errorf("rebalance interrupted before moving pid %d: %w", m.PID, err))
		}
		res, err := r.execute(ctx, m)
		rep.Results = append(rep.Results, res)
		rec := MoveRecord{PID: m.PID, StartTicks: m.StartTicks, Comm: m.Comm, From: m.From.UUID, To: m.To.UUID,
			FromIndex: m.From.Index, ToIndex: m.To.Index, At: r.Clock.Now(), OK: res.OK, Error: res.Error, Seconds: res.Seconds}
		st.History = append(st.History, rec)
		if res.OK {
			rep.Moved++
			st.Totals.Moves++
		} else {
			rep.Failed++
			st.Totals.Failures++
		}
		// Remember each move at once: a crash after it must not lose its cooldown.
		if serr := SaveState(r.Dir, st); serr != nil {
			log.Error("saving rebalance state", "err", serr)
			rep.Warnings = append(rep.Warnings, serr.Error())
		}
		if err != nil {
			rep.Durations["migrate"] = r.Clock.Now().Sub(tm).Seconds()
			return finish(err)
		}
	}
	rep.Durations["migrate"] = r.Clock.Now().Sub(tm).Seconds()
	return finish(nil)
}

// execute runs one move and checks that the process is alive on the target GPU only.
func (r *Runner) execute(ctx context.Context, m Move) (MoveResult, error) {
	res := MoveResult{Move: m}
	t := r.Clock.Now()
	err := r.Migrator.Migrate(ctx, m, time.Duration(r.Policy.LockTimeout))
	res.Seconds = r.Clock.Now().Sub(t).Seconds()
	if err != nil {
		err = fmt.Errorf("move pid %d from GPU %d to GPU %d: %w: %w", m.PID, m.From.Index, m.To.Index, ErrMoveFailed, err)
		res.Error = err.Error()
		res.Location, _ = r.Observer.Locate(ctx, m.PID)
		return res, err
	}
	loc, err := r.verify(ctx, m)
	res.Location = loc
	if err != nil {
		res.Error = err.Error()
		return res, err
	}
	res.OK = true
	return res, nil
}

// verify polls until NVML lists m.PID on the target GPU and not on the source.
func (r *Runner) verify(ctx context.Context, m Move) (Location, error) {
	timeout, every := r.VerifyTimeout, r.VerifyInterval
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	if every <= 0 {
		every = 250 * time.Millisecond
	}
	deadline := r.Clock.Now().Add(timeout)
	for {
		loc, err := r.Observer.Locate(ctx, m.PID)
		switch {
		case err != nil:
			return loc, fmt.Errorf("verify pid %d: %w: %w", m.PID, ErrVerify, err)
		case !loc.Alive:
			return loc, fmt.Errorf("verify pid %d: %w: the process is gone after migrating", m.PID, ErrVerify)
		case len(loc.GPUs) == 1 && loc.GPUs[0] == m.To.UUID:
			return loc, nil
		}
		if !r.Clock.Now().Before(deadline) {
			return loc, fmt.Errorf("verify pid %d: %w: NVML lists it on %v, want only GPU %d (%s)", m.PID, ErrVerify, loc.GPUs, m.To.Index, m.To.UUID)
		}
		if err := r.Clock.Sleep(ctx, every); err != nil {
			return loc, fmt.Errorf("verify pid %d: %w", m.PID, err)
		}
	}
}
