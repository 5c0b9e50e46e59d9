package rebalance

import (
	"fmt"
	"math"
	"sort"

	"time"

	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/op"
)

// GPURef names a GPU in a move.
type GPURef struct {
	Index int    `json:"index"`
	UUID  string `json:"uuid"`
}

// Move is one planned migration.
type Move struct {
	PID        int     `json:"pid"`
	StartTicks uint64  `json:"start_ticks"`
	Comm       string  `json:"comm,omitempty"`
	From       GPURef  `json:"from"`
	To         GPURef  `json:"to"`
	MemBytes   uint64  `json:"mem_bytes"`
	Util       float64 `json:"util"`
	// Score is the weighted predicted improvement; LoadGain and PowerGain its parts (see
	// docs/REBALANCE.md).
	Score     float64 `json:"score"`
	LoadGain  float64 `json:"load_gain"`
	PowerGain float64 `json:"power_gain"`
}

// Decision explains what the planner did with one process.
type Decision struct {
	PID    int     `json:"pid"`
	Comm   string  `json:"comm,omitempty"`
	GPU    int     `json:"gpu"` // index; -1 when not on exactly one observed GPU
	Util   float64 `json:"util"`
	MemMiB uint64  `json:"mem_mib"`
	Move   bool    `json:"move"`
	Reason string  `json:"reason"`
}

// Plan is the planner's answer: the moves, in order, and a decision for every process.
type Plan struct {
	Moves     []Move     `json:"moves"`
	Decisions []Decision `json:"decisions"`
}

// powerModel predicts a GPU's power draw as Idle + PerLoad·load (watts, load 0..1).
type powerModel struct{ Idle, PerLoad float64 }

// sim is the planner's predicted picture of the node, updated after each chosen move.
type sim struct {
	load, power []float64
	used        []uint64
	scale       []float64 // watts that make power 1.0 (the limit, else the chip group's peak)
	model       []powerModel
}

// candidate is the best move found for one process in one pass.
type candidate struct {
	proc  int // index into obs.Procs
	to    int // index into obs.GPUs
	score float64
	gl    float64
	gp    float64
}

// MakePlan decides which processes to move. It is pure: everything it needs is in its arguments.
// history holds past moves (successful or not) for cooldowns and ping-pong prevention.
func MakePlan(obs Observation, pol Policy, history []MoveRecord, now time.Time) Plan {
	s := newSim(obs)
	shares := processShares(obs)
	dec := make([]Decision, len(obs.Procs))
	eligible := make([]bool, len(obs.Procs))
	src := make([]int, len(obs.Procs))
	attempts, lastAttempt, left := summarizeHistory(history, now, time.Duration(pol.ReturnWindow))
	jobs := jobPeers(obs.Procs)

	for i, p := range obs.Procs {
		src[i] = -1
		if len(p.GPUs) == 1 {
			src[i] = obs.gpuByUUID(p.GPUs[0])
		}
		dec[i] = Decision{PID: p.PID, Comm: p.Comm, GPU: -1, Util: shares[i], MemMiB: p.MemBytes >> 20}
		if src[i] >= 0 {
			dec[i].GPU = obs.GPUs[src[i]].Index
		}
		dec[i].Reason = staticReason(p, src[i], pol, now, attempts, lastAttempt)
		if peers := jobs[p.PID]; len(peers) > 0 {
			dec[i].Reason = fmt.Sprintf("one of a job's %d CUDA processes (session %d: pids %s): a job is moved whole or not "+
				"at all, and the rebalancer plans moves of single processes only (move a job with `ptxmig migrate --gpu-map` on its launcher)", len(peers)+1, p.Session, pidsText(append([]int{p.PID}, peers...)))
		}
		eligible[i] = dec[i].Reason == ""
	}

	var plan Plan
	moved := make([]bool, len(obs.Procs))
	for len(plan.Moves) < pol.MaxMoves {
		c, ok := bestMove(obs, pol, s, shares, src, eligible, moved, left, dec)
		if !ok {
			break
		}
		p := obs.Procs[c.proc]
		from, to := obs.GPUs[src[c.proc]], obs.GPUs[c.to]
		plan.Moves = append(plan.Moves, Move{
			PID: p.PID, StartTicks: p.StartTicks, Comm: p.Comm,
			From: GPURef{from.Index, from.UUID}, To: GPURef{to.Index, to.UUID},
			MemBytes: p.MemBytes, Util: shares[c.proc], Score: c.score, LoadGain: c.gl, PowerGain: c.gp,
		})
		dec[c.proc].Move = true
		dec[c.proc].Reason = fmt.Sprintf("move to GPU %d: score %.3f > %.3f (load %+.3f, power %+.3f)",
			to.Index, c.score, pol.MinImprovement, c.gl, c.gp)
		moved[c.proc] = true
		s.apply(src[c.proc], c.to, shares[c.proc], p.MemBytes)
	}
	if len(plan.Moves) == pol.MaxMoves {
		// One more pass only to explain who else would have moved.
		bestMove(obs, pol, s, shares, src, eligible, moved, left, dec)
		for i := range dec {
			if eligible[i] && !moved[i] && dec[i].Reason == "" {
				dec[i].Reason = fmt.Sprintf("max-moves %d reached this run", pol.MaxMoves)
			}
		}
	}
	plan.Decisions = dec
	return plan
}

// jobPeers groups the observed CUDA processes into jobs: those that share a session (a launcher
// and its ranks: torchrun, mp.spawn, a script that starts them). Each process of a job of two or
// more maps to the others; a process alone in its session, or whose session is unknown, is absent.
func jobPeers(procs []Process) map[int][]int {
	bySID := map[int][]int{}
	for _, p := range procs {
		if p.Session > 0 {
			bySID[p.Session] = append(bySID[p.Session], p.PID)
		}
	}
	out := map[int][]int{}
	for _, pids := range bySID {
		if len(pids) < 2 {
			continue
		}
		sort.Ints(pids)
		for _, pid := range pids {
			for _, q := range pids {
				if q != pid {
					out[pid] = append(out[pid], q)
				}
			}
		}
	}
	return out
}

func pidsText(pids []int) string {
	sort.Ints(pids)
	return op.PIDText(pids)
}

// staticReason returns why process p may not move regardless of loads, or "".
func staticReason(p Process, src int, pol Policy, now time.Time, attempts map[string]int, last map[string]time.Time) string {
	switch {
	case len(p.GPUs) != 1:
		return fmt.Sprintf("uses %d GPUs: only single-GPU processes are moved", len(p.GPUs))
	case src < 0:
		return "its GPU " + p.GPUs[0] + " was not observed"
	}
	if r := pol.pinReason(p); r != "" {
		return r
	}
	switch {
	case p.InfoErr != "":
		return "no /proc information: " + p.InfoErr
	case !p.EnvKnown:
		return "environment unreadable: PTXMIG_PIN=1 cannot be ruled out"
	case pol.RequireShim && !p.UnderShim:
		return "not running under libptxmig.so (require_shim)"
	case p.StartTime.IsZero():
		return "age unknown"
	case now.Sub(p.StartTime) < time.Duration(pol.MinAge):
		return fmt.Sprintf("too young: age %s < min-age %s", now.Sub(p.StartTime).Round(time.Second), pol.MinAge)
	case !p.MemKnown:
		return "GPU memory use unknown: cannot check room on a target"
	}
	if n := attempts[p.Key()]; n > 0 {
		cd := cooldownAfter(time.Duration(pol.Cooldown), n, time.Duration(pol.ReturnWindow))
		if ago := now.Sub(last[p.Key()]); ago < cd {
			return fmt.Sprintf("cooldown: last move %s ago, cooldown %s after %d move(s)", ago.Round(time.Second), cd, n)
		}
	}
	return ""
}

// cooldownAfter is the cooldown after n moves: base doubled for each move after the first,
// capped at max(base, returnWindow).
func cooldownAfter(base time.Duration, n int, returnWindow time.Duration) time.Duration {
	limit := max(base, returnWindow)
	cd := base
	for i := 1; i < n && cd < limit; i++ {
		if cd > limit/2 { // doubling would pass the cap (or overflow for windows near the maximum)
			return limit
		}
		cd *= 2
	}
	return min(cd, limit)
}

// summarizeHistory counts attempts per process within window, the latest attempt, and the GPUs
// each process successfully left within window (uuid → time).
func summarizeHistory(history []MoveRecord, now time.Time, window time.Duration) (map[string]int, map[string]time.Time, map[string]map[string]time.Time) {
	attempts := map[string]int{}
	last := map[string]time.Time{}
	left := map[string]map[string]time.Time{}
	for _, m := range history {
		if now.Sub(m.At) > window && now.Sub(m.At) > 0 {
			continue
		}
		k := m.Key()
		attempts[k]++
		if m.At.After(last[k]) {
			last[k] = m.At
		}
		if m.OK {
			if left[k] == nil {
				left[k] = map[string]time.Time{}
			}
			if m.At.After(left[k][m.From]) {
				left[k][m.From] = m.At
			}
		}
	}
	return attempts, last, left
}

// bestMove evaluates every eligible, unmoved process against the predicted state and returns the
// best move scoring above the threshold. It writes the reason for processes that cannot move.
func bestMove(obs Observation, pol Policy, s *sim, shares []float64, src []int, eligible, moved []bool, left map[string]map[string]time.Time, dec []Decision) (candidate, bool) {
	var best candidate
	found := false
	margin := pol.MemoryMarginMiB << 20
	wsum := pol.WeightLoad + pol.WeightPower
	for i, p := range obs.Procs {
		if !eligible[i] || moved[i] {
			continue
		}
		a := src[i]
		g := obs.GPUs[a]
		if s.load[a]*100 < pol.BusyThreshold {
			if s.load[a] == clamp(g.Util, 0, 1) {
				dec[i].Reason = fmt.Sprintf("GPU %d at %.0f%% is below the busy threshold %.0f%%", g.Index, s.load[a]*100, pol.BusyThreshold)
			} else {
				dec[i].Reason = fmt.Sprintf("GPU %d, predicted at %.0f%% after the planned move(s), is below the busy threshold %.0f%%", g.Index, s.load[a]*100, pol.BusyThreshold)
			}
			continue
		}
		if shares[i] <= 0 {
			dec[i].Reason = fmt.Sprintf("idle on GPU %d: moving it would not lower the load", g.Index)
			continue
		}
		var (
			c                          candidate
			haveC                      bool
			sameChip, noRoom, noReturn int
			bestFree                   uint64
			bestFreeIdx                = -1
			returnIdx                  = -1
			returnAgo                  time.Duration
		)
		need := p.MemBytes + margin
		for b := range obs.GPUs {
			t := obs.GPUs[b]
			if b == a || !gpu.SameModel(g.Name, g.ComputeCap, t.Name, t.ComputeCap) {
				continue
			}
			sameChip++
			free := sat(t.MemTotal, s.used[b])
			if free < need {
				noRoom++
				if bestFreeIdx < 0 || free > bestFree {
					bestFree, bestFreeIdx = free, t.Index
				}
				continue
			}
			if at, ok := left[p.Key()][t.UUID]; ok {
				noReturn++
				returnIdx, returnAgo = t.Index, obs.Time.Sub(at)
				continue
			}
			gl, gp := s.gains(a, b, shares[i])
			score := (pol.WeightLoad*gl + pol.WeightPower*gp) / wsum
			cand := candidate{proc: i, to: b, score: score, gl: gl, gp: gp}
			if !haveC || betterTarget(cand, c, s, obs) {
				c, haveC = cand, true
			}
		}
		switch {
		case sameChip == 0:
			dec[i].Reason = "no other GPU of chip type " + g.Chip()
		case !haveC && noReturn > 0:
			dec[i].Reason = fmt.Sprintf("would return to GPU %d, which it left %s ago (return window %s)", returnIdx, returnAgo.Round(time.Second), pol.ReturnWindow)
		case !haveC:
			dec[i].Reason = fmt.Sprintf("no %s GPU with room for %d MiB + %d MiB margin (most free: GPU %d, %d MiB)",
				g.Chip(), p.MemBytes>>20, pol.MemoryMarginMiB, bestFreeIdx, bestFree>>20)
		case c.score <= pol.MinImprovement:
			dec[i].Reason = fmt.Sprintf("best move, to GPU %d, scores %.3f, not above min-improvement %.3f",
				obs.GPUs[c.to].Index, c.score, pol.MinImprovement)
		default:
			dec[i].Reason = ""
			if !found || betterCandidate(c, best, obs) {
				best, found = c, true
			}
		}
	}
	return best, found
}

// betterTarget orders targets for one process: higher score, then lower load, more free memory,
// lower index.
func betterTarget(x, y candidate, s *sim, obs Observation) bool {
	if x.score != y.score {
		return x.score > y.score
	}
	if s.load[x.to] != s.load[y.to] {
		return s.load[x.to] < s.load[y.to]
	}
	fx, fy := sat(obs.GPUs[x.to].MemTotal, s.used[x.to]), sat(obs.GPUs[y.to].MemTotal, s.used[y.to])
	if fx != fy {
		return fx > fy
	}
	return obs.GPUs[x.to].Index < obs.GPUs[y.to].Index
}

// betterCandidate orders moves: higher score, then processes under the shim (quick to quiesce),
// then less memory to move, then lower PID.
func betterCandidate(x, y candidate, obs Observation) bool {
	px, py := obs.Procs[x.proc], obs.Procs[y.proc]
	switch {
	case x.score != y.score:
		return x.score > y.score
	case px.UnderShim != py.UnderShim:
		return px.UnderShim
	case px.MemBytes != py.MemBytes:
		return px.MemBytes < py.MemBytes
	}
	return px.PID < py.PID
}

func sat(a, b uint64) uint64 {
	if b >= a {
		return 0
	}
	return a - b
}

// processShares returns each process's share of its GPU (0..1): NVML's per-process figure where
// known (capped at the GPU's load), else the GPU's remaining load split evenly among the
// processes without a figure.
func processShares(obs Observation) []float64 {
	shares := make([]float64, len(obs.Procs))
	type acc struct {
		known   float64
		unknown int
	}
	per := make([]acc, len(obs.GPUs))
	for i, p := range obs.Procs {
		if len(p.GPUs) != 1 {
			continue
		}
		g := obs.gpuByUUID(p.GPUs[0])
		if g < 0 {
			continue
		}
		if p.UtilKnown {
			shares[i] = clamp(p.Util, 0, obs.GPUs[g].Util)
			per[g].known += shares[i]
		} else {
			per[g].unknown++
		}
	}
	for i, p := range obs.Procs {
		if len(p.GPUs) != 1 || p.UtilKnown {
			continue
		}
		if g := obs.gpuByUUID(p.GPUs[0]); g >= 0 {
			shares[i] = math.Max(0, obs.GPUs[g].Util-per[g].known) / float64(per[g].unknown)
		}
	}
	return shares
}

func clamp(v, lo, hi float64) float64 { return math.Min(math.Max(v, lo), hi) }

func newSim(obs Observation) *sim {
	n := len(obs.GPUs)
	s := &sim{load: make([]float64, n), power: make([]float64, n), used: make([]uint64, n),
		scale: make([]float64, n), model: make([]powerModel, n)}
	groups := map[string][]int{}
	for i, g := range obs.GPUs {
		s.load[i] = clamp(g.Util, 0, 1)
		s.power[i] = math.Max(g.PowerW, 0)
		s.used[i] = g.MemUsed
		groups[gpu.ChipKey(g.Name, g.ComputeCap)] = append(groups[gpu.ChipKey(g.Name, g.ComputeCap)], i)
	}
	for _, idx := range groups {
		peak := 0.0
		for _, i := range idx {
			peak = math.Max(peak, math.Max(obs.GPUs[i].PowerLimitW, s.power[i]))
		}
		m, fitted := fitPower(s.load, s.power, idx)
		for _, i := range idx {
			s.scale[i] = obs.GPUs[i].PowerLimitW
			if s.scale[i] <= 0 {
				s.scale[i] = peak
			}
			s.model[i] = m
			if !fitted && s.load[i] > 0 {
				// No spread of loads to fit: attribute the GPU's whole draw to its load.
				s.model[i] = powerModel{PerLoad: s.power[i] / s.load[i]}
			}
		}
	}
	return s
}

// fitPower fits power = Idle + PerLoad·load by least squares over the GPUs idx. It reports false
// when the loads do not spread enough to fit.
func fitPower(load, power []float64, idx []int) (powerModel, bool) {
	if len(idx) < 2 {
		return powerModel{}, false
	}
	var ml, mp float64
	for _, i := range idx {
		ml += load[i]
		mp += power[i]
	}
	n := float64(len(idx))
	ml, mp = ml/n, mp/n
	var cov, vr float64
	for _, i := range idx {
		cov += (load[i] - ml) * (power[i] - mp)
		vr += (load[i] - ml) * (load[i] - ml)
	}
	if vr < 1e-4 {
		return powerModel{}, false
	}
	k := math.Max(cov/vr, 0)
	return powerModel{Idle: math.Max(mp-k*ml, 0), PerLoad: k}, true
}

// gains predicts the load and power improvement of moving a share u of GPU a's time to GPU b.
// Each is 2·(Σx² before − Σx² after) over the two GPUs (x = load, or power/scale): positive when
// the pair ends closer to even, 1.0 for moving half of a full GPU onto an idle one.
func (s *sim) gains(a, b int, u float64) (gl, gp float64) {
	la, lb := s.load[a], s.load[b]
	na, nb := math.Max(la-u, 0), lb+u
	gl = 2 * (la*la + lb*lb - na*na - nb*nb)
	if s.scale[a] > 0 && s.scale[b] > 0 {
		dw := s.model[a].PerLoad * u
		ra, rb := s.power[a]/s.scale[a], s.power[b]/s.scale[b]
		qa, qb := math.Max(s.power[a]-dw, 0)/s.scale[a], (s.power[b]+dw)/s.scale[b]
		gp = 2 * (ra*ra + rb*rb - qa*qa - qb*qb)
	}
	return gl, gp
}

// apply updates the predicted state after moving share u and mem bytes from a to b.
func (s *sim) apply(a, b int, u float64, mem uint64) {
	dw := s.model[a].PerLoad * u
	s.load[a] = math.Max(s.load[a]-u, 0)
	s.load[b] = math.Min(s.load[b]+u, 1)
	s.power[a] = math.Max(s.power[a]-dw, 0)
	s.power[b] += dw
	s.used[a] = sat(s.used[a], mem)
	s.used[b] += mem
}

// sortedDecisions returns decisions ordered by GPU then PID, for stable output.
func sortedDecisions(d []Decision) []Decision {
	out := append([]Decision(nil), d...)
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].GPU != out[j].GPU {
			return out[i].GPU < out[j].GPU
		}
		return out[i].PID < out[j].PID
	})
	return out
}
