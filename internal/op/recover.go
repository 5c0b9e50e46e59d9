package op

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/proc"
)

// Outcomes of a recovered operation (Recovered.Outcome).
const (
	RecoveredRolledBack = "rolled-back" // ptxmig died before the operation committed: what it did was undone
	RecoveredFinished   = "finished"    // it had committed: its last steps were completed
	RecoveredCleaned    = "cleaned"     // it had ended, or touched nothing: its files were removed
	RecoveredRunning    = "running"     // its ptxmig is alive: a live operation, left alone
	RecoveredBusy       = "recovering"  // its guardian is still at work
	RecoveredRefused    = "refused"     // the journal is invalid or unsafe: kept aside, nothing done
	RecoveredIncomplete = "incomplete"  // the rollback failed; the journal stays for another attempt
	RecoveredAbandoned  = "abandoned"   // the rollback failed too often; the journal was kept aside
)

// maxRecoverAttempts is how many failed rollbacks a journal gets before it is kept aside.
const maxRecoverAttempts = 3

// DefaultRecoverWait is how long recover waits for a guardian at work before going on.
const DefaultRecoverWait = 30 * time.Second

// Recovered reports one interrupted operation.
type Recovered struct {
	Journal string    `json:"journal"` // the journal id (OP-PID-RANDOM)
	Op      string    `json:"op,omitempty"`
	PID     int       `json:"pid,omitempty"` // the process (tree root) it operated on
	Started time.Time `json:"started,omitzero"`
	Outcome string    `json:"outcome"`
	Actions []string  `json:"actions,omitempty"` // what was done, in order
	Error   string    `json:"error,omitempty"`
	LogDir  string    `json:"log_dir,omitempty"` // the report, the journal and CRIU's log
}

// Report is what a recovery found and did.
type Report struct {
	Operations []Recovered `json:"operations"`
	// Staging lists leftover staging directories of operations that left no journal (killed
	// by a ptxmig without journals) that were removed.
	Staging []string `json:"staging_removed,omitempty"`
}

// RecoverOptions tune Recover.
type RecoverOptions struct {
	// Driver opens the NVIDIA driver when a rollback needs it; nil opens cudackpt.
	Driver func() (Driver, error)
	Log    *slog.Logger
	// Wait is how long to wait for a journal another process is recovering (its guardian);
	// 0 means DefaultRecoverWait.
	Wait time.Duration
}

func (o *RecoverOptions) logger() *slog.Logger {
	if o.Log == nil {
		return slog.Default()
	}
	return o.Log
}

// RecoverInterrupted runs Recover for an operation about to start, with e's driver; what it did
// is logged, and a failure never stops the new operation (its own preflight decides).
func (e *Env) RecoverInterrupted(ctx context.Context) *Report {
	o := RecoverOptions{Log: e.Logger()}
	if e.Driver != nil {
		o.Driver = func() (Driver, error) { return e.Driver, nil }
	} else if e.DriverErr != nil {
		o.Driver = func() (Driver, error) { return nil, e.DriverErr }
	}
	rep, err := Recover(ctx, o)
	if err != nil {
		e.Logger().Warn("cannot recover interrupted operations", "err", err)
		return rep
	}
	for _, r := range rep.Operations {
		switch r.Outcome {
		case RecoveredRunning:
		case RecoveredRolledBack, RecoveredFinished, RecoveredCleaned:
			e.Logger().Warn("recovered an interrupted operation", "journal", r.Journal, "outcome", r.Outcome,
				"actions", strings.Join(r.Actions, "; "), "logs", r.LogDir)
		default:
			e.Logger().Warn("interrupted operation not recovered", "journal", r.Journal, "outcome", r.Outcome, "err", r.Error)
		}
	}
	return rep
}

// Recover finds the operations whose ptxmig died before they ended and whose guardian did not
// (or could not) handle them, and rolls each back — or finishes it, when it had committed —
// from its journal (RecoverJournal). Live operations are left alone; for one a guardian is
// recovering it waits up to o.Wait. It also removes staging directories that ptxmig versions
// without journals left behind (older than an hour). It is cheap when there is nothing to do:
// one directory read per location.
func Recover(ctx context.Context, o RecoverOptions) (*Report, error) {
	if os.Geteuid() != 0 {
		return &Report{Operations: []Recovered{}}, Refusef("ptxmig recover must run as root: it resumes, unlocks and ends other processes (euid %d)", os.Geteuid())
	}
	rep := &Report{Operations: []Recovered{}}
	paths, err := journal.List(journal.Dir())
	if err != nil {
		return rep, fmt.Errorf("journal directory %s: %w", journal.Dir(), err)
	}
	drv := &driverOpener{open: o.Driver}
	for _, p := range paths {
		r := recoverPath(ctx, p, &o, drv, false)
		if r != nil {
			rep.Operations = append(rep.Operations, *r)
		}
	}
	rep.Staging = sweepLegacyStaging(time.Now(), time.Hour, o.logger())
	return rep, nil
}

// PendingInterrupted is the Outcome Pending gives an operation whose ptxmig died before it
// ended and that nothing is recovering: Recover would roll it back or finish it.
const PendingInterrupted = "interrupted"

// Pending lists the operations Recover would act on, touching nothing: it reads the journals
// without taking their locks (a lock, even a shared one for an instant, could fail a starting
// operation's own), and changes no journal, file or process. Each is a Recovered with no
// Actions and Outcome PendingInterrupted (its ptxmig is gone), RecoveredBusy (its ptxmig is
// gone and its guardian, still alive, is at work) or RecoveredRefused (the journal fails
// validation, in Error: Recover keeps it aside). Live operations are left out, and so are
// journals cut short while created (their operation touched nothing). It needs root, as
// Recover does: the journal directory is root's.
func Pending() ([]Recovered, error) {
	if os.Geteuid() != 0 {
		return nil, Refusef("the operation journals in %s are readable by root only (euid %d)", journal.Dir(), os.Geteuid())
	}
	paths, err := journal.List(journal.Dir())
	if err != nil {
		return nil, fmt.Errorf("journal directory %s: %w", journal.Dir(), err)
	}
	boot, _ := proc.BootID()
	alive := func(p journal.Proc, h journal.Header) bool {
		return boot != "" && boot == h.Boot && proc.Same(p.PID, p.Start)
	}
	out := []Recovered{}
	for _, p := range paths {
		r := Recovered{Journal: strings.TrimSuffix(filepath.Base(p), journal.Ext)}
		st, err := journal.Read(p)
		switch {
		case errors.Is(err, os.ErrNotExist), errors.Is(err, journal.ErrNoBegin):
			continue
		case err != nil:
			r.Outcome, r.Error = RecoveredRefused, err.Error()
		case alive(st.Header.Owner, st.Header):
			continue
		default:
			describe(&r, st)
			r.Outcome = PendingInterrupted
			if st.Guardian != nil && alive(*st.Guardian, st.Header) {
				r.Outcome = RecoveredBusy
			}
		}
		out = append(out, r)
	}
	return out, nil
}

// RecoverJournal recovers the one operation of the journal at path, as its guardian does once
// ptxmig is gone: it waits (up to o.Wait) for the journal's lock, then rolls back or finishes.
// It returns nil when the journal is gone (the operation ended).
func RecoverJournal(ctx context.Context, path string, o RecoverOptions) *Recovered {
	return recoverPath(ctx, path, &o, &driverOpener{open: o.Driver}, true)
}

func recoverPath(ctx context.Context, path string, o *RecoverOptions, drv *driverOpener, guardian bool) *Recovered {
	log := o.logger()
	id := strings.TrimSuffix(filepath.Base(path), journal.Ext)
	r := &Recovered{Journal: id}
	f, err := journal.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		refuse(r, path, nil, err, log)
		return r
	}
	defer f.Close()
	wait := o.Wait
	if wait <= 0 {
		wait = DefaultRecoverWait
	}
	ok, err := journal.TryLock(f)
	if err != nil {
		r.Outcome, r.Error = RecoveredIncomplete, err.Error()
		return r
	}
	if !ok {
		// Its owner is alive, or a guardian (or another recover) is at work on it.
		st, rerr := journal.ReadFrom(f)
		if rerr == nil {
			describe(r, st)
			if !guardian && proc.Same(st.Header.Owner.PID, st.Header.Owner.Start) {
				r.Outcome = RecoveredRunning
				return r
			}
		}
		if ok, err = journal.Lock(f, wait); err != nil || !ok {
			r.Outcome = RecoveredBusy
			if err != nil {
				r.Error = err.Error()
			}
			return r
		}
		if !journal.Same(f) {
			return nil // it ended, or was recovered, while we waited
		}
	}
	st, err := journal.ReadFrom(f)
	if errors.Is(err, journal.ErrNoBegin) {
		// ptxmig died while creating it: it wrote the journal before anything else.
		r.Outcome, r.Actions = RecoveredCleaned, []string{"ptxmig died while creating the journal: nothing was touched"}
		_ = journal.Remove(f)
		return r
	}
	if err != nil {
		refuse(r, path, f, err, log)
		return r
	}
	describe(r, st)
	h := st.Header
	if st.Outcome == "" && !guardian && proc.Same(h.Owner.PID, h.Owner.Start) {
		r.Outcome = RecoveredRunning // cannot happen while the owner holds the lock; never touch a live one
		return r
	}
	rb := &journalRollback{st: st, drv: drv, log: log}
	steps, err := rb.rebuild()
	if errors.Is(err, errUnknownKind) && st.Outcome == "" {
		// Left for a ptxmig that knows the kind: the journal stays as it is, no attempt counted.
		r.Outcome, r.Error = RecoveredIncomplete, fmt.Sprintf("%v: left for a ptxmig that knows it", err)
		log.Warn("cannot recover an interrupted operation; its journal stays", "journal", id, "err", err)
		return r
	}
	if err != nil && st.Outcome == "" {
		refuse(r, path, f, err, log)
		return r
	}
	switch {
	case st.Outcome != "":
		// (Nothing is rebuilt: an ended operation left its staging directory at most.)
		rb.note("the operation had ended (%s); removed what it left", st.Outcome)
		r.Outcome = RecoveredCleaned
	case len(st.Steps) == 0:
		rb.note("ptxmig died before the first step: no process was touched")
		r.Outcome = RecoveredCleaned
	default:
		r.Outcome = rb.run(ctx, steps)
	}
	if st.Outcome == "" {
		if dir, err := KeepLogs("recovered-"+h.Op, h.Root, append(stagingLogs(h.Staging), path)...); dir != "" {
			r.LogDir = dir
		} else if err != nil {
			log.Warn("cannot keep the recovery's logs", "err", err)
		}
	}
	rb.removeStaging()
	r.Actions = rb.actions
	if rb.err != nil {
		r.Error = rb.err.Error()
		if len(st.Attempts)+1 >= maxRecoverAttempts {
			r.Outcome = RecoveredAbandoned
			_ = journal.AppendTo(f, journal.Record{T: journal.TEnd, Outcome: journal.Recovered, Err: clip(r.Error)})
			_ = journal.Remove(f)
		} else {
			r.Outcome = RecoveredIncomplete
			_ = journal.AppendTo(f, journal.Record{T: journal.TAttempt, Err: clip(r.Error)})
		}
	} else if st.Outcome == "" {
		_ = journal.AppendTo(f, journal.Record{T: journal.TEnd, Outcome: journal.Recovered})
		_ = journal.Remove(f)
	} else {
		_ = journal.Remove(f)
	}
	writeReport(r, guardian)
	log.Info("recovered an interrupted operation", "journal", id, "outcome", r.Outcome, "actions", strings.Join(r.Actions, "; "), "err", r.Error)
	return r
}

func clip(s string) string {
	if len(s) > 4000 {
		return s[:4000]
	}
	return s
}

func describe(r *Recovered, st *journal.State) {
	r.Op, r.PID, r.Started = st.Header.Op, st.Header.Root, st.Header.Time
}

// refuse keeps an invalid or unsafe journal aside (a copy in the log directory, when it is a
// regular file) and removes it from the journal directory, touching no process.
func refuse(r *Recovered, path string, f *os.File, err error, log *slog.Logger) {
	r.Outcome, r.Error = RecoveredRefused, err.Error()
	if f != nil {
		if dir, kerr := KeepLogs("refused-journal", 0, path); dir != "" {
			r.LogDir = dir
		} else if kerr != nil {
			log.Warn("cannot keep a refused journal", "err", kerr)
		}
	}
	if rerr := os.Remove(path); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
		log.Warn("cannot remove a refused journal", "path", path, "err", rerr)
	}
	log.Warn("refused an invalid operation journal; no process was touched", "path", path, "err", err)
}

func writeReport(r *Recovered, guardian bool) {
	if r.LogDir == "" {
		return
	}
	who := "ptxmig recover"
	if guardian {
		who = "the operation's guardian"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "operation %s of pid %d (journal %s, started %s): ptxmig died before it ended.\n",
		r.Op, r.PID, r.Journal, r.Started.Format(time.RFC3339))
	fmt.Fprintf(&b, "recovered by %s at %s: %s\n", who, time.Now().UTC().Format(time.RFC3339), r.Outcome)
	for _, a := range r.Actions {
		fmt.Fprintf(&b, "  - %s\n", a)
	}
	if r.Error != "" {
		fmt.Fprintf(&b, "error: %s\n", r.Error)
	}
	_ = os.WriteFile(filepath.Join(r.LogDir, "report.txt"), []byte(b.String()), 0o600)
}

// journalRollback undoes (or finishes) one interrupted operation from its journal. Every action checks
// the process first: a pid is acted on only while it is the process the journal recorded (same
// start time), or, for a restore, a process started after the restore began.
type journalRollback struct {
	st      *journal.State
	drv     *driverOpener
	log     *slog.Logger
	actions []string
	err     error
}

func (rb *journalRollback) note(format string, a ...any) {
	rb.actions = append(rb.actions, fmt.Sprintf(format, a...))
}

func (rb *journalRollback) fail(err error) {
	if err != nil {
		rb.err = errors.Join(rb.err, err)
	}
}

// run rolls the operation back, or finishes it when it had committed, through the undos and
// finishes rebuilt from its journal (see Kind); it returns the outcome.
func (rb *journalRollback) run(ctx context.Context, steps []*rebuilt) string {
	h := rb.st.Header
	if boot, err := proc.BootID(); err != nil || boot != h.Boot {
		rb.note("journal of another boot: its processes are gone")
		return RecoveredCleaned
	}
	rb.endHelpers(steps)
	if committed(rb.st, steps) {
		rb.note("the %s had committed: finished it", h.Op)
		rb.fail(finishAll(ctx, steps))
		return RecoveredFinished
	}
	// The one rollback, as in-process (rollback); the journal is not written to: a recovery
	// that does not complete is retried from the same records.
	var se *StepError
	if errors.As(rollback(ctx, undoSteps(rb.st, steps), &StepError{}, 0, rb.log, nil), &se) {
		rb.fail(se.UndoErr)
	}
	return RecoveredRolledBack
}

// HelperWait is the longest a rollback waits for the operation's CRIU to finish by itself before
// killing it, even while it makes progress; one that makes none (criu.Activity) is killed once
// the operation's stall bound (journal.Header.CRIUStall) has passed.
var HelperWait = 10 * time.Minute

// endHelpers makes sure the operation's CRIU processes are gone before anything is resumed or
// killed. CRIU is left to finish: killed while its parasite code runs inside a process being
// dumped, it can kill that process; once done it finds ptxmig's end of its socket closed and
// exits (a dump leaves the tree stopped, which the rollback then resumes). Only a CRIU that made
// no progress for the operation's stall bound, or still runs after HelperWait, is killed, with
// its process group (the helpers it forked share it).
// A CRIU that ptxmig started but could not journal before it died is found by what it must be:
// a process named as its step's kind says (Kind.Helper), leader of its own process group, in
// ptxmig's session, started after the step that starts it began.
func (rb *journalRollback) endHelpers(steps []*rebuilt) {
	st := rb.st
	helpers := append([]journal.Proc(nil), st.Helpers...)
	for _, x := range steps {
		s := x.state
		if x.kind.Helper == "" || s == nil || slices.ContainsFunc(st.Helpers, func(h journal.Proc) bool {
			return time.Duration(h.Start)*(time.Second/proc.ClockTicks) >= s.At/(time.Second/proc.ClockTicks)*(time.Second/proc.ClockTicks)
		}) {
			continue // not begun, or its CRIU was journaled
		}
		for _, c := range proc.Group(0) {
			if c.Comm == x.kind.Helper && c.PGID == c.PID && c.SID == st.Header.Session && c.StartedSince(s.At) &&
				!slices.ContainsFunc(helpers, func(h journal.Proc) bool { return h.PID == c.PID }) {
				helpers = append(helpers, journal.Proc{PID: c.PID, Start: c.StartTicks})
			}
		}
	}
	alive := func() []int {
		var out []int
		for _, hp := range helpers {
			if proc.Same(hp.PID, hp.Start) {
				out = append(out, hp.PID)
			}
		}
		return out
	}
	activity := func(pids []int) uint64 {
		var n uint64
		for _, pid := range pids {
			n += criu.Activity(pid)
		}
		return n
	}
	t0 := time.Now()
	running := alive()
	var idle criu.Idle
	stalled := false
	for len(running) > 0 && time.Since(t0) < HelperWait {
		if bound := st.Header.CRIUStall; bound > 0 && idle.Observe(activity(running), time.Now()) >= bound {
			stalled = true
			break
		}
		time.Sleep(10 * time.Millisecond)
		running = alive()
	}
	if waited := time.Since(t0); waited > 50*time.Millisecond && len(running) == 0 {
		rb.note("waited %s for CRIU to finish", waited.Round(time.Millisecond))
	}
	for _, hp := range helpers {
		var pids []int
		for _, s := range proc.Group(hp.PID) {
			if s.StartTicks >= hp.Start && (s.PID != hp.PID || s.StartTicks == hp.Start) {
				pids = append(pids, s.PID)
			}
		}
		if len(pids) == 0 {
			continue
		}
		if err := proc.Kill(pids, 10*time.Second); err != nil {
			rb.fail(fmt.Errorf("CRIU (pid %d): %w", hp.PID, err))
			continue
		}
		switch {
		case slices.Contains(running, hp.PID) && stalled:
			rb.note("killed CRIU (pid %s): no progress for %s", pidText(pids), rb.st.Header.CRIUStall)
		case slices.Contains(running, hp.PID):
			rb.note("killed CRIU (pid %s) still running after %s", pidText(pids), HelperWait)
		default:
			rb.note("ended what CRIU (pid %d) left running (pid %s)", hp.PID, pidText(pids))
		}
	}
}

// removeStaging removes the operation's staging directory: a directory (not a symlink) named by
// the journal id, in a directory owned by this user.
func (rb *journalRollback) removeStaging() {
	dir := rb.st.Header.Staging
	if dir == "" {
		return
	}
	fi, err := os.Lstat(dir)
	if errors.Is(err, os.ErrNotExist) {
		return
	}
	if err != nil || !fi.IsDir() || !ownedDir(filepath.Dir(dir)) {
		rb.fail(fmt.Errorf("staging %s is not a directory of ptxmig's: left alone", dir))
		return
	}
	if err := os.RemoveAll(dir); err != nil {
		rb.fail(fmt.Errorf("remove staging %s: %w", dir, err))
		return
	}
	rb.note("removed staging %s", dir)
}

// ownedDir reports whether dir is a directory (not a symlink) of this user's, not writable by
// others.
func ownedDir(dir string) bool {
	fi, err := os.Lstat(dir)
	if err != nil || !fi.IsDir() {
		return false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && int(st.Uid) == os.Geteuid() && fi.Mode().Perm()&0o022 == 0
}

// stagingLogs are the log files (*.log) in an operation's staging directory and the directories
// right below it (CRIU's), kept with a recovery's report.
func stagingLogs(staging string) []string {
	if staging == "" {
		return nil
	}
	var out []string
	for _, pat := range []string{"*.log", "*/*.log"} {
		m, _ := filepath.Glob(filepath.Join(staging, pat))
		out = append(out, m...)
	}
	return out
}

func pidText(pids []int) string {
	s := make([]string, len(pids))
	for i, p := range pids {
		s[i] = fmt.Sprint(p)
	}
	return strings.Join(s, ", ")
}

// legacyStaging matches the staging directories of ptxmig versions without journals
// (os.MkdirTemp's "ckpt-PID-N" and "rst-IMAGE-N").
var legacyStaging = regexp.MustCompile(`^(ckpt-[0-9]+|rst-.+)-[0-9]+$`)

// sweepLegacyStaging removes legacy staging directories not modified for minAge.
func sweepLegacyStaging(now time.Time, minAge time.Duration, log *slog.Logger) []string {
	var removed []string
	for _, root := range StagingRoots() {
		if !ownedDir(root) {
			continue
		}
		ents, err := os.ReadDir(root)
		if err != nil {
			continue
		}
		for _, e := range ents {
			if !e.IsDir() || !legacyStaging.MatchString(e.Name()) {
				continue
			}
			info, err := e.Info()
			if err != nil || now.Sub(info.ModTime()) < minAge {
				continue
			}
			p := filepath.Join(root, e.Name())
			if err := os.RemoveAll(p); err != nil {
				log.Warn("cannot remove leftover staging", "dir", p, "err", err)
				continue
			}
			removed = append(removed, p)
		}
	}
	return removed
}
