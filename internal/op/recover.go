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
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimctl"
	"github.com/ptxmig/ptxmig/store"
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
	}
	return d.d, d.err
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
	switch {
	case st.Outcome != "":
		rb.note("the operation had ended (%s); removed what it left", st.Outcome)
		r.Outcome = RecoveredCleaned
	case len(st.Steps) == 0:
		rb.note("ptxmig died before the first step: no process was touched")
		r.Outcome = RecoveredCleaned
	default:
		r.Outcome = rb.run(ctx)
	}
	logs := []string{}
	if h.Staging != "" {
		for _, n := range []string{"images/dump.log", "work/restore.log"} {
			logs = append(logs, filepath.Join(h.Staging, n))
		}
	}
	if st.Outcome == "" {
		if dir, err := KeepLogs("recovered-"+h.Op, h.Root, append(logs, path)...); dir != "" {
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

// run returns the outcome.
func (rb *journalRollback) run(ctx context.Context) string {
	h := rb.st.Header
	if boot, err := proc.BootID(); err != nil || boot != h.Boot {
		rb.note("journal of another boot: its processes are gone")
		return RecoveredCleaned
	}
	rb.endHelpers()
	switch h.Op {
	case journal.OpCheckpoint:
		return rb.checkpoint(ctx)
	case journal.OpRestore:
		return rb.restore()
	default:
		return rb.migrate(ctx)
	}
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
// a process named criu, leader of its own process group, in ptxmig's session, started after the
// step that starts it began.
func (rb *journalRollback) endHelpers() {
	st := rb.st
	helpers := append([]journal.Proc(nil), st.Helpers...)
	for _, name := range []string{stepDump, stepCRIURestore} {
		s := st.Step(name)
		if s == nil || slices.ContainsFunc(st.Helpers, func(h journal.Proc) bool {
			return time.Duration(h.Start)*(time.Second/proc.ClockTicks) >= s.At/(time.Second/proc.ClockTicks)*(time.Second/proc.ClockTicks)
		}) {
			continue // not begun, or its CRIU was journaled
		}
		for _, c := range proc.Group(0) {
			if c.Comm == "criu" && c.PGID == c.PID && c.SID == st.Header.Session && c.StartedSince(s.At) &&
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
			rb.note("killed CRIU (pid %s): no progress for %s", PIDList(pids), rb.st.Header.CRIUStall)
		case slices.Contains(running, hp.PID):
			rb.note("killed CRIU (pid %s) still running after %s", PIDList(pids), HelperWait)
		default:
			rb.note("ended what CRIU (pid %d) left running (pid %s)", hp.PID, PIDList(pids))
		}
	}
}

// tree is the recorded processes still alive as themselves, plus whatever their trees hold now
// (forked since the plan: CRIU froze those too). Each recorded process's tree is walked, not
// only the root's, so that a process forked since the plan is found even when the root is gone.
func (rb *journalRollback) tree() []int {
	h := rb.st.Header
	var recorded []int
	for _, p := range h.Tree {
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

// cudaPIDs are the recorded CUDA processes still alive as themselves.
func (rb *journalRollback) cudaPIDs() []int {
	h := rb.st.Header
	var out []int
	for _, pid := range h.CUDA {
		for _, p := range h.Tree {
			if p.PID == pid && p.Start != 0 && proc.Same(pid, p.Start) {
				out = append(out, pid)
			}
		}
	}
	return out
}

// Step names the rollback knows (checkpoint's, restore's and migrate's).
const (
	stepDump        = "dump"
	stepStore       = "store"
	stepFinish      = "finish"
	stepCRIURestore = "criu-restore"
	stepPlaceFiles  = "place-files"
)

func (rb *journalRollback) checkpoint(ctx context.Context) string {
	st, h := rb.st, rb.st.Header
	committed := st.Committed || st.Began(stepFinish)
	if !committed && st.Began(stepStore) && rb.imageStored() {
		committed = true
		rb.note("image %s was stored before ptxmig died", h.Image)
	}
	tree := rb.tree()
	if committed {
		if h.LeaveRunning {
			rb.note("the checkpoint had committed (image %s); the tree runs on", h.Image)
			return RecoveredFinished
		}
		if len(tree) > 0 {
			rb.fail(proc.Kill(tree, 10*time.Second))
			rb.note("the checkpoint had committed (image %s): ended the checkpointed tree as the checkpoint does (pid %s)", h.Image, PIDList(tree))
		} else {
			rb.note("the checkpoint had committed (image %s); the tree had already ended", h.Image)
		}
		return RecoveredFinished
	}
	if st.Began(stepDump) && len(tree) > 0 {
		rb.fail(proc.Continue(tree, 5*time.Second))
		rb.note("resumed the tree stopped by the dump (pid %s)", PIDList(tree))
	}
	cuda := rb.cudaPIDs()
	if st.Began(StepLock) {
		rb.driverBack(cuda)
	}
	if st.Began(StepQuiesce) {
		rb.shimResume(ctx, cuda)
	}
	if st.Began(stepStore) {
		rb.note("the image was not stored (`%s` removes what the store step left)", Command(st.Header.Store, "image", "gc"))
	}
	return RecoveredRolledBack
}

func (rb *journalRollback) restore() string {
	st, h := rb.st, rb.st.Header
	if st.Committed || st.AllDone() {
		rb.note("the restore had completed; the tree runs")
		return RecoveredFinished
	}
	if st.Began(stepPlaceFiles) {
		rb.note("carried files put in place before ptxmig died stay (the processes need them); a file they replaced " +
			"is next to it as NAME.ptxmig-replaced-TIME")
	}
	s := st.Step(stepCRIURestore)
	if s == nil {
		rb.note("no process had been restored")
		return RecoveredRolledBack
	}
	var victims []int
	for _, p := range h.Tree {
		if ps, err := proc.ReadStat(p.PID); err == nil && !ps.Zombie() && ps.StartedSince(s.At) {
			victims = append(victims, p.PID)
			if sub, err := proc.Tree(p.PID); err == nil {
				for _, c := range sub[1:] {
					if !slices.Contains(victims, c.PID) {
						victims = append(victims, c.PID)
					}
				}
			}
		}
	}
	if len(victims) == 0 {
		rb.note("no half-restored process was left")
		return RecoveredRolledBack
	}
	rb.fail(proc.Kill(victims, 10*time.Second))
	rb.note("killed the half-restored processes (pid %s); the image is intact", PIDList(victims))
	return RecoveredRolledBack
}

func (rb *journalRollback) migrate(ctx context.Context) string {
	st := rb.st
	if st.Committed || st.AllDone() {
		rb.note("the migration had completed")
		return RecoveredFinished
	}
	cuda := rb.cudaPIDs()
	if s := st.Step(StepDriverRestore); s != nil && len(st.Header.Pairs) > 0 {
		switch {
		case !s.UndoBegan:
			// Then driverBack finds every process on its source GPUs. (One case it gets wrong: a
			// ptxmig that died while the step, failing for one process, moved the others back
			// itself; a process already back is moved onto its targets again. It runs there.)
			rb.moveBack(cuda)
		case !s.Undone:
			// ptxmig died while its own rollback moved the processes back: which ones it had
			// moved, the driver's state does not say (a moved one is locked on its source GPUs,
			// as one still on its targets is), so none is moved twice.
			rb.note("ptxmig died while it moved the processes back onto their source GPUs: pid %s may run on their target GPUs",
				PIDList(cuda))
		}
	}
	if st.Began(StepLock) {
		rb.driverBack(cuda)
	}
	if st.Began(StepQuiesce) {
		rb.shimResume(ctx, cuda)
	}
	if len(st.Header.Pairs) > 0 {
		return RecoveredRolledBack
	}
	// Without its pairs (a journal of an older ptxmig), a process the driver restored onto its
	// targets stays there: unlocking it finished its move. The report says so rather than claim
	// it went back.
	if s := st.Step(StepDriverRestore); s != nil && s.Done {
		rb.note("the driver had restored every process onto its target GPUs: unlocked there, they run on the targets (the move was finished, not undone)")
		return RecoveredFinished
	} else if s != nil {
		rb.note("the driver restore onto the target GPUs had begun: a process it had restored runs on its target GPUs, the others on their source GPUs")
	}
	return RecoveredRolledBack
}

// moveBack returns the processes a migrate's driver restore had put on their targets to their
// source GPUs, with the journal's pairs inverted (see RestoreStep); they stay locked for
// driverBack.
func (rb *journalRollback) moveBack(pids []int) {
	var pairs []cudackpt.Pair
	for _, p := range rb.st.Header.Pairs {
		o, err1 := cudackpt.ParseUUID(p.Old)
		n, err2 := cudackpt.ParseUUID(p.New)
		if err := errors.Join(err1, err2); err != nil {
			rb.fail(fmt.Errorf("the journal's GPU pair %s -> %s: %w", p.Old, p.New, err))
			return
		}
		pairs = append(pairs, cudackpt.Pair{Old: o, New: n})
	}
	d, err := rb.drv.get()
	if err != nil || d == nil {
		rb.fail(fmt.Errorf("pid %s may run on its target GPUs, but the NVIDIA driver cannot be used: %v", PIDList(pids), err))
		return
	}
	var moved []int
	for _, pid := range pids {
		if st, err := d.State(pid); err == nil && st != cudackpt.Checkpointed {
			moved = append(moved, pid) // restored onto its targets (locked, or unlocked since)
		}
	}
	if len(moved) == 0 {
		return
	}
	if err := moveBack(d, moved, pairs); err != nil {
		rb.fail(err)
		return
	}
	rb.note("moved pid %s back onto its source GPUs (checkpoint, restore with the inverse pairs)", PIDList(moved))
}

// driverBack puts each CUDA process back to running: a checkpointed one is restored onto its own
// GPUs (no pairs), a locked one unlocked.
func (rb *journalRollback) driverBack(pids []int) {
	if len(pids) == 0 {
		return
	}
	d, err := rb.drv.get()
	if err != nil || d == nil {
		rb.fail(fmt.Errorf("pid %s may be locked or checkpointed, but the NVIDIA driver cannot be used: %v", PIDList(pids), err))
		return
	}
	for _, pid := range pids {
		s, err := d.State(pid)
		if errors.Is(err, cudackpt.ErrNotCUDA) {
			continue
		}
		if err != nil {
			rb.fail(fmt.Errorf("driver state of pid %d: %w", pid, err))
			continue
		}
		if s == cudackpt.Checkpointed {
			if err := d.Restore(pid, nil); err != nil {
				rb.fail(fmt.Errorf("driver restore of pid %d onto its own GPUs: %w", pid, err))
				continue
			}
			rb.note("driver restore of pid %d onto its own GPUs", pid)
			if s, err = d.State(pid); err != nil {
				rb.fail(fmt.Errorf("driver state of pid %d: %w", pid, err))
				continue
			}
		}
		if s == cudackpt.Locked {
			if err := d.Unlock(pid); err != nil {
				rb.fail(fmt.Errorf("driver unlock of pid %d: %w", pid, err))
				continue
			}
			rb.note("driver unlock of pid %d", pid)
		}
	}
}

// shimResume resumes the processes under the shim (a quiesce that ptxmig detached stays until
// resumed; an attached one ended when ptxmig's connection closed).
func (rb *journalRollback) shimResume(ctx context.Context, pids []int) {
	for _, pid := range pids {
		dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		c, err := dial(dctx, pid)
		cancel()
		if errors.Is(err, shimctl.ErrNoShim) {
			continue
		}
		if err != nil {
			rb.fail(fmt.Errorf("shim of pid %d: %w", pid, err))
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		res, err := c.Resume(rctx)
		cancel()
		c.Close()
		switch {
		case errors.Is(err, shimctl.ErrNoPreemption):
		case err != nil:
			rb.fail(fmt.Errorf("shim resume of pid %d: %w", pid, err))
		default:
			rb.note("shim resume of pid %d (was %s, %d kernels relaunched)", pid, res.Was, res.Relaunched)
			for _, e := range res.Errors {
				rb.fail(fmt.Errorf("shim resume of pid %d: relaunch of %s failed: CUresult %d", pid, e.Kernel, e.Error))
			}
		}
	}
}

// imageStored reports whether the checkpoint's image is in the store (its manifest is written
// last: a stored image is complete).
func (rb *journalRollback) imageStored() bool {
	h := rb.st.Header
	if h.Store == "" || h.Image == "" {
		return false
	}
	if fi, err := os.Lstat(h.Store); err != nil || !fi.IsDir() {
		return false
	}
	st, err := store.Open(h.Store)
	if err != nil {
		rb.log.Warn("cannot open the store to see whether the image was stored", "store", h.Store, "err", err)
		return false
	}
	m, err := st.Get(h.Image)
	return err == nil && m.Name == h.Image && imagedesc.RootPID(m) == h.Root && !m.Created.Before(h.Time.Add(-time.Second))
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
