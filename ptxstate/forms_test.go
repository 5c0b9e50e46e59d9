package ptxstate

import (
	"bytes"
	"strings"
	"testing"
)

// formKernel wraps one instruction in a kernel with enough registers for every form below.
func formKernel(instr string) string {
	return `.version 9.0
.target sm_100a
.address_size 64

.shared .align 16 .b8 smem[1024];

.visible .entry k(
	.param .u64 k_p
)
{
	.reg .pred 	%p<4>;
	.reg .b16 	%rs<4>;
	.reg .b32 	%r<12>;
	.reg .b64 	%rd<4>;
	.reg .b128 	%q<2>;
	.reg .f32 	%f<6>;

	` + instr + `
	ret;
}
`
}

// TestQualifierForms parses every family of opcode whose qualifiers or state spaces contain
// "::" (PTX ISA 7.8-9.0: sm_90 TMA, mbarrier, async proxy, cache hints, clusters, sm_100
// tcgen05, cluster launch control), one instruction per kernel. Each must parse with the whole
// opcode as one token and the operands split correctly, print back byte for byte, and get a
// per-kernel verdict: eligible, or refused with the given reason; never a module-wide error.
func TestQualifierForms(t *testing.T) {
	tests := []struct {
		instr   string
		nargs   int
		refusal string // "" = eligible
	}{
		// mbarrier
		{"mbarrier.init.shared::cta.b64 [%r1], 128;", 2, ""},
		{"mbarrier.inval.shared::cta.b64 [%r1];", 1, ""},
		{"mbarrier.arrive.shared::cta.b64 %rd1, [%r1];", 2, ""},
		{"mbarrier.arrive.release.cta.shared::cta.b64 %rd1, [%r1], 2;", 3, ""},
		{"mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%r1];", 2, ""},
		{"mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 %rd1, [%r1], 1024;", 3, ""},
		{"mbarrier.arrive_drop.shared::cta.b64 %rd1, [%r1];", 2, ""},
		{"mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%r1], 4096;", 2, ""},
		{"mbarrier.complete_tx.relaxed.cta.shared::cta.b64 [%r1], 64;", 2, ""},
		{"mbarrier.test_wait.shared::cta.b64 %p1, [%r1], %rd1;", 3, ""},
		{"mbarrier.try_wait.parity.shared::cta.b64 %p1, [%r1], %r2;", 3, ""},
		{"mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 %p1, [%r1], %r2, %r3;", 4, ""},
		{"mbarrier.pending_count.b64 %r1, %rd1;", 2, ""},
		{"cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%r1];", 1, ""},
		// cp.async and bulk copies
		{"cp.async.ca.shared::cta.global.L2::128B [%r1], [%rd1], 16;", 3, ""},
		{"cp.async.cg.shared.global.L2::cache_hint [%r1], [%rd1], 16, %rd2;", 4, ""},
		{"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1], 256, [%r2];", 4, ""},
		{"cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes.L2::cache_hint [%r1], [%rd1], 256, [%r2], %rd2;", 5, ""},
		{"cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%r1], [%r2], 256, [%r3];", 4, ""},
		{"cp.async.bulk.global.shared::cta.bulk_group [%rd1], [%r1], 256;", 3, ""},
		{"cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.cp_mask [%rd1], [%r1], 256, %rd2, %rs1;", 5, ""},
		{"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%r1], [%rd1], 256, [%r2], %rs1;", 5, "thread-block cluster operation"},
		{"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%rd1], [%r1], 256;", 3, ""},
		{"cp.reduce.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes.inc.u32 [%r1], [%r2], 256, [%r3];", 4, ""},
		{"cp.async.bulk.prefetch.L2.global.L2::cache_hint [%rd1], 256, %rd2;", 3, ""},
		{"cp.async.bulk.commit_group;", 0, ""},
		{"cp.async.bulk.wait_group.read 0;", 1, ""},
		// tensor copies
		{"cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], [%r4];", 3, ""},
		{"cp.async.bulk.tensor.3d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3, %r4}], [%r5], {%rs1};", 4, ""},
		{"cp.async.bulk.tensor.2d.shared::cta.global.tile::gather4.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3, %r4, %r5, %r6}], [%r7];", 3, ""},
		{"cp.async.bulk.tensor.4d.shared::cluster.global.im2col::w::128.mbarrier::complete_tx::bytes.cta_group::1 [%r1], [%rd1, {%r2, %r3, %r4, %r5}], [%r6], {%rs1, %rs2};", 4, ""},
		{"cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%r1], [%rd1, {%r2, %r3, %r4, %r5, %r6}], [%r7], %rs1;", 4, "thread-block cluster operation"},
		{"cp.async.bulk.tensor.1d.global.shared::cta.tile.bulk_group [%rd1, {%r1}], [%r2];", 2, ""},
		{"cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%rd1, {%r1, %r2}], [%r3];", 2, ""},
		{"cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%rd1, {%r1, %r2}];", 1, ""},
		// proxies, fences, tensor maps
		{"fence.proxy.async.shared::cta;", 0, ""},
		{"fence.proxy.async.shared::cluster;", 0, ""},
		{"fence.proxy.tensormap::generic.release.gpu;", 0, ""},
		{"fence.proxy.tensormap::generic.acquire.gpu [%rd1], 128;", 2, ""},
		{"fence.proxy.async::generic.acquire.sync_restrict::shared::cluster.cluster;", 0, ""},
		{"fence.mbarrier_init.release.cluster;", 0, ""},
		{"tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%r1], %rd1;", 2, ""},
		{"tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned [%rd1], [%r1], 128;", 3, ""},
		// loads, stores, atomics and addresses in named spaces, with cache qualifiers
		{"ld.shared::cta.u32 %r1, [%r2];", 2, ""},
		{"ld.shared::cluster.u32 %r1, [%r2];", 2, ""},
		{"ld.param::entry.u64 %rd1, [k_p];", 2, ""},
		{"ld.global.L1::evict_last.L2::256B.v4.f32 {%f1, %f2, %f3, %f4}, [%rd1];", 2, ""},
		{"ld.global.nc.L1::no_allocate.L2::cache_hint.b32 %r1, [%rd1], %rd2;", 3, ""},
		{"ld.relaxed.gpu.global.L1::no_allocate.L2::64B.u32 %r1, [%rd1];", 2, ""},
		{"st.shared::cluster.u32 [%r1], %r2;", 2, ""},
		{"st.global.L1::no_allocate.L2::cache_hint.v2.u32 [%rd1], {%r1, %r2}, %rd2;", 3, ""},
		{"st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%r1], %r2, [%r3];", 3, ""},
		{"st.async.weak.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%r1], {%r2, %r3, %r4, %r5}, [%r6];", 3, ""},
		{"red.async.relaxed.cluster.shared::cluster.mbarrier::complete_tx::bytes.add.u32 [%r1], %r2, [%r3];", 3, ""},
		{"red.release.cta.shared::cta.and.b32 [%r1], 0;", 2, ""},
		{"atom.shared::cta.add.u32 %r1, [%r2], 1;", 3, ""},
		{"atom.acq_rel.cluster.shared::cluster.cas.b32 %r1, [%r2], %r3, %r4;", 4, ""},
		{"st.bulk.weak.shared::cta [%r1], %rd1, 0;", 3, ""},
		{"cvta.shared::cta.u64 %rd1, %rd2;", 2, ""},
		{"cvta.to.shared::cluster.u64 %rd1, %rd2;", 2, ""},
		{"cvta.param::entry.u64 %rd1, k_p;", 2, ""},
		{"isspacep.shared::cluster %p1, %rd1;", 2, ""},
		{"prefetch.global.L2::evict_last [%rd1];", 1, ""},
		{"applypriority.global.L2::evict_normal [%rd1], 128;", 2, ""},
		{"createpolicy.fractional.L2::evict_last.L2::evict_unchanged.b64 %rd1, 0f3F800000;", 2, ""},
		{"multimem.ld_reduce.relaxed.sys.global.add.f32 %f1, [%rd1];", 2, ""},
		{"ldmatrix.sync.aligned.m8n8.x4.shared::cta.b16 {%r1, %r2, %r3, %r4}, [%r5];", 2, ""},
		{"stmatrix.sync.aligned.m8n8.x1.trans.shared::cta.b16 [%r1], {%r2};", 2, ""},
		// cluster-only operations: refused per kernel
		{"mapa.shared::cluster.u32 %r1, %r2, %r3;", 3, "thread-block cluster operation mapa"},
		{"getctarank.shared::cluster.u32 %r1, %r2;", 2, "thread-block cluster operation getctarank"},
		{"barrier.cluster.arrive.release.aligned;", 0, "thread-block cluster operation"},
		{"mov.u32 %r1, %cluster_ctarank;", 2, "thread-block clusters"},
		// sm_90/sm_100 register and tensor-memory management, cluster launch control
		{"setmaxnreg.inc.sync.aligned.u32 232;", 1, "reallocates the warp's registers"},
		{"elect.sync %r1|%p1, -1;", 2, ""},
		{"griddepcontrol.wait;", 0, ""},
		{"clusterlaunchcontrol.try_cancel.async.shared::cta.mbarrier::complete_tx::bytes.b128 [%r1], [%r2];", 2, "schedules its own work"},
		{"clusterlaunchcontrol.query_cancel.get_first_ctaid::x.b32.b128 %r1, %q1;", 2, ""},
		{"tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r1], 32;", 2, ""},
		{"tcgen05.alloc.cta_group::2.sync.aligned.shared::cta.b32 [%r1], 32;", 2, "thread-block cluster operation"},
		{"tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;", 0, "tensor-memory allocation permit"},
		{"tcgen05.mma.cta_group::1.kind::f16 [%r1], %rd1, %rd2, %r2, %p1;", 5, ""},
		{"tcgen05.mma.cta_group::1.kind::mxf4.block_scale.scale_vec::2X [%r1], %rd1, %rd2, %r2, [%r3], [%r4], %p1;", 7, ""},
		{"tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%r1];", 1, ""},
		{"tcgen05.ld.sync.aligned.16x64b.x2.b32 {%r1, %r2}, [%r3];", 2, ""},
		{"tcgen05.wait::ld.sync.aligned;", 0, ""},
		{"tcgen05.fence::before_thread_sync;", 0, ""},
	}
	for _, tt := range tests {
		op := strings.Fields(tt.instr)[0]
		op = strings.TrimSuffix(op, ";")
		t.Run(op, func(t *testing.T) {
			src := []byte(formKernel(tt.instr))
			m, err := Parse(src)
			if err != nil {
				t.Fatalf("parse: %v", err)
			}
			if !bytes.Equal(m.Bytes(), src) {
				t.Fatal("print(parse(x)) != x")
			}
			var got *Stmt
			for _, it := range m.Items {
				if it.Func != nil && it.Func.Name == "k" {
					for _, s := range it.Func.Body {
						if s.Kind == StInstr && s.Op != "ret" {
							got = s
						}
					}
				}
			}
			if got == nil {
				t.Fatal("instruction not found")
			}
			if got.Op != op || len(got.Args) != tt.nargs || got.Text != tt.instr {
				t.Fatalf("parsed as op %q with %d operands (%q), want %q with %d", got.Op, len(got.Args), got.Text, op, tt.nargs)
			}
			out, r, err := Instrument(m)
			if err != nil {
				t.Fatalf("instrument: %v", err)
			}
			k := r.Kernels[0]
			switch {
			case tt.refusal == "" && !k.Eligible:
				t.Errorf("refused: %v", k.Refusals)
			case tt.refusal != "" && (k.Eligible || !strings.Contains(strings.Join(k.Refusals, "\n"), tt.refusal)):
				t.Errorf("want a refusal containing %q, got eligible=%v %v", tt.refusal, k.Eligible, k.Refusals)
			}
			text := out.Bytes()
			m2, err := Parse(text)
			if err != nil {
				t.Fatalf("instrumented module does not parse: %v", err)
			}
			if !bytes.Equal(m2.Bytes(), text) {
				t.Fatal("instrumented module does not round-trip")
			}
		})
	}
}

// TestQualifiedDeclarations covers "::" and attributes outside instructions: state spaces with
// sub-qualifiers in variable declarations, .attribute before a function name, and .pragma,
// .abi_preserve, .maxnctapersm and .blocksareclusters in a kernel header.
func TestQualifiedDeclarations(t *testing.T) {
	src := `.version 9.0
.target sm_100a
.address_size 64

.shared::cta .align 8 .b8 bars[64];
.extern .shared::cta .align 16 .b8 dyn[];

.func .attribute(.unified(0xAB, 0xCD)) (.param .b32 rv) helper(
	.param .b32 x
)
{
	ret;
}

.visible .entry plain(
	.param .u64 plain_p
)
.maxntid 128, 1, 1
.maxnctapersm 4
.abi_preserve 8
.pragma "nounroll";
{
	.reg .b32 	%r<3>;
	.shared::cta .align 4 .b8 local_tile[256];
	mov.u32 	%r1, bars;
	mov.u32 	%r2, dyn;
	st.shared::cta.u32 	[local_tile], %r1;
	ret;
}

.visible .entry clustered(
	.param .u64 clustered_p
)
.blocksareclusters
.reqntid 64, 1, 1
{
	ret;
}
`
	m, err := Parse([]byte(src))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(m.Bytes(), []byte(src)) {
		t.Fatal("print(parse(x)) != x")
	}
	var helper *Function
	for _, it := range m.Items {
		if it.Func != nil && it.Func.Name == "helper" {
			helper = it.Func
		}
	}
	if helper == nil || len(helper.Returns) != 1 || len(helper.Params) != 1 {
		t.Fatalf("helper after .attribute: %+v", helper)
	}
	r, err := Analyze(m)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Kernels) != 2 {
		t.Fatalf("want 2 kernels, got %d", len(r.Kernels))
	}
	plain, clustered := r.Kernels[0], r.Kernels[1]
	if !plain.Eligible || plain.SharedStaticBytes != 64+256 || !plain.DynamicShared {
		t.Errorf("plain: eligible=%v %v, shared %d bytes (want 320), dynamic=%v", plain.Eligible, plain.Refusals, plain.SharedStaticBytes, plain.DynamicShared)
	}
	if clustered.Eligible || !strings.Contains(strings.Join(clustered.Refusals, "\n"), ".blocksareclusters") {
		t.Errorf("clustered: want a .blocksareclusters refusal, got eligible=%v %v", clustered.Eligible, clustered.Refusals)
	}
}
