// Tracking (track.c): what the process did with the driver — contexts, allocations, cross-process
// sharing, module images, kernels and their launches (counts, shapes, sampled GPU times) — and
// the reports built from it. Bookkeeping never fails a CUDA call.
#ifndef PTXMIG_TRACK_H
#define PTXMIG_TRACK_H
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "base.h"
#include "instr.h"
#include "json.h"

// ---- allocations ----
enum alloc_kind { AK_DEVICE, AK_PITCH, AK_ASYNC, AK_MANAGED, AK_HOST, AK_VMM_PHYS, AK_VMM_MAP, AK_OWNED, AK_COUNT };
void trk_alloc_add(uint64_t key, uint64_t size, int kind);
void trk_alloc_remove(uint64_t key, int kind);  // kind -1: whichever kind key has
void trk_vmm_unmap(uint64_t ptr, uint64_t size);
// Peer access: the hooks of cuCtxEnablePeerAccess / cuCtxDisablePeerAccess call the driver's
// (real) through these, which keep the table of links peer-off / peer-on act on.
CUresult trk_peer_enable(CUcontext peer, unsigned flags, CUresult (*real)(CUcontext, unsigned));
CUresult trk_peer_disable(CUcontext peer, CUresult (*real)(CUcontext));
void trk_peer_ctx_gone(CUcontext ctx);  // a context was destroyed: its links with it
// trk_peer_hold(1): quiesced (or detached): the app's new links wait in the table; (0): running
// again, those go on now (preempt.c, at the state changes).
void trk_peer_hold(int on);
long trk_peer_links(void);              // links the app has enabled (status "peer_access")
long trk_peer_applied(void);            // of those, on in the driver now (quiesce "peer_links")
void trk_peer_refused(void);            // an enable refused under PTXMIG_PEER_ACCESS=0
// trk_peer_set(0): wait for the work queued in every context with a link on, then disable every
// link (a checkpoint follows); trk_peer_set(1) enables every link that is not on. 0 with a JSON
// reply in b, or -1 with err (a failed peer-off enables again what it disabled).
int trk_peer_set(int on, jbuf *b, char *err, size_t errlen);
int trk_peer_pending(void);  // some link is not on in the driver: the resume must run peer-on
// Cross-process GPU memory sharing (status "ipc"; docs/SHIM-PROTOCOL.md says what is counted).
// Each is called after the driver call succeeded.
enum share_kind { SK_IPC_MEM, SK_VMM, SK_POOL, SK_POOL_PTR, SK_COUNT };
void trk_share_export(int kind, uint64_t key);  // key: allocation base, VMM handle, pool or pointer
void trk_share_import(int kind, uint64_t key);
void trk_share_ipc_close(uint64_t ptr);         // cuIpcCloseMemHandle
void trk_share_free(uint64_t ptr);              // cuMemFree/cuMemFreeAsync of ptr
void trk_share_pool_destroy(uint64_t pool);     // cuMemPoolDestroy
void trk_share_map(uint64_t ptr, uint64_t size, uint64_t handle);  // cuMemMap
void trk_share_unmap(uint64_t ptr, uint64_t size);                 // cuMemUnmap
void trk_share_retain(uint64_t handle);         // cuMemRetainAllocationHandle
void trk_share_release(uint64_t handle);        // cuMemRelease

// ---- contexts ----
#define TRK_MAX_CTX 256
void trk_ctx_add(CUcontext ctx, CUdevice dev, int primary);
void trk_ctx_remove(CUcontext ctx);
int trk_primary_ctxs(CUdevice dev, CUcontext out[TRK_MAX_CTX]);  // dev's primary contexts: how many
void trk_cuinit(void);
// samples_drop_ctx forgets the timing samples and pooled events of a context about to go away.
void samples_drop_ctx(CUcontext ctx);

// ---- modules and functions ----
enum module_source {
  MS_REGISTER_FATBIN, MS_MODULE_LOAD, MS_MODULE_LOAD_DATA, MS_MODULE_LOAD_DATA_EX,
  MS_MODULE_LOAD_FATBIN, MS_LIBRARY_LOAD_DATA, MS_LIBRARY_LOAD_FILE, MS_LINK_COMPLETE, MS_COUNT
};
// image: the caller's pointer (wrapper, container, ELF or PTX) or NULL with path set.
void trk_module_add(int source, void *handle, const void *image, size_t known_size, const char *path);
void trk_module_remove(void *handle);
void trk_module_alias(void *alias, void *handle);  // cuLibraryGetModule
// trk_module_twins attaches ks (moved) to the module just tracked under handle.
void trk_module_twins(void *handle, kinfo_set *ks);
int trk_instrumented_modules(void);
void trk_func_named(void *fn, void *owner, const char *name);
void trk_func_copy(void *fn, void *from);  // cuKernelGetFunction: fn gets from's name/module

// ---- kernel records ----
#define NSHAPES 4
#define RING 256
// A launch's scalar signature: its first SIG_N parameters of 4 or 8 bytes, each the value when it
// is below 2^31 (a count, a size, a loop bound), else 0 (a pointer, a negative number, unknown).
#define SIG_N 8
typedef struct krec {
  void *fn;
  char *_Atomic name;
  atomic_int coll;  // a collective kernel (NCCL's): 0 not known yet, 1 yes, 2 no
  atomic_int module_id;
  int is_graph;
  atomic_ulong seen, launches, failed, cooperative;
  struct {
    unsigned g[3], b[3];
    atomic_ulong n;
  } shapes[NSHAPES];
  atomic_int nshapes;
  atomic_ulong other_shapes;
  // timing, under sample_mu
  float ring[RING];
  unsigned nring, ringpos;
  uint64_t nsampled;
  double sum_us;
  atomic_uint mean_us;  // mean sampled GPU time in µs (rounded up), 0 until timed
  // the sample with the largest time per block: high 32 bits the float µs per block, low 32 bits
  // that launch's block count (0: none yet); preempt.c derives the twin's batch_max from it
  _Atomic uint64_t blk_sample;
  // the scalar signature of blk_sample's launch (all 0: none recorded): preempt.c grows a block's
  // expected time by how much a launch's count arguments exceed these
  _Atomic uint32_t blk_sig[SIG_N];
  // the timed launch with the most blocks (for equal counts the longer one): high 32 bits its
  // µs (rounded up), low 32 bits its block count (both capped at 2^32-1); 0: none yet.
  // preempt.c scales it to launches larger than any timed one (auto's estimate)
  _Atomic uint64_t big_sample;
  // the scalar signature of big_sample's launch (all 0: none recorded): a launch whose count
  // arguments are larger than these is expected to run longer (preempt.c's estimate)
  _Atomic uint32_t big_sig[SIG_N];
  // preemption (preempt.c)
  void *_Atomic owner;          // module or library handle the kernel was obtained from
  const kinfo *_Atomic kinfo;   // its twin information (NULL: unknown yet)
  atomic_int kinfo_tried;       // the lookup through the driver was done
  void *_Atomic twin_fn;        // K__ptxmig's handle in the same module (looked up once)
  atomic_int twin_fn_state;     // 0 not looked up, 1 found, -1 not found
  atomic_ulong twin_launches, twin_fallbacks;
  const char *_Atomic original_why;  // why its last launch ran as the original (a static string)
  atomic_int param_src;         // 0 unknown, 1 cuFuncGetParamInfo, 2 PTX
  void *_Atomic layout;         // the parameter layout (preempt.c), reset with the twin information
  const char *_Atomic no_twin_why;  // why the kernel has no twin, once settled (launch fast path)
  struct {
    int attr, value;
  } attrs[8];                   // cuFuncSetAttribute calls to replay on the twin (under k_mu)
  atomic_int nattrs, attrs_gen, attrs_applied;
  // mid-block twins (preempt.c): the record layout the module carries (__ptxmig_mid_K = {2, register
  // slots, static shared bytes, sites, local bytes}); mid_state 0 not read, 1 read, -1 none
  atomic_int mid_state;
  uint32_t mid[5];
  void *_Atomic mid_fn;         // K_mid__ptxmig's handle (PTXMIG_MID_BLOCK=auto), looked up once
  atomic_int mid_fn_state;      // as twin_fn_state
  atomic_int mid_attrs_applied; // as attrs_applied, for mid_fn
  atomic_ulong mid_launches, mid_stops;
} krec;
const kinfo *trk_kinfo_of(krec *r, const char **module_reason, void **owner, int *owner_is_lib);
void trk_func_attr(CUfunction f, int attr, int value);
int trk_func_attrs(krec *r, int attrs[8][2], int *n);

// ---- launches ----
typedef struct launch_tok {
  krec *rec;
  struct sample *smp;
  unsigned dims[6];
  uint64_t self_ns;  // with PTXMIG_SELF_TIME=1: the time launch_pre took
  int twin;          // twin_launch launched the twin (its sample may cover part of the grid)
} launch_tok;
enum launch_kind { LK_NORMAL, LK_COOPERATIVE, LK_EX };
// trk_sample_sig gives the launch's scalar signature to its timing sample (if it is sampled),
// between launch_pre and launch_post.
void trk_sample_sig(launch_tok *t, const uint32_t sig[SIG_N]);
void launch_pre(launch_tok *t, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                unsigned by, unsigned bz, CUstream s, int ptsz, int kind);
// launch_post records the launch's outcome; 1 when it was a successful launch of a collective
// kernel (NCCL's), which the caller counts for the collective alignment (preempt.c).
int launch_post(launch_tok *t, CUresult r);
krec *trk_graph_launch(CUgraphExec g, CUresult r);
// Stream capture: while any capture is open no timing events are recorded.
void trk_capture(int delta);
int trk_capture_open(void);

// ---- reports for the control socket ----
// trk_report_status writes the tracked state as members of the status object, each led by a
// comma as jb_key writes them (the caller opens and closes the object); brief leaves the module
// list out.
void trk_report_status(jbuf *b, int brief);
void report_kernels(jbuf *b);
int report_dump(jbuf *b, const char *dir, char *err, size_t errlen);

#endif
