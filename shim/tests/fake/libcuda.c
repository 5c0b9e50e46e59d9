// A fake libcuda.so.1 for the shim's CI tests: no GPU, but the same entry points, ABIs
// (versioned and _ptsz variants) and resolver behaviour as the real driver, plus counters
// (fake_calls) so tests can check that every call the app made reached the "driver" through the
// variant the app asked for.
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
  X(cuMemAllocAsync_ptsz) X(cuCtxCreate_v4) X(cuCtxCreate_v2) X(cuEventCreate) X(cuEventDestroy_v2)
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
typedef struct func { int magic; char name[64]; struct mod *mod; } func;
typedef struct mod { int magic; int loaded; func fns[8]; int nfns; } mod;
#define MOD_MAGIC 0x30d
#define FN_MAGIC 0xf00

static int image_ok(const void *p) {
  const unsigned char *b = p;
  uint32_t m;
  if (!p) return 0;
  memcpy(&m, b, 4);
  return m == 0x466243b1u || m == 0xba55ed50u || (b[0] == 0x7f && b[1] == 'E') || strstr((const char *)b, ".entry") != NULL;
}
// Kernels are found by scanning PTX text for ".entry NAME"; binary images get any requested name.
static mod *mod_new(const void *image) {
  mod *m = calloc(1, sizeof *m);
  m->magic = MOD_MAGIC;
  m->loaded = 1;
  (void)image;
  return m;
}
static func *mod_fn(mod *m, const char *name) {
  for (int i = 0; i < m->nfns; i++)
    if (strcmp(m->fns[i].name, name) == 0) return &m->fns[i];
  if (m->nfns == 8) return NULL;
  func *f = &m->fns[m->nfns++];
  f->magic = FN_MAGIC;
  snprintf(f->name, sizeof f->name, "%s", name);
  f->mod = m;
  return f;
}
static int fn_ok(const void *f) { return f && ((const func *)f)->magic == FN_MAGIC && ((const func *)f)->mod->loaded; }

EXPORT CUresult cuInit(unsigned flags) { (void)flags; COUNT(cuInit); inited = 1; return OK; }
EXPORT CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
EXPORT CUresult cuDeviceGetCount(int *n) { if (!inited) return E_NOT_INITIALIZED; *n = 1; return OK; }
EXPORT CUresult cuDeviceGet(int *d, int i) { if (!inited) return E_NOT_INITIALIZED; if (i != 0) return 101; *d = 0; return OK; }
EXPORT CUresult cuDeviceGetName(char *n, int len, int d) { (void)d; snprintf(n, (size_t)len, "Fake GPU"); return OK; }
EXPORT CUresult cuDeviceTotalMem_v2(size_t *b, int d) { (void)d; *b = (size_t)80 << 30; return OK; }
EXPORT CUresult cuDeviceGetAttribute(int *v, int a, int d) { (void)d; *v = a == 75 ? 9 : 0; return OK; }
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

EXPORT CUresult cuModuleLoadData(void **m, const void *img) { COUNT(cuModuleLoadData); if (!image_ok(img)) return E_INVALID_IMAGE; *m = mod_new(img); return OK; }
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
EXPORT CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
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
  *l = mod_new(code);
  return OK;
}
EXPORT CUresult cuLibraryUnload(void *l) { return cuModuleUnload(l); }
EXPORT CUresult cuLibraryGetKernel(void **k, void *l, const char *name) { return cuModuleGetFunction(k, l, name); }
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

// ---- events: timestamps taken at record time ----
typedef struct { int magic; double t; } event;
static double now_s(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9; }
EXPORT CUresult cuEventCreate(void **e, unsigned f) { (void)f; COUNT(cuEventCreate); if (!current) return 201; event *x = calloc(1, sizeof *x); x->magic = 0xe7; *e = x; return OK; }
EXPORT CUresult cuEventRecord(void *e, void *s) { (void)s; COUNT(cuEventRecord); if (!e || ((event *)e)->magic != 0xe7) return E_INVALID_HANDLE; ((event *)e)->t = now_s(); return OK; }
EXPORT CUresult cuEventQuery(void *e) { return e && ((event *)e)->magic == 0xe7 ? OK : E_INVALID_HANDLE; }
EXPORT CUresult cuEventElapsedTime_v2(float *ms, void *a, void *b) { *ms = (float)((((event *)b)->t - ((event *)a)->t) * 1e3 + 0.25); return OK; }
EXPORT CUresult cuEventDestroy_v2(void *e) { COUNT(cuEventDestroy_v2); if (!e || ((event *)e)->magic != 0xe7) return E_INVALID_HANDLE; ((event *)e)->magic = 0; free(e); return OK; }

// ---- launches ----
#define LAUNCH_BODY(n) COUNT(n); if (!fn_ok(f)) return E_INVALID_HANDLE; if (!gx || !bx) return E_INVALID_VALUE; return OK
EXPORT CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, void *s, void **p, void **x) { (void)gy; (void)gz; (void)by; (void)bz; (void)sh; (void)s; (void)p; (void)x; LAUNCH_BODY(cuLaunchKernel); }
EXPORT CUresult cuLaunchKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, void *s, void **p, void **x) { (void)gy; (void)gz; (void)by; (void)bz; (void)sh; (void)s; (void)p; (void)x; LAUNCH_BODY(cuLaunchKernel_ptsz); }
EXPORT CUresult cuLaunchCooperativeKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, void *s, void **p) { (void)gy; (void)gz; (void)by; (void)bz; (void)sh; (void)s; (void)p; LAUNCH_BODY(cuLaunchCooperativeKernel); }
typedef struct { unsigned gx, gy, gz, bx, by, bz, sh; void *s; void *attrs; unsigned n; } cfg_t;
EXPORT CUresult cuLaunchKernelEx(const cfg_t *c, void *f, void **p, void **x) { (void)p; (void)x; unsigned gx = c->gx, bx = c->bx; LAUNCH_BODY(cuLaunchKernelEx); }
EXPORT CUresult cuLaunchKernelEx_ptsz(const cfg_t *c, void *f, void **p, void **x) { (void)p; (void)x; unsigned gx = c->gx, bx = c->bx; LAUNCH_BODY(cuLaunchKernelEx_ptsz); }
EXPORT CUresult cuGraphLaunch(void *g, void *s) { (void)s; COUNT(cuGraphLaunch); return g ? OK : E_INVALID_HANDLE; }
EXPORT CUresult cuStreamBeginCapture_v2(void *s, int m) { (void)s; (void)m; return OK; }
EXPORT CUresult cuStreamEndCapture(void *s, void **g) { (void)s; *g = (void *)0x6; return OK; }
EXPORT CUresult cuCtxSynchronize(void) { return OK; }

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
                                   "cuEventElapsedTime", "cuDevicePrimaryCtxRelease", "cuStreamBeginCapture"};
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
