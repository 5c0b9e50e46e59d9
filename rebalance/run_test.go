package rebalance

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fakeNode is an Observer and a Migrator over a synthetic fleet: moves change where processes
// are, and failures can be injected.
type fakeNode struct {
	obs        Observation
	place      map[int]string // pid -> GPU UUID reported by Locate
	migrated   []Move
	failPID    int           // Migrate fails for this PID
	strayPID   int           // Migrate "succeeds" but the process stays on its source
	takes      time.Duration // how long a migration takes on the fake clock
	clock      *fakeClock
	observeErr error
}

func (n *fakeNode) Observe(ctx context.Context, window time.Duration) (Observation, error) {
	if n.observeErr != nil {
		return Observation{}, n.observeErr
	}
	n.clock.Sleep(ctx, window)
	o := n.obs
	o.Time = n.clock.Now()
	o.Procs = nil
	for _, p := range n.obs.Procs {
		p.GPUs = []string{n.place[p.PID]}
		o.Procs = append(o.Procs, p)
	}
	return o, nil
}

func (n *fakeNode) Locate(ctx context.Context, pid int) (Location, error) {
	u, ok := n.place[pid]
	if !ok {
		return Location{}, nil
	}
	return Location{Alive: true, GPUs: []string{u}}, nil
}

var errDriver = errors.New("cuCheckpointProcessRestore: CUDA_ERROR_OUT_OF_MEMORY (rolled back onto the source GPU)")

func (n *fakeNode) Migrate(ctx context.Context, m Move, lockTimeout time.Duration) error {
	n.migrated = append(n.migrated, m)
	n.clock.Sleep(ctx, n.takes)
	switch m.PID {
	case n.failPID:
		return errDriver
	case n.strayPID:
		return nil
	}
	n.place[m.PID] = m.To.UUID
	return nil
}

// hotNode: GPU 0 runs two busy processes, GPU 1 none.
func hotNode() *fakeNode {
	c := &fakeClock{t: t0}
	return &fakeNode{
		clock: c, takes: 3 * time.Second,
		obs: Observation{Window: 5 * time.Second,
			GPUs:  []GPU{h200(0, 1, 680, 8), h200(1, 0, 90, 1)},
			Procs: []Process{procOn(10, 0, 0.5, 2), procOn(11, 0, 0.5, 3)}},
		place: map[int]string{10: uuidOf(0), 11: uuidOf(0)},
	}
}

func runner(dir string, n *fakeNode, dry bool) *Runner {
	return &Runner{Dir: dir, Policy: DefaultPolicy(), DryRun: dry, Observer: n, Migrator: n, Clock: n.clock, Log: quiet()}
}

func TestRunMovesOneThenRests(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "rebalance")
	n := hotNode()
	rep, err := runner(dir, n, false).Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if rep.Moved != 1 || rep.Failed != 0 || len(n.migrated) != 1 || n.migrated[0].PID != 10 || n.place[10] != uuidOf(1) {
		t.Fatalf("first run: moved %d, migrated %+v", rep.Moved, n.migrated)
	}
	if r := rep.Results[0]; !r.OK || r.Seconds != 3 || r.Location.GPUs[0] != uuidOf(1) {
		t.Errorf("result %+v", r)
	}
	if rep.Durations["observe"] != 5 || rep.Durations["migrate"] != 3 || rep.Durations["total"] != 8 {
		t.Errorf("durations %v", rep.Durations)
	}
	st, _, _ := LoadState(dir, t0, false, quiet())
	if len(st.History) != 1 || !st.History[0].OK || st.History[0].PID != 10 || st.Totals.Moves != 1 || st.Totals.Runs != 1 {
		t.Errorf("state after the move: %+v", st)
	}

	// Second run right away: the loads are now even (GPU 0 and GPU 1 each run one process).
	n.obs.GPUs = []GPU{h200(0, 1, 680, 5), h200(1, 1, 680, 3)}
	n.obs.Procs = []Process{procOn(10, 1, 1, 2), procOn(11, 0, 1, 3)}
	rep, err = runner(dir, n, false).Run(context.Background())
	if err != nil || rep.Moved != 0 || len(n.migrated) != 1 {
		t.Fatalf("second run: %v, moved %d", err, rep.Moved)
	}
	if d := decisionFor(rep.Plan, 10); !strings.Contains(d.Reason, "cooldown") {
		t.Errorf("moved process: %q, want cooldown", d.Reason)
	}
	st, _, _ = LoadState(dir, t0, false, quiet())
	if st.Totals.Runs != 2 || st.Totals.Moves != 1 || st.Totals.LastSuccess.IsZero() {
		t.Errorf("totals %+v", st.Totals)
	}
}

func TestRunDryRunTouchesNothing(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "rebalance")
	n := hotNode()
	r := runner(dir, n, true)
	r.Migrator = nil
	rep, err := r.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Plan.Moves) != 1 || rep.Moved != 0 || len(n.migrated) != 0 || n.place[10] != uuidOf(0) {
		t.Errorf("dry run moved: %+v", rep)
	}
	if _, err := os.Stat(filepath.Join(dir, StateFile)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("dry run wrote state: %v", err)
	}
	if d := decisionFor(rep.Plan, 11); d.Reason == "" || d.Move {
		t.Errorf("dry run does not explain pid 11: %+v", d)
	}
}

func TestRunStopsAtFirstFailure(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "rebalance")
	n := hotNode()
	n.obs.GPUs = append(n.obs.GPUs, h200(2, 0, 90, 1))
	n.obs.Procs = append(n.obs.Procs, procOn(12, 0, 0.3, 4))
	n.place[12] = uuidOf(0)
	n.failPID = 10
	r := runner(dir, n, false)
	r.Policy.MaxMoves = 3
	r.Policy.BusyThreshold = 40
	rep, err := r.Run(context.Background())
	if !errors.Is(err, ErrMoveFailed) || !errors.Is(err, errDriver) {
		t.Fatalf("err %v, want ErrMoveFailed wrapping the migrator's error", err)
	}
	if len(rep.Plan.Moves) < 2 || len(n.migrated) != 1 || rep.Failed != 1 || rep.Moved != 0 || rep.Error == "" {
		t.Fatalf("planned %d, attempted %d, report %+v", len(rep.Plan.Moves), len(n.migrated), rep.Results)
	}
	if loc := rep.Results[0].Location; !loc.Alive || loc.GPUs[0] != uuidOf(0) {
		t.Errorf("failed move: process found at %+v, want alive on its source", loc)
	}
	st, _, _ := LoadState(dir, t0, false, quiet())
	if st.Totals.Failures != 1 || len(st.History) != 1 || st.History[0].OK || !strings.Contains(st.History[0].Error, "OUT_OF_MEMORY") || !st.Totals.LastSuccess.IsZero() {
		t.Errorf("state after failure: %+v", st)
	}
	// The failed attempt counts for the cooldown: the next run does not retry it at once.
	n.failPID = 0
	rep, _ = runner(dir, n, false).Run(context.Background())
	if d := decisionFor(rep.Plan, 10); !strings.Contains(d.Reason, "cooldown") {
		t.Errorf("retry right after a failure: %q", d.Reason)
	}
}

func TestRunVerifiesTheTarget(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "rebalance")
	n := hotNode()
	n.strayPID = 10
	r := runner(dir, n, false)
	r.VerifyTimeout = 2 * time.Second
	rep, err := r.Run(context.Background())
	if !errors.Is(err, ErrVerify) || rep.Moved != 0 || rep.Failed != 1 {
		t.Fatalf("err %v moved %d failed %d", err, rep.Moved, rep.Failed)
	}
	// The process vanishing counts as a failure too.
	n = hotNode()
	n.strayPID = 10
	delete(n.place, 10)
	n.place[10] = uuidOf(0)
	m := &vanishing{fakeNode: n}
	r = runner(filepath.Join(t.TempDir(), "r"), n, false)
	r.Migrator = m
	if _, err := r.Run(context.Background()); !errors.Is(err, ErrVerify) || !strings.Contains(err.Error(), "gone") {
		t.Errorf("vanished process: %v", err)
	}
}

type vanishing struct{ *fakeNode }

func (v *vanishing) Migrate(ctx context.Context, m Move, lt time.Duration) error {
	delete(v.place, m.PID)
	return nil
}

func TestRunBusyAndRefusals(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "rebalance")
	if err := EnsureDir(dir); err != nil {
		t.Fatal(err)
	}
	l, err := TryLock(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := hotNode()
	if rep, err := runner(dir, n, false).Run(context.Background()); !errors.Is(err, ErrBusy) || rep != nil || len(n.migrated) != 0 {
		t.Errorf("overlapping run: %v", err)
	}
	l.Unlock()

	r := runner(dir, n, false)
	r.Migrator = nil
	if _, err := r.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "no migrator") {
		t.Errorf("no migrator: %v", err)
	}
	r = runner(dir, n, false)
	r.Policy.MaxMoves = 0
	if _, err := r.Run(context.Background()); !errors.Is(err, ErrBadPolicy) {
		t.Errorf("bad policy: %v", err)
	}
	n.observeErr = errors.New("nvml: GPU is lost")
	rep, err := runner(dir, n, false).Run(context.Background())
	if err == nil || rep == nil || !strings.Contains(rep.Error, "GPU is lost") {
		t.Errorf("observe failure: %v %+v", err, rep)
	}
}
