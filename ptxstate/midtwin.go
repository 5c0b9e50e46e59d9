package ptxstate

import (
	"fmt"
	"slices"
	"sort"
	"strings"
)

// Mid-block twins (Options.MidBlock; docs/PTXSTATE.md, "Mid-block safe points: the rewrite").
//
// A kernel with eligible mid-block sites (midblock.go) gets a version-3 twin: at every site the
// CTA votes, through one CTA-wide barrier (bar.red.or.pred, which replaces the site's own
// bar.sync, or is added every PollEvery visits of a loop header), whether to stop there. Only the
// leader's vote counts: it votes to stop when the preempt flag (prefetched after the previous
// vote) is set, or at the CTA's N-th vote when the test hook force_visit is N, and only after it
// reserved a record in the save area. A stopping CTA writes every thread's live registers of that
// site, the kernel's shared memory and the scheduler's state (the block's virtual %ctaid, the
// blocks left in its batch, the claim in flight) into the record, gives its batch up and goes back
// to the claim step. A later launch takes the record at its claim step, restores all of it and
// branches to the site, where the block continues as if it had passed the barrier. A record taken
// while the flag is set is copied to the save area unchanged (forwarded) instead of resumed, so a
// launch that is preempted at once ends at once; so each logical block finishes exactly once:
// whole, or through a chain of records.
//
// Thread-loop twins (every site a thread-loop: a kernel without barriers or warp collectives)
// stop thread by thread instead of voting. Each thread polls the flag itself every PollEvery
// visits of a site; one that stops keeps its live registers, marks the block stopped in shared
// memory and leaves the body for the block's end, where every thread meets at a barrier: the
// others finish their block or stop at their own next poll. If a thread stopped, the leader
// reserves a record and each thread writes its state into it: a status word in the last register
// slot (the site it stopped at, or StatusDone for a thread that finished the block) and, if it
// stopped, its registers. With the save area full, the stopped threads go back to their sites
// and the CTA makes no more stops in this launch. A resumed block restores shared memory, then
// each thread goes to its own site, or, done, straight to the block's end. Block-end barriers
// are non-aligned there (a warp may arrive divergent), which needs sm_70's independent thread
// scheduling.
//
// Record layout (RecordBytes): 64-byte header {u32 site, u32 blocks left in the batch, u32 ctaid
// x, y, z, u32 RecordMagic, u64 claim in flight, u64 its size, u64 claim position, u64 0, u32
// dynamic shared bytes, u32 threads}; then the registers, slot-major (slot j of thread t at
// 64 + (j*threads + t)*8: coalesced); then each static shared variable at a 16-byte aligned
// offset; then the dynamic shared memory.

// MidBlockLayout is what a host needs to size a mid-block twin's records. The instrumented
// module also carries it as `.visible .global .u32 __ptxmig_mid_K[5]` = {2, Slots,
// StaticSharedBytes, Sites, LocalBytes}, for hosts that hold only the module (cuModuleGetGlobal).
type MidBlockLayout struct {
	Sites             int  `json:"sites"`                  // eligible sites rewritten
	ThreadStops       bool `json:"thread_stops,omitempty"` // thread-loop sites: the last slot is each thread's status
	Slots             int  `json:"register_slots"`         // 8-byte register slots per thread
	LocalBytes        int  `json:"local_bytes"`            // the .local depot saved per thread (16-byte aligned)
	StaticSharedBytes int  `json:"static_shared_bytes"`    // static shared memory saved (16-byte aligned parts)
	DynamicShared     bool `json:"dynamic_shared"`         // the dynamic shared memory is saved too
}

// RecordBytes is the size of one record for a launch with threads threads per CTA and dyn bytes
// of dynamic shared memory, rounded up to 16.
func (l MidBlockLayout) RecordBytes(threads, dyn uint32) uint64 {
	n := 64 + (8*uint64(l.Slots)+uint64(l.LocalBytes))*uint64(threads) + uint64(l.StaticSharedBytes)
	if l.DynamicShared {
		n += uint64(dyn)
	}
	return (n + 15) &^ 15
}

// MidDescPrefix names the module variable that describes a kernel's records.
const MidDescPrefix = "__ptxmig_mid_"

// Thread-loop records: a thread's status word (the low half of its last register slot) is the
// site it stopped at or StatusDone; the header's site field is RecordThreadSites.
const (
	StatusDone        = 0xFFFFFFFF
	RecordThreadSites = 0x7FFFFFFF
	recRefused        = 0xFFFFFFFF // shRec of a thread-loop twin: the save area was full
)

type midShared struct {
	name  string
	bytes int
	off   int // in the record's shared part
	unit  int // 4: copied as 32-bit words, 1: bytewise
}

type midPlan struct {
	sites   []MidBlockSite // eligible, in body order; index = site id
	byIdx   map[int]int
	g       *CFG
	thread  bool // thread-loop sites: per-thread stops, non-uniform branches on the resume path
	rebase  bool // some site carries clock readings (the time registers are declared)
	layout  MidBlockLayout
	statics []midShared
	local   midShared // the .local depot (name "" when none)
	dyn     string    // an extern shared array of the kernel, "" when it uses none
	loops   bool
	// Resume enters a site through the header of every loop that encloses it, outermost first:
	// the twin's block loop (L("block")), then the body's loops (heads: the headers that enclose a
	// site; chain[id]: site id's, outer to inner), so that every loop keeps its header as its
	// only entry. A jump from the resume code straight into a loop's body makes the loop
	// irreducible, and ptxas 13 then compiled the twin of cuda-samples' fwtBatch1Kernel
	// (non-aligned barrier.sync in a loop) into wrong results even in runs that never resumed
	// (H100, 2026-11-27).
	heads   []midHead
	headAt  map[int]int // body index of a header's first instruction -> index in heads
	labelAt map[int]int // body index of a header block's first statement (its label) -> index in heads
	chain   [][]int
}

// midHead is a loop header that encloses sites: the resume dispatch at its top leads to them.
type midHead struct {
	sites []int // the site ids it encloses
}

// planMidBlock returns the rewrite plan of a kernel, nil when it has no eligible site.
func (a *analyzer) planMidBlock(f *Function, kr *KernelReport, info *kernelInfo) *midPlan {
	p := &midPlan{byIdx: map[int]int{}, g: info.cfg}
	for _, s := range kr.MidBlockSites {
		if !s.Eligible {
			continue
		}
		p.byIdx[s.idx] = len(p.sites)
		p.sites = append(p.sites, s)
		p.layout.Slots = max(p.layout.Slots, len(s.live))
		if s.Kind != "barrier" {
			p.loops = true
		}
		p.thread = p.thread || s.Kind == "thread-loop"
		p.rebase = p.rebase || len(s.rebase) > 0
	}
	if len(p.sites) == 0 {
		return nil
	}
	if p.thread {
		p.layout.ThreadStops = true
		p.layout.Slots++ // the status slot
	}
	p.layout.Sites = len(p.sites)
	p.planResume()
	vars := map[string]moduleVar{}
	for n := range info.shared {
		vars[n] = a.vars[n]
	}
	// nvcc 12 declares a kernel's __shared__ variables in its body ("demoted variable"); its
	// .local depot is there too.
	for _, s := range f.Body {
		if s.Kind == StDecl && s.Depth == 0 {
			n, v, ok := parseVar(s.Text)
			switch {
			case ok && v.Space == ".shared":
				vars[n] = v
			case ok && v.Space == ".local" && v.Bytes > 0:
				unit := 1
				if v.Align >= 4 && v.Bytes%4 == 0 {
					unit = 4
				}
				p.local = midShared{name: n, bytes: v.Bytes, unit: unit}
				p.layout.LocalBytes = (v.Bytes + 15) &^ 15
			}
		}
	}
	names := make([]string, 0, len(vars))
	for n := range vars {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		v := vars[n]
		if v.Extern || v.Bytes == 0 {
			if p.dyn == "" {
				p.dyn = n
			}
			continue
		}
		unit := 1
		if v.Align >= 4 && v.Bytes%4 == 0 {
			unit = 4
		}
		p.statics = append(p.statics, midShared{name: n, bytes: v.Bytes, off: p.layout.StaticSharedBytes, unit: unit})
		p.layout.StaticSharedBytes += (v.Bytes + 15) &^ 15
	}
	p.layout.DynamicShared = p.dyn != ""
	return p
}

// planResume finds, for every site, the loops that enclose it (a layout interval header..latch
// holding the site's block), outermost first.
func (p *midPlan) planResume() {
	type loop struct{ h, latch int }
	var loops []loop
	for h, latch := range layoutLoops(p.g) {
		loops = append(loops, loop{h, latch})
	}
	sort.Slice(loops, func(a, b int) bool {
		if loops[a].h != loops[b].h {
			return loops[a].h < loops[b].h
		}
		return loops[a].latch > loops[b].latch
	})
	// The loops around each site: a sweep over the blocks keeps the loops open at the current
	// block (header <= block <= latch) in a list in header order, so each site takes just its
	// own loops (testing every loop for every site was O(sites x loops): issue 36).
	nb := len(p.g.Blocks)
	siteAt := make([][]int, nb)
	for id, s := range p.sites {
		b := p.g.blockOf[s.idx]
		siteAt[b] = append(siteAt[b], id)
	}
	loopAt, endAt := make([]int, nb), make([][]int, nb) // loop index + 1 by header; loops by latch
	for i, l := range loops {
		loopAt[l.h] = i + 1
		endAt[l.latch] = append(endAt[l.latch], i)
	}
	head := len(loops) // the open list's sentinel
	next, prev := make([]int, len(loops)+1), make([]int, len(loops)+1)
	next[head], prev[head] = head, head
	around := make([][]int, len(p.sites))
	for b := 0; b < nb; b++ {
		if i := loopAt[b] - 1; i >= 0 { // headers are unique and come in order: append
			next[i], prev[i] = head, prev[head]
			next[prev[head]], prev[head] = i, i
		}
		for _, id := range siteAt[b] {
			for i := next[head]; i != head; i = next[i] {
				p.g.work++
				around[id] = append(around[id], i)
			}
		}
		for _, i := range endAt[b] {
			next[prev[i]], prev[next[i]] = next[i], prev[i]
		}
	}
	p.headAt, p.labelAt = map[int]int{}, map[int]int{}
	p.chain = make([][]int, len(p.sites))
	for id := range p.sites {
		for _, i := range around[id] {
			l := loops[i]
			start := firstInstr(p.g, l.h)
			if start < 0 {
				continue
			}
			k, ok := p.headAt[start]
			if !ok {
				k = len(p.heads)
				p.headAt[start] = k
				p.labelAt[p.g.Blocks[l.h].Start] = k
				p.heads = append(p.heads, midHead{})
			}
			p.heads[k].sites = append(p.heads[k].sites, id)
			p.chain[id] = append(p.chain[id], k)
		}
	}
}

// headDispatch is what goes before body statement i: before a loop header's block, the label
// the resume path enters it by (it falls into the header, so the header stays the loop's only
// entry); before the header's first instruction, the dispatch: a resume in progress (qRes)
// goes on towards its site, a normal iteration falls through.
func (p *midPlan) headDispatch(i int, L func(string) string) []string {
	if p == nil {
		return nil
	}
	var out []string
	if k, ok := p.labelAt[i]; ok {
		out = append(out, L(fmt.Sprintf("lh%d", k))+":")
	}
	if k, ok := p.headAt[i]; ok {
		out = append(out, "@"+qRes+" "+p.braR()+" \t"+L(fmt.Sprintf("hd%d", k))+";")
	}
	return out
}

// blockDispatch is the top of the twin's block loop: a resume in progress goes on towards its site.
func (p *midPlan) blockDispatch(L func(string) string) string {
	return "@" + qRes + " " + p.braR() + " \t" + L("hdb") + ";"
}

// braR is the branch of the resume path: uniform where the CTA resumes at one site, divergent
// where each thread goes to its own (thread-loops; a done thread does not come at all).
func (p *midPlan) braR() string {
	if p.thread {
		return "bra"
	}
	return "bra.uni"
}

// resumeDispatch is the tail's part of the resume path: at the block loop's header (hdb) and at
// each body loop header (hdK), the next hop of the site being resumed (mSite): the next inner
// header, or the site itself (qRes cleared).
func (p *midPlan) resumeDispatch(L func(string) string) []string {
	all := make([]int, len(p.sites))
	for id := range all {
		all[id] = id
	}
	var out []string
	hop := func(name string, k int, sites []int) {
		out = append(out, L(name)+":")
		var landings []string
		for _, id := range sites {
			// The hop after header k in the site's chain (k < 0: the block loop, before the chain).
			c, next, at := p.chain[id], "", slices.Index(p.chain[id], k)
			if at+1 < len(c) {
				next = L(fmt.Sprintf("lh%d", c[at+1]))
			}
			if next == "" {
				next = L(fmt.Sprintf("hz%s_%d", name[2:], id))
				landings = append(landings, next+":", "mov.pred \t"+qRes+", 0;")
				if p.thread {
					landings = append(landings, fmt.Sprintf("mov.u32 \t%s, %d;", mSite, uint32(StatusDone)))
				}
				landings = append(landings, p.braR()+" \t"+L(fmt.Sprintf("at%d", id))+";")
			}
			out = append(out, fmt.Sprintf("setp.eq.u32 \t%s, %s, %d;", qT, mSite, id), "@"+qT+" "+p.braR()+" \t"+next+";")
		}
		out = append(out, "trap;")
		out = append(out, landings...)
	}
	if p.thread {
		// hdb: a done thread of a resumed block (no site) goes to the block's end.
		out = append(out, L("hdb")+":",
			fmt.Sprintf("setp.eq.u32 \t%s, %s, %d;", qT, mSite, uint32(StatusDone)),
			"@"+qT+" bra \t"+L("hdone")+";")
		hop("hdb2", -1, all)
		out = append(out, L("hdone")+":", "mov.pred \t"+qRes+", 0;", "bra \t"+L("next")+";")
	} else {
		hop("hdb", -1, all)
	}
	for k, h := range p.heads {
		hop(fmt.Sprintf("hd%d", k), k, h.sites)
	}
	return out
}

// Registers of the mid-block code (besides the scheduler's, transform.go).
const (
	qMid  = "%ptxmig_q0" // mid-block stops enabled (v3 block with a save area that fits): uniform
	qV    = "%ptxmig_q1" // the leader's vote
	qStop = "%ptxmig_q2" // the CTA's vote
	qT    = "%ptxmig_q3"
	qRes  = "%ptxmig_q4" // a resume is on its way to its site through the loop headers (uniform)
	mA    = "%ptxmig_m0"
	mB    = "%ptxmig_m1"
	mC    = "%ptxmig_m2"
	mThr  = "%ptxmig_m3" // threads per CTA
	mTid  = "%ptxmig_m4" // linear thread index
	mSite = "%ptxmig_m5"
	mAct  = "%ptxmig_m6" // the published action: 0 batch, r+1 resume record r, | 1<<31 forward it
	mPoll = "%ptxmig_m7" // loop-header visits since the last vote (uniform)
	mOff  = "%ptxmig_m8"
	mStep = "%ptxmig_m9"
	mSh   = "%ptxmig_m10"
	mVal  = "%ptxmig_m11"
	mRB   = "%ptxmig_m12" // record bytes
	dRec  = "%ptxmig_md0" // this thread's record (save or resume)
	dA    = "%ptxmig_md1"
	dB    = "%ptxmig_md2"
	dSh   = "%ptxmig_md3" // the record's shared part
	dDst  = "%ptxmig_md4" // forward destination
	dG    = "%ptxmig_md5"
	// thread-loop twins and clock rebasing only
	uVis = "%ptxmig_u0" // this thread's polls in this launch (force_visit counts them)
	uFrc = "%ptxmig_u1" // force_visit as read at the start of the launch (0: none)
	uT   = "%ptxmig_u2"
	udT  = "%ptxmig_ud0"
	udT2 = "%ptxmig_ud1"
)

func (p *midPlan) decls() []string {
	out := []string{
		".reg .pred \t%ptxmig_q<5>;",
		".reg .b32 \t%ptxmig_m<13>;",
		".reg .b64 \t%ptxmig_md<6>;",
	}
	if p.thread || p.rebase {
		out = append(out, ".reg .b32 \t%ptxmig_u<3>;", ".reg .b64 \t%ptxmig_ud<2>;")
	}
	return out
}

func ctlAt(off int) string { return fmt.Sprintf("[%s+%d]", rCtl, off) }
func shAt(off int) string  { return fmt.Sprintf("[%s+%d]", rSlot, off) }

// threads computes mThr and mTid (every thread).
func threadIndex() []string {
	return []string{
		"mov.u32 \t" + mThr + ", %ntid.x;",
		"mov.u32 \t" + mA + ", %ntid.y;",
		"mov.u32 \t" + mB + ", %tid.z;",
		"mov.u32 \t" + mTid + ", %tid.y;",
		"mad.lo.u32 \t" + mB + ", " + mB + ", " + mA + ", " + mTid + ";",
		"mov.u32 \t" + mTid + ", %tid.x;",
		"mad.lo.u32 \t" + mTid + ", " + mB + ", " + mThr + ", " + mTid + ";",
		"mul.lo.u32 \t" + mThr + ", " + mThr + ", " + mA + ";",
		"mov.u32 \t" + mA + ", %ntid.z;",
		"mul.lo.u32 \t" + mThr + ", " + mThr + ", " + mA + ";",
	}
}

// prologue (every thread, after the scheduler's common set-up): decides qMid.
func (p *midPlan) prologue() []string {
	need := p.layout
	perThread := 8*need.Slots + need.LocalBytes
	out := []string{
		"// ptxmig: mid-block stops need a version-3 control block with a save area whose records fit",
		"mov.u32 \t" + rFlag + ", 0;",
		"// the first site visit of a CTA votes (the counter starts past every poll interval):",
		"// a CTA that runs fewer site visits than an interval can still stop inside its block",
		fmt.Sprintf("mov.u32 \t%s, %d;", mPoll, firstVote),
		"mov.pred \t" + qRes + ", 0;",
		fmt.Sprintf("ld.global.u32 \t%s, %s;", mA, ctlAt(CtlOffVersion)),
		fmt.Sprintf("setp.ge.u32 \t%s, %s, %d;", qMid, mA, CtlVersionMidBlock),
		fmt.Sprintf("@%s ld.global.u64 \t%s, %s;", qMid, dA, ctlAt(CtlOffSaveArea)),
		fmt.Sprintf("@%s setp.ne.u64 \t%s, %s, 0;", qMid, qMid, dA),
	}
	out = append(out, threadIndex()...)
	out = append(out,
		"// record bytes needed: 64 + (8 x slots + local) x threads + static shared (+ dynamic shared)",
		fmt.Sprintf("mul.wide.u32 \t%s, %s, %d;", dA, mThr, perThread),
		fmt.Sprintf("add.u64 \t%s, %s, %d;", dA, dA, 64+need.StaticSharedBytes),
	)
	if p.dyn != "" {
		out = append(out,
			"mov.u32 \t"+mA+", %dynamic_smem_size;",
			"cvt.u64.u32 \t"+dB+", "+mA+";",
			"add.u64 \t"+dA+", "+dA+", "+dB+";",
		)
	}
	out = append(out,
		fmt.Sprintf("@%s ld.global.u32 \t%s, %s;", qMid, mA, ctlAt(CtlOffRecordBytes)),
		"@"+qMid+" cvt.u64.u32 \t"+dB+", "+mA+";",
		"@"+qMid+" setp.le.u64 \t"+qMid+", "+dA+", "+dB+";",
		"@"+qMid+" and.b32 \t"+mA+", "+mA+", 15;",
		"@"+qMid+" setp.eq.u32 \t"+qMid+", "+mA+", 0;",
	)
	if p.thread {
		out = append(out,
			"// thread-loops: no site stopped at yet; each thread counts its own polls",
			fmt.Sprintf("mov.u32 \t%s, %d;", mSite, uint32(StatusDone)),
			"mov.u32 \t"+uVis+", 0;",
			"mov.u32 \t"+uFrc+", 0;",
			fmt.Sprintf("@%s ld.global.u32 \t%s, %s;", qMid, uFrc, ctlAt(CtlOffForceVisit)),
		)
	}
	return out
}

// leaderPrologue (leader, before the first claim): the vote counters; with qMid the first claim
// is deferred to the claim step, which takes records to resume before claiming new blocks.
func (p *midPlan) leaderPrologue(claimLabel string) []string {
	return []string{
		"mov.u32 \t" + mA + ", 0;",
		"st.shared.u32 \t" + shAt(shVisit) + ", " + mA + ";",
		fmt.Sprintf("@%s ld.global.u32 \t%s, %s;", qMid, mA, ctlAt(CtlOffForceVisit)),
		"st.shared.u32 \t" + shAt(shForce) + ", " + mA + ";",
		"st.shared.u32 \t" + shAt(shRec) + ", " + mA + ";",
		"mov.u64 \t" + rPend + ", -2;",
		"mov.u64 \t" + rG + ", 0;",
		"st.shared.u64 \t" + shAt(shPendG) + ", " + rG + ";",
		"@" + qMid + " bra \t" + claimLabel + ";",
	}
}

// claimStep (leader, at the claim step, before a deferred or new claim): with no claim in flight,
// take a record to resume (or, with the flag set, to forward) and publish it instead of a batch.
func (p *midPlan) claimStep(L func(string) string) []string {
	return []string{
		"// ptxmig: a claim in flight that got blocks is published as it is; with none (also one",
		"// that came back past the end: another CTA took the rest) records to resume come first,",
		"// or a launch with fewer CTAs than records would end with records left",
		"ld.shared.u64 \t" + rT64a + ", " + shAt(shTotal) + ";",
		"setp.lt.u64 \t" + pT + ", " + rPend + ", " + rT64a + ";",
		"@" + pT + " bra \t" + L("ready") + ";",
		"@!" + qMid + " bra \t" + L("norec") + ";",
		fmt.Sprintf("ld.volatile.global.u32 \t%s, %s;", mA, ctlAt(CtlOffResumeCount)),
		fmt.Sprintf("ld.volatile.global.u32 \t%s, %s;", mB, ctlAt(CtlOffResumeCursor)),
		"setp.ge.u32 \t" + pT + ", " + mB + ", " + mA + ";",
		"@" + pT + " bra \t" + L("norec") + ";",
		fmt.Sprintf("atom.global.add.u32 \t%s, %s, 1;", mB, ctlAt(CtlOffResumeCursor)),
		"setp.ge.u32 \t" + pT + ", " + mB + ", " + mA + ";",
		"@" + pT + " bra \t" + L("norec") + ";",
		"add.u32 \t" + mB + ", " + mB + ", 1;",
		fmt.Sprintf("ld.volatile.global.u32 \t%s, %s;", rFlag, ctlAt(CtlOffPreempt)),
		"setp.eq.u32 \t" + pT + ", " + rFlag + ", 0;",
		"@" + pT + " bra \t" + L("pubrec") + ";",
		"// the flag is set: forward the record to the save area unchanged (resume it if that is full)",
		fmt.Sprintf("atom.global.add.u32 \t%s, %s, 1;", mA, ctlAt(CtlOffSaved)),
		fmt.Sprintf("ld.global.u32 \t%s, %s;", mC, ctlAt(CtlOffSaveCapacity)),
		"setp.ge.u32 \t" + pT + ", " + mA + ", " + mC + ";",
		"@" + pT + " bra \t" + L("pubrec") + ";",
		"st.shared.u32 \t" + shAt(shFwd) + ", " + mA + ";",
		"or.b32 \t" + mB + ", " + mB + ", -2147483648;",
		fmt.Sprintf("red.global.or.b32 \t%s, %d;", ctlAt(CtlOffStatus), CtlStatusPreempted),
		L("pubrec") + ":",
		"add.u32 \t" + rAddr + ", " + rSlot + ", " + rPar + ";",
		"mov.u64 \t" + rT64a + ", 0;",
		"st.shared.v2.u64 \t[" + rAddr + "], {" + rT64a + ", " + rT64a + "};",
		"st.shared.u32 \t[" + rAddr + "+28], " + mB + ";",
		"bra \t" + L("wait") + ";",
		L("norec") + ":",
	}
}

// vote is the site's stop decision: the leader's vote, through a CTA-wide barrier with the
// operand barID ("0" for a loop site) in the given flavour, then a branch to the site's save.
func (p *midPlan) vote(id int, barID string, aligned bool, L func(string) string) []string {
	red := "bar.red.or.pred"
	if !aligned {
		red = "barrier.red.or.pred"
	}
	return []string{
		fmt.Sprintf("// ptxmig: mid-block site %d: the leader votes to stop (flag set, or the forced visit)", id),
		"setp.ne.and.u32 \t" + qV + ", " + rFlag + ", 0, " + pLead + ";",
		"@" + pLead + " ld.shared.u32 \t" + mA + ", " + shAt(shVisit) + ";",
		"@" + pLead + " add.u32 \t" + mA + ", " + mA + ", 1;",
		"@" + pLead + " st.shared.u32 \t" + shAt(shVisit) + ", " + mA + ";",
		"@" + pLead + " ld.shared.u32 \t" + mB + ", " + shAt(shForce) + ";",
		"@" + pLead + " setp.eq.or.u32 \t" + qV + ", " + mA + ", " + mB + ", " + qV + ";",
		"and.pred \t" + qV + ", " + qV + ", " + qMid + ";",
		"// a stop needs a record: reserved before the vote, which publishes it to the CTA",
		fmt.Sprintf("@%s atom.global.add.u32 \t%s, %s, 1;", qV, mA, ctlAt(CtlOffSaved)),
		fmt.Sprintf("@%s ld.global.u32 \t%s, %s;", qV, mB, ctlAt(CtlOffSaveCapacity)),
		"@" + qV + " setp.lt.u32 \t" + qV + ", " + mA + ", " + mB + ";",
		"@" + qV + " st.shared.u32 \t" + shAt(shRec) + ", " + mA + ";",
		red + " \t" + qStop + ", " + barID + ", " + qV + ";",
		"// warp 0 loads the flag (the leader's copy is used): a load by the leader alone would leave",
		"// warp 0 split for the rest of the body",
		"@" + pWarp0 + " ld.param.u64 \t" + rCtl + ", [" + CtlParam + "];",
		"@" + pWarp0 + " cvta.to.global.u64 \t" + rCtl + ", " + rCtl + ";",
		fmt.Sprintf("@%s ld.volatile.global.u32 \t%s, %s;", pWarp0, rFlag, ctlAt(CtlOffPreempt)),
		"@" + qStop + " bra.uni \t" + L(fmt.Sprintf("sv%d", id)) + ";",
	}
}

// firstVote starts the poll counter of a CTA past the largest interval (pollEvery's 1024).
const firstVote = 1 << 30

// count counts a site visit (every thread: uniform) and branches to skip unless this visit votes:
// every PollEvery visits of sites, none while mid-block stops are disabled. A vote is a CTA-wide
// barrier and, for the leader, waits for the flag it loaded at the previous vote: polling keeps
// both off the common path (a barrier-dense loop on an H100 ran 3.8x slower voting at every
// barrier).
func (p *midPlan) count(every int, skip string) []string {
	return []string{
		"add.u32 \t" + mPoll + ", " + mPoll + ", 1;",
		fmt.Sprintf("setp.lt.u32 \t%s, %s, %d;", qT, mPoll, every),
		"@" + qT + " bra.uni \t" + skip + ";",
		"mov.u32 \t" + mPoll + ", 0;",
		"@!" + qMid + " bra.uni \t" + skip + ";",
	}
}

// poll is a loop site: a vote every PollEvery site visits.
func (p *midPlan) poll(id, every int, aligned bool, L func(string) string) []string {
	return append(p.count(every, L(fmt.Sprintf("at%d", id))), p.vote(id, "0", aligned, L)...)
}

// copyLoop copies n bytes (a constant, or the register nReg when nReg != "") in units of unit
// bytes, each thread every threads-th unit, between shared memory at the 32-bit address in mSh
// and global memory at dG; toGlobal picks the direction.
func copyLoop(id string, n int, nReg string, unit int, toGlobal bool, L func(string) string) []string {
	ty := ".b32"
	if unit == 1 {
		ty = ".b8"
	}
	lim := fmt.Sprint(n)
	if nReg != "" {
		lim = nReg
	}
	out := []string{
		fmt.Sprintf("mul.lo.u32 \t%s, %s, %d;", mOff, mTid, unit),
		fmt.Sprintf("mul.lo.u32 \t%s, %s, %d;", mStep, mThr, unit),
		L("cp"+id) + ":",
		"setp.ge.u32 \t" + qT + ", " + mOff + ", " + lim + ";",
		"@" + qT + " bra \t" + L("cpd"+id) + ";",
		"add.u32 \t" + mA + ", " + mSh + ", " + mOff + ";",
		"cvt.u64.u32 \t" + dA + ", " + mOff + ";",
		"add.u64 \t" + dA + ", " + dA + ", " + dG + ";",
	}
	if toGlobal {
		out = append(out, "ld.shared"+ty+" \t"+mVal+", ["+mA+"];", "st.global"+ty+" \t["+dA+"], "+mVal+";")
	} else {
		out = append(out, "ld.global"+ty+" \t"+mVal+", ["+dA+"];", "st.shared"+ty+" \t["+mA+"], "+mVal+";")
	}
	return append(out,
		"add.u32 \t"+mOff+", "+mOff+", "+mStep+";",
		"bra \t"+L("cp"+id)+";",
		L("cpd"+id)+":",
	)
}

// sharedCopy copies the kernel's shared memory to (or from) the record at dRec.
func (p *midPlan) sharedCopy(tag string, toGlobal bool, L func(string) string) []string {
	out := []string{
		fmt.Sprintf("mul.wide.u32 \t%s, %s, %d;", dSh, mThr, 8*p.layout.Slots+p.layout.LocalBytes),
		"add.u64 \t" + dSh + ", " + dSh + ", " + dRec + ";",
		"add.u64 \t" + dSh + ", " + dSh + ", 64;",
	}
	if p.local.name != "" {
		// This thread's depot, after the register slots: thread t at t x LocalBytes.
		ty := ".b32"
		if p.local.unit == 1 {
			ty = ".b8"
		}
		out = append(out,
			fmt.Sprintf("mul.wide.u32 \t%s, %s, %d;", dG, mThr, 8*p.layout.Slots),
			"add.u64 \t"+dG+", "+dG+", "+dRec+";",
			fmt.Sprintf("mad.wide.u32 \t%s, %s, %d, %s;", dG, mTid, p.layout.LocalBytes, dG),
			"add.u64 \t"+dG+", "+dG+", 64;",
			"mov.u64 \t"+dB+", "+p.local.name+";",
		)
		for off := 0; off < p.local.bytes; off += p.local.unit {
			if toGlobal {
				out = append(out, fmt.Sprintf("ld.local%s \t%s, [%s+%d];", ty, mVal, dB, off), fmt.Sprintf("st.global%s \t[%s+%d], %s;", ty, dG, off, mVal))
			} else {
				out = append(out, fmt.Sprintf("ld.global%s \t%s, [%s+%d];", ty, mVal, dG, off), fmt.Sprintf("st.local%s \t[%s+%d], %s;", ty, dB, off, mVal))
			}
		}
	}
	for i, v := range p.statics {
		out = append(out,
			"mov.u32 \t"+mSh+", "+v.name+";",
			fmt.Sprintf("add.u64 \t%s, %s, %d;", dG, dSh, v.off),
		)
		out = append(out, copyLoop(fmt.Sprintf("%s%d", tag, i), v.bytes/v.unit*v.unit, "", v.unit, toGlobal, L)...)
	}
	if p.dyn != "" {
		out = append(out,
			"mov.u32 \t"+mSh+", "+p.dyn+";",
			fmt.Sprintf("add.u64 \t%s, %s, %d;", dG, dSh, p.layout.StaticSharedBytes),
			"mov.u32 \t"+mC+", %dynamic_smem_size;",
		)
		out = append(out, copyLoop(tag+"d", 0, mC, 1, toGlobal, L)...)
	}
	return out
}

// regAccess stores (or loads) the site's live registers, slot j of this thread at dA + j*dB.
func (p *midPlan) regAccess(s MidBlockSite, store bool) []string {
	var out []string
	for j, r := range s.live {
		name, typ := regKeyName(p.g.regNames[r]), p.g.regTypes[r]
		st := saveType(typ)
		if j > 0 {
			out = append(out, "add.u64 \t"+dA+", "+dA+", "+dB+";")
		}
		if c, ok := s.rebase[r]; ok {
			out = append(out, rebaseAccess(name, c, store)...)
			continue
		}
		switch {
		case typ == ".pred" && store:
			out = append(out, "selp.u32 \t"+mVal+", 1, 0, "+name+";", "st.global.b32 \t["+dA+"], "+mVal+";")
		case typ == ".pred":
			out = append(out, "ld.global.b32 \t"+mVal+", ["+dA+"];", "setp.ne.u32 \t"+name+", "+mVal+", 0;")
		case store:
			out = append(out, "st.global"+st+" \t["+dA+"], "+name+";")
		default:
			out = append(out, "ld.global"+st+" \t"+name+", ["+dA+"];")
		}
	}
	return out
}

// rebaseAccess saves a clock reading (register name, class c) as its distance from the clock now,
// or restores it as the clock now plus that distance, at dA (timebase.go).
func rebaseAccess(name string, c timeClass, store bool) []string {
	t, a, b, st := "u64", udT, udT2, "b64"
	if c.bytes() == 4 {
		t, a, b, st = "u32", uT, mVal, "b32"
	}
	src := c.timeSource()
	if store {
		return []string{
			"mov." + t + " \t" + a + ", " + src + ";",
			"sub." + t + " \t" + a + ", " + name + ", " + a + ";",
			"st.global." + st + " \t[" + dA + "], " + a + ";",
		}
	}
	return []string{
		"ld.global." + st + " \t" + a + ", [" + dA + "];",
		"mov." + t + " \t" + b + ", " + src + ";",
		"add." + t + " \t" + name + ", " + a + ", " + b + ";",
	}
}

// slotAddr sets dA to slot 0 of this thread in the record at dRec and dB to the slot stride.
func slotAddr() []string {
	return []string{
		"mul.wide.u32 \t" + dA + ", " + mTid + ", 8;",
		"add.u64 \t" + dA + ", " + dA + ", " + dRec + ";",
		"add.u64 \t" + dA + ", " + dA + ", 64;",
		"mul.wide.u32 \t" + dB + ", " + mThr + ", 8;",
	}
}

// recordAt sets dRec to record idxReg of the area at ctl offset areaOff (mRB: record bytes).
func recordAt(idxReg string, areaOff int) []string {
	return []string{
		fmt.Sprintf("ld.global.u64 \t%s, %s;", dRec, ctlAt(areaOff)),
		fmt.Sprintf("ld.global.u32 \t%s, %s;", mRB, ctlAt(CtlOffRecordBytes)),
		"mul.wide.u32 \t" + dA + ", " + idxReg + ", " + mRB + ";",
		"add.u64 \t" + dRec + ", " + dRec + ", " + dA + ";",
	}
}

// voteSave is the save of a CTA that voted to stop at site k (every thread): its registers.
func (p *midPlan) voteSave(L func(string) string) []string {
	out := []string{"// ptxmig: mid-block save (every thread of a CTA that voted to stop at site k)"}
	for id := range p.sites {
		out = append(out,
			L(fmt.Sprintf("sv%d", id))+":",
			fmt.Sprintf("mov.u32 \t%s, %d;", mSite, id),
			"bra.uni \t"+L("save")+";",
		)
	}
	out = append(out, L("save")+":")
	out = append(out, loadCtlLines()...)
	out = append(out, "ld.shared.u32 \t"+mA+", "+shAt(shRec)+";")
	out = append(out, recordAt(mA, CtlOffSaveArea)...)
	out = append(out, threadIndex()...)
	out = append(out, slotAddr()...)
	for id := range p.sites {
		out = append(out, fmt.Sprintf("setp.eq.u32 \t%s, %s, %d;", qT, mSite, id), "@"+qT+" bra.uni \t"+L(fmt.Sprintf("st%d", id))+";")
	}
	for id, s := range p.sites {
		out = append(out, L(fmt.Sprintf("st%d", id))+":")
		out = append(out, p.regAccess(s, true)...)
		out = append(out, "bra.uni \t"+L("saved")+";")
	}
	return out
}

// threadSave is the save of a thread-loop twin's block in which a thread stopped, reached by every
// thread from the block's end: the leader reserves a record; each thread writes its status and,
// if it stopped, its registers; with the save area full the stopped threads go back to their
// sites instead.
func (p *midPlan) threadSave(bar string, L func(string) string) []string {
	lead := "@" + pLead + " "
	out := []string{"// ptxmig: thread-loop save (every thread: a thread of this block stopped)", L("tstop") + ":"}
	out = append(out, loadCtlLines()...)
	out = append(out,
		fmt.Sprintf("%satom.global.add.u32 \t%s, %s, 1;", lead, mA, ctlAt(CtlOffSaved)),
		fmt.Sprintf("%sld.global.u32 \t%s, %s;", lead, mB, ctlAt(CtlOffSaveCapacity)),
		"setp.ge.and.u32 \t"+qT+", "+mA+", "+mB+", "+pLead+";",
		fmt.Sprintf("@%s mov.u32 \t%s, %d;", qT, mA, uint32(recRefused)),
		lead+"st.shared.u32 \t"+shAt(shRec)+", "+mA+";",
		bar,
		"ld.shared.u32 \t"+mA+", "+shAt(shRec)+";",
		fmt.Sprintf("setp.eq.u32 \t%s, %s, %d;", qT, mA, uint32(recRefused)),
		"@"+qT+" bra.uni \t"+L("tfull")+";",
	)
	out = append(out, recordAt(mA, CtlOffSaveArea)...)
	out = append(out, threadIndex()...)
	out = append(out, p.statusAddr()...)
	out = append(out, "st.global.u32 \t["+dG+"], "+mSite+";")
	out = append(out, slotAddr()...)
	out = append(out, fmt.Sprintf("setp.eq.u32 \t%s, %s, %d;", qT, mSite, uint32(StatusDone)), "@"+qT+" bra \t"+L("tsaved")+";")
	for id := range p.sites {
		out = append(out, fmt.Sprintf("setp.eq.u32 \t%s, %s, %d;", qT, mSite, id), "@"+qT+" bra \t"+L(fmt.Sprintf("st%d", id))+";")
	}
	out = append(out, "trap;")
	for id, s := range p.sites {
		out = append(out, L(fmt.Sprintf("st%d", id))+":")
		out = append(out, p.regAccess(s, true)...)
		out = append(out, "bra \t"+L("tsaved")+";")
	}
	return append(out,
		L("tsaved")+":",
		fmt.Sprintf("mov.u32 \t%s, %d;", mSite, uint32(RecordThreadSites)),
		"bra \t"+L("saved")+";",
		"// the save area is full: no more stops in this CTA for the rest of the launch; the threads",
		"// that stopped go back to their sites with their registers as they are",
		L("tfull")+":",
		"mov.pred \t"+qMid+", 0;",
		"// every thread clears the mark (a store by the leader alone would split warp 0)",
		"mov.u32 \t"+mVal+", 0;",
		"st.shared.u32 \t"+shAt(shStop)+", "+mVal+";",
		fmt.Sprintf("setp.eq.u32 \t%s, %s, %d;", qT, mSite, uint32(StatusDone)),
		"@"+qT+" bra \t"+L("next")+";",
		"mov.pred \t"+qRes+", 1;",
		"bra \t"+L("block")+";",
	)
}

// statusAddr sets dG to this thread's status word in the record at dRec: the last register slot.
func (p *midPlan) statusAddr() []string {
	return []string{
		fmt.Sprintf("mul.wide.u32 \t%s, %s, %d;", dG, mThr, 8*(p.layout.Slots-1)),
		"add.u64 \t" + dG + ", " + dG + ", " + dRec + ";",
		"mad.wide.u32 \t" + dG + ", " + mTid + ", 8, " + dG + ";",
		"add.u64 \t" + dG + ", " + dG + ", 64;",
	}
}

// threadPoll is a thread-loop site: every PollEvery visits this thread reads the flag (and counts
// a poll for force_visit); one that stops marks the block stopped and leaves for the block's end
// with its live registers as they are (they are saved there).
func (p *midPlan) threadPoll(id, every int, L func(string) string) []string {
	at := L(fmt.Sprintf("at%d", id))
	return []string{
		fmt.Sprintf("// ptxmig: thread-loop site %d: this thread polls the flag (or its forced poll)", id),
		"add.u32 \t" + mPoll + ", " + mPoll + ", 1;",
		fmt.Sprintf("setp.lt.u32 \t%s, %s, %d;", qT, mPoll, every),
		"@" + qT + " bra \t" + at + ";",
		"mov.u32 \t" + mPoll + ", 0;",
		"@!" + qMid + " bra \t" + at + ";",
		"add.u32 \t" + uVis + ", " + uVis + ", 1;",
		"setp.eq.u32 \t" + qV + ", " + uVis + ", " + uFrc + ";",
		"ld.param.u64 \t" + dG + ", [" + CtlParam + "];",
		"cvta.to.global.u64 \t" + dG + ", " + dG + ";",
		fmt.Sprintf("ld.volatile.global.u32 \t%s, [%s+%d];", mA, dG, CtlOffPreempt),
		"setp.ne.or.u32 \t" + qV + ", " + mA + ", 0, " + qV + ";",
		"@!" + qV + " bra \t" + at + ";",
		fmt.Sprintf("mov.u32 \t%s, %d;", mSite, id),
		"mov.u32 \t" + mA + ", 1;",
		"st.shared.u32 \t" + shAt(shStop) + ", " + mA + ";",
		"bra \t" + L("next") + ";",
	}
}

// blockEnd is what a thread-loop twin does at the end of each block (every thread): wait for the
// whole CTA, then save if a thread stopped. Nothing for other twins.
func (p *midPlan) blockEnd(bar string, L func(string) string) []string {
	if p == nil || !p.thread {
		return nil
	}
	return []string{
		"// ptxmig: every thread finished this block or stopped in it; save if one stopped",
		bar,
		"ld.shared.u32 \t" + mA + ", " + shAt(shStop) + ";",
		"setp.ne.u32 \t" + qT + ", " + mA + ", 0;",
		"@" + qT + " bra.uni \t" + L("tstop") + ";",
	}
}

// tail is the save, forward and resume code, after the twin's ret (reached only by branches).
func (p *midPlan) tail(bar, claimLabel string, drainAsync bool, L func(string) string) []string {
	var out []string
	if p.thread {
		out = p.threadSave(bar, L)
	} else {
		out = p.voteSave(L)
	}
	out = append(out, L("saved")+":")
	if drainAsync {
		out = append(out, "cp.async.wait_all;")
	}
	out = append(out, p.sharedCopy("s", true, L)...)
	if p.dyn != "" {
		out = append(out, "mov.u32 \t"+mC+", %dynamic_smem_size;")
	} else {
		out = append(out, "mov.u32 \t"+mC+", 0;")
	}
	lead := "@" + pLead + " "
	out = append(out,
		"// leader: the header; the batch's remaining blocks (this one included) and the claim in",
		"// flight go with the record, so this CTA counts them as not done and claims afresh",
		lead+"st.global.v4.u32 \t["+dRec+"], {"+mSite+", "+rCnt+", "+rCX+", "+rCY+"};",
		fmt.Sprintf("%smov.u32 \t%s, %d;", lead, mVal, RecordMagic),
		lead+"st.global.v2.u32 \t["+dRec+"+16], {"+rCZ+", "+mVal+"};",
		lead+"st.global.u64 \t["+dRec+"+24], "+rPend+";",
		lead+"ld.shared.u64 \t"+rT64a+", "+shAt(shPendG)+";",
		lead+"st.global.u64 \t["+dRec+"+32], "+rT64a+";",
		lead+"st.global.u64 \t["+dRec+"+40], "+rCur+";",
		lead+"mov.u64 \t"+rT64b+", 0;",
		lead+"st.global.u64 \t["+dRec+"+48], "+rT64b+";",
		lead+"st.global.v2.u32 \t["+dRec+"+56], {"+mC+", "+mThr+"};",
		lead+"ld.shared.u64 \t"+rT64a+", "+shAt(shDone)+";",
		lead+"cvt.u64.u32 \t"+rT64b+", "+rCnt+";",
		lead+"sub.u64 \t"+rT64a+", "+rT64a+", "+rT64b+";",
		lead+"st.shared.u64 \t"+shAt(shDone)+", "+rT64a+";",
		fmt.Sprintf("%sred.global.or.b32 \t%s, %d;", lead, ctlAt(CtlOffStatus), CtlStatusPreempted),
		lead+"mov.u64 \t"+rPend+", -2;",
	)
	if p.thread {
		out = append(out,
			lead+"mov.u32 \t"+mVal+", 0;",
			lead+"st.shared.u32 \t"+shAt(shStop)+", "+mVal+";",
			fmt.Sprintf("mov.u32 \t%s, %d;", mSite, uint32(StatusDone)),
		)
	}
	out = append(out,
		"// every thread has read its shared memory before any runs on",
		bar,
		"bra.uni \t"+claimLabel+";",
	)

	out = append(out, "// ptxmig: a record published at the claim step: forward it, or resume it", L("rec")+":")
	out = append(out, loadCtlLines()...)
	out = append(out,
		"and.b32 \t"+mA+", "+mAct+", 2147483647;",
		"sub.u32 \t"+mA+", "+mA+", 1;",
	)
	out = append(out, recordAt(mA, CtlOffResumeArea)...)
	out = append(out, threadIndex()...)
	out = append(out,
		"setp.lt.u32 \t"+qT+", "+mAct+", -2147483648;",
		"@"+qT+" bra.uni \t"+L("resume")+";",
		"ld.shared.u32 \t"+mA+", "+shAt(shFwd)+";",
		fmt.Sprintf("ld.global.u64 \t%s, %s;", dDst, ctlAt(CtlOffSaveArea)),
		"mul.wide.u32 \t"+dA+", "+mA+", "+mRB+";",
		"add.u64 \t"+dDst+", "+dDst+", "+dA+";",
		"mul.lo.u32 \t"+mOff+", "+mTid+", 4;",
		"mul.lo.u32 \t"+mStep+", "+mThr+", 4;",
		L("fw")+":",
		"setp.ge.u32 \t"+qT+", "+mOff+", "+mRB+";",
		"@"+qT+" bra \t"+L("fwd")+";",
		"cvt.u64.u32 \t"+dA+", "+mOff+";",
		"add.u64 \t"+dB+", "+dA+", "+dRec+";",
		"ld.global.b32 \t"+mVal+", ["+dB+"];",
		"add.u64 \t"+dB+", "+dA+", "+dDst+";",
		"st.global.b32 \t["+dB+"], "+mVal+";",
		"add.u32 \t"+mOff+", "+mOff+", "+mStep+";",
		"bra \t"+L("fw")+";",
		L("fwd")+":",
		bar,
		"bra.uni \t"+claimLabel+";",
		L("resume")+":",
	)
	out = append(out, p.sharedCopy("r", false, L)...)
	out = append(out,
		"ld.global.v4.u32 \t{"+mSite+", "+rCnt+", "+rCX+", "+rCY+"}, ["+dRec+"];",
		"ld.global.v2.u32 \t{"+rCZ+", "+mVal+"}, ["+dRec+"+16];",
		fmt.Sprintf("setp.ne.u32 \t%s, %s, %d;", qT, mVal, RecordMagic),
		"@"+qT+" trap;",
		"mov.u32 \t"+mPoll+", 0;",
		"// leader: the claim in flight comes back; one the flag had stopped is made again later",
		lead+"ld.global.u64 \t"+rPend+", ["+dRec+"+24];",
		lead+"ld.global.u64 \t"+rT64a+", ["+dRec+"+32];",
		lead+"st.shared.u64 \t"+shAt(shPendG)+", "+rT64a+";",
		lead+"ld.global.u64 \t"+rCur+", ["+dRec+"+40];",
		"setp.eq.and.u64 \t"+qT+", "+rPend+", -1, "+pLead+";",
		"@"+qT+" mov.u64 \t"+rPend+", -2;",
		lead+"ld.shared.u64 \t"+rT64a+", "+shAt(shDone)+";",
		lead+"cvt.u64.u32 \t"+rT64b+", "+rCnt+";",
		lead+"add.u64 \t"+rT64a+", "+rT64a+", "+rT64b+";",
		lead+"st.shared.u64 \t"+shAt(shDone)+", "+rT64a+";",
		fmt.Sprintf("%sld.volatile.global.u32 \t%s, %s;", lead, rFlag, ctlAt(CtlOffPreempt)),
		"// shared memory is whole before any thread reads it (the site's barrier did that)",
		bar,
	)
	out = append(out, slotAddr()...)
	if p.thread {
		out = append(out, "// each thread to its own site; one that had finished the block, to the block's end")
		out = append(out, p.statusAddr()...)
		out = append(out,
			"ld.global.u32 \t"+mSite+", ["+dG+"];",
			"// a done thread goes through the block loop's header too (hdb sends it to the block's",
			"// end): an edge from here into the block's end would make the loop irreducible",
			fmt.Sprintf("setp.eq.u32 \t%s, %s, %d;", qT, mSite, uint32(StatusDone)),
			"@"+qT+" mov.pred \t"+qRes+", 1;",
			"@"+qT+" bra \t"+L("block")+";",
		)
	}
	for id := range p.sites {
		out = append(out, fmt.Sprintf("setp.eq.u32 \t%s, %s, %d;", qT, mSite, id), "@"+qT+" "+p.braR()+" \t"+L(fmt.Sprintf("ld%d", id))+";")
	}
	out = append(out, "trap;")
	for id, s := range p.sites {
		out = append(out, L(fmt.Sprintf("ld%d", id))+":")
		out = append(out, p.regAccess(s, false)...)
		out = append(out, fmt.Sprintf("mov.u32 \t%s, %d;", mSite, id), "mov.pred \t"+qRes+", 1;", p.braR()+" \t"+L("block")+";")
	}
	return append(out, p.resumeDispatch(L)...)
}

func loadCtlLines() []string {
	return []string{"ld.param.u64 \t" + rCtl + ", [" + CtlParam + "];", "cvta.to.global.u64 \t" + rCtl + ", " + rCtl + ";"}
}

// descVar is the module variable that carries the layout for hosts (named after the kernel; the
// comment names the twin it describes).
func (p *midPlan) descVar(kernel, twin string) *Item {
	return &Item{Kind: ItemVar, Lead: "\n\n// ptxmig: mid-block record layout of " + twin + " {format 2, register slots, static shared bytes, sites, local bytes}\n",
		Text: fmt.Sprintf(".visible .global .align 4 .u32 %s%s[5] = {2, %d, %d, %d, %d};", MidDescPrefix, kernel, p.layout.Slots, p.layout.StaticSharedBytes, p.layout.Sites, p.layout.LocalBytes)}
}

// siteAligned reports whether a barrier site's own instruction is an aligned barrier.
func siteAligned(s *Stmt) bool {
	return s.Base() == "bar" || s.HasMod("aligned")
}

// barOperand is the barrier-id operand text of a site's barrier instruction.
func barOperand(s *Stmt) string {
	if len(s.Args) == 0 {
		return "0"
	}
	return strings.TrimSpace(s.Args[0].Text)
}

// siteAt reports the site id of body statement i (false for a nil plan).
func (p *midPlan) siteAt(i int) (int, bool) {
	if p == nil {
		return 0, false
	}
	id, ok := p.byIdx[i]
	return id, ok
}
