package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/rebalance"
)

// fakeFleet: GPU 0 runs two busy processes, GPU 1 nothing; migrations succeed.
type fakeFleet struct {
	place map[int]string
	moves []rebalance.Move
}

const (
	uuid0 = "GPU-00000000-0000-0000-0000-000000000000"
	uuid1 = "GPU-11111111-1111-1111-1111-111111111111"
)

func (f *fakeFleet) Observe(ctx context.Context, window time.Duration) (rebalance.Observation, error) {
	now := time.Now()
	busy := map[string]float64{}
	for _, u := range f.place {
		busy[u] += 0.5
	}
	o := rebalance.Observation{Time: now, Window: window}
	for i, u := range []string{uuid0, uuid1} {
		o.GPUs = append(o.GPUs, rebalance.GPU{Index: i, UUID: u, Name: "NVIDIA H200", ComputeCap: "9.0",
			MemTotal: 141 << 30, MemUsed: 4 << 30, Util: busy[u], PowerW: 100 + 500*busy[u], PowerLimitW: 700})
	}
	for _, pid := range []int{4242, 4243} {
		o.Procs = append(o.Procs, rebalance.Process{PID: pid, GPUs: []string{f.place[pid]}, MemBytes: 1 << 30, MemKnown: true,
			Util: 0.5, UtilKnown: true, Comm: "counter", StartTicks: uint64(pid), StartTime: now.Add(-time.Hour), EnvKnown: true})
	}
	return o, nil
}

func (f *fakeFleet) Locate(ctx context.Context, pid int) (rebalance.Location, error) {
	return rebalance.Location{Alive: true, GPUs: []string{f.place[pid]}}, nil
}

func (f *fakeFleet) Migrate(ctx context.Context, m rebalance.Move, lt time.Duration) error {
	f.moves = append(f.moves, m)
	f.place[m.PID] = m.To.UUID
	return nil
}

func withFleet(t *testing.T) *fakeFleet {
	f := &fakeFleet{place: map[int]string{4242: uuid0, 4243: uuid0}}
	oo, om := newRebalanceObserver, newRebalanceMigrator
	newRebalanceObserver = func() (rebalance.Observer, func(), error) { return f, func() {}, nil }
	newRebalanceMigrator = func() rebalance.Migrator { return f }
	t.Cleanup(func() { newRebalanceObserver, newRebalanceMigrator = oo, om })
	return f
}

func TestRebalanceCommand(t *testing.T) {
	f := withFleet(t)
	store := t.TempDir()
	out, stderr, code := runCLI(t, "--store", store, "rebalance", "--dry-run", "--window", "0s")
	if code != 0 || !strings.Contains(out, "dry run: 1 move(s) planned, nothing moved") ||
		!strings.Contains(out, "pid 4242 (counter) on GPU 0, 50% of it, 1024 MiB: moves: move to GPU 1") ||
		!strings.Contains(out, "pid 4243 (counter) on GPU 0, 50% of it, 1024 MiB: stays: GPU 0, predicted at 50% after the planned move(s)") || len(f.moves) != 0 {
		t.Fatalf("dry run: exit %d\n%s%s", code, out, stderr)
	}

	metrics := filepath.Join(t.TempDir(), "rebalance.prom")
	out, stderr, code = runCLI(t, "--store", store, "--json", "rebalance", "--window", "0s", "--metrics-file", metrics)
	var rep rebalance.Report
	if code != 0 || json.Unmarshal([]byte(out), &rep) != nil || rep.Moved != 1 || len(f.moves) != 1 || f.place[4242] != uuid1 {
		t.Fatalf("run: exit %d moves %v\n%s%s", code, f.moves, out, stderr)
	}
	if b, err := os.ReadFile(metrics); err != nil || !strings.Contains(string(b), "ptxmig_rebalance_moves_total 1\n") {
		t.Errorf("metrics file: %v\n%s", err, b)
	}
	if fi, err := os.Stat(filepath.Join(store, "rebalance", "state.json")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("state file: %v", err)
	}

	// An immediate second run moves nothing.
	out, _, code = runCLI(t, "--store", store, "rebalance", "--window", "0s")
	if code != 0 || !strings.Contains(out, "no move needed") || len(f.moves) != 1 {
		t.Errorf("second run: exit %d\n%s", code, out)
	}
}

func TestRebalancePolicyAndFlags(t *testing.T) {
	withFleet(t)
	store := t.TempDir()
	pol := filepath.Join(t.TempDir(), "policy.json")
	os.WriteFile(pol, []byte(`{"busy_threshold": 90, "max_moves": 3, "pin": {"pids": [4243]}}`), 0o600)
	out, stderr, code := runCLI(t, "--store", store, "--json", "rebalance", "--dry-run", "--window", "0s",
		"--policy", pol, "--busy-threshold", "40", "--pin", "4242")
	var rep rebalance.Report
	if code != 0 || json.Unmarshal([]byte(out), &rep) != nil {
		t.Fatalf("exit %d\n%s%s", code, out, stderr)
	}
	if rep.Policy.BusyThreshold != 40 || rep.Policy.MaxMoves != 3 || len(rep.Policy.Pin.PIDs) != 2 || len(rep.Plan.Moves) != 0 {
		t.Errorf("flags must override the file and add pins: %+v, moves %v", rep.Policy, rep.Plan.Moves)
	}

	os.WriteFile(pol, []byte(`{"busy_threshold": "high"}`), 0o600)
	for _, args := range [][]string{
		{"rebalance", "--policy", pol},
		{"rebalance", "--max-moves", "0"},
		{"rebalance", "--pin-name", "[x"},
		{"rebalance", "extra"},
		{"rebalance", "--policy", filepath.Join(t.TempDir(), "missing.json")},
	} {
		if _, stderr, code := runCLI(t, append([]string{"--store", store}, args...)...); code != 2 {
			t.Errorf("%v: exit %d, want 2 (%s)", args, code, stderr)
		}
	}
}

func TestRebalanceBusy(t *testing.T) {
	f := withFleet(t)
	store := t.TempDir()
	dir := filepath.Join(store, "rebalance")
	if err := rebalance.EnsureDir(dir); err != nil {
		t.Fatal(err)
	}
	l, err := rebalance.TryLock(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Unlock()
	out, _, code := runCLI(t, "--store", store, "rebalance", "--window", "0s")
	if code != 0 || !strings.Contains(out, "another ptxmig rebalance run is active (pid ") || len(f.moves) != 0 {
		t.Errorf("overlapping run: exit %d %q", code, out)
	}
	out, _, code = runCLI(t, "--store", store, "--json", "rebalance", "--window", "0s")
	if code != 0 || !strings.Contains(out, `"busy": true`) {
		t.Errorf("overlapping run, JSON: exit %d %q", code, out)
	}
}
