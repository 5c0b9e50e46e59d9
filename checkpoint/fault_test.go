package checkpoint_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/internal/testreq"
	"github.com/ptxmig/ptxmig/restore"
	"github.com/ptxmig/ptxmig/store"
)

// The fault injection, with the real ptxmig binary and real CRIU: ptxmig is killed with
// SIGKILL at random moments of a checkpoint (one process; a shell tree) and of a restore. After
// each kill its guardian (or `ptxmig recover`) must leave no process stopped or half-restored,
// no CRIU running, no staging and no journal; every trial ends with the process running on,
// exactly, or with a complete image that restores and continues exactly. The store verifies and
// garbage-collects cleanly afterwards. PTXMIG_FAULT_TRIALS sets the trials per scenario (default
// 50), PTXMIG_FAULT_SEED the random seed.

// faultRig is what every trial uses.
type faultRig struct {
	f       *fixture
	bin     string
	journal string
	rng     *rand.Rand
	counts  map[string]int
	win     time.Duration
}

func newFaultRig(t *testing.T) *faultRig {
	t.Helper()
	if testing.Short() {
		t.Skip("fault injection is slow: skipped with -short")
	}
	f := setup(t)
	gobin, err := exec.LookPath("go")
	if err != nil {
		testreq.Skip(t, "go", "building ptxmig needs the go command: %v", err)
	}
	bin := filepath.Join(f.dir, "ptxmig")
	build := exec.Command(gobin, "build", "-o", bin, "github.com/ptxmig/ptxmig/cmd/ptxmig")
	build.Env = append(os.Environ(), "CGO_CFLAGS=-O2 -Wno-deprecated-declarations")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("cannot build ptxmig: %v\n%s", err, out)
	}
	r := &faultRig{f: f, bin: bin, journal: filepath.Join(f.dir, "journal"), counts: map[string]int{}}
	t.Setenv("PTXMIG_JOURNAL_DIR", r.journal)
	t.Setenv("PTXMIG_STAGING_DIR", f.stage)
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("PTXMIG_FAULT_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	t.Logf("seed %d (PTXMIG_FAULT_SEED)", seed)
	r.rng = rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	return r
}

func faultTrials() int {
	if n, err := strconv.Atoi(os.Getenv("PTXMIG_FAULT_TRIALS")); err == nil && n > 0 {
		return n
	}
	return 50
}

// cli runs ptxmig to completion.
func (r *faultRig) cli(t *testing.T, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(r.bin, append([]string{"--store", r.f.st.Dir()}, args...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return out.String(), ee.ExitCode()
	}
	if err != nil {
		t.Fatal(err)
	}
	return out.String(), 0
}

// killAfter runs ptxmig and sends it SIGKILL after delay; it reports whether the kill landed
// (false: ptxmig had exited, with the returned status and output).
func (r *faultRig) killAfter(t *testing.T, delay time.Duration, args ...string) (bool, int, string) {
	t.Helper()
	cmd := exec.Command(r.bin, append([]string{"--store", r.f.st.Dir()}, args...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	timer := time.AfterFunc(delay, func() { _ = cmd.Process.Signal(syscall.SIGKILL) })
	err := cmd.Wait()
	timer.Stop()
	st := cmd.ProcessState
	if ws, ok := st.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
		return true, -1, out.String()
	}
	if err != nil && st.ExitCode() < 0 {
		t.Fatalf("ptxmig: %v", err)
	}
	return false, st.ExitCode(), out.String()
}

// window is where kills land: anywhere in [0, the median time of uninterrupted runs).
func (r *faultRig) window(runs []time.Duration) time.Duration {
	slices.Sort(runs)
	r.counts = map[string]int{}
	r.win = runs[len(runs)/2]
	return r.win
}

// children lists the processes whose parent is this test (it is a child subreaper: orphans of
// ptxmig — CRIU, the guardian, restored trees — come here).
func children() []proc.Stat {
	var out []proc.Stat
	tasks, _ := os.ReadDir("/proc/self/task")
	seen := map[int]bool{}
	for _, tk := range tasks {
		b, _ := os.ReadFile(filepath.Join("/proc/self/task", tk.Name(), "children"))
		for _, f := range strings.Fields(string(b)) {
			pid, err := strconv.Atoi(f)
			if err != nil || seen[pid] {
				continue
			}
			seen[pid] = true
			if s, err := proc.ReadStat(pid); err == nil {
				out = append(out, s)
			}
		}
	}
	return out
}

// reapZombies reaps zombie children (the guardian, CRIU, processes the guardian killed).
func reapZombies() {
	for _, c := range children() {
		if c.Zombie() {
			var ws syscall.WaitStatus
			_, _ = syscall.Wait4(c.PID, &ws, syscall.WNOHANG, nil)
		}
	}
}

// liveGuardians counts the guardians among this test's children (it is their subreaper).
func liveGuardians() int {
	n := 0
	for _, c := range children() {
		if c.Comm == "ptxmig-guardian" && !c.Zombie() {
			n++
		}
	}
	return n
}

// settle waits for the guardian of a killed ptxmig to finish; a journal it did not handle (ptxmig
// died before the guardian ran) goes to `ptxmig recover`. Then it checks that no CRIU runs and
// no staging or journal is left.
func (r *faultRig) settle(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		reapZombies()
		guardians := liveGuardians()
		js, err := journal.List(r.journal)
		if err != nil {
			t.Fatal(err)
		}
		if guardians == 0 && len(js) == 0 {
			break
		}
		if guardians == 0 {
			out, code := r.cli(t, "recover")
			r.counts["recovered by `ptxmig recover`"]++
			if code != 0 {
				t.Fatalf("ptxmig recover: exit %d\n%s", code, out)
			}
			continue
		}
		if time.Now().After(deadline) {
			t.Fatalf("the guardian did not finish within 60 s (journals %v)", js)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// A CRIU started before the journal (ptxmig's `criu --version`) gets SIGKILL when ptxmig
	// dies (PR_SET_PDEATHSIG), but may still be exiting: give it a moment.
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		reapZombies()
		if !slices.ContainsFunc(children(), func(c proc.Stat) bool { return c.Comm == "criu" && !c.Zombie() }) {
			break
		}
	}
	for _, c := range children() {
		if c.Comm == "criu" && !c.Zombie() {
			self, _ := proc.ReadStat(os.Getpid())
			t.Errorf("CRIU (pid %d, state %c, pgid %d, sid %d, start %d; test pgid %d) %q outlived the operation; last report:\n%s",
				c.PID, c.State, c.PGID, c.SID, c.StartTicks, self.PGID, proc.Cmdline("", c.PID), lastReport())
		}
	}
	if ents, _ := os.ReadDir(r.f.stage); len(ents) != 0 {
		t.Errorf("staging left: %v", ents)
	}
}

// noneStoppedPIDs fails when a process is left stopped.
func noneStoppedPIDs(t *testing.T, pids []int) {
	t.Helper()
	for _, pid := range pids {
		if s, err := proc.ReadStat(pid); err == nil && s.Stopped() {
			t.Fatalf("pid %d (%s) left stopped", pid, s.Comm)
		}
	}
}

// alive is a pid that exists as a running (non-zombie) process, reaping it first if it is a
// zombie child.
func aliveReaped(pid int) bool {
	reapZombies()
	return proc.Alive(pid)
}

// TestFaultInjectionCheckpoint kills `ptxmig checkpoint` of one process at random moments.
func TestFaultInjectionCheckpoint(t *testing.T) {
	r := newFaultRig(t)
	f := r.f
	const mib = 1
	p, m := f.startMiB(t, "state", mib)
	pid := p.PID
	// Calibration: uninterrupted checkpoints (the process is restored after each).
	var runs []time.Duration
	for i := range 3 {
		name := fmt.Sprintf("calib-%d", i)
		t0 := time.Now()
		if out, code := r.cli(t, "checkpoint", "--name", name, strconv.Itoa(pid)); code != 0 {
			t.Fatalf("checkpoint: exit %d\n%s", code, out)
		}
		runs = append(runs, time.Since(t0))
		for proc.Exists(pid) {
			reapZombies()
			time.Sleep(5 * time.Millisecond)
		}
		f.restore(t, name)
	}
	window := r.window(runs)
	trials := faultTrials()
	for i := range trials {
		name := fmt.Sprintf("ck-%d", i)
		before, err := testproc.ReadState(p.StateFile)
		if err != nil {
			t.Fatal(err)
		}
		delay := time.Duration(r.rng.Int64N(int64(window)))
		logs := recoveries()
		killed, code, out := r.killAfter(t, delay, "checkpoint", "--name", name, strconv.Itoa(pid))
		r.settle(t)
		if killed {
			r.counts[killedAt(logs)]++
		}
		stored := false
		if _, err := f.st.Get(name); err == nil {
			stored = true
		} else if !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("trial %d: %v", i, err)
		}
		alive := aliveReaped(pid)
		switch {
		case !killed && code != 0:
			t.Fatalf("trial %d: ptxmig exited %d before the kill\n%s", i, code, out)
		case !killed:
			r.counts["completed before the kill"]++
		}
		switch {
		case alive && stored:
			t.Fatalf("trial %d (kill after %s): the image was stored and the process runs on", i, delay)
		case !alive && !stored:
			t.Fatalf("trial %d (kill after %s): the process is gone and no image was stored; last report:\n%s", i, delay, lastReport())
		case alive:
			r.counts["process running on"]++
			noneStoppedPIDs(t, []int{pid})
			advancesExactly(t, p.StateFile, m, before.Step, 3)
		default:
			r.counts["image stored, restored"]++
			if rep, err := f.st.Verify(context.Background(), name); err != nil || !rep.OK() {
				t.Fatalf("trial %d: image %s does not verify: %v %+v", i, name, err, rep)
			}
			at, _ := testproc.ReadState(p.StateFile)
			res, err := restore.Run(context.Background(), f.env, restore.Options{Image: name, StagingRoot: f.stage})
			if err != nil {
				t.Fatalf("trial %d: restore %s: %v", i, name, err)
			}
			if res.PID != pid {
				t.Fatalf("trial %d: restored as pid %d", i, res.PID)
			}
			advancesExactly(t, p.StateFile, m, at.Step, 3)
		}
	}
	t.Cleanup(func() { _ = testproc.KillPID(pid, 10*time.Second); reapZombies() })
	r.finish(t, "checkpoint of one process", trials)
}

// TestFaultInjectionCheckpointTree kills `ptxmig checkpoint` of a shell tree (a counting loop
// that forks a child every 50 ms) at random moments.
func TestFaultInjectionCheckpointTree(t *testing.T) {
	r := newFaultRig(t)
	f := r.f
	pid, counter := shellCounter(t, f.dir, true)
	var runs []time.Duration
	for i := range 3 {
		name := fmt.Sprintf("calib-%d", i)
		t0 := time.Now()
		if out, code := r.cli(t, "checkpoint", "--name", name, strconv.Itoa(pid)); code != 0 {
			t.Fatalf("checkpoint: exit %d\n%s", code, out)
		}
		runs = append(runs, time.Since(t0))
		r.restoreTree(t, name, pid)
	}
	window := r.window(runs)
	trials := faultTrials()
	for i := range trials {
		name := fmt.Sprintf("tree-%d", i)
		delay := time.Duration(r.rng.Int64N(int64(window)))
		logs := recoveries()
		killed, code, out := r.killAfter(t, delay, "checkpoint", "--name", name, strconv.Itoa(pid))
		r.settle(t)
		if killed {
			r.counts[killedAt(logs)]++
		}
		_, gerr := f.st.Get(name)
		stored := gerr == nil
		alive := aliveReaped(pid)
		switch {
		case !killed && code != 0:
			t.Fatalf("trial %d: ptxmig exited %d before the kill\n%s", i, code, out)
		case !killed:
			r.counts["completed before the kill"]++
		}
		switch {
		case alive && stored:
			t.Fatalf("trial %d (kill after %s): the image was stored and the tree runs on", i, delay)
		case !alive && !stored:
			t.Fatalf("trial %d (kill after %s): the tree is gone and no image was stored; last report:\n%s", i, delay, lastReport())
		case alive:
			r.counts["tree running on"]++
			tree, _ := proc.Tree(pid)
			noneStoppedPIDs(t, proc.PIDs(tree))
			waitCount(t, counter, readCount(counter)+2)
		default:
			r.counts["image stored, restored"]++
			if rep, err := f.st.Verify(context.Background(), name); err != nil || !rep.OK() {
				t.Fatalf("trial %d: image %s does not verify: %v %+v", i, name, err, rep)
			}
			r.restoreTree(t, name, pid)
			waitCount(t, counter, readCount(counter)+2)
		}
	}
	r.finish(t, "checkpoint of a process tree", trials)
}

// restoreTree restores a tree image in-process once its pids are free.
func (r *faultRig) restoreTree(t *testing.T, name string, root int) {
	t.Helper()
	m, err := r.f.st.Get(name)
	if err != nil {
		t.Fatal(err)
	}
	d, err := imagedesc.Read(m)
	if err != nil {
		t.Fatal(err)
	}
	tree := d.Processes()
	// The checkpoint ended the tree; its zombies are ours to reap before the pids are free.
	deadline := time.Now().Add(10 * time.Second)
	for _, p := range tree {
		for {
			reapZombies()
			if !proc.Exists(p.PID) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("pid %d still exists after the checkpoint of %s", p.PID, m.Name)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	res, err := restore.Run(context.Background(), r.f.env, restore.Options{Image: name, StagingRoot: r.f.stage})
	if err != nil {
		t.Fatalf("restore %s: %v", name, err)
	}
	t.Cleanup(func() { killTree(res.PID); reapZombies() })
}

// TestFaultInjectionRestore kills `ptxmig restore` at random moments.
func TestFaultInjectionRestore(t *testing.T) {
	r := newFaultRig(t)
	f := r.f
	const mib = 1
	p, _ := f.startMiB(t, "state", mib)
	pid := p.PID
	if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: "img", StagingRoot: f.stage}); err != nil {
		t.Fatal(err)
	}
	<-p.Exited()
	// The state file is reset between trials, so that only a restored process can fill it.
	reset := func() {
		if err := os.WriteFile(p.StateFile, []byte(fmt.Sprintf("%-127s\n", "pid 0 step 0 hash 0 done 0")), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	end := func() {
		if err := testproc.KillPID(pid, 10*time.Second); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for proc.Exists(pid) {
			reapZombies()
			if time.Now().After(deadline) {
				t.Fatalf("pid %d not gone", pid)
			}
			time.Sleep(5 * time.Millisecond)
		}
		reset()
	}
	check := func(i int) {
		t.Helper()
		// Whatever runs under the pid must be the program, running and continuing exactly.
		noneStoppedPIDs(t, []int{pid})
		s, err := testproc.WaitState(p.StateFile, func(s testproc.State) bool { return s.PID == pid }, 10*time.Second)
		if err != nil {
			t.Fatalf("trial %d: pid %d exists but does not run the program (half-restored?): %v", i, pid, err)
		}
		now := s.Step
		s, err = testproc.WaitState(p.StateFile, func(s testproc.State) bool { return s.Step >= now+3 }, 10*time.Second)
		if err != nil {
			t.Fatalf("trial %d: restored pid %d does not advance: %v", i, pid, err)
		}
		if err := testproc.NewModel(mib).Check(s); err != nil {
			t.Fatalf("trial %d: %v", i, err)
		}
	}
	var runs []time.Duration
	for range 3 {
		reset()
		t0 := time.Now()
		if out, code := r.cli(t, "restore", "img"); code != 0 {
			t.Fatalf("restore: exit %d\n%s", code, out)
		}
		runs = append(runs, time.Since(t0))
		check(-1)
		end()
	}
	window := r.window(runs)
	trials := faultTrials()
	for i := range trials {
		delay := time.Duration(r.rng.Int64N(int64(window)))
		logs := recoveries()
		killed, code, out := r.killAfter(t, delay, "restore", "img")
		r.settle(t)
		if killed {
			r.counts[killedAt(logs)]++
		}
		switch {
		case !killed && code != 0:
			t.Fatalf("trial %d: ptxmig exited %d before the kill\n%s", i, code, out)
		case !killed:
			r.counts["completed before the kill"]++
		}
		if aliveReaped(pid) {
			r.counts["restored, running"]++
			check(i)
			end()
			continue
		}
		if proc.Exists(pid) {
			t.Fatalf("trial %d: pid %d left as %c", i, pid, proc.State(pid))
		}
		r.counts["rolled back: nothing left"]++
	}
	// The image still restores.
	f.restore(t, "img")
	check(trials)
	end()
	r.finish(t, "restore", trials)
}

// finish checks the store and logs the counts.
func (r *faultRig) finish(t *testing.T, what string, trials int) {
	t.Helper()
	ctx := context.Background()
	ms, err := r.f.st.List()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if rep, err := r.f.st.Verify(ctx, m.Name); err != nil || !rep.OK() {
			t.Errorf("image %s does not verify: %v %+v", m.Name, err, rep)
		}
	}
	gc, err := r.f.st.GC(ctx)
	if err != nil {
		t.Fatalf("gc: %v", err)
	}
	for _, m := range ms {
		if rep, err := r.f.st.Verify(ctx, m.Name); err != nil || !rep.OK() {
			t.Errorf("image %s does not verify after gc: %v %+v", m.Name, err, rep)
		}
	}
	if ents, _ := os.ReadDir(filepath.Join(r.f.st.Dir(), "tmp")); len(ents) != 0 {
		t.Errorf("store temp files after gc: %d", len(ents))
	}
	var parts []string
	for k, v := range r.counts {
		parts = append(parts, fmt.Sprintf("%s %d", k, v))
	}
	slices.Sort(parts)
	t.Logf("%s: %d SIGKILL trials (kills within %s): %s; 0 processes left stopped or half-restored, 0 CRIU left, 0 staging, 0 journals; "+
		"store: %d images verify, gc removed %d temp files and %d chunks", what, trials, r.win.Round(time.Millisecond), strings.Join(parts, ", "),
		len(ms), gc.TempRemoved, gc.ChunksRemoved)
}

// lastReport is the newest recovery report in the log directory.
func lastReport() string {
	dirs, _ := filepath.Glob(filepath.Join(os.Getenv("PTXMIG_LOG_DIR"), "recovered-*"))
	var newest string
	var at time.Time
	for _, d := range dirs {
		if fi, err := os.Stat(d); err == nil && fi.ModTime().After(at) {
			newest, at = d, fi.ModTime()
		}
	}
	b, _ := os.ReadFile(filepath.Join(newest, "report.txt"))
	j, _ := filepath.Glob(filepath.Join(newest, "*.journal"))
	var jb []byte
	if len(j) > 0 {
		jb, _ = os.ReadFile(j[0])
	}
	return string(b) + string(jb)
}

// recoveries lists the recovery reports in the log directory.
func recoveries() map[string]bool {
	dirs, _ := filepath.Glob(filepath.Join(os.Getenv("PTXMIG_LOG_DIR"), "recovered-*"))
	out := map[string]bool{}
	for _, d := range dirs {
		out[d] = true
	}
	return out
}

// killedAt names where a killed operation was, from the journal its recovery kept (new since
// before): "before the journal" when there is none, else the last step begun and the outcome.
func killedAt(before map[string]bool) string {
	for d := range recoveries() {
		if before[d] {
			continue
		}
		js, _ := filepath.Glob(filepath.Join(d, "*"+journal.Ext))
		if len(js) == 0 {
			continue
		}
		b, err := os.ReadFile(js[0])
		if err != nil {
			continue
		}
		st, err := journal.Parse(b, filepath.Base(js[0]))
		if err != nil {
			return "invalid journal"
		}
		step := "before the first step"
		if n := len(st.Steps); n > 0 {
			s := st.Steps[n-1]
			step = "during " + s.Name
			if s.Done {
				step = "after " + s.Name
			}
		}
		rep, _ := os.ReadFile(filepath.Join(d, "report.txt"))
		outcome := "?"
		if _, rest, ok := strings.Cut(string(rep), ": ptxmig died before it ended.\nrecovered by "); ok {
			if _, o, ok := strings.Cut(strings.SplitN(rest, "\n", 2)[0], ": "); ok {
				outcome = o
			}
		}
		return "killed " + step + " → " + outcome
	}
	return "killed before the journal or its first step"
}

// stopAfter runs ptxmig with op.FaultStopAfter set to step, waits for it to stop itself there,
// and kills it.
func (r *faultRig) stopAfter(t *testing.T, step string, args ...string) {
	t.Helper()
	cmd := exec.Command(r.bin, append([]string{"--store", r.f.st.Dir()}, args...)...)
	exited, _ := startStopped(t, cmd, step, 30*time.Second)
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-exited
	r.settle(t)
}

// startStopped starts cmd (its environment, or os.Environ() when unset, plus op.FaultStopAfter
// naming step) and waits up to within for it to stop itself after that step. It returns a
// channel closed once cmd has exited (reaped), and cmd's output so far (stdout and stderr).
func startStopped(t *testing.T, cmd *exec.Cmd, step string, within time.Duration) (<-chan struct{}, *bytes.Buffer) {
	t.Helper()
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = append(cmd.Env, op.FaultStopAfter+"="+step)
	out := &bytes.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	for deadline := time.Now().Add(within); ; time.Sleep(2 * time.Millisecond) {
		if s, err := proc.ReadStat(cmd.Process.Pid); err == nil && s.Stopped() {
			return exited, out
		}
		select {
		case <-exited:
			t.Fatalf("%s exited before stopping after %s:\n%s", filepath.Base(cmd.Path), step, out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not stop after %s within %s", filepath.Base(cmd.Path), step, within)
		}
	}
}

// TestGuardianAfterEachStep kills ptxmig right after each step of a checkpoint and of a restore
// (it stops itself there: op.FaultStopAfter): before the store commits, the guardian resumes the
// process; after, the checkpoint is finished (the process ends, its image restores); a restore
// killed after its CRIU step (its commit) runs on.
func TestGuardianAfterEachStep(t *testing.T) {
	r := newFaultRig(t)
	f := r.f
	p, m := f.startMiB(t, "state", 1)
	pid := p.PID
	for _, step := range []string{checkpoint.StepDump, checkpoint.StepStore, checkpoint.StepFinish} {
		name := "after-" + step
		before, _ := testproc.ReadState(p.StateFile)
		r.stopAfter(t, step, "checkpoint", "--name", name, strconv.Itoa(pid))
		_, gerr := f.st.Get(name)
		alive := aliveReaped(pid)
		if step == checkpoint.StepDump {
			if !alive || gerr == nil {
				t.Fatalf("killed after the dump: alive %v, image %v; want the process running, no image\n%s", alive, gerr, lastReport())
			}
			noneStoppedPIDs(t, []int{pid})
			advancesExactly(t, p.StateFile, m, before.Step, 3)
			continue
		}
		if alive || gerr != nil {
			t.Fatalf("killed after %s (committed): alive %v, image %v; want the process ended, the image stored\n%s", step, alive, gerr, lastReport())
		}
		at, _ := testproc.ReadState(p.StateFile)
		for proc.Exists(pid) {
			reapZombies()
			time.Sleep(5 * time.Millisecond)
		}
		// Restore it with ptxmig killed after its CRIU step (the restore's commit).
		r.stopAfter(t, restore.StepCRIURestore, "restore", name)
		if !aliveReaped(pid) {
			t.Fatalf("restore killed after its commit: pid %d does not run\n%s", pid, lastReport())
		}
		noneStoppedPIDs(t, []int{pid})
		advancesExactly(t, p.StateFile, m, at.Step, 3)
	}
	t.Cleanup(func() { _ = testproc.KillPID(pid, 10*time.Second); reapZombies() })
	t.Logf("killed after dump (rolled back: running on), after store and after finish (finished: image stored, " +
		"restored by a restore killed after its CRIU step, which ran on): every outcome as expected")
}

// TestGuardianSurvivesGroupKill: ptxmig runs in a cgroup of its own (as a service does) and the
// whole cgroup is killed right after CRIU's dump (cgroup.kill: systemctl stop or kill, an OOM
// group kill): ptxmig and everything else of that cgroup die, but its guardian, started in
// proc.KeepCgroup, resumes the stopped process. (Started in ptxmig's cgroup, it died with it and
// the process stayed stopped until `ptxmig recover`.)
func TestGuardianSurvivesGroupKill(t *testing.T) {
	r := newFaultRig(t)
	f := r.f
	svc, svcFD := testproc.ServiceCgroup(t)
	p, m := f.startMiB(t, "state", 1)
	pid := p.PID
	t.Cleanup(func() { _ = testproc.KillPID(pid, 10*time.Second); reapZombies() })
	before, _ := testproc.ReadState(p.StateFile)
	cmd := exec.Command(r.bin, "--store", f.st.Dir(), "checkpoint", "--name", "group-kill", strconv.Itoa(pid))
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: svcFD}
	exited, _ := startStopped(t, cmd, checkpoint.StepDump, 30*time.Second)
	if s, err := proc.ReadStat(pid); err != nil || !s.Stopped() {
		t.Fatalf("after the dump the process is %+v (%v), want stopped", s, err)
	}
	if err := testproc.KillCgroup(svc); err != nil {
		t.Fatal(err)
	}
	<-exited
	// The guardian alone must roll it back: no `ptxmig recover` here (settle would run one).
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		reapZombies()
		js, err := journal.List(r.journal)
		if err != nil {
			t.Fatal(err)
		}
		guardians := liveGuardians()
		if len(js) == 0 && guardians == 0 {
			break
		}
		if guardians == 0 {
			t.Fatalf("ptxmig's cgroup killed after the dump: no guardian left and the journal %v is still there (the guardian died with the cgroup)", js)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the guardian did not finish within 60 s (journals %v)", js)
		}
	}
	if _, err := f.st.Get("group-kill"); err == nil || !aliveReaped(pid) {
		t.Fatalf("ptxmig's cgroup killed after the dump: image %v, alive %v; want the process running, no image\n%s", err, aliveReaped(pid), lastReport())
	}
	noneStoppedPIDs(t, []int{pid})
	advancesExactly(t, p.StateFile, m, before.Step, 3)
}
