package ptxstate

import (
	"fmt"
	"strings"
)

// Instrument adds a preemptible persistent-thread twin after every eligible kernel and returns
// the new module and the analysis (with refusals for the kernels left alone). The input module
// is not modified.
func Instrument(m *Module) (*Module, *Report, error) {
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
			slot, twin, err := makeTwin(it.Func, info.cfg)
			if err != nil {
				return nil, nil, fmt.Errorf("kernel %s: %w", it.Func.Name, err)
			}
			out.Items = append(out.Items, slot, twin)
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
const (
	rCtl    = "%ptxmig_rd0" // control block (global address)
	rTotal  = "%ptxmig_rd1" // total virtual blocks
	rVB     = "%ptxmig_rd2" // claimed virtual block
	rT64a   = "%ptxmig_rd3"
	rT64b   = "%ptxmig_rd4"
	rT64c   = "%ptxmig_rd5"
	rGX     = "%ptxmig_r0" // original grid
	rGY     = "%ptxmig_r1"
	rGZ     = "%ptxmig_r2"
	rTmp    = "%ptxmig_r3"
	rTmp2   = "%ptxmig_r4"
	rPar    = "%ptxmig_r5" // parity slot byte offset: 0 or 8
	rPrev   = "%ptxmig_r6" // 1 once this CTA has run a block
	rSlot   = "%ptxmig_r7" // shared address of the slots
	rFlag   = "%ptxmig_r8"
	rAddr   = "%ptxmig_r9"
	rCX     = "%ptxmig_r10" // virtual %ctaid
	rCY     = "%ptxmig_r11"
	rCZ     = "%ptxmig_r12"
	rV32    = "%ptxmig_r13"
	pLead   = "%ptxmig_p0"
	pT      = "%ptxmig_p1"
	pCount  = "%ptxmig_p2"
	pFits32 = "%ptxmig_p3"
	pOneDim = "%ptxmig_p4"
)

var virtualSpecial = map[string]string{
	"%ctaid.x": rCX, "%ctaid.y": rCY, "%ctaid.z": rCZ,
	"%nctaid.x": rGX, "%nctaid.y": rGY, "%nctaid.z": rGZ,
}

// makeTwin builds the shared parity-slot variable and the twin function of kernel f.
func makeTwin(f *Function, g *CFG) (*Item, *Item, error) {
	twinName := f.Name + TwinSuffix
	slotName := slotPrefix + f.Name
	slot := &Item{Kind: ItemVar, Lead: "\n\n// ptxmig: claim slots of " + twinName + " (two, by iteration parity)\n",
		Text: fmt.Sprintf(".shared .align 8 .b8 %s[%d];", slotName, twinSlotBytes)}

	// Header: same text with the new name and one more parameter.
	h := f.Head
	var head string
	extra := "\t.param .u64 " + CtlParam
	end := f.paramsEnd
	for end > 0 && strings.ContainsRune(" \t\r\n", rune(h[end-1])) {
		end--
	}
	sep := ",\n"
	if len(f.Params) == 0 {
		sep = "\n"
	}
	head = h[:f.nameOff] + twinName + h[f.nameOff+len(f.Name):end] + sep + extra + "\n" + h[f.paramsEnd:]
	tw := &Function{Entry: true, Name: twinName, Head: head, Close: f.Close, Params: append(append([]Param(nil), f.Params...), Param{Space: ".param", Type: ".u64", Name: CtlParam, Bytes: 8}),
		MaxNTID: f.MaxNTID, ReqNTID: f.ReqNTID, MinNCTAPerSM: f.MinNCTAPerSM, MaxNReg: f.MaxNReg}

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
	emit(
		"// ptxmig: preemptible persistent-thread scheduler (docs/PTXSTATE.md)",
		".reg .pred \t%ptxmig_p<5>;",
		".reg .b32 \t%ptxmig_r<14>;",
		".reg .b64 \t%ptxmig_rd<6>;",
		"ld.param.u64 \t"+rCtl+", ["+CtlParam+"];",
		"cvta.to.global.u64 \t"+rCtl+", "+rCtl+";",
		fmt.Sprintf("ld.global.u64 \t%s, [%s+%d];", rTotal, rCtl, CtlOffTotalBlocks),
		fmt.Sprintf("ld.global.u32 \t%s, [%s+%d];", rGX, rCtl, CtlOffGridX),
		fmt.Sprintf("ld.global.u32 \t%s, [%s+%d];", rGY, rCtl, CtlOffGridY),
		fmt.Sprintf("ld.global.u32 \t%s, [%s+%d];", rGZ, rCtl, CtlOffGridZ),
		"setp.le.u64 \t"+pFits32+", "+rTotal+", 4294967295;",
		"cvt.u64.u32 \t"+rT64a+", "+rGX+";",
		"setp.eq.u64 \t"+pOneDim+", "+rT64a+", "+rTotal+";",
		"mov.u32 \t"+rTmp+", %tid.x;",
		"mov.u32 \t"+rTmp2+", %tid.y;",
		"or.b32 \t"+rTmp+", "+rTmp+", "+rTmp2+";",
		"mov.u32 \t"+rTmp2+", %tid.z;",
		"or.b32 \t"+rTmp+", "+rTmp+", "+rTmp2+";",
		"setp.eq.u32 \t"+pLead+", "+rTmp+", 0;",
		"mov.u32 \t"+rPar+", 0;",
		"mov.u32 \t"+rPrev+", 0;",
		"mov.u32 \t"+rSlot+", "+slotName+";",
		L("claim")+":",
		"@!"+pLead+" bra \t"+L("wait")+";",
		fmt.Sprintf("ld.volatile.global.u32 \t%s, [%s+%d];", rFlag, rCtl, CtlOffPreempt),
		"setp.ne.u32 \t"+pT+", "+rFlag+", 0;",
		"mov.u64 \t"+rVB+", -1;",
		fmt.Sprintf("@%s red.global.or.b32 \t[%s+%d], %d;", pT, rCtl, CtlOffStatus, CtlStatusPreempted),
		fmt.Sprintf("@!%s atom.global.add.u64 \t%s, [%s+%d], 1;", pT, rVB, rCtl, CtlOffNextBlock),
		"add.u32 \t"+rAddr+", "+rSlot+", "+rPar+";",
		"st.shared.u64 \t["+rAddr+"], "+rVB+";",
		L("wait")+":",
		"bar.sync \t0;",
		"add.u32 \t"+rAddr+", "+rSlot+", "+rPar+";",
		"ld.shared.u64 \t"+rVB+", ["+rAddr+"];",
		"xor.b32 \t"+rPar+", "+rPar+", 8;",
		"setp.ne.and.u32 \t"+pCount+", "+rPrev+", 0, "+pLead+";",
		fmt.Sprintf("@%s red.global.add.u64 \t[%s+%d], 1;", pCount, rCtl, CtlOffBlocksDone),
		"mov.u32 \t"+rPrev+", 1;",
		"setp.ge.u64 \t"+pT+", "+rVB+", "+rTotal+";",
		"@"+pT+" bra.uni \t"+L("exit")+";",
		"@!"+pOneDim+" bra.uni \t"+L("ndim")+";",
		"cvt.u32.u64 \t"+rCX+", "+rVB+";",
		"mov.u32 \t"+rCY+", 0;",
		"mov.u32 \t"+rCZ+", 0;",
		"bra.uni \t"+L("body")+";",
		L("ndim")+":",
		"@!"+pFits32+" bra.uni \t"+L("d64")+";",
		"cvt.u32.u64 \t"+rV32+", "+rVB+";",
		"rem.u32 \t"+rCX+", "+rV32+", "+rGX+";",
		"div.u32 \t"+rV32+", "+rV32+", "+rGX+";",
		"rem.u32 \t"+rCY+", "+rV32+", "+rGY+";",
		"div.u32 \t"+rCZ+", "+rV32+", "+rGY+";",
		"bra.uni \t"+L("body")+";",
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
		L("body")+":",
		"// ptxmig: original body",
	)
	for _, s := range f.Body {
		ns := *s
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
		body = append(body, &ns)
	}
	emit(
		L("next")+":",
		"bra \t"+L("claim")+";",
		L("exit")+":",
		"ret;",
	)
	tw.Body = body
	twin := &Item{Kind: ItemFunc, Lead: "\n\n// ptxmig: preemptible twin of " + f.Name + "\n", Func: tw}
	return slot, twin, nil
}
