/* ptxmig_ctrl.h — control block of a ptxmig preemptible twin kernel (K__ptxmig).
 *
 * Mirrors ptxstate/ctrl.go; the protocol is in docs/PTXSTATE.md. One block per logical launch of
 * K, in DEVICE memory (cuMemAlloc; never host-mapped/pinned memory: the twin reads the preempt
 * flag once per claim and would cross PCIe each time), 8-byte aligned, passed (as a device
 * pointer) in the twin's extra last .param .u64. The host zeroes it, fills grid_*, total_blocks,
 * magic and version (and optionally the batch_* claim tuning; 0 = the twin's defaults), then
 * launches the twin with K's blockDim, dynamic shared memory and parameters on any number of CTAs
 * (normally min(total_blocks, occupancy(twin) x SMs)).
 *
 * Preempt: cuMemsetD32Async(ctl + PTXMIG_CTL_OFF_PREEMPT, 1, 1, side_stream) on a non-blocking
 * stream, then wait for the twin; it ends after the batches its CTAs already claimed. Done when
 * next_block >= total_blocks after the launch ends; otherwise clear preempt on the kernel's stream
 * and relaunch with the same control block: each remaining block runs exactly once.
 * blocks_done == min(next_block, total_blocks) once the launch has ended. */
#ifndef PTXMIG_CTRL_H
#define PTXMIG_CTRL_H

#include <stddef.h>
#include <stdint.h>

#define PTXMIG_TWIN_SUFFIX "__ptxmig"
// A kernel's second, mid-block twin (ptx instrument --mid-block-twins): K_mid__ptxmig.
#define PTXMIG_MID_TWIN_SUFFIX "_mid__ptxmig"
#define PTXMIG_CTL_MAGIC 0x4d585450u /* "PTXM" */
#define PTXMIG_CTL_VERSION 2u
#define PTXMIG_CTL_STATUS_PREEMPTED 1u
/* Claim sizes used for zero batch_* fields (ptxstate.DefaultBatch*). */
#define PTXMIG_BATCH_MIN_DEFAULT 2u
#define PTXMIG_BATCH_MAX_DEFAULT 16u
#define PTXMIG_BATCH_DIV_DEFAULT 4u

struct ptxmig_ctl {
  uint64_t next_block;   /* 0:  next virtual block to claim (atomic add of a whole batch; never rolled back) */
  uint64_t total_blocks; /* 8:  grid_x * grid_y * grid_z of the original launch */
  uint64_t blocks_done;  /* 16: virtual blocks completed over all launches (added as CTAs exit) */
  uint32_t grid_x;       /* 24: what %nctaid.x reads in the twin */
  uint32_t grid_y;       /* 28 */
  uint32_t grid_z;       /* 32 */
  uint32_t preempt;      /* 36: nonzero: CTAs stop claiming blocks */
  uint32_t status;       /* 40: PTXMIG_CTL_STATUS_PREEMPTED once a CTA saw the flag with work left */
  uint32_t magic;        /* 44: PTXMIG_CTL_MAGIC (host-side check only) */
  uint32_t version;      /* 48: PTXMIG_CTL_VERSION */
  uint32_t batch_max;    /* 52: largest claim in blocks (0: PTXMIG_BATCH_MAX_DEFAULT) */
  uint32_t batch_min;    /* 56: smallest claim (0: PTXMIG_BATCH_MIN_DEFAULT) */
  uint32_t batch_div;    /* 60: guided divisor f: claim = left / (f x twin CTAs) (0: PTXMIG_BATCH_DIV_DEFAULT) */
};

#define PTXMIG_CTL_OFF_NEXT_BLOCK 0
#define PTXMIG_CTL_OFF_TOTAL_BLOCKS 8
#define PTXMIG_CTL_OFF_BLOCKS_DONE 16
#define PTXMIG_CTL_OFF_GRID_X 24
#define PTXMIG_CTL_OFF_PREEMPT 36
#define PTXMIG_CTL_OFF_STATUS 40
#define PTXMIG_CTL_OFF_BATCH_MAX 52
#define PTXMIG_CTL_OFF_BATCH_MIN 56
#define PTXMIG_CTL_OFF_BATCH_DIV 60
#define PTXMIG_CTL_SIZE 64

_Static_assert(sizeof(struct ptxmig_ctl) == PTXMIG_CTL_SIZE, "ptxmig_ctl size");
_Static_assert(offsetof(struct ptxmig_ctl, grid_x) == PTXMIG_CTL_OFF_GRID_X, "grid_x offset");
_Static_assert(offsetof(struct ptxmig_ctl, preempt) == PTXMIG_CTL_OFF_PREEMPT, "preempt offset");
_Static_assert(offsetof(struct ptxmig_ctl, status) == PTXMIG_CTL_OFF_STATUS, "status offset");
_Static_assert(offsetof(struct ptxmig_ctl, blocks_done) == PTXMIG_CTL_OFF_BLOCKS_DONE, "blocks_done offset");
_Static_assert(offsetof(struct ptxmig_ctl, batch_max) == PTXMIG_CTL_OFF_BATCH_MAX, "batch_max offset");
_Static_assert(offsetof(struct ptxmig_ctl, batch_min) == PTXMIG_CTL_OFF_BATCH_MIN, "batch_min offset");
_Static_assert(offsetof(struct ptxmig_ctl, batch_div) == PTXMIG_CTL_OFF_BATCH_DIV, "batch_div offset");

/* Version 3: mid-block save and resume (twins from `ptxmig ptx instrument --mid-block`;
 * docs/PTXSTATE.md, "Mid-block safe points"). A v3 twin reads past the v2 fields only when
 * version >= 3, so it also runs with a v2 block (no mid-block stops). The shim launches v3
 * blocks under PTXMIG_MID_BLOCK=1, and under PTXMIG_MID_BLOCK=auto (the default) for one-wave
 * grids and long blocks (a second twin, K_mid__ptxmig, from `ptx instrument --mid-block-twins`). */
#define PTXMIG_CTL_VERSION_MID_BLOCK 3u
#define PTXMIG_RECORD_MAGIC 0x52585450u /* "PTXR" */
#define PTXMIG_CTL_OFF_SAVE_AREA 64
#define PTXMIG_CTL_OFF_RECORD_BYTES 72
#define PTXMIG_CTL_OFF_SAVED 76
#define PTXMIG_CTL_OFF_RESUME_COUNT 80
#define PTXMIG_CTL_OFF_RESUME_CURSOR 84
#define PTXMIG_CTL_OFF_RESUME_AREA 88
#define PTXMIG_CTL_OFF_SAVE_CAPACITY 96
#define PTXMIG_CTL_OFF_FORCE_VISIT 100
#define PTXMIG_CTL_SIZE_V3 112

struct ptxmig_ctl_v3 {
  struct ptxmig_ctl v2;
  uint64_t save_area;      /* 64: records this launch writes (0: no mid-block stops) */
  uint32_t record_bytes;   /* 72: bytes per record */
  uint32_t saved;          /* 76: records reserved by this launch (may pass save_capacity) */
  uint32_t resume_count;   /* 80: records to resume */
  uint32_t resume_cursor;  /* 84: next record to take */
  uint64_t resume_area;    /* 88: the records to resume (the last launch's save area) */
  uint32_t save_capacity;  /* 96: records save_area holds */
  uint32_t force_visit;    /* 100: test hook: stop at the N-th site vote of each CTA (0: never) */
  uint64_t reserved;       /* 104 */
};

_Static_assert(sizeof(struct ptxmig_ctl_v3) == PTXMIG_CTL_SIZE_V3, "ptxmig_ctl_v3 size");
_Static_assert(offsetof(struct ptxmig_ctl_v3, resume_area) == PTXMIG_CTL_OFF_RESUME_AREA, "resume_area offset");
_Static_assert(offsetof(struct ptxmig_ctl_v3, force_visit) == PTXMIG_CTL_OFF_FORCE_VISIT, "force_visit offset");

#endif
