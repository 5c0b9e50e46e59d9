// A fake libcuda.so.1 for the shim's CI tests: no GPU, but the same entry points, ABIs
// (versioned and _ptsz variants) and resolver behaviour as the real driver, plus counters
// (fake_calls) so tests can check that every call the app made reached the "driver" through the
// variant the app asked for.
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
#define OK 0
#define E_INVALID_VALUE 1
#define E_NOT_INITIALIZED 3
#define E_INVALID_IMAGE 200
#define E_INVALID_HANDLE 400
#define E_NOT_FOUND 500
#define EXPORT __attribute__((visibility("default")))

// ---- call counters, readable by tests through fake_calls(name) ----
enum {
#define CALLS(X) X(cuInit) X(cuLaunchKernel) X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz) \
  X(cuLaunchCooperativeKernel) X(cuGraphLaunch) X(cuMemAlloc_v2) X(cuMemFree_v2) X(cuModuleLoadData)            \
  X(cuLibraryLoadData) X(cuGetProcAddress) X(cuGetProcAddress_v2) X(cuGetExportTable) X(cuEventRecord)           \
  X(cuMemAllocAsync_ptsz) X(cuCtxCreate_v4) X(cuCtxCreate_v2) X(cuEventCreate) X(cuEventDestroy_v2)        \
  X(twin_launches) X(twin_stops) X(memset32_async) X(mid_stops) X(mid_resumes) X(mid_forwards) X(mid_bad)
#define E(n) C_##n,
  CALLS(E)
#undef E
      C_COUNT
};
static const char *call_names[] = {
#define N(n) #n,
    CALLS(N)
#undef N
};
static atomic_long calls[C_COUNT];
// FAKE_CUDA_EVENT_STATS=1: report event creations and destructions on stderr at exit.
__attribute__((destructor)) static void event_stats(void) {
  const char *v = getenv("FAKE_CUDA_EVENT_STATS");
  if (v && v[0] == '1')
    fprintf(stderr, "fake-events created=%ld destroyed=%ld\n", atomic_load(&calls[C_cuEventCreate]),
            atomic_load(&calls[C_cuEventDestroy_v2]));
}
EXPORT long fake_calls(const char *name) {
  for (int i = 0; i < C_COUNT; i++)
    if (strcmp(call_names[i], name) == 0) return atomic_load(&calls[i]);
  return -1;
}
#define COUNT(n) atomic_fetch_add(&calls[C_##n], 1)

static int inited;
static struct ctx { int magic; int dev; } primary = {0xc0c0, 0};
static __thread struct ctx *current;

// ---- modules and functions ----
// A PTX module knows its .entry kernels and their parameter layouts (cuModuleGetFunction of another
// name fails, cuFuncGetParamInfo answers); a binary image gives any requested name, no layout.
typedef struct func {
  int magic;
  char name[160];
  struct mod *mod;
  int nparams;  // -1: unknown (binary image)
  unsigned off[32], size[32];
  int max_dyn_shmem;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (8): launches above 48 KiB need it
} func;
// Mid-block twins' record layouts (__ptxmig_mid_K[5] = {2, slots, static shared, sites, local}),
// read from the PTX as module globals (cuModuleGetGlobal); fake device memory is host memory.
typedef struct mglobal { char name[180]; uint32_t v[5]; } mglobal;
typedef struct mod { int magic; int loaded; int ptx; func fns[64]; int nfns; mglobal g[16]; int ng; } mod;
#define MOD_MAGIC 0x30d
#define FN_MAGIC 0xf00

static int image_ok(const void *p) {
  const unsigned char *b = p;
  uint32_t m;
  if (!p) return 0;
  memcpy(&m, b, 4);
  return m == 0x466243b1u || m == 0xba55ed50u || (b[0] == 0x7f && b[1] == 'E') || strstr((const char *)b, ".entry") != NULL;
}
static int is_ptx(const void *p) {
  uint32_t m;
  memcpy(&m, p, 4);
  return m != 0x466243b1u && m != 0xba55ed50u && ((const unsigned char *)p)[0] != 0x7f;
}
static void parse_entries(mod *m, const char *t) {
  const char *s = t;
  while ((s = strstr(s, ".entry")) && m->nfns < 64) {
    s += 6;
    while (*s == ' ' || *s == '\t' || *s == '\n') s++;
    const char *e = s;
    while (*e && *e != '(' && *e != ' ' && *e != '\n' && *e != '\t') e++;
    func *f = &m->fns[m->nfns++];
    f->magic = FN_MAGIC;
    f->mod = m;
    snprintf(f->name, sizeof f->name, "%.*s", (int)(e - s), s);
    const char *close = strchr(e, ')');
    unsigned cur = 0;
    f->nparams = 0;
    for (const char *q = strstr(e, ".param"); q && close && q < close && f->nparams < 32; q = strstr(q + 6, ".param")) {
      unsigned sz = strncmp(q, ".param .u64", 11) == 0 || strncmp(q, ".param .b64", 11) == 0 ? 8 : 4;
      cur = (cur + sz - 1) & ~(sz - 1);
      f->off[f->nparams] = cur;
      f->size[f->nparams++] = sz;
      cur += sz;
    }
    s = close ? close : e;
  }
}
static void parse_mid_globals(mod *m, const char *t) {
  for (const char *s = t; (s = strstr(s, "__ptxmig_mid_")) && m->ng < 16; s++) {
    const char *e = s;
    while (*e && *e != '[' && *e != ' ' && *e != '\n') e++;
    mglobal *g = &m->g[m->ng];
    if (*e != '[' || sscanf(e, "[5] = {%u, %u, %u, %u, %u}", &g->v[0], &g->v[1], &g->v[2], &g->v[3], &g->v[4]) != 5) continue;
    snprintf(g->name, sizeof g->name, "%.*s", (int)(e - s), s);
    m->ng++;
  }
}
static mod *mod_new(const void *image) {
  mod *m = calloc(1, sizeof *m);
  m->magic = MOD_MAGIC;
  m->loaded = 1;
  if (image && is_ptx(image)) {
    m->ptx = 1;
    parse_entries(m, image);
    parse_mid_globals(m, image);
  }
  return m;
}
// FAKE_CUDA_NO_GLOBALS=1: globals are never found (a driver or module without the layout).
static CUresult get_global(CUdeviceptr *p, size_t *n, void *mp, const char *name) {
  mod *m = mp;
  if (!m || m->magic != MOD_MAGIC) return E_INVALID_HANDLE;
  const char *v = getenv("FAKE_CUDA_NO_GLOBALS");
  for (int i = 0; i < m->ng && !(v && *v == '1'); i++)
    if (strcmp(m->g[i].name, name) == 0) {
      if (p) *p = (CUdeviceptr)(uintptr_t)m->g[i].v;
      if (n) *n = sizeof m->g[i].v;
      return OK;
    }
  return E_NOT_FOUND;
}
EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr *p, size_t *n, void *m, const char *name) { return get_global(p, n, m, name); }
EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *p, size_t *n, void *l, const char *name) { return get_global(p, n, l, name); }
static func *mod_fn(mod *m, const char *name) {
  for (int i = 0; i < m->nfns; i++)
    if (strcmp(m->fns[i].name, name) == 0) return &m->fns[i];
  if (m->ptx || m->nfns == 64) return NULL;
  func *f = &m->fns[m->nfns++];
  f->magic = FN_MAGIC;
  f->nparams = -1;
  snprintf(f->name, sizeof f->name, "%s", name);
  f->mod = m;
  return f;
}
static int fn_ok(const void *f) { return f && ((const func *)f)->magic == FN_MAGIC && ((const func *)f)->mod->loaded; }
// FAKE_CUDA_NO_PARAM_INFO=1: cuFuncGetParamInfo is "not supported" (drivers before 12.4).
EXPORT CUresult cuFuncGetParamInfo(void *fp, size_t i, size_t *off, size_t *size) {
  const char *v = getenv("FAKE_CUDA_NO_PARAM_INFO");
  if (v && *v == '1') return 801;
  if (!fn_ok(fp)) return E_INVALID_HANDLE;
  func *f = fp;
  if (f->nparams < 0) return 801;
  if (i >= (size_t)f->nparams) return E_INVALID_VALUE;
  *off = f->off[i];
  *size = f->size[i];
  return OK;
}
EXPORT CUresult cuFuncSetAttribute(void *fp, int attr, int v) {
  if (!fn_ok(fp)) return E_INVALID_HANDLE;
  if (attr == 8) ((func *)fp)->max_dyn_shmem = v;
  return OK;
}
EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, void *f, int bs, size_t sh) {
  (void)sh;
  if (!fn_ok(f) || bs <= 0) return E_INVALID_VALUE;
  // FAKE_CUDA_TWIN_OCC=1: twins fit one CTA per SM, originals two (a twin with more registers).
  const char *v = getenv("FAKE_CUDA_TWIN_OCC");
  const char *nm = ((func *)f)->name;
  size_t tl = strlen(nm), sl = strlen("__ptxmig");
  *n = v && *v == '1' && tl > sl && strcmp(nm + tl - sl, "__ptxmig") == 0 ? 1 : 2;
  return OK;
}

EXPORT CUresult cuInit(unsigned flags) { (void)flags; COUNT(cuInit); inited = 1; return OK; }
EXPORT CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
EXPORT CUresult cuDeviceGetCount(int *n) { if (!inited) return E_NOT_INITIALIZED; *n = 1; return OK; }
EXPORT CUresult cuDeviceGet(int *d, int i) { if (!inited) return E_NOT_INITIALIZED; if (i != 0) return 101; *d = 0; return OK; }
EXPORT CUresult cuDeviceGetName(char *n, int len, int d) { (void)d; snprintf(n, (size_t)len, "Fake GPU"); return OK; }
EXPORT CUresult cuDeviceTotalMem_v2(size_t *b, int d) { (void)d; *b = (size_t)80 << 30; return OK; }
EXPORT CUresult cuDeviceGetAttribute(int *v, int a, int d) { (void)d; *v = a == 75 ? 9 : a == 16 ? 4 : 0; return OK; }
EXPORT CUresult cuCtxGetDevice(int *d) { if (!current) return 201; *d = 0; return OK; }
// One fake device: any context is accepted as a peer; a NULL one is refused as the driver would.
EXPORT CUresult cuCtxEnablePeerAccess(void *peer, unsigned flags) { (void)flags; return peer ? OK : E_INVALID_HANDLE; }
EXPORT CUresult cuCtxDisablePeerAccess(void *peer) { return peer ? OK : E_INVALID_HANDLE; }
EXPORT CUresult cuDeviceGetUuid_v2(unsigned char *u, int d) { (void)d; for (int i = 0; i < 16; i++) u[i] = (unsigned char)i; return OK; }
EXPORT CUresult cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; if (!inited) return E_NOT_INITIALIZED; *c = &primary; return OK; }
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return OK; }
EXPORT CUresult cuCtxSetCurrent(void *c) { current = c; return OK; }
EXPORT CUresult cuCtxGetCurrent(void **c) { *c = current; return OK; }
EXPORT CUresult cuCtxPushCurrent_v2(void *c) { current = c; return OK; }
EXPORT CUresult cuCtxPopCurrent_v2(void **c) { if (c) *c = current; current = NULL; return OK; }
EXPORT CUresult cuCtxCreate_v2(void **c, unsigned f, int d) { (void)f; COUNT(cuCtxCreate_v2); struct ctx *x = calloc(1, sizeof *x); x->magic = 0xc0c0; x->dev = d; *c = current = x; return OK; }
EXPORT CUresult cuCtxCreate_v4(void **c, void *p, unsigned f, int d) { (void)p; (void)f; COUNT(cuCtxCreate_v4); struct ctx *x = calloc(1, sizeof *x); x->magic = 0xc0c0; x->dev = d; *c = current = x; return OK; }
EXPORT CUresult cuCtxDestroy_v2(void *c) { if (c == &primary) return E_INVALID_VALUE; if (current == c) current = NULL; free(c); return OK; }

// FAKE_CUDA_REJECT_TWINS=1: PTX with twins fails to JIT (the shim must load the original instead).
static int reject(const void *img) { const char *v = getenv("FAKE_CUDA_REJECT_TWINS"); return v && *v == '1' && is_ptx(img) && strstr(img, "__ptxmig"); }
EXPORT CUresult cuModuleLoadData(void **m, const void *img) { COUNT(cuModuleLoadData); if (!image_ok(img)) return E_INVALID_IMAGE; if (reject(img)) return 218; *m = mod_new(img); return OK; }
EXPORT CUresult cuModuleLoadDataEx(void **m, const void *img, unsigned n, void *o, void **v) { (void)n; (void)o; (void)v; if (!image_ok(img)) return E_INVALID_IMAGE; *m = mod_new(img); return OK; }
EXPORT CUresult cuModuleLoadFatBinary(void **m, const void *img) { if (!image_ok(img)) return E_INVALID_IMAGE; *m = mod_new(img); return OK; }
EXPORT CUresult cuModuleLoad(void **m, const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return 301;  // CUDA_ERROR_FILE_NOT_FOUND
  fclose(f);
  *m = mod_new(NULL);
  return OK;
}
EXPORT CUresult cuModuleUnload(void *m) { if (!m || ((mod *)m)->magic != MOD_MAGIC) return E_INVALID_HANDLE; ((mod *)m)->loaded = 0; return OK; }
// Internal calls go through static functions, never through exported symbols (which a preloaded
// shim interposes: the real driver's internal calls are not visible to it either).
static CUresult get_function(void **f, void *m, const char *name);
EXPORT CUresult cuModuleGetFunction(void **f, void *m, const char *name) { return get_function(f, m, name); }
static CUresult get_function(void **f, void *m, const char *name) {
  if (!m || ((mod *)m)->magic != MOD_MAGIC) return E_INVALID_HANDLE;
  func *fn = mod_fn(m, name);
  if (!fn) return E_NOT_FOUND;
  *f = fn;
  return OK;
}
EXPORT CUresult cuFuncGetName(const char **n, void *f) { if (!fn_ok(f)) return E_INVALID_HANDLE; *n = ((func *)f)->name; return OK; }
EXPORT CUresult cuFuncGetModule(void **m, void *f) { if (!fn_ok(f)) return E_INVALID_HANDLE; *m = ((func *)f)->mod; return OK; }
// Libraries are modules here too; CUkernel and CUfunction share the representation.
EXPORT CUresult cuLibraryLoadData(void **l, const void *code, void *a, void *b, unsigned c, void *d, void *e, unsigned g) {
  (void)a; (void)b; (void)c; (void)d; (void)e; (void)g;
  COUNT(cuLibraryLoadData);
  if (!image_ok(code)) return E_INVALID_IMAGE;
  if (reject(code)) return 218;
  *l = mod_new(code);
  return OK;
}
EXPORT CUresult cuLibraryUnload(void *l) { return cuModuleUnload(l); }
EXPORT CUresult cuLibraryGetKernel(void **k, void *l, const char *name) { return get_function(k, l, name); }
EXPORT CUresult cuLibraryGetModule(void **m, void *l) { *m = l; return OK; }
EXPORT CUresult cuKernelGetFunction(void **f, void *k) { if (!fn_ok(k)) return E_INVALID_HANDLE; *f = k; return OK; }
EXPORT CUresult cuKernelGetName(const char **n, void *k) { return cuFuncGetName(n, k); }

// ---- memory ----
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { COUNT(cuMemAlloc_v2); if (!current) return 201; void *m = malloc(n ? n : 1); *p = (CUdeviceptr)(uintptr_t)m; return OK; }
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { COUNT(cuMemFree_v2); free((void *)(uintptr_t)p); return OK; }
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, void *s) { (void)s; return cuMemAlloc_v2(p, n); }
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, void *s) { (void)s; COUNT(cuMemAllocAsync_ptsz); return cuMemAlloc_v2(p, n); }
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, void *s) { (void)s; return cuMemFree_v2(p); }
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, void *s) { (void)s; return cuMemFree_v2(p); }
EXPORT CUresult cuMemAllocHost_v2(void **p, size_t n) { *p = malloc(n); return OK; }
EXPORT CUresult cuMemFreeHost(void *p) { free(p); return OK; }
static unsigned long long next_handle = 0x1000;
EXPORT CUresult cuMemCreate(unsigned long long *h, size_t n, const void *prop, unsigned long long f) { (void)n; (void)prop; (void)f; *h = next_handle++; return OK; }
EXPORT CUresult cuMemRelease(unsigned long long h) { (void)h; return OK; }
EXPORT CUresult cuMemMap(CUdeviceptr p, size_t n, size_t o, unsigned long long h, unsigned long long f) { (void)p; (void)n; (void)o; (void)h; (void)f; return OK; }
EXPORT CUresult cuMemUnmap(CUdeviceptr p, size_t n) { (void)p; (void)n; return OK; }

// ---- streams: each a queue of operations run in order by its own thread ----
// Operations on an idle stream that take no time (events, copies, memsets) run inline, so simple
// apps see the same synchronous behaviour as before. Kernels named k_count* do real work: block b
// increments ((u32 *)param0)[b], sleeping FAKE_CUDA_BLOCK_US per block; their twins (…__ptxmig)
// claim blocks from the control block (last parameter) and stop when its preempt word is set, as
// ptxstate's twins do.
typedef struct event { int magic; atomic_int done; double t; } event;
enum { OP_KERNEL, OP_EVENT, OP_MEMSET32, OP_COPY, OP_HOSTFN, OP_WAITEV };
typedef struct op {
  struct op *next;
  int kind;
  uint64_t seq;
  func *f;
  unsigned total;
  uint64_t out, ctl;
  event *ev;
  uint64_t dst;
  unsigned val;
  size_t n;
  uint8_t *src;
  void (*hfn)(void *);
  void *hdata;
  uint64_t need_rb;  // a mid-block twin: the record bytes its launch needs (0: none)
} op;
typedef struct fstream {
  int magic;
  unsigned flags;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  op *head, *tail;
  int running, started;
  uint64_t enq, done;
  pthread_t th;
} fstream;
#define FS_MAGIC 0x5757
static fstream legacy = {FS_MAGIC, 0, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0};
static pthread_mutex_t ev_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ev_cv = PTHREAD_COND_INITIALIZER;
static double now_s(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9; }
static fstream *fs_of(void *s) {
  if (!s || s == (void *)0x1 || s == (void *)0x2) return &legacy;
  fstream *f = s;
  return f->magic == FS_MAGIC ? f : NULL;
}
static unsigned block_us(void) { const char *v = getenv("FAKE_CUDA_BLOCK_US"); return v ? (unsigned)atoi(v) : 0; }
static void nap(unsigned us) { if (us) { struct timespec ts = {us / 1000000, (long)(us % 1000000) * 1000}; nanosleep(&ts, NULL); } }

// ---- mid-block twins (control block version 3, save_area set) ----
// A block runs in two parts: its time (FAKE_CUDA_BLOCK_US), then its count. Between them (its
// "site"; a flag raised during a block is seen there) a twin whose preempt flag is up saves a
// record {site 0, block, batch end, RecordMagic at 20} into the save area, if the area has room and
// its record_bytes covers what the module's layout needs, and gives the rest of its batch up with
// it. The block's count is added at its end, so a record never resumed leaves it at 0 and one
// resumed twice makes it 2. At the claim step records of resume_area are taken first (cursor):
// resumed (the block's count, then the rest of the batch), or, with the flag up, forwarded.
typedef struct v3 {
  uint8_t *c, *save, *rarea;
  uint32_t rb, cap;
  uint64_t need;
  uint32_t *out;
  unsigned us;
} v3;
static int v3_room(v3 *x) { return x->save && x->rb >= x->need && __atomic_load_n((uint32_t *)(x->c + 76), __ATOMIC_SEQ_CST) < x->cap; }
static void v3_write(v3 *x, uint64_t b, uint64_t e, const uint8_t *copy) {
  uint32_t i = __atomic_fetch_add((uint32_t *)(x->c + 76), 1, __ATOMIC_SEQ_CST);
  uint8_t *r = x->save + (uint64_t)i * x->rb;
  if (copy) {
    memcpy(r, copy, x->rb);
    return;
  }
  memset(r, 0, 64);
  uint32_t magic = 0x52585450u;
  memcpy(r + 8, &b, 8);
  memcpy(r + 24, &e, 8);
  memcpy(r + 20, &magic, 4);
}
// v3_blocks runs blocks [b, e) (the first one from its site on when half); 1 when it stopped.
static int v3_blocks(v3 *x, uint64_t b, uint64_t e, int half) {
  uint64_t *done = (uint64_t *)(x->c + 16);
  uint32_t *preempt = (uint32_t *)(x->c + 36), *status = (uint32_t *)(x->c + 40);
  for (; b < e; b++, half = 0) {
    if (!half) {
      nap(x->us);
      if (__atomic_load_n(preempt, __ATOMIC_SEQ_CST) && v3_room(x)) {
        v3_write(x, b, e, NULL);
        __atomic_store_n(status, 1, __ATOMIC_SEQ_CST);
        COUNT(mid_stops);
        return 1;
      }
    }
    if (x->out) __atomic_add_fetch(&x->out[b], 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(done, 1, __ATOMIC_SEQ_CST);
  }
  return 0;
}
static void v3_run(op *o, uint8_t *c, uint32_t g) {
  v3 x = {c, NULL, NULL, 0, 0, o->need_rb, (uint32_t *)(uintptr_t)o->out, block_us()};
  memcpy(&x.save, c + 64, 8);
  memcpy(&x.rarea, c + 88, 8);
  memcpy(&x.rb, c + 72, 4);
  memcpy(&x.cap, c + 96, 4);
  uint64_t *next = (uint64_t *)c, *total = (uint64_t *)(c + 8);
  uint32_t *preempt = (uint32_t *)(c + 36), *status = (uint32_t *)(c + 40);
  uint32_t rcount = *(uint32_t *)(c + 80), *cursor = (uint32_t *)(c + 84);
  for (;;) {
    uint32_t i = rcount ? __atomic_fetch_add(cursor, 1, __ATOMIC_SEQ_CST) : rcount;
    if (i < rcount) {
      const uint8_t *r = x.rarea + (uint64_t)i * x.rb;
      uint64_t b, e;
      uint32_t magic;
      memcpy(&b, r + 8, 8);
      memcpy(&e, r + 24, 8);
      memcpy(&magic, r + 20, 4);
      if (!x.rarea || magic != 0x52585450u || b >= e || e > *total) {
        COUNT(mid_bad);
        continue;
      }
      if (__atomic_load_n(preempt, __ATOMIC_SEQ_CST) && v3_room(&x)) {
        v3_write(&x, 0, 0, r);
        __atomic_store_n(status, 1, __ATOMIC_SEQ_CST);
        COUNT(mid_forwards);
        continue;
      }
      COUNT(mid_resumes);
      v3_blocks(&x, b, e, 1);
      continue;
    }
    uint64_t t = __atomic_load_n(total, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(preempt, __ATOMIC_SEQ_CST)) {
      if (__atomic_load_n(next, __ATOMIC_SEQ_CST) < t) {
        __atomic_store_n(status, 1, __ATOMIC_SEQ_CST);
        COUNT(twin_stops);
      }
      return;
    }
    uint64_t b0 = __atomic_fetch_add(next, g, __ATOMIC_SEQ_CST);
    if (b0 >= t) return;
    if (v3_blocks(&x, b0, b0 + g < t ? b0 + g : t, 0)) COUNT(twin_stops);
  }
}

static void op_exec(op *o) {
  switch (o->kind) {
  case OP_EVENT:
    pthread_mutex_lock(&ev_mu);
    o->ev->t = now_s();
    atomic_store(&o->ev->done, 1);
    pthread_cond_broadcast(&ev_cv);
    pthread_mutex_unlock(&ev_mu);
    break;
  case OP_WAITEV:
    pthread_mutex_lock(&ev_mu);
    while (!atomic_load(&o->ev->done)) pthread_cond_wait(&ev_cv, &ev_mu);
    pthread_mutex_unlock(&ev_mu);
    break;
  case OP_MEMSET32:
    for (size_t i = 0; i < o->n; i++) __atomic_store_n((uint32_t *)(uintptr_t)o->dst + i, o->val, __ATOMIC_SEQ_CST);
    break;
  case OP_COPY:
    memcpy((void *)(uintptr_t)o->dst, o->src, o->n);
    break;
  case OP_HOSTFN:
    o->hfn(o->hdata);
    break;
  case OP_KERNEL: {
    uint32_t *out = (uint32_t *)(uintptr_t)o->out;
    unsigned us = block_us();
    if (!o->ctl) {
      for (unsigned b = 0; out && b < o->total; b++) {
        __atomic_add_fetch(&out[b], 1, __ATOMIC_SEQ_CST);
        nap(us);
      }
      break;
    }
    uint8_t *c = (uint8_t *)(uintptr_t)o->ctl;
    uint64_t *next = (uint64_t *)c, *total = (uint64_t *)(c + 8), *done = (uint64_t *)(c + 16);
    uint32_t *preempt = (uint32_t *)(c + 36), *status = (uint32_t *)(c + 40);
    COUNT(twin_launches);
    // FAKE_CUDA_TWIN_BATCH=1: claims of batch_max blocks (control block offset 52, 0: 16), the flag
    // read only between claims, like ptxstate's batched scheduler (so stopping takes a batch).
    const char *tb = getenv("FAKE_CUDA_TWIN_BATCH");
    uint32_t g = 1;
    if (tb && *tb == '1') {
      g = *(uint32_t *)(c + 52);
      if (!g) g = 16;
      if (g < *(uint32_t *)(c + 56)) g = *(uint32_t *)(c + 56);
    }
    uint64_t sa;
    memcpy(&sa, c + 64, 8);
    if (o->need_rb && *(uint32_t *)(c + 48) >= 3 && sa) {
      v3_run(o, c, g);
      break;
    }
    for (;;) {
      uint64_t t = __atomic_load_n(total, __ATOMIC_SEQ_CST);
      if (__atomic_load_n(preempt, __ATOMIC_SEQ_CST)) {
        if (__atomic_load_n(next, __ATOMIC_SEQ_CST) < t) {
          __atomic_store_n(status, 1, __ATOMIC_SEQ_CST);
          COUNT(twin_stops);
        }
        break;
      }
      uint64_t b0 = __atomic_fetch_add(next, g, __ATOMIC_SEQ_CST);
      if (b0 >= t) break;
      for (uint64_t b = b0; b < b0 + g && b < t; b++) {
        if (out) __atomic_add_fetch(&out[b], 1, __ATOMIC_SEQ_CST);
        nap(us);
        __atomic_add_fetch(done, 1, __ATOMIC_SEQ_CST);
      }
    }
    break;
  }
  }
}
static void *fs_worker(void *arg) {
  fstream *f = arg;
  pthread_mutex_lock(&f->mu);
  for (;;) {
    while (!f->head) pthread_cond_wait(&f->cv, &f->mu);
    op *o = f->head;
    f->head = o->next;
    if (!f->head) f->tail = NULL;
    f->running = 1;
    pthread_mutex_unlock(&f->mu);
    op_exec(o);
    pthread_mutex_lock(&f->mu);
    f->running = 0;
    f->done = o->seq;
    free(o->src);
    free(o);
    pthread_cond_broadcast(&f->cv);
  }
  return NULL;
}
static int instant(const op *o) { return o->kind == OP_EVENT || o->kind == OP_MEMSET32 || o->kind == OP_COPY || (o->kind == OP_KERNEL && !o->out); }
static uint64_t fs_enqueue(fstream *f, op *o) {
  pthread_mutex_lock(&f->mu);
  o->seq = ++f->enq;
  if (!f->head && !f->running && instant(o)) {
    op_exec(o);
    f->done = o->seq;
    free(o->src);
    free(o);
    pthread_mutex_unlock(&f->mu);
    return f->done;
  }
  uint64_t seq = o->seq;
  if (f->tail) f->tail->next = o;
  else f->head = o;
  f->tail = o;
  if (!f->started) {
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    f->started = pthread_create(&f->th, &at, fs_worker, f) == 0;
    pthread_attr_destroy(&at);
  }
  pthread_cond_broadcast(&f->cv);
  pthread_mutex_unlock(&f->mu);
  return seq;
}
static void fs_wait(fstream *f, uint64_t seq) {
  pthread_mutex_lock(&f->mu);
  while (f->done < seq) pthread_cond_wait(&f->cv, &f->mu);
  pthread_mutex_unlock(&f->mu);
}
static void fs_sync(fstream *f) {
  pthread_mutex_lock(&f->mu);
  uint64_t seq = f->enq;
  pthread_mutex_unlock(&f->mu);
  fs_wait(f, seq);
}
static int fs_busy(fstream *f) {
  pthread_mutex_lock(&f->mu);
  int b = f->done < f->enq;
  pthread_mutex_unlock(&f->mu);
  return b;
}
static op *op_new(int kind) { op *o = calloc(1, sizeof *o); o->kind = kind; return o; }

#define MAX_STREAMS 256
static fstream *streams[MAX_STREAMS];
static int nstreams;
static pthread_mutex_t streams_mu = PTHREAD_MUTEX_INITIALIZER;
EXPORT CUresult cuStreamCreate(void **s, unsigned flags) {
  fstream *f = calloc(1, sizeof *f);
  f->magic = FS_MAGIC;
  f->flags = flags;
  pthread_mutex_init(&f->mu, NULL);
  pthread_cond_init(&f->cv, NULL);
  pthread_mutex_lock(&streams_mu);
  if (nstreams < MAX_STREAMS) streams[nstreams++] = f;
  pthread_mutex_unlock(&streams_mu);
  *s = f;
  return OK;
}
EXPORT CUresult cuStreamCreateWithPriority(void **s, unsigned flags, int prio) { (void)prio; return cuStreamCreate(s, flags); }
EXPORT CUresult cuStreamDestroy_v2(void *s) { fstream *f = fs_of(s); if (!f || f == &legacy) return E_INVALID_HANDLE; fs_sync(f); return OK; }
EXPORT CUresult cuStreamGetCtx(void *s, void **c) { if (!fs_of(s)) return E_INVALID_HANDLE; *c = current ? (void *)current : (void *)&primary; return OK; }
EXPORT CUresult cuStreamGetFlags(void *s, unsigned *fl) { fstream *f = fs_of(s); if (!f) return E_INVALID_HANDLE; *fl = f->flags; return OK; }
EXPORT CUresult cuStreamSynchronize(void *s) { fstream *f = fs_of(s); if (!f) return E_INVALID_HANDLE; fs_sync(f); return OK; }
EXPORT CUresult cuStreamSynchronize_ptsz(void *s) { return cuStreamSynchronize(s); }
EXPORT CUresult cuStreamQuery(void *s) { fstream *f = fs_of(s); if (!f) return E_INVALID_HANDLE; return fs_busy(f) ? 600 : OK; }
EXPORT CUresult cuStreamQuery_ptsz(void *s) { return cuStreamQuery(s); }
EXPORT CUresult cuCtxSynchronize(void) {
  fs_sync(&legacy);
  pthread_mutex_lock(&streams_mu);
  int n = nstreams;
  pthread_mutex_unlock(&streams_mu);
  for (int i = 0; i < n; i++) fs_sync(streams[i]);
  return OK;
}
EXPORT CUresult cuLaunchHostFunc(void *s, void (*fn)(void *), void *data) {
  fstream *f = fs_of(s);
  if (!f) return E_INVALID_HANDLE;
  op *o = op_new(OP_HOSTFN);
  o->hfn = fn, o->hdata = data;
  fs_enqueue(f, o);
  return OK;
}

// ---- memory operations (device memory is host memory here) ----
static CUresult copy_op(void *s, uint64_t dst, const void *src, size_t n, int sync) {
  fstream *f = fs_of(s);
  if (!f) return E_INVALID_HANDLE;
  op *o = op_new(OP_COPY);
  o->dst = dst, o->n = n;
  o->src = malloc(n ? n : 1);
  memcpy(o->src, src, n);  // staged at call time, as for pageable host memory
  uint64_t seq = fs_enqueue(f, o);
  if (sync) fs_wait(f, seq);
  return OK;
}
// A device-to-host copy reads the source when it runs (not when it is submitted).
typedef struct { uint64_t dst; const void *src; size_t n; } d2h;
static void d2h_run(void *a) { d2h *x = a; memcpy((void *)(uintptr_t)x->dst, x->src, x->n); free(x); }
static CUresult d2h_op(void *s, void *dst, uint64_t src, size_t n, int sync) {
  fstream *f = fs_of(s);
  if (!f) return E_INVALID_HANDLE;
  d2h *x = malloc(sizeof *x);
  x->dst = (uint64_t)(uintptr_t)dst, x->src = (const void *)(uintptr_t)src, x->n = n;
  op *o = op_new(OP_HOSTFN);
  o->hfn = d2h_run, o->hdata = x;
  pthread_mutex_lock(&f->mu);
  int idle = !f->head && !f->running;
  pthread_mutex_unlock(&f->mu);
  if (idle) {  // run inline like the other instant operations
    free(o);
    d2h_run(x);
    return OK;
  }
  uint64_t seq = fs_enqueue(f, o);
  if (sync) fs_wait(f, seq);
  return OK;
}
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, void *s) { return copy_op(s, d, h, n, 0); }
EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) { return copy_op(NULL, d, h, n, 1); }
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, void *s) { return d2h_op(s, h, d, n, 0); }
EXPORT CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) { return d2h_op(NULL, h, d, n, 1); }
static CUresult memset32(CUdeviceptr p, unsigned v, size_t n, void *s);
EXPORT CUresult cuMemsetD32Async(CUdeviceptr p, unsigned v, size_t n, void *s) { return memset32(p, v, n, s); }
static CUresult memset32(CUdeviceptr p, unsigned v, size_t n, void *s) {
  COUNT(memset32_async);
  fstream *f = fs_of(s);
  if (!f) return E_INVALID_HANDLE;
  op *o = op_new(OP_MEMSET32);
  o->dst = p, o->val = v, o->n = n;
  fs_enqueue(f, o);
  return OK;
}
EXPORT CUresult cuMemsetD32_v2(CUdeviceptr p, unsigned v, size_t n) { return memset32(p, v, n, NULL); }

// ---- events ----
EXPORT CUresult cuEventCreate(void **e, unsigned f) { (void)f; COUNT(cuEventCreate); if (!current) return 201; event *x = calloc(1, sizeof *x); x->magic = 0xe7; atomic_store(&x->done, 1); *e = x; return OK; }
EXPORT CUresult cuEventRecord(void *e, void *s) {
  COUNT(cuEventRecord);
  fstream *f = fs_of(s);
  if (!e || ((event *)e)->magic != 0xe7 || !f) return E_INVALID_HANDLE;
  atomic_store(&((event *)e)->done, 0);
  op *o = op_new(OP_EVENT);
  o->ev = e;
  fs_enqueue(f, o);
  return OK;
}
EXPORT CUresult cuEventRecord_ptsz(void *e, void *s) { return cuEventRecord(e, s); }
EXPORT CUresult cuEventQuery(void *e) { if (!e || ((event *)e)->magic != 0xe7) return E_INVALID_HANDLE; return atomic_load(&((event *)e)->done) ? OK : 600; }
EXPORT CUresult cuEventSynchronize(void *e) {
  if (!e || ((event *)e)->magic != 0xe7) return E_INVALID_HANDLE;
  pthread_mutex_lock(&ev_mu);
  while (!atomic_load(&((event *)e)->done)) pthread_cond_wait(&ev_cv, &ev_mu);
  pthread_mutex_unlock(&ev_mu);
  return OK;
}
EXPORT CUresult cuStreamWaitEvent(void *s, void *e, unsigned fl) {
  (void)fl;
  fstream *f = fs_of(s);
  if (!f || !e || ((event *)e)->magic != 0xe7) return E_INVALID_HANDLE;
  if (atomic_load(&((event *)e)->done)) return OK;
  op *o = op_new(OP_WAITEV);
  o->ev = e;
  fs_enqueue(f, o);
  return OK;
}
EXPORT CUresult cuEventElapsedTime_v2(float *ms, void *a, void *b) { if (!atomic_load(&((event *)a)->done) || !atomic_load(&((event *)b)->done)) return 600; *ms = (float)((((event *)b)->t - ((event *)a)->t) * 1e3 + 0.25); return OK; }
EXPORT CUresult cuEventDestroy_v2(void *e) { COUNT(cuEventDestroy_v2); if (!e || ((event *)e)->magic != 0xe7) return E_INVALID_HANDLE; ((event *)e)->magic = 0; free(e); return OK; }

// ---- launches ----
// kernel_op queues a k_count kernel (or its twin); other kernels do nothing.
static void kernel_op(func *f, unsigned gx, unsigned gy, unsigned gz, unsigned threads, unsigned sh, void *s, void **p, void **x) {
  if (strncmp(f->name, "k_count", 7) != 0 || f->nparams < 1) return;
  fstream *fs = fs_of(s);
  if (!fs) return;
  op *o = op_new(OP_KERNEL);
  o->f = f;
  size_t tl = strlen(f->name), sl = strlen("__ptxmig");
  int twin = tl > sl && strcmp(f->name + tl - sl, "__ptxmig") == 0;
  if (p) {
    memcpy(&o->out, p[0], 8);
    if (twin) memcpy(&o->ctl, p[f->nparams - 1], 8);
  } else if (x && x[0] == (void *)1) {
    memcpy(&o->out, (uint8_t *)x[1] + f->off[0], 8);
    if (twin) memcpy(&o->ctl, (uint8_t *)x[1] + f->off[f->nparams - 1], 8);
  }
  o->total = gx * gy * gz;
  if (twin) o->total = 0;  // the twin reads total_blocks from its control block
  if (twin) {
    char gn[200];
    snprintf(gn, sizeof gn, "__ptxmig_mid_%.*s", (int)(tl - sl), f->name);
    for (int i = 0; i < f->mod->ng; i++)
      if (strcmp(f->mod->g[i].name, gn) == 0) {
        const uint32_t *v = f->mod->g[i].v;
        o->need_rb = (64 + (8ull * v[1] + v[4]) * threads + v[2] + sh + 15) & ~15ull;
      }
  }
  fs_enqueue(fs, o);
}
#define LAUNCH_BODY(n) COUNT(n); if (!fn_ok(f)) return E_INVALID_HANDLE; if (!gx || !bx) return E_INVALID_VALUE; if (sh > 49152 && (int)sh > ((func *)f)->max_dyn_shmem) return E_INVALID_VALUE; kernel_op(f, gx, gy, gz, bx * by * bz, sh, s, p, x); return OK
EXPORT CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, void *s, void **p, void **x) { (void)by; (void)bz; (void)sh; LAUNCH_BODY(cuLaunchKernel); }
EXPORT CUresult cuLaunchKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, void *s, void **p, void **x) { (void)by; (void)bz; (void)sh; LAUNCH_BODY(cuLaunchKernel_ptsz); }
EXPORT CUresult cuLaunchCooperativeKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, void *s, void **p) { (void)by; (void)bz; (void)sh; void **x = NULL; LAUNCH_BODY(cuLaunchCooperativeKernel); }
typedef struct { unsigned gx, gy, gz, bx, by, bz, sh; void *s; void *attrs; unsigned n; } cfg_t;
EXPORT CUresult cuLaunchKernelEx(const cfg_t *c, void *f, void **p, void **x) { unsigned gx = c->gx, gy = c->gy, gz = c->gz, bx = c->bx, by = c->by, bz = c->bz, sh = c->sh; void *s = c->s; LAUNCH_BODY(cuLaunchKernelEx); }
EXPORT CUresult cuLaunchKernelEx_ptsz(const cfg_t *c, void *f, void **p, void **x) { unsigned gx = c->gx, gy = c->gy, gz = c->gz, bx = c->bx, by = c->by, bz = c->bz, sh = c->sh; void *s = c->s; LAUNCH_BODY(cuLaunchKernelEx_ptsz); }
EXPORT CUresult cuGraphLaunch(void *g, void *s) { (void)s; COUNT(cuGraphLaunch); return g ? OK : E_INVALID_HANDLE; }
EXPORT CUresult cuStreamBeginCapture_v2(void *s, int m) { (void)s; (void)m; return OK; }
EXPORT CUresult cuStreamEndCapture(void *s, void **g) { (void)s; *g = (void *)0x6; return OK; }

static const void *export_table[4];
EXPORT CUresult cuGetExportTable(const void **t, const void *uuid) { (void)uuid; COUNT(cuGetExportTable); *t = export_table; return OK; }

// ---- the resolver: a private name table, as in the real driver (no dlsym involved) ----
EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags);
EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *st);
static const struct { const char *name; void *fn; } table[] = {
#define T(n) {#n, (void *)n},
    T(cuInit) T(cuDriverGetVersion) T(cuDeviceGetCount) T(cuDeviceGet) T(cuDeviceGetName) T(cuDeviceTotalMem_v2)
    T(cuDeviceGetAttribute) T(cuDeviceGetUuid_v2) T(cuDevicePrimaryCtxRetain) T(cuDevicePrimaryCtxRelease_v2)
    T(cuCtxSetCurrent) T(cuCtxGetCurrent) T(cuCtxPushCurrent_v2) T(cuCtxPopCurrent_v2) T(cuCtxCreate_v2)
    T(cuCtxCreate_v4) T(cuCtxDestroy_v2) T(cuModuleLoadData) T(cuModuleLoadDataEx) T(cuModuleLoadFatBinary)
    T(cuModuleLoad) T(cuModuleUnload) T(cuModuleGetFunction) T(cuFuncGetName) T(cuFuncGetModule)
    T(cuLibraryLoadData) T(cuLibraryUnload) T(cuLibraryGetKernel) T(cuLibraryGetModule) T(cuKernelGetFunction)
    T(cuKernelGetName) T(cuMemAlloc_v2) T(cuMemFree_v2) T(cuMemAllocAsync) T(cuMemAllocAsync_ptsz)
    T(cuMemFreeAsync) T(cuMemFreeAsync_ptsz) T(cuMemAllocHost_v2) T(cuMemFreeHost) T(cuMemCreate) T(cuMemRelease)
    T(cuMemMap) T(cuMemUnmap) T(cuEventCreate) T(cuEventRecord) T(cuEventQuery) T(cuEventElapsedTime_v2)
    T(cuEventDestroy_v2) T(cuLaunchKernel) T(cuLaunchKernel_ptsz) T(cuLaunchCooperativeKernel)
    T(cuLaunchKernelEx) T(cuLaunchKernelEx_ptsz) T(cuGraphLaunch) T(cuStreamBeginCapture_v2)
    T(cuStreamEndCapture) T(cuCtxSynchronize) T(cuGetExportTable) T(cuGetProcAddress) T(cuGetProcAddress_v2)
    T(cuFuncGetParamInfo) T(cuFuncSetAttribute) T(cuOccupancyMaxActiveBlocksPerMultiprocessor) T(cuCtxGetDevice) T(cuStreamCreate)
    T(cuStreamCreateWithPriority) T(cuStreamDestroy_v2) T(cuStreamGetCtx) T(cuStreamGetFlags) T(cuStreamSynchronize)
    T(cuStreamSynchronize_ptsz) T(cuStreamQuery) T(cuStreamQuery_ptsz) T(cuLaunchHostFunc) T(cuMemcpyHtoDAsync_v2)
    T(cuMemcpyHtoD_v2) T(cuMemcpyDtoHAsync_v2) T(cuMemcpyDtoH_v2) T(cuMemsetD32Async) T(cuMemsetD32_v2)
    T(cuEventRecord_ptsz) T(cuEventSynchronize) T(cuStreamWaitEvent) T(cuCtxEnablePeerAccess)
    T(cuCtxDisablePeerAccess)
#undef T
};
// With FAKE_CUDA_INTERNAL_PTRS=1 the resolver hands out internal entry points (distinct addresses
// from the exported symbols, same ABI), as the real driver's cuGetProcAddress does for the
// functions below: a shim must still recognise them by (symbol, version, flags).
static CUresult i_cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, void *s, void **p, void **x) { return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sh, s, p, x); }
static CUresult i_cuLaunchKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, void *s, void **p, void **x) { return cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, sh, s, p, x); }
static CUresult i_cuLaunchKernelEx(const cfg_t *c, void *f, void **p, void **x) { return cuLaunchKernelEx(c, f, p, x); }
static CUresult i_cuLibraryLoadData(void **l, const void *code, void *a, void *b, unsigned c, void *d, void *e, unsigned g) { return cuLibraryLoadData(l, code, a, b, c, d, e, g); }
static CUresult i_cuModuleLoadData(void **m, const void *img) { return cuModuleLoadData(m, img); }
static CUresult i_cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, void *s) { return cuMemAllocAsync_ptsz(p, n, s); }
static CUresult i_cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *st) { return cuGetProcAddress_v2(sym, pfn, ver, flags, st); }
static const struct { const char *name; void *fn; } internal[] = {
    {"cuLaunchKernel", (void *)i_cuLaunchKernel}, {"cuLaunchKernel_ptsz", (void *)i_cuLaunchKernel_ptsz},
    {"cuLaunchKernelEx", (void *)i_cuLaunchKernelEx}, {"cuLibraryLoadData", (void *)i_cuLibraryLoadData},
    {"cuModuleLoadData", (void *)i_cuModuleLoadData}, {"cuMemAllocAsync_ptsz", (void *)i_cuMemAllocAsync_ptsz},
    {"cuGetProcAddress_v2", (void *)i_cuGetProcAddress_v2},
};
static void *lookup(const char *n) {
  const char *ip = getenv("FAKE_CUDA_INTERNAL_PTRS");
  if (ip && *ip == '1')
    for (size_t i = 0; i < sizeof internal / sizeof internal[0]; i++)
      if (strcmp(internal[i].name, n) == 0) return internal[i].fn;
  for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
    if (strcmp(table[i].name, n) == 0) return table[i].fn;
  return NULL;
}
static CUresult resolve(const char *sym, void **pfn, int ver, unsigned long long flags, int *st) {
  char name[128];
  void *p = NULL;
  static const char *const v2[] = {"cuMemAlloc", "cuMemFree", "cuMemAllocHost", "cuDeviceTotalMem", "cuDeviceGetUuid",
                                   "cuCtxPushCurrent", "cuCtxPopCurrent", "cuCtxDestroy", "cuEventDestroy",
                                   "cuEventElapsedTime", "cuDevicePrimaryCtxRelease", "cuStreamBeginCapture",
                                   "cuMemcpyHtoD", "cuMemcpyDtoH", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemsetD32",
                                   "cuStreamDestroy"};
  const char *suffix = "";
  for (size_t i = 0; i < sizeof v2 / sizeof v2[0]; i++)
    if (strcmp(sym, v2[i]) == 0 && ver >= 3020) suffix = "_v2";
  if (strcmp(sym, "cuCtxCreate") == 0) suffix = ver >= 13000 ? "_v4" : "_v2";
  if (strcmp(sym, "cuGetProcAddress") == 0 && ver >= 12000) suffix = "_v2";
  if (flags == 2) {  // per-thread default stream: the _ptsz variant where one exists
    snprintf(name, sizeof name, "%s%s_ptsz", sym, suffix);
    p = lookup(name);
  }
  if (!p) {
    snprintf(name, sizeof name, "%s%s", sym, suffix);
    p = lookup(name);
  }
  if (st) *st = p ? 0 : 1;
  *pfn = p;
  return p ? OK : E_NOT_FOUND;
}
EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
  COUNT(cuGetProcAddress);
  return resolve(sym, pfn, ver, flags, NULL);
}
EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *st) {
  COUNT(cuGetProcAddress_v2);
  return resolve(sym, pfn, ver, flags, st);
}
