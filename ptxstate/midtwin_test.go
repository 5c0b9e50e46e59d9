package ptxstate

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/golden"
)

// TestMidBlockGolden pins the mid-block twins of the kernels written for them (nvcc 12.4 PTX of
// testdata/nvcc12/midblock.cu): loop sites (nested, unrolled), barrier sites with predicates
// live across them, static shared memory declared in the body and dynamic shared memory.
func TestMidBlockGolden(t *testing.T) {
	tests := []struct {
		name string // testdata/nvcc12/NAME.sm_90.ptx; goldens NAME.mid.*
		want map[string]MidBlockLayout
	}{
		{"midblock", map[string]MidBlockLayout{
			"mc_hist":     {Sites: 2, Slots: 8},
			"smem_rounds": {Sites: 11, Slots: 19, StaticSharedBytes: 1040},
			"dyn_stencil": {Sites: 11, Slots: 7, DynamicShared: true},
			"nested_mix":  {Sites: 4, Slots: 12},
		}},
		// Thread-loops: one more slot, each thread's status.
		{"threadloop", map[string]MidBlockLayout{
			"spin_count":     {Sites: 1, Slots: 5, ThreadStops: true},
			"timer_deadline": {Sites: 1, Slots: 3, ThreadStops: true},
			"collatz_hist":   {Sites: 2, Slots: 12, StaticSharedBytes: 2048, ThreadStops: true},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, _ := mustParse(t, "testdata/nvcc12/"+tt.name+".sm_90.ptx")
			out, r, err := InstrumentWith(m, Options{MidBlock: true})
			if err != nil {
				t.Fatal(err)
			}
			golden.Check(t, filepath.Join("testdata", "golden", tt.name+".mid.instrumented.ptx"), out.Bytes())
			js, err := json.MarshalIndent(r, "", "  ")
			if err != nil {
				t.Fatal(err)
			}
			golden.Check(t, filepath.Join("testdata", "golden", tt.name+".mid.report.json"), append(js, '\n'))
			for _, k := range r.Kernels {
				if k.MidBlock == nil || *k.MidBlock != tt.want[k.Name] {
					t.Errorf("%s: mid-block layout %+v, want %+v", k.Name, k.MidBlock, tt.want[k.Name])
				}
			}
			text := string(out.Bytes())
			for name := range tt.want {
				if !strings.Contains(text, ".visible .global .align 4 .u32 "+MidDescPrefix+name+"[5]") {
					t.Errorf("no layout variable for %s", name)
				}
			}
		})
	}
}

// TestMidBlockOff: without the option nothing changes, and a kernel with no eligible site keeps
// its block-granular twin under it.
func TestMidBlockOff(t *testing.T) {
	for _, path := range committedCorpus(t) {
		m, _ := mustParse(t, path)
		plain, _, err := Instrument(m)
		if err != nil {
			t.Fatal(err)
		}
		mid, r, err := InstrumentWith(m, Options{MidBlock: true})
		if err != nil {
			t.Fatal(err)
		}
		any := false
		for _, k := range r.Kernels {
			if k.MidBlock != nil {
				any = true
				if !k.Eligible {
					t.Errorf("%s %s: a mid-block layout without a twin", path, k.Name)
				}
			}
			usable := false
			for _, s := range k.MidBlockSites {
				usable = usable || s.Eligible
			}
			if (k.MidBlock != nil) != (usable && k.Eligible) {
				t.Errorf("%s %s: mid-block twin %v, usable sites %v", path, k.Name, k.MidBlock != nil, usable)
			}
		}
		if !any && string(plain.Bytes()) != string(mid.Bytes()) {
			t.Errorf("%s: no mid-block twin, yet the output differs with the option", path)
		}
	}
}

// TestMidBlockAssembles: every committed module instrumented with mid-block twins assembles
// with the real ptxas for sm_80 and sm_90.
func TestMidBlockAssembles(t *testing.T) {
	ptxas := ptxasPath(t)
	if testing.Short() {
		t.Skip("ptxas runs are slow; skipped with -short")
	}
	twins := 0
	for _, path := range committedCorpus(t) {
		m, src := mustParse(t, path)
		out, rep, err := InstrumentWith(m, Options{MidBlock: true})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, k := range rep.Kernels {
			if k.MidBlock != nil {
				n++
			}
		}
		if n == 0 {
			continue
		}
		twins += n
		for _, arch := range []string{"sm_80", "sm_90"} {
			t.Run(filepath.Base(path)+"/"+arch, func(t *testing.T) { assembleBoth(t, ptxas, arch, src, out.Bytes()) })
		}
	}
	if twins < 4 {
		t.Fatalf("only %d mid-block twins in the corpus", twins)
	}
}

func TestMidBlockLayoutBytes(t *testing.T) {
	for _, c := range []struct {
		l            MidBlockLayout
		threads, dyn uint32
		want         uint64
	}{
		{MidBlockLayout{Slots: 8}, 256, 0, 64 + 8*8*256},
		{MidBlockLayout{Slots: 19, StaticSharedBytes: 1040}, 256, 4096, 64 + 8*19*256 + 1040},
		{MidBlockLayout{Slots: 7, DynamicShared: true}, 256, 1032, 64 + 8*7*256 + 1040},
		{MidBlockLayout{Slots: 1, DynamicShared: true}, 1, 1, 80},
		{MidBlockLayout{Slots: 2, LocalBytes: 16}, 32, 0, 64 + (16+16)*32},
	} {
		if got := c.l.RecordBytes(c.threads, c.dyn); got != c.want {
			t.Errorf("%+v.RecordBytes(%d, %d) = %d, want %d", c.l, c.threads, c.dyn, got, c.want)
		}
	}
	for _, c := range []struct{ instrs, want int }{{1, 1024}, {10, 128}, {64, 16}, {100, 16}, {1024, 1}, {5000, 1}, {0, 1024}} {
		if got := pollEvery(c.instrs); got != c.want {
			t.Errorf("pollEvery(%d) = %d, want %d", c.instrs, got, c.want)
		}
	}
}

// TestMidBlockReducible: every mid-block twin's control flow is reducible (each loop is entered
// only through its header): the resume reaches a site inside loops through their headers. With
// jumps from the resume code straight into loop bodies, ptxas 13 compiled the twin of
// cuda-samples' fwtBatch1Kernel (testdata/public) into wrong results even in runs that never
// resumed (H100, 2026-11-27). The originals are checked too: the property is the twin's to keep.
func TestMidBlockReducible(t *testing.T) {
	twins := 0
	for _, path := range committedCorpus(t) {
		m, _ := mustParse(t, path)
		out, r, err := InstrumentWith(m, Options{MidBlock: true})
		if err != nil {
			t.Fatal(err)
		}
		mid := map[string]bool{}
		for _, k := range r.Kernels {
			if k.MidBlock != nil {
				mid[k.Name] = true
				mid[k.Name+TwinSuffix] = true
			}
		}
		if len(mid) == 0 {
			continue
		}
		im, err := Parse(out.Bytes())
		if err != nil {
			t.Fatalf("%s: instrumented output does not parse: %v", path, err)
		}
		for _, it := range im.Items {
			if it.Kind != ItemFunc || it.Func == nil || !mid[it.Func.Name] {
				continue
			}
			g, err := buildCFG(it.Func)
			if err != nil {
				t.Fatalf("%s %s: %v", path, it.Func.Name, err)
			}
			if u, v, ok := irreducibleEdge(g); !ok {
				t.Errorf("%s %s: irreducible: the edge from block %d (line %d) enters a loop at block %d (line %d), not at its header",
					path, it.Func.Name, u, it.Func.Body[g.Blocks[u].Start].Line, v, it.Func.Body[g.Blocks[v].Start].Line)
			}
			if strings.HasSuffix(it.Func.Name, TwinSuffix) {
				twins++
				if line, ok := leaderReachesBody(g); !ok {
					t.Errorf("%s %s: the leader-only instruction at line %d reaches the original body without a CTA barrier (warp 0 would run it split)",
						path, it.Func.Name, line)
				}
			}
		}
	}
	if twins == 0 {
		t.Fatal("no mid-block twin in the corpus")
	}
}

// irreducibleEdge finds a retreating edge (u -> v, v on the depth-first path to u) whose target
// does not dominate its source: the graph is reducible exactly when there is none.
func irreducibleEdge(g *CFG) (int, int, bool) {
	n := len(g.Blocks)
	if n == 0 {
		return 0, 0, true
	}
	// Dominators (Cooper, Harvey, Kennedy) over reverse postorder from block 0.
	order, onPath := []int{}, make([]bool, n)
	seen := make([]bool, n)
	var retreating [][2]int
	var dfs func(int)
	dfs = func(b int) {
		seen[b], onPath[b] = true, true
		for _, s := range g.Blocks[b].Succs {
			if s >= n {
				continue
			}
			if onPath[s] {
				retreating = append(retreating, [2]int{b, s})
			} else if !seen[s] {
				dfs(s)
			}
		}
		onPath[b] = false
		order = append(order, b)
	}
	dfs(0)
	rpo := make([]int, n)
	for i := range rpo {
		rpo[i] = -1
	}
	for i, b := range order {
		rpo[b] = len(order) - 1 - i
	}
	idom := make([]int, n)
	for i := range idom {
		idom[i] = -1
	}
	idom[0] = 0
	intersect := func(a, b int) int {
		for a != b {
			for rpo[a] > rpo[b] {
				a = idom[a]
			}
			for rpo[b] > rpo[a] {
				b = idom[b]
			}
		}
		return a
	}
	for changed := true; changed; {
		changed = false
		for i := len(order) - 1; i >= 0; i-- {
			b := order[i]
			if b == 0 {
				continue
			}
			nd := -1
			for _, p := range g.Blocks[b].Preds {
				if p < n && rpo[p] >= 0 && idom[p] >= 0 {
					if nd < 0 {
						nd = p
					} else {
						nd = intersect(p, nd)
					}
				}
			}
			if nd >= 0 && idom[b] != nd {
				idom[b], changed = nd, true
			}
		}
	}
	dominates := func(a, b int) bool {
		for {
			if a == b {
				return true
			}
			if b == 0 || idom[b] < 0 {
				return false
			}
			b = idom[b]
		}
	}
	for _, e := range retreating {
		if !dominates(e[1], e[0]) {
			return e[0], e[1], false
		}
	}
	return 0, 0, true
}

// TestMidBlockTwins: with Options.MidBlockTwins each kernel keeps the block-granular twin it gets
// without options, byte for byte, and a kernel with eligible sites gets a second twin, the
// --mid-block one under the name K_mid__ptxmig (with its own scheduler slot); the module
// assembles.
func TestMidBlockTwins(t *testing.T) {
	m, src := mustParse(t, "testdata/nvcc12/midblock.sm_90.ptx")
	plain, _, err := Instrument(m)
	if err != nil {
		t.Fatal(err)
	}
	mid, _, err := InstrumentWith(m, Options{MidBlock: true})
	if err != nil {
		t.Fatal(err)
	}
	both, r, err := InstrumentWith(m, Options{MidBlockTwins: true})
	if err != nil {
		t.Fatal(err)
	}
	text, plainText, midText := string(both.Bytes()), string(plain.Bytes()), string(mid.Bytes())
	n := 0
	for _, k := range r.Kernels {
		if !k.Eligible {
			continue
		}
		if got, want := funcText(t, text, k.Twin), funcText(t, plainText, k.Twin); got != want {
			t.Errorf("%s: the block twin differs from the one without options", k.Name)
		}
		if k.MidBlock == nil {
			if k.MidTwin != "" || strings.Contains(text, k.Name+MidTwinInfix+TwinSuffix) {
				t.Errorf("%s: no eligible site, yet a mid-block twin %q", k.Name, k.MidTwin)
			}
			continue
		}
		n++
		if k.MidTwin != k.Name+MidTwinInfix+TwinSuffix {
			t.Fatalf("%s: mid twin named %q", k.Name, k.MidTwin)
		}
		want := strings.NewReplacer(k.Twin, k.MidTwin, slotPrefix+k.Name, slotPrefix+k.Name+MidTwinInfix).Replace(funcText(t, midText, k.Twin))
		if got := funcText(t, text, k.MidTwin); got != want {
			t.Errorf("%s: the mid-block twin differs from --mid-block's, renamed:\n%s\nwant:\n%s", k.Name, got, want)
		}
		if !strings.Contains(text, ".shared .align 16 .b8 "+slotPrefix+k.Name+MidTwinInfix+"[") {
			t.Errorf("%s: no scheduler slot of its own for the mid twin", k.Name)
		}
	}
	if n < 4 {
		t.Fatalf("only %d mid-block twins", n)
	}
	if _, err := Parse(both.Bytes()); err != nil {
		t.Fatalf("the module with both twins does not parse again: %v", err)
	}
	if testing.Short() {
		return
	}
	ptxas := ptxasPath(t)
	for _, arch := range []string{"sm_80", "sm_90"} {
		t.Run(arch, func(t *testing.T) { assembleBoth(t, ptxas, arch, src, both.Bytes()) })
	}
}

// TestMidBlockTwinNameTaken: a module that already has a kernel K_mid (whose own twin would be
// K_mid__ptxmig) gives K no second twin, and says why.
func TestMidBlockTwinNameTaken(t *testing.T) {
	_, src := mustParse(t, "testdata/nvcc12/midblock.sm_90.ptx")
	// A copy of mc_hist named mc_hist_mid.
	text := string(src)
	start := strings.Index(text, ".visible .entry mc_hist(")
	if start < 0 {
		t.Fatal("no mc_hist in the fixture")
	}
	end := start + strings.Index(text[start:], "\n}\n") + 3
	dup := strings.ReplaceAll(text[start:end], "mc_hist", "mc_hist_mid")
	m, err := Parse([]byte(text + "\n" + dup))
	if err != nil {
		t.Fatal(err)
	}
	out, r, err := InstrumentWith(m, Options{MidBlockTwins: true})
	if err != nil {
		t.Fatal(err)
	}
	// No layout variable for mc_hist either: the shim would take mc_hist_mid__ptxmig (the twin of
	// mc_hist_mid) for mc_hist's mid-block twin.
	if strings.Contains(string(out.Bytes()), MidDescPrefix+"mc_hist[") {
		t.Error("a mid-block layout variable for mc_hist, whose mid twin's name is taken")
	}
	if _, err := Parse(out.Bytes()); err != nil {
		t.Errorf("the output does not parse again: %v", err)
	}
	for _, k := range r.Kernels {
		if k.Name != "mc_hist" {
			continue
		}
		if k.MidTwin != "" || k.MidBlock != nil || !strings.Contains(strings.Join(k.Notes, "\n"), "no mid-block twin") {
			t.Fatalf("mc_hist beside mc_hist_mid: mid twin %q, layout %v, notes %q", k.MidTwin, k.MidBlock, k.Notes)
		}
		return
	}
	t.Fatal("mc_hist not reported")
}

// funcText is the text of the function named name in a printed module, from ".entry name(" to
// its closing brace.
func funcText(t *testing.T, text, name string) string {
	t.Helper()
	i := strings.Index(text, ".entry "+name+"(")
	if i < 0 {
		t.Fatalf("no function %s", name)
	}
	j := strings.Index(text[i:], "\n}\n")
	if j < 0 {
		t.Fatalf("function %s has no end", name)
	}
	return text[i : i+j+3]
}
