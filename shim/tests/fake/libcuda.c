// A fake libcuda.so.1 for the shim's CI tests: no GPU, but the same entry points, ABIs
// (versioned and _ptsz variants) and resolver behaviour as the real driver, plus counters
// (fake_calls) so tests can check that every call the app made reached the "driver" through the
// variant the app asked for.
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../../src/gpuhash.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
#define OK 0
#define E_INVALID_VALUE 1
#define E_OUT_OF_MEMORY 2
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
  X(twin_launches) X(twin_stops) X(memset32_async) X(mid_stops) X(mid_resumes) X(mid_forwards) X(mid_bad)      \
  X(bad_access) X(mid_twin_launches) X(ptxmig_chunk_hash) X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)      \
  X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemHostRegister_v2) X(cuMemHostUnregister) X(cuIpcGetMemHandle)   \
  X(cuIpcOpenMemHandle) X(cuIpcOpenMemHandle_v2) X(cuIpcCloseMemHandle) X(cuMemExportToShareableHandle)              \
  X(cuMemImportFromShareableHandle) X(cuMemRetainAllocationHandle) X(cuMemcpyDtoDAsync_v2) X(cuMemPoolExportToShareableHandle)               \
  X(cuMemPoolImportFromShareableHandle) X(cuMemPoolExportPointer) X(cuMemPoolImportPointer) X(cuMemPoolDestroy)
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
// lib: loaded by cuLibraryLoadData. A CUlibrary is not a CUmodule: as the real driver, the module
// calls refuse a library handle and the library calls a module handle.
// view: a library's CUmodule (cuLibraryGetModule, cuFuncGetModule of its kernels): lib 0, and of
// its library, whose functions and globals it serves.
typedef struct mod { int magic; int loaded; int ptx; int lib; struct mod *view, *of; func fns[64]; int nfns; mglobal g[16]; int ng; } mod;
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
  if (m->of) m = m->of;
  const char *v = getenv("FAKE_CUDA_NO_GLOBALS");
  for (int i = 0; i < m->ng && !(v && *v == '1'); i++)
    if (strcmp(m->g[i].name, name) == 0) {
      if (p) *p = (CUdeviceptr)(uintptr_t)m->g[i].v;
      if (n) *n = sizeof m->g[i].v;
      return OK;
    }
  return E_NOT_FOUND;
}
static int is_lib(const void *m) { return m && ((const mod *)m)->magic == MOD_MAGIC && ((const mod *)m)->lib; }
EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr *p, size_t *n, void *m, const char *name) {
  return is_lib(m) ? E_INVALID_HANDLE : get_global(p, n, m, name);
}
EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *p, size_t *n, void *l, const char *name) {
  return l && !is_lib(l) ? E_INVALID_HANDLE : get_global(p, n, l, name);
}
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
  // FAKE_CUDA_TWIN_OCC=1: twins fit one CTA per SM, originals two (a twin with more registers);
  // FAKE_CUDA_MID_OCC=1: the same for second, mid-block twins (K_mid__ptxmig) only.
  const char *v = getenv("FAKE_CUDA_TWIN_OCC"), *mv = getenv("FAKE_CUDA_MID_OCC");
  const char *nm = ((func *)f)->name;
  size_t tl = strlen(nm), sl = strlen("__ptxmig"), ml = strlen("_mid__ptxmig");
  int twin = tl > sl && strcmp(nm + tl - sl, "__ptxmig") == 0, mid = tl > ml && strcmp(nm + tl - ml, "_mid__ptxmig") == 0;
  *n = (v && *v == '1' && twin) || (mv && *mv == '1' && mid) ? 1 : 2;
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
// Links are kept per (current context, peer) as the driver keeps them: enabling one twice is 704
// (PEER_ACCESS_ALREADY_ENABLED), disabling one that is off 705 (PEER_ACCESS_NOT_ENABLED).
// FAKE_CUDA_PEER_FILE=PATH: the number of links enabled is written there after each change.
static struct { void *ctx, *peer; } fake_links[16];
static int fake_nlinks;
static void fake_links_note(void) {
  const char *f = getenv("FAKE_CUDA_PEER_FILE");
  FILE *o = f && *f ? fopen(f, "w") : NULL;
  if (o) fprintf(o, "%d\n", fake_nlinks), fclose(o);
}
static int fake_link(void *peer) {
  for (int i = 0; i < fake_nlinks; i++)
    if (fake_links[i].ctx == current && fake_links[i].peer == peer) return i;
  return -1;
}
// FAKE_CUDA_PEER_STALE=FILE: while FILE exists, every peer context is one the driver no longer
// knows (400 from the peer calls, 201 from cuCtxGetApiVersion: a context destroyed behind the
// app's back).
static int peer_stale(void) {
  const char *f = getenv("FAKE_CUDA_PEER_STALE");
  return f && *f && access(f, F_OK) == 0;
}
// FAKE_CUDA_PEER_REFUSE=FILE holding N: the next N enables between live contexts are refused
// with 400 (as driver 580 refused a link's first enable after a restore), N counted down in FILE.
static int peer_refuse(void) {
  const char *f = getenv("FAKE_CUDA_PEER_REFUSE");
  FILE *in = f && *f ? fopen(f, "r") : NULL;
  int n = 0;
  if (!in) return 0;
  if (fscanf(in, "%d", &n) != 1) n = 0;
  fclose(in);
  if (n <= 0) return 0;
  FILE *o = fopen(f, "w");
  if (o) fprintf(o, "%d\n", n - 1), fclose(o);
  return 1;
}
EXPORT CUresult cuCtxGetApiVersion(void *c, unsigned *v) {
  if (!c || peer_stale()) return 201;  // CUDA_ERROR_INVALID_CONTEXT
  *v = 3020;
  return OK;
}
EXPORT CUresult cuCtxEnablePeerAccess(void *peer, unsigned flags) {
  (void)flags;
  if (!peer || !current || peer_stale() || peer_refuse()) return E_INVALID_HANDLE;
  if (fake_link(peer) >= 0) return 704;
  if (fake_nlinks == 16) return 999;
  fake_links[fake_nlinks].ctx = current, fake_links[fake_nlinks++].peer = peer;
  fake_links_note();
  return OK;
}
EXPORT CUresult cuCtxDisablePeerAccess(void *peer) {
  if (!peer || !current || peer_stale()) return E_INVALID_HANDLE;
  int i = fake_link(peer);
  if (i < 0) return 705;
  fake_links[i] = fake_links[--fake_nlinks];
  fake_links_note();
  return OK;
}
// As a pair of GPUs with a peer path (NVLink) would answer.
EXPORT CUresult cuDeviceCanAccessPeer(int *can, int d, int peer) { (void)d; (void)peer; if (!inited) return E_NOT_INITIALIZED; *can = 1; return OK; }
EXPORT CUresult cuDeviceGetP2PAttribute(int *v, int attr, int src, int dst) { (void)src; (void)dst; if (!inited) return E_NOT_INITIALIZED; *v = attr == 1 ? 0 : 1; return OK; }
EXPORT CUresult cuDeviceGetUuid_v2(unsigned char *u, int d) { (void)d; for (int i = 0; i < 16; i++) u[i] = (unsigned char)i; return OK; }
EXPORT CUresult cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; if (!inited) return E_NOT_INITIALIZED; *c = &primary; return OK; }
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return OK; }
// Enough of the rest of the driver API for ptxmig's own binding (internal/cudackpt) to load this
// library: its tests of what ptxmig itself does on a GPU (memory it keeps for a migrate). A
// process's checkpoint is not faked here (cudackpttest fakes it in Go): those calls say so.
EXPORT CUresult cuGetErrorName(CUresult r, const char **s) { *s = r == 801 ? "CUDA_ERROR_NOT_SUPPORTED" : "CUDA_ERROR_FAKE"; return OK; }
EXPORT CUresult cuGetErrorString(CUresult r, const char **s) { (void)r; *s = "fake driver"; return OK; }
EXPORT CUresult cuCheckpointProcessGetState(int pid, int *st) { (void)pid; (void)st; return 801; }
EXPORT CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) { (void)pid; (void)tid; return 801; }
EXPORT CUresult cuCheckpointProcessLock(int pid, void *a) { (void)pid; (void)a; return 801; }
EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, void *a) { (void)pid; (void)a; return 801; }
EXPORT CUresult cuCheckpointProcessRestore(int pid, void *a) { (void)pid; (void)a; return 801; }
EXPORT CUresult cuCheckpointProcessUnlock(int pid, void *a) { (void)pid; (void)a; return 801; }
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
// A JIT link (CuPy, Numba): PTX in, a "cubin" out: a 64-byte ELF header that loads as a binary
// image (any function name, no layout), as a real cubin would hold the linked kernels.
typedef struct flink { int magic; int inputs; unsigned char cubin[64]; } flink;
#define LINK_MAGIC 0x11c
EXPORT CUresult cuLinkCreate_v2(unsigned n, void *o, void **v, void **st) {
  (void)n; (void)o; (void)v;
  flink *l = calloc(1, sizeof *l);
  if (!l) return 2;
  l->magic = LINK_MAGIC;
  static const unsigned char ident[] = {0x7f, 'E', 'L', 'F', 2, 1, 1};
  memcpy(l->cubin, ident, sizeof ident);
  *st = l;
  return OK;
}
static CUresult link_add_data(void *st, void *data, size_t size) {
  if (!st || ((flink *)st)->magic != LINK_MAGIC || !data || !size) return E_INVALID_VALUE;
  ((flink *)st)->inputs++;
  return OK;
}
EXPORT CUresult cuLinkAddData_v2(void *st, int type, void *data, size_t size, const char *name, unsigned n, void *o, void **v) {
  (void)type; (void)name; (void)n; (void)o; (void)v;
  return link_add_data(st, data, size);
}
// The pre-6.5 entry point (what cuGetProcAddress gives for versions before 6050), same parameters.
EXPORT CUresult cuLinkAddData(void *st, int type, void *data, size_t size, const char *name, unsigned n, void *o, void **v) {
  (void)type; (void)name; (void)n; (void)o; (void)v;
  return link_add_data(st, data, size);
}
EXPORT CUresult cuLinkAddFile_v2(void *st, int type, const char *path, unsigned n, void *o, void **v) {
  (void)type; (void)n; (void)o; (void)v;
  if (!st || ((flink *)st)->magic != LINK_MAGIC || !path) return E_INVALID_VALUE;
  ((flink *)st)->inputs++;
  return OK;
}
EXPORT CUresult cuLinkComplete(void *st, void **cubin, size_t *size) {
  if (!st || ((flink *)st)->magic != LINK_MAGIC || !((flink *)st)->inputs) return E_INVALID_VALUE;
  *cubin = ((flink *)st)->cubin;
  *size = sizeof ((flink *)st)->cubin;
  return OK;
}
EXPORT CUresult cuLinkDestroy(void *st) {
  if (!st || ((flink *)st)->magic != LINK_MAGIC) return E_INVALID_VALUE;
  ((flink *)st)->magic = 0;
  free(st);
  return OK;
}
EXPORT CUresult cuModuleLoadDataEx(void **m, const void *img, unsigned n, void *o, void **v) { (void)n; (void)o; (void)v; if (!image_ok(img)) return E_INVALID_IMAGE; *m = mod_new(img); return OK; }
EXPORT CUresult cuModuleLoadFatBinary(void **m, const void *img) { if (!image_ok(img)) return E_INVALID_IMAGE; *m = mod_new(img); return OK; }
EXPORT CUresult cuModuleLoad(void **m, const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return 301;  // CUDA_ERROR_FILE_NOT_FOUND
  fclose(f);
  *m = mod_new(NULL);
  return OK;
}
static CUresult unload(void *m, int lib) {
  if (!m || ((mod *)m)->magic != MOD_MAGIC || ((mod *)m)->lib != lib || ((mod *)m)->of) return E_INVALID_HANDLE;
  ((mod *)m)->loaded = 0;
  return OK;
}
EXPORT CUresult cuModuleUnload(void *m) { return unload(m, 0); }
// module_view: the CUmodule of library l, made once.
static mod *module_view(mod *l) {
  if (!l->view) {
    mod *v = calloc(1, sizeof *v);
    if (!v) return NULL;
    v->magic = MOD_MAGIC, v->loaded = 1, v->of = l;
    l->view = v;
  }
  return l->view;
}
// Internal calls go through static functions, never through exported symbols (which a preloaded
// shim interposes: the real driver's internal calls are not visible to it either).
static CUresult get_function(void **f, void *m, const char *name);
EXPORT CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
  return is_lib(m) ? E_INVALID_HANDLE : get_function(f, m, name);
}
static CUresult get_function(void **f, void *m, const char *name) {
  if (!m || ((mod *)m)->magic != MOD_MAGIC) return E_INVALID_HANDLE;
  if (((mod *)m)->of) m = ((mod *)m)->of;
  func *fn = mod_fn(m, name);
  if (!fn) return E_NOT_FOUND;
  *f = fn;
  return OK;
}
EXPORT CUresult cuFuncGetName(const char **n, void *f) { if (!fn_ok(f)) return E_INVALID_HANDLE; *n = ((func *)f)->name; return OK; }
EXPORT CUresult cuFuncGetModule(void **m, void *f) {
  if (!fn_ok(f)) return E_INVALID_HANDLE;
  mod *o = ((func *)f)->mod;
  *m = o->lib ? (void *)module_view(o) : (void *)o;
  return *m ? OK : E_INVALID_HANDLE;
}
// Libraries are modules here too; CUkernel and CUfunction share the representation.
EXPORT CUresult cuLibraryLoadData(void **l, const void *code, void *a, void *b, unsigned c, void *d, void *e, unsigned g) {
  (void)a; (void)b; (void)c; (void)d; (void)e; (void)g;
  COUNT(cuLibraryLoadData);
  if (!image_ok(code)) return E_INVALID_IMAGE;
  if (reject(code)) return 218;
  mod *m = mod_new(code);
  m->lib = 1;
  *l = m;
  return OK;
}
EXPORT CUresult cuLibraryUnload(void *l) { return unload(l, 1); }
EXPORT CUresult cuLibraryGetKernel(void **k, void *l, const char *name) {
  return l && !is_lib(l) ? E_INVALID_HANDLE : get_function(k, l, name);
}
EXPORT CUresult cuLibraryGetModule(void **m, void *l) {
  if (!is_lib(l)) return E_INVALID_HANDLE;
  *m = module_view(l);
  return *m ? OK : E_INVALID_HANDLE;
}
EXPORT CUresult cuKernelGetFunction(void **f, void *k) { if (!fn_ok(k)) return E_INVALID_HANDLE; *f = k; return OK; }
EXPORT CUresult cuKernelGetName(const char **n, void *k) { return cuFuncGetName(n, k); }

// ---- memory ----
static atomic_int sticky;  // the context's sticky error
// bad_log reports a bad access on stderr, or appended to the file $FAKE_CUDA_LOG (the first 20 of
// them; none with FAKE_CUDA_QUIET=1).
static void bad_log(const char *what, uint64_t a, uint64_t n, int code) {
  static atomic_int logged;
  const char *q = getenv("FAKE_CUDA_QUIET"), *path = getenv("FAKE_CUDA_LOG");
  if ((q && *q == '1') || atomic_fetch_add(&logged, 1) >= 20) return;
  FILE *f = path && *path ? fopen(path, "a") : NULL;
  fprintf(f ? f : stderr, "fake-cuda[%d]: bad access (error %d): %s [%#llx, +%llu): %s\n", (int)getpid(), code, what,
          (unsigned long long)a, (unsigned long long)n, code == 716 ? "misaligned" : "not mapped with the access it needs");
  if (f) fclose(f);
}
static CUresult fault(CUresult code) {
  COUNT(bad_access);
  int zero = 0;
  atomic_compare_exchange_strong(&sticky, &zero, code);
  return code;
}
static CUresult sticky_err(void) { return atomic_load(&sticky); }
EXPORT void fake_clear_error(void) { atomic_store(&sticky, 0); }
// cuMemAlloc memory is host memory (malloc) kept in a table, so that cuPointerGetAttribute,
// cuMemGetAddressRange and cuIpcGetMemHandle answer for it and cuMemFree of anything else fails.
typedef struct { uint64_t base; size_t size; void *ctx; } dalloc;
static dalloc *dallocs;
static size_t ndallocs, capdallocs;
static pthread_mutex_t dalloc_mu = PTHREAD_MUTEX_INITIALIZER;
// dalloc_find (dalloc_mu held): the allocation holding p (exact: its base), or -1.
static long dalloc_find(uint64_t p, int exact) {
  for (size_t i = 0; i < ndallocs; i++)
    if (exact ? dallocs[i].base == p : p - dallocs[i].base < (dallocs[i].size ? dallocs[i].size : 1)) return (long)i;
  return -1;
}
// dalloc_new: a new allocation of n bytes in the current context (what cuMemAlloc_v2 and an
// imported pool pointer get; cuMemFree frees both).
static CUresult dalloc_new(CUdeviceptr *p, size_t n) {
  void *m = malloc(n ? n : 1);
  if (!m) return E_OUT_OF_MEMORY;
  pthread_mutex_lock(&dalloc_mu);
  if (ndallocs == capdallocs) {
    size_t c = capdallocs ? 2 * capdallocs : 64;
    dalloc *x = realloc(dallocs, c * sizeof *x);
    if (!x) {
      pthread_mutex_unlock(&dalloc_mu);
      free(m);
      return E_OUT_OF_MEMORY;
    }
    dallocs = x, capdallocs = c;
  }
  dallocs[ndallocs++] = (dalloc){(uint64_t)(uintptr_t)m, n, current};
  pthread_mutex_unlock(&dalloc_mu);
  *p = (CUdeviceptr)(uintptr_t)m;
  return OK;
}
// FAKE_CUDA_ALLOC_FAIL_KB=K: a cuMemAlloc_v2 of K KiB or more is out of memory (2).
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  COUNT(cuMemAlloc_v2);
  if (!current) return 201;
  if (!p) return E_INVALID_VALUE;
  if (sticky_err()) return sticky_err();
  const char *fk = getenv("FAKE_CUDA_ALLOC_FAIL_KB");
  if (fk && *fk && n >= strtoull(fk, NULL, 10) * 1024) return 2;
  return dalloc_new(p, n);
}
// Rows padded to 512 bytes (the texture pitch alignment of current GPUs); one allocation of pitch * h.
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned elem) {
  if (!p || !pitch || !w || !h || (elem != 4 && elem != 8 && elem != 16)) return E_INVALID_VALUE;
  size_t pp = (w + 511) & ~(size_t)511;
  CUresult r = cuMemAlloc_v2(p, pp * h);
  if (r == OK) *pitch = pp;
  return r;
}
// Only the base of a live cuMemAlloc allocation is freed (0 is accepted and ignored).
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
  COUNT(cuMemFree_v2);
  if (!p) return OK;
  pthread_mutex_lock(&dalloc_mu);
  long i = dalloc_find(p, 1);
  if (i >= 0) dallocs[i] = dallocs[--ndallocs];
  pthread_mutex_unlock(&dalloc_mu);
  if (i < 0) return E_INVALID_VALUE;
  free((void *)(uintptr_t)p);
  return OK;
}
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, void *s) { (void)s; return cuMemAlloc_v2(p, n); }
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, void *s) { (void)s; COUNT(cuMemAllocAsync_ptsz); return cuMemAlloc_v2(p, n); }
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, void *s) { (void)s; return cuMemFree_v2(p); }
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, void *s) { (void)s; return cuMemFree_v2(p); }
EXPORT CUresult cuMemAllocHost_v2(void **p, size_t n) { *p = malloc(n); return OK; }
EXPORT CUresult cuMemFreeHost(void *p) { free(p); return OK; }

// ---- virtual memory management (cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess) ----
// Modelled on host memory so that misuse crashes or fails as on a GPU: a reservation is a
// PROT_NONE anonymous mapping (2 MiB aligned), a physical allocation a memfd, cuMemMap maps it
// MAP_SHARED|MAP_FIXED still PROT_NONE, cuMemSetAccess makes it readable/writable, cuMemUnmap puts
// PROT_NONE anonymous memory back. A handle is invalid after cuMemRelease; its memory lives until
// it is also unmapped. FAKE_CUDA_VMM_LIMIT_MB caps the bytes of live physical allocations
// (CUDA_ERROR_OUT_OF_MEMORY beyond; by default the device's 80 GiB). Device memory in a reservation
// without the access an operation needs is never touched, and the operation counts as
// fake_calls("bad_access"). As the driver (580, H100) does: copies and memsets are refused when
// submitted (CUDA_ERROR_INVALID_VALUE, nothing sticks); a kernel (k_count*, ptxmig_chunk_hash)
// faults when it runs: CUDA_ERROR_ILLEGAL_ADDRESS sticks to the context, returned by later
// launches, copies, allocations and synchronizations (fake_clear_error() resets it); so does a
// copy whose memory was unmapped between its submission and its turn.
#define GRAN ((size_t)2 << 20)
typedef struct { int type, handle_types; struct { int type, id; } loc; } mem_prop;  // CUmemAllocationProp's head
typedef struct { struct { int type, id; } loc; int flags; } mem_access;            // CUmemAccessDesc
typedef struct phys { unsigned long long h; int fd; size_t size; int released, maps, holds; } phys;  // holds: create/import + retains
typedef struct vrange { uint64_t base; size_t size; phys *p; int prot; } vrange;  // a reservation or a mapping
static pthread_rwlock_t vmm_lock = PTHREAD_RWLOCK_INITIALIZER;
static vrange *resv, *maps;  // each sorted by base, disjoint
static size_t nresv, capresv, nmaps, capmaps;
static phys **physs;
static size_t nphys, capphys, phys_bytes;
static atomic_int vmm_active;  // set by the first reservation: device accesses are checked from then on
static unsigned long long next_handle = 0x1000;
typedef struct { uint64_t base; size_t size; unsigned flags; } hostreg;
static hostreg *hregs;
static size_t nhregs, caphregs;
static pthread_mutex_t hreg_mu = PTHREAD_MUTEX_INITIALIZER;

static int grow(void **a, size_t *cap, size_t n, size_t elem) {
  if (n < *cap) return 0;
  size_t c = *cap ? 2 * *cap : 16;
  void *x = realloc(*a, c * elem);
  if (!x) return -1;
  *a = x, *cap = c;
  return 0;
}
static int vr_insert(vrange **a, size_t *n, size_t *cap, vrange v) {
  if (grow((void **)a, cap, *n, sizeof v)) return -1;
  size_t i = *n;
  for (; i > 0 && (*a)[i - 1].base > v.base; i--) (*a)[i] = (*a)[i - 1];
  (*a)[i] = v;
  (*n)++;
  return 0;
}
static void vr_delete(vrange *a, size_t *n, size_t i) { memmove(&a[i], &a[i + 1], (*n - i - 1) * sizeof *a), (*n)--; }
// vr_below: how many ranges start below e (the last of them is the only one that can reach e).
static size_t vr_below(const vrange *a, size_t n, uint64_t e) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (a[mid].base < e) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}
static long vr_find(const vrange *a, size_t n, uint64_t p) {
  size_t i = vr_below(a, n, p + 1);
  return i && p - a[i - 1].base < a[i - 1].size ? (long)(i - 1) : -1;
}
static int vr_overlaps(const vrange *a, size_t n, uint64_t b, size_t len) {
  size_t i = vr_below(a, n, b + len);
  return i && a[i - 1].base + a[i - 1].size > b;
}
// vr_span: whether [b, b + len) is exactly a run of adjacent ranges of a (first index in *first,
// count in *cnt).
static int vr_span(const vrange *a, size_t n, uint64_t b, size_t len, size_t *first, size_t *cnt) {
  long i = vr_find(a, n, b);
  if (i < 0 || a[i].base != b || !len) return 0;
  uint64_t cur = b, e = b + len;
  size_t k = (size_t)i;
  while (k < n && a[k].base == cur && cur < e) cur += a[k++].size;
  *first = (size_t)i, *cnt = k - (size_t)i;
  return cur == e;
}
// vmm_bad (vmm_lock held): whether [a, a + n) touches a reservation without being mapped throughout
// with the access `need` (PROT_READ or PROT_WRITE) asks for. Memory outside reservations is the
// fake's plain host memory: not checked.
static int vmm_bad(uint64_t a, size_t n, int need) {
  if (!n || !vr_overlaps(resv, nresv, a, n)) return 0;
  if (a + n < a) return 1;
  for (uint64_t cur = a; cur < a + n;) {
    long i = vr_find(maps, nmaps, cur);
    if (i < 0 || (maps[i].prot & need) != need) return 1;
    cur = maps[i].base + maps[i].size;
  }
  return 0;
}
// The device side of copies, memsets and kernels: vmm_enter takes the read lock once reservations
// exist (mappings then cannot change under an access) and says whether it did.
static int vmm_enter(void) {
  if (!atomic_load(&vmm_active)) return 0;
  pthread_rwlock_rdlock(&vmm_lock);
  return 1;
}
static void vmm_exit(int locked) { if (locked) pthread_rwlock_unlock(&vmm_lock); }
// vmm_refused: the driver's check when a copy or memset is submitted.
static int vmm_refused(const char *what, uint64_t a, size_t n, int need) {
  int lk = vmm_enter(), bad = lk && vmm_bad(a, n, need);
  vmm_exit(lk);
  if (bad) COUNT(bad_access), bad_log(what, a, n, E_INVALID_VALUE);
  return bad;
}

static CUresult prop_check(const void *pp) {
  const mem_prop *p = pp;
  if (!p || p->type != 1 /* CU_MEM_ALLOCATION_TYPE_PINNED */ || p->loc.type != 1 /* CU_MEM_LOCATION_TYPE_DEVICE */) return E_INVALID_VALUE;
  return p->loc.id == 0 ? OK : 101;  // CUDA_ERROR_INVALID_DEVICE
}
// The driver answers for any property here (a bad device or type included).
EXPORT CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int option) {
  if (!inited) return E_NOT_INITIALIZED;
  if (!g || !prop || (option != 0 && option != 1)) return E_INVALID_VALUE;  // MINIMUM, RECOMMENDED
  *g = GRAN;
  return OK;
}
EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
  COUNT(cuMemAddressReserve);
  if (!inited) return E_NOT_INITIALIZED;
  if (!ptr || !size || size % GRAN || (align & (align - 1)) || flags) return E_INVALID_VALUE;
  size_t al = align > GRAN ? align : GRAN;
  const int mf = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  uint8_t *p = MAP_FAILED;
  if (addr && addr % al == 0) {  // a hint, honoured where free
    p = mmap((void *)(uintptr_t)addr, size, PROT_NONE, mf | MAP_FIXED_NOREPLACE, -1, 0);
    if (p != MAP_FAILED && (uint64_t)(uintptr_t)p != addr) munmap(p, size), p = MAP_FAILED;
  }
  if (p == MAP_FAILED) {
    uint8_t *q = mmap(NULL, size + al, PROT_NONE, mf, -1, 0);
    if (q == MAP_FAILED) return E_OUT_OF_MEMORY;
    p = (uint8_t *)(((uintptr_t)q + al - 1) & ~(uintptr_t)(al - 1));
    if (p > q) munmap(q, (size_t)(p - q));
    if (q + size + al > p + size) munmap(p + size, (size_t)(q + size + al - (p + size)));
  }
  pthread_rwlock_wrlock(&vmm_lock);
  int bad = vr_insert(&resv, &nresv, &capresv, (vrange){(uint64_t)(uintptr_t)p, size, NULL, 0});
  if (!bad) atomic_store(&vmm_active, 1);
  pthread_rwlock_unlock(&vmm_lock);
  if (bad) {
    munmap(p, size);
    return E_OUT_OF_MEMORY;
  }
  *ptr = (CUdeviceptr)(uintptr_t)p;
  return OK;
}
// Exactly one whole reservation, with nothing mapped in it.
EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  COUNT(cuMemAddressFree);
  pthread_rwlock_wrlock(&vmm_lock);
  long i = vr_find(resv, nresv, ptr);
  CUresult r = E_INVALID_VALUE;
  if (i >= 0 && resv[i].base == ptr && resv[i].size == size && !vr_overlaps(maps, nmaps, ptr, size)) {
    munmap((void *)(uintptr_t)ptr, size);
    vr_delete(resv, &nresv, (size_t)i);
    r = OK;
  }
  pthread_rwlock_unlock(&vmm_lock);
  return r;
}
static long phys_find(unsigned long long h) {  // a live (unreleased) handle
  for (size_t i = 0; i < nphys; i++)
    if (physs[i]->h == h && !physs[i]->released) return (long)i;
  return -1;
}
static void phys_drop(phys *p) {  // released and unmapped: the memory goes
  if (!p->released || p->maps) return;
  for (size_t i = 0; i < nphys; i++)
    if (physs[i] == p) {
      physs[i] = physs[--nphys];
      break;
    }
  phys_bytes -= p->size;
  close(p->fd);
  free(p);
}
// FAKE_CUDA_VMM_FAIL_AT=FILE: while FILE holds a count N, each cuMemCreate counts it down and the
// one that finds 1 fails with CUDA_ERROR_OUT_OF_MEMORY and removes FILE (a test arms one failure
// at a chosen moment by writing the file).
// FAKE_CUDA_IMPORT_FAIL_AT=FILE: the same for cuMemImportFromShareableHandle.
static int fail_now(const char *var);
static int vmm_fail_now(void) { return fail_now("FAKE_CUDA_VMM_FAIL_AT"); }
static int fail_now(const char *var) {
  const char *path = getenv(var);
  if (!path || !*path) return 0;
  FILE *fp = fopen(path, "r+");
  if (!fp) return 0;
  long n = 0;
  int fail = fscanf(fp, "%ld", &n) == 1 && n <= 1;
  if (!fail) {
    rewind(fp);
    fprintf(fp, "%ld\n", n - 1);
  }
  fclose(fp);
  if (fail) unlink(path);
  return fail;
}
EXPORT CUresult cuMemCreate(unsigned long long *h, size_t n, const void *prop, unsigned long long f) {
  COUNT(cuMemCreate);
  if (!inited) return E_NOT_INITIALIZED;
  if (vmm_fail_now()) return E_OUT_OF_MEMORY;
  CUresult r = prop_check(prop);
  if (r) return r;
  if (!h || !n || n % GRAN || f) return E_INVALID_VALUE;
  const char *lim = getenv("FAKE_CUDA_VMM_LIMIT_MB");
  unsigned long long limit = lim && *lim ? strtoull(lim, NULL, 10) << 20 : 80ULL << 30;  // cuDeviceTotalMem
  pthread_rwlock_wrlock(&vmm_lock);
  r = E_OUT_OF_MEMORY;
  phys *p = NULL;
  if (phys_bytes + n <= limit && phys_bytes + n >= n && !grow((void **)&physs, &capphys, nphys, sizeof *physs) &&
      (p = calloc(1, sizeof *p)) != NULL) {
    p->fd = memfd_create("fake-cuda-vmm", MFD_CLOEXEC);
    if (p->fd >= 0 && ftruncate(p->fd, (off_t)n) == 0) {
      p->h = next_handle++;
      p->size = n;
      p->holds = 1;
      physs[nphys++] = p;
      phys_bytes += n;
      *h = p->h;
      r = OK;
    } else {
      if (p->fd >= 0) close(p->fd);
      free(p);
    }
  }
  pthread_rwlock_unlock(&vmm_lock);
  return r;
}
EXPORT CUresult cuMemRelease(unsigned long long h) {
  COUNT(cuMemRelease);
  pthread_rwlock_wrlock(&vmm_lock);
  long i = phys_find(h);
  if (i >= 0 && --physs[i]->holds == 0) {
    physs[i]->released = 1;
    phys_drop(physs[i]);
  }
  pthread_rwlock_unlock(&vmm_lock);
  return i >= 0 ? OK : E_INVALID_VALUE;
}
// A whole allocation (a non-zero offset or another size: CUDA_ERROR_NOT_SUPPORTED, as from the
// driver), granule-aligned, inside one reservation (stricter than the driver, which lets a mapping
// run past a reservation's end), over no other mapping.
EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t off, unsigned long long h, unsigned long long f) {
  COUNT(cuMemMap);
  if (!size || ptr % GRAN || size % GRAN || f) return E_INVALID_VALUE;
  pthread_rwlock_wrlock(&vmm_lock);
  CUresult r = E_INVALID_VALUE;
  long i = phys_find(h), ri = vr_find(resv, nresv, ptr);
  if (i >= 0 && (off || size != physs[i]->size)) r = 801;
  else if (i >= 0 && ri >= 0 && ptr + size - resv[ri].base <= resv[ri].size && !vr_overlaps(maps, nmaps, ptr, size)) {
    phys *p = physs[i];
    if (vr_insert(&maps, &nmaps, &capmaps, (vrange){ptr, size, p, 0})) {
      r = E_OUT_OF_MEMORY;
    } else if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, p->fd, 0) == MAP_FAILED) {
      vr_delete(maps, &nmaps, (size_t)vr_find(maps, nmaps, ptr));
      r = E_OUT_OF_MEMORY;
    } else {
      p->maps++;
      r = OK;
    }
  }
  pthread_rwlock_unlock(&vmm_lock);
  return r;
}
// Whole mappings only: one, or several adjacent ones. The driver also takes a range with gaps or
// nothing mapped (it fails only on a mapping cut in two); the fake refuses those, to catch
// double unmaps.
EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  COUNT(cuMemUnmap);
  pthread_rwlock_wrlock(&vmm_lock);
  size_t first, cnt;
  int ok = vr_span(maps, nmaps, ptr, size, &first, &cnt);
  if (ok) {
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    for (size_t k = 0; k < cnt; k++) {
      phys *p = maps[first].p;
      vr_delete(maps, &nmaps, first);
      p->maps--;
      phys_drop(p);
    }
  }
  pthread_rwlock_unlock(&vmm_lock);
  return ok ? OK : E_INVALID_VALUE;
}
// A fully mapped range of whole mappings; one descriptor for device 0: none, read or read-write.
EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *descs, size_t count) {
  COUNT(cuMemSetAccess);
  const mem_access *d = descs;
  if (!d || count < 1) return E_INVALID_VALUE;
  int prot = -1;
  for (size_t i = 0; i < count; i++) {
    if (d[i].loc.type != 1) return E_INVALID_VALUE;
    if (d[i].loc.id != 0) return E_INVALID_VALUE;  // as the driver answers for a device it lacks
    prot = d[i].flags == 0 ? PROT_NONE : d[i].flags == 1 ? PROT_READ : d[i].flags == 3 ? PROT_READ | PROT_WRITE : -2;
    if (prot == -2) return E_INVALID_VALUE;
  }
  pthread_rwlock_wrlock(&vmm_lock);
  size_t first, cnt;
  int ok = vr_span(maps, nmaps, ptr, size, &first, &cnt) && mprotect((void *)(uintptr_t)ptr, size, prot) == 0;
  for (size_t k = 0; ok && k < cnt; k++) maps[first + k].prot = prot;
  pthread_rwlock_unlock(&vmm_lock);
  return ok ? OK : E_INVALID_VALUE;
}
// fake_vmm(what): the fake's VMM state, for tests: "phys_bytes" (live physical memory), "phys"
// (live physical allocations, released ones still mapped included), "handles" (unreleased ones),
// "reservations", "mappings", "host_registered", "allocs" (live cuMemAlloc allocations); -1 else.
EXPORT long fake_vmm(const char *what) {
  long v = -1;
  pthread_rwlock_rdlock(&vmm_lock);
  if (strcmp(what, "phys_bytes") == 0) v = (long)phys_bytes;
  if (strcmp(what, "phys") == 0) v = (long)nphys;
  if (strcmp(what, "handles") == 0) {
    v = 0;
    for (size_t i = 0; i < nphys; i++) v += !physs[i]->released;
  }
  if (strcmp(what, "reservations") == 0) v = (long)nresv;
  if (strcmp(what, "mappings") == 0) v = (long)nmaps;
  pthread_rwlock_unlock(&vmm_lock);
  pthread_mutex_lock(&hreg_mu);
  if (strcmp(what, "host_registered") == 0) v = (long)nhregs;
  pthread_mutex_unlock(&hreg_mu);
  pthread_mutex_lock(&dalloc_mu);
  if (strcmp(what, "allocs") == 0) v = (long)ndallocs;
  pthread_mutex_unlock(&dalloc_mu);
  return v;
}

// ---- page-locked host memory ----
EXPORT CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) {
  COUNT(cuMemHostRegister_v2);
  if (!p || !n) return E_INVALID_VALUE;
  uint64_t b = (uint64_t)(uintptr_t)p;
  CUresult r = OK;
  pthread_mutex_lock(&hreg_mu);
  for (size_t i = 0; i < nhregs && !r; i++)
    if (b < hregs[i].base + hregs[i].size && hregs[i].base < b + n) r = 712;  // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
  if (!r && grow((void **)&hregs, &caphregs, nhregs, sizeof *hregs)) r = E_OUT_OF_MEMORY;
  if (!r) hregs[nhregs++] = (hostreg){b, n, flags};
  pthread_mutex_unlock(&hreg_mu);
  return r;
}
EXPORT CUresult cuMemHostRegister(void *p, size_t n, unsigned flags) { return cuMemHostRegister_v2(p, n, flags); }
EXPORT CUresult cuMemHostUnregister(void *p) {
  COUNT(cuMemHostUnregister);
  uint64_t b = (uint64_t)(uintptr_t)p;
  CUresult r = 713;  // CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED; inside a registration: INVALID_VALUE
  pthread_mutex_lock(&hreg_mu);
  for (size_t i = 0; i < nhregs && r; i++)
    if (hregs[i].base == b) hregs[i] = hregs[--nhregs], r = OK;
    else if (b - hregs[i].base < hregs[i].size) r = E_INVALID_VALUE;
  pthread_mutex_unlock(&hreg_mu);
  return r;
}

// ---- pointer queries ----
// ptr_lookup: what p lies in: 1 a cuMemAlloc allocation, 2 a VMM mapping, 3 registered host
// memory; 0 nothing the driver knows. The range: the allocation, the mapping or the registration;
// *rb, *rs (when given): for a mapping its reservation's range, which cuPointerGetAttribute's
// RANGE_START_ADDR and RANGE_SIZE give (as from the driver; cuMemGetAddressRange gives the mapping).
static int ptr_lookup(uint64_t p, uint64_t *base, size_t *size, void **ctx, uint64_t *rb, size_t *rs) {
  pthread_mutex_lock(&dalloc_mu);
  long i = dalloc_find(p, 0);
  if (i >= 0) *base = dallocs[i].base, *size = dallocs[i].size, *ctx = dallocs[i].ctx;
  pthread_mutex_unlock(&dalloc_mu);
  if (i >= 0) {
    if (rb) *rb = *base, *rs = *size;
    return 1;
  }
  pthread_rwlock_rdlock(&vmm_lock);
  i = vr_find(maps, nmaps, p);
  if (i >= 0) *base = maps[i].base, *size = maps[i].size, *ctx = NULL;  // VMM memory belongs to no context
  long ri = i >= 0 ? vr_find(resv, nresv, p) : -1;
  if (ri >= 0 && rb) *rb = resv[ri].base, *rs = resv[ri].size;
  pthread_rwlock_unlock(&vmm_lock);
  if (i >= 0) return 2;
  pthread_mutex_lock(&hreg_mu);
  for (size_t k = 0; k < nhregs && i < 0; k++)
    if (p - hregs[k].base < hregs[k].size) *base = hregs[k].base, *size = hregs[k].size, *ctx = &primary, i = (long)k;
  if (i >= 0 && rb) *rb = *base, *rs = *size;
  pthread_mutex_unlock(&hreg_mu);
  return i >= 0 ? 3 : 0;
}
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
  uint64_t b;
  size_t n;
  void *ctx;
  int k = ptr_lookup(p, &b, &n, &ctx, NULL, NULL);
  if (k != 1 && k != 2) return E_NOT_FOUND;  // as the driver answers for memory it did not allocate
  if (base) *base = b;
  if (size) *size = n;
  return OK;
}
EXPORT CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
  uint64_t b, rb;
  size_t n, rs;
  void *ctx;
  if (!data) return E_INVALID_VALUE;
  int k = ptr_lookup(p, &b, &n, &ctx, &rb, &rs);
  if (!k) return E_INVALID_VALUE;
  switch (attr) {
  case 1: *(void **)data = ctx; return OK;                                  // CONTEXT
  case 2: *(unsigned *)data = k == 3 ? 1 : 2; return OK;                    // MEMORY_TYPE: HOST, DEVICE
  case 3: *(CUdeviceptr *)data = p; return OK;                              // DEVICE_POINTER
  case 8: *(int *)data = 0; return OK;                                      // IS_MANAGED
  case 9: *(int *)data = 0; return OK;                                      // DEVICE_ORDINAL
  case 10: *(int *)data = k == 1; return OK;                                // IS_LEGACY_CUDA_IPC_CAPABLE
  case 11: *(CUdeviceptr *)data = rb; return OK;                            // RANGE_START_ADDR
  case 12: *(size_t *)data = rs; return OK;                                 // RANGE_SIZE
  case 13: *(int *)data = 1; return OK;                                     // MAPPED
  default: return 801;  // CUDA_ERROR_NOT_SUPPORTED: an attribute this fake does not model
  }
}
// CUDA IPC exports cuMemAlloc memory only (VMM memory has its own handles).
EXPORT CUresult cuIpcGetMemHandle(void *handle, CUdeviceptr p) {
  COUNT(cuIpcGetMemHandle);
  uint64_t b;
  size_t n;
  void *ctx;
  if (!handle || ptr_lookup(p, &b, &n, &ctx, NULL, NULL) != 1) return E_INVALID_VALUE;
  uint64_t h[8] = {0x1bcfa4e0ULL, b, n, (uint64_t)getpid()};
  memcpy(handle, h, 64);
  return OK;
}
// Opening a handle maps the exported allocation at a pointer of its own (host memory here), the
// same pointer again for the same handle with a reference count, as the driver does. Unlike the
// driver, the fake also opens handles its own process exported (one process can test both sides).
typedef struct { char reserved[64]; } ipc_handle;
typedef struct { uint64_t base, pid; CUdeviceptr p; long refs; } ipc_open;
static ipc_open ipc_opens[64];
static pthread_mutex_t ipc_mu = PTHREAD_MUTEX_INITIALIZER;
static CUresult ipc_open_handle(CUdeviceptr *p, ipc_handle h, unsigned flags) {
  uint64_t w[8];
  memcpy(w, h.reserved, sizeof w);
  if (!p || w[0] != 0x1bcfa4e0ULL || flags > 1) return E_INVALID_VALUE;
  if (!current) return 201;
  CUresult r = E_OUT_OF_MEMORY;
  pthread_mutex_lock(&ipc_mu);
  int fr = -1;
  for (int i = 0; i < 64; i++) {
    if (ipc_opens[i].refs && ipc_opens[i].base == w[1] && ipc_opens[i].pid == w[3]) {
      ipc_opens[i].refs++, *p = ipc_opens[i].p, r = OK;
      break;
    }
    if (!ipc_opens[i].refs && fr < 0) fr = i;
  }
  void *m;
  if (r != OK && fr >= 0 && (m = calloc(1, w[2] ? w[2] : 1)) != NULL) {
    ipc_opens[fr] = (ipc_open){w[1], w[3], (CUdeviceptr)(uintptr_t)m, 1};
    *p = ipc_opens[fr].p, r = OK;
  }
  pthread_mutex_unlock(&ipc_mu);
  return r;
}
EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *p, ipc_handle h, unsigned flags) { COUNT(cuIpcOpenMemHandle); return ipc_open_handle(p, h, flags); }
EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, ipc_handle h, unsigned flags) { COUNT(cuIpcOpenMemHandle_v2); return ipc_open_handle(p, h, flags); }
EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  COUNT(cuIpcCloseMemHandle);
  CUresult r = E_INVALID_VALUE;
  pthread_mutex_lock(&ipc_mu);
  for (int i = 0; i < 64 && r; i++)
    if (ipc_opens[i].refs && ipc_opens[i].p == p) {
      if (--ipc_opens[i].refs == 0) free((void *)(uintptr_t)p);
      r = OK;
    }
  pthread_mutex_unlock(&ipc_mu);
  return r;
}

// VMM shareable handles: a POSIX file descriptor (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1) of
// the physical allocation's memfd; an import is a new handle on the same memory.
EXPORT CUresult cuMemExportToShareableHandle(void *out, unsigned long long h, int type, unsigned long long f) {
  COUNT(cuMemExportToShareableHandle);
  if (!out || type != 1 || f) return E_INVALID_VALUE;
  pthread_rwlock_rdlock(&vmm_lock);
  long i = phys_find(h);
  int fd = i >= 0 ? dup(physs[i]->fd) : -1;
  pthread_rwlock_unlock(&vmm_lock);
  if (i < 0) return E_INVALID_VALUE;
  if (fd < 0) return E_OUT_OF_MEMORY;
  *(int *)out = fd;
  return OK;
}
EXPORT CUresult cuMemImportFromShareableHandle(unsigned long long *h, void *os, int type) {
  COUNT(cuMemImportFromShareableHandle);
  if (fail_now("FAKE_CUDA_IMPORT_FAIL_AT")) return E_OUT_OF_MEMORY;
  struct stat st;
  int fd = (int)(intptr_t)os;
  if (!h || type != 1 || fstat(fd, &st) || st.st_size <= 0 || (size_t)st.st_size % GRAN) return E_INVALID_VALUE;
  phys *p = calloc(1, sizeof *p);
  if (!p || (p->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0) {
    free(p);
    return E_OUT_OF_MEMORY;
  }
  pthread_rwlock_wrlock(&vmm_lock);
  CUresult r = E_OUT_OF_MEMORY;
  if (!grow((void **)&physs, &capphys, nphys, sizeof *physs)) {
    p->h = next_handle++, p->size = (size_t)st.st_size, p->holds = 1;
    physs[nphys++] = p;
    phys_bytes += p->size;
    *h = p->h;
    r = OK;
  }
  pthread_rwlock_unlock(&vmm_lock);
  if (r) close(p->fd), free(p);
  return r;
}
// The handle of the mapping holding addr, with one more reference (released by cuMemRelease).
EXPORT CUresult cuMemRetainAllocationHandle(unsigned long long *h, void *addr) {
  COUNT(cuMemRetainAllocationHandle);
  if (!h) return E_INVALID_VALUE;
  pthread_rwlock_wrlock(&vmm_lock);
  long i = vr_find(maps, nmaps, (uint64_t)(uintptr_t)addr);
  if (i >= 0) maps[i].p->holds++, maps[i].p->released = 0, *h = maps[i].p->h;  // valid again until released
  pthread_rwlock_unlock(&vmm_lock);
  return i >= 0 ? OK : E_INVALID_VALUE;
}

// Memory pools: handles only (allocations come from cuMemAlloc memory). A pool exports as a memfd
// descriptor; an exported pointer's data names the allocation; importing it gives a new
// allocation of that size, which cuMemFree frees.
typedef struct { int magic, imported; } fpool;
#define POOL_MAGIC 0x9001
static int pool_ok(const void *p) { return p && ((const fpool *)p)->magic == POOL_MAGIC; }
EXPORT CUresult cuMemPoolCreate(void **pool, const void *props) {
  if (!pool || !props) return E_INVALID_VALUE;
  fpool *x = calloc(1, sizeof *x);
  if (!x) return E_OUT_OF_MEMORY;
  x->magic = POOL_MAGIC;
  *pool = x;
  return OK;
}
EXPORT CUresult cuMemPoolDestroy(void *pool) {
  COUNT(cuMemPoolDestroy);
  if (!pool_ok(pool)) return E_INVALID_VALUE;
  ((fpool *)pool)->magic = 0;
  free(pool);
  return OK;
}
EXPORT CUresult cuMemPoolExportToShareableHandle(void *out, void *pool, int type, unsigned long long f) {
  COUNT(cuMemPoolExportToShareableHandle);
  if (!out || !pool_ok(pool) || type != 1 || f) return E_INVALID_VALUE;
  int fd = memfd_create("fake-cuda-pool", MFD_CLOEXEC);
  if (fd < 0) return E_OUT_OF_MEMORY;
  *(int *)out = fd;
  return OK;
}
EXPORT CUresult cuMemPoolImportFromShareableHandle(void **pool, void *h, int type, unsigned long long f) {
  COUNT(cuMemPoolImportFromShareableHandle);
  struct stat st;
  if (!pool || type != 1 || f || fstat((int)(intptr_t)h, &st)) return E_INVALID_VALUE;
  fpool *x = calloc(1, sizeof *x);
  if (!x) return E_OUT_OF_MEMORY;
  x->magic = POOL_MAGIC, x->imported = 1;
  *pool = x;
  return OK;
}
typedef struct { unsigned char reserved[64]; } pool_ptr_data;
EXPORT CUresult cuMemPoolExportPointer(pool_ptr_data *out, CUdeviceptr p) {
  COUNT(cuMemPoolExportPointer);
  if (!out) return E_INVALID_VALUE;
  pthread_mutex_lock(&dalloc_mu);
  long i = dalloc_find(p, 1);
  uint64_t w[8] = {0x9001da7aULL, p, i >= 0 ? dallocs[i].size : 0};
  pthread_mutex_unlock(&dalloc_mu);
  if (i < 0) return E_INVALID_VALUE;
  memcpy(out->reserved, w, sizeof w);
  return OK;
}
EXPORT CUresult cuMemPoolImportPointer(CUdeviceptr *p, void *pool, pool_ptr_data *data) {
  COUNT(cuMemPoolImportPointer);
  uint64_t w[8];
  if (!p || !data || !pool_ok(pool) || !((fpool *)pool)->imported) return E_INVALID_VALUE;
  memcpy(w, data->reserved, sizeof w);
  if (w[0] != 0x9001da7aULL) return E_INVALID_VALUE;
  if (!current) return 201;
  return dalloc_new(p, w[2]);
}

// ---- streams: each a queue of operations run in order by its own thread ----
// Operations on an idle stream that take no time (events, copies, memsets) run inline, so simple
// apps see the same synchronous behaviour as before. Kernels named k_count* do real work: block b
// increments ((u32 *)param0)[b], sleeping FAKE_CUDA_BLOCK_US per block; their twins (…__ptxmig)
// claim blocks from the control block (last parameter) and stop when its preempt word is set, as
// ptxstate's twins do.
typedef struct event { int magic; atomic_int done; double t; } event;
enum { OP_KERNEL, OP_EVENT, OP_MEMSET32, OP_COPY, OP_HOSTFN, OP_WAITEV, OP_MEMSET8, OP_HASH };
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
  unsigned arg1;     // k_count's second argument
  uint64_t hb, hl, hc, ho, hdup;  // ptxmig_chunk_hash: base, len, chunk, out; blocks run gy*gz*by*bz times
  unsigned hbpc, hgx, hbx;        // its bpc, grid.x, blockDim.x
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
// FAKE_CUDA_BLOCK_US_ARG=1: a k_count block runs FAKE_CUDA_BLOCK_US times its second argument (a
// loop count: the same grid takes longer with a larger count).
static unsigned block_us_of(const op *o) {
  const char *v = getenv("FAKE_CUDA_BLOCK_US_ARG");
  return v && *v == '1' && o->arg1 ? block_us() * o->arg1 : block_us();
}
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
  v3 x = {c, NULL, NULL, 0, 0, o->need_rb, (uint32_t *)(uintptr_t)o->out, block_us_of(o)};
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

// kernel_bad: whether a k_count kernel (or twin) would touch reserved memory without access: its
// counters, control block and save/resume areas, checked at its start (a GPU faults at the first
// access; memory must not be unmapped under a running kernel, which would crash the fake).
static int kernel_bad(const op *o) {
  int lk = vmm_enter(), bad = 0;
  if (!lk) return 0;
  const int rw = PROT_READ | PROT_WRITE;
  uint64_t total = o->total;
  if (o->ctl) {
    const uint8_t *c = (const uint8_t *)(uintptr_t)o->ctl;
    bad = vmm_bad(o->ctl, 64, rw);
    uint32_t ver = 0, rb = 0, cap = 0, rcount = 0;
    uint64_t sa = 0, ra = 0;
    if (!bad) {
      memcpy(&total, c + 8, 8), memcpy(&ver, c + 48, 4), memcpy(&sa, c + 64, 8);
      if (o->need_rb && ver >= 3 && sa) bad = vmm_bad(o->ctl, 100, rw);
    }
    if (!bad && o->need_rb && ver >= 3 && sa) {
      memcpy(&rb, c + 72, 4), memcpy(&rcount, c + 80, 4), memcpy(&ra, c + 88, 8), memcpy(&cap, c + 96, 4);
      bad = vmm_bad(sa, (uint64_t)cap * rb, rw) || (ra && vmm_bad(ra, (uint64_t)rcount * rb, PROT_READ));
    }
  }
  if (!bad && o->out) bad = vmm_bad(o->out, total * 4, rw);
  vmm_exit(lk);
  if (bad) {
    char what[256];
    snprintf(what, sizeof what, "kernel %s (counters, control block or save areas) at", o->f->name);
    fault(700), bad_log(what, o->out, total * 4, 700);
  }
  return bad;
}

// hash_exec runs ptxmig_chunk_hash as gpuhash.cu does, for the blocks the launch has: block b sums
// chunk b / bpc's words of part b % bpc (blockDim.x words every bpc * blockDim.x), and adds them
// into out[2c], out[2c + 1] once per thread row (gy * gz * by * bz times).
static void hash_exec(const op *o) {
  uint64_t base = o->hb, len = o->hl, chunk = o->hc, out = o->ho, bx = o->hbx, bpc = o->hbpc;
  if (chunk < 8 || !bpc) return;
  uint64_t nchunks = (len + chunk - 1) / chunk, launched = (o->hgx + bpc - 1) / bpc;
  uint64_t nc = launched < nchunks ? launched : nchunks;
  if (!nc) return;
  if (base % 8 || out % 8) {
    fault(716);  // CUDA_ERROR_MISALIGNED_ADDRESS
    bad_log("ptxmig_chunk_hash over", base, len, 716);
    return;
  }
  int lk = vmm_enter(), bad = 0;
  for (uint64_t c = 0; lk && c < nc && !bad; c++) {
    uint64_t start = c * chunk, nw = (len - start < chunk ? len - start : chunk) / 8;
    bad = vmm_bad(base + start / 8 * 8, nw * 8, PROT_READ);
  }
  if (lk && !bad) bad = vmm_bad(out, nc * 16, PROT_READ | PROT_WRITE);
  if (bad) {
    vmm_exit(lk);
    fault(700);
    bad_log("ptxmig_chunk_hash over", base, len, 700);
    return;
  }
  for (uint64_t c = 0; c < nc; c++) {
    uint64_t start = c * chunk, nw = (len - start < chunk ? len - start : chunk) / 8;
    const uint8_t *w = (const uint8_t *)(uintptr_t)(base + start / 8 * 8);
    uint64_t parts = o->hgx - c * bpc < bpc ? o->hgx - c * bpc : bpc, sums[2] = {0, 0};
    if (parts == bpc) {
      ptxmig_gpuhash_sums(w, nw * 8, 0, sums);
    } else {
      for (uint64_t q = 0; q < parts; q++)
        for (uint64_t j = q * bx; j < nw; j += bpc * bx) ptxmig_gpuhash_sums(w + 8 * j, 8 * (nw - j < bx ? nw - j : bx), j, sums);
    }
    uint64_t *d = (uint64_t *)(uintptr_t)out + 2 * c;
    __atomic_fetch_add(&d[0], sums[0] * o->hdup, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&d[1], sums[1] * o->hdup, __ATOMIC_SEQ_CST);
  }
  vmm_exit(lk);
}

static void op_exec(op *o) {
  int lk;
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
    lk = vmm_enter();
    if (lk && vmm_bad(o->dst, o->n * 4, PROT_WRITE)) fault(700), bad_log("a queued cuMemsetD32 of", o->dst, o->n * 4, 700);
    else
      for (size_t i = 0; i < o->n; i++) __atomic_store_n((uint32_t *)(uintptr_t)o->dst + i, o->val, __ATOMIC_SEQ_CST);
    vmm_exit(lk);
    break;
  case OP_MEMSET8:
    lk = vmm_enter();
    if (lk && vmm_bad(o->dst, o->n, PROT_WRITE)) fault(700), bad_log("a queued cuMemsetD8 of", o->dst, o->n, 700);
    else memset((void *)(uintptr_t)o->dst, (int)(o->val & 0xff), o->n);
    vmm_exit(lk);
    break;
  case OP_COPY:
    lk = vmm_enter();
    if (lk && vmm_bad(o->dst, o->n, PROT_WRITE)) fault(700), bad_log("a queued copy to", o->dst, o->n, 700);
    else memcpy((void *)(uintptr_t)o->dst, o->src, o->n);
    vmm_exit(lk);
    break;
  case OP_HASH:
    hash_exec(o);
    break;
  case OP_HOSTFN:
    o->hfn(o->hdata);
    break;
  case OP_KERNEL: {
    if (kernel_bad(o)) break;
    uint32_t *out = (uint32_t *)(uintptr_t)o->out;
    unsigned us = block_us_of(o);
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
    size_t fl = strlen(o->f->name), ml = strlen("_mid__ptxmig");
    if (fl > ml && strcmp(o->f->name + fl - ml, "_mid__ptxmig") == 0) COUNT(mid_twin_launches);
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
static int instant(const op *o) {
  return o->kind == OP_EVENT || o->kind == OP_MEMSET32 || o->kind == OP_MEMSET8 || o->kind == OP_COPY || o->kind == OP_HASH ||
         (o->kind == OP_KERNEL && !o->out);
}
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
// fork: the child gets the fake's tables and streams unlocked even when another thread was inside
// them at the fork (app_fork: the child records events on the legacy stream and allocates). Lock
// order: streams_mu, the streams, ev_mu, then the memory tables.
static void fork_prepare(void) {
  pthread_mutex_lock(&streams_mu);
  pthread_mutex_lock(&legacy.mu);
  for (int i = 0; i < nstreams; i++) pthread_mutex_lock(&streams[i]->mu);
  pthread_mutex_lock(&ev_mu);
  pthread_mutex_lock(&dalloc_mu);
  pthread_mutex_lock(&hreg_mu);
  pthread_rwlock_wrlock(&vmm_lock);
}
static void fork_after(void) {
  pthread_rwlock_unlock(&vmm_lock);
  pthread_mutex_unlock(&hreg_mu);
  pthread_mutex_unlock(&dalloc_mu);
  pthread_mutex_unlock(&ev_mu);
  for (int i = nstreams - 1; i >= 0; i--) pthread_mutex_unlock(&streams[i]->mu);
  pthread_mutex_unlock(&legacy.mu);
  pthread_mutex_unlock(&streams_mu);
}
__attribute__((constructor)) static void fork_handlers(void) { pthread_atfork(fork_prepare, fork_after, fork_after); }
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
EXPORT CUresult cuStreamSynchronize(void *s) { fstream *f = fs_of(s); if (!f) return E_INVALID_HANDLE; fs_sync(f); return sticky_err(); }
EXPORT CUresult cuStreamSynchronize_ptsz(void *s) { return cuStreamSynchronize(s); }
EXPORT CUresult cuStreamQuery(void *s) { fstream *f = fs_of(s); if (!f) return E_INVALID_HANDLE; return sticky_err() ? sticky_err() : fs_busy(f) ? 600 : OK; }
EXPORT CUresult cuStreamQuery_ptsz(void *s) { return cuStreamQuery(s); }
EXPORT CUresult cuCtxSynchronize(void) {
  fs_sync(&legacy);
  pthread_mutex_lock(&streams_mu);
  int n = nstreams;
  pthread_mutex_unlock(&streams_mu);
  for (int i = 0; i < n; i++) fs_sync(streams[i]);
  return sticky_err();
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
  if (vmm_refused("a copy to", dst, n, PROT_WRITE)) return E_INVALID_VALUE;
  op *o = op_new(OP_COPY);
  o->dst = dst, o->n = n;
  o->src = malloc(n ? n : 1);
  memcpy(o->src, src, n);  // staged at call time, as for pageable host memory
  uint64_t seq = fs_enqueue(f, o);
  if (sync) fs_wait(f, seq);
  return sticky_err();
}
// A device-to-host copy reads the source when it runs (not when it is submitted).
typedef struct { uint64_t dst; const void *src; size_t n; } d2h;
static void d2h_run(void *a) {
  d2h *x = a;
  int lk = vmm_enter();
  if (lk && vmm_bad((uint64_t)(uintptr_t)x->src, x->n, PROT_READ))
    fault(700), bad_log("a queued copy from", (uint64_t)(uintptr_t)x->src, x->n, 700);
  else memcpy((void *)(uintptr_t)x->dst, x->src, x->n);
  vmm_exit(lk);
  free(x);
}
static CUresult d2h_op(void *s, void *dst, uint64_t src, size_t n, int sync) {
  fstream *f = fs_of(s);
  if (!f) return E_INVALID_HANDLE;
  if (vmm_refused("a copy from", src, n, PROT_READ)) return E_INVALID_VALUE;
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
    return sticky_err();
  }
  uint64_t seq = fs_enqueue(f, o);
  if (sync) fs_wait(f, seq);
  return sticky_err();
}
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, void *s) { return copy_op(s, d, h, n, 0); }
EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) { return copy_op(NULL, d, h, n, 1); }
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, void *s) { return d2h_op(s, h, d, n, 0); }
EXPORT CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) { return d2h_op(NULL, h, d, n, 1); }
// Device to device: both ends are checked at submission, the source read when the copy runs.
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr src, size_t n, void *s) {
  COUNT(cuMemcpyDtoDAsync_v2);
  if (vmm_refused("a copy to", d, n, PROT_WRITE)) return E_INVALID_VALUE;
  return d2h_op(s, (void *)(uintptr_t)d, src, n, 0);
}
static CUresult memset32(CUdeviceptr p, unsigned v, size_t n, void *s);
EXPORT CUresult cuMemsetD32Async(CUdeviceptr p, unsigned v, size_t n, void *s) { return memset32(p, v, n, s); }
static CUresult memset32(CUdeviceptr p, unsigned v, size_t n, void *s) {
  COUNT(memset32_async);
  fstream *f = fs_of(s);
  if (!f) return E_INVALID_HANDLE;
  if (vmm_refused("cuMemsetD32 of", p, n * 4, PROT_WRITE)) return E_INVALID_VALUE;
  op *o = op_new(OP_MEMSET32);
  o->dst = p, o->val = v, o->n = n;
  fs_enqueue(f, o);
  return sticky_err();
}
EXPORT CUresult cuMemsetD32_v2(CUdeviceptr p, unsigned v, size_t n) { return memset32(p, v, n, NULL); }
static CUresult memset8(CUdeviceptr p, unsigned char v, size_t n, void *s) {
  fstream *f = fs_of(s);
  if (!f) return E_INVALID_HANDLE;
  if (vmm_refused("cuMemsetD8 of", p, n, PROT_WRITE)) return E_INVALID_VALUE;
  op *o = op_new(OP_MEMSET8);
  o->dst = p, o->val = v, o->n = n;
  fs_enqueue(f, o);
  return sticky_err();
}
EXPORT CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void *s) { return memset8(p, v, n, s); }
EXPORT CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) { return memset8(p, v, n, NULL); }

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
EXPORT CUresult cuEventQuery(void *e) { if (!e || ((event *)e)->magic != 0xe7) return E_INVALID_HANDLE; return sticky_err() ? sticky_err() : atomic_load(&((event *)e)->done) ? OK : 600; }
EXPORT CUresult cuEventSynchronize(void *e) {
  if (!e || ((event *)e)->magic != 0xe7) return E_INVALID_HANDLE;
  pthread_mutex_lock(&ev_mu);
  while (!atomic_load(&((event *)e)->done)) pthread_cond_wait(&ev_cv, &ev_mu);
  pthread_mutex_unlock(&ev_mu);
  return sticky_err();
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
// hash_launch queues ptxmig_chunk_hash (from PTX, with gpuhash.cu's parameters) in stream order.
static CUresult hash_launch(func *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned byz, void *s, void **p, void **x) {
  static const unsigned sizes[5] = {8, 8, 8, 4, 8};
  if (f->nparams != 5) return E_INVALID_VALUE;
  for (int i = 0; i < 5; i++)
    if (f->size[i] != sizes[i]) return E_INVALID_VALUE;
  fstream *fs = fs_of(s);
  if (!fs) return E_INVALID_HANDLE;
  const uint8_t *arg[5];
  for (int i = 0; i < 5; i++) {
    if (p) arg[i] = p[i];
    else if (x && x[0] == (void *)1) arg[i] = (const uint8_t *)x[1] + f->off[i];
    else return E_INVALID_VALUE;
  }
  COUNT(ptxmig_chunk_hash);
  op *o = op_new(OP_HASH);
  memcpy(&o->hb, arg[0], 8), memcpy(&o->hl, arg[1], 8), memcpy(&o->hc, arg[2], 8), memcpy(&o->hbpc, arg[3], 4);
  memcpy(&o->ho, arg[4], 8);
  o->hgx = gx, o->hbx = bx, o->hdup = (uint64_t)gy * gz * byz;
  CUresult r = sticky_err();  // a fault of this launch shows at the next call, as on a GPU
  fs_enqueue(fs, o);
  return r;
}
// kernel_op queues a k_count kernel (or its twin) or the chunk hash; other kernels do nothing.
static CUresult kernel_op(func *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, void *s, void **p, void **x) {
  unsigned threads = bx * by * bz;
  if (f->mod->ptx && strcmp(f->name, PTXMIG_GPUHASH_KERNEL) == 0) return hash_launch(f, gx, gy, gz, bx, by * bz, s, p, x);
  if (strncmp(f->name, "k_count", 7) != 0 || f->nparams < 1) return sticky_err();
  fstream *fs = fs_of(s);
  if (!fs) return sticky_err();
  op *o = op_new(OP_KERNEL);
  o->f = f;
  size_t tl = strlen(f->name), sl = strlen("__ptxmig");
  int twin = tl > sl && strcmp(f->name + tl - sl, "__ptxmig") == 0;
  int has1 = f->nparams >= (twin ? 3 : 2);
  if (p) {
    memcpy(&o->out, p[0], 8);
    if (has1 && p[1]) memcpy(&o->arg1, p[1], 4);
    if (twin) memcpy(&o->ctl, p[f->nparams - 1], 8);
  } else if (x && x[0] == (void *)1) {
    memcpy(&o->out, (uint8_t *)x[1] + f->off[0], 8);
    if (has1) memcpy(&o->arg1, (uint8_t *)x[1] + f->off[1], 4);
    if (twin) memcpy(&o->ctl, (uint8_t *)x[1] + f->off[f->nparams - 1], 8);
  }
  o->total = gx * gy * gz;
  if (twin) o->total = 0;  // the twin reads total_blocks from its control block
  if (twin) {
    // The record layout of K__ptxmig's or of K_mid__ptxmig's kernel K.
    size_t ml = strlen("_mid__ptxmig");
    int is_mid = tl > ml && strcmp(f->name + tl - ml, "_mid__ptxmig") == 0;
    size_t base = is_mid ? tl - ml : tl - sl;
    char gn[200], mn[200];
    snprintf(gn, sizeof gn, "__ptxmig_mid_%.*s", (int)base, f->name);
    // Beside a second, mid-block twin K_mid__ptxmig (ptx instrument --mid-block-twins), K__ptxmig
    // is the block-granular one: the layout describes the other.
    snprintf(mn, sizeof mn, "%.*s_mid__ptxmig", (int)base, f->name);
    for (int i = 0; !is_mid && i < f->mod->nfns; i++)
      if (strcmp(f->mod->fns[i].name, mn) == 0) gn[0] = 0;
    for (int i = 0; gn[0] && i < f->mod->ng; i++)
      if (strcmp(f->mod->g[i].name, gn) == 0) {
        const uint32_t *v = f->mod->g[i].v;
        o->need_rb = (64 + (8ull * v[1] + v[4]) * threads + v[2] + sh + 15) & ~15ull;
      }
  }
  CUresult r = sticky_err();
  fs_enqueue(fs, o);
  return r;
}
#define LAUNCH_BODY(n) COUNT(n); if (!fn_ok(f)) return E_INVALID_HANDLE; if (!gx || !bx) return E_INVALID_VALUE; if (sh > 49152 && (int)sh > ((func *)f)->max_dyn_shmem) return E_INVALID_VALUE; return kernel_op(f, gx, gy, gz, bx, by, bz, sh, s, p, x)
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
    T(cuMemcpyHtoD_v2) T(cuMemcpyDtoHAsync_v2) T(cuMemcpyDtoH_v2) T(cuMemcpyDtoDAsync_v2) T(cuMemsetD32Async) T(cuMemsetD32_v2)
    T(cuEventRecord_ptsz) T(cuEventSynchronize) T(cuStreamWaitEvent) T(cuCtxEnablePeerAccess)
    T(cuCtxDisablePeerAccess) T(cuDeviceCanAccessPeer) T(cuDeviceGetP2PAttribute) T(cuMemGetAllocationGranularity) T(cuMemAddressReserve) T(cuMemAddressFree)
    T(cuMemSetAccess) T(cuMemHostRegister) T(cuMemHostRegister_v2) T(cuMemHostUnregister) T(cuMemGetAddressRange_v2)
    T(cuPointerGetAttribute) T(cuIpcGetMemHandle) T(cuMemsetD8Async) T(cuMemsetD8_v2) T(cuMemAllocPitch_v2)
    T(cuIpcOpenMemHandle) T(cuIpcOpenMemHandle_v2) T(cuIpcCloseMemHandle) T(cuMemExportToShareableHandle)
    T(cuMemImportFromShareableHandle) T(cuMemRetainAllocationHandle) T(cuMemPoolCreate) T(cuMemPoolDestroy)
    T(cuMemPoolExportToShareableHandle) T(cuMemPoolImportFromShareableHandle) T(cuMemPoolExportPointer)
    T(cuMemPoolImportPointer) T(cuLinkCreate_v2) T(cuLinkAddData_v2) T(cuLinkAddData) T(cuLinkAddFile_v2) T(cuLinkComplete)
    T(cuLinkDestroy)
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
                                   "cuStreamDestroy", "cuMemGetAddressRange", "cuMemsetD8", "cuMemAllocPitch"};
  const char *suffix = "";
  for (size_t i = 0; i < sizeof v2 / sizeof v2[0]; i++)
    if (strcmp(sym, v2[i]) == 0 && ver >= 3020) suffix = "_v2";
  if (strcmp(sym, "cuCtxCreate") == 0) suffix = ver >= 13000 ? "_v4" : "_v2";
  if (strcmp(sym, "cuGetProcAddress") == 0 && ver >= 12000) suffix = "_v2";
  if (strcmp(sym, "cuMemHostRegister") == 0 && ver >= 6050) suffix = "_v2";
  if (strcmp(sym, "cuIpcOpenMemHandle") == 0 && ver >= 11000) suffix = "_v2";
  if ((strcmp(sym, "cuLinkCreate") == 0 || strcmp(sym, "cuLinkAddData") == 0 || strcmp(sym, "cuLinkAddFile") == 0) && ver >= 6050) suffix = "_v2";
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
