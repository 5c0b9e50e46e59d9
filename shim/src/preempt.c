// Preemptible launches (docs/SHIM-PROTOCOL.md "Preemption"): twin launches with private argument
// copies and a control block from a per-context pool, the submission gate, per-stream submission
// sequence numbers for the tail rule, quiesce/detach/resume, and the honest synchronisation used
// by the sync wrappers. Locks: pre_mu guards the launch list, the stream/context records' pending
// counters and the state; it is never taken by fork handlers (the child re-creates it) and never
// held while waiting for the GPU (driver calls under it are non-blocking queries and async submits).
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../include/ptxmig_ctrl.h"
#include "base.h"
#include "instr.h"
#include "json.h"
#include "preempt.h"
#include "track.h"

static const char *const preempt_mode_names[3] = {"off", "auto", "always"};

#define CU_STREAM_LEGACY_H ((CUstream)0x1)
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_LAUNCH_PARAM_END ((void *)0x00)
#define CU_LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)
#define CU_LAUNCH_PARAM_BUFFER_SIZE ((void *)0x02)
#define ATTR_MULTIPROCESSOR_COUNT 16

static void nap_us(unsigned us) {
  struct timespec ts = {0, (long)us * 1000};
  nanosleep(&ts, NULL);
}

// ---- the real driver entry points the shim itself calls ----
static struct {
  pthread_once_t once;
  int ok;
  CUresult (*ctx_get)(CUcontext *);
  CUresult (*ctx_push)(CUcontext);
  CUresult (*ctx_pop)(CUcontext *);
  CUresult (*ctx_dev)(CUdevice *);
  CUresult (*stream_ctx)(CUstream, CUcontext *);
  CUresult (*stream_flags)(CUstream, unsigned *);
  CUresult (*stream_create)(CUstream *, unsigned);
  CUresult (*stream_destroy)(CUstream);
  CUresult (*stream_query)(CUstream);
  CUresult (*stream_sync)(CUstream);
  CUresult (*ev_create)(CUevent *, unsigned);
  CUresult (*ev_record)(CUevent, CUstream);
  CUresult (*ev_query)(CUevent);
  CUresult (*ev_sync)(CUevent);
  CUresult (*mem_alloc)(CUdeviceptr *, size_t);
  CUresult (*memset32_async)(CUdeviceptr, unsigned, size_t, CUstream);
  CUresult (*htod_async)(CUdeviceptr, const void *, size_t, CUstream);
  CUresult (*dtoh_async)(void *, CUdeviceptr, size_t, CUstream);
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void **, void **);
  CUresult (*occupancy)(int *, CUfunction, int, size_t);
  CUresult (*dev_attr)(int *, int, CUdevice);
  CUresult (*param_info)(CUfunction, size_t, size_t *, size_t *);
  CUresult (*mod_get_fn)(CUfunction *, CUmodule, const char *);
  CUresult (*lib_get_kernel)(CUkernel *, CUlibrary, const char *);
  CUresult (*kernel_get_fn)(CUfunction *, CUkernel);
  CUresult (*func_set_attr)(CUfunction, int, int);
  CUresult (*mod_get_global)(CUdeviceptr *, size_t *, CUmodule, const char *);
  CUresult (*lib_get_global)(CUdeviceptr *, size_t *, CUlibrary, const char *);
} d = {.once = PTHREAD_ONCE_INIT};

#define SYM(field, name) (*(void **)&d.field = drv_sym(name))
static void d_load(void) {
  SYM(ctx_get, "cuCtxGetCurrent");
  SYM(ctx_push, "cuCtxPushCurrent_v2");
  SYM(ctx_pop, "cuCtxPopCurrent_v2");
  SYM(ctx_dev, "cuCtxGetDevice");
  SYM(stream_ctx, "cuStreamGetCtx");
  SYM(stream_flags, "cuStreamGetFlags");
  SYM(stream_create, "cuStreamCreate");
  SYM(stream_destroy, "cuStreamDestroy_v2");
  SYM(stream_query, "cuStreamQuery");
  SYM(stream_sync, "cuStreamSynchronize");
  SYM(ev_create, "cuEventCreate");
  SYM(ev_record, "cuEventRecord");
  SYM(ev_query, "cuEventQuery");
  SYM(ev_sync, "cuEventSynchronize");
  SYM(mem_alloc, "cuMemAlloc_v2");
  SYM(memset32_async, "cuMemsetD32Async");
  SYM(htod_async, "cuMemcpyHtoDAsync_v2");
  SYM(dtoh_async, "cuMemcpyDtoHAsync_v2");
  SYM(launch, "cuLaunchKernel");
  SYM(occupancy, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  SYM(dev_attr, "cuDeviceGetAttribute");
  SYM(param_info, "cuFuncGetParamInfo");
  SYM(mod_get_fn, "cuModuleGetFunction");
  SYM(lib_get_kernel, "cuLibraryGetKernel");
  SYM(kernel_get_fn, "cuKernelGetFunction");
  SYM(func_set_attr, "cuFuncSetAttribute");
  SYM(mod_get_global, "cuModuleGetGlobal_v2");
  SYM(lib_get_global, "cuLibraryGetGlobal");
  d.ok = d.ctx_get && d.ctx_push && d.ctx_pop && d.ctx_dev && d.stream_ctx && d.stream_flags && d.stream_create &&
         d.stream_query && d.ev_create && d.ev_record && d.ev_query && d.ev_sync && d.mem_alloc && d.memset32_async &&
         d.htod_async && d.dtoh_async && d.launch && d.occupancy && d.dev_attr && d.stream_sync;
  if (!d.ok) LOG_ONCE("preemption: the driver lacks entry points the twins need; kernels launch as originals");
}
static int d_ready(void) {
  pthread_once(&d.once, d_load);
  return d.ok;
}

// ---- contexts and streams ----
#define SLOTS_PER_SLAB 64
#define MAX_SLABS 16
// A pool slot holds a version-3 control block (112 bytes; version-2 twins read the first 64).
#define CTL_SLOT_BYTES 128
_Static_assert(CTL_SLOT_BYTES >= PTXMIG_CTL_SIZE_V3, "control block slot");
// A save area of a mid-block twin launch (device memory, reused by later launches of the context).
typedef struct area {
  CUdeviceptr p;
  size_t n;
} area;
typedef struct crec {
  CUcontext ctx;
  int sms;  // multiprocessors of its device (0: unknown yet)
  _Atomic uint64_t legacy_last, blocking_last;  // last submission to the legacy stream / any blocking stream
  uint64_t pgen;  // last preemption generation raised on a stream of this context (pre_mu)
  int npending;   // twins of this context preempted (or being preempted) and not yet relaunched
  CUstream side;  // non-blocking stream for the preempt writes and read-backs
  CUdeviceptr slab[MAX_SLABS];
  uint64_t used[MAX_SLABS];
  int nslab;
  CUevent free_ev[64];  // two per twin launch (done, go)
  int nfree_ev;
  struct krec *_Atomic orig;  // the last original launched on the legacy stream
  const char *_Atomic orig_why;
  area *areas;  // free save areas (pre_mu); device memory kept for the context's life
  int nareas, careas;
} crec;
typedef struct srec {
  CUstream s;
  crec *cr;
  int nonblocking;
  _Atomic uint64_t last;
  uint64_t pgen;
  int npending;
  struct krec *_Atomic orig;
  const char *_Atomic orig_why;
} srec;

static pthread_mutex_t pre_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pre_cv = PTHREAD_COND_INITIALIZER;  // pending cleared, gate opened
#define MAX_CRECS 64
static crec *_Atomic crecs[MAX_CRECS];
#define STAB 4096
static srec *_Atomic stab[STAB];  // open addressing by handle; records are never freed
static _Atomic uint64_t gseq;      // submission sequence
static _Atomic uint64_t pgen;      // preemption generation (bumped under pre_mu)
static atomic_int twins_ever;

static crec *crec_of(CUcontext c) {
  if (!c) return NULL;
  static __thread CUcontext lc;
  static __thread crec *lr;
  if (c == lc && lr) return lr;
  for (int i = 0; i < MAX_CRECS; i++) {
    crec *r = atomic_load(&crecs[i]);
    if (!r) break;
    if (r->ctx == c) {
      lc = c, lr = r;
      return r;
    }
  }
  pthread_mutex_lock(&pre_mu);
  crec *r = NULL;
  int i;
  for (i = 0; i < MAX_CRECS; i++) {
    r = atomic_load(&crecs[i]);
    if (!r || r->ctx == c) break;
  }
  if (i < MAX_CRECS && !r && (r = calloc(1, sizeof *r))) {
    r->ctx = c;
    atomic_store(&crecs[i], r);
  } else if (i == MAX_CRECS) {
    r = NULL;
    LOG_ONCE("preemption: context table full");
  }
  pthread_mutex_unlock(&pre_mu);
  if (r) lc = c, lr = r;
  return r;
}
static crec *crec_cur(void) {
  CUcontext c = NULL;
  if (!d.ctx_get || d.ctx_get(&c) != CUDA_SUCCESS) return NULL;
  return crec_of(c);
}

static size_t shash(CUstream s) {
  uint64_t k = (uint64_t)(uintptr_t)s;
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return (size_t)k & (STAB - 1);
}
static srec *srec_find(CUstream s) {
  for (size_t i = shash(s), n = 0; n < STAB; i = (i + 1) & (STAB - 1), n++) {
    srec *r = atomic_load(&stab[i]);
    if (!r) return NULL;
    if (r->s == s) return r;
  }
  return NULL;
}
// srec_get finds or adds the record of an explicit stream (ctx and flags from the driver or given).
static srec *srec_put(CUstream s, CUcontext ctx, int have_flags, unsigned flags) {
  srec *r = srec_find(s);
  if (r && !have_flags) return r;
  if (!ctx && d.stream_ctx(s, &ctx) != CUDA_SUCCESS) return NULL;
  if (!have_flags && d.stream_flags(s, &flags) != CUDA_SUCCESS) return NULL;
  crec *c = crec_of(ctx);
  if (!c) return NULL;
  pthread_mutex_lock(&pre_mu);
  if (!r) r = srec_find(s);
  if (r) {  // a re-created stream reusing a handle
    r->cr = c;
    r->nonblocking = (flags & CU_STREAM_NON_BLOCKING) != 0;
  } else {
    size_t i = shash(s), n = 0;
    while (n < STAB && atomic_load(&stab[i])) i = (i + 1) & (STAB - 1), n++;
    if (n < STAB * 3 / 4 && (r = calloc(1, sizeof *r))) {
      r->s = s;
      r->cr = c;
      r->nonblocking = (flags & CU_STREAM_NON_BLOCKING) != 0;
      atomic_store(&stab[i], r);
    } else {
      r = NULL;
      LOG_ONCE("preemption: stream table full; twins launch only on known streams");
    }
  }
  pthread_mutex_unlock(&pre_mu);
  return r;
}
static srec *srec_get(CUstream s) {
  static __thread CUstream ls;
  static __thread srec *lr;
  if (s == ls && lr) return lr;
  srec *r = srec_find(s);
  if (!r) r = srec_put(s, NULL, 0, 0);
  if (r) ls = s, lr = r;
  return r;
}

static int is_legacy(CUstream s, int ptsz) { return (s == NULL && !ptsz) || s == CU_STREAM_LEGACY_H; }
static int is_ptds(CUstream s, int ptsz) { return (s == NULL && ptsz) || s == CU_STREAM_PER_THREAD; }

void stream_created(CUstream s, unsigned flags) {
  if (cfg.preempt == PM_OFF || !s || !d_ready()) return;
  CUcontext c = NULL;
  if (d.ctx_get(&c) == CUDA_SUCCESS && c) srec_put(s, c, 1, flags);
}

// ---- the gate ----
static atomic_int gate_closed;
// Submissions past the gate, counted in per-thread shards (no cache line shared by launching
// threads); quiesce sums them.
#define SHARDS 16
static struct {
  _Alignas(64) atomic_long n;
} inflight[SHARDS];
static atomic_uint next_shard;
static __thread int my_shard = -1;
static atomic_long *shard(void) {
  if (my_shard < 0) my_shard = (int)(atomic_fetch_add(&next_shard, 1) % SHARDS);
  return &inflight[my_shard].n;
}
static long inflight_total(void) {
  long t = 0;
  for (int i = 0; i < SHARDS; i++) t += atomic_load(&inflight[i].n);
  return t;
}

// Re-entrant per thread: a submission made from inside another (a driver calling one of its own
// exported entry points) is part of the outer one and never waits at the gate.
static __thread int sub_depth;
void sub_enter(void) {
  if (sub_depth++) return;
  atomic_long *n = shard();
  for (;;) {
    atomic_fetch_add(n, 1);
    if (!atomic_load(&gate_closed)) return;
    atomic_fetch_sub(n, 1);
    pthread_mutex_lock(&pre_mu);
    while (atomic_load(&gate_closed)) pthread_cond_wait(&pre_cv, &pre_mu);
    pthread_mutex_unlock(&pre_mu);
  }
}
void sub_exit(void) {
  if (--sub_depth == 0) atomic_fetch_sub(shard(), 1);
}

uint64_t sub_mark(CUstream s, int ptsz) {
  if (cfg.preempt == PM_OFF || !d_ready()) return 0;
  uint64_t seq = atomic_fetch_add(&gseq, 1) + 1;
  if (is_legacy(s, ptsz)) {
    crec *c = crec_cur();
    if (c) atomic_store(&c->legacy_last, seq);
  } else if (is_ptds(s, ptsz)) {
    crec *c = crec_cur();  // the per-thread stream synchronises with the legacy one: a blocking stream
    if (c) atomic_store(&c->blocking_last, seq);
  } else {
    srec *r = srec_get(s);
    if (r) {
      atomic_store(&r->last, seq);
      if (!r->nonblocking) atomic_store(&r->cr->blocking_last, seq);
    } else {
      crec *c = crec_cur();
      if (c) atomic_store(&c->blocking_last, seq);
    }
  }
  return seq;
}

void note_original(CUstream s, int ptsz, struct krec *r, const char *why) {
  if (cfg.preempt == PM_OFF || !r || !d.ok) return;
  if (why) atomic_store(&r->original_why, why);
  if (is_legacy(s, ptsz) || is_ptds(s, ptsz)) {
    crec *c = crec_cur();
    if (c) {
      atomic_store(&c->orig, r);
      atomic_store(&c->orig_why, why);
    }
  } else {
    srec *sr = srec_find(s);
    if (sr) {
      atomic_store(&sr->orig, r);
      atomic_store(&sr->orig_why, why);
    }
  }
}

// ---- twin launches ----
enum { TL_RUNNING, TL_PREEMPTING, TL_PREEMPTED, TL_DONE };
typedef struct tl {
  struct tl *next;
  uint64_t id, seq;
  krec *rec;
  CUfunction twin;
  crec *cr;
  srec *sr;  // NULL on the legacy stream
  CUstream stream;
  unsigned block[3], shmem, W;
  int slab, slot;
  CUdeviceptr ctl;
  struct ptxmig_ctl_v3 init;  // host image of the control block (the async copies' source; v3 fields: mid only)
  struct ptxmig_ctl_v3 seen;  // read back at quiesce
  int mid;  // a mid-block twin launched with save areas (version 3)
  CUdeviceptr area[2];  // its two save areas (mid)
  size_t area_n;  // bytes of each
  uint32_t records;  // records its last stop saved (mid: CTAs stopped inside a block)
  uint8_t *args;
  void **argv;
  CUevent done;
  CUevent go;  // recorded right before the twin's control-block copy: complete once the twin is at its stream's head
  int state, raised, drain, ended, relaunches;
  int started, nohold;  // sub_hold (pre_mu): go seen complete; a hold gave up on this launch
  int stopping;  // raised, not ended when the quiesce replied: the raiser thread owns it (pre_mu)
} tl;
static const char *kname(krec *r) {
  char *n = r ? atomic_load(&r->name) : NULL;
  return n ? n : "(unnamed)";
}
static tl *live;  // pre_mu
static atomic_int nlive;  // changed under pre_mu; read without it by sub_hold
static uint64_t next_launch_id = 1;
static atomic_ulong st_twin_launches, st_relaunches, st_quiesces, st_preempted, st_holds, st_hold_ns, st_hold_gaveup;
static atomic_ulong st_mid_launches, st_mid_stops, st_mid_refused;

typedef struct layout {
  int n;
  uint32_t args_size;
  uint32_t *off, *size;
} layout;

// param_layout_of: from cuFuncGetParamInfo where the driver has it, else from the PTX; kept in
// the kernel record.
static const layout *param_layout_of(krec *r, const kinfo *k) {
  layout *l = atomic_load(&r->layout);
  if (l) return l;
  l = calloc(1, sizeof *l);
  if (!l) return NULL;
  int n = 0;
  if (d.param_info) {
    size_t off, sz;
    uint32_t offs[1024], sizes[1024];
    while (n < 1024 && d.param_info(r->fn, (size_t)n, &off, &sz) == CUDA_SUCCESS && off < 32768 && sz <= 32768) {
      offs[n] = (uint32_t)off;
      sizes[n] = (uint32_t)sz;
      if (off + sz > l->args_size) l->args_size = (uint32_t)(off + sz);
      n++;
    }
    if (n > 0 && (!k || k->nparams < 0 || k->nparams == n)) {
      l->off = malloc((size_t)n * sizeof *l->off);
      l->size = malloc((size_t)n * sizeof *l->size);
      if (l->off && l->size) {
        memcpy(l->off, offs, (size_t)n * sizeof *offs);
        memcpy(l->size, sizes, (size_t)n * sizeof *sizes);
        l->n = n;
        atomic_store(&r->param_src, 1);
      } else {
        n = 0;
      }
    } else {
      n = 0;
    }
  }
  if (!n) {
    free(l->off);
    free(l->size);
    l->off = l->size = NULL;
    l->args_size = 0;
    if (!k || k->nparams < 0) {
      free(l);
      return NULL;
    }
    l->n = k->nparams;
    l->off = k->off;
    l->size = k->size;
    l->args_size = k->args_size;
    atomic_store(&r->param_src, 2);
  }
  layout *expect = NULL;
  if (!atomic_compare_exchange_strong(&r->layout, &expect, l)) {
    if (atomic_load(&r->param_src) == 1) {
      free(l->off);
      free(l->size);
    }
    free(l);
    l = expect;
  }
  return l;
}

// fn_handle looks up, once per kernel record, the function named after the kernel plus suffix in
// its module or library (fn and state: the record's twin_fn/twin_fn_state or mid_fn/mid_fn_state).
static CUfunction fn_handle(const kinfo *k, void *owner, int is_lib, const char *suffix, void *_Atomic *fn,
                            atomic_int *state) {
  int st = atomic_load(state);
  if (st) return st > 0 ? atomic_load(fn) : NULL;
  char tn[600];
  void *f = NULL;
  int l = snprintf(tn, sizeof tn, "%s%s", k->name, suffix);
  if (l > 0 && (size_t)l < sizeof tn && owner) {
    if (is_lib && d.lib_get_kernel && d.kernel_get_fn) {
      CUkernel kk;
      if (d.lib_get_kernel(&kk, (CUlibrary)owner, tn) == CUDA_SUCCESS) f = kk;
    } else if (d.mod_get_fn) {
      CUfunction ff;
      if (d.mod_get_fn(&ff, (CUmodule)owner, tn) == CUDA_SUCCESS) f = ff;
    }
  }
  atomic_store(fn, f);
  atomic_store(state, !f ? -1 : is_lib ? 2 : 1);
  if (!f) shim_log("preemption: %s not found in its module; kernel launches as the original", tn);
  return f;
}

// function_of: a library's twin is a CUkernel; its function in the current context serves
// occupancy and launch (NULL when the driver refuses it).
static CUfunction function_of(CUfunction f, atomic_int *state) {
  if (f && atomic_load(state) == 2 && d.kernel_get_fn(&f, (CUkernel)f) != CUDA_SUCCESS) return NULL;
  return f;
}

// replay_attrs replays the app's cuFuncSetAttribute calls on the kernel (e.g. the dynamic shared
// memory limit) on one of its twins, once per change (applied: that twin's generation).
static void replay_attrs(krec *r, CUfunction twin, atomic_int *applied) {
  int ag = atomic_load(&r->attrs_gen);
  if (ag && atomic_load(applied) != ag && d.func_set_attr) {
    int at[8][2], na;
    ag = trk_func_attrs(r, at, &na);
    for (int i = 0; i < na; i++) d.func_set_attr(twin, at[i][0], at[i][1]);
    atomic_store(applied, ag);
  }
}

// ctl_slot takes a control block from c's pool; pre_mu held (allocates a slab when all are used).
static int ctl_slot(crec *c, CUdeviceptr *p, int *slab, int *slot) {
  for (int i = 0; i < c->nslab; i++)
    if (~c->used[i]) {
      int b = __builtin_ctzll(~c->used[i]);
      c->used[i] |= 1ull << b;
      *slab = i, *slot = b;
      *p = c->slab[i] + (CUdeviceptr)b * CTL_SLOT_BYTES;
      return 0;
    }
  if (c->nslab == MAX_SLABS || d.mem_alloc(&c->slab[c->nslab], SLOTS_PER_SLAB * CTL_SLOT_BYTES) != CUDA_SUCCESS)
    return -1;
  c->used[c->nslab] = 1;
  *slab = c->nslab, *slot = 0;
  *p = c->slab[c->nslab++];
  return 0;
}

static void area_put_locked(crec *c, CUdeviceptr p, size_t n);
static void tl_free(tl *t) {  // pre_mu held
  if (t->slab >= 0) t->cr->used[t->slab] &= ~(1ull << t->slot);
  for (int i = 0; i < 2; i++) area_put_locked(t->cr, t->area[i], t->area_n);
  CUevent evs[2] = {t->done, t->go};
  for (int i = 0; i < 2; i++)
    if (evs[i] && t->cr->nfree_ev < 64) t->cr->free_ev[t->cr->nfree_ev++] = evs[i];
  // else: leaked rather than destroyed under the lock; the pool rarely overflows
  free(t->args);
  free(t->argv);
  free(t);
}

// retire frees finished launches of ctx c (NULL: any, on the control thread); pre_mu held.
static void retire_locked(crec *c, int max) {
  for (tl **pp = &live; *pp && max > 0;) {
    tl *t = *pp;
    if ((t->state != TL_RUNNING && t->state != TL_DONE) || (c && t->cr != c)) {
      pp = &t->next;
      continue;
    }
    max--;
    if (t->state == TL_DONE) {
      *pp = t->next;
      nlive--;
      tl_free(t);
      continue;
    }
    int pushed = 0;
    if (!c && !(pushed = d.ctx_push(t->cr->ctx) == CUDA_SUCCESS)) {  // its context is gone
      pp = &t->next;
      continue;
    }
    CUresult q = d.ev_query(t->done);
    if (pushed) {
      CUcontext x;
      d.ctx_pop(&x);
    }
    if (q == CUDA_ERROR_NOT_READY) {
      pp = &t->next;
      continue;
    }
    *pp = t->next;
    nlive--;
    tl_free(t);
  }
}

// block_us_of: the kernel's sampled time of one block, µs (0: never timed). A sample gives its
// time per block of the launch; the blocks of a launch ran about `resident` at a time (fewer when
// the launch had fewer), so one block took about that many times the per-block share.
static double block_us_of(krec *r, uint64_t resident) {
  uint64_t smp = r ? atomic_load(&r->blk_sample) : 0;
  uint64_t blocks = smp & 0xffffffffull;
  if (!smp || !blocks || !resident) return 0;
  uint32_t hi = (uint32_t)(smp >> 32);
  float per;
  memcpy(&per, &hi, sizeof per);
  double us = (double)per * (double)(resident < blocks ? resident : blocks);
  return us > 0 ? us : 0;
}

// batch_max_for: the twin's largest claim. PTXMIG_PREEMPT_BATCH_MAX when set; else from the
// kernel's sampled time per block so that one batch lasts about BATCH_TARGET_US (a CTA runs up to
// ~2 batches after the flag is raised; with one-block claims only the block in progress, as the
// twin then claims nothing ahead), 1 to PTXMIG_BATCH_MAX_DEFAULT; the default when the kernel was
// never timed.
#define BATCH_TARGET_US 1000.0
static uint32_t batch_max_for(krec *r, uint64_t resident) {
  if (cfg.preempt_batch_max) return cfg.preempt_batch_max;
  double block_us = block_us_of(r, resident);
  if (!(block_us > 0)) return PTXMIG_BATCH_MAX_DEFAULT;
  double g = BATCH_TARGET_US / block_us;
  if (g >= PTXMIG_BATCH_MAX_DEFAULT) return PTXMIG_BATCH_MAX_DEFAULT;
  return g < 1 ? 1 : (uint32_t)g;
}

// twin_ctas: the CTAs a twin launch of `total` blocks gets: one wave of `occ` CTAs per SM, no more
// than the blocks, within the grid's x limit.
static uint64_t twin_ctas(int occ, int sms, uint64_t total) {
  uint64_t w = (uint64_t)occ * (uint64_t)sms;
  if (w > total) w = total;
  return w > 0x7fffffffu ? 0x7fffffffu : w;
}

// arg_growth: the largest growth of a count argument of this launch (sig) over the same argument
// of a sampled launch (was: big_sig, the longest timed original's; blk_sig, the one with the
// longest blocks), counted from 2x; 1 when none grew or none is known.
static double arg_growth(_Atomic uint32_t *was_sig, const uint32_t sig[SIG_N]) {
  double g = 1.0;
  for (int i = 0; sig && i < SIG_N; i++) {
    uint32_t was = atomic_load_explicit(&was_sig[i], memory_order_relaxed);
    if (was && sig[i] >= 2u * was && (double)sig[i] / was > g) g = (double)sig[i] / was;
  }
  return g;
}

// est_us is auto's expected GPU time of a launch of `blocks` blocks of r's kernel, in µs rounded
// up, 0 when it was never timed: the mean of its samples, scaled up when the launch has more
// blocks than any original launch timed (big_sample). A kernel timed on small grids (a warm-up, a
// calibration run) and then launched on a large one is not short: its time grows with the number
// of waves. Linear in blocks, the scaling over-estimates a sample smaller than one wave: near the
// threshold such a kernel gets its twin (a cost), never the original by mistake.
static uint64_t est_us(krec *r, uint64_t blocks, const uint32_t sig[SIG_N]) {
  uint64_t m = atomic_load(&r->mean_us);
  if (!m) return 0;
  uint64_t big = atomic_load(&r->big_sample), bb = big & 0xffffffffull, bu = big >> 32;
  if (!bb) return m;
  // Scaled from the longest timed launch by the larger of the grid's growth and the largest
  // growth of a count argument (a loop bound raised 1000x on the same grid runs about 1000x
  // longer). Not their product: a size argument usually grows with the grid it sizes.
  double scale = blocks > bb ? (double)blocks / (double)bb : 1.0;
  double ag = arg_growth(r->big_sig, sig);
  if (ag > scale) scale = ag;
  if (scale > 1.0) {
    double e = (double)bu * scale + 1.0;
    if (e > (double)m) m = e > 4e9 ? 4000000000ull : (uint64_t)e;
  }
  return m;
}

// extra_buffer finds the argument buffer of a launch's `extra` (CU_LAUNCH_PARAM_BUFFER_POINTER and
// _SIZE); 0 when it holds anything else or no buffer.
static int extra_buffer(void **extra, const uint8_t **buf, size_t *bsz) {
  *buf = NULL, *bsz = 0;
  for (int i = 0; i < 64 && extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
    if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) *buf = extra[i + 1];
    else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE && extra[i + 1]) *bsz = *(size_t *)extra[i + 1];
    else return 0;
  }
  return *buf != NULL;
}

// scalar_sig reads a launch's scalar signature (see SIG_N) from its arguments.
static void scalar_sig(const layout *lay, void **params, void **extra, uint32_t sig[SIG_N]) {
  memset(sig, 0, SIG_N * sizeof *sig);
  const uint8_t *buf = NULL;
  size_t bsz = 0;
  if (!params && !(extra && extra_buffer(extra, &buf, &bsz))) return;
  for (int i = 0, j = 0; i < lay->n && j < SIG_N; i++) {
    uint32_t sz = lay->size[i];
    if (sz != 4 && sz != 8) continue;
    const void *p = params ? params[i] : (lay->off[i] + sz <= bsz ? buf + lay->off[i] : NULL);
    uint64_t v = 0;
    if (p) memcpy(&v, p, sz);  // little-endian: a 4-byte value lands in the low half
    sig[j++] = v < (1ull << 31) ? (uint32_t)v : 0;
  }
}

// ---- mid-block twins (control block version 3; docs/PTXSTATE.md "Mid-block safe points") ----
// mid_layout reads, once per kernel record, the record layout that the instrumented module carries
// for the kernel (__ptxmig_mid_K = {2, register slots, static shared bytes, sites, local bytes});
// 1 when the twin can stop inside a block. The app's context is current. The copy goes through a
// non-blocking stream of its own: a synchronous copy would wait behind the app's kernels on the
// legacy stream. A launch that finds another thread reading it runs with block-granular stops.
#define MID_READING 2
static int mid_layout(krec *r, const kinfo *k, void *owner, int is_lib) {
  int st = atomic_load(&r->mid_state);
  if (st) return st == 1;
  int expect = 0;
  if (!atomic_compare_exchange_strong(&r->mid_state, &expect, MID_READING)) return expect == 1;
  st = -1;
  char gn[600];
  int l = snprintf(gn, sizeof gn, "__ptxmig_mid_%s", k->name);
  CUdeviceptr p = 0;
  size_t n = 0;
  CUresult rc = CUDA_ERROR_NOT_FOUND;
  if (l > 0 && (size_t)l < sizeof gn && owner) {
    if (is_lib && d.lib_get_global) rc = d.lib_get_global(&p, &n, (CUlibrary)owner, gn);
    else if (!is_lib && d.mod_get_global) rc = d.mod_get_global(&p, &n, (CUmodule)owner, gn);
  }
  uint32_t v[5] = {0};
  CUstream q = NULL;
  if (rc == CUDA_SUCCESS && n == sizeof v && d.stream_create(&q, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS) {
    // Bounds: ptxstate saves at most 512 live bytes (64 slots) per thread; shared memory and the
    // local depot are bounded by the hardware (228 KiB, 512 KiB per thread).
    if (d.dtoh_async(v, p, sizeof v, q) == CUDA_SUCCESS && d.stream_sync(q) == CUDA_SUCCESS && v[0] == 2 &&
        v[1] <= 64 && v[2] <= (1u << 20) && v[3] > 0 && v[4] <= (1u << 19)) {
      memcpy(r->mid, v, sizeof v);
      st = 1;
    } else {
      shim_log("preemption: %s: its mid-block layout is unreadable or out of range; block-granular stops", k->name);
    }
    if (d.stream_destroy) d.stream_destroy(q);
  }
  atomic_store(&r->mid_state, st);
  return st == 1;
}

// mid_record_bytes: one record of a launch with `threads` threads and `dyn` bytes of dynamic
// shared memory (ptxstate.MidBlockLayout.RecordBytes, the dynamic part always counted).
static uint64_t mid_record_bytes(const krec *r, uint64_t threads, uint64_t dyn) {
  uint64_t n = 64 + (8ull * r->mid[1] + r->mid[4]) * threads + r->mid[2] + dyn;
  return (n + 15) & ~15ull;
}

// area_take gives a free save area of at least n bytes of c (the smallest that fits), else
// allocates one (the context current); 0 when there is no device memory.
static CUdeviceptr area_take(crec *c, size_t n, size_t *got) {
  pthread_mutex_lock(&pre_mu);
  int best = -1;
  for (int i = 0; i < c->nareas; i++)
    if (c->areas[i].n >= n && (best < 0 || c->areas[i].n < c->areas[best].n)) best = i;
  if (best >= 0) {
    area a = c->areas[best];
    c->areas[best] = c->areas[--c->nareas];
    pthread_mutex_unlock(&pre_mu);
    *got = a.n;
    return a.p;
  }
  pthread_mutex_unlock(&pre_mu);
  CUdeviceptr p = 0;
  if (d.mem_alloc(&p, n) != CUDA_SUCCESS) return 0;
  *got = n;
  return p;
}

// area_put_locked returns a save area to c's pool (pre_mu held); the pool holds every area ever
// allocated and not in use, so device memory for save areas peaks with the launches in flight.
static void area_put_locked(crec *c, CUdeviceptr p, size_t n) {
  if (!p) return;
  if (c->nareas == c->careas) {
    int nc = c->careas ? 2 * c->careas : 8;
    area *na = realloc(c->areas, (size_t)nc * sizeof *na);
    if (!na) {
      LOG_ONCE("preemption: out of memory for the save-area pool; an area is left allocated");
      return;
    }
    c->areas = na;
    c->careas = nc;
  }
  c->areas[c->nareas++] = (area){p, n};
}

static int attrs_allowed(const CUlaunchConfig *c) {
  for (unsigned i = 0; c->attrs && i < c->numAttrs && i < 64; i++) {
    int id = c->attrs[i].id;
    // access policy window 1, synchronization policy 3, priority 8, memory sync domain map/domain 9/10
    if (id != 1 && id != 3 && id != 8 && id != 9 && id != 10) return 0;
  }
  return 1;
}

int twin_launch(launch_tok *t, int kind, CUfunction f, const unsigned g[3], const unsigned b[3], unsigned shmem,
                CUstream s, int ptsz, void **params, void **extra, launch_fn lf, const CUlaunchConfig *ex,
                launch_ex_fn lef, uint64_t seq, CUresult *res, const char **why) {
  *why = NULL;
  if (cfg.preempt == PM_OFF) return 0;
  krec *r = t->rec;
  if (!r || !d_ready()) {
    *why = "kernel not tracked";
    return 0;
  }
  if (kind == LK_COOPERATIVE) {
    *why = "cooperative launch";
    return 0;
  }
  if (trk_capture_open()) {
    *why = "stream capture open";
    return 0;
  }
  if (is_ptds(s, ptsz)) {
    *why = "per-thread default stream";
    return 0;
  }
  const char *mr;
  void *owner;
  int is_lib;
  const kinfo *k = trk_kinfo_of(r, &mr, &owner, &is_lib);
  if (!k || !k->twin) {
    *why = k && k->reason ? k->reason : mr ? mr : "no twin";
    return 0;
  }
  uint64_t blocks = (uint64_t)g[0] * g[1] * g[2];
  // The scalar signature goes with the launch's timing sample (whichever way it launches), and
  // auto's estimate compares it with the longest timed launch's.
  const layout *lay = param_layout_of(r, k);
  uint32_t sig[SIG_N];
  if (lay) {
    scalar_sig(lay, params, extra, sig);
    trk_sample_sig(t, sig);
  }
  if (cfg.preempt == PM_AUTO) {
    uint64_t m = est_us(r, blocks, lay ? sig : NULL);
    if (m && m - 1 <= cfg.preempt_min_us) {
      *why = "short kernel (auto)";
      return 0;
    }
  }
  if (ex && !attrs_allowed(ex)) {
    *why = "launch attributes (cluster, programmatic or completion events)";
    return 0;
  }
  if (!g[0] || !g[1] || !g[2] || !b[0] || !b[1] || !b[2]) {
    *why = "invalid launch";
    return 0;
  }
  CUcontext cur = NULL;
  if (d.ctx_get(&cur) != CUDA_SUCCESS || !cur) {
    *why = "no current context";
    return 0;
  }
  crec *c = crec_of(cur);
  srec *sr = NULL;
  if (!is_legacy(s, ptsz)) {
    sr = srec_get(s);
    if (!sr || sr->cr != c) {
      *why = sr ? "stream of another context" : "stream not tracked";
      return 0;
    }
  }
  if (!c) {
    *why = "context not tracked";
    return 0;
  }
  CUfunction twin = function_of(fn_handle(k, owner, is_lib, PTXMIG_TWIN_SUFFIX, &r->twin_fn, &r->twin_fn_state),
                                 &r->twin_fn_state);
  if (!twin) {
    *why = "twin not found in the loaded module";
    return 0;
  }
  replay_attrs(r, twin, &r->attrs_applied);
  if (!lay) {
    *why = "parameter layout unknown";
    return 0;
  }
  if (!c->sms) {
    CUdevice dev;
    int sms = 0;
    if (d.ctx_dev(&dev) == CUDA_SUCCESS && d.dev_attr(&sms, ATTR_MULTIPROCESSOR_COUNT, dev) == CUDA_SUCCESS) c->sms = sms;
  }
  int occ = 0;
  unsigned threads = b[0] * b[1] * b[2];
  if (!c->sms || d.occupancy(&occ, twin, (int)threads, shmem) != CUDA_SUCCESS || occ <= 0) {
    *why = "twin occupancy is zero";
    return 0;
  }
  // A mid-block twin (one whose module carries its record layout) stops inside a block.
  int mid = cfg.mid_block == MB_ON && mid_layout(r, k, owner, is_lib);
  // auto (PTXMIG_MID_BLOCK=auto): the kernel's second, mid-block twin where its block twin could
  // not stop in time. A grid that fits in one wave of resident blocks gives each block-twin CTA one
  // block, which it cannot cut short; and a block expected to run longer than half
  // PTXMIG_PREEMPT_MIN_US holds a block twin's stop for the rest of the block running once timed
  // (one-block claims: nothing claimed ahead). A block's expected time: from the sample with the
  // largest time per block (block_us_of), grown by how much the launch's count arguments exceed
  // that sample's (a loop bound raised 10x: blocks 10x longer). One
  // wave is judged by the mid twin's own occupancy (it holds more registers), so such a launch
  // still runs in one wave; a grid that is one wave for the block twin only gets the mid twin when
  // its blocks are long (two waves, but stoppable), else the block twin (and under auto the
  // original). The layout is read only for a launch that would use the mid twin.
  int one_wave = 0, long_blocks = 0;
  CUfunction block_twin = twin;
  int block_occ = occ;
  int fits = blocks <= (uint64_t)occ * (uint64_t)c->sms;  // one wave of the block twin
  if (cfg.mid_block == MB_AUTO && k->mid_twin) {
    uint64_t res = (uint64_t)occ * (uint64_t)c->sms;
    double bus = block_us_of(r, res) * arg_growth(r->blk_sig, sig);
    int lng = 2.0 * bus > (double)cfg.preempt_min_us;
    CUfunction mf = (fits || lng) && mid_layout(r, k, owner, is_lib)
                        ? function_of(fn_handle(k, owner, is_lib, PTXMIG_MID_TWIN_SUFFIX, &r->mid_fn, &r->mid_fn_state),
                                      &r->mid_fn_state)
                        : NULL;
    int occ_mid = 0;
    if (mf) replay_attrs(r, mf, &r->mid_attrs_applied);
    if (mf && d.occupancy(&occ_mid, mf, (int)threads, shmem) == CUDA_SUCCESS && occ_mid > 0) {
      one_wave = fits && blocks <= (uint64_t)occ_mid * (uint64_t)c->sms;
      long_blocks = !one_wave && lng;
      if (one_wave || long_blocks) twin = mf, occ = occ_mid, mid = 1;
    }
  }
  // auto: a grid that fits in one wave of the twin gives each twin CTA at most one block, and a
  // block-granular twin never cuts a block short: it could not stop sooner than the original, only
  // run slower (a grid-stride loop over SMs x 8 CTAs, as counter's, took 1.28x on an H100).
  if (cfg.preempt == PM_AUTO && !mid && fits) {  // !mid: occ is still the block twin's
    *why = "grid fits in one wave (auto: its twin could not stop sooner)";
    return 0;
  }
  // auto: a twin that fits fewer CTAs per SM than its original (more registers, e.g. 40 against
  // 32 at 1024 threads: half the CTAs) runs markedly slower; a kernel sampled shorter than
  // PTXMIG_PREEMPT_LONG_US drains within about the budget anyway, so it launches as the original.
  if (cfg.preempt == PM_AUTO && !one_wave) {  // one wave: every block resident either way
    uint64_t m = est_us(r, blocks, sig);
    int occ_orig = 0;
    if (m && m < cfg.preempt_long_us && d.occupancy(&occ_orig, f, (int)threads, shmem) == CUDA_SUCCESS &&
        occ_orig > occ) {
      *why = "twin fits fewer CTAs per SM than the original (auto: short enough to drain)";
      return 0;
    }
  }
  uint64_t total = blocks;
  uint64_t w = twin_ctas(occ, c->sms, total);
  // Save areas: a stop saves at most one record per twin CTA plus the records it forwards, and
  // the records left at any time are at most one per CTA (a CTA takes records before it claims
  // blocks), so 2 W + 64 records per area never run out; if they did, a CTA would not stop
  // inside its block (it finishes it). Two areas: a relaunch resumes from one and saves into the
  // other.
  uint64_t rec_bytes = 0, cap = 0;
  if (mid) {
    rec_bytes = mid_record_bytes(r, threads, shmem);
    cap = 2 * w + 64;
    if (rec_bytes > 0xffffffffu || cap > 0xffffffffu || rec_bytes > cfg.mid_max_bytes / 2 / cap) {
      mid = 0;
      atomic_fetch_add(&st_mid_refused, 1);
      if (one_wave) {  // stopping between blocks only, the one-wave launch would gain nothing
        *why = "one wave, and its mid-block save areas exceed PTXMIG_MID_BLOCK_MAX_MB";
        return 0;
      }
      if (long_blocks && fits && cfg.preempt == PM_AUTO) {
        *why = "grid fits in one wave (auto: its twin could not stop sooner)";
        return 0;
      }
      if (long_blocks) {  // stopping between blocks only: the block twin does that faster
        twin = block_twin, occ = block_occ;
        w = twin_ctas(occ, c->sms, total);
      }
      LOG_ONCE("preemption: a mid-block twin's save areas exceed PTXMIG_MID_BLOCK_MAX_MB; it stops between blocks only");
    }
  }
  // Private copy of the arguments (the app may reuse its buffers once the launch returns).
  tl *x = calloc(1, sizeof *x);
  uint8_t *args = calloc(1, lay->args_size + 8);
  void **argv = calloc((size_t)lay->n + 1, sizeof *argv);
  if (!x || !args || !argv) {
    free(x);
    free(args);
    free(argv);
    *why = "out of memory";
    return 0;
  }
  int ok = 1;
  if (params) {
    for (int i = 0; i < lay->n; i++) {
      if (!params[i]) {
        ok = 0;
        break;
      }
      memcpy(args + lay->off[i], params[i], lay->size[i]);
    }
  } else if (extra) {
    const uint8_t *buf;
    size_t bsz;
    if (!extra_buffer(extra, &buf, &bsz) || bsz < lay->args_size) ok = 0;
    else memcpy(args, buf, lay->args_size);
  } else if (lay->n) {
    ok = 0;
  }
  if (!ok) {
    free(x);
    free(args);
    free(argv);
    *why = "arguments not understood";
    return 0;
  }
  for (int i = 0; i < lay->n; i++) argv[i] = args + lay->off[i];
  argv[lay->n] = &x->ctl;
  x->args = args;
  x->argv = argv;
  x->rec = r;
  x->twin = twin;
  x->cr = c;
  x->sr = sr;
  x->stream = s;
  x->seq = seq;
  memcpy(x->block, b, sizeof x->block);
  x->shmem = shmem;
  x->W = (unsigned)w;
  x->slab = -1;
  x->init.v2.total_blocks = total;
  x->init.v2.grid_x = g[0], x->init.v2.grid_y = g[1], x->init.v2.grid_z = g[2];
  x->init.v2.magic = PTXMIG_CTL_MAGIC;
  x->init.v2.version = PTXMIG_CTL_VERSION;
  x->init.v2.batch_max = batch_max_for(r, (uint64_t)occ * (uint64_t)c->sms);
  if (x->init.v2.batch_max < PTXMIG_BATCH_MIN_DEFAULT) x->init.v2.batch_min = x->init.v2.batch_max;
  pthread_mutex_lock(&pre_mu);
  retire_locked(c, 4);
  int got = ctl_slot(c, &x->ctl, &x->slab, &x->slot) == 0;
  if (got && c->nfree_ev) x->done = c->free_ev[--c->nfree_ev];
  if (got && c->nfree_ev) x->go = c->free_ev[--c->nfree_ev];
  pthread_mutex_unlock(&pre_mu);
  if (got && !x->done && d.ev_create(&x->done, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) x->done = NULL;
  if (got && !x->go && d.ev_create(&x->go, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) x->go = NULL;
  if (!got || !x->done) {
    pthread_mutex_lock(&pre_mu);
    tl_free(x);
    pthread_mutex_unlock(&pre_mu);
    *why = "no control block (device memory)";
    return 0;
  }
  if (mid) {
    size_t need = (size_t)(rec_bytes * cap);
    need = (need + (1u << 20) - 1) & ~(size_t)((1u << 20) - 1);  // MiB granules: areas are reused
    size_t n0 = 0, n1 = 0;
    x->area[0] = area_take(c, need, &n0);
    x->area[1] = x->area[0] ? area_take(c, need, &n1) : 0;
    x->area_n = n0 < n1 ? n0 : n1;
    if (!x->area[1]) {
      pthread_mutex_lock(&pre_mu);
      area_put_locked(c, x->area[0], n0);
      pthread_mutex_unlock(&pre_mu);
      x->area[0] = 0;
      x->area_n = 0;
      mid = 0;
      atomic_fetch_add(&st_mid_refused, 1);
      if (one_wave) {
        pthread_mutex_lock(&pre_mu);
        tl_free(x);
        pthread_mutex_unlock(&pre_mu);
        *why = "one wave, and no device memory for its mid-block save areas";
        return 0;
      }
      if (long_blocks && fits && cfg.preempt == PM_AUTO) {
        pthread_mutex_lock(&pre_mu);
        tl_free(x);
        pthread_mutex_unlock(&pre_mu);
        *why = "grid fits in one wave (auto: its twin could not stop sooner)";
        return 0;
      }
      if (long_blocks) {  // stopping between blocks only: the block twin does that faster
        occ = block_occ;
        w = twin_ctas(occ, c->sms, total);
        x->twin = twin = block_twin;
        x->W = (unsigned)w;
        x->init.v2.batch_max = batch_max_for(r, (uint64_t)occ * (uint64_t)c->sms);
        x->init.v2.batch_min = x->init.v2.batch_max < PTXMIG_BATCH_MIN_DEFAULT ? x->init.v2.batch_max : 0;
      }
      LOG_ONCE("preemption: no device memory for a mid-block twin's save areas; it stops between blocks only");
    } else {
      // An area taken from the pool may be larger than this launch needs: its capacity is what it holds.
      uint64_t held = x->area_n / rec_bytes;
      if (held > 0xffffffffu) held = 0xffffffffu;
      x->mid = 1;
      x->init.v2.version = PTXMIG_CTL_VERSION_MID_BLOCK;
      x->init.save_area = x->area[0];
      x->init.record_bytes = (uint32_t)rec_bytes;
      x->init.save_capacity = (uint32_t)held;
    }
  }
  if (cfg.debug)
    shim_log("preemption: twin of %s: %llu blocks on %u CTAs (%d a SM), batch_max %u%s", kname(r),
             (unsigned long long)total, x->W, occ, x->init.v2.batch_max, x->mid ? ", mid-block" : "");
  if (x->go && d.ev_record(x->go, s) != CUDA_SUCCESS) {  // optional: without it, holding cannot tell
    pthread_mutex_lock(&pre_mu);
    if (c->nfree_ev < 64) c->free_ev[c->nfree_ev++] = x->go;
    pthread_mutex_unlock(&pre_mu);
    x->go = NULL;
  }
  CUresult rr = d.htod_async(x->ctl, &x->init, x->mid ? sizeof x->init : sizeof x->init.v2, s);
  if (rr == CUDA_SUCCESS) {
    if (ex && lef) {
      CUlaunchConfig c2 = *ex;
      c2.gridDimX = x->W, c2.gridDimY = 1, c2.gridDimZ = 1;
      rr = lef(&c2, twin, argv, NULL);
    } else {
      rr = lf(twin, x->W, 1, 1, b[0], b[1], b[2], shmem, s, argv, NULL);
    }
  }
  if (rr == CUDA_SUCCESS) rr = d.ev_record(x->done, s);
  if (rr != CUDA_SUCCESS) {
    // The twin could not be launched: the original is launched instead (and reports its error).
    atomic_fetch_add(&r->twin_fallbacks, 1);
    LOG_ONCE("preemption: a twin launch failed (%d); launching the original", (int)rr);
    pthread_mutex_lock(&pre_mu);
    tl_free(x);
    pthread_mutex_unlock(&pre_mu);
    *why = "twin launch failed";
    return 0;
  }
  atomic_store(&twins_ever, 1);
  pthread_mutex_lock(&pre_mu);
  x->id = next_launch_id++;
  x->state = TL_RUNNING;
  x->next = live;
  live = x;
  nlive++;
  pthread_mutex_unlock(&pre_mu);
  atomic_fetch_add(&r->twin_launches, 1);
  atomic_fetch_add(&st_twin_launches, 1);
  if (x->mid) {
    atomic_fetch_add(&r->mid_launches, 1);
    atomic_fetch_add(&st_mid_launches, 1);
  }
  t->twin = 1;
  *res = CUDA_SUCCESS;
  return 1;
}

// ---- honest synchronisation ----
void scope_stream(sync_scope *sc, CUstream s, int ptsz) {
  sc->c = sc->s = NULL;
  if (!atomic_load(&twins_ever)) return;
  if (is_legacy(s, ptsz) || is_ptds(s, ptsz)) sc->c = crec_cur();
  else sc->s = srec_find(s);
}
void scope_ctx(sync_scope *sc) {
  sc->c = sc->s = NULL;
  if (atomic_load(&twins_ever)) sc->c = crec_cur();
}
static int pending_locked(const sync_scope *sc) {
  return sc->s ? ((srec *)sc->s)->npending : sc->c ? ((crec *)sc->c)->npending : 0;
}
static uint64_t pgen_locked(const sync_scope *sc) {
  return sc->s ? ((srec *)sc->s)->pgen : sc->c ? ((crec *)sc->c)->pgen : 0;
}
int honest_pending(const sync_scope *sc) {
  if (!sc->c && !sc->s) return 0;
  pthread_mutex_lock(&pre_mu);
  int p = pending_locked(sc);
  pthread_mutex_unlock(&pre_mu);
  return p;
}
void honest_wait(const sync_scope *sc, uint64_t *g) {
  *g = atomic_load(&pgen);
  if (!sc->c && !sc->s) return;
  pthread_mutex_lock(&pre_mu);
  while (pending_locked(sc)) pthread_cond_wait(&pre_cv, &pre_mu);
  *g = atomic_load(&pgen);
  pthread_mutex_unlock(&pre_mu);
}
int honest_again(const sync_scope *sc, uint64_t g) {
  if ((!sc->c && !sc->s) || atomic_load(&pgen) == g) return 0;
  pthread_mutex_lock(&pre_mu);
  int again = pgen_locked(sc) > g;
  pthread_mutex_unlock(&pre_mu);
  return again;
}

// ---- holding submissions behind a twin (deferral) ----
// A submission that would queue behind a twin still in flight waits here, before the gate, until
// that twin has finished; a preempted twin counts as finished only once its remainder has run. So
// a twin is the last work of its stream when a quiesce comes and can be preempted instead of
// drained, and no later work (a copy, an event, a host function, another launch) can run before
// it: the thread that submits it is held instead, in the shim, not in the driver. "Behind" follows
// CUDA's ordering: the same stream; the legacy stream behind every blocking stream of its context
// and every blocking stream (the per-thread default stream included) behind the legacy stream.
// The tail rule stays as the fallback for a submission that races a twin's launch from another
// thread. PTXMIG_PREEMPT_HOLD=0 turns holding off (tail rule only).
static int behind(const tl *t, const crec *c, const srec *sr, int legacy, int blocking) {
  if (t->cr != c) return 0;
  if (sr && t->sr == sr) return 1;
  if (legacy) return !t->sr || !t->sr->nonblocking;
  return blocking && !t->sr;
}
// tl_live finds the launch with this id among those still listed (pre_mu held).
static tl *tl_live(uint64_t id) {
  tl *t = live;
  while (t && t->id != id) t = t->next;
  return t;
}

#define HOLD_START_NS 50000000ull
void sub_hold(CUstream s, int ptsz) {
  if (sub_depth || !cfg.preempt_hold || !atomic_load(&twins_ever) || !atomic_load(&nlive)) return;
  // While a stream capture is open, waiting on an event can be an error that invalidates the
  // capture (global capture mode): no holding then (the tail rule still applies).
  if (trk_capture_open()) return;
  int legacy = is_legacy(s, ptsz), blocking = 1;
  srec *sr = NULL;
  crec *c;
  if (legacy || is_ptds(s, ptsz)) {
    c = crec_cur();
  } else {
    sr = srec_get(s);
    c = sr ? sr->cr : crec_cur();
    if (sr) blocking = !sr->nonblocking;
  }
  if (!c) return;
  uint64_t t0 = 0;
  pthread_mutex_lock(&pre_mu);
  for (;;) {
    // Quiesced or detached, the driver lock may be held: no driver call here (least of all under
    // pre_mu, which detach needs); the thread waits for the resume, as it would at the gate.
    while (atomic_load(&gate_closed)) pthread_cond_wait(&pre_cv, &pre_mu);
    retire_locked(c, 64);
    tl *w = NULL;
    int pending = 0;
    for (tl *t = live; t; t = t->next) {
      if (t->state == TL_DONE || !behind(t, c, sr, legacy, blocking)) continue;
      if (t->state != TL_RUNNING) pending = 1;  // preempted or stopping: its remainder runs after the resume
      else if (t->go && !t->nohold) w = t;       // else: not held (no start event, or a hold gave up on it)
      break;
    }
    if (!w && !pending) break;
    if (!t0) t0 = shim_now_ns(), atomic_fetch_add(&st_holds, 1);
    if (pending) {
      pthread_cond_wait(&pre_cv, &pre_mu);
      continue;
    }
    uint64_t id = w->id;
    CUevent ev = w->started ? w->done : w->go;
    int started = w->started;
    pthread_mutex_unlock(&pre_mu);
    // Poll, never block: the events are pooled and may serve another launch once this one
    // retires, so the launch is looked up again by id between polls. A twin still queued behind
    // other work of its stream after HOLD_START_NS may wait for something only this thread would
    // do next (a host function, a stream wait on a value the app writes later): holding could
    // deadlock, so the submission goes ahead and later ones are not held behind it (the twin is
    // then no longer its stream's tail: a quiesce drains it). A twin at the head of its stream
    // runs on the GPU alone and ends.
    uint64_t since = shim_now_ns();
    unsigned nap = 20;
    CUresult q;
    while ((q = d.ev_query(ev)) == CUDA_ERROR_NOT_READY && !atomic_load(&gate_closed) &&
           (started || shim_now_ns() - since < HOLD_START_NS)) {
      nap_us(nap);
      if (nap < 1000) nap *= 2;
      pthread_mutex_lock(&pre_mu);
      tl *t = tl_live(id);
      int same = t && t->state == TL_RUNNING;
      pthread_mutex_unlock(&pre_mu);
      if (!same) break;
    }
    pthread_mutex_lock(&pre_mu);
    tl *t = started ? NULL : tl_live(id);
    if (t && q == CUDA_ERROR_NOT_READY && !atomic_load(&gate_closed)) {
      if (t->state == TL_RUNNING && shim_now_ns() - since >= HOLD_START_NS) {
        t->nohold = 1;
        atomic_fetch_add(&st_hold_gaveup, 1);
        break;
      }
    } else if (t && q != CUDA_ERROR_NOT_READY) {
      t->started = 1;
    }
  }
  pthread_mutex_unlock(&pre_mu);
  if (t0) atomic_fetch_add(&st_hold_ns, shim_now_ns() - t0);
}

void preempt_wait_clean(void) {
  if (!atomic_load(&twins_ever)) return;
  sync_scope sc;
  uint64_t g;
  scope_ctx(&sc);
  honest_wait(&sc, &g);
}

// ---- quiesce / detach / resume ----
enum { P_RUNNING, P_QUIESCED, P_DETACHED };
static const char *const pstate_names[] = {"running", "quiesced", "detached"};
static int pstate;       // pre_mu
static char *last_reply;  // pre_mu: the last quiesce's result object

static void jb_stream(jbuf *b, CUstream s) { jb_printf(b, "\"0x%llx\"", (unsigned long long)(uintptr_t)s); }

static int is_tail(const tl *t) {
  uint64_t q = t->seq;
  if (!q) return 0;
  if (!t->sr) return atomic_load(&t->cr->legacy_last) == q && atomic_load(&t->cr->blocking_last) < q;
  return atomic_load(&t->sr->last) == q && (t->sr->nonblocking || atomic_load(&t->cr->legacy_last) < q);
}

static CUstream side_stream(crec *c) {  // ctx pushed
  if (!c->side && d.stream_create(&c->side, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) c->side = NULL;
  return c->side;
}

static void pending_clear_locked(tl *t) {
  if (!t->raised) return;
  t->raised = 0;
  if (t->sr) t->sr->npending--;
  t->cr->npending--;
}

static void report_originals(jbuf *b) {
  int first = 1;
  jb_s(b, "[");
  for (int i = 0; i < MAX_CRECS; i++) {
    crec *c = atomic_load(&crecs[i]);
    if (!c) break;
    if (d.ctx_push(c->ctx) != CUDA_SUCCESS) continue;
    krec *r = atomic_load(&c->orig);
    if (r && d.stream_query(NULL) == CUDA_ERROR_NOT_READY) {
      const char *w = atomic_load(&c->orig_why);
      jb_printf(b, "%s{\"kernel\":", first ? "" : ",");
      first = 0;
      const char *n = kname(r);
      jb_str(b, n, strlen(n));
      jb_s(b, ",\"stream\":\"legacy\",\"reason\":");
      jb_str(b, w ? w : "original", strlen(w ? w : "original"));
      jb_s(b, "}");
    }
    for (size_t j = 0; j < STAB; j++) {
      srec *s = atomic_load(&stab[j]);
      if (!s || s->cr != c || !(r = atomic_load(&s->orig))) continue;
      if (d.stream_query(s->s) != CUDA_ERROR_NOT_READY) continue;
      const char *w = atomic_load(&s->orig_why);
      jb_printf(b, "%s{\"kernel\":", first ? "" : ",");
      first = 0;
      const char *n = kname(r);
      jb_str(b, n, strlen(n));
      jb_s(b, ",\"stream\":");
      jb_stream(b, s->s);
      jb_s(b, ",\"reason\":");
      jb_str(b, w ? w : "original", strlen(w ? w : "original"));
      jb_s(b, "}");
    }
    CUcontext x;
    d.ctx_pop(&x);
  }
  jb_s(b, "]");
}

// classify_locked: a raised twin that ended, its control block read back into t->seen. No block
// left: it is done (it finished before it saw the flag) and nothing waits for it any more;
// otherwise it is preempted and its remainder is relaunched by resume. Returns 1 when preempted.
static int classify_locked(tl *t) {
  // A mid-block twin with records pending has claimed every block (next_block is past the end)
  // without finishing them: it is done only when every block is.
  uint64_t done = t->mid ? t->seen.v2.blocks_done : t->seen.v2.next_block;
  if (t->seen.v2.magic == PTXMIG_CTL_MAGIC && done >= t->seen.v2.total_blocks) {
    pending_clear_locked(t);
    t->state = TL_DONE;
    return 0;
  }
  t->state = TL_PREEMPTED;
  t->records = 0;
  if (t->mid && t->seen.v2.magic == PTXMIG_CTL_MAGIC) {
    t->records = t->seen.saved < t->seen.save_capacity ? t->seen.saved : t->seen.save_capacity;
    if (t->records) {
      atomic_fetch_add(&t->rec->mid_stops, 1);
      atomic_fetch_add(&st_mid_stops, 1);
    }
  }
  atomic_fetch_add(&st_preempted, 1);
  return 1;
}

// read_back copies a stopped twin's control block (ctx pushed; on the side stream, which waits
// for nothing but the raises).
static void read_back(CUstream side, CUdeviceptr ctl, int mid, struct ptxmig_ctl_v3 *seen) {
  size_t n = mid ? sizeof *seen : sizeof seen->v2;
  memset(seen, 0, sizeof *seen);
  if (!side || d.dtoh_async(seen, ctl, n, side) != CUDA_SUCCESS || d.stream_sync(side) != CUDA_SUCCESS)
    memset(seen, 0, sizeof *seen);
}

// ---- the raiser: twins still stopping when a quiesce replied ----
// A raised twin that has not ended by the budget keeps its flag raised (every RERAISE_NS, since
// a raise can be overwritten by a preempt = 0 write still queued ahead of the twin on its stream)
// and is watched until it ends; then its control block is read back and it is classified like
// the ones that stopped within the budget. The thread never holds pre_mu during a driver call
// (a driver call can block for the whole time of a checkpoint lock).
#define RERAISE_NS 500000ull
static pthread_cond_t raiser_cv = PTHREAD_COND_INITIALIZER;
static int raiser_started, raiser_busy, nstopping;  // pre_mu
#define RAISE_BATCH 64
static void *raiser_main(void *arg) {
  (void)arg;
  struct {
    tl *t;
    uint64_t id;
    CUcontext ctx;
    CUstream side;
    CUdeviceptr ctl;
    CUevent done;
    int ended;
    int mid;
    struct ptxmig_ctl_v3 seen;
  } *j = calloc(RAISE_BATCH, sizeof *j);
  uint64_t last_raise = 0;
  pthread_mutex_lock(&pre_mu);
  for (;;) {
    while (!nstopping || !j) {
      raiser_busy = 0;
      pthread_cond_broadcast(&pre_cv);
      pthread_cond_wait(&raiser_cv, &pre_mu);
    }
    raiser_busy = 1;
    int n = 0;
    for (tl *t = live; t && n < RAISE_BATCH; t = t->next)
      if (t->stopping) {
        j[n].t = t, j[n].id = t->id, j[n].ctx = t->cr->ctx, j[n].side = t->cr->side, j[n].ctl = t->ctl;
        j[n].done = t->done, j[n].ended = 0, j[n].mid = t->mid;
        n++;
      }
    pthread_mutex_unlock(&pre_mu);
    int raise_now = shim_now_ns() - last_raise >= RERAISE_NS, nended = 0;
    for (int i = 0; i < n; i++) {
      if (d.ctx_push(j[i].ctx) != CUDA_SUCCESS) {
        j[i].ended = 1;  // its context is gone
        memset(&j[i].seen, 0, sizeof j[i].seen);
        nended++;
        continue;
      }
      if (raise_now && (!j[i].side || d.memset32_async(j[i].ctl + PTXMIG_CTL_OFF_PREEMPT, 1, 1, j[i].side) != CUDA_SUCCESS))
        LOG_ONCE("preemption: raising a preempt flag after the budget failed");
      if (d.ev_query(j[i].done) != CUDA_ERROR_NOT_READY) {
        j[i].ended = 1;
        read_back(j[i].side, j[i].ctl, j[i].mid, &j[i].seen);
        nended++;
      }
      CUcontext x;
      d.ctx_pop(&x);
    }
    if (raise_now) last_raise = shim_now_ns();
    pthread_mutex_lock(&pre_mu);
    for (int i = 0; i < n && nended; i++) {
      if (!j[i].ended) continue;
      for (tl *t = live; t; t = t->next) {
        if (t != j[i].t || t->id != j[i].id || !t->stopping) continue;
        t->stopping = 0;
        nstopping--;
        t->ended = 1;
        t->seen = j[i].seen;
        int p = classify_locked(t);
        if (cfg.debug)
          shim_log("preemption: launch %llu ended after the budget: %s (%llu of %llu blocks done)",
                   (unsigned long long)t->id, p ? "preempted" : "done", (unsigned long long)t->seen.v2.blocks_done,
                   (unsigned long long)t->seen.v2.total_blocks);
        break;
      }
    }
    if (nended) pthread_cond_broadcast(&pre_cv);  // pending cleared (done), or resume waits for the end
    if (nstopping && !nended) {
      pthread_mutex_unlock(&pre_mu);
      nap_us(100);
      pthread_mutex_lock(&pre_mu);
    }
  }
  return NULL;
}

// raiser_kick hands the stopping twins to the raiser thread (started once); pre_mu held. Returns
// 0 when the thread cannot be started (the twins then stay raised, and resume relaunches each
// behind its still running launch).
static int raiser_kick(void) {
  if (!raiser_started) {
    pthread_attr_t at;
    pthread_t th;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    raiser_started = pthread_create(&th, &at, raiser_main, NULL) == 0;
    pthread_attr_destroy(&at);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!raiser_started) {
      LOG_ONCE("preemption: cannot start the raiser thread; twins still stopping are not watched");
      return 0;
    }
  }
  pthread_cond_signal(&raiser_cv);
  return 1;
}

int preempt_quiesce(jbuf *b, unsigned budget_ms) {
  uint64_t t0 = shim_now_ns(), deadline = t0 + (uint64_t)budget_ms * 1000000ull;
  d_ready();
  pthread_mutex_lock(&pre_mu);
  if (pstate != P_RUNNING) {
    jb_s(b, last_reply ? last_reply : "{}");
    pthread_mutex_unlock(&pre_mu);
    return 0;
  }
  atomic_store(&gate_closed, 1);
  pstate = P_QUIESCED;
  pthread_mutex_unlock(&pre_mu);
  trk_peer_hold(1);  // new peer links wait for the resume (the reply counts the ones on)
  atomic_fetch_add(&st_quiesces, 1);
  // Calls past the gate finish their submission first: their sequence numbers are then final.
  while (inflight_total() > 0 && shim_now_ns() < deadline) nap_us(20);
  int racing = inflight_total() > 0;
  tl *raise[256];
  int nraise = 0;
  pthread_mutex_lock(&pre_mu);
  for (tl *t = live; t; t = t->next) {
    t->drain = t->ended = 0;
    if (t->state != TL_RUNNING) continue;
    // Launches that already finished (not yet retired) are neither preempted nor drained.
    int pushed = d.ctx_push(t->cr->ctx) == CUDA_SUCCESS;
    CUresult q = pushed ? d.ev_query(t->done) : CUDA_ERROR_NOT_READY;
    if (pushed) {
      CUcontext x;
      d.ctx_pop(&x);
    }
    if (q == CUDA_SUCCESS) {
      t->state = TL_DONE;
      continue;
    }
    if (cfg.debug)
      shim_log("quiesce: launch %llu seq %llu stream %p: stream last %llu legacy %llu blocking %llu racing %d",
               (unsigned long long)t->id, (unsigned long long)t->seq, (void *)t->stream,
               (unsigned long long)(t->sr ? atomic_load(&t->sr->last) : 0),
               (unsigned long long)atomic_load(&t->cr->legacy_last), (unsigned long long)atomic_load(&t->cr->blocking_last),
               racing);
    if (!racing && nraise < 256 && is_tail(t)) {
      uint64_t gg = atomic_fetch_add(&pgen, 1) + 1;
      t->raised = 1;
      t->state = TL_PREEMPTING;
      t->cr->pgen = gg;
      t->cr->npending++;
      if (t->sr) {
        t->sr->pgen = gg;
        t->sr->npending++;
      }
      raise[nraise++] = t;
    } else {
      t->drain = 1;
    }
  }
  pthread_mutex_unlock(&pre_mu);
  // Raise the flags. Launches stay listed meanwhile: retire skips non-running ones, and app threads
  // are held at the gate. A twin still queued behind other work of its stream has its control
  // block initialised (preempt = 0) on that stream just before it starts, after a raise made
  // now: the flag is raised again every RERAISE_NS until the twin ends, so it also stops.
  uint64_t last_raise = 0;
  for (;;) {
    if (shim_now_ns() - last_raise >= RERAISE_NS) {
      for (int i = 0; i < nraise; i++) {
        tl *t = raise[i];
        if (t->ended || d.ctx_push(t->cr->ctx) != CUDA_SUCCESS) continue;
        CUstream side = side_stream(t->cr);
        if (!side || d.memset32_async(t->ctl + PTXMIG_CTL_OFF_PREEMPT, 1, 1, side) != CUDA_SUCCESS)
          LOG_ONCE("preemption: raising a preempt flag failed");
        CUcontext x;
        d.ctx_pop(&x);
      }
      last_raise = shim_now_ns();
    }
    // Wait for the raised twins to stop and the others to finish, within the budget.
    int left = 0;
    pthread_mutex_lock(&pre_mu);
    for (tl *t = live; t; t = t->next) {
      if (t->ended || !(t->raised || t->drain)) continue;
      int pushed = d.ctx_push(t->cr->ctx) == CUDA_SUCCESS;
      if (d.ev_query(t->done) != CUDA_ERROR_NOT_READY) t->ended = 1;
      else left++;
      if (pushed) {
        CUcontext x;
        d.ctx_pop(&x);
      }
    }
    pthread_mutex_unlock(&pre_mu);
    if (!left || shim_now_ns() >= deadline) break;
    nap_us(20);
  }
  // Read back the stopped twins' control blocks (on the side stream: it waits for nothing else).
  for (int i = 0; i < nraise; i++) {
    tl *t = raise[i];
    if (!t->ended || d.ctx_push(t->cr->ctx) != CUDA_SUCCESS) continue;
    read_back(side_stream(t->cr), t->ctl, t->mid, &t->seen);
    CUcontext x;
    d.ctx_pop(&x);
  }
  jbuf r = {0};
  // peer_links: the links on in the driver; ptxmig turns them off (peer-off) before the driver lock
  // when there are any (from now on the app's new ones wait for the resume: track.c).
  jb_printf(&r, "{\"state\":\"quiesced\",\"gate\":\"closed\",\"elapsed_us\":%llu,\"budget_ms\":%u,\"peer_links\":%ld,\"preempted\":[",
            (unsigned long long)((shim_now_ns() - t0) / 1000), budget_ms, trk_peer_applied());
  int fp = 1, fd = 1, fn = 1, fs = 1;
  jbuf drained = {0}, notst = {0}, stopping = {0};
  pthread_mutex_lock(&pre_mu);
  for (tl *t = live; t; t = t->next) {
    const char *n = kname(t->rec);
    if (t->raised && t->ended && !classify_locked(t)) {  // it finished before it saw the flag
      jb_printf(&drained, "%s{\"launch\":%llu,\"kernel\":", fd ? "" : ",", (unsigned long long)t->id);
      jb_str(&drained, n, strlen(n));
      jb_s(&drained, "}");
      fd = 0;
    } else if (t->raised && t->ended) {
      uint64_t tot = t->seen.v2.magic == PTXMIG_CTL_MAGIC ? t->seen.v2.total_blocks : t->init.v2.total_blocks;
      jb_printf(&r, "%s{\"launch\":%llu,\"kernel\":", fp ? "" : ",", (unsigned long long)t->id);
      jb_str(&r, n, strlen(n));
      jb_s(&r, ",\"stream\":");
      jb_stream(&r, t->stream);
      jb_printf(&r, ",\"blocks_done\":%llu,\"blocks_total\":%llu,\"batch_max\":%u,\"mid_block\":%s,\"stop\":\"%s\",\"records\":%u}",
                (unsigned long long)t->seen.v2.blocks_done, (unsigned long long)tot, t->init.v2.batch_max,
                t->mid ? "true" : "false", t->records ? "mid-block" : "block boundary", t->records);
      fp = 0;
    } else if (t->drain && t->ended) {
      t->state = TL_DONE;
      jb_printf(&drained, "%s{\"launch\":%llu,\"kernel\":", fd ? "" : ",", (unsigned long long)t->id);
      jb_str(&drained, n, strlen(n));
      jb_s(&drained, "}");
      fd = 0;
    } else if (t->raised || t->drain) {
      jb_printf(&notst, "%s{\"launch\":%llu,\"kernel\":", fn ? "" : ",", (unsigned long long)t->id);
      jb_str(&notst, n, strlen(n));
      jb_s(&notst, ",\"stream\":");
      jb_stream(&notst, t->stream);
      const char *why = t->raised ? "still running after the budget"
                        : racing  ? "a submission was in progress"
                                  : "not the tail of its stream";
      jb_s(&notst, ",\"reason\":");
      jb_str(&notst, why, strlen(why));
      if (t->raised) {
        // Its flag stays raised: the raiser watches it until it ends, then it is preempted (or
        // done). Until then the driver lock waits for it.
        t->stopping = 1;
        nstopping++;
        jb_printf(&notst, ",\"stopping\":true,\"batch_max\":%u", t->init.v2.batch_max);
        jb_printf(&stopping, "%s%llu", fs ? "" : ",", (unsigned long long)t->id);
        fs = 0;
      }
      jb_s(&notst, "}");
      fn = 0;
    }
  }
  if (nstopping) raiser_kick();
  pthread_cond_broadcast(&pre_cv);
  pthread_mutex_unlock(&pre_mu);
  jb_s(&r, "],\"drained\":[");
  if (drained.p) jb_s(&r, drained.p);
  jb_s(&r, "],\"not_stopped\":[");
  if (notst.p) jb_s(&r, notst.p);
  jb_s(&r, "],\"stopping\":[");
  if (stopping.p) jb_s(&r, stopping.p);
  jb_s(&r, "],\"originals\":");
  report_originals(&r);
  jb_s(&r, "}");
  free(drained.p);
  free(notst.p);
  int soom = stopping.oom;
  free(stopping.p);
  if (r.oom || drained.oom || notst.oom || soom) {
    free(r.p);
    r = (jbuf){0};
    jb_s(&r, "{\"state\":\"quiesced\",\"gate\":\"closed\",\"error\":\"out of memory building the reply\"}");
  }
  pthread_mutex_lock(&pre_mu);
  free(last_reply);
  last_reply = r.p ? strdup(r.p) : NULL;
  pthread_mutex_unlock(&pre_mu);
  jb_s(b, r.p ? r.p : "{}");
  free(r.p);
  return 1;
}

int preempt_detach(jbuf *b) {
  pthread_mutex_lock(&pre_mu);
  int ok = pstate == P_QUIESCED;
  if (ok) pstate = P_DETACHED;
  pthread_mutex_unlock(&pre_mu);
  if (ok) jb_s(b, "{\"state\":\"detached\",\"detached\":true}");
  return ok ? 0 : -1;
}

int preempt_state(void) {
  pthread_mutex_lock(&pre_mu);
  int s = pstate;
  pthread_mutex_unlock(&pre_mu);
  return s;
}

// mid_swap readies a stopped mid-block twin's control block for its relaunch (its context pushed):
// the next launch resumes the records this stop saved, from that area, and saves into the other
// one (docs/PTXSTATE.md, "Host protocol between launches"). The control block is read again here,
// on the launch's own stream (the twin ended; nothing of the app is queued behind it): after a
// driver restore or a rollback it is what the device holds. A twin still stopping is waited for
// (it stops at its next site vote).
static CUresult mid_swap(tl *t) {
  CUresult rr = CUDA_SUCCESS;
  if (d.ev_query(t->done) == CUDA_ERROR_NOT_READY) rr = d.ev_sync(t->done);
  struct ptxmig_ctl_v3 now;
  memset(&now, 0, sizeof now);
  if (rr == CUDA_SUCCESS) rr = d.dtoh_async(&now, t->ctl, sizeof now, t->stream);
  if (rr == CUDA_SUCCESS) rr = d.stream_sync(t->stream);
  if (rr != CUDA_SUCCESS) return rr;
  // Everything read from the device is checked before it steers a launch.
  if (now.v2.magic != PTXMIG_CTL_MAGIC || now.v2.version != PTXMIG_CTL_VERSION_MID_BLOCK ||
      (now.save_area != t->area[0] && now.save_area != t->area[1]) || now.save_capacity != t->init.save_capacity ||
      now.record_bytes != t->init.record_bytes) {
    shim_log("preemption: %s: its control block changed under it (magic %x, save area %llx); not relaunched",
             kname(t->rec), now.v2.magic, (unsigned long long)now.save_area);
    return CUDA_ERROR_INVALID_VALUE;
  }
  uint32_t n = now.saved < now.save_capacity ? now.saved : now.save_capacity;
  t->init.resume_area = now.save_area;
  t->init.resume_count = n;
  t->init.resume_cursor = 0;
  t->init.saved = 0;
  t->init.save_area = now.save_area == t->area[0] ? t->area[1] : t->area[0];
  t->init.force_visit = 0;
  return d.htod_async(t->ctl + PTXMIG_CTL_OFF_SAVE_AREA, &t->init.save_area,
                      PTXMIG_CTL_SIZE_V3 - PTXMIG_CTL_OFF_SAVE_AREA, t->stream);
}

static int cmp_seq(const void *a, const void *b) {
  const tl *x = *(tl *const *)a, *y = *(tl *const *)b;
  return (x->seq > y->seq) - (x->seq < y->seq);
}

// ---- collective alignment ----
// A job's ranks locked one by one as they run can deadlock: a rank's collective kernel waits for
// its peers' kernels of the same collective, and one peer is already locked. ptxmig asks every
// rank for its count of collective launches, then arms each to close its gate right after launch
// number `at` (the highest count + 1): every rank launches that collective, whose kernels then
// all end, and submits nothing after it. The count and the hold are process-wide.
static atomic_ullong coll_count, coll_at;  // launches seen; armed at (0: not armed)
static atomic_int coll_held;               // the gate is closed by the alignment

void preempt_collective_launched(void) {
  unsigned long long n = atomic_fetch_add(&coll_count, 1) + 1, at = atomic_load(&coll_at);
  if (!at || n != at) return;
  pthread_mutex_lock(&pre_mu);
  // Re-read under the lock: an "align" that found this launch's count past `at` disarmed.
  if (atomic_load(&coll_at) == at && pstate == P_RUNNING) {
    atomic_store(&coll_held, 1);
    atomic_store(&gate_closed, 1);  // this thread's next submission waits here, with every other's
  }
  pthread_mutex_unlock(&pre_mu);
}

// align_release_locked disarms and reopens a gate the alignment closed (pre_mu held).
static void align_release_locked(void) {
  atomic_store(&coll_at, 0);
  if (atomic_exchange(&coll_held, 0) && pstate == P_RUNNING) {
    atomic_store(&gate_closed, 0);
    pthread_cond_broadcast(&pre_cv);
  }
}

int preempt_align(jbuf *b, unsigned long long at, char *err, size_t errlen) {
  pthread_mutex_lock(&pre_mu);
  const char *state;
  int armed = 0;
  if (at == 0) {
    align_release_locked();
    state = "running";
  } else if (pstate != P_RUNNING) {
    pthread_mutex_unlock(&pre_mu);
    snprintf(err, errlen, "align: not running (%s)", pstate_names[pstate]);
    return -1;
  } else if (atomic_load(&coll_held)) {
    state = atomic_load(&coll_at) == at ? "held" : "passed";  // held after another collective
  } else {
    // Armed first, then the count read: a launch that reaches `at` in between holds (and waits
    // for this lock), one that passed it before is seen here and the arming is undone.
    atomic_store(&coll_at, at);
    if (atomic_load(&coll_count) >= at) {
      atomic_store(&coll_at, 0);
      state = "passed";
    } else {
      state = "armed";
      armed = 1;
    }
  }
  unsigned long long n = atomic_load(&coll_count);
  pthread_mutex_unlock(&pre_mu);
  jb_printf(b, "{\"state\":\"%s\",\"collectives\":%llu,\"at\":%llu}", state, n, at);
  return armed;
}

void preempt_collectives_report(jbuf *b) {
  jb_printf(b, "{\"count\":%llu,\"hold_at\":%llu,\"held\":%s}", (unsigned long long)atomic_load(&coll_count),
            (unsigned long long)atomic_load(&coll_at), atomic_load(&coll_held) ? "true" : "false");
}

void preempt_resume(jbuf *b) {
  uint64_t t0 = shim_now_ns();
  d_ready();
  pthread_mutex_lock(&pre_mu);
  int was = pstate;
  align_release_locked();  // a resume ends any alignment (held or armed)
  if (was == P_RUNNING) {
    pthread_mutex_unlock(&pre_mu);
    jb_s(b, "{\"state\":\"running\",\"was\":\"running\",\"relaunched\":0,\"errors\":[],\"elapsed_us\":0}");
    return;
  }
  // Twins still stopping: let them end first (the raiser keeps raising; a twin stops within about
  // two batches), so that no relaunch queues behind a launch that is still stopping (a later
  // quiesce's raises could land before that relaunch's preempt = 0). One that does not end in
  // RESUME_WAIT_NS is relaunched behind its launch: its flag is raised, so it stops first.
#define RESUME_WAIT_NS 2000000000ull
  int still = 0;
  if (nstopping) {
    uint64_t until = shim_now_ns() + RESUME_WAIT_NS;
    while (nstopping && raiser_started && shim_now_ns() < until) {
      pthread_mutex_unlock(&pre_mu);
      nap_us(200);
      pthread_mutex_lock(&pre_mu);
    }
    still = nstopping;
    for (tl *t = live; t; t = t->next) t->stopping = 0;
    nstopping = 0;
    // The raiser may be between its snapshot and its raises: wait for its round to end.
    uint64_t until2 = shim_now_ns() + RESUME_WAIT_NS;
    while (raiser_busy && shim_now_ns() < until2) {
      pthread_mutex_unlock(&pre_mu);
      nap_us(100);
      pthread_mutex_lock(&pre_mu);
    }
    if (still) shim_log("preemption: resume: %d twin(s) still stopping; relaunched behind their launch", still);
  }
  tl **todo = nlive ? calloc((size_t)nlive, sizeof *todo) : NULL;
  CUcontext sides_ctx[MAX_CRECS];
  CUstream sides[MAX_CRECS];
  int n = 0, nsides = 0;
  for (tl *t = live; t && todo; t = t->next)
    if (t->raised) todo[n++] = t;
  for (int i = 0; i < MAX_CRECS && n; i++) {
    crec *c = atomic_load(&crecs[i]);
    if (!c) break;
    if (c->side) sides_ctx[nsides] = c->ctx, sides[nsides++] = c->side;
  }
  pthread_mutex_unlock(&pre_mu);
  // Every raise has landed before any relaunch's preempt = 0 is queued. Then the side streams are
  // dropped: after a driver checkpoint and restore (--leave-running, a rollback, a restored process)
  // the raise written on the old side stream never reached the twin on an H100 (driver 580: the
  // channel was gone, NVRM "STOP_CHANNEL ... object not found", then Xid 109 at the lock). The next
  // quiesce creates a fresh one.
  for (int i = 0; i < nsides; i++) {
    if (d.ctx_push(sides_ctx[i]) != CUDA_SUCCESS) continue;
    d.stream_sync(sides[i]);
    CUcontext x;
    d.ctx_pop(&x);
  }
  nsides = 0;
  pthread_mutex_lock(&pre_mu);
  for (int i = 0; i < MAX_CRECS; i++) {
    crec *c = atomic_load(&crecs[i]);
    if (!c) break;
    if (c->side) sides_ctx[nsides] = c->ctx, sides[nsides++] = c->side;
    c->side = NULL;
  }
  pthread_mutex_unlock(&pre_mu);
  for (int i = 0; i < nsides && d.stream_destroy; i++) {  // driver calls outside pre_mu
    if (d.ctx_push(sides_ctx[i]) != CUDA_SUCCESS) continue;
    d.stream_destroy(sides[i]);  // an error here (a channel already gone) changes nothing
    CUcontext x;
    d.ctx_pop(&x);
  }
  if (n > 1) qsort(todo, (size_t)n, sizeof *todo, cmp_seq);
  int relaunched = 0;
  jbuf errs = {0};
  // The gate stays closed meanwhile: each remainder is ahead of anything the app submits next.
  for (int i = 0; i < n; i++) {
    tl *t = todo[i];
    CUresult rr = d.ctx_push(t->cr->ctx);
    if (rr == CUDA_SUCCESS) {
      // The start event again, for sub_hold: the remainder is queued at its stream's head.
      t->started = t->nohold = 0;
      if (t->mid) rr = mid_swap(t);
      if (rr == CUDA_SUCCESS && t->go && d.ev_record(t->go, t->stream) != CUDA_SUCCESS) t->nohold = 1;
      if (rr == CUDA_SUCCESS) rr = d.memset32_async(t->ctl + PTXMIG_CTL_OFF_PREEMPT, 0, 1, t->stream);
      if (rr == CUDA_SUCCESS)
        rr = d.launch(t->twin, t->W, 1, 1, t->block[0], t->block[1], t->block[2], t->shmem, t->stream, t->argv, NULL);
      if (rr == CUDA_SUCCESS) rr = d.ev_record(t->done, t->stream);
      CUcontext x;
      d.ctx_pop(&x);
    }
    if (rr == CUDA_SUCCESS) {
      relaunched++;
      t->relaunches++;
      atomic_fetch_add(&st_relaunches, 1);
    } else {
      shim_log("preemption: relaunch of %s failed: %d", kname(t->rec), (int)rr);
      const char *nm = kname(t->rec);
      jb_printf(&errs, "%s{\"launch\":%llu,\"kernel\":", errs.len ? "," : "", (unsigned long long)t->id);
      jb_str(&errs, nm, strlen(nm));
      jb_printf(&errs, ",\"error\":%d}", (int)rr);
    }
  }
  trk_peer_hold(0);  // peer links the app enabled meanwhile go on before the gate opens
  pthread_mutex_lock(&pre_mu);
  for (int i = 0; i < n; i++) {
    pending_clear_locked(todo[i]);
    todo[i]->state = TL_RUNNING;
  }
  for (tl *t = live; t; t = t->next) t->drain = t->ended = 0;
  pstate = P_RUNNING;
  atomic_store(&gate_closed, 0);
  pthread_cond_broadcast(&pre_cv);
  pthread_mutex_unlock(&pre_mu);
  free(todo);
  jb_printf(b,
            "{\"state\":\"running\",\"was\":\"%s\",\"relaunched\":%d,\"still_stopping\":%d,\"errors\":[%s],"
            "\"elapsed_us\":%llu}",
            pstate_names[was], relaunched, still, errs.p ? errs.p : "", (unsigned long long)((shim_now_ns() - t0) / 1000));
  free(errs.p);
}

void preempt_report_status(jbuf *b) {
  pthread_mutex_lock(&pre_mu);
  if (d.ok && pstate == P_RUNNING) retire_locked(NULL, 64);  // finished launches leave the count
  int st = pstate, n = 0, np = 0, ns = nstopping;
  for (tl *t = live; t; t = t->next) {
    n += t->state == TL_RUNNING || t->state == TL_PREEMPTING;
    np += t->state == TL_PREEMPTED || t->state == TL_PREEMPTING;
  }
  pthread_mutex_unlock(&pre_mu);
  jb_printf(b,
            "{\"mode\":\"%s\",\"min_us\":%u,\"state\":\"%s\",\"gate\":\"%s\",\"twins_in_flight\":%d,\"preempted_pending\":%d,"
            "\"stopping\":%d,\"batch_max\":%u,"
            "\"instrumented_modules\":%d,\"twin_launches\":%lu,\"relaunches\":%lu,\"quiesces\":%lu,\"preempted\":%lu,\"hold\":%s,\"holds\":%lu,\"hold_ms\":%.3f,\"hold_not_started\":%lu,"
            "\"mid_block\":%s,\"mid_block_mode\":\"%s\",\"mid_block_launches\":%lu,\"mid_block_stops\":%lu,\"mid_block_refused\":%lu,\"cache\":",
            preempt_mode_names[cfg.preempt], cfg.preempt_min_us, pstate_names[st],
            atomic_load(&gate_closed) ? "closed" : "open", n, np, ns, cfg.preempt_batch_max, trk_instrumented_modules(),
            atomic_load(&st_twin_launches), atomic_load(&st_relaunches), atomic_load(&st_quiesces),
            atomic_load(&st_preempted), cfg.preempt_hold ? "true" : "false", atomic_load(&st_holds),
            (double)atomic_load(&st_hold_ns) / 1e6, atomic_load(&st_hold_gaveup), cfg.mid_block ? "true" : "false",
            cfg.mid_block == MB_ON ? "on" : cfg.mid_block == MB_AUTO ? "auto" : "off",
            atomic_load(&st_mid_launches), atomic_load(&st_mid_stops), atomic_load(&st_mid_refused));
  instr_stats(b);
  jb_printf(b, ",\"helper\":");
  jb_str(b, cfg.helper, strlen(cfg.helper));
  jb_s(b, ",\"cache_dir\":");
  jb_str(b, cfg.ptx_cache, strlen(cfg.ptx_cache));
  jb_s(b, "}");
}

// preempt_drop_ctx forgets a context that is being destroyed (or whose primary context is being
// released): its launches, control-block slabs, events and side stream die with it. A context
// that survives (a primary context still retained elsewhere) only loses its pool, which is rebuilt.
void preempt_drop_ctx(CUcontext ctx) {
  if (!ctx) return;
  pthread_mutex_lock(&pre_mu);
  crec *c = NULL;
  for (int i = 0; i < MAX_CRECS && !c; i++) {
    crec *r = atomic_load(&crecs[i]);
    if (!r) break;
    if (r->ctx == ctx) c = r;
  }
  if (c) {
    for (tl **pp = &live; *pp;) {
      tl *t = *pp;
      if (t->cr != c) {
        pp = &t->next;
        continue;
      }
      *pp = t->next;
      nlive--;
      pending_clear_locked(t);
      if (t->stopping) nstopping--;
      t->slab = -1;
      t->done = NULL;
      tl_free(t);
    }
    c->nslab = 0;
    memset(c->used, 0, sizeof c->used);
    free(c->areas);  // their device memory went with the context
    c->areas = NULL;
    c->nareas = c->careas = 0;
    c->nfree_ev = 0;
    c->side = NULL;
    c->sms = 0;
    atomic_store(&c->orig, NULL);
    pthread_cond_broadcast(&pre_cv);
  }
  pthread_mutex_unlock(&pre_mu);
}

// A child forked after CUDA has none of the parent's launches, contexts or streams.
static void atfork_child(void) {
  pthread_mutex_init(&pre_mu, NULL);
  pthread_cond_init(&pre_cv, NULL);
  pthread_cond_init(&raiser_cv, NULL);
  raiser_started = raiser_busy = nstopping = 0;  // the parent's raiser thread is not in the child
  atomic_store(&gate_closed, 0);
  atomic_store(&coll_count, 0);  // a child's collectives are its own
  atomic_store(&coll_at, 0);
  atomic_store(&coll_held, 0);
  for (int i = 0; i < SHARDS; i++) atomic_store(&inflight[i].n, 0);
  pstate = P_RUNNING;
  live = NULL;  // the parent's records are leaked, never touched
  nlive = 0;
  for (int i = 0; i < MAX_CRECS; i++) atomic_store(&crecs[i], NULL);
  for (size_t i = 0; i < STAB; i++) atomic_store(&stab[i], NULL);
}
__attribute__((constructor)) static void preempt_fork_init(void) { pthread_atfork(NULL, NULL, atfork_child); }
