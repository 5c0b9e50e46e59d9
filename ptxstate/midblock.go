package ptxstate

import (
	"fmt"
	"slices"
	"sort"
	"strings"
)

// Mid-block safe points (../shared/notes/ptx-instrumentation.md §3(b)): places inside a block
// where a twin could stop the whole CTA, save its live registers and shared memory, and resume
// there in a later launch. This file finds the candidate sites and checks each against the
// correctness conditions that can be decided statically; the rewrite comes on top of it.
//
// Sites:
//   - "barrier": bar.sync / barrier.sync[.aligned] with no thread count, in the kernel itself
//     (not a callee), at scope depth 0, reached by all threads of the CTA or none (C1);
//   - "loop": the header of a loop with no barrier in it whose exit branches are CTA-uniform (so
//     every thread runs the same number of iterations and a CTA-wide vote can be taken there);
//   - "thread-loop": the header of any loop with no barrier in it, in a kernel that has no
//     barrier or warp collective at all (threadBlockers): each thread stops there by itself, and
//     the CTA saves once every thread stopped or finished the block. Such a kernel's loop sites
//     are all thread-loops.
//
// Conditions checked per site (a failed one is a refusal naming it):
//   - C1 the site is CTA-uniform (above);
//   - C3 nothing asynchronous can be in flight: no bulk/TMA copies, mbarrier waits, wgmma or
//     tcgen05 operations in the kernel (plain cp.async is waited for at the site: allowed);
//   - C4 no live value is bound to where the CTA ran: derived from %smid, %nsmid, %warpid,
//     %gridid, or a .local address (cvta.local, %SP, %SPL), or from %clock, %clock64 or
//     %globaltimer other than as a reading plus or minus a clock-free amount, which is rebased
//     instead (timebase.go);
//   - C5 no dynamic stack (alloca); a static .local depot is saved with the registers;
//   - C6 no cross-CTA waits: the kernel must have a block-granular twin at all (spin-waits on
//     memory other CTAs write, grid sync and clusters already refuse that);
//   - C9 the live state fits the budget (MaxMidBlockLiveBytes per thread).
// C2 (exited threads stay exited), C7 (identical resume launch) and C8 (no replay) are properties
// of the rewrite and the runtime, not of the kernel.

// MaxMidBlockLiveBytes bounds the registers one thread saves at a site (C9): beyond it the save
// area and the save/restore time grow past what a preemption should cost.
const MaxMidBlockLiveBytes = 512

// MidBlockSite is a candidate mid-block safe point and whether it is usable.
type MidBlockSite struct {
	Line      int      `json:"line"`
	Kind      string   `json:"kind"` // "barrier", "loop" or "thread-loop"
	Op        string   `json:"op"`
	LiveBytes int      `json:"live_bytes"` // registers saved per thread (predicates as 4 bytes)
	Eligible  bool     `json:"eligible"`
	Refusals  []string `json:"refusals,omitempty"` // "C4: ..."
	// PollEvery is, for a loop site, how many header visits pass between two votes (pollEvery).
	PollEvery int `json:"poll_every,omitempty"`
	// Rebased names the live registers that hold clock readings, saved relative to the clock
	// ("%rd1 (%clock64)").
	Rebased []string `json:"rebased,omitempty"`

	idx    int               // statement index: the barrier, or the loop header's first instruction
	live   []int             // registers live at the site (CFG register ids), saved and restored
	rebase map[int]timeClass // live registers saved relative to their clock
	c1     []string          // its C1 refusals (dropped for a thread-loop)
}

// maxC6Reasons is how many of the kernel's refusals a site's C6 refusal names.
const maxC6Reasons = 8

// kernelBlockers are the kernel-wide reasons (C3, C5, C6) that rule out every site.
func midBlockBlockers(kr *KernelReport, bodies [][]*Stmt) []string {
	var out []string
	if !kr.Eligible {
		// Every site repeats this refusal: it names at most maxC6Reasons of the kernel's reasons
		// (a kernel refused for each of n barriers has n reasons and n sites: listing them all at
		// every site made the report quadratic, 530 MB for 2,000 barriers).
		why := strings.Join(kr.Refusals[:min(len(kr.Refusals), maxC6Reasons)], "; ")
		if more := len(kr.Refusals) - maxC6Reasons; more > 0 {
			why += fmt.Sprintf("; and %d more (the kernel's refusals)", more)
		}
		out = append(out, "C6: the kernel has no block-granular twin ("+why+")")
	}
	seen := map[string]bool{}
	add := func(key, msg string) { // one refusal per kind, naming its first occurrence
		if !seen[key] {
			seen[key] = true
			out = append(out, msg)
		}
	}
	for _, body := range bodies {
		for _, s := range body {
			if s.Kind != StInstr {
				continue
			}
			switch {
			case strings.HasPrefix(s.Op, "cp.async.bulk") || strings.HasPrefix(s.Op, "cp.reduce.async.bulk") || s.HasMod("bulk_group"):
				add("bulk", fmt.Sprintf("C3: bulk/TMA copies (%s, line %d) may be in flight at any site", s.Op, s.Line))
			case s.Base() == "mbarrier":
				add("mbarrier", fmt.Sprintf("C3: mbarrier operations (%s, line %d): a transaction may be pending at any site", s.Op, s.Line))
			case s.Base() == "wgmma":
				add("wgmma", fmt.Sprintf("C3: wgmma (line %d): asynchronous warpgroup MMAs may be in flight", s.Line))
			case s.Base() == "tcgen05":
				add("tcgen05", fmt.Sprintf("C3: tcgen05 (line %d): tensor-memory state cannot be saved", s.Line))
			case s.Base() == "alloca" || s.Base() == "stacksave" || s.Base() == "stackrestore":
				add("alloca", fmt.Sprintf("C5: dynamic stack (%s, line %d)", s.Op, s.Line))
			case isBarrier(s) && !plainCTABarrier(s):
				// bar.arrive, bar.red, or a barrier with a thread count: a site's vote is a CTA-wide
				// barrier and must not interleave with partial ones.
				add("partial", fmt.Sprintf("C1: %s (line %d) is not a CTA-wide barrier without a thread count: a site's vote would interleave with it", s.Op, s.Line))
			}
		}
		for _, s := range body {
			if s.Kind == StDecl && s.Depth > 0 && (strings.Contains(s.Text, ".shared") || strings.Contains(s.Text, ".local")) {
				add("decl", fmt.Sprintf("C5: shared or local memory declared in a nested { } scope (line %d): the save cannot name it", s.Line))
			}
		}
	}
	return out
}

// plainCTABarrier reports whether s is a CTA-wide barrier with no thread count.
func plainCTABarrier(s *Stmt) bool {
	switch s.Base() {
	case "bar":
		return (s.Op == "bar.sync" || s.Op == "bar.sync.aligned") && len(s.Args) == 1
	case "barrier":
		return (s.Op == "barrier.sync" || s.Op == "barrier.sync.aligned" || s.Op == "barrier.cta.sync" || s.Op == "barrier.cta.sync.aligned") &&
			len(s.Args) == 1
	}
	return false
}

// midBlockSites finds and checks the kernel's candidate sites. after is the liveness after each
// statement, bodies the kernel's and its callees' statements, target the module's .target.
func midBlockSites(kr *KernelReport, g *CFG, after [][]int, uni *uniformity, bodies [][]*Stmt, barrierFuncs map[string]bool, target []string) []MidBlockSite {
	f := g.Fn
	blockers := midBlockBlockers(kr, bodies)
	times := timeClasses(g)
	check := func(site *MidBlockSite, live []int, uniform bool, c1, extra []string) {
		g.work += len(live)
		site.live = live
		var bound []string
		for _, r := range site.live {
			name := regKeyName(g.regNames[r])
			site.LiveBytes += regSize(g.regTypes[r])
			switch c := times[r]; {
			case c == tcBound:
				bound = append(bound, name)
			case c.timeSource() != "":
				if site.rebase == nil {
					site.rebase = map[int]timeClass{}
				}
				site.rebase[r] = c
				site.Rebased = append(site.Rebased, name+" ("+c.timeSource()+")")
			}
			if strings.Contains(g.regNames[r], "#") {
				extra = append(extra, "C9: register "+name+" is declared in a nested scope")
			}
			if saveType(g.regTypes[r]) == "" {
				extra = append(extra, fmt.Sprintf("C9: register %s has type %s, which the save does not handle", name, g.regTypes[r]))
			}
		}
		site.LiveBytes += kr.LocalBytes
		sort.Strings(bound)
		sort.Strings(site.Rebased)
		site.Refusals = append(append(site.Refusals, c1...), extra...)
		if !uniform {
			c1 = append(c1, "C1: reached divergently (some threads of the CTA may not get here)")
			site.Refusals = append(site.Refusals, c1[len(c1)-1])
		}
		site.c1 = c1
		if len(bound) > 0 {
			site.Refusals = append(site.Refusals, "C4: live values bound to where the CTA ran: "+strings.Join(bound, ", "))
		}
		if site.LiveBytes > MaxMidBlockLiveBytes {
			site.Refusals = append(site.Refusals, fmt.Sprintf("C9: %d live bytes per thread, over the budget of %d", site.LiveBytes, MaxMidBlockLiveBytes))
		}
		site.Refusals = append(site.Refusals, blockers...)
		site.Eligible = len(site.Refusals) == 0
	}
	var sites []MidBlockSite
	var polls []int
	for i, s := range f.Body {
		if s.Kind != StInstr {
			continue
		}
		callBar := s.Base() == "call" && barrierFuncs[callee(s)]
		if !isBarrier(s) && !callBar {
			continue
		}
		site := MidBlockSite{Line: s.Line, Kind: "barrier", Op: s.Op, idx: i}
		var why []string
		switch {
		case callBar:
			site.Op = "call " + callee(s)
			why = append(why, "C1: the barrier is inside the called function "+callee(s)+": the CTA must stop in the kernel itself")
		case !plainCTABarrier(s):
			why = append(why, "C1: "+s.Op+" is not a CTA-wide barrier without a thread count")
		case s.Pred != "":
			why = append(why, "C1: the barrier is guarded (@"+s.Pred+")")
		}
		if s.Depth > 0 {
			why = append(why, "C1: inside a nested { } scope")
		}
		check(&site, after[i], uni.reachedUniformly(g.blockOf[i]), why, nil)
		if polls == nil {
			polls = barrierPollEvery(g)
		}
		site.PollEvery = polls[g.blockOf[i]]
		sites = append(sites, site)
	}
	loops := layoutLoops(g)
	sites = append(sites, loopSites(g, loops, after, uni, check)...)
	tb := threadBlockers(bodies, target)
	heads := make([]int, 0, len(loops))
	for h := range loops {
		heads = append(heads, h)
	}
	sort.Ints(heads)
	for _, h := range heads {
		if firstInstr(g, h) < 0 {
			// An empty header block gets no site (loopSites): a thread waiting in that loop for a
			// stopped one would never stop.
			tb = append(tb, fmt.Sprintf("the loop at line %d has no instruction at its header, so no site", f.Body[g.Blocks[h].Start].Line))
		}
	}
	threadLoops(sites, tb)
	sort.SliceStable(sites, func(a, b int) bool { return sites[a].Line < sites[b].Line })
	return sites
}

// threadLoops turns the loop sites of a kernel into thread-loops when that makes a site usable
// that C1 alone refused, and the kernel allows stopping thread by thread (no blockers); a loop site
// that C1 alone refused otherwise names, in its C1 refusal, what rules thread stops out.
func threadLoops(sites []MidBlockSite, blockers []string) {
	gain := false
	for _, s := range sites {
		if s.Kind == "loop" && len(s.c1) > 0 && len(s.Refusals) == len(s.c1) {
			gain = true
		}
	}
	if !gain {
		return
	}
	for i := range sites {
		s := &sites[i]
		if s.Kind != "loop" {
			continue
		}
		if len(blockers) > 0 {
			if len(s.c1) > 0 && len(s.Refusals) == len(s.c1) {
				s.Refusals[0] += "; a thread-granular stop is ruled out: " + blockers[0]
			}
			continue
		}
		s.Kind, s.Op = "thread-loop", "loop header (each thread stops by itself)"
		s.Refusals = slices.DeleteFunc(s.Refusals, func(r string) bool { return slices.Contains(s.c1, r) })
		s.Eligible = len(s.Refusals) == 0
	}
}

// minThreadStopSM is the first architecture whose warps can stop thread by thread: independent
// thread scheduling lets a thread wait at the non-aligned barrier of the twin's block end while
// others of its warp still run the body.
const minThreadStopSM = 70

// threadBlockers are the reasons a kernel cannot stop thread by thread: a stopped thread leaves
// its block at once and the others of its CTA wait for it at the block's end, so no thread may
// wait for it at a barrier or in a warp collective; and every loop in which a thread could wait
// for another (a spin on shared memory) must be a site, where the waiting thread stops too: a
// call may hide a loop that is none.
func threadBlockers(bodies [][]*Stmt, target []string) []string {
	var out []string
	for _, t := range target {
		if n, ok := strings.CutPrefix(t, "sm_"); ok {
			var sm int
			if _, err := fmt.Sscanf(n, "%d", &sm); err == nil && sm < minThreadStopSM {
				out = append(out, fmt.Sprintf("the module targets %s, before sm_%d (no independent thread scheduling)", t, minThreadStopSM))
			}
		}
	}
	for _, body := range bodies {
		for _, s := range body {
			if s.Kind != StInstr {
				continue
			}
			switch {
			case isBarrier(s) || isWarpCollective(s):
				out = append(out, fmt.Sprintf("%s (line %d) waits for other threads", s.Op, s.Line))
			case s.Base() == "call":
				out = append(out, fmt.Sprintf("a call (line %d) may hold a loop that is no site, where a thread could wait for a stopped one", s.Line))
			}
			if len(out) > 0 {
				return out
			}
		}
	}
	return out
}

// loopSites finds, among the loops of headers (layoutLoops: back edge b → h in layout order),
// those with no barrier, and checks each: every exit branch of the loop must be CTA-uniform (same
// trip count everywhere).
func loopSites(g *CFG, headers map[int]int, after [][]int, uni *uniformity, check func(*MidBlockSite, []int, bool, []string, []string)) []MidBlockSite {
	f := g.Fn
	var out []MidBlockSite
	for h, latch := range headers {
		barrier, divergentExit := false, false
		instrs := 0
		for x := h; x <= latch; x++ {
			bl := g.Blocks[x]
			g.work += bl.End - bl.Start
			for k := bl.Start; k < bl.End; k++ {
				if s := f.Body[k]; s.Kind == StInstr {
					instrs++
					if isBarrier(s) || s.Base() == "call" {
						barrier = true
						break
					}
				}
			}
			if barrier {
				break
			}
			for _, succ := range bl.Succs {
				if (succ < h || succ > latch) && uni.divBranch[x] {
					divergentExit = true
				}
			}
		}
		if barrier {
			continue // its barriers are the sites (a call may hide one)
		}
		start := firstInstr(g, h)
		if start < 0 {
			continue
		}
		site := MidBlockSite{Line: f.Body[start].Line, Kind: "loop", Op: "loop header", idx: start, PollEvery: pollEvery(instrs)}
		var why []string
		if divergentExit {
			why = append(why, "C1: the loop's exit depends on per-thread values: threads may run different trip counts")
		}
		// Live on entry to the header's first instruction: its uses, and what is live after it
		// that it does not define.
		var live []int
		for _, r := range after[start] {
			if !containsInt(g.defs[start], r) {
				live = append(live, r)
			}
		}
		live = append(live, g.uses[start]...)
		sort.Ints(live)
		live = slices.Compact(live)
		check(&site, live, uni.reachedUniformly(h), why, nil)
		out = append(out, site)
	}
	return out
}

// layoutLoops maps each loop header to its last latch: a branch from block b back to block h
// (h <= b in layout order) closes a loop whose blocks are h..latch (nvcc lays loops out
// contiguously).
func layoutLoops(g *CFG) map[int]int {
	headers := map[int]int{}
	for _, b := range g.Blocks {
		for _, h := range b.Succs {
			if h <= b.ID && h < len(g.Blocks) {
				headers[h] = max(headers[h], b.ID)
			}
		}
	}
	return headers
}

// firstInstr is the body index of block b's first instruction, -1 when it has none.
func firstInstr(g *CFG, b int) int {
	for k := g.Blocks[b].Start; k < g.Blocks[b].End; k++ {
		if g.Fn.Body[k].Kind == StInstr {
			return k
		}
	}
	return -1
}

// pollTarget is about how many instructions a thread runs between two votes of a loop site: a
// vote is a CTA-wide barrier (plus the leader's flag load, issued a poll ahead so that its
// latency is hidden), which costs about what a few dozen instructions do, so one vote per ~1000
// keeps the sites' cost near 1-3 % while a stop still comes within microseconds of the flag.
const pollTarget = 1024

// pollEvery is how many visits of a loop header pass between two votes: a power of two near
// pollTarget divided by the loop's instruction count, between 1 and 1024.
func pollEvery(loopInstrs int) int {
	k := 1
	for k < 1024 && k*max(loopInstrs, 1) < pollTarget {
		k *= 2
	}
	return k
}

// saveType is the type of the st/ld that saves and restores a register of PTX type t, or "" when
// the rewrite does not handle it (predicates are saved through a 32-bit value).
func saveType(t string) string {
	if t == ".pred" {
		return ".b32"
	}
	switch typeBytes(t) {
	case 1:
		return ".b8"
	case 2:
		return ".b16"
	case 4:
		return ".b32"
	case 8:
		return ".b64"
	}
	return ""
}

// barrierPollEvery is, for every block b, how many site visits pass between two votes at a
// barrier site in b: pollEvery of the instructions per barrier of the innermost loop around it
// (the shortest layout interval h..latch of a back edge holding b, the one with the lower latch
// on a tie), or, outside loops, of the whole body (the site counter counts every site's visits
// and runs on across the blocks a CTA runs: a kernel whose short blocks voted at each of their
// barriers ran 1.7-3.8x slower than its block-granular twin on an H100).
//
// It is computed for all blocks at once, in O(blocks + statements + back edges x log): the
// intervals are taken shortest first and each paints the blocks no shorter one holds (a
// union-find skips painted blocks), and instructions and barriers per interval come from prefix
// sums. Scanning every block's interval per site instead was quadratic in barriers (issue 36:
// 50,000 barriers took 109 s).
func barrierPollEvery(g *CFG) []int {
	nb := len(g.Blocks)
	type loop struct{ h, latch int }
	var loops []loop
	for _, bl := range g.Blocks {
		for _, h := range bl.Succs {
			if h <= bl.ID {
				loops = append(loops, loop{h, bl.ID})
			}
		}
	}
	sort.Slice(loops, func(a, b int) bool {
		la, lb := loops[a].latch-loops[a].h, loops[b].latch-loops[b].h
		if la != lb {
			return la < lb
		}
		return loops[a].latch < loops[b].latch
	})
	// Prefix sums per block of instructions and barriers: instrs[x] counts blocks 0..x-1.
	instrs, bars := make([]int, nb+1), make([]int, nb+1)
	for x, bl := range g.Blocks {
		instrs[x+1], bars[x+1] = instrs[x], bars[x]
		g.work += bl.End - bl.Start + len(bl.Succs)
		for k := bl.Start; k < bl.End; k++ {
			if s := g.Fn.Body[k]; s.Kind == StInstr {
				instrs[x+1]++
				if isBarrier(s) {
					bars[x+1]++
				}
			}
		}
	}
	every := func(h, latch int) int {
		return pollEvery((instrs[latch+1] - instrs[h]) / max(bars[latch+1]-bars[h], 1))
	}
	out := make([]int, nb)
	// next[x] leads (through find) to the first block >= x not painted yet; nb when none.
	next := make([]int, nb+1)
	for x := range next {
		next[x] = x
	}
	find := func(x int) int {
		r := x
		for next[r] != r {
			r = next[r]
		}
		for next[x] != r {
			next[x], x = r, next[x]
		}
		return r
	}
	for _, l := range loops {
		e := every(l.h, l.latch)
		g.work++
		for x := find(l.h); x <= l.latch; x = find(x) {
			g.work++
			out[x] = e
			next[x] = x + 1
		}
	}
	if nb > 0 {
		e := every(0, nb-1)
		for x := find(0); x < nb; x = find(x) {
			g.work++
			out[x] = e
			next[x] = x + 1
		}
	}
	return out
}
