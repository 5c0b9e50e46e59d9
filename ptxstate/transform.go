package ptxstate

import (
	"fmt"
	"strings"
)

// Instrument adds a preemptible persistent-thread twin after every eligible kernel and returns
// the new module and the analysis (with refusals for the kernels left alone). The input module
// is not modified.
func Instrument(m *Module) (*Module, *Report, error) { return InstrumentWith(m, Options{}) }

// Options tune Instrument.
type Options struct {
	// MaxNReg caps the registers of a kernel's twin (by the kernel's name) with .maxnreg, for
	// kernels without a .maxnreg or .minnctapersm of their own: the twin's scheduler adds a few live values, and
	// ptxas, free to use more registers, can make the twin fit fewer CTAs per SM than its original
	// (matrixMul's 32x32 kernel: 40 registers against 32 at 1024 threads, half the CTAs). Given
	// the most registers that keep the original's occupancy (ptxas -v on the original,
	// internal/ptxas.Registers and SameOccupancyRegs), the twin keeps it; ptxas spills if it must.
	MaxNReg map[string]int
	// MidBlock gives kernels with eligible mid-block sites a version-3 twin that can also stop
	// inside a block, at those sites (midtwin.go). Such a twin runs with a version-2 control
	// block too, with mid-block stops disabled.
	MidBlock bool
	// MidBlockTwins keeps every twin block-granular (K__ptxmig, as without MidBlock) and gives a
	// kernel with eligible mid-block sites a second twin, the version-3 one, named
	// K + MidTwinInfix + TwinSuffix: the shim chooses per launch (a grid that fits in one wave
	// of resident blocks cannot stop between blocks, only inside them). Overrides MidBlock.
	MidBlockTwins bool
}

// MidTwinInfix names a kernel's second, mid-block twin (Options.MidBlockTwins): K_mid__ptxmig.
const MidTwinInfix = "_mid"

// InstrumentWith is Instrument with options.
func InstrumentWith(m *Module, o Options) (*Module, *Report, error) {
	out := &Module{Trailer: m.Trailer, Version: m.Version, Target: m.Target, AddressSize: m.AddressSize, src: m.src}
	r := &Report{Version: m.Version, Target: m.Target}
	a := newAnalyzer(m)
	for _, it := range m.Items {
		out.Items = append(out.Items, it)
		if it.Kind != ItemFunc || !it.Func.Entry || it.Func.Proto || strings.HasSuffix(it.Func.Name, TwinSuffix) {
			continue
		}
		kr, info, err := a.kernel(it.Func)
		if err != nil {
			return nil, nil, fmt.Errorf("kernel %s: %w", it.Func.Name, err)
		}
		if m.AddressSize != 64 && kr.Eligible {
			kr.Eligible, kr.Twin = false, ""
			kr.Refusals = append(kr.Refusals, fmt.Sprintf(".address_size %d: the control block needs 64-bit addresses", m.AddressSize))
		}
		if kr.Eligible {
			maxnreg := 0
			if n := o.MaxNReg[it.Func.Name]; n > 0 && it.Func.MaxNReg == 0 && it.Func.MinNCTAPerSM == 0 {
				maxnreg = max(n, minTwinRegs)
				kr.TwinMaxNReg = maxnreg
			}
			var mid *midPlan
			if o.MidBlock || o.MidBlockTwins {
				if mid = a.planMidBlock(it.Func, kr, info); mid != nil {
					l := mid.layout
					kr.MidBlock = &l
				}
			}
			name := it.Func.Name
			first := mid
			if o.MidBlockTwins {
				first = nil // the block-granular twin under the usual name
			}
			slot, twin, err := makeTwin(it.Func, info, maxnreg, first, name+TwinSuffix, slotPrefix+name)
			if err != nil {
				return nil, nil, fmt.Errorf("kernel %s: %w", name, err)
			}
			out.Items = append(out.Items, slot, twin)
			if o.MidBlockTwins && mid != nil {
				// K_mid__ptxmig must be free: neither defined, nor the twin of a kernel K_mid.
				n := name + MidTwinInfix + TwinSuffix
				_, defined := a.funcs[n]
				_, kernel := a.funcs[name+MidTwinInfix]
				if defined || kernel {
					kr.Notes = append(kr.Notes, "no mid-block twin: its name "+n+" is taken (defined in the module, or the twin of a kernel of that name)")
					kr.MidBlock, mid = nil, nil
				}
			}
			if o.MidBlockTwins && mid != nil {
				kr.MidTwin = name + MidTwinInfix + TwinSuffix
				slot, twin, err := makeTwin(it.Func, info, maxnreg, mid, kr.MidTwin, slotPrefix+name+MidTwinInfix)
				if err != nil {
					return nil, nil, fmt.Errorf("kernel %s: mid-block twin: %w", name, err)
				}
				out.Items = append(out.Items, slot, twin)
			}
			if mid != nil {
				described := name + TwinSuffix
				if kr.MidTwin != "" {
					described = kr.MidTwin
				}
				out.Items = append(out.Items, mid.descVar(name, described))
			}
		}
		r.Kernels = append(r.Kernels, *kr)
	}
	return out, r, nil
}

// rewriteStmt returns s's text with tokens replaced (token index -> new text).
func rewriteStmt(s *Stmt, repl map[int]string) string {
	if len(repl) == 0 {
		return s.Text
	}
	base := s.toks[0].Off
	var b strings.Builder
	pos := 0
	for i, t := range s.toks {
		if r, ok := repl[i]; ok {
			b.WriteString(s.Text[pos : t.Off-base])
			b.WriteString(r)
			pos = t.End - base
		}
	}
	b.WriteString(s.Text[pos:])
	return b.String()
}

// Registers of the twin's scheduler (declared as ranges, so they cannot collide with nvcc's).
// Only vb, cnt, par, the virtual grid and the leader's in-flight claim and flag stay live across
// the body; the rest of the leader's state is in shared memory (see shSlots...).
const (
	rCtl    = "%ptxmig_rd0" // control block (global address); reloaded from the parameter where needed
	rVB     = "%ptxmig_rd1" // first virtual block of a batch
	rPend   = "%ptxmig_rd2" // leader: first block of the claim in flight (atom result), ~0 if none
	rT64a   = "%ptxmig_rd3"
	rT64b   = "%ptxmig_rd4"
	rT64c   = "%ptxmig_rd5"
	rCur    = "%ptxmig_rd6" // leader: end of the last batch seen (claim position estimate)
	rG      = "%ptxmig_rd7" // leader: claim size
	rGX     = "%ptxmig_r0"  // original grid
	rGY     = "%ptxmig_r1"
	rGZ     = "%ptxmig_r2"
	rTmp    = "%ptxmig_r3"
	rTmp2   = "%ptxmig_r4"
	rPar    = "%ptxmig_r5" // parity slot byte offset: 0 or slotStride
	rFlag   = "%ptxmig_r6" // leader: preempt flag, loaded during each batch's last block
	rSlot   = "%ptxmig_r7" // shared address of the scheduler state
	rCnt    = "%ptxmig_r8" // blocks left in the current batch, this one included
	rAddr   = "%ptxmig_r9"
	rCX     = "%ptxmig_r10" // virtual %ctaid
	rCY     = "%ptxmig_r11"
	rCZ     = "%ptxmig_r12"
	rV32    = "%ptxmig_r13"
	pLead   = "%ptxmig_p0"
	pT      = "%ptxmig_p1"
	pC      = "%ptxmig_p2"
	pFits32 = "%ptxmig_p3"
	pOneDim = "%ptxmig_p4"
	pS      = "%ptxmig_p5"
	pWarp0  = "%ptxmig_p6" // the thread is in warp 0 (linear %tid < 32): warp-uniform
	rF      = "%ptxmig_f0" // leader: claim size arithmetic
	rF2     = "%ptxmig_f1"
)

var virtualSpecial = map[string]string{
	"%ctaid.x": rCX, "%ctaid.y": rCY, "%ctaid.z": rCZ,
	"%nctaid.x": rGX, "%nctaid.y": rGY, "%nctaid.z": rGZ,
}

// makeTwin builds the shared scheduler-state variable and the twin function of kernel f.
//
// Scheduling (docs/PTXSTATE.md, "What a twin does"): the CTA leader claims batches of
// consecutive virtual blocks with one atom.add each (guided sizes, ClaimSize) and keeps one claim
// in flight: the claim for batch k+1 is issued right after batch k is published, so its latency
// overlaps batch k's body. The preempt flag is read (asynchronously) at the start of each batch's
// last block and consulted only before issuing a claim; a claim already issued always runs.
//
// Convergence (TestTwinConvergence checks it on every twin): all leader-only code sits in one region
// that ends at the scheduler's bar.sync, and the loop has a single entry ($__ptxmig_claim), so the
// control flow is reducible and every warp enters the original body converged. The body's own
// bar.sync (an aligned barrier) and warp-synchronous instructions (shfl.sync, vote) need that:
// a leader lane still in scheduler code while its warp's other lanes run the body is undefined
// behaviour, and on H200 it faulted (CUDA_ERROR_INVALID_ADDRESS_SPACE in transpose2d).
//
// Barrier flavour (schedulerBarrier): the scheduler's two barriers are aligned (bar.sync) unless
// the body uses a non-aligned CTA barrier (barrier.sync without .aligned: nvcc 13 emits it for
// cooperative groups' cta.sync()); then they are non-aligned too. Mixing the two computed wrong
// blocks on an H100 (driver 580): the twin of cuda-samples' fwtBatch1Kernel built by nvcc 13 gave
// wrong results with the scheduler on bar.sync 0, and also on bar.sync 15 (another barrier), and
// exact ones with barrier.sync 0; the same kernel from nvcc 12.4 (bar.sync in the body) was exact
// (docs/BENCHMARKS.md, 2026-11-25).
// minTwinRegs is the least .maxnreg given to a twin: below it the scheduler's own live values
// would only move to local memory (the hardware allocates registers in groups of 8 anyway).
const minTwinRegs = 24

func makeTwin(f *Function, info *kernelInfo, maxnreg int, mid *midPlan, twinName, slotName string) (*Item, *Item, error) {
	slotBytes := twinSlotBytes
	if mid != nil {
		slotBytes = midSlotBytes
	}
	slot := &Item{Kind: ItemVar, Lead: "\n\n// ptxmig: scheduler state of " + twinName + " (two parity slots, leader state)\n",
		Text: fmt.Sprintf(".shared .align 16 .b8 %s[%d];", slotName, slotBytes)}

	// Header: same text with the new name and one more parameter.
	h := f.Head
	var head string
	extra := "\t.param .u64 " + CtlParam
	end := f.paramsEnd
	sep := ",\n"
	if len(f.Params) == 0 {
		sep = "\n"
	}
	rest := h[end:]
	if !strings.HasPrefix(rest, "\n") && !strings.HasPrefix(rest, "\r\n") {
		rest = "\n" + rest
	}
	if maxnreg > 0 {
		// Before the body's opening brace (the last "{" of the header).
		i := strings.LastIndex(rest, "{")
		if i < 0 {
			return nil, nil, fmt.Errorf("header of %s has no opening brace", f.Name)
		}
		rest = rest[:i] + fmt.Sprintf(".maxnreg %d\n", maxnreg) + rest[i:]
	}
	head = h[:f.nameOff] + twinName + h[f.nameOff+len(f.Name):end] + sep + extra + rest
	tw := &Function{Entry: true, Name: twinName, Head: head, Close: f.Close, Params: append(append([]Param(nil), f.Params...), Param{Space: ".param", Type: ".u64", Name: CtlParam, Bytes: 8}),
		MaxNTID: f.MaxNTID, ReqNTID: f.ReqNTID, MinNCTAPerSM: f.MinNCTAPerSM, MaxNReg: f.MaxNReg}
	if maxnreg > 0 {
		tw.MaxNReg = maxnreg
	}

	bar := schedulerBarrier(f.Body)
	if mid != nil && mid.thread {
		bar = "barrier.sync \t0;" // a warp may reach the block's end divergent (midtwin.go)
	}
	var body []*Stmt
	emit := func(lines ...string) {
		for _, l := range lines {
			kind := StInstr
			lead := "\n\t"
			if strings.HasSuffix(l, ":") {
				kind, lead = StLabel, "\n"
			} else if strings.HasPrefix(l, ".") || strings.HasPrefix(l, "//") {
				kind = StDirective
			}
			body = append(body, &Stmt{Kind: kind, Lead: lead, Text: l})
		}
	}
	L := func(n string) string { return labelPrefix + n }
	loadCtl := loadCtlLines()
	// claim (leader only): unless the flag is set or no block is left after rCur, issue
	// atom.add(next_block, G) into rPend (not waited for here) and record G; else rPend = ~0.
	// With mayDefer (the claim kept in flight during a batch), a claim in the last wave (at most
	// one block per CTA left, as this CTA sees it) is deferred instead: rPend = ~1, G = 0, and the
	// leader claims at the next publish, when it is ready to run what it gets. Claiming ahead there
	// would take a block that an idle CTA could start now (a one-wave grid ran in two waves).
	claim := func(id string, mayDefer bool) {
		emit(
			"ld.shared.u64 \t"+rT64a+", "+shAt(shTotal)+";",
			"setp.lt.u64 \t"+pC+", "+rCur+", "+rT64a+";",
			"setp.ne.and.u32 \t"+pS+", "+rFlag+", 0, "+pC+";",
			fmt.Sprintf("@%s red.global.or.b32 \t%s, %d;", pS, ctlAt(CtlOffStatus), CtlStatusPreempted),
			"setp.eq.and.u32 \t"+pC+", "+rFlag+", 0, "+pC+";",
			"mov.u64 \t"+rPend+", -1;",
			"mov.u64 \t"+rG+", 0;",
			"@!"+pC+" bra \t"+L("noclaim"+id)+";",
			"// G = min(clamp(left * (1/(div*ctas)), min, max), ceil(left/ctas)) in f32: any G >= 1 is",
			"// correct, so rounding is harmless; the cap keeps a CTA from taking more than its share of",
			"// the last wave (a one-wave grid claimed in pairs would run in two waves)",
			"sub.u64 \t"+rT64a+", "+rT64a+", "+rCur+";",
			"cvt.rn.f32.u64 \t"+rF+", "+rT64a+";",
			"ld.shared.f32 \t"+rF2+", "+shAt(shInvCtas)+";",
			"mul.f32 \t"+rF2+", "+rF+", "+rF2+";",
			"cvt.rpi.u32.f32 \t"+rAddr+", "+rF2+";",
		)
		if mayDefer {
			// Also deferred: every claim of one-block claims (batch_max 1, blocks long enough
			// that one makes a batch): made when the CTA is ready for it, on a fresh flag.
			emit(
				"ld.shared.v2.u32 \t{"+rTmp+", "+rTmp2+"}, "+shAt(shMin)+";",
				"setp.le.u32 \t"+pS+", "+rAddr+", 1;",
				"setp.eq.or.u32 \t"+pS+", "+rTmp2+", 1, "+pS+";",
				"@"+pS+" mov.u64 \t"+rPend+", -2;",
				"@"+pS+" bra \t"+L("noclaim"+id)+";",
			)
		}
		emit(
			"ld.shared.f32 \t"+rF2+", "+shAt(shInvDiv)+";",
			"mul.f32 \t"+rF+", "+rF+", "+rF2+";",
			"ld.shared.v2.u32 \t{"+rTmp+", "+rTmp2+"}, "+shAt(shMin)+";",
			"cvt.rn.f32.u32 \t"+rF2+", "+rTmp2+";",
			"min.f32 \t"+rF+", "+rF+", "+rF2+";",
			"cvt.rzi.u32.f32 \t"+rTmp2+", "+rF+";",
			"max.u32 \t"+rTmp2+", "+rTmp2+", "+rTmp+";",
			"min.u32 \t"+rTmp2+", "+rTmp2+", "+rAddr+";",
			"cvt.u64.u32 \t"+rG+", "+rTmp2+";",
			fmt.Sprintf("atom.global.add.u64 \t%s, %s, %s;", rPend, ctlAt(CtlOffNextBlock), rG),
			L("noclaim"+id)+":",
			"st.shared.u64 \t"+shAt(shPendG)+", "+rG+";",
		)
	}
	emit(
		"// ptxmig: preemptible persistent-thread scheduler (docs/PTXSTATE.md)",
		".reg .pred \t%ptxmig_p<7>;",
		".reg .b32 \t%ptxmig_r<14>;",
		".reg .b64 \t%ptxmig_rd<8>;",
		".reg .f32 \t%ptxmig_f<2>;",
	)
	if mid != nil {
		emit(mid.decls()...)
	}
	emit(loadCtl...)
	emit(
		fmt.Sprintf("ld.global.u64 \t%s, %s;", rT64c, ctlAt(CtlOffTotalBlocks)),
		fmt.Sprintf("ld.global.u32 \t%s, %s;", rGX, ctlAt(CtlOffGridX)),
		fmt.Sprintf("ld.global.u32 \t%s, %s;", rGY, ctlAt(CtlOffGridY)),
		fmt.Sprintf("ld.global.u32 \t%s, %s;", rGZ, ctlAt(CtlOffGridZ)),
		"setp.le.u64 \t"+pFits32+", "+rT64c+", 4294967295;",
		"cvt.u64.u32 \t"+rT64a+", "+rGX+";",
		"setp.eq.u64 \t"+pOneDim+", "+rT64a+", "+rT64c+";",
		"mov.u32 \t"+rTmp+", %tid.x;",
		"mov.u32 \t"+rTmp2+", %tid.y;",
		"or.b32 \t"+rTmp+", "+rTmp+", "+rTmp2+";",
		"mov.u32 \t"+rTmp2+", %tid.z;",
		"or.b32 \t"+rTmp+", "+rTmp+", "+rTmp2+";",
		"setp.eq.u32 \t"+pLead+", "+rTmp+", 0;",
		"// warp 0: linear thread index (x fastest) below 32",
		"mov.u32 \t"+rTmp+", %tid.z;",
		"mov.u32 \t"+rTmp2+", %ntid.y;",
		"mul.lo.u32 \t"+rTmp+", "+rTmp+", "+rTmp2+";",
		"mov.u32 \t"+rTmp2+", %tid.y;",
		"add.u32 \t"+rTmp+", "+rTmp+", "+rTmp2+";",
		"mov.u32 \t"+rTmp2+", %ntid.x;",
		"mul.lo.u32 \t"+rTmp+", "+rTmp+", "+rTmp2+";",
		"mov.u32 \t"+rTmp2+", %tid.x;",
		"add.u32 \t"+rTmp+", "+rTmp+", "+rTmp2+";",
		"setp.lt.u32 \t"+pWarp0+", "+rTmp+", 32;",
		"mov.u32 \t"+rPar+", 0;",
		"mov.u32 \t"+rSlot+", "+slotName+";",
	)
	if mid != nil {
		emit(mid.prologue()...)
	}
	emit(
		"@!"+pLead+" bra \t"+L("claim")+";",
		"// leader: resolve the claim tuning, then make the first claim (waited for at the first publish)",
		fmt.Sprintf("ld.volatile.global.u32 \t%s, %s;", rFlag, ctlAt(CtlOffPreempt)),
		fmt.Sprintf("ld.volatile.global.u64 \t%s, %s;", rCur, ctlAt(CtlOffNextBlock)),
		"st.shared.u64 \t"+shAt(shTotal)+", "+rT64c+";",
		fmt.Sprintf("ld.global.u32 \t%s, %s;", rTmp, ctlAt(CtlOffBatchMin)),
		"setp.eq.u32 \t"+pT+", "+rTmp+", 0;",
		fmt.Sprintf("@%s mov.u32 \t%s, %d;", pT, rTmp, DefaultBatchMin),
		fmt.Sprintf("ld.global.u32 \t%s, %s;", rTmp2, ctlAt(CtlOffBatchMax)),
		"setp.eq.u32 \t"+pT+", "+rTmp2+", 0;",
		fmt.Sprintf("@%s mov.u32 \t%s, %d;", pT, rTmp2, DefaultBatchMax),
		"max.u32 \t"+rTmp2+", "+rTmp2+", "+rTmp+";",
		"st.shared.v2.u32 \t"+shAt(shMin)+", {"+rTmp+", "+rTmp2+"};",
		fmt.Sprintf("ld.global.u32 \t%s, %s;", rTmp, ctlAt(CtlOffBatchDiv)),
		"setp.eq.u32 \t"+pT+", "+rTmp+", 0;",
		fmt.Sprintf("@%s mov.u32 \t%s, %d;", pT, rTmp, DefaultBatchDiv),
		"mov.u32 \t"+rTmp2+", %nctaid.x;",
		"mov.u32 \t"+rAddr+", %nctaid.y;",
		"mul.lo.u32 \t"+rTmp2+", "+rTmp2+", "+rAddr+";",
		"mov.u32 \t"+rAddr+", %nctaid.z;",
		"mul.lo.u32 \t"+rTmp2+", "+rTmp2+", "+rAddr+";",
		"mul.wide.u32 \t"+rT64a+", "+rTmp+", "+rTmp2+";",
		"cvt.rn.f32.u64 \t"+rF+", "+rT64a+";",
		"rcp.rn.f32 \t"+rF+", "+rF+";",
		"st.shared.f32 \t"+shAt(shInvDiv)+", "+rF+";",
		"cvt.rn.f32.u32 \t"+rF+", "+rTmp2+";",
		"rcp.rn.f32 \t"+rF+", "+rF+";",
		"st.shared.f32 \t"+shAt(shInvCtas)+", "+rF+";",
		"mov.u64 \t"+rT64a+", 0;",
		"st.shared.u64 \t"+shAt(shDone)+", "+rT64a+";",
	)
	if mid != nil {
		emit(mid.leaderPrologue(L("claim"))...)
	}
	claim("0", false)
	emit(
		"// the loop's only entry: the leader's divergent set-up reconverges here (reducible CFG)",
		L("claim")+":",
		"@!"+pLead+" bra \t"+L("wait")+";",
	)
	if mid != nil {
		emit(loadCtl...)
		emit(mid.claimStep(L)...)
	}
	emit(
		"// leader: a deferred claim (rPend == ~1) is made now, for the batch about to be published",
		"setp.ne.u64 \t"+pT+", "+rPend+", -2;",
		"@"+pT+" bra \t"+L("ready")+";",
	)
	emit(loadCtl...)
	emit(
		"// on the flag as it is now: a deferred claim decides whether the CTA runs another block",
		fmt.Sprintf("ld.volatile.global.u32 \t%s, %s;", rFlag, ctlAt(CtlOffPreempt)),
	)
	claim("2", false)
	emit(
		L("ready")+":",
		"// leader: publish the claim in flight as {base, end}; an empty batch (base == end) ends the CTA",
		"ld.shared.u64 \t"+rT64a+", "+shAt(shTotal)+";",
		"ld.shared.u64 \t"+rG+", "+shAt(shPendG)+";",
		"add.u64 \t"+rCur+", "+rPend+", "+rG+";",
		"min.u64 \t"+rCur+", "+rCur+", "+rT64a+";",
		"min.u64 \t"+rVB+", "+rPend+", "+rCur+";",
		"// decompose the batch's first block once; threads step %ctaid from it",
		"setp.eq.u64 \t"+pT+", "+rVB+", "+rCur+";",
		"@"+pT+" bra \t"+L("pub")+";",
		"@!"+pOneDim+" bra \t"+L("ndim")+";",
		"cvt.u32.u64 \t"+rCX+", "+rVB+";",
		"mov.u32 \t"+rCY+", 0;",
		"mov.u32 \t"+rCZ+", 0;",
		"bra \t"+L("pub")+";",
		L("ndim")+":",
		"@!"+pFits32+" bra \t"+L("d64")+";",
		"cvt.u32.u64 \t"+rV32+", "+rVB+";",
		"rem.u32 \t"+rCX+", "+rV32+", "+rGX+";",
		"div.u32 \t"+rV32+", "+rV32+", "+rGX+";",
		"rem.u32 \t"+rCY+", "+rV32+", "+rGY+";",
		"div.u32 \t"+rCZ+", "+rV32+", "+rGY+";",
		"bra \t"+L("pub")+";",
		L("d64")+":",
		"cvt.u64.u32 \t"+rT64a+", "+rGX+";",
		"rem.u64 \t"+rT64b+", "+rVB+", "+rT64a+";",
		"cvt.u32.u64 \t"+rCX+", "+rT64b+";",
		"div.u64 \t"+rT64b+", "+rVB+", "+rT64a+";",
		"cvt.u64.u32 \t"+rT64a+", "+rGY+";",
		"rem.u64 \t"+rT64c+", "+rT64b+", "+rT64a+";",
		"cvt.u32.u64 \t"+rCY+", "+rT64c+";",
		"div.u64 \t"+rT64c+", "+rT64b+", "+rT64a+";",
		"cvt.u32.u64 \t"+rCZ+", "+rT64c+";",
		L("pub")+":",
		"add.u32 \t"+rAddr+", "+rSlot+", "+rPar+";",
		"st.shared.v2.u64 \t["+rAddr+"], {"+rVB+", "+rCur+"};",
		"st.shared.v2.u32 \t["+rAddr+"+16], {"+rCX+", "+rCY+"};",
		"st.shared.u32 \t["+rAddr+"+24], "+rCZ+";",
	)
	if mid != nil {
		emit("mov.u32 \t"+mB+", 0;", "st.shared.u32 \t["+rAddr+"+28], "+mB+";")
	}
	emit(
		"ld.shared.u64 \t"+rT64a+", "+shAt(shDone)+";",
		"sub.u64 \t"+rT64b+", "+rCur+", "+rVB+";",
		"add.u64 \t"+rT64a+", "+rT64a+", "+rT64b+";",
		"st.shared.u64 \t"+shAt(shDone)+", "+rT64a+";",
		"// leader: keep one claim in flight, from the end of the batch just published (none once",
		"// the batch is empty: rCur == total); the atom's result is waited for at the next publish",
	)
	emit(loadCtl...)
	claim("1", true)
	emit(
		"// every leader-only path ends at this barrier: the warp enters the body converged",
		L("wait")+":",
		bar,
		"add.u32 \t"+rAddr+", "+rSlot+", "+rPar+";",
		"ld.shared.v2.u64 \t{"+rVB+", "+rT64a+"}, ["+rAddr+"];",
		"ld.shared.v2.u32 \t{"+rCX+", "+rCY+"}, ["+rAddr+"+16];",
		"ld.shared.u32 \t"+rCZ+", ["+rAddr+"+24];",
	)
	if mid != nil {
		emit("ld.shared.u32 \t" + mAct + ", [" + rAddr + "+28];")
	}
	emit(
		fmt.Sprintf("xor.b32 \t%s, %s, %d;", rPar, rPar, slotStride),
	)
	if mid != nil {
		emit("setp.ne.u32 \t"+pT+", "+mAct+", 0;", "@"+pT+" bra.uni \t"+L("rec")+";")
	}
	emit(
		"sub.u64 \t"+rT64a+", "+rT64a+", "+rVB+";",
		"cvt.u32.u64 \t"+rCnt+", "+rT64a+";",
		"setp.eq.u32 \t"+pT+", "+rCnt+", 0;",
		"@"+pT+" bra.uni \t"+L("exit")+";",
		L("block")+":",
	)
	if mid != nil {
		emit(mid.blockDispatch(L))
	}
	emit(
		"// warp 0 reads the flag during the batch's last block, for the leader's next claim decision",
		"// (the leader's copy is used): a load by the leader alone would split warp 0 for the whole",
		"// body, as ptxas makes the predicated load a branch; the guard is warp-uniform",
		"setp.eq.and.u32 \t"+pT+", "+rCnt+", 1, "+pWarp0+";",
		"@"+pT+" ld.param.u64 \t"+rCtl+", ["+CtlParam+"];",
		"@"+pT+" cvta.to.global.u64 \t"+rCtl+", "+rCtl+";",
		fmt.Sprintf("@%s ld.volatile.global.u32 \t%s, %s;", pT, rFlag, ctlAt(CtlOffPreempt)),
		L("body")+":",
		"// ptxmig: original body",
	)
	for i, s := range f.Body {
		ns := *s
		if nl := strings.IndexByte(ns.Lead, '\n'); i == 0 && (nl < 0 || strings.Contains(ns.Lead[:nl], "/*")) {
			// "{{" or "{ld..." on one line, or "{ /* a comment\n over lines */": keep it off
			// the line comment emitted above.
			ns.Lead = "\n" + ns.Lead
		}
		if s.Kind == StInstr {
			repl := map[int]string{}
			for i, t := range s.toks {
				if t.Kind == tokIdent {
					if v, ok := virtualSpecial[t.Text]; ok {
						repl[i] = v
					}
				}
			}
			switch s.Base() {
			case "ret", "exit":
				// Return to the claim step: the CTA's other threads meet this one at its barrier.
				opTok := 0
				for i, t := range s.toks {
					if t.Kind == tokIdent && t.Text == s.Op {
						opTok = i
						break
					}
				}
				repl[opTok] = "bra \t" + L("next")
			}
			ns.Text = rewriteStmt(s, repl)
		}
		emit(mid.headDispatch(i, L)...)
		if id, ok := mid.siteAt(i); ok {
			site := mid.sites[id]
			switch site.Kind {
			case "thread-loop":
				emit(mid.threadPoll(id, site.PollEvery, L)...)
				emit(L(fmt.Sprintf("at%d", id)) + ":")
			case "loop":
				emit(mid.poll(id, site.PollEvery, bar != "barrier.sync \t0;", L)...)
				emit(L(fmt.Sprintf("at%d", id)) + ":")
			default:
				// Every PollEvery-th visit the site's barrier becomes the vote (itself a barrier
				// with the same operand); the other visits keep the barrier as it is.
				emit(mid.count(site.PollEvery, L(fmt.Sprintf("plain%d", id)))...)
				emit(mid.vote(id, barOperand(s), siteAligned(s), L)...)
				emit("bra.uni \t"+L(fmt.Sprintf("at%d", id))+";", L(fmt.Sprintf("plain%d", id))+":")
				body = append(body, &ns)
				emit(L(fmt.Sprintf("at%d", id)) + ":")
				continue
			}
		}
		body = append(body, &ns)
	}
	emit(L("next") + ":")
	// Copies the block issued and never waited for (legal in the original: its shared memory
	// died with the CTA) must not land in, or read from, the next block's shared memory.
	if info.drainAsync {
		emit("// the thread's cp.async groups complete before the next block reuses shared memory",
			"cp.async.wait_all;")
	}
	if info.drainBulk {
		emit("// the thread's bulk copies have read their shared-memory source before it is reused",
			"cp.async.bulk.wait_group.read \t0;")
	}
	emit(mid.blockEnd(bar, L)...)
	emit(
		"// the whole CTA finished this block: next block of the batch, or the next claim",
		"sub.u32 \t"+rCnt+", "+rCnt+", 1;",
		"setp.eq.u32 \t"+pT+", "+rCnt+", 0;",
		"@"+pT+" bra \t"+L("claim")+";",
		"// the next %ctaid in x-fastest order (blocks of a batch are consecutive)",
		"add.u32 \t"+rCX+", "+rCX+", 1;",
		"setp.eq.u32 \t"+pT+", "+rCX+", "+rGX+";",
		"@"+pT+" mov.u32 \t"+rCX+", 0;",
		"@"+pT+" add.u32 \t"+rCY+", "+rCY+", 1;",
		"setp.eq.and.u32 \t"+pT+", "+rCY+", "+rGY+", "+pT+";",
		"@"+pT+" mov.u32 \t"+rCY+", 0;",
		"@"+pT+" add.u32 \t"+rCZ+", "+rCZ+", 1;",
		bar,
		"bra \t"+L("block")+";",
		L("exit")+":",
		"@!"+pLead+" bra \t"+L("ret")+";",
		"ld.shared.u64 \t"+rT64a+", "+shAt(shDone)+";",
		"setp.ne.u64 \t"+pT+", "+rT64a+", 0;",
		"@!"+pT+" bra \t"+L("ret")+";",
	)
	emit(loadCtl...)
	emit(
		fmt.Sprintf("red.global.add.u64 \t%s, %s;", ctlAt(CtlOffBlocksDone), rT64a),
		L("ret")+":",
		"ret;",
	)
	if mid != nil {
		emit(mid.tail(bar, L("claim"), info.drainAsync, L)...)
	}
	tw.Body = body
	twin := &Item{Kind: ItemFunc, Lead: "\n\n// ptxmig: preemptible twin of " + f.Name + "\n", Func: tw}
	return slot, twin, nil
}

// schedulerBarrier is the instruction of the twin's own barriers: "barrier.sync 0" (non-aligned)
// when the body uses a non-aligned CTA barrier, else "bar.sync 0" (see makeTwin).
func schedulerBarrier(body []*Stmt) string {
	for _, s := range body {
		if s.Kind == StInstr && ctaBarrierUnaligned(s) {
			return "barrier.sync \t0;"
		}
	}
	return "bar.sync \t0;"
}

// ctaBarrierUnaligned reports whether s is a CTA-wide barrier instruction without .aligned
// (barrier{.cta}.sync/.arrive/.red); bar.* is always aligned and bar.warp.sync is warp-level.
func ctaBarrierUnaligned(s *Stmt) bool {
	return s.Base() == "barrier" && !s.HasMod("aligned") && !s.HasMod("cluster") &&
		(s.HasMod("sync") || s.HasMod("arrive") || s.HasMod("red"))
}
