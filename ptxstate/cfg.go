package ptxstate

import (
	"fmt"
	"math/bits"
	"sort"
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
	// work counts the statements, blocks and edges that the per-kernel analyses visit: the
	// scaling tests check that it grows about linearly with the input (no timed assertions).
	work int
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
	if len(f.Body) > MaxStmtsPerFunction {
		return nil, fmt.Errorf("%w: %d statements in %s, at most %d", ErrLimit, len(f.Body), f.Name, MaxStmtsPerFunction)
	}
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
	if len(g.Blocks) > MaxBlocksPerKernel {
		return nil, fmt.Errorf("%w: %d basic blocks in %s, at most %d", ErrLimit, len(g.Blocks), f.Name, MaxBlocksPerKernel)
	}
	exit := len(g.Blocks)
	// added[x] == b.ID+1 when x is already a successor of b (a .branchtargets table of n labels
	// costs O(n), not O(n^2)).
	added := make([]int, exit+1)
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
			if added[id] == b.ID+1 {
				return
			}
			added[id] = b.ID + 1
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
	if d := g.loopDepth(); d > MaxLoopDepth {
		return nil, fmt.Errorf("%w: loops nested %d deep in %s (backward branches whose spans share a block), at most %d", ErrLimit, d, f.Name, MaxLoopDepth)
	}
	g.resolveRegs()
	return g, nil
}

// loopDepth is the largest number of loops (layoutLoops: header..last latch) that hold one
// block.
func (g *CFG) loopDepth() int {
	open := make([]int, len(g.Blocks)+1) // loops starting at a block, less those ended before it
	for h, latch := range layoutLoops(g) {
		open[h]++
		open[latch+1]--
	}
	depth, d := 0, 0
	for _, n := range open {
		d += n
		depth = max(depth, d)
	}
	return depth
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

// liveness returns, for every statement i with want[i], the registers live after it (keys in
// ascending order); the other entries are nil.
//
// It is the least fixpoint of the usual backward dataflow (live-in = upward-exposed uses, plus
// live-out less unpredicated definitions), found one register at a time by a backward walk from
// the blocks that use it, with sparse sets: time and memory are O(statements + registers + the
// sum over blocks of their live-out sets + the sets returned). Dense per-block bitsets and a
// bitset per statement were O(statements x registers): a kernel of 50,000 barriers with fresh
// registers at each (as nvcc numbers them) allocated 3.4 GB (issue 36).
func (g *CFG) liveness(want []bool) [][]int {
	f := g.Fn
	nb, nr := len(g.Blocks), len(g.regNames)
	// gen: (register, block) when the block uses the register before any unpredicated definition
	// of it in the block; kill: when the block has an unpredicated definition of it.
	var gens, kills []regBlock
	genTag := make([]int32, nr)  // b+1: already a gen of block b
	killTag := make([]int32, nr) // b+1: defined (unpredicated) earlier in block b
	for _, bl := range g.Blocks {
		tag := int32(bl.ID + 1)
		for k := bl.Start; k < bl.End; k++ {
			g.work++
			s := f.Body[k]
			if s.Kind != StInstr {
				continue
			}
			for _, u := range g.uses[k] {
				if killTag[u] != tag && genTag[u] != tag {
					genTag[u] = tag
					gens = append(gens, regBlock{int32(u), int32(bl.ID)})
				}
			}
			if s.Pred == "" {
				for _, d := range g.defs[k] {
					if killTag[d] != tag {
						killTag[d] = tag
						kills = append(kills, regBlock{int32(d), int32(bl.ID)})
					}
				}
			}
		}
	}
	genAt, genBlocks := byRegister(gens, nr)
	killAt, killBlocks := byRegister(kills, nr)
	// Per register r: the blocks it is live into, walked backwards from its gens through
	// predecessors until blocks that kill it. Tags are r+1, so no set is cleared between registers.
	inTag, outTag, blockKill := make([]int32, nb), make([]int32, nb), make([]int32, nb)
	liveOut := make([][]int, nb)
	var work []int32
	for r := 0; r < nr; r++ {
		tag := int32(r + 1)
		for _, b := range killBlocks[killAt[r]:killAt[r+1]] {
			blockKill[b] = tag
		}
		for _, b := range genBlocks[genAt[r]:genAt[r+1]] {
			if inTag[b] != tag {
				inTag[b] = tag
				work = append(work, b)
			}
		}
		for len(work) > 0 {
			b := work[len(work)-1]
			work = work[:len(work)-1]
			for _, p := range g.Blocks[b].Preds {
				g.work++
				if outTag[p] == tag {
					continue
				}
				outTag[p] = tag
				liveOut[p] = append(liveOut[p], r)
				if blockKill[p] != tag && inTag[p] != tag {
					inTag[p] = tag
					work = append(work, int32(p))
				}
			}
		}
	}
	// The wanted statements: one backward pass over each block holding one, from its live-out set.
	after := make([][]int, len(f.Body))
	var cur sparseSet
	cur.pos = make([]int32, nr)
	for _, bl := range g.Blocks {
		first := -1
		for k := bl.Start; k < bl.End; k++ {
			if want[k] {
				first = k
				break
			}
		}
		if first < 0 {
			continue
		}
		for _, r := range liveOut[bl.ID] {
			cur.add(r)
		}
		for k := bl.End - 1; k >= first; k-- {
			g.work++
			if want[k] {
				after[k] = cur.sorted()
				g.work += len(after[k])
			}
			s := f.Body[k]
			if s.Kind != StInstr {
				continue
			}
			if s.Pred == "" {
				for _, d := range g.defs[k] {
					cur.remove(d)
				}
			}
			for _, u := range g.uses[k] {
				cur.add(u)
			}
		}
		cur.reset()
	}
	return after
}

// regBlock is a (register key, block) pair.
type regBlock struct{ r, b int32 }

// byRegister buckets pairs by register (a counting sort): the blocks of register r are
// blocks[at[r]:at[r+1]], in the pairs' order.
func byRegister(pairs []regBlock, nr int) (at []int, blocks []int32) {
	at = make([]int, nr+1)
	for _, p := range pairs {
		at[p.r+1]++
	}
	for r := 0; r < nr; r++ {
		at[r+1] += at[r]
	}
	blocks = make([]int32, len(pairs))
	next := append([]int(nil), at[:nr]...)
	for _, p := range pairs {
		blocks[next[p.r]] = p.b
		next[p.r]++
	}
	return at, blocks
}

// sparseSet is a set of register keys with O(1) add and remove and O(size) listing; pos must
// have a slot per key.
type sparseSet struct {
	pos     []int32 // key -> index in members + 1, 0 when absent
	members []int
}

func (s *sparseSet) add(r int) {
	if s.pos[r] == 0 {
		s.members = append(s.members, r)
		s.pos[r] = int32(len(s.members))
	}
}

func (s *sparseSet) remove(r int) {
	i := s.pos[r]
	if i == 0 {
		return
	}
	last := s.members[len(s.members)-1]
	s.members[i-1] = last
	s.pos[last] = i
	s.members = s.members[:len(s.members)-1]
	s.pos[r] = 0
}

// sorted returns a copy of the members in ascending order (nil when empty).
func (s *sparseSet) sorted() []int {
	if len(s.members) == 0 {
		return nil
	}
	out := append([]int(nil), s.members...)
	sort.Ints(out)
	return out
}

func (s *sparseSet) reset() {
	for _, r := range s.members {
		s.pos[r] = 0
	}
	s.members = s.members[:0]
}

// postDominators returns ipdom[b] for every block (ExitNode when only the exit post-dominates).
// Blocks that cannot reach the exit (infinite loops) get the exit as immediate post-dominator.
// It is the Cooper-Harvey-Kennedy iteration on the reverse CFG ("A Simple, Fast Dominance
// Algorithm"): near-linear in practice, O(blocks) memory (the bitset version it replaces was
// cubic in time and quadratic in memory: 46 s for 2,000 blocks).
func (g *CFG) postDominators() []int {
	nb := len(g.Blocks)
	exit := nb
	// Predecessors in the reverse CFG are the successors; successors in the reverse CFG are the
	// predecessors, computed here.
	preds := make([][]int, nb+1)
	for i, b := range g.Blocks {
		for _, s := range b.Succs {
			preds[s] = append(preds[s], i)
		}
	}
	// Postorder of the reverse CFG from the exit (iterative DFS).
	order := make([]int, nb+1) // node -> postorder number, -1 if not reached
	for i := range order {
		order[i] = -1
	}
	var post []int
	visited := make([]bool, nb+1)
	type frame struct{ n, k int }
	stack := []frame{{exit, 0}}
	visited[exit] = true
	for len(stack) > 0 {
		top := &stack[len(stack)-1]
		if top.k < len(preds[top.n]) {
			x := preds[top.n][top.k]
			top.k++
			if !visited[x] {
				visited[x] = true
				stack = append(stack, frame{x, 0})
			}
			continue
		}
		order[top.n] = len(post)
		post = append(post, top.n)
		stack = stack[:len(stack)-1]
	}
	idom := make([]int, nb+1)
	for i := range idom {
		idom[i] = -1
	}
	idom[exit] = exit
	intersect := func(a, b int) int {
		for a != b {
			for order[a] < order[b] {
				a = idom[a]
			}
			for order[b] < order[a] {
				b = idom[b]
			}
		}
		return a
	}
	for changed := true; changed; {
		changed = false
		for k := len(post) - 2; k >= 0; k-- { // reverse postorder, the exit (last) excluded
			n := post[k]
			nd := -1
			for _, s := range g.Blocks[n].Succs {
				if idom[s] < 0 {
					continue
				}
				if nd < 0 {
					nd = s
				} else {
					nd = intersect(s, nd)
				}
			}
			if nd >= 0 && idom[n] != nd {
				idom[n] = nd
				changed = true
			}
		}
	}
	ipdom := make([]int, nb)
	for i := range ipdom {
		ipdom[i] = exit
		if idom[i] >= 0 {
			ipdom[i] = idom[i]
		}
	}
	return ipdom
}

// reachableFrom calls visit for the blocks reachable from the successors of b without entering
// stop. w holds the traversal's buffers, reused across calls (memory stays O(blocks)).
func (g *CFG) reachableFrom(b, stop int, w *walker, visit func(int)) {
	if len(w.seen) != len(g.Blocks)+1 {
		w.seen = make([]uint32, len(g.Blocks)+1)
	}
	w.gen++
	work := w.work[:0]
	for _, s := range g.Blocks[b].Succs {
		if s != stop && w.seen[s] != w.gen {
			w.seen[s] = w.gen
			work = append(work, s)
		}
	}
	for len(work) > 0 {
		x := work[len(work)-1]
		work = work[:len(work)-1]
		visit(x)
		if x >= len(g.Blocks) {
			continue
		}
		for _, s := range g.Blocks[x].Succs {
			if s != stop && w.seen[s] != w.gen {
				w.seen[s] = w.gen
				work = append(work, s)
			}
		}
	}
	w.work = work
}

// walker holds reachableFrom's reusable buffers.
type walker struct {
	seen []uint32
	gen  uint32
	work []int
}

// regKeyName strips the scope suffix of a register key.
func regKeyName(k string) string {
	if i := strings.IndexByte(k, '#'); i >= 0 {
		return k[:i]
	}
	return k
}
