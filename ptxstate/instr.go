package ptxstate

import "strings"

// Opcode classes used by the analyses. Unknown opcodes are treated conservatively: every
// register operand is a use and none is a definition (that can only lengthen live ranges).

// noDef lists opcodes that define no register.
var noDef = map[string]bool{
	"st": true, "red": true, "bar": true, "barrier": true, "bra": true, "brx": true, "ret": true,
	"exit": true, "trap": true, "membar": true, "fence": true, "prefetch": true, "prefetchu": true,
	"cp": true, "sust": true, "sured": true, "nanosleep": true, "pmevent": true, "griddepcontrol": true,
	"setmaxnreg": true, "discard": true, "applypriority": true, "stmatrix": true, "multimem": true,
	"tensormap": true, "st.async": true, "red.async": true, "brkpt": true, "wgmma": true,
}

// firstDef lists opcodes whose first operand is the (only) destination; the rest are uses.
var firstDef = map[string]bool{
	"ld": true, "ldu": true, "mov": true, "add": true, "sub": true, "mul": true, "mad": true,
	"mul24": true, "mad24": true, "sad": true, "div": true, "rem": true, "abs": true, "neg": true,
	"min": true, "max": true, "popc": true, "clz": true, "bfind": true, "fns": true, "brev": true,
	"bfe": true, "bfi": true, "szext": true, "bmsk": true, "dp4a": true, "dp2a": true, "copysign": true,
	"fma": true, "rcp": true, "sqrt": true, "rsqrt": true, "sin": true, "cos": true, "lg2": true,
	"ex2": true, "tanh": true, "testp": true, "and": true, "or": true, "xor": true, "not": true,
	"cnot": true, "lop3": true, "shf": true, "shl": true, "shr": true, "prmt": true, "cvt": true,
	"cvta": true, "setp": true, "set": true, "selp": true, "slct": true, "shfl": true, "vote": true,
	"match": true, "redux": true, "activemask": true, "atom": true, "tex": true, "tld4": true,
	"suld": true, "txq": true, "suq": true, "istypep": true, "isspacep": true, "mapa": true,
	"getctarank": true, "mma": true, "wmma": true, "ldmatrix": true, "movmatrix": true, "elect": true,
	"alloca": true, "stacksave": true, "addc": true, "subc": true, "madc": true, "mbarrier": true,
	"mul.hi": true, "cvt.pack": true, "createpolicy": true, "abs.f": true, "clusterlaunchcontrol": true,
}

// IsSpecialReg reports whether a %name is a predefined (special) register such as %tid.x.
func IsSpecialReg(name string) bool {
	n := strings.TrimPrefix(name, "%")
	if i := strings.IndexByte(n, '.'); i >= 0 {
		n = n[:i]
	}
	switch n {
	case "tid", "ntid", "laneid", "warpid", "nwarpid", "ctaid", "nctaid", "smid", "nsmid", "gridid",
		"clock", "clock64", "clock_hi", "globaltimer", "globaltimer_lo", "globaltimer_hi",
		"dynamic_smem_size", "total_smem_size", "aggr_smem_size", "is_explicit_cluster",
		"clusterid", "nclusterid", "cluster_ctaid", "cluster_nctaid", "cluster_ctarank",
		"cluster_nctarank", "current_graph_exec", "pm0", "pm1", "pm2", "pm3", "pm4", "pm5", "pm6", "pm7",
		"pm0_64", "pm1_64", "pm2_64", "pm3_64", "pm4_64", "pm5_64", "pm6_64", "pm7_64",
		"lanemask_eq", "lanemask_le", "lanemask_lt", "lanemask_ge", "lanemask_gt":
		return true
	}
	return strings.HasPrefix(n, "envreg") || strings.HasPrefix(n, "reserved_smem_offset")
}

// defsUses returns the virtual registers an instruction defines and uses (special registers
// excluded; the guard predicate is a use; a guarded definition is also a use, since it may not
// happen and must not kill the old value).
func defsUses(s *Stmt) (defs, uses []string) {
	addUse := func(rs []string) {
		for _, r := range rs {
			if !IsSpecialReg(r) {
				uses = append(uses, regBase(r))
			}
		}
	}
	addDef := func(o Operand) {
		if o.Kind == OpAddr {
			addUse(o.Regs)
			return
		}
		for _, r := range o.Regs {
			if !IsSpecialReg(r) {
				defs = append(defs, regBase(r))
			}
		}
	}
	if s.Pred != "" {
		uses = append(uses, s.Pred)
	}
	base := s.Base()
	switch {
	case base == "call":
		for i, a := range s.Args {
			if i == 0 && a.Kind == OpList && len(s.Args) > 1 && s.Args[1].Kind != OpList {
				addDef(a)
				continue
			}
			addUse(a.Regs)
		}
	case base == "mbarrier" && (len(s.Args) == 0 || s.Args[0].Kind == OpAddr):
		for _, a := range s.Args {
			addUse(a.Regs)
		}
	case strings.HasPrefix(s.Op, "wgmma.mma_async"):
		// The accumulator is read and written.
		for _, a := range s.Args {
			addUse(a.Regs)
		}
		if len(s.Args) > 0 {
			addDef(s.Args[0])
		}
	case noDef[base] || strings.HasPrefix(s.Op, "wmma.store") || strings.HasPrefix(s.Op, "bar.warp"):
		for _, a := range s.Args {
			addUse(a.Regs)
		}
	case firstDef[base]:
		for i, a := range s.Args {
			if i == 0 {
				addDef(a)
			} else {
				addUse(a.Regs)
			}
		}
	default:
		for _, a := range s.Args {
			addUse(a.Regs)
		}
	}
	if s.Pred != "" {
		uses = append(uses, defs...)
	}
	return defs, uses
}

// regBase strips a component selector from a register operand: %r2.b0 (a video instruction's
// byte selectors) and %v.x (an element of a vector register) are reads of %r2 and %v.
func regBase(r string) string {
	if i := strings.IndexByte(r, '.'); i > 0 {
		return r[:i]
	}
	return r
}

// isBarrier reports whether an instruction is a CTA-level barrier operation.
func isBarrier(s *Stmt) bool {
	if s.Kind != StInstr {
		return false
	}
	switch s.Base() {
	case "bar":
		return !strings.HasPrefix(s.Op, "bar.warp")
	case "barrier":
		return !strings.HasPrefix(s.Op, "barrier.cluster")
	}
	return false
}

// isWarpCollective reports whether an instruction is a warp-synchronous collective.
func isWarpCollective(s *Stmt) bool {
	if s.Kind != StInstr {
		return false
	}
	switch s.Base() {
	case "shfl", "vote", "match", "redux", "activemask", "elect", "mma", "wmma", "ldmatrix", "stmatrix", "movmatrix", "wgmma":
		return true
	}
	return strings.HasPrefix(s.Op, "bar.warp")
}

// callee returns the function a call instruction names ("" for indirect calls).
func callee(s *Stmt) string {
	for _, a := range s.Args {
		if a.Kind == OpSym {
			return a.Text
		}
		if a.Kind == OpReg {
			return ""
		}
	}
	return ""
}

// regSize is the byte size of a register's declared type (4 when unknown; predicates count 4
// because they are saved as .u32 through selp).
func regSize(t string) int {
	switch t {
	case ".pred":
		return 4
	}
	if n := typeBytes(t); n > 0 {
		if n < 4 {
			return 4
		}
		return n
	}
	return 4
}
