package ptxstate

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand"
	"reflect"
	"runtime"
	"slices"
	"sort"
	"strings"
	"testing"
)

// genBarriers generates a kernel with n `bar.sync 0;` barriers (issue 36, item 7): "straight" is
// one basic block in which each barrier publishes a value through shared memory and reads
// another thread's back (a handful of registers, as after register allocation); "fresh" is the
// same with new registers at every step, as nvcc numbers them in fully unrolled code;
// "divergent" is "straight" after a return that only some threads take (every barrier is then
// reached divergently and refused); "loops" is n loops in sequence, each with a barrier in its
// body; "oneloop" is "fresh" inside one loop whose exit depends on the last value (its exit
// branch depends on every register); "nested" is n loops nested in one another, each with a
// barrier before the next.
func genBarriers(shape string, n int) []byte {
	var b strings.Builder
	b.WriteString(".version 8.4\n.target sm_80\n.address_size 64\n\n.shared .align 4 .b8 sbuf[4096];\n\n" +
		".visible .entry bars(\n\t.param .u64 bars_param_0,\n\t.param .u32 bars_param_1\n)\n{\n")
	if shape == "fresh" || shape == "oneloop" {
		fmt.Fprintf(&b, "\t.reg .pred \t%%p<2>;\n\t.reg .b32 \t%%r<%d>;\n\t.reg .b64 \t%%rd<4>;\n\n", 2*n+8)
	} else {
		b.WriteString("\t.reg .pred \t%p<2>;\n\t.reg .b32 \t%r<8>;\n\t.reg .b64 \t%rd<4>;\n\n")
	}
	b.WriteString("\tld.param.u64 \t%rd1, [bars_param_0];\n\tld.param.u32 \t%r1, [bars_param_1];\n\tmov.u32 \t%r2, %tid.x;\n" +
		"\tshl.b32 \t%r3, %r2, 2;\n\tmov.u32 \t%r4, sbuf;\n\tadd.s32 \t%r4, %r4, %r3;\n\tmov.u32 \t%r5, 0;\n")
	switch shape {
	case "divergent":
		b.WriteString("\tsetp.ge.u32 \t%p1, %r2, %r1;\n\t@%p1 ret;\n")
	case "oneloop":
		b.WriteString("$L__BB0_loop:\n")
	}
	last := 5
	for i := 0; i < n; i++ {
		off := 4 * (i % 1024)
		switch shape {
		case "straight", "divergent":
			fmt.Fprintf(&b, "\tst.shared.u32 \t[%%r4], %%r5;\n\tbar.sync \t0;\n\tld.shared.u32 \t%%r6, [sbuf+%d];\n\tadd.s32 \t%%r5, %%r5, %%r6;\n", off)
		case "fresh", "oneloop":
			v, sum := 8+2*i, 9+2*i
			fmt.Fprintf(&b, "\tst.shared.u32 \t[%%r4], %%r%d;\n\tbar.sync \t0;\n\tld.shared.u32 \t%%r%d, [sbuf+%d];\n\tadd.s32 \t%%r%d, %%r%d, %%r%d;\n",
				last, v, off, sum, last, v)
			last = sum
		case "loops":
			fmt.Fprintf(&b, "\tmov.u32 \t%%r7, 0;\n$L__BB0_%d:\n\tst.shared.u32 \t[%%r4], %%r5;\n\tbar.sync \t0;\n\tld.shared.u32 \t%%r6, [sbuf+%d];\n"+
				"\tadd.s32 \t%%r5, %%r5, %%r6;\n\tadd.s32 \t%%r7, %%r7, 1;\n\tsetp.lt.u32 \t%%p1, %%r7, %%r1;\n\t@%%p1 bra \t$L__BB0_%d;\n", i, off, i)
		case "nested":
			fmt.Fprintf(&b, "\tmov.u32 \t%%r7, 0;\n$L__BB0_%d:\n\tst.shared.u32 \t[%%r4], %%r5;\n\tbar.sync \t0;\n\tld.shared.u32 \t%%r6, [sbuf+%d];\n"+
				"\tadd.s32 \t%%r5, %%r5, %%r6;\n", i, off)
		}
	}
	switch shape {
	case "nested":
		for i := n - 1; i >= 0; i-- {
			fmt.Fprintf(&b, "\tadd.s32 \t%%r7, %%r7, 1;\n\tsetp.lt.u32 \t%%p1, %%r7, %%r1;\n\t@%%p1 bra \t$L__BB0_%d;\n", i)
		}
	case "oneloop":
		fmt.Fprintf(&b, "\tsetp.lt.u32 \t%%p1, %%r%d, %%r1;\n\t@%%p1 bra \t$L__BB0_loop;\n", last)
	}
	fmt.Fprintf(&b, "\tcvta.to.global.u64 \t%%rd2, %%rd1;\n\tmul.wide.u32 \t%%rd3, %%r2, 4;\n\tadd.s64 \t%%rd2, %%rd2, %%rd3;\n\tst.global.u32 \t[%%rd2], %%r%d;\n\tret;\n}\n", last)
	return []byte(b.String())
}

// barrierShapes are genBarriers' shapes.
var barrierShapes = []string{"straight", "fresh", "divergent", "loops", "oneloop", "nested"}

// barrierCost analyses the kernel of src as `ptx analyze` does, then plans its mid-block twin as
// `ptx instrument --mid-block` does, and returns the work counted on its CFG, the bytes
// allocated from Parse on, and the size of the JSON report.
func barrierCost(t *testing.T, src []byte) (work int, alloc uint64, report int) {
	t.Helper()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	m, err := Parse(src)
	if err != nil {
		t.Fatal(err)
	}
	a := newAnalyzer(m)
	f := m.Items[len(m.Items)-1].Func
	kr, info, err := a.kernel(f)
	if err != nil {
		t.Fatal(err)
	}
	if kr.Eligible {
		a.planMidBlock(f, kr, info)
	}
	runtime.ReadMemStats(&after)
	js, err := json.Marshal(&Report{Kernels: []KernelReport{*kr}})
	if err != nil {
		t.Fatal(err)
	}
	return info.cfg.work, after.TotalAlloc - before.TotalAlloc, len(js)
}

// TestAnalyzeBarriersLinear: analysing 4 times the barriers costs about 4 times the work, memory
// and report, never 16 (issue 36, item 7: 10,000 barriers took 1.7 s, 20,000 6.4 s, 50,000
// 109 s). The per-site poll interval scanned the whole body at every barrier; liveness kept a
// register bitset per statement (statements x registers); every site's C6 refusal listed all of
// the kernel's refusals (one per divergent barrier: 530 MB of report for 2,000 barriers); the
// spin-wait check scanned a loop's statements for every register its exit depends on; the
// mid-block plan tested every loop for every site. Work is counted, not timed;
// BenchmarkAnalyzeBarriers measures the time. (Nested loops cost their depth times their
// statements: MaxLoopDepth bounds that, TestLoopDepthLimit.)
func TestAnalyzeBarriersLinear(t *testing.T) {
	const maxRatio = 6.0 // for 4x the barriers; quadratic work gives about 16
	for _, shape := range barrierShapes {
		if shape == "nested" {
			continue
		}
		n := 1000
		if shape == "divergent" {
			n = 250 // its report was 0.5 GB at 4n before
		}
		t.Run(shape, func(t *testing.T) {
			w1, m1, r1 := barrierCost(t, genBarriers(shape, n))
			w4, m4, r4 := barrierCost(t, genBarriers(shape, 4*n))
			t.Logf("n=%d: work %d -> %d, allocated %d -> %d, report %d -> %d bytes", n, w1, w4, m1, m4, r1, r4)
			for _, c := range []struct {
				what string
				a, b uint64
			}{{"work", uint64(w1), uint64(w4)}, {"memory", m1, m4}, {"report", uint64(r1), uint64(r4)}} {
				if r := float64(c.b) / float64(c.a); r > maxRatio {
					t.Errorf("%s grows %.1fx for 4x the barriers (%d -> %d), want at most %.0fx", c.what, r, c.a, c.b, maxRatio)
				}
			}
		})
	}
}

// TestLoopDepthLimit: loops nested deeper than MaxLoopDepth are refused with ErrLimit, naming the
// depth and the limit; at the limit they are analysed.
func TestLoopDepthLimit(t *testing.T) {
	m, err := Parse(genBarriers("nested", MaxLoopDepth))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Analyze(m); err != nil {
		t.Fatalf("%d nested loops: %v", MaxLoopDepth, err)
	}
	m, err = Parse(genBarriers("nested", MaxLoopDepth+1))
	if err != nil {
		t.Fatal(err)
	}
	_, err = Analyze(m)
	want := fmt.Sprintf("loops nested %d deep in bars (backward branches whose spans share a block), at most %d", MaxLoopDepth+1, MaxLoopDepth)
	if !errors.Is(err, ErrLimit) || !strings.Contains(err.Error(), want) {
		t.Fatalf("%d nested loops: %v, want ErrLimit and %q", MaxLoopDepth+1, err, want)
	}
	if _, _, err := Instrument(m); !errors.Is(err, ErrLimit) {
		t.Fatalf("instrument %d nested loops: %v, want ErrLimit", MaxLoopDepth+1, err)
	}
}

// BenchmarkAnalyzeBarriers: `ptx analyze` of kernels with n barriers (issue 36, item 7).
func BenchmarkAnalyzeBarriers(b *testing.B) {
	for _, shape := range []string{"straight", "fresh", "loops"} {
		for _, n := range []int{1000, 10000, 50000} {
			if shape == "loops" && 2*n > MaxBlocksPerKernel {
				n = MaxBlocksPerKernel/2 - 2 // two blocks per loop
			}
			src := genBarriers(shape, n)
			b.Run(fmt.Sprintf("%s-%d", shape, n), func(b *testing.B) {
				b.SetBytes(int64(len(src)))
				b.ReportAllocs()
				for i := 0; i < b.N; i++ {
					m, err := Parse(src)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := Analyze(m); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// TestMidBlockC6Bounded: a kernel refused for each of its 20 divergent barriers has 20 refusals,
// and each site's C6 refusal names the first maxC6Reasons of them and counts the rest.
func TestMidBlockC6Bounded(t *testing.T) {
	m, err := Parse(genBarriers("divergent", 20))
	if err != nil {
		t.Fatal(err)
	}
	r, err := Analyze(m)
	if err != nil {
		t.Fatal(err)
	}
	k := r.Kernels[0]
	if len(k.Refusals) != 20 || len(k.MidBlockSites) != 20 {
		t.Fatalf("%d refusals, %d sites, want 20 and 20", len(k.Refusals), len(k.MidBlockSites))
	}
	want := "C6: the kernel has no block-granular twin (" + strings.Join(k.Refusals[:maxC6Reasons], "; ") + "; and 12 more (the kernel's refusals))"
	for _, s := range k.MidBlockSites {
		if !slices.Contains(s.Refusals, want) {
			t.Fatalf("site at line %d: refusals %q, want one of them %q", s.Line, s.Refusals, want)
		}
	}
}

// analysisCFGs are the CFGs of every function body of the committed PTX and of generated kernels
// of every shape, small.
func analysisCFGs(t *testing.T) map[string]*CFG {
	t.Helper()
	srcs := map[string][]byte{}
	for _, path := range committedCorpus(t) {
		_, src := mustParse(t, path)
		srcs[path] = src
	}
	for _, shape := range []string{"ifs", "ring", "nest", "straight"} {
		srcs["genKernel-"+shape] = genKernel(shape, 60)
	}
	for _, shape := range barrierShapes {
		srcs["genBarriers-"+shape] = genBarriers(shape, 40)
	}
	for name, src := range randomKernels(true) {
		srcs[name] = src
	}
	cfgs := map[string]*CFG{}
	for name, src := range srcs {
		m, err := Parse(src)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for _, it := range m.Items {
			if it.Kind != ItemFunc || it.Func.Proto {
				continue
			}
			g, err := buildCFG(it.Func)
			if err != nil {
				t.Fatalf("%s: %s: %v", name, it.Func.Name, err)
			}
			cfgs[name+":"+it.Func.Name] = g
		}
	}
	return cfgs
}

// denseLiveness is liveness as it was before issue 36: iterative dataflow over a register bitset
// per block, then one per statement. The reference for TestLivenessSparse.
func denseLiveness(g *CFG) []bitset {
	n := len(g.regNames)
	f := g.Fn
	liveIn := make([]bitset, len(g.Blocks))
	liveOut := make([]bitset, len(g.Blocks))
	for i := range g.Blocks {
		liveIn[i], liveOut[i] = newBitset(n), newBitset(n)
	}
	transfer := func(b *Block, out bitset, perStmt []bitset) bitset {
		cur := newBitset(n)
		copy(cur, out)
		for k := b.End - 1; k >= b.Start; k-- {
			if perStmt != nil {
				perStmt[k] = newBitset(n)
				copy(perStmt[k], cur)
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
			if in := transfer(b, liveOut[i], nil); !slices.Equal(in, liveIn[i]) {
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

// TestLivenessSparse: the sparse liveness gives, after every statement, the registers the dense
// dataflow it replaced gives.
func TestLivenessSparse(t *testing.T) {
	for name, g := range analysisCFGs(t) {
		want := make([]bool, len(g.Fn.Body))
		for i := range want {
			want[i] = true
		}
		got, ref := g.liveness(want), denseLiveness(g)
		for i := range want {
			if !slices.Equal(got[i], ref[i].members()) {
				t.Fatalf("%s: after statement %d (line %d): live %v, want %v", name, i, g.Fn.Body[i].Line, got[i], ref[i].members())
			}
		}
		// Only the statements asked for.
		for i := range want {
			want[i] = i%3 == 0
		}
		for i, live := range g.liveness(want) {
			if i%3 != 0 && live != nil || i%3 == 0 && !slices.Equal(live, ref[i].members()) {
				t.Fatalf("%s: statement %d asked for %v: %v", name, i, want[i], live)
			}
		}
	}
}

// scanPollEvery is barrierPollEvery for block b as it was before issue 36 (a scan of every block
// per site). The reference for TestBarrierPollEvery.
func scanPollEvery(g *CFG, b int) int {
	bestH, bestL := -1, -1
	for _, bl := range g.Blocks {
		for _, h := range bl.Succs {
			if h <= bl.ID && h <= b && b <= bl.ID && (bestH < 0 || bl.ID-h < bestL-bestH) {
				bestH, bestL = h, bl.ID
			}
		}
	}
	if bestH < 0 {
		bestH, bestL = 0, len(g.Blocks)-1
	}
	instrs, bars := 0, 0
	for x := bestH; x <= bestL; x++ {
		for k := g.Blocks[x].Start; k < g.Blocks[x].End; k++ {
			if s := g.Fn.Body[k]; s.Kind == StInstr {
				instrs++
				if isBarrier(s) {
					bars++
				}
			}
		}
	}
	return pollEvery(instrs / max(bars, 1))
}

// TestBarrierPollEvery: the poll interval of every block is the one the per-site scan found.
func TestBarrierPollEvery(t *testing.T) {
	for name, g := range analysisCFGs(t) {
		got := barrierPollEvery(g)
		for b := range g.Blocks {
			if want := scanPollEvery(g, b); got[b] != want {
				t.Fatalf("%s: block %d: poll every %d, want %d", name, b, got[b], want)
			}
		}
	}
}

// TestPlanResumeSweep: the loops found around each mid-block site, and the heads and chains
// built from them, are those of testing every loop for every site (as before issue 36).
func TestPlanResumeSweep(t *testing.T) {
	srcs := map[string][]byte{}
	for _, path := range committedCorpus(t) {
		_, src := mustParse(t, path)
		srcs[path] = src
	}
	for _, shape := range barrierShapes {
		srcs["genBarriers-"+shape] = genBarriers(shape, 30)
	}
	for name, src := range randomKernels(false) {
		srcs[name] = src
	}
	plans := 0
	for name, src := range srcs {
		m, err := Parse(src)
		if err != nil {
			t.Fatal(err)
		}
		a := newAnalyzer(m)
		for _, it := range m.Items {
			if it.Kind != ItemFunc || !it.Func.Entry || it.Func.Proto {
				continue
			}
			kr, info, err := a.kernel(it.Func)
			if err != nil || !kr.Eligible {
				continue
			}
			p := a.planMidBlock(it.Func, kr, info)
			if p == nil {
				continue
			}
			plans++
			// The plan as the per-site scan made it.
			type loop struct{ h, latch int }
			var loops []loop
			for h, latch := range layoutLoops(p.g) {
				loops = append(loops, loop{h, latch})
			}
			sort.Slice(loops, func(a, b int) bool { return loops[a].h < loops[b].h })
			headAt, labelAt, chain := map[int]int{}, map[int]int{}, make([][]int, len(p.sites))
			var heads []midHead
			for id, s := range p.sites {
				b := p.g.blockOf[s.idx]
				for _, l := range loops {
					start := firstInstr(p.g, l.h)
					if l.h > b || b > l.latch || start < 0 {
						continue
					}
					k, ok := headAt[start]
					if !ok {
						k = len(heads)
						headAt[start] = k
						labelAt[p.g.Blocks[l.h].Start] = k
						heads = append(heads, midHead{})
					}
					heads[k].sites = append(heads[k].sites, id)
					chain[id] = append(chain[id], k)
				}
			}
			if !reflect.DeepEqual(p.heads, heads) || !reflect.DeepEqual(p.headAt, headAt) || !reflect.DeepEqual(p.labelAt, labelAt) || !reflect.DeepEqual(p.chain, chain) {
				t.Errorf("%s: %s: heads %v chains %v, want %v %v", name, it.Func.Name, p.heads, p.chain, heads, chain)
			}
		}
	}
	t.Logf("%d mid-block plans compared", plans)
	if plans < 5 {
		t.Fatalf("%d mid-block plans compared, want at least 5", plans)
	}
}

// genRandomKernel is a kernel of n blocks of random instructions (loads that may spin, atomics,
// arithmetic, predicated definitions, barriers) ending in random branches forward and back.
func genRandomKernel(rng *rand.Rand, n int, spins bool) []byte {
	var b strings.Builder
	b.WriteString(".version 8.4\n.target sm_80\n.address_size 64\n\n.shared .align 4 .b8 sbuf[64];\n\n" +
		".visible .entry rnd(\n\t.param .u64 rnd_param_0\n)\n{\n\t.reg .pred \t%p<4>;\n\t.reg .b32 \t%r<9>;\n\t.reg .b64 \t%rd<4>;\n\n" +
		"\tld.param.u64 \t%rd1, [rnd_param_0];\n\tcvta.to.global.u64 \t%rd2, %rd1;\n\tmov.u32 \t%r1, %tid.x;\n\tmov.u32 \t%r2, sbuf;\n" +
		"\tmov.u32 \t%r3, 0;\n\tmov.u32 \t%r4, 0;\n\tmov.u32 \t%r5, 0;\n\tmov.u32 \t%r6, 0;\n\tmov.u32 \t%r7, 0;\n\tmov.u32 \t%r8, 0;\n" +
		"\tsetp.ne.u32 \t%p1, %r3, 0;\n\tsetp.ne.u32 \t%p2, %r3, 0;\n\tsetp.ne.u32 \t%p3, %r3, 0;\n")
	r := func() int { return 3 + rng.Intn(6) }
	p := func() int { return 1 + rng.Intn(3) }
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, "$L_%d:\n", i)
		for k := rng.Intn(4); k >= 0; k-- {
			switch x := rng.Intn(10); {
			case x == 0 && spins:
				fmt.Fprintf(&b, "\tld.volatile.global.u32 \t%%r%d, [%%rd2];\n", r())
			case x == 1 && spins:
				fmt.Fprintf(&b, "\tatom.global.add.u32 \t%%r%d, [%%rd2], 1;\n", r())
			case x == 2:
				fmt.Fprintf(&b, "\tld.shared.u32 \t%%r%d, [%%r2];\n", r())
			case x == 3:
				fmt.Fprintf(&b, "\t@%%p%d add.s32 \t%%r%d, %%r%d, 1;\n", p(), r(), r())
			case x == 4:
				fmt.Fprintf(&b, "\tsetp.lt.u32 \t%%p%d, %%r%d, %%r%d;\n", p(), r(), r())
			case x == 5:
				b.WriteString("\tbar.sync \t0;\n")
			case x == 6:
				fmt.Fprintf(&b, "\tadd.s32 \t%%r%d, %%r%d, %%r1;\n", r(), r())
			default:
				fmt.Fprintf(&b, "\tadd.s32 \t%%r%d, %%r%d, %%r%d;\n", r(), r(), r())
			}
		}
		switch x := rng.Intn(8); {
		case x < 3:
			fmt.Fprintf(&b, "\t@%%p%d bra \t$L_%d;\n", p(), rng.Intn(n))
		case x == 3:
			fmt.Fprintf(&b, "\tbra.uni \t$L_%d;\n", rng.Intn(n))
		case x == 4:
			fmt.Fprintf(&b, "\t@%%p%d ret;\n", p())
		}
	}
	b.WriteString("\tst.global.u32 \t[%rd2], %r3;\n\tret;\n}\n")
	return []byte(b.String())
}

// randomKernels are genRandomKernel's kernels, by name.
func randomKernels(spins bool) map[string][]byte {
	rng := rand.New(rand.NewSource(36))
	out := map[string][]byte{}
	for i := 0; i < 300; i++ {
		out[fmt.Sprintf("random-%v-%d", spins, i)] = genRandomKernel(rng, 1+rng.Intn(12), spins)
	}
	return out
}

// scanLoops is the spin-wait check as it was before issue 36 (every back edge on its own, a scan
// of the loop's statements per dependency), returning each refusal with the index of the back
// edge (in block, then successor order) that first gave it. The reference for TestSpinWaitLoops.
func scanLoops(g *CFG, prov *provenance) map[string]int {
	f := g.Fn
	first := map[string]int{}
	edge := -1
	refuse := func(format string, args ...any) {
		msg := fmt.Sprintf(format, args...)
		if _, ok := first[msg]; !ok {
			first[msg] = edge
		}
	}
	for _, b := range g.Blocks {
		for _, h := range b.Succs {
			if h > b.ID || h >= len(g.Blocks) {
				continue
			}
			edge++
			in := map[int]bool{}
			for x := h; x <= b.ID; x++ {
				in[x] = true
			}
			deps := map[int]bool{}
			var work []int
			for x := range in {
				bl := g.Blocks[x]
				last := f.Body[bl.End-1]
				if last.Kind == StInstr && last.Pred != "" && (last.Base() == "bra" || last.Base() == "ret" || last.Base() == "exit") {
					for _, u := range g.uses[bl.End-1] {
						if !deps[u] {
							deps[u] = true
							work = append(work, u)
						}
					}
				}
			}
			for len(work) > 0 {
				r := work[len(work)-1]
				work = work[:len(work)-1]
				for x := range in {
					bl := g.Blocks[x]
					for k := bl.Start; k < bl.End; k++ {
						s := f.Body[k]
						if s.Kind != StInstr || !containsInt(g.defs[k], r) {
							continue
						}
						switch {
						case (s.Base() == "ld" || s.Base() == "atom") && prov.privateAccess(k):
						case s.Base() == "ld" && (s.HasMod("volatile") || s.HasMod("acquire") || s.HasMod("relaxed")):
							refuse("spin-wait: the loop at line %d waits on %s (line %d), which another CTA may write", f.Body[g.Blocks[h].Start].Line, s.Op, s.Line)
						case s.Base() == "atom" && (s.HasMod("add") || s.HasMod("inc")) || s.Base() == "atom" && s.HasMod("or") && len(s.Args) == 3 && s.Args[2].Text == "0":
							refuse("schedules its own work: the loop at line %d exits on the result of %s (line %d), a kernel that is already persistent", f.Body[g.Blocks[h].Start].Line, s.Op, s.Line)
						}
						for _, u := range g.uses[k] {
							if !deps[u] {
								deps[u] = true
								work = append(work, u)
							}
						}
					}
				}
			}
		}
	}
	return first
}

// TestSpinWaitLoops: the spin-wait check gives the refusals that checking every back edge on its
// own gave, in the order of the back edges that first give them.
func TestSpinWaitLoops(t *testing.T) {
	srcs := randomKernels(true)
	for _, path := range committedCorpus(t) {
		_, src := mustParse(t, path)
		srcs[path] = src
	}
	for _, shape := range barrierShapes {
		srcs["genBarriers-"+shape] = genBarriers(shape, 30)
	}
	refusals := 0
	for name, src := range srcs {
		m, err := Parse(src)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		a := newAnalyzer(m)
		for _, it := range m.Items {
			if it.Kind != ItemFunc || it.Func.Proto {
				continue
			}
			g, err := buildCFG(it.Func)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			prov := a.provenanceOf(g)
			var got []string
			a.loops(g, prov, func(format string, args ...any) { got = append(got, fmt.Sprintf(format, args...)) })
			got = dedup(got)
			want := scanLoops(g, prov)
			refusals += len(want)
			if len(got) != len(want) {
				t.Fatalf("%s: %s: refusals %q, want %v", name, it.Func.Name, got, want)
			}
			for i, msg := range got {
				e, ok := want[msg]
				if !ok {
					t.Fatalf("%s: %s: refusal %q, want none such (%v)", name, it.Func.Name, msg, want)
				}
				if i > 0 && e < want[got[i-1]] {
					t.Fatalf("%s: %s: refusal %q (back edge %d) after %q (back edge %d)", name, it.Func.Name, msg, e, got[i-1], want[got[i-1]])
				}
			}
		}
	}
	t.Logf("%d refusals compared", refusals)
	if refusals < 100 {
		t.Fatalf("%d refusals compared, want at least 100", refusals)
	}
}
