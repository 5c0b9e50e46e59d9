package ptxstate

import "strings"

// Time values across a mid-block stop (C4). A register that holds a reading of a GPU clock, or a
// reading plus or minus a clock-free amount (a deadline such as t0 + spin), can be carried across
// a stop: the save stores it relative to the same clock read at the save, and the resume adds the
// clock read at the resume. A later reading minus the value then gives what it would have given
// had the block not stopped: the time spent stopped (and the difference between two SMs' cycle
// counters, or two GPUs' timers) does not count. A difference of two readings of one clock is a
// duration and needs nothing. Every other value derived from a clock (scaled, truncated, mixed
// with another clock) or from where the CTA ran (%smid, %warpid, a .local address, ...) is
// location-bound and refuses the site.
//
// The analysis is flow-insensitive, like the other register analyses: each register gets the
// join of what every instruction that writes it can produce, to a fixpoint. An instruction's
// result is evaluated only once all its inputs have a class, so the order of the body does not
// matter and a register whose writes only feed on themselves (a counter's increment) stays
// clock-free.

// timeClass is what a register holds with respect to clocks and places.
type timeClass uint8

const (
	tcUnset       timeClass = iota // no write evaluated yet
	tcFree                         // nothing from a clock or a place
	tcClock                        // %clock (32-bit) plus a clock-free amount
	tcClock64                      // %clock64 plus a clock-free amount
	tcGlobaltimer                  // %globaltimer plus a clock-free amount
	tcBound                        // anything else derived from a clock or a place
)

// timeSource is the special register a rebased class is read from, "" for the others.
func (c timeClass) timeSource() string {
	switch c {
	case tcClock:
		return "%clock"
	case tcClock64:
		return "%clock64"
	case tcGlobaltimer:
		return "%globaltimer"
	}
	return ""
}

// bytes is the width of a rebased class's values.
func (c timeClass) bytes() int {
	if c == tcClock {
		return 4
	}
	return 8
}

func joinTime(a, b timeClass) timeClass {
	switch {
	case a == tcUnset:
		return b
	case b == tcUnset || a == b:
		return a
	}
	return tcBound
}

// specialTime is the class of a special register read as an operand.
func specialTime(name string) timeClass {
	n := strings.TrimPrefix(name, "%")
	if i := strings.IndexByte(n, '.'); i >= 0 {
		n = n[:i]
	}
	switch n {
	case "clock":
		return tcClock
	case "clock64":
		return tcClock64
	case "globaltimer":
		return tcGlobaltimer
	case "clock_hi", "globaltimer_lo", "globaltimer_hi", "smid", "nsmid", "warpid", "gridid":
		return tcBound
	}
	return tcFree
}

// timeClasses classifies every register of g (CFG register ids); tcUnset never remains.
func timeClasses(g *CFG) []timeClass {
	class := make([]timeClass, len(g.regNames))
	for changed := true; changed; {
		changed = false
		for k, s := range g.Fn.Body {
			if s.Kind != StInstr || len(g.defs[k]) == 0 {
				continue
			}
			c := evalTime(g, k, class)
			if c == tcUnset {
				continue
			}
			for _, d := range g.defs[k] {
				if n := joinTime(class[d], c); n != class[d] {
					class[d] = n
					changed = true
				}
			}
		}
	}
	for r := range class {
		if class[r] == tcUnset {
			class[r] = tcFree
		}
	}
	return class
}

// evalTime is the class instruction k writes, given the registers' classes so far; tcUnset while
// one of its inputs has none yet.
func evalTime(g *CFG, k int, class []timeClass) timeClass {
	s := g.Fn.Body[k]
	if s.Base() == "cvta" && s.HasMod("local") {
		return tcBound // a .local window address belongs to the thread slot it ran in
	}
	regClass := func(r string) timeClass {
		if IsSpecialReg(r) {
			return specialTime(r)
		}
		if n := strings.TrimPrefix(regBase(r), "%"); n == "SP" || n == "SPL" {
			return tcBound // nvcc's stack pointers: .local addresses
		}
		key, ok := g.regKey[k][regBase(r)]
		if !ok {
			return tcFree
		}
		return class[key]
	}
	for _, r := range s.Args[0].Regs {
		if n := strings.TrimPrefix(regBase(r), "%"); n == "SP" || n == "SPL" {
			return tcBound // a write of a stack pointer is bound whatever it writes
		}
	}
	if s.Pred != "" {
		// A guarded write depends on its guard: one computed from a place is bound (a guard
		// comparing clocks is a fact about the past, free like any comparison).
		switch c := regClass(s.Pred); c {
		case tcUnset, tcBound:
			return c
		}
	}
	in := make([]timeClass, 0, len(s.Args))
	for _, o := range s.Args[1:] {
		c := tcFree
		for _, r := range o.Regs {
			rc := regClass(r)
			switch {
			case rc == tcUnset:
				return tcUnset
			case o.Kind == OpReg && len(o.Regs) == 1:
				c = rc
			case rc != tcFree:
				c = tcBound // inside an address or a vector: not a plain value
			}
		}
		in = append(in, c)
	}
	if c, ok := affineTime(s, in); ok {
		return c
	}
	for _, c := range in {
		if c != tcFree {
			return tcBound
		}
	}
	return tcFree
}

// affineTime applies the rules that keep a reading rebasable: mov, add of a clock-free amount,
// sub of a clock-free amount or of another reading of the same clock (a duration), a comparison
// (a fact about the past), and selp between two values of one class. ok is false where they do
// not apply.
func affineTime(s *Stmt, in []timeClass) (timeClass, bool) {
	mods := s.Mods()
	if len(mods) != 1 || s.Args[0].Kind != OpReg {
		// add.cc, mul.wide, cvt.u32.u64, vector destinations: not a plain same-width value.
		if s.Base() == "setp" && noBound(in) {
			return tcFree, true
		}
		return 0, false
	}
	w := typeBytes("." + mods[0])
	fits := func(c timeClass) bool { return c.timeSource() != "" && c.bytes() == w }
	switch s.Base() {
	case "mov":
		if len(in) == 1 && fits(in[0]) {
			return in[0], true
		}
	case "add":
		if len(in) == 2 && mods[0] != "f32" && mods[0] != "f64" {
			switch {
			case fits(in[0]) && in[1] == tcFree:
				return in[0], true
			case in[0] == tcFree && fits(in[1]):
				return in[1], true
			}
		}
	case "sub":
		if len(in) == 2 && fits(in[0]) {
			switch {
			case in[1] == tcFree:
				return in[0], true
			case in[1] == in[0]:
				return tcFree, true
			}
		}
	case "selp":
		if len(in) == 3 && in[0] == in[1] && fits(in[0]) && in[2] == tcFree {
			return in[0], true
		}
	}
	return 0, false
}

func noBound(in []timeClass) bool {
	for _, c := range in {
		if c == tcBound {
			return false
		}
	}
	return true
}
