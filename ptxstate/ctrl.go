package ptxstate

// Control block of a preemptible twin: one per logical launch, in device memory, 8-byte aligned,
// CtlSize bytes. The host zeroes it, writes the grid and magic fields (and optionally the claim
// tuning fields), and passes its address as the twin's last parameter.
// shim/include/ptxmig_ctrl.h mirrors this layout for the C shim; the protocol is in
// docs/PTXSTATE.md.
const (
	CtlOffNextBlock   = 0  // u64: next virtual block to claim (atomically advanced by whole batches; never rolled back)
	CtlOffTotalBlocks = 8  // u64: grid_x*grid_y*grid_z of the original launch
	CtlOffBlocksDone  = 16 // u64: virtual blocks completed, over all launches (added as each CTA exits)
	CtlOffGridX       = 24 // u32: original gridDim.x (what %nctaid.x reads in the twin)
	CtlOffGridY       = 28 // u32: original gridDim.y
	CtlOffGridZ       = 32 // u32: original gridDim.z
	CtlOffPreempt     = 36 // u32: nonzero asks every CTA to stop claiming blocks
	CtlOffStatus      = 40 // u32: bit 0 set once a CTA observed the preempt flag with work left
	CtlOffMagic       = 44 // u32: CtlMagic, written by the host (not read by the kernel)
	CtlOffVersion     = 48 // u32: CtlVersion
	CtlOffBatchMax    = 52 // u32: largest claim, in virtual blocks (0: DefaultBatchMax)
	CtlOffBatchMin    = 56 // u32: smallest claim (0: DefaultBatchMin)
	CtlOffBatchDiv    = 60 // u32: guided divisor f: a claim takes (blocks left)/(f x twin CTAs) (0: DefaultBatchDiv)
	CtlSize           = 64

	// Version 3 (twins built with Options.MidBlock): mid-block save and resume. A v3 twin reads
	// these fields only when the block's version is >= 3, so a version-2 block (64 bytes) still
	// runs it, with mid-block stops disabled (docs/PTXSTATE.md, "Mid-block safe points").
	CtlOffSaveArea     = 64  // u64: device address of the save area (0: no mid-block stops)
	CtlOffRecordBytes  = 72  // u32: bytes per record (MidBlockLayout.RecordBytes)
	CtlOffSaved        = 76  // u32: records reserved in the save area by this launch (atom.add; may pass the capacity)
	CtlOffResumeCount  = 80  // u32: records to resume in this launch
	CtlOffResumeCursor = 84  // u32: next record to take (atom.add)
	CtlOffResumeArea   = 88  // u64: device address of the records to resume
	CtlOffSaveCapacity = 96  // u32: records the save area holds
	CtlOffForceVisit   = 100 // u32: test hook: a CTA stops at its N-th site vote of a launch (0: never)
	CtlSizeV3          = 112

	CtlVersionMidBlock = 3
	// RecordMagic is the u32 at offset 20 of every saved record ("PTXR").
	RecordMagic = 0x52585450

	CtlMagic           = 0x4d585450 // "PTXM" little-endian
	CtlVersion         = 2
	CtlStatusPreempted = 1

	// Defaults the twin uses for zero tuning fields (docs/PTXSTATE.md, "Claim sizes").
	DefaultBatchMin = 2
	DefaultBatchMax = 16
	DefaultBatchDiv = 4
)

// ClaimSize is the number of virtual blocks a twin CTA claims with one atomic (the kernel
// computes the same in PTX): guided self-scheduling, clamp(left/(div x ctas), min, max), capped at
// ceil(left/ctas) so that no CTA takes more than its share of the last wave, where left = total -
// (the end of the last batch this CTA saw) and zero tuning fields take their defaults. The kernel
// claims only while left > 0; ClaimSize(0, ...) is 0. Exported so hosts and tests can reason about
// claim counts and preemption latency.
func ClaimSize(left, ctas uint64, batchMin, batchMax, batchDiv uint32) uint64 {
	gmin, gmax, div := uint64(batchMin), uint64(batchMax), uint64(batchDiv)
	if gmin == 0 {
		gmin = DefaultBatchMin
	}
	if gmax == 0 {
		gmax = DefaultBatchMax
	}
	if gmax < gmin {
		gmax = gmin
	}
	if div == 0 {
		div = DefaultBatchDiv
	}
	if ctas == 0 {
		ctas = 1
	}
	g := min(max(left/(div*ctas), gmin), gmax)
	return min(g, (left+ctas-1)/ctas)
}

// Shared-memory scheduler state of one twin CTA (__ptxmig_slot_K, twinSlotBytes, 16-aligned):
// two parity slots {u64 base, u64 end, u32 ctaid x, y, z, pad} through which the leader publishes
// a batch (with its first block already decomposed, so the threads step %ctaid without dividing),
// then leader-only values kept in shared memory rather than registers so that the twin needs few
// more registers than its original (occupancy).
const (
	shSlots       = 0   // 2 x 32 bytes
	shTotal       = 64  // u64 total_blocks
	shInvDiv      = 72  // f32 1/(div x twin CTAs)
	shPendG       = 80  // u64 size of the claim in flight
	shDone        = 88  // u64 blocks this CTA published (= ran, at exit)
	shMin         = 96  // u32 batch_min (resolved)
	shMax         = 100 // u32 batch_max (resolved)
	shInvCtas     = 104 // f32 1/(twin CTAs)
	twinSlotBytes = 112
	// Mid-block twins only (midSlotBytes in all):
	shRec        = 112 // u32 save-area record reserved by the leader before a site's vote
	shFwd        = 116 // u32 save-area record a forwarded record is copied to
	shVisit      = 120 // u32 site votes of this CTA in this launch
	shStop       = 120 // thread-loop twins (no votes): u32 non-zero once a thread of the block stopped
	shForce      = 124 // u32 CtlOffForceVisit as read at the start of the launch
	midSlotBytes = 128
	slotStride   = 32
)
