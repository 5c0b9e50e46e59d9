package op

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/proc"
)

// Every operation that touches a process runs as a Txn: before anything is frozen, locked or
// checkpointed, ptxmig writes the operation to a journal (internal/journal) and starts a
// guardian, a small process of its own session (outside ptxmig's process group, so a Ctrl-C or a
// kill of the group does not reach it) that waits for ptxmig to end. Each step is journaled as it
// begins and ends. If ptxmig dies before the operation ends, the guardian rolls back what the
// journal says was done — or finishes it, when it had committed — (RecoverJournal) and keeps a
// report with the failure logs. `ptxmig recover`, run by itself and at the start of every
// operation (Begin, NewEnv), does the same for journals whose guardian died too.

// GuardianArg is the first argument of a guardian process: `ptxmig GuardianArg JOURNAL`, with the
// watch pipe as fd 3 (EOF: ptxmig ended) and the ready pipe as fd 4.
const GuardianArg = "__ptxmig-guardian"

// guardianReadyTimeout bounds the guardian's start.
const guardianReadyTimeout = 10 * time.Second

var guardianExe string

// EnableGuardian declares that this program runs as a guardian when started with GuardianArg
// (cmd/ptxmig does so from init): NewEnv then gives every operation a guardian.
func EnableGuardian() { guardianExe = "/proc/self/exe" }

// TxnSpec describes an operation for its journal.
type TxnSpec struct {
	Op           string // journal.OpCheckpoint, OpRestore, OpMigrate
	Root         int
	Tree         []int // root first
	CUDA         []int
	LeaveRunning bool
	StagingRoot  string // where the operation's staging directory goes ("" for none)
	Store, Image string
	// Steps are the planned steps, in order: the journal records each one's name, kind and data
	// (the steps Txn.Execute runs must match them by name and kind).
	Steps []Step
	// Build, when set, makes Steps once the operation's id and staging directory are known
	// (t.Staging(); t.Helper may be called from the steps), before the journal is written: an
	// operation whose steps need their staging paths builds them once (Txn.Steps).
	Build func(t *Txn) []Step
}

// JournalSteps is what the journal records of steps.
func JournalSteps(steps []Step) ([]journal.Step, error) {
	out := make([]journal.Step, len(steps))
	for i, s := range steps {
		data, err := marshalData(s.Data)
		if err != nil {
			return nil, fmt.Errorf("step %s: %w", s.Name, err)
		}
		out[i] = journal.Step{Name: s.Name, Kind: s.Kind, Commit: s.Commit, Data: data}
	}
	return out, nil
}

// Txn is a journaled operation with its guardian.
type Txn struct {
	env     *Env
	steps   []journal.Step
	planned []Step
	w       *journal.Writer
	g       *guardianProc
	id      string
	staging string
	log     *slog.Logger
}

// Begin starts a journaled operation: it first recovers operations whose ptxmig died (see
// Recover), then writes the journal, starts the guardian (when e.GuardianExe is set) and creates
// the staging directory. Nothing has been touched yet: every failure is a refusal.
func (e *Env) Begin(ctx context.Context, spec TxnSpec) (*Txn, error) {
	log := e.Logger()
	e.RecoverInterrupted(ctx)
	self, err := proc.ReadStat(os.Getpid())
	if err != nil {
		return nil, Refusef("operation journal: %w", err)
	}
	boot, err := proc.BootID()
	if err != nil {
		return nil, Refusef("operation journal: %w", err)
	}
	id, err := journal.NewID(spec.Op, os.Getpid())
	if err != nil {
		return nil, Refusef("operation journal: %w", err)
	}
	h := journal.Header{V: journal.Version, Op: spec.Op, ID: id, Boot: boot, Time: time.Now().UTC(),
		Owner: journal.Proc{PID: self.PID, Start: self.StartTicks}, Session: self.SID, Root: spec.Root,
		CUDA: spec.CUDA, LeaveRunning: spec.LeaveRunning, Store: spec.Store, Image: spec.Image, CRIUStall: criu.Bound(e.CRIUStall)}
	for _, pid := range spec.Tree {
		p := journal.Proc{PID: pid}
		if s, err := proc.ReadStat(pid); err == nil && !s.Zombie() {
			p.Start = s.StartTicks
		}
		h.Tree = append(h.Tree, p)
	}
	if spec.StagingRoot != "" {
		root, err := filepath.Abs(spec.StagingRoot)
		if err != nil {
			return nil, Refusef("staging root %s: %w", spec.StagingRoot, err)
		}
		h.Staging = filepath.Join(root, id)
	}
	t := &Txn{env: e, id: id, staging: h.Staging, log: log, planned: spec.Steps}
	if spec.Build != nil {
		t.planned = spec.Build(t)
	}
	if h.Steps, err = JournalSteps(t.planned); err != nil {
		return nil, Refusef("operation journal: %w", err)
	}
	t.steps = h.Steps
	w, err := journal.Create(journal.Dir(), h)
	if err != nil {
		return nil, Refusef("operation journal: %w", err)
	}
	t.w = w
	if e.GuardianExe != "" {
		g, err := startGuardian(e.GuardianExe, w.Path())
		if err != nil {
			_ = w.End(journal.Failed, err.Error())
			return nil, Refusef("cannot start the operation's guardian: %w", err)
		}
		t.g = g
		if err := w.Append(journal.Record{T: journal.TGuardian, Proc: procOf(g.cmd.Process.Pid)}); err != nil {
			t.abort(err)
			return nil, Refusef("operation journal: %w", err)
		}
	}
	if t.staging != "" {
		if err := os.Mkdir(t.staging, 0o700); err != nil {
			t.abort(err)
			return nil, Refusef("staging directory in %s: %w", spec.StagingRoot, err)
		}
	}
	log.Debug("operation journaled", "journal", w.Path(), "guardian", t.g != nil)
	return t, nil
}

// abort ends a Txn that touched nothing.
func (t *Txn) abort(err error) {
	_ = t.w.End(journal.Failed, err.Error())
	t.g.release()
}

func procOf(pid int) *journal.Proc {
	p := &journal.Proc{PID: pid}
	if s, err := proc.ReadStat(pid); err == nil {
		p.Start = s.StartTicks
	}
	return p
}

// Steps are the operation's planned steps (TxnSpec.Steps, or those TxnSpec.Build made).
func (t *Txn) Steps() []Step { return t.planned }

// ID is the operation's journal id.
func (t *Txn) ID() string { return t.id }

// Staging is the operation's staging directory ("" when it has none).
func (t *Txn) Staging() string { return t.staging }

// Helper records a helper process (CRIU) that must not outlive the operation.
func (t *Txn) Helper(pid int) {
	if err := t.w.Append(journal.Record{T: journal.THelper, Proc: procOf(pid)}); err != nil {
		t.log.Warn("cannot journal a helper process", "pid", pid, "err", err)
	}
}

// Execute runs the steps as one transaction (see Execute), journaling each.
func (t *Txn) Execute(ctx context.Context, steps []Step, hook Hook, rollbackTimeout time.Duration) (Timings, error) {
	return execute(ctx, steps, hook, rollbackTimeout, t.log, t)
}

func (t *Txn) begin(s Step) error {
	if !slices.ContainsFunc(t.steps, func(p journal.Step) bool { return p.Name == s.Name && p.Kind == s.Kind }) {
		return fmt.Errorf("step %q (kind %q) is not in the operation's journal", s.Name, s.Kind)
	}
	if err := t.w.Append(journal.Record{T: journal.TStep, Step: s.Name, Phase: journal.PhaseBegin, At: int64(max(1, proc.SinceBoot()))}); err != nil {
		return fmt.Errorf("operation journal: %w", err)
	}
	return nil
}

func (t *Txn) end(step string, err error) {
	ph := journal.PhaseDone
	if err != nil {
		ph = journal.PhaseFailed
	}
	t.note(journal.Record{T: journal.TStep, Step: step, Phase: ph})
	if err == nil && step == os.Getenv(FaultStopAfter) {
		// Fault injection: stop here, so that a test can kill ptxmig at this exact point.
		t.log.Warn("stopping for fault injection", "after", step, "env", FaultStopAfter)
		_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
	}
}

// FaultStopAfter names an environment variable for fault-injection tests: when it names a
// step, ptxmig stops itself (SIGSTOP) right after that step completes and is journaled, so that
// a test can SIGKILL it at that exact point and watch the guardian.
const FaultStopAfter = "PTXMIG_FAULT_STOP_AFTER"

func (t *Txn) undo(step string) {
	t.note(journal.Record{T: journal.TStep, Step: step, Phase: journal.PhaseUndo})
}

func (t *Txn) undone(step string, err error) {
	ph := journal.PhaseUndone
	if err != nil {
		ph = journal.PhaseUndoFailed
	}
	t.note(journal.Record{T: journal.TStep, Step: step, Phase: ph})
}

func (t *Txn) commit() error { return t.w.Append(journal.Record{T: journal.TCommit}) }

func (t *Txn) note(r journal.Record) {
	if err := t.w.Append(r); err != nil {
		t.log.Warn("cannot write the operation journal", "err", err)
	}
}

// End closes the operation after Execute returned err: it removes the staging directory (unless
// keepStaging), records the outcome, removes the journal and lets the guardian go.
func (t *Txn) End(err error, keepStaging bool) {
	if t.staging != "" && !keepStaging {
		if rerr := os.RemoveAll(t.staging); rerr != nil {
			t.log.Warn("cannot remove staging directory", "dir", t.staging, "err", rerr)
		}
	}
	outcome, text := journal.Committed, ""
	var se *StepError
	switch {
	case err == nil:
	case errors.As(err, &se) && se.Committed:
		text = err.Error()
	case errors.As(err, &se) && se.RolledBack():
		outcome, text = journal.RolledBack, err.Error()
	case errors.As(err, &se) && !se.Touched, errors.Is(err, ErrRefused):
		outcome, text = journal.RolledBack, err.Error() // nothing was touched
	default:
		outcome, text = journal.Failed, err.Error()
	}
	if jerr := t.w.End(outcome, text); jerr != nil {
		t.log.Warn("cannot end the operation journal", "journal", t.w.Path(), "err", jerr)
	}
	t.g.release()
}

// guardianProc is a started guardian.
type guardianProc struct {
	cmd   *exec.Cmd
	watch *os.File // write end of the watch pipe: closing it (or dying) wakes the guardian
}

// startGuardian starts `exe GuardianArg journal` in a session of its own and waits until it has
// validated the journal and watches.
func startGuardian(exe, journalPath string) (*guardianProc, error) {
	watchR, watchW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	readyR, readyW, err := os.Pipe()
	if err != nil {
		watchR.Close()
		watchW.Close()
		return nil, err
	}
	defer readyR.Close()
	// In a cgroup of its own (proc.KeepCgroup): a kill of ptxmig's whole cgroup leaves it to roll
	// the operation back.
	cmd, _, err := proc.StartKept(func() *exec.Cmd {
		cmd := exec.Command(exe, GuardianArg, journalPath)
		cmd.Args[0] = "ptxmig"
		cmd.Dir = "/"
		cmd.ExtraFiles = []*os.File{watchR, readyW}
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		return cmd
	})
	watchR.Close()
	readyW.Close()
	if err != nil {
		watchW.Close()
		return nil, err
	}
	g := &guardianProc{cmd: cmd, watch: watchW}
	_ = readyR.SetReadDeadline(time.Now().Add(guardianReadyTimeout))
	b := make([]byte, 1)
	if n, rerr := readyR.Read(b); n != 1 || b[0] != 'R' {
		_ = cmd.Process.Kill()
		g.release()
		if rerr == nil {
			rerr = fmt.Errorf("unexpected answer %q", b[:n])
		}
		return nil, fmt.Errorf("guardian %s did not start: %w", exe, rerr)
	}
	return g, nil
}

// release lets the guardian go (it finds the journal removed and exits) and reaps it.
func (g *guardianProc) release() {
	if g == nil {
		return
	}
	g.watch.Close()
	go func() { _ = g.cmd.Wait() }()
}
