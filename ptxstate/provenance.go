package ptxstate

import "strings"

// provenance finds the registers that can only hold addresses of this CTA's own shared memory
// or the thread's own local memory ("private" addresses): memory that no other CTA can write
// (another CTA reaches a CTA's shared memory only through a .shared::cluster address made by
// mapa, which is refused as a cluster operation on its own).
//
// The analysis is flow-insensitive and conservative: a register is private when every
// instruction that writes it (anywhere in the function) makes a private address, namely
//
//   - cvta.shared / cvta.shared::cta / cvta.local (shared or local window to generic),
//   - mov of a .shared/.local variable (its window address) or of a private register,
//   - add with exactly one private operand (pointer + offset), sub of a non-private offset from a
//     private register, mad/mad.wide whose addend is the only private operand (nvcc's
//     base + index*size), selp between two private registers,
//
// and at least one of those writes starts from a variable or cvta (a register that is only ever
// incremented never held an address).
type provenance struct {
	g       *CFG
	private bitset
	syms    map[string]bool // .shared and .local variables visible in the function
}

func (a *analyzer) provenanceOf(g *CFG) *provenance {
	p := &provenance{g: g, private: newBitset(len(g.regNames)), syms: map[string]bool{}}
	for name, v := range a.vars {
		if v.Space == ".shared" || v.Space == ".local" {
			p.syms[name] = true
		}
	}
	for _, s := range g.Fn.Body {
		if s.Kind != StDecl {
			continue
		}
		if name, v, ok := parseVar(s.Text); ok {
			p.syms[name] = v.Space == ".shared" || v.Space == ".local"
		}
	}
	defsOf := make([][]int, len(g.regNames))
	for k, ds := range g.defs {
		for _, d := range ds {
			defsOf[d] = append(defsOf[d], k)
		}
	}
	// Grounded: some write of the register starts a private address (least fixpoint).
	grounded := newBitset(len(g.regNames))
	for changed := true; changed; {
		changed = false
		for r, ks := range defsOf {
			if grounded.has(r) {
				continue
			}
			for _, k := range ks {
				if p.derives(k, grounded.has) {
					grounded.set(r)
					changed = true
					break
				}
			}
		}
	}
	// Private: grounded, and every write of it derives a private address (greatest fixpoint).
	p.private.copyFrom(grounded)
	for changed := true; changed; {
		changed = false
		for _, r := range p.private.members() {
			for _, k := range defsOf[r] {
				if !p.derives(k, p.private.has) {
					p.private.clear(r)
					changed = true
					break
				}
			}
		}
	}
	return p
}

// derives reports whether instruction k writes a private address into its destination, given
// which registers are private (in).
func (p *provenance) derives(k int, in func(int) bool) bool {
	s := p.g.Fn.Body[k]
	if len(p.g.defs[k]) != 1 || len(s.Args) < 2 {
		return false
	}
	priv := func(o Operand) bool { // one private operand: a register or a private variable
		switch o.Kind {
		case OpReg:
			key, ok := p.g.regKey[k][regBase(o.Text)]
			return ok && !o.Neg && in(key)
		case OpSym:
			return p.syms[symName(o.Text)]
		}
		return false
	}
	src := s.Args[1:]
	count := func(ops []Operand) int {
		n := 0
		for _, o := range ops {
			if priv(o) {
				n++
			}
		}
		return n
	}
	switch s.Base() {
	case "cvta":
		if s.HasMod("to") {
			return false
		}
		for _, sp := range s.Spaces() {
			if sp == "shared::cta" || sp == "local" {
				return true
			}
		}
		return false
	case "mov":
		return len(src) == 1 && priv(src[0])
	case "add":
		return len(src) == 2 && count(src) == 1
	case "sub":
		return len(src) == 2 && priv(src[0]) && !priv(src[1])
	case "mad":
		return len(src) == 3 && priv(src[2]) && count(src) == 1
	case "selp":
		return len(src) == 3 && priv(src[0]) && priv(src[1])
	}
	return false
}

// symName strips "+offset" from a symbol operand.
func symName(t string) string {
	if i := strings.IndexAny(t, "+-"); i > 0 {
		t = t[:i]
	}
	return strings.TrimSpace(t)
}

// privateAccess reports whether memory instruction k (a load or an atomic) can only access this
// CTA's shared memory, the thread's local memory or read-only parameter/constant space: its
// opcode names such a state space, or it addresses generically through private registers or
// variables only.
func (p *provenance) privateAccess(k int) bool {
	s := p.g.Fn.Body[k]
	if sp := s.Spaces(); len(sp) > 0 {
		switch sp[0] {
		case "shared::cta", "local", "param", "const":
			return true
		}
		return false
	}
	for _, o := range s.Args {
		if o.Kind != OpAddr {
			continue
		}
		any := false
		for _, t := range o.toks {
			switch {
			case t.Kind == tokIdent && t.Text[0] == '%':
				key, ok := p.g.regKey[k][regBase(t.Text)]
				if IsSpecialReg(t.Text) || !ok || !p.private.has(key) {
					return false
				}
				any = true
			case t.Kind == tokIdent:
				if !p.syms[t.Text] {
					return false
				}
				any = true
			}
		}
		return any
	}
	return false
}
