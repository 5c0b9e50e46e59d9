// libptxmig internals shared between the interception, tracking and control-socket files.
#ifndef PTXMIG_SHIM_H
#define PTXMIG_SHIM_H
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda_defs.h"
#include "../include/ptxmig_ctrl.h"

struct jbuf;
struct krec;

#define EXPORT __attribute__((visibility("default")))
#define PTXMIG_SHIM_VERSION "ptxmig-shim 2"
#define PTXMIG_PROTO_VERSION 2
// Cache key of instrumented PTX: <sha256 of the PTX>-v<this>.ptx. Bump when ptxstate's output changes.
#define PTXMIG_TRANSFORM_VERSION 3

// ---- configuration (read once from the environment, see docs/SHIM-PROTOCOL.md) ----
typedef struct {
  int debug;                 // PTXMIG_DEBUG=1: log to stderr
  char socket_dir[256];      // PTXMIG_SOCKET_DIR, default /run/ptxmig
  unsigned sample_first;     // PTXMIG_SAMPLE_FIRST: time the first N launches of each kernel
  unsigned sample_every;     // PTXMIG_SAMPLE_EVERY: then 1 in M (0: never)
  uint64_t capture_max;      // PTXMIG_CAPTURE_MAX_MB: bytes of module images kept at most
  char libcuda[256];         // PTXMIG_LIBCUDA: the real driver library
  int self_time;             // PTXMIG_SELF_TIME=1: measure the shim's own time on each launch
  int preempt;               // PTXMIG_PREEMPT: PM_OFF (default), PM_AUTO, PM_ALWAYS
  unsigned preempt_min_us;   // PTXMIG_PREEMPT_MIN_US (default 5000)
  unsigned preempt_long_us;   // PTXMIG_PREEMPT_LONG_US (default 10000): auto keeps twins at or above it even when slower
  int preempt_hold;            // PTXMIG_PREEMPT_HOLD (default 1): hold submissions behind twins in flight
  unsigned preempt_batch_max;  // PTXMIG_PREEMPT_BATCH_MAX: twins' largest claim (0: from the sampled block time)
  int preempt_sass;          // PTXMIG_PREEMPT_SASS: 1 jit (default), 0 keep modules with SASS for the GPU
  int ptx_cubin;             // PTXMIG_PTX_CUBIN (default 1): ask the helper for a cubin (ptxas) instead of PTX to JIT
  int mid_block;             // PTXMIG_MID_BLOCK=1 (default 0): twins that also stop inside a block (ptx instrument --mid-block)
  uint64_t mid_max_bytes;    // PTXMIG_MID_BLOCK_MAX_MB (default 2048): save areas of one launch at most
  int owned;                 // PTXMIG_OWNED_MEMORY=1 (default 0): serve cuMemAlloc* from VMM mappings (vmm.c)
  uint64_t owned_min;        // PTXMIG_OWNED_MIN_KB (default 1024): smaller allocations go to the driver
  char ptx_cache[256];       // PTXMIG_PTX_CACHE, default /var/cache/ptxmig/ptx ("" or "off": no cache)
  char helper[256];          // PTXMIG_HELPER: the ptxmig binary ("" : none)
  unsigned helper_timeout_ms;  // PTXMIG_HELPER_TIMEOUT_MS (default 60000)
  uint64_t helper_max_bytes; // PTXMIG_HELPER_MAX_MB: PTX size limit in and out (default 256)
} shim_config;
enum { PM_OFF, PM_AUTO, PM_ALWAYS };
extern const char *const preempt_mode_names[3];
extern shim_config cfg;
void config_load(void);

uint64_t shim_now_ns(void);  // CLOCK_MONOTONIC in nanoseconds

// ---- logging: stderr only with PTXMIG_DEBUG=1; each call site logs once ----
void shim_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#define LOG_ONCE(...)                                                  \
  do {                                                                 \
    static atomic_int once_;                                           \
    if (!atomic_exchange(&once_, 1)) shim_log(__VA_ARGS__);            \
  } while (0)

// ---- the real driver ----
void *libcuda_handle(void);       // dlopen'd real driver (NULL if none)
void *drv_sym(const char *name);  // a driver symbol, bypassing every hook
void *real_dlsym_fn(void *h, const char *name);

// Interception counters (for status and the self-test).
typedef struct {
  atomic_ulong dlsym_hits, getproc_hits, getproc_v2_hits, entrypoint_hits, by_name, unmatched, passthrough;
} intercept_stats;
extern intercept_stats istats;

// ---- tracking (track.c) ----
enum alloc_kind { AK_DEVICE, AK_PITCH, AK_ASYNC, AK_MANAGED, AK_HOST, AK_VMM_PHYS, AK_VMM_MAP, AK_OWNED, AK_COUNT };
extern const char *const alloc_kind_names[AK_COUNT];
void trk_alloc_add(uint64_t key, uint64_t size, int kind);
void trk_alloc_remove(uint64_t key, int kind);
void trk_vmm_unmap(uint64_t ptr, uint64_t size);
void trk_peer_access(int delta);  // +1 per peer link enabled, -1 per link disabled
long trk_peer_links(void);
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

void trk_ctx_add(CUcontext ctx, CUdevice dev, int primary);
void trk_ctx_remove(CUcontext ctx);
void trk_cuinit(void);

enum module_source {
  MS_REGISTER_FATBIN, MS_MODULE_LOAD, MS_MODULE_LOAD_DATA, MS_MODULE_LOAD_DATA_EX,
  MS_MODULE_LOAD_FATBIN, MS_LIBRARY_LOAD_DATA, MS_LIBRARY_LOAD_FILE, MS_LINK_COMPLETE, MS_COUNT
};
extern const char *const module_source_names[MS_COUNT];
// image: the caller's pointer (wrapper, container, ELF or PTX) or NULL with path set.
void trk_module_add(int source, void *handle, const void *image, size_t known_size, const char *path);
void trk_module_remove(void *handle);
void trk_module_alias(void *alias, void *handle);  // cuLibraryGetModule
void trk_func_named(void *fn, void *owner, const char *name);
void trk_func_copy(void *fn, void *from);  // cuKernelGetFunction: fn gets from's name/module

// Per-kernel twin information of an instrumented (or refused) module, from ptxstate's report and
// the PTX's .entry parameter lists. Never freed (kernel records point at them).
typedef struct kinfo {
  char *name;        // the original kernel's name
  int twin;          // the loaded module carries name__ptxmig
  char *reason;      // why not (NULL when twin)
  int nparams;       // -1: layout unknown
  uint32_t *off, *size;
  uint32_t args_size;
} kinfo;
typedef struct kinfo_set {
  int n;
  kinfo *k;
  int instrumented;  // the module was loaded from instrumented PTX
  char reason[192];  // module-level reason when not instrumented (or no kernels)
} kinfo_set;
// instr.c: instr_prepare looks at a module image about to be loaded (image, or a file at path) and,
// when the preempt mode is on and the image has usable PTX, returns 1 with *ptx the instrumented PTX
// (malloc'd, NUL-terminated) to load instead and *ks filled; 0 (with ks->reason) to load the original.
int instr_prepare(const void *image, size_t known, const char *path, char **ptx, kinfo_set *ks);
void kinfo_set_free(kinfo_set *ks);  // frees the kernels (keeps reason)
void instr_failed(kinfo_set *ks, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void instr_stats(struct jbuf *b);
// JIT links (cuLinkAddData/AddFile, cuLinkComplete, cuLinkDestroy): instr_link_ptx returns a copy
// (malloc'd) of the one PTX input of the link that produced image, or NULL.
void instr_link_input(void *state, int type, const void *data, size_t size, const char *path);
void instr_link_complete(void *state, const void *cubin, size_t size);
void instr_link_destroy(void *state);
char *instr_link_ptx(const void *image);
void instr_atfork_child(void);
// trk_module_twins attaches ks (moved) to the module just tracked under handle.
void trk_module_twins(void *handle, kinfo_set *ks);
const kinfo *trk_kinfo_of(struct krec *r, const char **module_reason, void **owner, int *owner_is_lib);
int trk_instrumented_modules(void);

// Kernel records (track.c).
#define NSHAPES 4
#define RING 256
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
  // the timed launch with the most blocks (for equal counts the longer one): high 32 bits its
  // µs (rounded up), low 32 bits its block count (both capped at 2^32-1); 0: none yet.
  // preempt.c scales it to launches larger than any timed one (auto's estimate)
  _Atomic uint64_t big_sample;
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
  atomic_ulong mid_launches, mid_stops;
} krec;


// Launches.
typedef struct launch_tok {
  struct krec *rec;
  struct sample *smp;
  unsigned dims[6];
  uint64_t self_ns;  // with PTXMIG_SELF_TIME=1: the time launch_pre took
  int twin;          // twin_launch launched the twin (its sample may cover part of the grid)
} launch_tok;
enum launch_kind { LK_NORMAL, LK_COOPERATIVE, LK_EX };
void launch_pre(launch_tok *t, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                unsigned by, unsigned bz, CUstream s, int ptsz, int kind);
void launch_post(launch_tok *t, CUresult r);
struct krec *trk_graph_launch(CUgraphExec g, CUresult r);
void trk_capture(int delta);
int trk_capture_open(void);

// ---- preemption (preempt.c) ----
// Every wrapper that submits GPU work brackets its driver call with sub_enter/sub_exit (the gate:
// sub_enter blocks while the process is quiesced) and records the submission with sub_mark.
// sub_hold, before sub_enter: waits while the submission would queue behind a twin in flight.
void sub_hold(CUstream s, int ptsz);
void sub_enter(void);
void sub_exit(void);
uint64_t sub_mark(CUstream s, int ptsz);
void note_original(CUstream s, int ptsz, struct krec *r, const char *why);
void stream_created(CUstream s, unsigned flags);
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
typedef CUresult (*launch_ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
// twin_launch launches f's twin instead of f when the policy allows: 1 with *res set, or 0 (and
// *why) when the caller must launch the original.
int twin_launch(launch_tok *t, int kind, CUfunction f, const unsigned g[3], const unsigned b[3], unsigned shmem,
                CUstream s, int ptsz, void **params, void **extra, launch_fn lf, const CUlaunchConfig *ex,
                launch_ex_fn lef, uint64_t seq, CUresult *res, const char **why);
typedef struct {
  void *c, *s;  // context record (ctx-wide scope) or stream record
} sync_scope;
void scope_stream(sync_scope *sc, CUstream s, int ptsz);
void scope_ctx(sync_scope *sc);
void honest_wait(const sync_scope *sc, uint64_t *gen);
int honest_again(const sync_scope *sc, uint64_t gen);
int honest_pending(const sync_scope *sc);
int preempt_quiesce(struct jbuf *b, unsigned budget_ms);  // 1: this call quiesced (the lease is the caller's)
int preempt_detach(struct jbuf *b);
void preempt_resume(struct jbuf *b);
int preempt_state(void);  // 0 running, 1 quiesced, 2 detached
// Collective alignment (preempt.c): every launch of a collective kernel counts; "align" arms the
// gate to close right after launch number `at` (0 disarms and reopens a gate it closed).
void preempt_collective_launched(void);
int preempt_align(struct jbuf *b, unsigned long long at, char *err, size_t errlen);  // 1: armed
void preempt_collectives_report(struct jbuf *b);
void preempt_report_status(struct jbuf *b);
void preempt_atfork_child(void);
void preempt_drop_ctx(CUcontext ctx);
void preempt_wait_clean(void);  // sleeps while a twin of the current context awaits its relaunch
void trk_func_attr(CUfunction f, int attr, int value);
void trk_twin_reset(struct krec *r);
int trk_func_attrs(struct krec *r, int attrs[8][2], int *n);
void samples_drop_ctx(CUcontext ctx);
void trk_primary_release(CUdevice dev);  // before a primary context release: drop its samples and events
void samples_harvest(int max, int from_ctl);

// ---- owned device memory (vmm.c) ----
// vmm_alloc/vmm_free: CUDA_SUCCESS, or -1 when the shim does not serve the call (the driver must).
int vmm_alloc(CUdeviceptr *p, size_t size);
int vmm_free(CUdeviceptr p);
int vmm_range(CUdeviceptr p, CUdeviceptr *base, size_t *size);  // 1 when p is owned memory
int vmm_ipc_refuse(CUdeviceptr p);                                // 1: owned, refuse the IPC handle
int vmm_released(void);
void vmm_report_status(struct jbuf *b);
void vmm_atfork_child(void);
void vmm_conn_closed(void);  // the lease connection went away (or detached): drop the transfer session
int vmm_cmd_begin(int sock, const char *dir, uint64_t chunk, unsigned slots, int hash, char *err, size_t errlen);
int vmm_cmd_copy(int sock, const char *skip, struct jbuf *b, char *err, size_t errlen);
int vmm_cmd_fill(int sock, struct jbuf *b, char *err, size_t errlen);
int vmm_feed(const char *p, size_t n);
int vmm_cmd_release(struct jbuf *b, char *err, size_t errlen);
int vmm_cmd_end(struct jbuf *b);

// ---- control socket (ctl.c) ----
void ctl_ensure_started(void);
// ctl_send sends all of p on the socket (with the descriptor passfd attached, SCM_RIGHTS, unless
// it is -1); -1 on failure.
int ctl_send(int sock, const char *p, size_t n, int passfd);  // called on first CUDA activity; idempotent and cheap
void ctl_atfork_child(void);

// ---- JSON output buffer (json.c) ----
typedef struct jbuf {
  char *p;
  size_t len, cap;
  int oom;
} jbuf;
void jb_raw(jbuf *b, const char *s, size_t n);
void jb_s(jbuf *b, const char *s);  // raw text
void jb_printf(jbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void jb_str(jbuf *b, const char *s, size_t n);  // quoted, escaped JSON string
void jb_key(jbuf *b, const char *k);            // "k":
// json_get_string parses a flat JSON object and copies string member key into out; returns 1 if
// found, 0 if absent, -1 when the text is not a valid flat JSON object (error text in err).
// A key spelled "#name" takes a number (its text is returned).
int json_flat_parse(const char *text, size_t n, const char *const *keys, char **vals, size_t nkeys,
                    char *err, size_t errlen);
// json_kernel_report walks ptxstate's report ({"kernels":[{"name","eligible","refusals"},...]}) and
// calls cb per kernel (refusal: the first one, or NULL); 0, or -1 when the text is not such a report.
typedef void (*json_kernel_fn)(void *arg, const char *name, int eligible, const char *refusal);
int json_kernel_report(const char *text, size_t n, json_kernel_fn cb, void *arg);

// Report builders (track.c) used by the control socket.
void report_status(jbuf *b, int brief);  // brief: without the module list
void report_kernels(jbuf *b);
int report_dump(jbuf *b, const char *dir, char *err, size_t errlen);

#endif
