package op_test

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

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/cudackpt/cudackpttest"
	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimctl/shimctltest"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/internal/testreq"
	"github.com/ptxmig/ptxmig/migrate"
	"github.com/ptxmig/ptxmig/restore"
)

// The guardian's rollback (RecoverJournal, Recover), driven in-process against the fake driver,
// a fake shim socket and real processes. A real GPU run adds what only the driver can show: the
// guardian's restore and unlock after a SIGKILL right after the lock or the checkpoint
// (checkpoint/gputest TestGuardian*).

const gpu0 = "GPU-00000000-0000-0000-0000-000000000000"

// kindOf is the kind each operation journals its own steps with.
var kindOf = map[string]string{checkpoint.StepDump: checkpoint.KindDump, checkpoint.StepStore: checkpoint.KindStore,
	checkpoint.StepFinish: checkpoint.KindFinish, restore.StepCRIURestore: restore.KindCRIURestore}

// planned is the operations' own steps named, as they are journaled (the store step commits),
// each doing nothing.
func planned(names ...string) []op.Step {
	out := make([]op.Step, len(names))
	for i, n := range names {
		out[i] = op.Step{Name: n, Kind: kindOf[n], Commit: n == checkpoint.StepStore, Do: func(context.Context) error { return nil }}
	}
	return out
}

// journaled is what the journal records of planned(names...).
func journaled(names ...string) []journal.Step {
	out, err := op.JournalSteps(planned(names...))
	if err != nil {
		panic(err)
	}
	return out
}

// checkpointPlan is the steps a checkpoint of the CUDA processes pids journals (align: a job).
func checkpointPlan(drv op.Driver, pids []int, align bool) []op.Step {
	pre := shimstep.NewPreemption(&op.Env{}, 0)
	var s []op.Step
	if align {
		s = append(s, pre.AlignStep(pids, 0))
	}
	s = append(s, pre.QuiesceStep(pids), driverstep.LockStep(drv, pids, time.Second), driverstep.CheckpointStep(drv, pids), pre.DetachStep())
	return append(s, planned(checkpoint.StepDump, checkpoint.StepStore, checkpoint.StepFinish)...)
}

// reply is one line of a fake shim's answers.
func reply(cmd, result string, proto int) string {
	return fmt.Sprintf(`{"ok":true,"proto":%d,"cmd":%q,"result":%s}`+"\n", proto, cmd, result)
}

type recoverRig struct {
	env  *op.Env
	drv  *cudackpttest.Driver
	opts op.RecoverOptions
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
	for pid, p := range drv.Procs {
		p.Real = pid != os.Getpid() // this process's own threads are never held
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	r := &recoverRig{drv: drv, logs: filepath.Join(dir, "logs"),
		env:  &op.Env{Driver: drv, Euid: 0, Log: log},
		opts: op.RecoverOptions{Driver: func() (op.Driver, error) { return drv, nil }, Log: log, Wait: time.Second}}
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

// begin journals an operation and runs the steps given (the first of the planned ones).
func (r *recoverRig) begin(t *testing.T, spec op.TxnSpec, run []op.Step) *op.Txn {
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

func (r *recoverRig) recoverOne(t *testing.T, tx *op.Txn) *op.Recovered {
	t.Helper()
	path := tx.JournalPath()
	rep := op.RecoverJournal(context.Background(), path, r.opts)
	if rep == nil {
		t.Fatal("RecoverJournal found nothing")
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) && rep.Outcome != op.RecoveredIncomplete {
		t.Errorf("journal still there after %s: %v", rep.Outcome, err)
	}
	return rep
}

func stopped(pid int) bool {
	s, err := proc.ReadStat(pid)
	return err == nil && s.Stopped()
}

// TestGuardianRollsBackCheckpoint: ptxmig dies after the driver lock and checkpoint and while
// CRIU dumps (the tree is stopped): the guardian leaves the CUDA process stopped until it has
// restored its GPU state onto its own GPUs (the restore continues it), unlocks, and removes the
// staging directory; the report says so.
func TestGuardianRollsBackCheckpoint(t *testing.T) {
	pid := sleeper(t)
	r := newRecoverRig(t, pid)
	steps := checkpointPlan(r.drv, []int{pid}, false)
	tx := r.begin(t, op.TxnSpec{Op: journal.OpCheckpoint, Root: pid, Tree: []int{pid}, CUDA: []int{pid}, StagingRoot: os.Getenv("PTXMIG_STAGING_DIR"), Steps: steps},
		[]op.Step{driverstep.LockStep(r.drv, []int{pid}, time.Second), driverstep.CheckpointStep(r.drv, []int{pid})})
	// The dump began and stopped the tree; then ptxmig died.
	if err := tx.BeginStep("dump"); err != nil {
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
	tx.Die()

	rep := r.recoverOne(t, tx)
	if rep.Outcome != op.RecoveredRolledBack || rep.Error != "" {
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
	for _, want := range []string{"rolled-back", "stays stopped until the driver has restored it", "driver restore of pid", "driver unlock of pid", "removed staging"} {
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
	steps := checkpointPlan(r.drv, []int{pid}, false)
	tx := r.begin(t, op.TxnSpec{Op: journal.OpCheckpoint, Root: pid, Tree: []int{pid}, CUDA: []int{pid}, Steps: steps},
		[]op.Step{{Name: shimstep.StepQuiesce, Kind: shimstep.KindQuiesce, Do: func(context.Context) error { return nil }}, driverstep.LockStep(r.drv, []int{pid}, time.Second), driverstep.CheckpointStep(r.drv, []int{pid}),
			{Name: shimstep.StepDetach, Do: func(context.Context) error { return nil }}})
	tx.Die()
	rep := r.recoverOne(t, tx)
	if rep.Outcome != op.RecoveredRolledBack || rep.Error != "" {
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
// the unlock, it is left running where it is.
func TestGuardianMigrate(t *testing.T) {
	pid := sleeper(t)
	r := newRecoverRig(t, pid)
	pre := shimstep.NewPreemption(r.env, 0)
	steps := append([]op.Step{pre.QuiesceStep([]int{pid})}, migrate.Steps(r.drv, []int{pid}, nil, time.Second, nil)...)
	steps = append(steps, pre.ResumeStep(op.Fixed([]int{pid}), false))
	steps[len(steps)-1].Commit = true
	spec := op.TxnSpec{Op: journal.OpMigrate, Root: pid, Tree: []int{pid}, CUDA: []int{pid}, Steps: steps}
	tx := r.begin(t, spec, []op.Step{driverstep.LockStep(r.drv, []int{pid}, time.Second), driverstep.CheckpointStep(r.drv, []int{pid})})
	if err := tx.BeginStep(driverstep.StepDriverRestore); err != nil {
		t.Fatal(err)
	}
	tx.Die()
	if rep := r.recoverOne(t, tx); rep.Outcome != op.RecoveredRolledBack || rep.Error != "" {
		t.Fatalf("recovery %+v", rep)
	}
	if p := r.drv.Get(pid); p.State != cudackpt.Running || p.GPU != gpu0 {
		t.Errorf("after recovery: %+v, want running on %s", p, gpu0)
	}
	calls := len(r.drv.Calls)
	tx = r.begin(t, spec, []op.Step{driverstep.LockStep(r.drv, []int{pid}, time.Second), driverstep.CheckpointStep(r.drv, []int{pid}),
		driverstep.RestoreStep(r.drv, op.Fixed([]int{pid}), nil, nil, false), driverstep.UnlockStep(r.drv, op.Fixed([]int{pid}))})
	tx.Die()
	if rep := r.recoverOne(t, tx); rep.Outcome != op.RecoveredRolledBack || rep.Error != "" {
		t.Fatalf("recovery %+v", rep)
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
	tx := r.begin(t, op.TxnSpec{Op: journal.OpCheckpoint, Root: pid, Tree: []int{pid}, Steps: planned("dump", "store", "finish")},
		planned("dump", "store"))
	tx.Die()
	rep := r.recoverOne(t, tx)
	if rep.Outcome != op.RecoveredFinished {
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
	// The plan saw the root and its child; the grandchild is "forked since".
	tx := r.begin(t, op.TxnSpec{Op: journal.OpCheckpoint, Root: root, Tree: []int{root, child}, Steps: planned("dump", "store", "finish")},
		planned("dump", "store"))
	for _, pid := range pids[1:] {
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
	}
	if err := syscall.Kill(root, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-done
	tx.Die()
	rep := r.recoverOne(t, tx)
	if rep.Outcome != op.RecoveredFinished || rep.Error != "" {
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
			Session: 1, Root: tree[0].PID, Tree: tree, Steps: journaled("dump", "store", "finish", "criu-restore")}
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
	rep, err := op.Recover(context.Background(), r.opts)
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
	if rep, err = op.Recover(context.Background(), r.opts); err != nil || len(rep.Operations) != 1 || rep.Operations[0].Outcome != op.RecoveredRolledBack {
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
	live, err := r.env.Begin(context.Background(), op.TxnSpec{Op: journal.OpCheckpoint, Root: pid, Tree: []int{pid}, Steps: planned("dump")})
	if err != nil {
		t.Fatal(err)
	}
	defer live.End(nil, false)
	dir := journal.Dir()
	bad := filepath.Join(dir, "restore-77-0123456789abcdef"+journal.Ext)
	hostile := fmt.Sprintf(`{"t":"begin","begin":{"v":%d,"op":"restore","id":"restore-77-0123456789abcdef","boot":"x","time":"2026-01-01T00:00:00Z","owner":{"pid":77,"start":1},"session":1,"root":%d,"tree":[{"pid":%d,"start":0}],"steps":[{"name":"criu-restore","kind":%q}]}}`+"\n", journal.Version, pid, pid, restore.KindCRIURestore)
	if err := os.WriteFile(bad, []byte(hostile+`{"t":"step","step":"criu-restore","phase":"begin","at":1}`+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cut := filepath.Join(dir, "checkpoint-78-0123456789abcdef"+journal.Ext)
	if err := os.WriteFile(cut, []byte(`{"t":"begin","be`), 0o600); err != nil {
		t.Fatal(err)
	}
	rep, err := op.Recover(context.Background(), r.opts)
	if err != nil {
		t.Fatal(err)
	}
	outcomes := map[string]string{}
	for _, o := range rep.Operations {
		outcomes[o.Journal] = o.Outcome
	}
	want := map[string]string{"restore-77-0123456789abcdef": op.RecoveredRefused, "checkpoint-78-0123456789abcdef": op.RecoveredCleaned, live.ID(): op.RecoveredRunning}
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
	if _, err := os.Stat(live.JournalPath()); err != nil {
		t.Errorf("the live operation's journal: %v", err)
	}
	kept, _ := filepath.Glob(filepath.Join(r.logs, "refused-journal-*", "restore-77-*"))
	if len(kept) != 1 {
		t.Errorf("the refused journal is not kept in the log directory: %v", kept)
	}
	live.End(nil, false)
	t0 := time.Now()
	for range 100 {
		if rep, err := op.Recover(context.Background(), r.opts); err != nil || len(rep.Operations) != 0 {
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
	if got, err := op.Pending(); err != nil || len(got) != 0 {
		t.Fatalf("Pending with no journal directory: %+v, %v", got, err)
	}
	live, err := r.env.Begin(context.Background(), op.TxnSpec{Op: journal.OpCheckpoint, Root: pid, Tree: []int{pid}, Steps: planned("dump")})
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
			Session: 1, Root: pid, Tree: []journal.Proc{{PID: pid, Start: ps.StartTicks}}, Steps: journaled("dump")}
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

	got, err := op.Pending()
	if err != nil {
		t.Fatal(err)
	}
	outcomes := map[string]op.Recovered{}
	for _, o := range got {
		outcomes[o.Journal] = o
	}
	want := map[string]string{interrupted: op.PendingInterrupted, guarded: op.RecoveredBusy, "restore-77-0123456789abcdef": op.RecoveredRefused}
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
	rep, err := op.Recover(context.Background(), r.opts)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range rep.Operations {
		if o.Journal == interrupted && o.Outcome != op.RecoveredRolledBack && o.Outcome != op.RecoveredCleaned {
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
		{op.DefaultStoreDir, "`ptxmig image gc`"},
	} {
		id, _ := journal.NewID(journal.OpCheckpoint, dead.Process.Pid)
		h := journal.Header{V: journal.Version, Op: journal.OpCheckpoint, ID: id, Boot: boot, Time: time.Now(), Owner: journal.Proc{PID: dead.Process.Pid, Start: 1},
			Session: 1, Root: pid, Tree: []journal.Proc{{PID: pid, Start: s.StartTicks}}, Store: tt.store, Image: "img", Steps: journaled("dump", "store", "finish")}
		w, err := journal.Create(journal.Dir(), h)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Append(journal.Record{T: journal.TStep, Step: "store", Phase: journal.PhaseBegin, At: 1}); err != nil {
			t.Fatal(err)
		}
		w.Abandon()
		rep := op.RecoverJournal(context.Background(), w.Path(), r.opts)
		if rep == nil || rep.Outcome != op.RecoveredRolledBack || !slices.ContainsFunc(rep.Actions, func(a string) bool { return strings.Contains(a, tt.want) }) {
			t.Errorf("store %s: %+v, want an action with %s", tt.store, rep, tt.want)
		}
	}
}

// TestGuardianRollsBackJobMidStep: ptxmig dies in the middle of the lock or the checkpoint of a
// job's three CUDA processes (some ranks done, the others not): the guardian's rollback brings
// every rank back to running, whatever point it died at.
func TestGuardianRollsBackJobMidStep(t *testing.T) {
	for _, step := range []string{driverstep.StepLock, driverstep.StepCheckpoint} {
		for k := 1; k <= 3; k++ {
			t.Run(fmt.Sprintf("%s/%d-of-3", step, k), func(t *testing.T) {
				pids := []int{sleeper(t), sleeper(t), sleeper(t)}
				r := newRecoverRig(t, pids...)
				steps := checkpointPlan(r.drv, pids, true)
				var run []op.Step
				if step == driverstep.StepCheckpoint {
					run = []op.Step{driverstep.LockStep(r.drv, pids, time.Second)}
				}
				tx := r.begin(t, op.TxnSpec{Op: journal.OpCheckpoint, Root: pids[0], Tree: pids, CUDA: pids, Steps: steps}, run)
				if err := tx.BeginStep(step); err != nil {
					t.Fatal(err)
				}
				for _, pid := range pids[:k] {
					var err error
					if step == driverstep.StepLock {
						err = r.drv.Lock(pid, time.Second)
					} else {
						err = r.drv.Checkpoint(pid)
					}
					if err != nil {
						t.Fatal(err)
					}
				}
				tx.Die()
				rep := r.recoverOne(t, tx)
				if rep.Outcome != op.RecoveredRolledBack || rep.Error != "" {
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

// TestRecoverLeavesUnknownKinds: a journal with a step of a kind this ptxmig does not know (a
// newer ptxmig's) is left as it is, touching nothing, and named in the report; one whose step data
// its kind cannot read is refused (kept aside).
func TestRecoverLeavesUnknownKinds(t *testing.T) {
	pid := sleeper(t)
	r := newRecoverRig(t, pid)
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	boot, _ := proc.BootID()
	s, _ := proc.ReadStat(pid)
	write := func(steps []journal.Step) string {
		id, _ := journal.NewID(journal.OpMigrate, dead.Process.Pid)
		h := journal.Header{V: journal.Version, Op: journal.OpMigrate, ID: id, Boot: boot, Time: time.Now(), Owner: journal.Proc{PID: dead.Process.Pid, Start: 1},
			Session: 1, Root: pid, Tree: []journal.Proc{{PID: pid, Start: s.StartTicks}}, CUDA: []int{pid}, Steps: steps}
		w, err := journal.Create(journal.Dir(), h)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Append(journal.Record{T: journal.TStep, Step: steps[0].Name, Phase: journal.PhaseBegin, At: 1}); err != nil {
			t.Fatal(err)
		}
		w.Abandon()
		return w.Path()
	}
	if err := r.drv.Lock(pid, time.Second); err != nil {
		t.Fatal(err)
	}
	unknown := write([]journal.Step{{Name: "lock", Kind: "future.lock", Data: []byte(`{"pids":[1]}`)}})
	rep := op.RecoverJournal(context.Background(), unknown, r.opts)
	if rep == nil || rep.Outcome != op.RecoveredIncomplete || !strings.Contains(rep.Error, "future.lock") {
		t.Fatalf("unknown kind: %+v", rep)
	}
	if _, err := os.Stat(unknown); err != nil {
		t.Errorf("the journal of an unknown kind is gone: %v", err)
	}
	if st := r.drv.Get(pid).State; st != cudackpt.Locked {
		t.Errorf("a journal of an unknown kind changed the driver state: %v", st)
	}
	bad := write([]journal.Step{{Name: "lock", Kind: driverstep.KindLock, Data: []byte(`{"pids":"all"}`)}})
	if rep := op.RecoverJournal(context.Background(), bad, r.opts); rep == nil || rep.Outcome != op.RecoveredRefused {
		t.Fatalf("unreadable step data: %+v", rep)
	}
	if st := r.drv.Get(pid).State; st != cudackpt.Locked {
		t.Errorf("a refused journal changed the driver state: %v", st)
	}
	_ = os.Remove(unknown)
}

// jobMove is a job migrate's planned steps for pids, their GPUs swapped (the driver restore of
// kind driverstep.KindMove journals the pairs).
func jobMove(r *recoverRig, pids []int) (op.TxnSpec, []cudackpt.Pair) {
	g0, _ := cudackpt.ParseUUID(gpu0)
	g1, _ := cudackpt.ParseUUID(jobGPU1)
	swap := []cudackpt.Pair{{Old: g0, New: g1}, {Old: g1, New: g0}}
	steps := migrate.Steps(r.drv, pids, swap, time.Second, nil)
	return op.TxnSpec{Op: journal.OpMigrate, Root: pids[0], Tree: pids, CUDA: pids, Steps: steps}, swap
}

const jobGPU1 = "GPU-11111111-1111-1111-1111-111111111111"

// continueStopped continues a process the checkpoint step left stopped, as the driver restore
// (which holds its threads) does before it restores it: a test that calls the fake driver itself
// must do the same.
func continueStopped(t *testing.T, pid int) {
	t.Helper()
	if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	for stopped(pid) {
		time.Sleep(time.Millisecond)
	}
}

// TestGuardianJobMigrateMidRestore: ptxmig dies in the middle of a job migrate's driver restore
// (k of 3 ranks restored onto their target, the others still checkpointed), or right after it
// (k = 3, one rank unlocked there too). The guardian rebuilds the restore's undo from the journal
// (the pairs inverted) and brings every rank back to running on its own GPU.
func TestGuardianJobMigrateMidRestore(t *testing.T) {
	for k := 0; k <= 3; k++ {
		t.Run(fmt.Sprintf("%d-of-3-restored", k), func(t *testing.T) {
			pids := []int{sleeper(t), sleeper(t), sleeper(t)}
			r := newRecoverRig(t, pids...)
			spec, swap := jobMove(r, pids)
			tx := r.begin(t, spec, []op.Step{driverstep.LockStep(r.drv, pids, time.Second), driverstep.CheckpointStep(r.drv, pids)})
			if err := tx.BeginStep(driverstep.StepDriverRestore); err != nil {
				t.Fatal(err)
			}
			for _, pid := range pids[:k] {
				continueStopped(t, pid)
				if err := r.drv.Restore(pid, swap); err != nil {
					t.Fatal(err)
				}
			}
			if k == 3 { // the restore step done, the unlock under way: one rank unlocked already
				tx.EndStep(driverstep.StepDriverRestore, nil)
				if err := tx.BeginStep(driverstep.StepUnlock); err != nil {
					t.Fatal(err)
				}
				if err := r.drv.Unlock(pids[0]); err != nil {
					t.Fatal(err)
				}
			}
			tx.Die()
			rep := r.recoverOne(t, tx)
			if rep.Outcome != op.RecoveredRolledBack || rep.Error != "" {
				t.Fatalf("recovery %+v", rep)
			}
			for _, pid := range pids {
				if p := r.drv.Get(pid); p.State != cudackpt.Running || p.GPU != gpu0 {
					t.Errorf("rank pid %d: %+v, want running on %s (driver calls %v)", pid, p, gpu0, r.drv.PIDCalls)
				}
			}
		})
	}
}

// TestGuardianJobMigrateDiesInItsRollback: ptxmig dies while its own rollback moves a job's ranks
// back (the driver restore's undo begun, one rank moved): the guardian moves nothing twice (the
// moved rank stays on its source GPU, the other on its target), says so, and brings every rank
// back to running.
func TestGuardianJobMigrateDiesInItsRollback(t *testing.T) {
	pids := []int{sleeper(t), sleeper(t)}
	r := newRecoverRig(t, pids...)
	spec, swap := jobMove(r, pids)
	back := []cudackpt.Pair{{Old: swap[0].New, New: swap[0].Old}, {Old: swap[1].New, New: swap[1].Old}}
	tx := r.begin(t, spec, []op.Step{driverstep.LockStep(r.drv, pids, time.Second), driverstep.CheckpointStep(r.drv, pids)})
	if err := tx.BeginStep(driverstep.StepDriverRestore); err != nil {
		t.Fatal(err)
	}
	for _, pid := range pids {
		continueStopped(t, pid)
		if err := r.drv.Restore(pid, swap); err != nil {
			t.Fatal(err)
		}
	}
	tx.EndStep(driverstep.StepDriverRestore, nil)
	tx.UndoStep(driverstep.StepDriverRestore)
	if err := r.drv.Checkpoint(pids[1]); err != nil { // the rollback moved the second rank back
		t.Fatal(err)
	}
	if err := r.drv.Restore(pids[1], back); err != nil {
		t.Fatal(err)
	}
	tx.Die()
	rep := r.recoverOne(t, tx)
	if rep.Error != "" || !slices.ContainsFunc(rep.Actions, func(a string) bool { return strings.Contains(a, "may run on their target GPUs") }) {
		t.Fatalf("recovery %+v", rep)
	}
	for i, want := range []string{jobGPU1, gpu0} {
		if p := r.drv.Get(pids[i]); p.State != cudackpt.Running || p.GPU != want {
			t.Errorf("rank pid %d: %+v, want running on %s (driver calls %v)", pids[i], p, want, r.drv.PIDCalls)
		}
	}
}
