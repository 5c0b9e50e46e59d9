package ptxstate

import (
	"strings"
	"testing"
)

// spinKernel is a kernel around a loop body: %rd1 is a global pointer (from the parameter), %rd3
// a generic pointer to the shared variable flag (cvta.shared), %rd4 a generic pointer into the
// thread's local depot (cvta.local), %r1 = %tid.x.
func spinKernel(body string) string {
	return `.version 8.4
.target sm_90
.address_size 64

.shared .align 4 .u32 flag;
.shared .align 4 .b8 flags[128];

.visible .entry k(
	.param .u64 k_p
)
{
	.local .align 4 .b8 	__local_depot0[16];
	.reg .pred 	%p<4>;
	.reg .b32 	%r<8>;
	.reg .b64 	%rd<10>;

	ld.param.u64 	%rd1, [k_p];
	cvta.to.global.u64 	%rd1, %rd1;
	mov.u64 	%rd2, flag;
	cvta.shared.u64 	%rd3, %rd2;
	mov.u64 	%rd5, __local_depot0;
	cvta.local.u64 	%rd4, %rd5;
	mov.u32 	%r1, %tid.x;
` + body + `
	ret;
}
`
}

// TestSpinWaitScope pins the spin-wait rule: a loop that waits on memory another CTA may write
// is refused; one that waits on this CTA's shared memory or the thread's local memory (written
// only by threads of the same CTA, which run the same virtual block in the twin) is not.
func TestSpinWaitScope(t *testing.T) {
	tests := []struct {
		name, body string
		refusal    string // "" = eligible
	}{
		{"acquire.cta through cvta.shared", `
$L_spin:
	ld.acquire.cta.u32 	%r2, [%rd3];
	setp.ne.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, ""},
		{"relaxed .shared::cta variable", `
$L_spin:
	ld.relaxed.cta.shared::cta.u32 	%r2, [flag];
	setp.ne.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, ""},
		{"volatile .shared through a window address", `
	mov.u32 	%r3, flag;
$L_spin:
	ld.volatile.shared.u32 	%r2, [%r3];
	setp.ne.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, ""},
		{"generic shared element: base + tid*4 (mad.wide)", `
	mad.wide.u32 	%rd6, %r1, 4, %rd3;
$L_spin:
	ld.acquire.cta.u32 	%r2, [%rd6+4];
	setp.eq.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, ""},
		{"generic pointer advanced through the shared array", `
	mov.u64 	%rd7, flags;
	cvta.shared.u64 	%rd6, %rd7;
$L_spin:
	ld.volatile.u32 	%r2, [%rd6];
	add.s64 	%rd6, %rd6, 4;
	setp.eq.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, ""},
		{"volatile local through cvta.local", `
$L_spin:
	ld.volatile.u32 	%r2, [%rd4+8];
	setp.ne.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, ""},
		{"CTA-local work counter (atom.shared)", `
$L_spin:
	atom.shared::cta.add.u32 	%r2, [flag], 1;
	setp.lt.u32 	%p1, %r2, 64;
	@%p1 bra 	$L_spin;`, ""},
		{"acquire.gpu on global memory", `
$L_spin:
	ld.acquire.gpu.global.u32 	%r2, [%rd1];
	setp.ne.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, "spin-wait"},
		{"acquire.cta on global memory (scope alone does not make it local)", `
$L_spin:
	ld.acquire.cta.global.u32 	%r2, [%rd1];
	setp.ne.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, "spin-wait"},
		{"generic pointer from the parameter", `
	ld.param.u64 	%rd6, [k_p];
$L_spin:
	ld.volatile.u32 	%r2, [%rd6];
	setp.ne.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, "spin-wait"},
		{"selp between a shared and a global pointer", `
	setp.eq.s32 	%p2, %r1, 0;
	selp.b64 	%rd6, %rd3, %rd1, %p2;
$L_spin:
	ld.volatile.u32 	%r2, [%rd6];
	setp.ne.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, "spin-wait"},
		{"register also assigned a global pointer on another path", `
	mov.u64 	%rd6, %rd3;
	setp.eq.s32 	%p2, %r1, 0;
	@%p2 mov.u64 	%rd6, %rd1;
$L_spin:
	ld.volatile.u32 	%r2, [%rd6];
	setp.ne.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, "spin-wait"},
		{"difference of shared pointers used as a global offset", `
	add.s64 	%rd7, %rd3, 64;
	sub.s64 	%rd8, %rd7, %rd3;
	add.s64 	%rd6, %rd1, %rd8;
$L_spin:
	ld.volatile.u32 	%r2, [%rd6];
	setp.ne.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, "spin-wait"},
		{"pointer never initialised from shared memory", `
$L_spin:
	ld.volatile.u32 	%r2, [%rd9];
	add.s64 	%rd9, %rd9, 4;
	setp.ne.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, "spin-wait"},
		{"shared::cluster (another CTA of the cluster may write it)", `
	mov.u32 	%r3, flag;
$L_spin:
	ld.acquire.cluster.shared::cluster.u32 	%r2, [%r3];
	setp.ne.s32 	%p1, %r2, 0;
	@%p1 bra 	$L_spin;`, "spin-wait"},
		{"global work counter", `
$L_spin:
	atom.global.add.u32 	%r2, [%rd1], 1;
	setp.lt.u32 	%p1, %r2, 64;
	@%p1 bra 	$L_spin;`, "already persistent"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := Parse([]byte(spinKernel(tt.body)))
			if err != nil {
				t.Fatal(err)
			}
			r, err := Analyze(m)
			if err != nil {
				t.Fatal(err)
			}
			k := r.Kernels[0]
			switch {
			case tt.refusal == "" && !k.Eligible:
				t.Errorf("refused: %v", k.Refusals)
			case tt.refusal != "" && (k.Eligible || !strings.Contains(strings.Join(k.Refusals, "\n"), tt.refusal)):
				t.Errorf("want a refusal containing %q, got eligible=%v %v", tt.refusal, k.Eligible, k.Refusals)
			}
		})
	}
}
