package ptxstate

import (
	"strconv"
	"strings"
	"testing"
)

// TestMidBlockSites pins the site rules on small kernels built around spinKernel's prologue
// (%rd1 a global pointer, %rd3 a generic shared pointer, %rd4 a generic local pointer, %r1 =
// %tid.x): which candidate sites are found, and which condition refuses each.
func TestMidBlockSites(t *testing.T) {
	tests := []struct {
		name, body string
		kind       string
		refusal    string // "" = eligible; else a substring of the first refusal
		rebased    string // the site's Rebased, joined with ", "
	}{
		{"plain barrier", `
	st.shared.u32 	[flag], %r1;
	bar.sync 	0;
	ld.shared.u32 	%r2, [flag];
	st.global.u32 	[%rd1], %r2;`, "barrier", "", ""},
		{"aligned barrier.sync", `
	barrier.sync.aligned 	0;
	st.global.u32 	[%rd1], %r1;`, "barrier", "", ""},
		{"barrier with a thread count", `
	bar.sync 	1, 64;
	st.global.u32 	[%rd1], %r1;`, "barrier", "C1: bar.sync is not a CTA-wide barrier", ""},
		{"bar.red is not a site", `
	setp.ne.s32 	%p1, %r1, 0;
	bar.red.or.pred 	%p2, 0, %p1;
	selp.u32 	%r2, 1, 0, %p2;
	st.global.u32 	[%rd1], %r2;`, "barrier", "C1: bar.red.or.pred is not a CTA-wide barrier", ""},
		{"SM id live across the barrier", `
	mov.u32 	%r2, %smid;
	bar.sync 	0;
	st.global.u32 	[%rd1], %r2;`, "barrier", "C4: live values bound to where the CTA ran: %r2", ""},
		{"local address live across the barrier", `
	bar.sync 	0;
	st.u32 	[%rd4], %r1;`, "barrier", "C4: live values bound to where the CTA ran: %rd4", ""},
		{"timer deadline live across the barrier: rebased", `
	mov.u64 	%rd6, %globaltimer;
	add.s64 	%rd7, %rd6, 1000;
	bar.sync 	0;
	st.global.u64 	[%rd1], %rd7;`, "barrier", "", "%rd7 (%globaltimer)"},
		{"32-bit clock deadline: rebased", `
	mov.u32 	%r2, %clock;
	add.s32 	%r3, %r2, 100;
	bar.sync 	0;
	st.global.u32 	[%rd1], %r3;`, "barrier", "", "%r3 (%clock)"},
		{"a duration needs no rebase", `
	mov.u64 	%rd6, %clock64;
	mov.u64 	%rd7, %clock64;
	sub.s64 	%rd8, %rd7, %rd6;
	bar.sync 	0;
	st.global.u64 	[%rd1], %rd8;`, "barrier", "", ""},
		{"a scaled clock is bound", `
	mov.u64 	%rd6, %clock64;
	shr.u64 	%rd7, %rd6, 10;
	bar.sync 	0;
	st.global.u64 	[%rd1], %rd7;`, "barrier", "C4: live values bound to where the CTA ran: %rd7", ""},
		{"a truncated clock is bound", `
	mov.u64 	%rd6, %clock64;
	cvt.u32.u64 	%r2, %rd6;
	bar.sync 	0;
	st.global.u32 	[%rd1], %r2;`, "barrier", "C4: live values bound to where the CTA ran: %r2", ""},
		{"two clocks mixed are bound", `
	mov.u64 	%rd6, %clock64;
	mov.u64 	%rd7, %globaltimer;
	sub.s64 	%rd8, %rd7, %rd6;
	bar.sync 	0;
	st.global.u64 	[%rd1], %rd8;`, "barrier", "C4: live values bound to where the CTA ran: %rd8", ""},
		{"a register written from a clock and from a constant is bound", `
	mov.u64 	%rd6, 0;
	setp.eq.u32 	%p1, %r1, 0;
	@%p1 mov.u64 	%rd6, %clock64;
	bar.sync 	0;
	st.global.u64 	[%rd1], %rd6;`, "barrier", "C4: live values bound to where the CTA ran: %rd6", ""},
		{"a write guarded by the SM id is bound", `
	mov.u32 	%r2, %smid;
	setp.eq.u32 	%p1, %r2, 0;
	mov.u32 	%r3, 0;
	@%p1 mov.u32 	%r3, 1;
	bar.sync 	0;
	st.global.u32 	[%rd1], %r3;`, "barrier", "C4: live values bound to where the CTA ran: %r3", ""},
		{"mbarrier in the kernel", `
	mbarrier.init.shared::cta.b64 	[flags], 1;
	bar.sync 	0;
	st.global.u32 	[%rd1], %r1;`, "barrier", "C3: mbarrier operations", ""},
		{"uniform loop without a barrier", `
	mov.u32 	%r3, 0;
	ld.param.u32 	%r4, [k_p];
$L_loop:
	add.s32 	%r3, %r3, 1;
	setp.lt.u32 	%p1, %r3, %r4;
	@%p1 bra 	$L_loop;
	st.global.u32 	[%rd1], %r3;`, "loop", "", ""},
		{"per-thread trip count in a kernel without collectives: a thread-loop", `
	mov.u32 	%r3, %r1;
$L_loop:
	add.s32 	%r3, %r3, 32;
	setp.lt.u32 	%p1, %r3, 4096;
	@%p1 bra 	$L_loop;
	st.global.u32 	[%rd1], %r3;`, "thread-loop", "", ""},
		{"a clock spin (CuPy's): a thread-loop with its start rebased", `
	mov.u64 	%rd6, %clock64;
$L_loop:
	mov.u64 	%rd7, %clock64;
	sub.s64 	%rd8, %rd7, %rd6;
	setp.lt.u64 	%p1, %rd8, 100000;
	@%p1 bra 	$L_loop;
	st.global.u32 	[%rd1], %r1;`, "thread-loop", "", "%rd6 (%clock64)"},
		{"per-thread trip count and a barrier", `
	mov.u32 	%r3, %r1;
$L_loop:
	add.s32 	%r3, %r3, 32;
	setp.lt.u32 	%p1, %r3, 4096;
	@%p1 bra 	$L_loop;
	bar.sync 	0;
	st.global.u32 	[%rd1], %r3;`, "loop", "C1: the loop's exit depends on per-thread values: threads may run different trip counts; a thread-granular stop is ruled out: bar.sync (line", ""},
		{"per-thread trip count and a shuffle", `
	mov.u32 	%r3, %r1;
$L_loop:
	add.s32 	%r3, %r3, 32;
	setp.lt.u32 	%p1, %r3, 4096;
	@%p1 bra 	$L_loop;
	shfl.sync.bfly.b32 	%r4, %r3, 1, 31, -1;
	st.global.u32 	[%rd1], %r4;`, "loop", "a thread-granular stop is ruled out: shfl.sync.bfly.b32", ""},
		{"per-thread trip count and a call", `
	// with f
	mov.u32 	%r3, %r1;
$L_loop:
	add.s32 	%r3, %r3, 32;
	setp.lt.u32 	%p1, %r3, 4096;
	@%p1 bra 	$L_loop;
	call.uni 	f, ();
	st.global.u32 	[%rd1], %r3;`, "loop", "a thread-granular stop is ruled out: a call (line", ""},
		{"per-thread trip count and a loop entered at an empty block (no site)", `
	mov.u32 	%r3, %r1;
$L_wait:
$L_body:
	add.s32 	%r3, %r3, 32;
	setp.lt.u32 	%p1, %r3, 4096;
	@%p1 bra 	$L_wait;
$L_loop:
	add.s32 	%r3, %r3, 32;
	setp.lt.u32 	%p1, %r3, 8192;
	@%p1 bra 	$L_loop;
	st.global.u32 	[%rd1], %r3;`, "loop", "a thread-granular stop is ruled out: the loop at line 26 has no instruction at its header, so no site", ""},
		{"per-thread trip count on sm_60", `
	// target sm_60
	mov.u32 	%r3, %r1;
$L_loop:
	add.s32 	%r3, %r3, 32;
	setp.lt.u32 	%p1, %r3, 4096;
	@%p1 bra 	$L_loop;
	st.global.u32 	[%rd1], %r3;`, "loop", "a thread-granular stop is ruled out: the module targets sm_60, before sm_70", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			src := spinKernel(tt.body)
			if strings.Contains(tt.body, "// target sm_60") {
				src = strings.Replace(src, ".target sm_90", ".target sm_60", 1)
			}
			if strings.Contains(tt.body, "// with f") {
				src = strings.Replace(src, ".visible .entry k(", ".func f()\n{\n\tret;\n}\n\n.visible .entry k(", 1)
			}
			m, err := Parse([]byte(src))
			if err != nil {
				t.Fatal(err)
			}
			r, err := Analyze(m)
			if err != nil {
				t.Fatal(err)
			}
			k := r.Kernels[0]
			var site *MidBlockSite
			for i := range k.MidBlockSites {
				if k.MidBlockSites[i].Kind == tt.kind {
					site = &k.MidBlockSites[i]
				}
			}
			if site == nil {
				t.Fatalf("no %s site in %+v", tt.kind, k.MidBlockSites)
			}
			if got := strings.Join(site.Rebased, ", "); got != tt.rebased {
				t.Errorf("rebased %q, want %q", got, tt.rebased)
			}
			if tt.refusal == "" {
				if !site.Eligible {
					t.Fatalf("site %+v refused, want eligible", site)
				}
				return
			}
			if site.Eligible || len(site.Refusals) == 0 || !strings.Contains(site.Refusals[0], tt.refusal) {
				t.Fatalf("site %+v, want refused with %q first", site, tt.refusal)
			}
		})
	}
}

// TestMidBlockLiveBytes: a site's saved state is its live registers (predicates as 4 bytes) plus
// the kernel's .local depot, and more than MaxMidBlockLiveBytes is refused (C9).
func TestMidBlockLiveBytes(t *testing.T) {
	var b strings.Builder
	b.WriteString("\t.reg .b64 \t%big<80>;\n")
	for i := range 80 {
		b.WriteString("\tld.global.u64 \t%big" + strconv.Itoa(i) + ", [%rd1];\n")
	}
	b.WriteString("\tbar.sync \t0;\n")
	for i := range 80 {
		b.WriteString("\tst.global.u64 \t[%rd1], %big" + strconv.Itoa(i) + ";\n")
	}
	m, err := Parse([]byte(spinKernel(b.String())))
	if err != nil {
		t.Fatal(err)
	}
	r, err := Analyze(m)
	if err != nil {
		t.Fatal(err)
	}
	s := r.Kernels[0].MidBlockSites[0]
	// 80 × 8 bytes + %rd1 + the 16-byte depot.
	if s.LiveBytes != 80*8+8+16 || s.Eligible || !strings.Contains(strings.Join(s.Refusals, ";"), "C9: 664 live bytes") {
		t.Fatalf("site %+v", s)
	}
}
