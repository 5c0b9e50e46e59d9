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
	m, _ := mustParse(t, "testdata/nvcc12/midblock.sm_90.ptx")
	out, r, err := InstrumentWith(m, Options{MidBlock: true})
	if err != nil {
		t.Fatal(err)
	}
	golden.Check(t, filepath.Join("testdata", "golden", "midblock.mid.instrumented.ptx"), out.Bytes())
	js, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	golden.Check(t, filepath.Join("testdata", "golden", "midblock.mid.report.json"), append(js, '\n'))
	want := map[string]MidBlockLayout{
		"mc_hist":     {Sites: 2, Slots: 8},
		"smem_rounds": {Sites: 11, Slots: 19, StaticSharedBytes: 1040},
		"dyn_stencil": {Sites: 11, Slots: 7, DynamicShared: true},
		"nested_mix":  {Sites: 4, Slots: 12},
	}
	for _, k := range r.Kernels {
		if k.MidBlock == nil || *k.MidBlock != want[k.Name] {
			t.Errorf("%s: mid-block layout %+v, want %+v", k.Name, k.MidBlock, want[k.Name])
		}
	}
	text := string(out.Bytes())
	for name := range want {
		if !strings.Contains(text, ".visible .global .align 4 .u32 "+MidDescPrefix+name+"[5]") {
			t.Errorf("no layout variable for %s", name)
		}
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
