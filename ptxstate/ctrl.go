package ptxstate

// Control block of a preemptible twin: one per logical launch, in device memory, 8-byte aligned,
// CtlSize bytes. The host zeroes it, writes the grid and magic fields, and passes its address as
// the twin's last parameter. shim/include/ptxmig_ctrl.h mirrors this layout for the C shim; the
// protocol is in docs/PTXSTATE.md.
const (
	CtlOffNextBlock   = 0  // u64: next virtual block to claim (atomically incremented; never rolled back)
	CtlOffTotalBlocks = 8  // u64: grid_x*grid_y*grid_z of the original launch
	CtlOffBlocksDone  = 16 // u64: virtual blocks completed, over all launches
	CtlOffGridX       = 24 // u32: original gridDim.x (what %nctaid.x reads in the twin)
	CtlOffGridY       = 28 // u32: original gridDim.y
	CtlOffGridZ       = 32 // u32: original gridDim.z
	CtlOffPreempt     = 36 // u32: nonzero asks every CTA to stop claiming blocks
	CtlOffStatus      = 40 // u32: bit 0 set once a CTA observed the preempt flag
	CtlOffMagic       = 44 // u32: CtlMagic, written by the host (not read by the kernel)
	CtlOffVersion     = 48 // u32: CtlVersion
	CtlSize           = 64

	CtlMagic           = 0x4d585450 // "PTXM" little-endian
	CtlVersion         = 1
	CtlStatusPreempted = 1
	twinSlotBytes      = 16 // two u64 parity slots in shared memory
)
