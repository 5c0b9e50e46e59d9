package ptxstate

import (
	"fmt"
	"math/bits"
	"strconv"
	"strings"
)

// Block is a basic block: body statements [Start, End) of its function.
type Block struct {
	ID         int
	Start, End int
	Succs      []int // block IDs; ExitNode for ret/exit/trap and falling off the end
	Preds      []int
}

// CFG is a function's control-flow graph. Node len(Blocks) is the virtual exit.
type CFG struct {
	Fn      *Function
	Blocks  []*Block
	blockOf []int // statement index -> block id (-1 outside blocks)
	labels  map[string]int
	// register keys per statement, resolved through { } scopes
	defs, uses [][]int
	regNames   []string
	regTypes   []string
	// regKey maps, per instruction, each register name it mentions to its key (scopes resolved).
	regKey []map[string]int
}

// ExitNode is the ID of the virtual exit node.
func (g *CFG) ExitNode() int { return len(g.Blocks) }

func isTerminator(s *Stmt) bool {
	if s.Kind != StInstr {
		return false
	}
	switch s.Base() {
	case "bra", "brx", "ret", "exit", "trap":
		return true
	}
	return false
}

// buildCFG splits a function body into basic blocks and links them.
func buildCFG(f *Function) (*CFG, error) {
	g := &CFG{Fn: f, labels: map[string]int{}, blockOf: make([]int, len(f.Body))}
	tables := map[string][]string{}
	for i, s := range f.Body {
		if s.Kind == StLabel {
			if _, dup := g.labels[s.Name]; dup && s.Depth == 0 {
				return nil, fmt.Errorf("line %d: label %s defined twice", s.Line, s.Name)
			}
			g.labels[s.Name] = i
			if i+1 < len(f.Body) && f.Body[i+1].Kind == StDirective && (f.Body[i+1].Name == ".branchtargets") {
				var ts []string
				for _, t := range f.Body[i+1].toks[1:] {
					if t.Kind == tokIdent {
						ts = append(ts, t.Text)
					}
				}
				tables[s.Name] = ts
			}
		}
	}
	// Leaders.
	leader := make([]bool, len(f.Body)+1)
	leader[0] = true
	for i, s := range f.Body {
		if s.Kind == StLabel {
			leader[i] = true
		}
		if isTerminator(s) {
			leader[i+1] = true
		}
	}
	for i := 0; i < len(f.Body); {
		j := i + 1
		for j < len(f.Body) && !leader[j] {
			j++
		}
		b := &Block{ID: len(g.Blocks), Start: i, End: j}
		for k := i; k < j; k++ {
			g.blockOf[k] = b.ID
		}
		g.Blocks = append(g.Blocks, b)
		i = j
	}
	exit := len(g.Blocks)
	target := func(s *Stmt, name string) (int, error) {
		idx, ok := g.labels[name]
		if !ok {
			return 0, fmt.Errorf("line %d: %s to undefined label %s", s.Line, s.Op, name)
		}
		return g.blockOf[idx], nil
	}
	for _, b := range g.Blocks {
		var last *Stmt
		for k := b.End - 1; k >= b.Start; k-- {
			if f.Body[k].Kind == StInstr {
				last = f.Body[k]
				break
			}
		}
		fall := b.ID + 1 // exit when b is the last block
		add := func(id int) {
			for _, x := range b.Succs {
				if x == id {
					return
				}
			}
			b.Succs = append(b.Succs, id)
		}
		if last == nil || !isTerminator(last) {
			add(fall)
			continue
		}
		guarded := last.Pred != ""
		switch last.Base() {
		case "bra":
			if len(last.Args) != 1 {
				return nil, fmt.Errorf("line %d: bra wants one label", last.Line)
			}
			t, err := target(last, last.Args[0].Text)
			if err != nil {
				return nil, err
			}
			add(t)
		case "brx":
			if len(last.Args) != 2 {
				return nil, fmt.Errorf("line %d: brx.idx wants an index and a table", last.Line)
			}
			ts, ok := tables[last.Args[1].Text]
			if !ok {
				return nil, fmt.Errorf("line %d: brx.idx table %s is not a .branchtargets label", last.Line, last.Args[1].Text)
			}
			for _, n := range ts {
				t, err := target(last, n)
				if err != nil {
					return nil, err
				}
				add(t)
			}
		default: // ret, exit, trap
			add(exit)
		}
		if guarded {
			add(fall)
		}
	}
	for _, b := range g.Blocks {
		for _, s := range b.Succs {
			if s < exit {
				g.Blocks[s].Preds = append(g.Blocks[s].Preds, b.ID)
			}
		}
	}
	g.resolveRegs()
	return g, nil
}

// declRegs parses a .reg declaration into names and ranges (%r<5> is prefix %r, count 5).
func declRegs(s *Stmt) (typ string, names []string, ranges map[string]int) {
	ranges = map[string]int{}
	ts := s.toks
	for k := 1; k < len(ts); k++ {
		t := ts[k]
		if t.Kind == tokIdent && t.Text[0] == '.' && t.Text != ".v2" && t.Text != ".v4" && t.Text != ".v8" {
			typ = t.Text
			continue
		}
		if t.Kind == tokIdent && t.Text[0] != '.' {
			if k+3 < len(ts) && ts[k+1].Text == "<" && ts[k+2].Kind == tokNumber && ts[k+3].Text == ">" {
				n, _ := strconv.Atoi(ts[k+2].Text)
				ranges[t.Text] = n
				k += 3
				continue
			}
			names = append(names, t.Text)
		}
	}
	return
}

type scopeDecls struct {
	id     int
	names  map[string]string // name -> type
	ranges map[string]int
	rtypes map[string]string
}

func (sc *scopeDecls) lookup(name string) (string, bool) {
	if t, ok := sc.names[name]; ok {
		return t, true
	}
	// %r12 against range %r<N>: longest prefix with all-digit suffix.
	for i := len(name) - 1; i > 0; i-- {
		if name[i] < '0' || name[i] > '9' {
			if i == len(name)-1 {
				return "", false
			}
			p := name[:i+1]
			if n, ok := sc.ranges[p]; ok {
				v, err := strconv.Atoi(name[i+1:])
				if err == nil && v < n {
					return sc.rtypes[p], true
				}
			}
			return "", false
		}
	}
	return "", false
}

// resolveRegs assigns every register occurrence a key that tells apart same-named registers of
// nested { } scopes, and records per-statement defs and uses.
func (g *CFG) resolveRegs() {
	f := g.Fn
	g.defs = make([][]int, len(f.Body))
	g.uses = make([][]int, len(f.Body))
	g.regKey = make([]map[string]int, len(f.Body))
	keys := map[string]int{}
	stack := []*scopeDecls{{names: map[string]string{}, ranges: map[string]int{}, rtypes: map[string]string{}}}
	nextID := 1
	key := func(name string) int {
		scope, typ := 0, ""
		for k := len(stack) - 1; k >= 0; k-- {
			if t, ok := stack[k].lookup(name); ok {
				scope, typ = stack[k].id, t
				break
			}
		}
		full := name
		if scope != 0 {
			full = name + "#" + strconv.Itoa(scope)
		}
		id, ok := keys[full]
		if !ok {
			id = len(g.regNames)
			keys[full] = id
			g.regNames = append(g.regNames, full)
			g.regTypes = append(g.regTypes, typ)
		}
		return id
	}
	for i, s := range f.Body {
		switch s.Kind {
		case StOpen:
			stack = append(stack, &scopeDecls{id: nextID, names: map[string]string{}, ranges: map[string]int{}, rtypes: map[string]string{}})
			nextID++
		case StClose:
			if len(stack) > 1 {
				stack = stack[:len(stack)-1]
			}
		case StDecl:
			if s.Name == ".reg" {
				typ, names, ranges := declRegs(s)
				top := stack[len(stack)-1]
				for _, n := range names {
					top.names[n] = typ
				}
				for p, n := range ranges {
					top.ranges[p] = n
					top.rtypes[p] = typ
				}
			}
		case StInstr:
			d, u := defsUses(s)
			rk := map[string]int{}
			for _, r := range d {
				rk[r] = key(r)
				g.defs[i] = append(g.defs[i], rk[r])
			}
			for _, r := range u {
				rk[r] = key(r)
				g.uses[i] = append(g.uses[i], rk[r])
			}
			g.regKey[i] = rk
		}
	}
}

// bitset is a fixed-size set of small integers.
type bitset []uint64

func newBitset(n int) bitset       { return make(bitset, (n+63)/64) }
func (b bitset) set(i int)         { b[i/64] |= 1 << (uint(i) % 64) }
func (b bitset) clear(i int)       { b[i/64] &^= 1 << (uint(i) % 64) }
func (b bitset) has(i int) bool    { return b[i/64]&(1<<(uint(i)%64)) != 0 }
func (b bitset) copyFrom(o bitset) { copy(b, o) }
func (b bitset) orWith(o bitset) bool {
	changed := false
	for i := range b {
		n := b[i] | o[i]
		if n != b[i] {
			b[i], changed = n, true
		}
	}
	return changed
}
func (b bitset) equal(o bitset) bool {
	for i := range b {
		if b[i] != o[i] {
			return false
		}
	}
	return true
}
func (b bitset) members() []int {
	var out []int
	for i, w := range b {
		for w != 0 {
			t := bits.TrailingZeros64(w)
			out = append(out, i*64+t)
			w &^= 1 << uint(t)
		}
	}
	return out
}

// liveness computes, for every statement, the registers live after it (backward dataflow).
func (g *CFG) liveness() []bitset {
	n := len(g.regNames)
	f := g.Fn
	liveIn := make([]bitset, len(g.Blocks))
	liveOut := make([]bitset, len(g.Blocks))
	for i := range g.Blocks {
		liveIn[i], liveOut[i] = newBitset(n), newBitset(n)
	}
	transfer := func(b *Block, out bitset, perStmt []bitset) bitset {
		cur := newBitset(n)
		cur.copyFrom(out)
		for k := b.End - 1; k >= b.Start; k-- {
			if perStmt != nil {
				perStmt[k] = newBitset(n)
				perStmt[k].copyFrom(cur)
			}
			if f.Body[k].Kind != StInstr {
				continue
			}
			if f.Body[k].Pred == "" {
				for _, d := range g.defs[k] {
					cur.clear(d)
				}
			}
			for _, u := range g.uses[k] {
				cur.set(u)
			}
		}
		return cur
	}
	for changed := true; changed; {
		changed = false
		for i := len(g.Blocks) - 1; i >= 0; i-- {
			b := g.Blocks[i]
			for _, s := range b.Succs {
				if s < len(g.Blocks) && liveOut[i].orWith(liveIn[s]) {
					changed = true
				}
			}
			in := transfer(b, liveOut[i], nil)
			if !in.equal(liveIn[i]) {
				liveIn[i] = in
				changed = true
			}
		}
	}
	after := make([]bitset, len(f.Body))
	for i, b := range g.Blocks {
		transfer(b, liveOut[i], after)
	}
	return after
}

// postDominators returns ipdom[b] for every block (ExitNode when only the exit post-dominates).
// Blocks that cannot reach the exit (infinite loops) get the exit as immediate post-dominator.
func (g *CFG) postDominators() []int {
	n := len(g.Blocks) + 1
	exit := n - 1
	pdom := make([]bitset, n)
	for i := range pdom {
		pdom[i] = newBitset(n)
		if i == exit {
			pdom[i].set(exit)
		} else {
			for j := 0; j < n; j++ {
				pdom[i].set(j)
			}
		}
	}
	for changed := true; changed; {
		changed = false
		for i := len(g.Blocks) - 1; i >= 0; i-- {
			b := g.Blocks[i]
			nw := newBitset(n)
			first := true
			for _, s := range b.Succs {
				if first {
					nw.copyFrom(pdom[s])
					first = false
				} else {
					for k := range nw {
						nw[k] &= pdom[s][k]
					}
				}
			}
			if first { // no successors cannot happen (falls to exit), keep safe
				nw.set(exit)
			}
			nw.set(i)
			if !nw.equal(pdom[i]) {
				pdom[i] = nw
				changed = true
			}
		}
	}
	ipdom := make([]int, len(g.Blocks))
	for i := range g.Blocks {
		ipdom[i] = exit
		// the immediate post-dominator is the strict post-dominator with the largest set.
		best := -1
		for _, c := range pdom[i].members() {
			if c == i {
				continue
			}
			cnt := len(pdom[c].members())
			if c == exit {
				cnt = 1
			}
			if cnt > best {
				best, ipdom[i] = cnt, c
			}
		}
		// All-ones sets (unreachable from the exit) fall back to the exit.
		if len(pdom[i].members()) == n && i != exit {
			ipdom[i] = exit
		}
	}
	return ipdom
}

// reachableFrom returns the blocks reachable from the successors of b without entering stop.
func (g *CFG) reachableFrom(b, stop int) []bool {
	seen := make([]bool, len(g.Blocks)+1)
	var work []int
	for _, s := range g.Blocks[b].Succs {
		if s != stop && !seen[s] {
			seen[s] = true
			work = append(work, s)
		}
	}
	for len(work) > 0 {
		x := work[len(work)-1]
		work = work[:len(work)-1]
		if x >= len(g.Blocks) {
			continue
		}
		for _, s := range g.Blocks[x].Succs {
			if s != stop && !seen[s] {
				seen[s] = true
				work = append(work, s)
			}
		}
	}
	return seen
}

// regKeyName strips the scope suffix of a register key.
func regKeyName(k string) string {
	if i := strings.IndexByte(k, '#'); i >= 0 {
		return k[:i]
	}
	return k
}
