package op

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/cudackpt/cudackpttest"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimctl/shimctltest"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

// The guardian's rollback (RecoverJournal, Recover), driven in-process against the fake driver,
// a fake shim socket and real processes. A real GPU run adds what only the driver can show: the
// guardian's restore and unlock after a SIGKILL right after the lock or the checkpoint
// (checkpoint/gputest TestGuardian*).

const gpu0 = "GPU-00000000-0000-0000-0000-000000000000"

type recoverRig struct {
	env  *Env
	drv  *cudackpttest.Driver
	opts RecoverOptions
	logs string
}

func newRecoverRig(t *testing.T, pids ...int) *recoverRig {
	t.Helper()
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "recovery acts on other processes and needs root")
	}
	dir := t.TempDir()
	t.Setenv("PTXMIG_JOURNAL_DIR", filepath.Join(dir, "journal"))
	t.Setenv("PTXMIG_LOG_DIR", filepath.Join(dir, "logs"))
	t.Setenv("PTXMIG_STAGING_DIR", filepath.Join(dir, "staging"))
	if err := os.MkdirAll(filepath.Join(dir, "staging"), 0o700); err != nil {
		t.Fatal(err)
	}
	drv := cudackpttest.New(gpu0, nil, pids...)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	r := &recoverRig{drv: drv, logs: filepath.Join(dir, "logs"),
		env:  &Env{Driver: drv, Euid: 0, Log: log},
		opts: RecoverOptions{Driver: func() (Driver, error) { return drv, nil }, Log: log, Wait: time.Second}}
	return r
}

// sleeper starts a process in a session of its own.
func sleeper(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		testreq.Skip(t, "sleep", "cannot start sleep: %v", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-done })
	return cmd.Process.Pid
}

// die abandons a Txn as if ptxmig had been killed: the journal stays, unlocked, unended.
func (tx *Txn) die() { tx.w.Abandon() }

// begin journals an operation and runs the steps given (the first of the planned ones).
func (r *recoverRig) begin(t *testing.T, spec TxnSpec, run []Step) *Txn {
	t.Helper()
	tx, err := r.env.Begin(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Execute(context.Background(), run, nil, 0); err != nil {
		t.Fatal(err)
	}
	return tx
}

func (r *recoverRig) recoverOne(t *testing.T, tx *Txn) *Recovered {
	t.Helper()
	path := tx.w.Path()
	rep := RecoverJournal(context.Background(), path, r.opts)
	if rep == nil {
		t.Fatal("RecoverJournal found nothing")
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) && rep.Outcome != RecoveredIncomplete {
		t.Errorf("journal still there after %s: %v", rep.Outcome, err)
	}
	return rep
}

func stopped(pid int) bool {
	s, err := proc.ReadStat(pid)
	return err == nil && s.Stopped()
}

// TestGuardianRollsBackCheckpoint: ptxmig dies after the driver lock and checkpoint and while
// CRIU dumps (the tree is stopped): the guardian resumes the tree, restores the GPU state onto
// its own GPUs and unlocks, and removes the staging directory; the report says so.
func TestGuardianRollsBackCheckpoint(t *testing.T) {
	pid := sleeper(t)
	r := newRecoverRig(t, pid)
	steps := []string{StepQuiesce, StepLock, StepCheckpoint, StepDetach, "dump", "store", "finish"}
	tx := r.begin(t, TxnSpec{Op: journal.OpCheckpoint, Root: pid, Tree: []int{pid}, CUDA: []int{pid}, StagingRoot: os.Getenv("PTXMIG_STAGING_DIR"), Steps: steps},
		[]Step{LockStep(r.drv, []int{pid}, time.Second), CheckpointStep(r.drv, []int{pid})})
	// The dump began and stopped the tree; then ptxmig died.
	if err := tx.begin("dump"); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	for !stopped(pid) {
		time.Sleep(time.Millisecond)
	}
	if err := os.WriteFile(filepath.Join(tx.Staging(), "pages-1.img"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	tx.die()

	rep := r.recoverOne(t, tx)
	if rep.Outcome != RecoveredRolledBack || rep.Error != "" {
		t.Fatalf("recovery %+v", rep)
	}
	if stopped(pid) {
		t.Error("the tree is still stopped")
	}
	if st := r.drv.Get(pid).State; st != cudackpt.Running {
		t.Errorf("driver state %v, want running", st)
	}
	if want := []string{"lock", "checkpoint", "restore", "unlock"}; !slices.Equal(r.drv.Calls[len(r.drv.Calls)-4:], want) {
		t.Errorf("driver calls %v, want ... %v (restore without pairs, then unlock)", r.drv.Calls, want)
	}
	if _, err := os.Stat(tx.Staging()); !os.IsNotExist(err) {
		t.Errorf("staging left: %v", err)
	}
	report, err := os.ReadFile(filepath.Join(rep.LogDir, "report.txt"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"rolled-back", "resumed the tree", "driver restore of pid", "driver unlock of pid", "removed staging"} {
		if !strings.Contains(string(report), want) {
			t.Errorf("report lacks %q:\n%s", want, report)
		}
	}
	if _, err := os.Stat(filepath.Join(rep.LogDir, tx.ID()+journal.Ext)); err != nil {
		t.Errorf("the journal is not kept with the report: %v", err)
	}
}

// TestGuardianResumesShim: a process under the shim was quiesced and detached (its quiesce
// survives ptxmig's connection); ptxmig died after the driver checkpoint. The guardian restores,
// unlocks and resumes it through the control socket.
func TestGuardianResumesShim(t *testing.T) {
	pid := os.Getpid() // the fake shim serves this process's socket
	r := newRecoverRig(t, pid)
	sock := t.TempDir()
	t.Setenv("PTXMIG_SOCKET_DIR", sock)
	shimctltest.Serve(t, filepath.Join(sock, fmt.Sprintf("%d.sock", pid)), map[string]string{
		"status": reply("status", fmt.Sprintf(`{"pid":%d,"proto":2}`, pid), 2),
		"resume": reply("resume", `{"state":"running","was":"detached","relaunched":3,"elapsed_us":90}`, 2),
	})
	steps := []string{StepQuiesce, StepLock, StepCheckpoint, StepDetach, "dump", "store", "finish"}
	tx := r.begin(t, TxnSpec{Op: journal.OpCheckpoint, Root: pid, Tree: []int{pid}, CUDA: []int{pid}, Steps: steps},
		[]Step{{Name: StepQuiesce, Do: func(context.Context) error { return nil }}, LockStep(r.drv, []int{pid}, time.Second), CheckpointStep(r.drv, []int{pid}),
			{Name: StepDetach, Do: func(context.Context) error { return nil }}})
	tx.die()
	rep := r.recoverOne(t, tx)
	if rep.Outcome != RecoveredRolledBack || rep.Error != "" {
		t.Fatalf("recovery %+v", rep)
	}
	if st := r.drv.Get(pid).State; st != cudackpt.Running {
		t.Errorf("driver state %v, want running", st)
	}
	if !slices.ContainsFunc(rep.Actions, func(a string) bool {
		return strings.Contains(a, "shim resume of pid") && strings.Contains(a, "3 kernels relaunched")
	}) {
		t.Errorf("actions %q lack the shim's resume", rep.Actions)
	}
}

// TestGuardianMigrate: ptxmig dies during the driver restore onto the target (the process is
// still checkpointed): the guardian restores it onto its source GPUs and unlocks. Killed after
// the driver restore and the unlock, it is left running where it is, and the report says the
// move was finished, not undone.
func TestGuardianMigrate(t *testing.T) {
	pid := sleeper(t)
	r := newRecoverRig(t, pid)
	steps := []string{StepQuiesce, StepLock, StepCheckpoint, StepDriverRestore, StepUnlock, StepResume}
	spec := TxnSpec{Op: journal.OpMigrate, Root: pid, Tree: []int{pid}, CUDA: []int{pid}, Steps: steps}
	tx := r.begin(t, spec, []Step{LockStep(r.drv, []int{pid}, time.Second), CheckpointStep(r.drv, []int{pid})})
	if err := tx.begin(StepDriverRestore); err != nil {
		t.Fatal(err)
	}
	tx.die()
	if rep := r.recoverOne(t, tx); rep.Outcome != RecoveredRolledBack || rep.Error != "" {
		t.Fatalf("recovery %+v", rep)
	}
	if p := r.drv.Get(pid); p.State != cudackpt.Running || p.GPU != gpu0 {
		t.Errorf("after recovery: %+v, want running on %s", p, gpu0)
	}
	calls := len(r.drv.Calls)
	tx = r.begin(t, spec, []Step{LockStep(r.drv, []int{pid}, time.Second), CheckpointStep(r.drv, []int{pid}),
		RestoreStep(r.drv, Fixed([]int{pid}), nil, nil, false), UnlockStep(r.drv, Fixed([]int{pid}))})
	tx.die()
	if rep := r.recoverOne(t, tx); rep.Outcome != RecoveredFinished || rep.Error != "" ||
		!slices.ContainsFunc(rep.Actions, func(a string) bool { return strings.Contains(a, "they run on the targets") }) {
		t.Fatalf("recovery %+v, want finished: the processes run on their targets", rep)
	}
	if got := r.drv.Calls[calls:]; !slices.Equal(got, []string{"lock", "checkpoint", "restore", "unlock"}) {
		t.Errorf("a recovery after the unlock called the driver: %v", got)
	}
}

// TestGuardianFinishesCommittedCheckpoint: killed after the store step committed, the checkpoint
// is finished (the tree ends, as the checkpoint does), not rolled back.
func TestGuardianFinishesCommittedCheckpoint(t *testing.T) {
	pid := sleeper(t)
	r := newRecoverRig(t)
	ok := func(context.Context) error { return nil }
	tx := r.begin(t, TxnSpec{Op: journal.OpCheckpoint, Root: pid, Tree: []int{pid}, Steps: []string{"dump", "store", "finish"}},
		[]Step{{Name: "dump", Do: ok}, {Name: "store", Do: ok, Commit: true}})
	tx.die()
	rep := r.recoverOne(t, tx)
	if rep.Outcome != RecoveredFinished {
		t.Fatalf("recovery %+v", rep)
	}
	if proc.Alive(pid) {
		t.Error("the checkpointed process still runs")
	}
}

// TestGuardianFinishesHalfEndedTree: killed while it ended the tree, after the root but before a
// recorded child, the checkpoint leaves that child stopped under no recorded root, with a process
// forked since the plan below it. The recovery ends both: it walks the tree of every recorded
// process still alive, not only the root's.
func TestGuardianFinishesHalfEndedTree(t *testing.T) {
	cmd := exec.Command("sh", "-c", `sh -c "sleep 60 & wait" & wait`)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	root := cmd.Process.Pid
	tree, err := testproc.WaitTree(root, 3, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	pids := proc.PIDs(tree)
	t.Cleanup(func() { _ = proc.Kill(pids, 5*time.Second) })
	child, grandchild := pids[1], pids[2]
	r := newRecoverRig(t)
	ok := func(context.Context) error { return nil }
	// The plan saw the root and its child; the grandchild is "forked since".
	tx := r.begin(t, TxnSpec{Op: journal.OpCheckpoint, Root: root, Tree: []int{root, child}, Steps: []string{"dump", "store", "finish"}},
		[]Step{{Name: "dump", Do: ok}, {Name: "store", Do: ok, Commit: true}})
	for _, pid := range pids[1:] {
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
	}
	if err := syscall.Kill(root, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-done
	tx.die()
	rep := r.recoverOne(t, tx)
	if rep.Outcome != RecoveredFinished || rep.Error != "" {
		t.Fatalf("recovery %+v", rep)
	}
	for _, pid := range []int{child, grandchild} {
		if proc.Alive(pid) {
			t.Errorf("pid %d (%s) survived the recovery: %+v", pid, proc.Comm(pid), rep)
		}
	}
}

// TestRecoverTouchesOnlyItsOwnProcesses: the rollback acts on a pid only while it is the process
// the journal recorded (same start time) or, for a restore, one started after the restore began:
// a reused pid is left alone.
func TestRecoverTouchesOnlyItsOwnProcesses(t *testing.T) {
	pid := sleeper(t)
	r := newRecoverRig(t)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer syscall.Kill(pid, syscall.SIGCONT)
	for !stopped(pid) {
		time.Sleep(time.Millisecond)
	}
	s, _ := proc.ReadStat(pid)
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	boot, _ := proc.BootID()
	write := func(op string, tree []journal.Proc, recs ...journal.Record) string {
		id, _ := journal.NewID(op, dead.Process.Pid)
		h := journal.Header{V: journal.Version, Op: op, ID: id, Boot: boot, Time: time.Now(), Owner: journal.Proc{PID: dead.Process.Pid, Start: 1},
			Session: 1, Root: tree[0].PID, Tree: tree, Steps: []string{"dump", "store", "finish", "criu-restore"}}
		w, err := journal.Create(journal.Dir(), h)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Append(recs...); err != nil {
			t.Fatal(err)
		}
		w.Abandon()
		return w.Path()
	}
	at := func(step string, d time.Duration) journal.Record {
		return journal.Record{T: journal.TStep, Step: step, Phase: journal.PhaseBegin, At: int64(d)}
	}
	commit := journal.Record{T: journal.TCommit}
	write(journal.OpCheckpoint, []journal.Proc{{PID: pid, Start: s.StartTicks + 1}}, at("dump", 1), at("store", 2), commit) // committed, another process's start
	write(journal.OpCheckpoint, []journal.Proc{{PID: pid, Start: 0}}, at("dump", 1), at("store", 2), commit)                // start unknown
	// Start times count in 10 ms ticks: let one pass before the restore "begins".
	time.Sleep(30 * time.Millisecond)
	write(journal.OpRestore, []journal.Proc{{PID: pid}}, at("criu-restore", proc.SinceBoot())) // began after the pid started
	rep, err := Recover(context.Background(), r.opts)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Operations) != 3 {
		t.Fatalf("recovered %+v", rep.Operations)
	}
	if !proc.Alive(pid) || !stopped(pid) {
		t.Fatalf("pid %d was touched (alive %v, stopped %v): %+v", pid, proc.Alive(pid), stopped(pid), rep.Operations)
	}
	// The same restore journal, begun before the pid started: it is the half-restored process.
	write(journal.OpRestore, []journal.Proc{{PID: pid}}, at("criu-restore", s.StartedAt()-time.Second))
	if rep, err = Recover(context.Background(), r.opts); err != nil || len(rep.Operations) != 1 || rep.Operations[0].Outcome != RecoveredRolledBack {
		t.Fatalf("recover: %+v, %v", rep, err)
	}
	if proc.Alive(pid) {
		t.Fatal("the half-restored process was not killed")
	}
}

// TestRecoverRefusesInvalidJournals: an invalid journal is kept aside and removed, touching no
// process; a journal cut short while created is removed; a live operation's is left alone; and
// with nothing to do recover is cheap.
func TestRecoverRefusesInvalidJournals(t *testing.T) {
	pid := sleeper(t)
	r := newRecoverRig(t)
	// The live operation first: its Begin recovers what it finds.
	live, err := r.env.Begin(context.Background(), TxnSpec{Op: journal.OpCheckpoint, Root: pid, Tree: []int{pid}, Steps: []string{"dump"}})
	if err != nil {
		t.Fatal(err)
	}
	defer live.End(nil, false)
	dir := journal.Dir()
	bad := filepath.Join(dir, "restore-77-0123456789abcdef"+journal.Ext)
	hostile := fmt.Sprintf(`{"t":"begin","begin":{"v":1,"op":"restore","id":"restore-77-0123456789abcdef","boot":"x","time":"2026-01-01T00:00:00Z","owner":{"pid":77,"start":1},"session":1,"root":%d,"tree":[{"pid":%d,"start":0}],"steps":["criu-restore"]}}`+"\n", pid, pid)
	if err := os.WriteFile(bad, []byte(hostile+`{"t":"step","step":"criu-restore","phase":"begin","at":1}`+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cut := filepath.Join(dir, "checkpoint-78-0123456789abcdef"+journal.Ext)
	if err := os.WriteFile(cut, []byte(`{"t":"begin","be`), 0o600); err != nil {
		t.Fatal(err)
	}
	rep, err := Recover(context.Background(), r.opts)
	if err != nil {
		t.Fatal(err)
	}
	outcomes := map[string]string{}
	for _, o := range rep.Operations {
		outcomes[o.Journal] = o.Outcome
	}
	want := map[string]string{"restore-77-0123456789abcdef": RecoveredRefused, "checkpoint-78-0123456789abcdef": RecoveredCleaned, live.ID(): RecoveredRunning}
	for id, o := range want {
		if outcomes[id] != o {
			t.Errorf("%s: %q, want %q (all: %v)", id, outcomes[id], o, outcomes)
		}
	}
	if !proc.Alive(pid) {
		t.Fatal("an invalid journal killed a process")
	}
	for _, p := range []string{bad, cut} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s still in the journal directory", p)
		}
	}
	if _, err := os.Stat(live.w.Path()); err != nil {
		t.Errorf("the live operation's journal: %v", err)
	}
	kept, _ := filepath.Glob(filepath.Join(r.logs, "refused-journal-*", "restore-77-*"))
	if len(kept) != 1 {
		t.Errorf("the refused journal is not kept in the log directory: %v", kept)
	}
	live.End(nil, false)
	t0 := time.Now()
	for range 100 {
		if rep, err := Recover(context.Background(), r.opts); err != nil || len(rep.Operations) != 0 {
			t.Fatalf("recover with nothing to do: %+v, %v", rep, err)
		}
	}
	t.Logf("recover with nothing to do: %s per call", time.Since(t0)/100)
}

// TestPending lists what Recover would act on without touching anything: an interrupted
// operation, one whose guardian is still at work, an invalid journal; not a live operation nor
// a journal cut short while created. Afterwards every journal is as it was, and Recover finds
// them unlocked.
func TestPending(t *testing.T) {
	pid, guard := sleeper(t), sleeper(t)
	r := newRecoverRig(t)
	if got, err := Pending(); err != nil || len(got) != 0 {
		t.Fatalf("Pending with no journal directory: %+v, %v", got, err)
	}
	live, err := r.env.Begin(context.Background(), TxnSpec{Op: journal.OpCheckpoint, Root: pid, Tree: []int{pid}, Steps: []string{"dump"}})
	if err != nil {
		t.Fatal(err)
	}
	defer live.End(nil, false)
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	boot, _ := proc.BootID()
	ps, _ := proc.ReadStat(pid)
	gs, _ := proc.ReadStat(guard)
	write := func(op string, recs ...journal.Record) string {
		id, _ := journal.NewID(op, dead.Process.Pid)
		h := journal.Header{V: journal.Version, Op: op, ID: id, Boot: boot, Time: time.Now(), Owner: journal.Proc{PID: dead.Process.Pid, Start: 1},
			Session: 1, Root: pid, Tree: []journal.Proc{{PID: pid, Start: ps.StartTicks}}, Steps: []string{"dump"}}
		w, err := journal.Create(journal.Dir(), h)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Append(recs...); err != nil {
			t.Fatal(err)
		}
		w.Abandon()
		return id
	}
	step := journal.Record{T: journal.TStep, Step: "dump", Phase: journal.PhaseBegin, At: 1}
	interrupted := write(journal.OpCheckpoint, step)
	guarded := write(journal.OpMigrate, journal.Record{T: journal.TGuardian, Proc: &journal.Proc{PID: guard, Start: gs.StartTicks}}, step)
	dir := journal.Dir()
	if err := os.WriteFile(filepath.Join(dir, "restore-77-0123456789abcdef"+journal.Ext), []byte(`{"t":"begin","begin":{"v":9}}`+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "checkpoint-78-0123456789abcdef"+journal.Ext), []byte(`{"t":"begin","be`), 0o600); err != nil {
		t.Fatal(err)
	}
	snapshot := func() map[string]string {
		m := map[string]string{}
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			b, _ := os.ReadFile(filepath.Join(dir, e.Name()))
			m[e.Name()] = string(b)
		}
		return m
	}
	before := snapshot()

	got, err := Pending()
	if err != nil {
		t.Fatal(err)
	}
	outcomes := map[string]Recovered{}
	for _, o := range got {
		outcomes[o.Journal] = o
	}
	want := map[string]string{interrupted: PendingInterrupted, guarded: RecoveredBusy, "restore-77-0123456789abcdef": RecoveredRefused}
	if len(got) != len(want) {
		t.Errorf("Pending: %+v, want %v", got, want)
	}
	for id, o := range want {
		if outcomes[id].Outcome != o {
			t.Errorf("%s: %+v, want %q", id, outcomes[id], o)
		}
	}
	if o := outcomes[interrupted]; o.Op != journal.OpCheckpoint || o.PID != pid || o.Started.IsZero() || len(o.Actions) != 0 {
		t.Errorf("interrupted operation described as %+v", o)
	}
	if o := outcomes["restore-77-0123456789abcdef"]; !strings.Contains(o.Error, "version 9") {
		t.Errorf("invalid journal: %+v", o)
	}
	if after := snapshot(); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Errorf("Pending changed the journal directory:\n%v\nwant\n%v", after, before)
	}
	if !proc.Alive(pid) || stopped(pid) || !proc.Alive(guard) {
		t.Error("Pending touched a process")
	}
	// Nothing is left locked: recover handles them all now (the guarded one waits for no lock).
	rep, err := Recover(context.Background(), r.opts)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range rep.Operations {
		if o.Journal == interrupted && o.Outcome != RecoveredRolledBack && o.Outcome != RecoveredCleaned {
			t.Errorf("recover after Pending: %+v", o)
		}
	}
}

// TestRecoverHintNamesStore: the hint of a checkpoint rolled back after its store step began
// names the operation's store when it is not the default, so that it works as printed.
func TestRecoverHintNamesStore(t *testing.T) {
	pid := sleeper(t)
	r := newRecoverRig(t)
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	boot, _ := proc.BootID()
	s, _ := proc.ReadStat(pid)
	for _, tt := range []struct{ store, want string }{
		{"/data/other-store", "`ptxmig --store /data/other-store image gc`"},
		{DefaultStoreDir, "`ptxmig image gc`"},
	} {
		id, _ := journal.NewID(journal.OpCheckpoint, dead.Process.Pid)
		h := journal.Header{V: journal.Version, Op: journal.OpCheckpoint, ID: id, Boot: boot, Time: time.Now(), Owner: journal.Proc{PID: dead.Process.Pid, Start: 1},
			Session: 1, Root: pid, Tree: []journal.Proc{{PID: pid, Start: s.StartTicks}}, Store: tt.store, Image: "img", Steps: []string{"dump", "store", "finish"}}
		w, err := journal.Create(journal.Dir(), h)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Append(journal.Record{T: journal.TStep, Step: "store", Phase: journal.PhaseBegin, At: 1}); err != nil {
			t.Fatal(err)
		}
		w.Abandon()
		rep := RecoverJournal(context.Background(), w.Path(), r.opts)
		if rep == nil || rep.Outcome != RecoveredRolledBack || !slices.ContainsFunc(rep.Actions, func(a string) bool { return strings.Contains(a, tt.want) }) {
			t.Errorf("store %s: %+v, want an action with %s", tt.store, rep, tt.want)
		}
	}
}

// TestGuardianRollsBackJobMidStep: ptxmig dies in the middle of the lock or the checkpoint of a
// job's three CUDA processes (some ranks done, the others not): the guardian's rollback brings
// every rank back to running, whatever point it died at.
func TestGuardianRollsBackJobMidStep(t *testing.T) {
	for _, step := range []string{StepLock, StepCheckpoint} {
		for k := 1; k <= 3; k++ {
			t.Run(fmt.Sprintf("%s/%d-of-3", step, k), func(t *testing.T) {
				pids := []int{sleeper(t), sleeper(t), sleeper(t)}
				r := newRecoverRig(t, pids...)
				steps := []string{StepAlign, StepQuiesce, StepLock, StepCheckpoint, StepDetach, "dump", "store", "finish"}
				var run []Step
				if step == StepCheckpoint {
					run = []Step{LockStep(r.drv, pids, time.Second)}
				}
				tx := r.begin(t, TxnSpec{Op: journal.OpCheckpoint, Root: pids[0], Tree: pids, CUDA: pids, Steps: steps}, run)
				if err := tx.begin(step); err != nil {
					t.Fatal(err)
				}
				for _, pid := range pids[:k] {
					var err error
					if step == StepLock {
						err = r.drv.Lock(pid, time.Second)
					} else {
						err = r.drv.Checkpoint(pid)
					}
					if err != nil {
						t.Fatal(err)
					}
				}
				tx.die()
				rep := r.recoverOne(t, tx)
				if rep.Outcome != RecoveredRolledBack || rep.Error != "" {
					t.Fatalf("recovery %+v", rep)
				}
				for _, pid := range pids {
					if st := r.drv.Get(pid).State; st != cudackpt.Running {
						t.Errorf("pid %d left %v (driver calls %v)", pid, st, r.drv.PIDCalls)
					}
				}
			})
		}
	}
}

// TestGuardianJobMigrateMidRestore: ptxmig dies in the middle of a job migrate's driver restore
// (k of 3 ranks restored onto their target, the others still checkpointed), or right after it
// (k = 3, some ranks unlocked there too). The guardian moves the restored ranks back with the
// journal's pairs inverted and brings every rank back to running on its own GPU. A journal
// without pairs (an older ptxmig's) leaves the restored ranks on their targets, and says so.
func TestGuardianJobMigrateMidRestore(t *testing.T) {
	const gpu1 = "GPU-11111111-1111-1111-1111-111111111111"
	g0, err := cudackpt.ParseUUID(gpu0)
	if err != nil {
		t.Fatal(err)
	}
	g1, err := cudackpt.ParseUUID(gpu1)
	if err != nil {
		t.Fatal(err)
	}
	swap := []cudackpt.Pair{{Old: g0, New: g1}, {Old: g1, New: g0}}
	for _, journaled := range []bool{true, false} {
		for k := 0; k <= 3; k++ {
			t.Run(fmt.Sprintf("pairs-%v/%d-of-3-restored", journaled, k), func(t *testing.T) {
				pids := []int{sleeper(t), sleeper(t), sleeper(t)}
				r := newRecoverRig(t, pids...)
				steps := []string{StepAlign, StepQuiesce, StepLock, StepCheckpoint, StepDriverRestore, StepUnlock, StepResume}
				spec := TxnSpec{Op: journal.OpMigrate, Root: pids[0], Tree: pids, CUDA: pids, Steps: steps}
				if journaled {
					spec.Pairs = swap
				}
				tx := r.begin(t, spec, []Step{LockStep(r.drv, pids, time.Second), CheckpointStep(r.drv, pids)})
				if err := tx.begin(StepDriverRestore); err != nil {
					t.Fatal(err)
				}
				for _, pid := range pids[:k] {
					if err := r.drv.Restore(pid, swap); err != nil {
						t.Fatal(err)
					}
				}
				if k == 3 { // the restore step done, the unlock under way: one rank unlocked already
					tx.end(StepDriverRestore, nil)
					if err := tx.begin(StepUnlock); err != nil {
						t.Fatal(err)
					}
					if err := r.drv.Unlock(pids[0]); err != nil {
						t.Fatal(err)
					}
				}
				tx.die()
				rep := r.recoverOne(t, tx)
				note := "moved pid"
				if !journaled && k > 0 {
					note = "target GPUs"
				}
				if rep.Error != "" || k > 0 && !slices.ContainsFunc(rep.Actions, func(a string) bool { return strings.Contains(a, note) }) {
					t.Fatalf("recovery %+v, want a note with %q", rep, note)
				}
				for i, pid := range pids {
					want := gpu0
					if !journaled && i < k {
						want = gpu1
					}
					if p := r.drv.Get(pid); p.State != cudackpt.Running || p.GPU != want {
						t.Errorf("rank pid %d: %+v, want running on %s (driver calls %v)", pid, p, want, r.drv.PIDCalls)
					}
				}
			})
		}
	}
}

// TestGuardianJobMigrateDiesInItsRollback: ptxmig dies while its own rollback moves a job's ranks
// back (the driver restore's undo begun, one rank moved): the guardian moves nothing twice (the
// moved rank stays on its source GPU) and brings every rank back to running.
func TestGuardianJobMigrateDiesInItsRollback(t *testing.T) {
	const gpu1 = "GPU-11111111-1111-1111-1111-111111111111"
	g0, _ := cudackpt.ParseUUID(gpu0)
	g1, _ := cudackpt.ParseUUID(gpu1)
	swap := []cudackpt.Pair{{Old: g0, New: g1}, {Old: g1, New: g0}}
	back := []cudackpt.Pair{{Old: g1, New: g0}, {Old: g0, New: g1}}
	pids := []int{sleeper(t), sleeper(t)}
	r := newRecoverRig(t, pids...)
	steps := []string{StepQuiesce, StepLock, StepCheckpoint, StepDriverRestore, StepUnlock, StepResume}
	tx := r.begin(t, TxnSpec{Op: journal.OpMigrate, Root: pids[0], Tree: pids, CUDA: pids, Steps: steps, Pairs: swap},
		[]Step{LockStep(r.drv, pids, time.Second), CheckpointStep(r.drv, pids)})
	if err := tx.begin(StepDriverRestore); err != nil {
		t.Fatal(err)
	}
	for _, pid := range pids {
		if err := r.drv.Restore(pid, swap); err != nil {
			t.Fatal(err)
		}
	}
	tx.end(StepDriverRestore, nil)
	tx.undo(StepDriverRestore)
	if err := r.drv.Checkpoint(pids[1]); err != nil { // the rollback moved the second rank back
		t.Fatal(err)
	}
	if err := r.drv.Restore(pids[1], back); err != nil {
		t.Fatal(err)
	}
	tx.die()
	rep := r.recoverOne(t, tx)
	if rep.Error != "" || !slices.ContainsFunc(rep.Actions, func(a string) bool { return strings.Contains(a, "may run on their target GPUs") }) {
		t.Fatalf("recovery %+v", rep)
	}
	for i, want := range []string{gpu1, gpu0} {
		if p := r.drv.Get(pids[i]); p.State != cudackpt.Running || p.GPU != want {
			t.Errorf("rank pid %d: %+v, want running on %s (driver calls %v)", pids[i], p, want, r.drv.PIDCalls)
		}
	}
}
