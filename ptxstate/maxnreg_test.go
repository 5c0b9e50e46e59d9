package ptxstate

import (
	"context"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/ptxas"
)

// TestMaxNRegOption: a cap given for a kernel lands on its twin's header, never on the original,
// and is left out where the kernel has .maxnreg or .minnctapersm of its own.
func TestMaxNRegOption(t *testing.T) {
	src := `.version 8.4
.target sm_90
.address_size 64

.visible .entry plain(
	.param .u64 p
)
{
	.reg .b32 %r<3>;
	.reg .b64 %rd<3>;
	ld.param.u64 %rd1, [p];
	cvta.to.global.u64 %rd2, %rd1;
	mov.u32 %r1, %ctaid.x;
	st.global.u32 [%rd2], %r1;
	ret;
}

.visible .entry own(
	.param .u64 p
)
.maxnreg 40
{
	.reg .b32 %r<3>;
	.reg .b64 %rd<3>;
	ld.param.u64 %rd1, [p];
	cvta.to.global.u64 %rd2, %rd1;
	mov.u32 %r1, %ctaid.x;
	st.global.u32 [%rd2], %r1;
	ret;
}
`
	m, err := Parse([]byte(src))
	if err != nil {
		t.Fatal(err)
	}
	out, rep, err := InstrumentWith(m, Options{MaxNReg: map[string]int{"plain": 32, "own": 32}})
	if err != nil {
		t.Fatal(err)
	}
	text := string(out.Bytes())
	twinHead := func(name string) string {
		i := strings.Index(text, ".entry "+name+"(")
		if i < 0 {
			t.Fatalf("no entry %s in\n%s", name, text)
		}
		return text[i : i+strings.Index(text[i:], "{")]
	}
	if h := twinHead("plain__ptxmig"); !strings.Contains(h, ".maxnreg 32") {
		t.Errorf("twin of plain lacks .maxnreg 32:\n%s", h)
	}
	if h := twinHead("plain"); strings.Contains(h, ".maxnreg") {
		t.Errorf("the original got a .maxnreg:\n%s", h)
	}
	if h := twinHead("own__ptxmig"); strings.Count(h, ".maxnreg") != 1 || !strings.Contains(h, ".maxnreg 40") {
		t.Errorf("twin of own should keep only its .maxnreg 40:\n%s", h)
	}
	got := map[string]int{}
	for _, k := range rep.Kernels {
		got[k.Name] = k.TwinMaxNReg
	}
	if got["plain"] != 32 || got["own"] != 0 {
		t.Errorf("report twin_maxnreg %v", got)
	}
	if _, err := Parse(out.Bytes()); err != nil {
		t.Fatalf("instrumented module does not parse: %v", err)
	}
}

// TestMatchRegistersAssembles: with the caps --match-registers computes (ptxas -v on the
// original, SameOccupancyRegs), every twin of the corpus assembles with the real ptxas and fits
// as many warps per SM as its original. Logs how many twins the caps changed.
func TestMatchRegistersAssembles(t *testing.T) {
	bin := ptxasPath(t)
	if testing.Short() {
		t.Skip("ptxas runs are slow; skipped with -short")
	}
	const arch = "sm_90"
	warps := func(r int) int { return min(64, 65536/(32*((r+7)/8*8))) }
	used := regexp.MustCompile(`\.maxnreg (\d+)`)
	capped, lower := 0, 0
	for _, path := range corpus(t) {
		_, src := mustParse(t, path)
		low := lowerFor(src, arch)
		orig, err := ptxas.Registers(context.Background(), bin, low, arch)
		if err != nil {
			t.Logf("%s: the original, lowered to ISA 8.4, does not assemble here (newer feature): skipped", filepath.Base(path))
			continue
		}
		m, err := Parse(low)
		if err != nil {
			t.Fatal(err)
		}
		plainOut, _, err := Instrument(m)
		if err != nil {
			t.Fatal(err)
		}
		plain, err := ptxas.Registers(context.Background(), bin, plainOut.Bytes(), arch)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		caps := map[string]int{}
		for k, n := range orig {
			caps[k] = ptxas.SameOccupancyRegs(n, arch)
		}
		out, rep, err := InstrumentWith(m, Options{MaxNReg: caps})
		if err != nil {
			t.Fatal(err)
		}
		regs, err := ptxas.Registers(context.Background(), bin, out.Bytes(), arch)
		if err != nil {
			t.Fatalf("%s: capped module does not assemble: %v", filepath.Base(path), err)
		}
		for _, k := range rep.Kernels {
			if !k.Eligible {
				continue
			}
			o, tw := orig[k.Name], regs[k.Twin]
			if k.TwinMaxNReg > 0 {
				capped++
				if !used.MatchString(string(out.Bytes())) {
					t.Errorf("%s: report says .maxnreg %d, the text has none", k.Twin, k.TwinMaxNReg)
				}
			}
			if warps(plain[k.Twin]) < warps(o) {
				lower++
			}
			if k.TwinMaxNReg > 0 && warps(tw) < warps(o) {
				t.Errorf("%s: original %d registers (%d warps/SM), capped twin %d (%d warps/SM)", k.Twin, o, warps(o), tw, warps(tw))
			}
		}
	}
	if capped == 0 {
		t.Fatal("no twin was capped: nothing tested")
	}
	t.Logf("%d twins capped; %d would have fitted fewer warps per SM than their originals without the cap", capped, lower)
}
