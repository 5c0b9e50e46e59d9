package ptxstate

import "strings"

// uniformity is a conservative CTA-level divergence analysis: a register is uniform when every
// thread of a CTA holds the same value in it. Sources of divergence are per-thread special
// registers, memory reads other than .param/.const, atomics, warp collectives and call results;
// values defined inside the region controlled by a divergent branch are divergent too.
type uniformity struct {
	g         *CFG
	divReg    bitset
	divBranch []bool
	divBlock  []bool
}

func divergentSpecial(r string) bool {
	n := strings.TrimPrefix(r, "%")
	for _, p := range []string{"tid", "laneid", "warpid", "clock", "globaltimer", "lanemask", "pm"} {
		if strings.HasPrefix(n, p) {
			return true
		}
	}
	return false
}

func divergentSource(s *Stmt) bool {
	switch s.Base() {
	case "ld", "ldu":
		return !(s.HasMod("param") || s.HasMod("const"))
	case "atom", "shfl", "vote", "match", "redux", "activemask", "call", "tex", "tld4", "suld", "alloca",
		"elect", "mbarrier", "ldmatrix", "mma", "wmma", "wgmma", "stacksave":
		return true
	}
	return false
}

func (g *CFG) uniformity() *uniformity {
	f := g.Fn
	u := &uniformity{g: g, divReg: newBitset(len(g.regNames)), divBranch: make([]bool, len(g.Blocks)), divBlock: make([]bool, len(g.Blocks)+1)}
	ipdom := g.postDominators()
	var w walker
	for changed := true; changed; {
		changed = false
		for i, s := range f.Body {
			if s.Kind != StInstr || len(g.defs[i]) == 0 {
				continue
			}
			div := u.divBlock[g.blockOf[i]] || divergentSource(s)
			for _, r := range g.uses[i] {
				if u.divReg.has(r) {
					div = true
				}
			}
			for _, o := range s.Args {
				for _, r := range o.Regs {
					if divergentSpecial(r) {
						div = true
					}
				}
			}
			if !div {
				continue
			}
			for _, d := range g.defs[i] {
				if !u.divReg.has(d) {
					u.divReg.set(d)
					changed = true
				}
			}
		}
		for _, b := range g.Blocks {
			if u.divBranch[b.ID] || len(b.Succs) < 2 {
				continue
			}
			k := b.End - 1
			last := f.Body[k]
			if last.Kind != StInstr {
				continue
			}
			div := false
			for _, r := range g.uses[k] {
				if u.divReg.has(r) {
					div = true
				}
			}
			if !div {
				continue
			}
			u.divBranch[b.ID] = true
			changed = true
			g.reachableFrom(b.ID, ipdom[b.ID], &w, func(x int) {
				if x < len(g.Blocks) {
					u.divBlock[x] = true
				}
			})
		}
	}
	return u
}

// reachedUniformly reports whether block b is executed by all threads of the CTA or none.
func (u *uniformity) reachedUniformly(b int) bool { return !u.divBlock[b] }
