package rebalance

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

const gib = 1 << 30

// gpuOf builds a GPU: index, chip name, utilization (0..1), power draw (W), memory used (GiB).
func gpuOf(i int, name string, util, powerW, usedGiB float64) GPU {
	return GPU{Index: i, UUID: fmt.Sprintf("GPU-%08d-0000-0000-0000-000000000000", i), Name: name, ComputeCap: "9.0",
		MemTotal: 141 * gib, MemUsed: uint64(usedGiB * gib), Util: util, PowerW: powerW, PowerLimitW: 700, Samples: 20}
}

func h200(i int, util, powerW, usedGiB float64) GPU {
	return gpuOf(i, "NVIDIA H200", util, powerW, usedGiB)
}

// procOn builds a process an hour old, on GPU gpu, with a known utilization share and memory.
func procOn(pid, gpu int, util, memGiB float64) Process {
	return Process{PID: pid, GPUs: []string{fmt.Sprintf("GPU-%08d-0000-0000-0000-000000000000", gpu)},
		MemBytes: uint64(memGiB * gib), MemKnown: true, Util: util, UtilKnown: true,
		Comm: fmt.Sprintf("worker%d", pid), Cmdline: []string{"/opt/app/worker", "--id", fmt.Sprint(pid)},
		StartTicks: uint64(pid) * 1000, StartTime: t0.Add(-time.Hour), EnvKnown: true}
}

func uuidOf(i int) string { return fmt.Sprintf("GPU-%08d-0000-0000-0000-000000000000", i) }

func decisionFor(p Plan, pid int) Decision {
	for _, d := range p.Decisions {
		if d.PID == pid {
			return d
		}
	}
	return Decision{Reason: "<no decision>"}
}

func TestMakePlan(t *testing.T) {
	type want struct {
		moves   []string       // "pid:from->to"
		reasons map[int]string // pid -> substring of its reason
	}
	mod := func(p Process, f func(*Process)) Process { f(&p); return p }
	pol := func(f func(*Policy)) Policy { p := DefaultPolicy(); f(&p); return p }
	tests := []struct {
		name    string
		gpus    []GPU
		procs   []Process
		policy  Policy
		history []MoveRecord
		want    want
	}{
		{
			name:   "balanced busy fleet: no moves",
			gpus:   []GPU{h200(0, 0.8, 500, 20), h200(1, 0.8, 500, 20)},
			procs:  []Process{procOn(10, 0, 0.8, 10), procOn(11, 1, 0.8, 10)},
			policy: DefaultPolicy(),
			want:   want{reasons: map[int]string{10: "not above min-improvement", 11: "not above min-improvement"}},
		},
		{
			name:   "balanced idle fleet: below threshold",
			gpus:   []GPU{h200(0, 0.5, 300, 20), h200(1, 0.45, 300, 20)},
			procs:  []Process{procOn(10, 0, 0.5, 10), procOn(11, 1, 0.45, 10)},
			policy: DefaultPolicy(),
			want:   want{reasons: map[int]string{10: "below the busy threshold 70%"}},
		},
		{
			name: "one hot GPU: one move to the coolest same-type GPU with room",
			gpus: []GPU{h200(0, 0.95, 650, 40), h200(1, 0.4, 350, 20), h200(2, 0.05, 90, 2), h200(3, 0.3, 250, 10)},
			procs: []Process{procOn(10, 0, 0.5, 20), procOn(11, 0, 0.45, 20), procOn(12, 1, 0.4, 20),
				procOn(13, 2, 0.05, 2), procOn(14, 3, 0.3, 10)},
			policy: DefaultPolicy(),
			want: want{moves: []string{"11:0->2"}, reasons: map[int]string{
				10: "predicted at 50% after the planned move(s), is below the busy threshold", 12: "GPU 1 at 40% is below the busy threshold", 13: "below the busy threshold"}},
		},
		{
			name: "a job's ranks are left alone (one session), a process alone in its session moves",
			gpus: []GPU{h200(0, 0.95, 650, 40), h200(1, 0.05, 90, 2), h200(2, 0.05, 90, 2)},
			procs: []Process{mod(procOn(10, 0, 0.5, 20), func(p *Process) { p.Session = 7 }), mod(procOn(11, 0, 0.45, 20), func(p *Process) { p.Session = 7 }),
				mod(procOn(12, 0, 0.4, 10), func(p *Process) { p.Session = 9 })},
			policy: DefaultPolicy(),
			want: want{moves: []string{"12:0->1"}, reasons: map[int]string{
				10: "one of a job's 2 CUDA processes (session 7: pids 10, 11)", 11: "a job is moved whole or not at all"}},
		},
		{
			name:   "mixed chip types never cross",
			gpus:   []GPU{h200(0, 0.95, 650, 40), gpuOf(1, "NVIDIA A100-SXM4-80GB", 0, 60, 1)},
			procs:  []Process{procOn(10, 0, 0.5, 20), procOn(11, 0, 0.45, 20)},
			policy: DefaultPolicy(),
			want:   want{reasons: map[int]string{10: "no other GPU of chip type NVIDIA H200", 11: "no other GPU of chip type"}},
		},
		{
			name: "mixed chip types: the idle other chip is ignored, the same chip is used",
			gpus: []GPU{h200(0, 0.95, 650, 40), gpuOf(1, "NVIDIA A100-SXM4-80GB", 0, 60, 1), h200(2, 0.3, 250, 10)},
			procs: []Process{procOn(10, 0, 0.5, 20), procOn(11, 0, 0.45, 20),
				procOn(12, 2, 0.3, 10)},
			policy: DefaultPolicy(),
			want:   want{moves: []string{"11:0->2"}},
		},
		{
			name:   "compute capability is part of the chip type",
			gpus:   []GPU{h200(0, 0.95, 650, 40), func() GPU { g := h200(1, 0, 90, 1); g.ComputeCap = "9.1"; return g }()},
			procs:  []Process{procOn(10, 0, 0.5, 20), procOn(11, 0, 0.45, 20)},
			policy: DefaultPolicy(),
			want:   want{reasons: map[int]string{10: "no other GPU of chip type"}},
		},
		{
			name: "memory margin respected: the idle GPU lacks room, the warmer one has it",
			// Process needs 60 GiB + 1 GiB margin. GPU 1 has 60.5 GiB free, GPU 2 exactly 61.
			gpus:   []GPU{h200(0, 0.95, 650, 100), h200(1, 0, 90, 80.5), h200(2, 0.2, 200, 80)},
			procs:  []Process{procOn(10, 0, 0.5, 60), procOn(11, 0, 0.45, 35), procOn(12, 1, 0, 80), procOn(13, 2, 0.2, 80)},
			policy: pol(func(p *Policy) { p.Pin.PIDs = []int{11} }),
			want:   want{moves: []string{"10:0->2"}},
		},
		{
			name:   "memory margin respected: no GPU has room",
			gpus:   []GPU{h200(0, 0.95, 650, 100), h200(1, 0, 90, 80.5)},
			procs:  []Process{procOn(10, 0, 0.95, 60)},
			policy: DefaultPolicy(),
			want:   want{reasons: map[int]string{10: "no NVIDIA H200 (sm 9.0) GPU with room for 61440 MiB + 1024 MiB margin (most free: GPU 1, 61952 MiB)"}},
		},
		{
			name:   "memory margin is configurable",
			gpus:   []GPU{h200(0, 0.95, 650, 100), h200(1, 0, 90, 80.5)},
			procs:  []Process{procOn(10, 0, 0.5, 60), procOn(11, 0, 0.45, 40)},
			policy: pol(func(p *Policy) { p.MemoryMarginMiB = 256; p.Pin.PIDs = []int{11} }),
			want:   want{moves: []string{"10:0->1"}},
		},
		{
			name: "pins: PID list, name pattern, PTXMIG_PIN=1, unreadable environment",
			gpus: []GPU{h200(0, 1, 680, 60), h200(1, 0, 90, 1)},
			procs: []Process{
				procOn(10, 0, 0.2, 5),
				mod(procOn(11, 0, 0.2, 5), func(p *Process) { p.Comm = "trainer"; p.Cmdline = []string{"/usr/bin/python3", "train.py"} }),
				mod(procOn(12, 0, 0.2, 5), func(p *Process) { p.EnvPin = true }),
				mod(procOn(13, 0, 0.2, 5), func(p *Process) { p.EnvKnown = false }),
				mod(procOn(14, 0, 0.2, 5), func(p *Process) { p.Comm = "x"; p.Cmdline = []string{"/opt/bin/serve-llm"} }),
			},
			policy: pol(func(p *Policy) { p.Pin.PIDs = []int{10}; p.Pin.Names = []string{"train*", "serve-*"} }),
			want: want{reasons: map[int]string{
				10: "pinned by PID", 11: `pinned by name pattern "train*"`, 12: "PTXMIG_PIN=1",
				13: "environment unreadable", 14: `pinned by name pattern "serve-*"`}},
		},
		{
			name: "pins leave the others movable",
			gpus: []GPU{h200(0, 1, 680, 60), h200(1, 0, 90, 1)},
			procs: []Process{mod(procOn(10, 0, 0.5, 5), func(p *Process) { p.EnvPin = true }),
				procOn(11, 0, 0.5, 8)},
			policy: DefaultPolicy(),
			want:   want{moves: []string{"11:0->1"}, reasons: map[int]string{10: "PTXMIG_PIN=1"}},
		},
		{
			name: "ages: younger than min-age stays, unknown age stays",
			gpus: []GPU{h200(0, 1, 680, 60), h200(1, 0, 90, 1)},
			procs: []Process{mod(procOn(10, 0, 0.5, 5), func(p *Process) { p.StartTime = t0.Add(-30 * time.Second) }),
				mod(procOn(11, 0, 0.5, 5), func(p *Process) { p.StartTime = time.Time{} })},
			policy: DefaultPolicy(),
			want:   want{reasons: map[int]string{10: "too young: age 30s < min-age 1m0s", 11: "age unknown"}},
		},
		{
			name:   "ages: min-age 0 moves a young process",
			gpus:   []GPU{h200(0, 1, 680, 60), h200(1, 0, 90, 1)},
			procs:  []Process{mod(procOn(10, 0, 0.5, 5), func(p *Process) { p.StartTime = t0.Add(-time.Second) }), procOn(11, 0, 0.5, 9)},
			policy: pol(func(p *Policy) { p.MinAge = 0 }),
			want:   want{moves: []string{"10:0->1"}},
		},
		{
			name:   "cooldown: moved 5 minutes ago",
			gpus:   []GPU{h200(0, 1, 680, 60), h200(1, 0, 90, 1)},
			procs:  []Process{procOn(10, 0, 0.5, 5), procOn(11, 0, 0.5, 5)},
			policy: DefaultPolicy(),
			history: []MoveRecord{
				{PID: 10, StartTicks: 10000, From: uuidOf(2), To: uuidOf(0), At: t0.Add(-5 * time.Minute), OK: true},
				{PID: 11, StartTicks: 11000, From: uuidOf(2), To: uuidOf(0), At: t0.Add(-6 * time.Minute), OK: false},
			},
			want: want{reasons: map[int]string{10: "cooldown: last move 5m0s ago, cooldown 10m0s after 1 move(s)", 11: "cooldown: last move 6m0s ago"}},
		},
		{
			name:   "cooldown: expired after 11 minutes; a reused PID is a new process",
			gpus:   []GPU{h200(0, 1, 680, 60), h200(1, 0, 90, 1)},
			procs:  []Process{procOn(10, 0, 0.5, 5), procOn(11, 0, 0.5, 6)},
			policy: DefaultPolicy(),
			history: []MoveRecord{
				{PID: 10, StartTicks: 10000, From: uuidOf(2), To: uuidOf(0), At: t0.Add(-11 * time.Minute), OK: true},
				{PID: 11, StartTicks: 999, From: uuidOf(2), To: uuidOf(0), At: t0.Add(-1 * time.Minute), OK: true},
			},
			want: want{moves: []string{"10:0->1"}},
		},
		{
			name:   "cooldown doubles with each move",
			gpus:   []GPU{h200(0, 1, 680, 60), h200(1, 0, 90, 1)},
			procs:  []Process{procOn(10, 0, 0.5, 5), procOn(11, 0, 0.5, 5)},
			policy: pol(func(p *Policy) { p.Pin.PIDs = []int{11} }),
			history: []MoveRecord{
				{PID: 10, StartTicks: 10000, From: uuidOf(2), To: uuidOf(3), At: t0.Add(-3 * time.Hour), OK: true},
				{PID: 10, StartTicks: 10000, From: uuidOf(3), To: uuidOf(0), At: t0.Add(-15 * time.Minute), OK: true},
			},
			want: want{reasons: map[int]string{10: "cooldown 20m0s after 2 move(s)"}},
		},
		{
			name:   "no return to a GPU the process left within the return window",
			gpus:   []GPU{h200(0, 1, 680, 60), h200(1, 0, 90, 1)},
			procs:  []Process{procOn(10, 0, 0.5, 5), procOn(11, 0, 0.5, 5)},
			policy: pol(func(p *Policy) { p.Pin.PIDs = []int{11} }),
			history: []MoveRecord{
				{PID: 10, StartTicks: 10000, From: uuidOf(1), To: uuidOf(0), At: t0.Add(-2 * time.Hour), OK: true},
			},
			want: want{reasons: map[int]string{10: "would return to GPU 1, which it left 2h0m0s ago (return window 24h0m0s)"}},
		},
		{
			name: "max-moves 2: the second move goes to the next coolest GPU",
			gpus: []GPU{h200(0, 1, 680, 60), h200(1, 0, 90, 1), h200(2, 0.05, 100, 1)},
			procs: func() []Process {
				ps := []Process{procOn(9, 2, 0.05, 1)}
				for i := 0; i < 10; i++ { // ten processes of 10% each
					ps = append(ps, procOn(10+i, 0, 0.1, float64(5+i)))
				}
				return ps
			}(),
			policy: pol(func(p *Policy) { p.MaxMoves = 2 }),
			want:   want{moves: []string{"10:0->1", "11:0->2"}, reasons: map[int]string{12: "max-moves 2 reached"}},
		},
		{
			name: "multi-GPU process stays; idle process on a hot GPU stays",
			gpus: []GPU{h200(0, 1, 680, 60), h200(1, 0, 90, 1)},
			procs: []Process{mod(procOn(10, 0, 0.9, 5), func(p *Process) { p.GPUs = []string{uuidOf(0), uuidOf(1)} }),
				procOn(11, 0, 0, 5)},
			policy: DefaultPolicy(),
			want:   want{reasons: map[int]string{10: "uses 2 GPUs", 11: "idle on GPU 0"}},
		},
		{
			name: "unknown utilization shares are estimated evenly",
			gpus: []GPU{h200(0, 0.9, 600, 60), h200(1, 0, 90, 1)},
			procs: []Process{mod(procOn(10, 0, 0, 5), func(p *Process) { p.UtilKnown = false }),
				mod(procOn(11, 0, 0, 4), func(p *Process) { p.UtilKnown = false })},
			policy: DefaultPolicy(),
			want:   want{moves: []string{"11:0->1"}},
		},
		{
			name:   "power breaks a load tie: the cooler-drawing GPU wins",
			gpus:   []GPU{h200(0, 1, 690, 60), h200(1, 0.1, 420, 1), h200(2, 0.1, 110, 1)},
			procs:  []Process{procOn(10, 0, 0.5, 5), procOn(11, 0, 0.5, 6), procOn(12, 1, 0.1, 1), procOn(13, 2, 0.1, 1)},
			policy: DefaultPolicy(),
			want:   want{moves: []string{"10:0->2"}},
		},
		{
			name:   "small gains are not worth a move",
			gpus:   []GPU{h200(0, 0.75, 500, 60), h200(1, 0.65, 450, 1)},
			procs:  []Process{procOn(10, 0, 0.05, 5), procOn(11, 0, 0.7, 5), procOn(12, 1, 0.65, 1)},
			policy: DefaultPolicy(),
			want:   want{reasons: map[int]string{10: "not above min-improvement 0.050", 11: "scores -"}},
		},
		{
			name: "require_shim leaves plain processes alone",
			gpus: []GPU{h200(0, 1, 680, 60), h200(1, 0, 90, 1)},
			procs: []Process{procOn(10, 0, 0.5, 5),
				mod(procOn(11, 0, 0.5, 9), func(p *Process) { p.UnderShim = true })},
			policy: pol(func(p *Policy) { p.RequireShim = true }),
			want:   want{moves: []string{"11:0->1"}, reasons: map[int]string{10: "not running under libptxmig.so"}},
		},
		{
			name: "missing /proc info or memory stays",
			gpus: []GPU{h200(0, 1, 680, 60), h200(1, 0, 90, 1)},
			procs: []Process{mod(procOn(10, 0, 0.5, 5), func(p *Process) { p.InfoErr = "pid 10: no such process" }),
				mod(procOn(11, 0, 0.5, 5), func(p *Process) { p.MemKnown = false })},
			policy: DefaultPolicy(),
			want:   want{reasons: map[int]string{10: "no /proc information", 11: "GPU memory use unknown"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.policy.Validate(); err != nil {
				t.Fatal(err)
			}
			obs := Observation{Time: t0, Window: 5 * time.Second, GPUs: tt.gpus, Procs: tt.procs}
			plan := MakePlan(obs, tt.policy, tt.history, t0)
			var got []string
			for _, m := range plan.Moves {
				got = append(got, fmt.Sprintf("%d:%d->%d", m.PID, m.From.Index, m.To.Index))
				if m.Score <= tt.policy.MinImprovement {
					t.Errorf("move %v scores %v, not above the threshold", m, m.Score)
				}
			}
			if strings.Join(got, " ") != strings.Join(tt.want.moves, " ") {
				t.Errorf("moves %v, want %v", got, tt.want.moves)
				for _, d := range plan.Decisions {
					t.Logf("  pid %d: move=%v %s", d.PID, d.Move, d.Reason)
				}
			}
			if len(plan.Decisions) != len(tt.procs) {
				t.Errorf("%d decisions for %d processes", len(plan.Decisions), len(tt.procs))
			}
			for _, d := range plan.Decisions {
				if d.Reason == "" {
					t.Errorf("pid %d has no reason", d.PID)
				}
			}
			for pid, sub := range tt.want.reasons {
				if d := decisionFor(plan, pid); d.Move || !strings.Contains(d.Reason, sub) {
					t.Errorf("pid %d: move=%v reason %q, want it to stay with %q", pid, d.Move, d.Reason, sub)
				}
			}
			// Pure: the same input gives the same plan.
			again := MakePlan(obs, tt.policy, tt.history, t0)
			if fmt.Sprint(again) != fmt.Sprint(plan) {
				t.Errorf("plan not deterministic")
			}
		})
	}
}

// fleetSim is a synthetic node: processes with a per-run demand (0..1 of a GPU) placed on GPUs.
type fleetSim struct {
	gpus   int
	place  map[int]int                // pid -> gpu
	demand func(run, pid int) float64 // demand of pid in run
	mem    map[int]float64            // pid -> GiB
}

// observe builds the observation NVML would give: a GPU's utilization is its summed demand
// (capped at 1), split among its processes in proportion to their demand.
func (f *fleetSim) observe(run int, now time.Time) Observation {
	obs := Observation{Time: now, Window: 5 * time.Second}
	sum := make([]float64, f.gpus)
	used := make([]float64, f.gpus)
	for pid, g := range f.place {
		sum[g] += f.demand(run, pid)
		used[g] += f.mem[pid]
	}
	for g := 0; g < f.gpus; g++ {
		u := min(sum[g], 1)
		obs.GPUs = append(obs.GPUs, h200(g, u, 90+600*u, used[g]+0.5))
	}
	for pid := 1; pid <= len(f.place); pid++ {
		g := f.place[pid]
		share := 0.0
		if sum[g] > 0 {
			share = f.demand(run, pid) / sum[g] * obs.GPUs[g].Util
		}
		obs.Procs = append(obs.Procs, procOn(pid, g, share, f.mem[pid]))
	}
	return obs
}

// simulate runs the planner every 5 minutes over 20 runs, applying its moves, and returns the
// moves as history.
func (f *fleetSim) simulate(t *testing.T, pol Policy) []MoveRecord {
	t.Helper()
	var hist []MoveRecord
	for run := 0; run < 20; run++ {
		now := t0.Add(time.Duration(run) * 5 * time.Minute)
		obs := f.observe(run, now)
		plan := MakePlan(obs, pol, hist, now)
		for _, m := range plan.Moves {
			if f.place[m.PID] != m.From.Index {
				t.Fatalf("run %d: move %+v from the wrong GPU", run, m)
			}
			f.place[m.PID] = m.To.Index
			hist = append(hist, MoveRecord{PID: m.PID, StartTicks: m.StartTicks, From: m.From.UUID, To: m.To.UUID,
				FromIndex: m.From.Index, ToIndex: m.To.Index, At: now, OK: true})
		}
	}
	return hist
}

// pingPongs counts moves that put a process back on a GPU it left earlier.
func pingPongs(hist []MoveRecord) int {
	left := map[int]map[int]bool{}
	n := 0
	for _, m := range hist {
		if left[m.PID][m.ToIndex] {
			n++
		}
		if left[m.PID] == nil {
			left[m.PID] = map[int]bool{}
		}
		left[m.PID][m.FromIndex] = true
	}
	return n
}

func TestNoPingPong(t *testing.T) {
	// GPU 0: pid 1 (steady 0.42, the best mover), pid 2 (0.48 on even runs, else 0).
	// GPU 1: pid 3 (pinned; 0.5 on odd runs, else 0), pid 4 (steady 0.05).
	// The hot GPU alternates every run (every 5 minutes).
	newFleet := func() *fleetSim {
		return &fleetSim{
			gpus:  2,
			place: map[int]int{1: 0, 2: 0, 3: 1, 4: 1},
			mem:   map[int]float64{1: 2, 2: 4, 3: 6, 4: 8},
			demand: func(run, pid int) float64 {
				even := run%2 == 0
				switch {
				case pid == 1:
					return 0.42
				case pid == 2 && even:
					return 0.48
				case pid == 3 && !even:
					return 0.5
				case pid == 4:
					return 0.05
				}
				return 0
			},
		}
	}
	policy := func(cooldown, window time.Duration) Policy {
		p := DefaultPolicy()
		p.Cooldown, p.ReturnWindow = Duration(cooldown), Duration(window)
		p.Pin.PIDs = []int{3}
		return p
	}
	// Control: without cooldown and return window the same fleet does ping-pong, so the rules
	// tested below have something to prevent.
	if n := pingPongs(newFleet().simulate(t, policy(0, 0))); n < 5 {
		t.Fatalf("control: naive policy moved processes back only %d times; the scenario does not exercise the rules", n)
	} else {
		t.Logf("control: naive policy moved processes back %d times in 20 runs", n)
	}

	hist := newFleet().simulate(t, policy(10*time.Minute, 24*time.Hour))
	if len(hist) == 0 {
		t.Fatal("no move at all; the fleet starts unbalanced")
	}
	if n := pingPongs(hist); n != 0 {
		t.Errorf("%d moves back onto a GPU the process had left: %+v", n, hist)
	}
	if len(hist) > 4 {
		t.Errorf("%d moves for 4 processes in 20 runs: %+v", len(hist), hist)
	}

	// A return window shorter than the simulation: the doubling cooldown spaces the returns out.
	hist = newFleet().simulate(t, policy(10*time.Minute, 30*time.Minute))
	per := map[int][]time.Time{}
	for _, m := range hist {
		per[m.PID] = append(per[m.PID], m.At)
	}
	for pid, ts := range per {
		for i := 1; i < len(ts); i++ {
			if want := cooldownAfter(10*time.Minute, i, 30*time.Minute); ts[i].Sub(ts[i-1]) < want {
				t.Errorf("pid %d: move %d only %s after the previous one, cooldown %s", pid, i+1, ts[i].Sub(ts[i-1]), want)
			}
		}
	}
}

func TestCooldownAfter(t *testing.T) {
	const maxDur = time.Duration(1<<63 - 1)
	tests := []struct {
		base, window time.Duration
		n            int
		want         time.Duration
	}{
		{10 * time.Minute, time.Hour, 1, 10 * time.Minute},
		{10 * time.Minute, time.Hour, 2, 20 * time.Minute},
		{10 * time.Minute, time.Hour, 3, 40 * time.Minute},
		{10 * time.Minute, time.Hour, 4, time.Hour},
		{10 * time.Minute, time.Hour, 4096, time.Hour},
		{time.Hour, 10 * time.Minute, 5, time.Hour}, // capped at the base when it is the larger
		{0, time.Hour, 9, 0},
		// A return window near the largest duration must not overflow into a negative cooldown.
		{10 * time.Minute, maxDur, 4096, maxDur},
		{maxDur/2 + 1, maxDur, 2, maxDur},
	}
	for _, tt := range tests {
		if got := cooldownAfter(tt.base, tt.n, tt.window); got != tt.want {
			t.Errorf("cooldownAfter(%v, %d, %v) = %v, want %v", tt.base, tt.n, tt.window, got, tt.want)
		}
	}
}
