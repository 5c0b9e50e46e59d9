// Interception: exported driver symbols, dlsym, cuGetProcAddress[_v2] and
// cudaGetDriverEntryPoint[ByVersion]. Every wrapper calls the exact real function the caller would
// have reached (per ABI and per-thread-stream variant) and only adds bookkeeping around it.
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shim.h"

shim_config cfg;
intercept_stats istats;

static unsigned env_uint(const char *name, unsigned def) {
  const char *v = getenv(name);
  if (!v || !*v) return def;
  char *end;
  unsigned long x = strtoul(v, &end, 10);
  if (*end || x > 1000000000ul) return def;
  return (unsigned)x;
}

void config_load(void) {
  const char *d = getenv("PTXMIG_DEBUG");
  cfg.debug = d && d[0] == '1';
  const char *sd = getenv("PTXMIG_SOCKET_DIR");
  snprintf(cfg.socket_dir, sizeof cfg.socket_dir, "%s", sd && sd[0] == '/' ? sd : "/run/ptxmig");
  cfg.sample_first = env_uint("PTXMIG_SAMPLE_FIRST", 20);
  cfg.sample_every = env_uint("PTXMIG_SAMPLE_EVERY", 100);
  cfg.capture_max = (uint64_t)env_uint("PTXMIG_CAPTURE_MAX_MB", 2048) << 20;
  const char *lc = getenv("PTXMIG_LIBCUDA");
  snprintf(cfg.libcuda, sizeof cfg.libcuda, "%s", lc && *lc ? lc : "libcuda.so.1");
  const char *st = getenv("PTXMIG_SELF_TIME");
  cfg.self_time = st && st[0] == '1';
}

void shim_log(const char *fmt, ...) {
  if (!cfg.debug) return;
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  int n = snprintf(buf, sizeof buf, "ptxmig-shim[%d]: ", (int)getpid());
  if (n > 0 && (size_t)n < sizeof buf) vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
  va_end(ap);
  size_t len = strlen(buf);
  if (len + 1 < sizeof buf) buf[len++] = '\n';
  ssize_t w = write(2, buf, len);
  (void)w;
}

// ---- the real dlsym and the real driver ----

// The dlsym path can run before anything else in the process, even inside a sanitizer runtime's
// own initialisation (ASan resolves its interceptors through dlsym), so it is never instrumented.
#define NO_SAN __attribute__((no_sanitize("address", "undefined")))
static void *(*real_dlsym)(void *, const char *);
static pthread_once_t dlsym_once = PTHREAD_ONCE_INIT;
NO_SAN static void dlsym_init(void) {
  static const char *vers[] = {"GLIBC_2.34", "GLIBC_2.17", "GLIBC_2.2.5"};
  for (size_t i = 0; i < sizeof vers / sizeof vers[0] && !real_dlsym; i++)
    real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", vers[i]);
}
void *real_dlsym_fn(void *h, const char *name) {
  pthread_once(&dlsym_once, dlsym_init);
  return real_dlsym ? real_dlsym(h, name) : NULL;
}

static void *cuda_h;
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static void cuda_open(void) {
  cuda_h = dlopen(cfg.libcuda, RTLD_NOW | RTLD_LOCAL);
  if (!cuda_h) LOG_ONCE("cannot open the real driver %s: %s", cfg.libcuda, dlerror());
}
void *libcuda_handle(void) {
  pthread_once(&cuda_once, cuda_open);
  return cuda_h;
}
void *drv_sym(const char *name) {
  void *h = libcuda_handle();
  return h ? real_dlsym_fn(h, name) : NULL;
}

// ---- hook table ----
// X(symbol, query name for cuGetProcAddress fallback or NULL, min version, max version (exclusive,
// 0 = none), per-thread-stream variant, library: 0 driver, 1 runtime)
#define HOOKS(X)                                                                  \
  X(cuInit, "cuInit", 0, 0, 0, 0)                                                 \
  X(cuGetExportTable, NULL, 0, 0, 0, 0)                                           \
  X(cuGetProcAddress, "cuGetProcAddress", 0, 12000, 0, 0)                         \
  X(cuGetProcAddress_v2, "cuGetProcAddress", 12000, 0, 0, 0)                      \
  X(cuCtxCreate_v2, "cuCtxCreate", 3020, 13000, 0, 0)                             \
  X(cuCtxCreate_v3, "cuCtxCreate_v3", 0, 0, 0, 0)                                 \
  X(cuCtxCreate_v4, "cuCtxCreate", 13000, 0, 0, 0)                                \
  X(cuCtxDestroy_v2, "cuCtxDestroy", 4000, 0, 0, 0)                               \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 0, 0, 0, 0)             \
  X(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 11000, 0, 0, 0)    \
  X(cuModuleLoad, "cuModuleLoad", 0, 0, 0, 0)                                     \
  X(cuModuleLoadData, "cuModuleLoadData", 0, 0, 0, 0)                             \
  X(cuModuleLoadDataEx, "cuModuleLoadDataEx", 0, 0, 0, 0)                         \
  X(cuModuleLoadFatBinary, "cuModuleLoadFatBinary", 0, 0, 0, 0)                   \
  X(cuModuleUnload, "cuModuleUnload", 0, 0, 0, 0)                                 \
  X(cuModuleGetFunction, "cuModuleGetFunction", 0, 0, 0, 0)                       \
  X(cuLibraryLoadData, "cuLibraryLoadData", 0, 0, 0, 0)                           \
  X(cuLibraryLoadFromFile, "cuLibraryLoadFromFile", 0, 0, 0, 0)                   \
  X(cuLibraryUnload, "cuLibraryUnload", 0, 0, 0, 0)                               \
  X(cuLibraryGetKernel, "cuLibraryGetKernel", 0, 0, 0, 0)                         \
  X(cuLibraryGetModule, "cuLibraryGetModule", 0, 0, 0, 0)                         \
  X(cuKernelGetFunction, "cuKernelGetFunction", 0, 0, 0, 0)                       \
  X(cuLinkComplete, "cuLinkComplete", 0, 0, 0, 0)                                 \
  X(cuMemAlloc_v2, "cuMemAlloc", 3020, 0, 0, 0)                                   \
  X(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, 0, 0, 0)                         \
  X(cuMemFree_v2, "cuMemFree", 3020, 0, 0, 0)                                     \
  X(cuMemAllocManaged, "cuMemAllocManaged", 0, 0, 0, 0)                           \
  X(cuMemAllocHost_v2, "cuMemAllocHost", 3020, 0, 0, 0)                           \
  X(cuMemHostAlloc, "cuMemHostAlloc", 0, 0, 0, 0)                                 \
  X(cuMemFreeHost, "cuMemFreeHost", 0, 0, 0, 0)                                   \
  X(cuMemAllocAsync, "cuMemAllocAsync", 0, 0, 0, 0)                               \
  X(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 0, 0, 1, 0)                          \
  X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 0, 0, 0, 0)               \
  X(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 0, 0, 1, 0)          \
  X(cuMemFreeAsync, "cuMemFreeAsync", 0, 0, 0, 0)                                 \
  X(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 0, 0, 1, 0)                            \
  X(cuMemCreate, "cuMemCreate", 0, 0, 0, 0)                                       \
  X(cuMemRelease, "cuMemRelease", 0, 0, 0, 0)                                     \
  X(cuMemMap, "cuMemMap", 0, 0, 0, 0)                                             \
  X(cuMemUnmap, "cuMemUnmap", 0, 0, 0, 0)                                         \
  X(cuLaunchKernel, "cuLaunchKernel", 0, 0, 0, 0)                                 \
  X(cuLaunchKernel_ptsz, "cuLaunchKernel", 0, 0, 1, 0)                            \
  X(cuLaunchKernelEx, "cuLaunchKernelEx", 0, 0, 0, 0)                             \
  X(cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 0, 0, 1, 0)                        \
  X(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 0, 0, 0, 0)           \
  X(cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 0, 0, 1, 0)      \
  X(cuLaunchCooperativeKernelMultiDevice, NULL, 0, 0, 0, 0)                       \
  X(cuGraphLaunch, "cuGraphLaunch", 0, 0, 0, 0)                                   \
  X(cuGraphLaunch_ptsz, "cuGraphLaunch", 0, 0, 1, 0)                              \
  X(cuStreamBeginCapture, NULL, 0, 0, 0, 0)                                       \
  X(cuStreamBeginCapture_ptsz, NULL, 0, 0, 1, 0)                                  \
  X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 10010, 0, 0, 0)             \
  X(cuStreamBeginCapture_v2_ptsz, "cuStreamBeginCapture", 10010, 0, 1, 0)        \
  X(cuStreamBeginCaptureToGraph, "cuStreamBeginCaptureToGraph", 0, 0, 0, 0)       \
  X(cuStreamBeginCaptureToGraph_ptsz, "cuStreamBeginCaptureToGraph", 0, 0, 1, 0)  \
  X(cuStreamEndCapture, "cuStreamEndCapture", 0, 0, 0, 0)                         \
  X(cuStreamEndCapture_ptsz, "cuStreamEndCapture", 0, 0, 1, 0)                    \
  X(__cudaRegisterFatBinary, NULL, 0, 0, 0, 1)                                    \
  X(__cudaUnregisterFatBinary, NULL, 0, 0, 0, 1)                                  \
  X(__cudaRegisterFunction, NULL, 0, 0, 0, 1)                                     \
  X(cudaGetDriverEntryPoint, NULL, 0, 0, 0, 1)                                    \
  X(cudaGetDriverEntryPoint_ptsz, NULL, 0, 0, 0, 1)                               \
  X(cudaGetDriverEntryPointByVersion, NULL, 0, 0, 0, 1)                           \
  X(cudaGetDriverEntryPointByVersion_ptsz, NULL, 0, 0, 0, 1)

enum {
#define X(sym, q, lo, hi, pt, lib) H_##sym,
  HOOKS(X)
#undef X
      H_COUNT
};

typedef struct {
  const char *name, *query;
  int lo, hi, ptsz, lib;
  void *wrapper;
  void *_Atomic real;
} hook_t;
static hook_t hooks[H_COUNT];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;
static void table_init(void);

static void *hook_real(int i) {
  void *p = atomic_load_explicit(&hooks[i].real, memory_order_acquire);
  if (p) return p;
  pthread_once(&table_once, table_init);
  p = hooks[i].lib ? real_dlsym_fn(RTLD_NEXT, hooks[i].name) : drv_sym(hooks[i].name);
  if (!p) return NULL;
  void *expect = NULL;
  if (!atomic_compare_exchange_strong(&hooks[i].real, &expect, p)) p = expect;
  return p;
}
#define REAL(fn) ((__typeof__(&fn))hook_real(H_##fn))
// A wrapper whose real function cannot be found fails the call the way a missing driver would.
#define CALL_REAL(fn, ...)                                                  \
  __typeof__(&fn) real_ = REAL(fn);                                         \
  if (!real_) {                                                             \
    LOG_ONCE("%s: real function not found in %s", #fn, cfg.libcuda);       \
    return 999; /* CUDA_ERROR_UNKNOWN */                                    \
  }                                                                         \
  CUresult r_ = real_(__VA_ARGS__)

static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;
static void resolve_all(void) {
  for (int i = 0; i < H_COUNT; i++) hook_real(i);
}

static int hook_by_wrapper(void *p) {
  for (int i = 0; i < H_COUNT; i++)
    if (hooks[i].wrapper == p) return i;
  return -1;
}

// substitute returns the wrapper for a real driver function pointer handed out by a resolver, or
// the pointer itself when it is not one we wrap (or cannot be matched safely).
static void *substitute(const char *symbol, void *p, int version, unsigned long long flags) {
  pthread_once(&table_once, table_init);
  pthread_once(&resolve_once, resolve_all);
  ctl_ensure_started();
  if (cfg.debug) shim_log("trace: resolve %s version %d flags %llu -> %p", symbol ? symbol : "(entry point)", version, flags, p);
  if (hook_by_wrapper(p) >= 0) return p;
  for (int i = 0; i < H_COUNT; i++)
    if (!hooks[i].lib && atomic_load(&hooks[i].real) == p) return hooks[i].wrapper;
  // Not an exported driver symbol: the real driver's resolver hands out internal entry points,
  // not the addresses of its exported symbols. (symbol, version range, flags) names exactly one
  // ABI, the one of this hook's exported symbol, so the wrapper (which calls that exported
  // symbol, or adopts p when the driver exports none) serves the caller with the same ABI.
  int ptsz = flags == CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
  for (int i = 0; i < H_COUNT && symbol; i++) {
    hook_t *h = &hooks[i];
    if (h->lib || !h->query || strcmp(h->query, symbol) != 0 || h->ptsz != ptsz) continue;
    if (version < h->lo || (h->hi && version >= h->hi)) continue;
    void *expect = NULL;
    if (atomic_compare_exchange_strong(&h->real, &expect, p) || expect) {
      atomic_fetch_add(&istats.by_name, 1);
      return h->wrapper;
    }
    break;
  }
  if (symbol && strncmp(symbol, "cu", 2) == 0) {
    for (int i = 0; i < H_COUNT; i++)
      if (hooks[i].query && strcmp(hooks[i].query, symbol) == 0) {
        atomic_fetch_add(&istats.unmatched, 1);
        shim_log("resolver: %s (version %d, flags %llu) returned an unknown pointer; not wrapped", symbol,
                 version, flags);
        break;
      }
  }
  atomic_fetch_add(&istats.passthrough, 1);
  return p;
}

// ---- dlsym ----
// The exported dlsym is an assembly trampoline (below) that asks dlsym_decide first and otherwise
// tail-jumps into the real dlsym, so the real one sees the caller's return address (RTLD_NEXT).
#define DLSYM_PASS ((void *)1)
static void *dlsym_decide_cu(void *handle, const char *name);
NO_SAN __attribute__((used)) void *ptxmig_dlsym_decide(void *handle, const char *name) {
  if (!name || name[0] != 'c' || name[1] != 'u' || handle == RTLD_NEXT) return DLSYM_PASS;
  return dlsym_decide_cu(handle, name);
}
static void *dlsym_decide_cu(void *handle, const char *name) {
  pthread_once(&dlsym_once, dlsym_init);
  pthread_once(&table_once, table_init);
  int i;
  for (i = 0; i < H_COUNT; i++)
    if (strcmp(hooks[i].name, name) == 0) break;
  if (i == H_COUNT) {
    if (cfg.debug) shim_log("trace: dlsym(%p, %s): not hooked", handle, name);
    return DLSYM_PASS;
  }
  void *r = real_dlsym ? real_dlsym(handle, name) : NULL;
  if (!r) return NULL;
  void *mine = hook_real(i);
  if (mine != r) {
    if (cfg.debug) shim_log("trace: dlsym(%p, %s): %p is not the driver's %p", handle, name, r, mine);
    return r;  // a different library's symbol: not ours to wrap
  }
  if (cfg.debug) shim_log("trace: dlsym(%p, %s): wrapped", handle, name);
  atomic_fetch_add(&istats.dlsym_hits, 1);
  ctl_ensure_started();
  return hooks[i].wrapper;
}
NO_SAN __attribute__((used)) void *ptxmig_real_dlsym_ptr(void) {
  pthread_once(&dlsym_once, dlsym_init);
  return (void *)real_dlsym;
}

#if defined(__x86_64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, @function\n"
        "dlsym:\n"
        "  push %rdi\n"
        "  push %rsi\n"
        "  sub $8, %rsp\n"
        "  call ptxmig_dlsym_decide\n"
        "  cmp $1, %rax\n"
        "  jne 1f\n"
        "  call ptxmig_real_dlsym_ptr\n"
        "  add $8, %rsp\n"
        "  pop %rsi\n"
        "  pop %rdi\n"
        "  test %rax, %rax\n"
        "  jz 2f\n"
        "  jmp *%rax\n"
        "1:\n"
        "  add $24, %rsp\n"
        "  ret\n"
        "2:\n"
        "  ret\n"
        ".size dlsym, .-dlsym\n");
#else
EXPORT void *dlsym(void *handle, const char *name) {
  void *r = ptxmig_dlsym_decide(handle, name);
  if (r != DLSYM_PASS) return r;
  void *(*f)(void *, const char *) = (void *(*)(void *, const char *))ptxmig_real_dlsym_ptr();
  return f ? f(handle, name) : NULL;
}
#endif

// ---- resolvers ----
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
  CALL_REAL(cuGetProcAddress, symbol, pfn, version, flags);
  if (r_ == CUDA_SUCCESS && pfn && *pfn) {
    atomic_fetch_add(&istats.getproc_hits, 1);
    *pfn = substitute(symbol, *pfn, version, flags);
  }
  return r_;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                                    CUdriverProcAddressQueryResult *status) {
  CALL_REAL(cuGetProcAddress_v2, symbol, pfn, version, flags, status);
  if (r_ == CUDA_SUCCESS && pfn && *pfn && (!status || *status == CU_GET_PROC_ADDRESS_SUCCESS)) {
    atomic_fetch_add(&istats.getproc_v2_hits, 1);
    *pfn = substitute(symbol, *pfn, version, flags);
  }
  return r_;
}

// The runtime's entry-point queries. The 4th argument of cudaGetDriverEntryPoint did not exist
// before CUDA 12, so it is forwarded but never read. cudaGetDriverEntryPoint takes no version:
// matching is by pointer only (the version given here never selects an ABI).
#define ENTRYPOINT(fn)                                                                            \
  EXPORT cudaError_t fn(const char *symbol, void **pfn, unsigned long long flags, void *status) { \
    __typeof__(&fn) real_ = REAL(fn);                                                             \
    if (!real_) return 49; /* cudaErrorCallRequiresNewerDriver */                                 \
    cudaError_t r = real_(symbol, pfn, flags, status);                                            \
    if (r == cudaSuccess && pfn && *pfn) {                                                        \
      atomic_fetch_add(&istats.entrypoint_hits, 1);                                               \
      *pfn = substitute(NULL, *pfn, 0, flags);                                                    \
    }                                                                                             \
    return r;                                                                                     \
  }
ENTRYPOINT(cudaGetDriverEntryPoint)
ENTRYPOINT(cudaGetDriverEntryPoint_ptsz)
#define ENTRYPOINT_V(fn)                                                                            \
  EXPORT cudaError_t fn(const char *symbol, void **pfn, unsigned int version, unsigned long long flags, \
                        int *status) {                                                              \
    __typeof__(&fn) real_ = REAL(fn);                                                               \
    if (!real_) return 49;                                                                          \
    cudaError_t r = real_(symbol, pfn, version, flags, status);                                     \
    if (r == cudaSuccess && pfn && *pfn && (!status || *status == 0)) {                             \
      atomic_fetch_add(&istats.entrypoint_hits, 1);                                                 \
      *pfn = substitute(symbol, *pfn, (int)version, flags);                                         \
    }                                                                                               \
    return r;                                                                                       \
  }
ENTRYPOINT_V(cudaGetDriverEntryPointByVersion)
ENTRYPOINT_V(cudaGetDriverEntryPointByVersion_ptsz)

// cuGetExportTable hands out the driver's private tables. It passes through untouched; the
// wrapper exists only so PTXMIG_DEBUG=1 shows which tables an app asks for.
EXPORT CUresult cuGetExportTable(const void **table, const CUuuid *id) {
  CALL_REAL(cuGetExportTable, table, id);
  if (cfg.debug && id) {
    const unsigned char *b = (const unsigned char *)id->bytes;
    shim_log("trace: cuGetExportTable(%02x%02x%02x%02x-%02x%02x%02x%02x-%02x%02x%02x%02x-%02x%02x%02x%02x) -> %d",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15], (int)r_);
  }
  return r_;
}

// ---- init and contexts ----
EXPORT CUresult cuInit(unsigned flags) {
  ctl_ensure_started();
  CALL_REAL(cuInit, flags);
  if (r_ == CUDA_SUCCESS) trk_cuinit();
  return r_;
}

EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned flags, CUdevice dev) {
  CALL_REAL(cuCtxCreate_v2, pctx, flags, dev);
  if (r_ == CUDA_SUCCESS && pctx) trk_ctx_add(*pctx, dev, 0);
  return r_;
}
EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, void *params, int n, unsigned flags, CUdevice dev) {
  CALL_REAL(cuCtxCreate_v3, pctx, params, n, flags, dev);
  if (r_ == CUDA_SUCCESS && pctx) trk_ctx_add(*pctx, dev, 0);
  return r_;
}
EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned flags, CUdevice dev) {
  CALL_REAL(cuCtxCreate_v4, pctx, params, flags, dev);
  if (r_ == CUDA_SUCCESS && pctx) trk_ctx_add(*pctx, dev, 0);
  return r_;
}
EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
  samples_drop_ctx(ctx);  // events of this context die with it
  CALL_REAL(cuCtxDestroy_v2, ctx);
  if (r_ == CUDA_SUCCESS) trk_ctx_remove(ctx);
  return r_;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  CALL_REAL(cuDevicePrimaryCtxRetain, pctx, dev);
  if (r_ == CUDA_SUCCESS && pctx) trk_ctx_add(*pctx, dev, 1);
  return r_;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  trk_primary_release(dev);  // the release may destroy the context and its events
  CALL_REAL(cuDevicePrimaryCtxRelease_v2, dev);
  return r_;
}

// ---- modules and libraries ----
EXPORT CUresult cuModuleLoad(CUmodule *m, const char *fname) {
  CALL_REAL(cuModuleLoad, m, fname);
  if (r_ == CUDA_SUCCESS && m) trk_module_add(MS_MODULE_LOAD, *m, NULL, 0, fname);
  return r_;
}
EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image) {
  CALL_REAL(cuModuleLoadData, m, image);
  if (r_ == CUDA_SUCCESS && m) trk_module_add(MS_MODULE_LOAD_DATA, *m, image, 0, NULL);
  return r_;
}
EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned n, CUjit_option *o, void **v) {
  CALL_REAL(cuModuleLoadDataEx, m, image, n, o, v);
  if (r_ == CUDA_SUCCESS && m) trk_module_add(MS_MODULE_LOAD_DATA_EX, *m, image, 0, NULL);
  return r_;
}
EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *fatbin) {
  CALL_REAL(cuModuleLoadFatBinary, m, fatbin);
  if (r_ == CUDA_SUCCESS && m) trk_module_add(MS_MODULE_LOAD_FATBIN, *m, fatbin, 0, NULL);
  return r_;
}
EXPORT CUresult cuModuleUnload(CUmodule m) {
  CALL_REAL(cuModuleUnload, m);
  if (r_ == CUDA_SUCCESS) trk_module_remove(m);
  return r_;
}
EXPORT CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
  CALL_REAL(cuModuleGetFunction, f, m, name);
  if (r_ == CUDA_SUCCESS && f) trk_func_named(*f, m, name);
  return r_;
}
EXPORT CUresult cuLibraryLoadData(CUlibrary *lib, const void *code, CUjit_option *jo, void **jv, unsigned nj,
                                  CUlibraryOption *lo, void **lv, unsigned nl) {
  CALL_REAL(cuLibraryLoadData, lib, code, jo, jv, nj, lo, lv, nl);
  if (r_ == CUDA_SUCCESS && lib) trk_module_add(MS_LIBRARY_LOAD_DATA, *lib, code, 0, NULL);
  return r_;
}
EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *lib, const char *fname, CUjit_option *jo, void **jv, unsigned nj,
                                      CUlibraryOption *lo, void **lv, unsigned nl) {
  CALL_REAL(cuLibraryLoadFromFile, lib, fname, jo, jv, nj, lo, lv, nl);
  if (r_ == CUDA_SUCCESS && lib) trk_module_add(MS_LIBRARY_LOAD_FILE, *lib, NULL, 0, fname);
  return r_;
}
EXPORT CUresult cuLibraryUnload(CUlibrary lib) {
  CALL_REAL(cuLibraryUnload, lib);
  if (r_ == CUDA_SUCCESS) trk_module_remove(lib);
  return r_;
}
EXPORT CUresult cuLibraryGetKernel(CUkernel *k, CUlibrary lib, const char *name) {
  CALL_REAL(cuLibraryGetKernel, k, lib, name);
  if (r_ == CUDA_SUCCESS && k) trk_func_named(*k, lib, name);
  return r_;
}
EXPORT CUresult cuLibraryGetModule(CUmodule *m, CUlibrary lib) {
  CALL_REAL(cuLibraryGetModule, m, lib);
  if (r_ == CUDA_SUCCESS && m) trk_module_alias(*m, lib);
  return r_;
}
EXPORT CUresult cuKernelGetFunction(CUfunction *f, CUkernel k) {
  CALL_REAL(cuKernelGetFunction, f, k);
  if (r_ == CUDA_SUCCESS && f) trk_func_copy(*f, k);
  return r_;
}
EXPORT CUresult cuLinkComplete(CUlinkState st, void **cubin, size_t *size) {
  CALL_REAL(cuLinkComplete, st, cubin, size);
  if (r_ == CUDA_SUCCESS && cubin && *cubin && size) trk_module_add(MS_LINK_COMPLETE, NULL, *cubin, *size, NULL);
  return r_;
}

// The runtime's registration path (shared cudart only; a static cudart calls its own copy).
EXPORT void **__cudaRegisterFatBinary(void *wrapper) {
  ctl_ensure_started();
  __typeof__(&__cudaRegisterFatBinary) real = REAL(__cudaRegisterFatBinary);
  if (!real) {
    LOG_ONCE("__cudaRegisterFatBinary: no CUDA runtime found behind the shim");
    return NULL;
  }
  void **h = real(wrapper);
  if (h) trk_module_add(MS_REGISTER_FATBIN, h, wrapper, 0, NULL);  // NULL: nothing was registered
  return h;
}
// The registered image is borrowed in place (track.c): forget it before the runtime lets the
// library's mapping go.
EXPORT void __cudaUnregisterFatBinary(void **h) {
  trk_module_remove(h);
  __typeof__(&__cudaUnregisterFatBinary) real = REAL(__cudaUnregisterFatBinary);
  if (!real) {
    LOG_ONCE("__cudaUnregisterFatBinary: no CUDA runtime found behind the shim");
    return;
  }
  real(h);
}
EXPORT void __cudaRegisterFunction(void **fatCubinHandle, const char *hostFun, char *deviceFun,
                                   const char *deviceName, int thread_limit, void *tid, void *bid,
                                   void *bDim, void *gDim, int *wSize) {
  __typeof__(&__cudaRegisterFunction) real = REAL(__cudaRegisterFunction);
  if (!real) {
    LOG_ONCE("__cudaRegisterFunction: no CUDA runtime found behind the shim");
    return;
  }
  real(fatCubinHandle, hostFun, deviceFun, deviceName, thread_limit, tid, bid, bDim, gDim, wSize);
}

// ---- memory ----
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size) {
  CALL_REAL(cuMemAlloc_v2, p, size);
  if (r_ == CUDA_SUCCESS && p) trk_alloc_add(*p, size, AK_DEVICE);
  return r_;
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned elem) {
  CALL_REAL(cuMemAllocPitch_v2, p, pitch, w, h, elem);
  if (r_ == CUDA_SUCCESS && p && pitch) trk_alloc_add(*p, *pitch * h, AK_PITCH);
  return r_;
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
  CALL_REAL(cuMemFree_v2, p);
  if (r_ == CUDA_SUCCESS) trk_alloc_remove(p, -1);
  return r_;
}
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t size, unsigned flags) {
  CALL_REAL(cuMemAllocManaged, p, size, flags);
  if (r_ == CUDA_SUCCESS && p) trk_alloc_add(*p, size, AK_MANAGED);
  return r_;
}
EXPORT CUresult cuMemAllocHost_v2(void **p, size_t size) {
  CALL_REAL(cuMemAllocHost_v2, p, size);
  if (r_ == CUDA_SUCCESS && p) trk_alloc_add((uint64_t)(uintptr_t)*p, size, AK_HOST);
  return r_;
}
EXPORT CUresult cuMemHostAlloc(void **p, size_t size, unsigned flags) {
  CALL_REAL(cuMemHostAlloc, p, size, flags);
  if (r_ == CUDA_SUCCESS && p) trk_alloc_add((uint64_t)(uintptr_t)*p, size, AK_HOST);
  return r_;
}
EXPORT CUresult cuMemFreeHost(void *p) {
  CALL_REAL(cuMemFreeHost, p);
  if (r_ == CUDA_SUCCESS) trk_alloc_remove((uint64_t)(uintptr_t)p, AK_HOST);
  return r_;
}
#define ALLOC_ASYNC(fn)                                              \
  EXPORT CUresult fn(CUdeviceptr *p, size_t size, CUstream s) {      \
    CALL_REAL(fn, p, size, s);                                       \
    if (r_ == CUDA_SUCCESS && p) trk_alloc_add(*p, size, AK_ASYNC);  \
    return r_;                                                       \
  }
ALLOC_ASYNC(cuMemAllocAsync)
ALLOC_ASYNC(cuMemAllocAsync_ptsz)
#define ALLOC_POOL(fn)                                                                \
  EXPORT CUresult fn(CUdeviceptr *p, size_t size, CUmemoryPool pool, CUstream s) {    \
    CALL_REAL(fn, p, size, pool, s);                                                  \
    if (r_ == CUDA_SUCCESS && p) trk_alloc_add(*p, size, AK_ASYNC);                   \
    return r_;                                                                        \
  }
ALLOC_POOL(cuMemAllocFromPoolAsync)
ALLOC_POOL(cuMemAllocFromPoolAsync_ptsz)
#define FREE_ASYNC(fn)                                     \
  EXPORT CUresult fn(CUdeviceptr p, CUstream s) {          \
    CALL_REAL(fn, p, s);                                   \
    if (r_ == CUDA_SUCCESS) trk_alloc_remove(p, AK_ASYNC); \
    return r_;                                             \
  }
FREE_ASYNC(cuMemFreeAsync)
FREE_ASYNC(cuMemFreeAsync_ptsz)

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
  CALL_REAL(cuMemCreate, h, size, prop, flags);
  if (r_ == CUDA_SUCCESS && h) trk_alloc_add(*h, size, AK_VMM_PHYS);
  return r_;
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  CALL_REAL(cuMemRelease, h);
  if (r_ == CUDA_SUCCESS) trk_alloc_remove(h, AK_VMM_PHYS);
  return r_;
}
EXPORT CUresult cuMemMap(CUdeviceptr p, size_t size, size_t off, CUmemGenericAllocationHandle h,
                         unsigned long long flags) {
  CALL_REAL(cuMemMap, p, size, off, h, flags);
  if (r_ == CUDA_SUCCESS) trk_alloc_add(p, size, AK_VMM_MAP);
  return r_;
}
EXPORT CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
  CALL_REAL(cuMemUnmap, p, size);
  if (r_ == CUDA_SUCCESS) trk_vmm_unmap(p, size);
  return r_;
}

// ---- launches ----
#define LAUNCH(fn, ptsz, kind)                                                                        \
  EXPORT CUresult fn(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,   \
                     unsigned bz, unsigned shmem, CUstream s, void **params, void **extra) {          \
    launch_tok t;                                                                                     \
    launch_pre(&t, f, gx, gy, gz, bx, by, bz, s, ptsz, kind);                                         \
    CALL_REAL(fn, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);                                \
    launch_post(&t, r_);                                                                              \
    return r_;                                                                                        \
  }
LAUNCH(cuLaunchKernel, 0, LK_NORMAL)
LAUNCH(cuLaunchKernel_ptsz, 1, LK_NORMAL)

#define LAUNCH_COOP(fn, ptsz)                                                                         \
  EXPORT CUresult fn(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,   \
                     unsigned bz, unsigned shmem, CUstream s, void **params) {                        \
    launch_tok t;                                                                                     \
    launch_pre(&t, f, gx, gy, gz, bx, by, bz, s, ptsz, LK_COOPERATIVE);                               \
    CALL_REAL(fn, f, gx, gy, gz, bx, by, bz, shmem, s, params);                                       \
    launch_post(&t, r_);                                                                              \
    return r_;                                                                                        \
  }
LAUNCH_COOP(cuLaunchCooperativeKernel, 0)
LAUNCH_COOP(cuLaunchCooperativeKernel_ptsz, 1)

#define LAUNCH_EX(fn, ptsz)                                                                        \
  EXPORT CUresult fn(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {         \
    launch_tok t = {0};                                                                            \
    if (c) {                                                                                       \
      int kind = LK_EX;                                                                            \
      for (unsigned i = 0; c->attrs && i < c->numAttrs && i < 64; i++)                            \
        if (c->attrs[i].id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE && c->attrs[i].value.cooperative)    \
          kind = LK_COOPERATIVE;                                                                   \
      launch_pre(&t, f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY,         \
                 c->blockDimZ, c->hStream, ptsz, kind);                                            \
    }                                                                                              \
    CALL_REAL(fn, c, f, params, extra);                                                            \
    if (c) launch_post(&t, r_);                                                                    \
    return r_;                                                                                     \
  }
LAUNCH_EX(cuLaunchKernelEx, 0)
LAUNCH_EX(cuLaunchKernelEx_ptsz, 1)

EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *lp, unsigned n, unsigned flags) {
  launch_tok t[16];
  unsigned k = n < 16 ? n : 16;
  for (unsigned i = 0; lp && i < k; i++)
    launch_pre(&t[i], lp[i].function, lp[i].gridDimX, lp[i].gridDimY, lp[i].gridDimZ, lp[i].blockDimX,
               lp[i].blockDimY, lp[i].blockDimZ, lp[i].hStream, 0, LK_COOPERATIVE);
  CALL_REAL(cuLaunchCooperativeKernelMultiDevice, lp, n, flags);
  for (unsigned i = 0; lp && i < k; i++) launch_post(&t[i], r_);
  return r_;
}

#define GRAPH_LAUNCH(fn)                                  \
  EXPORT CUresult fn(CUgraphExec g, CUstream s) {         \
    CALL_REAL(fn, g, s);                                  \
    trk_graph_launch(g, r_);                              \
    return r_;                                            \
  }
GRAPH_LAUNCH(cuGraphLaunch)
GRAPH_LAUNCH(cuGraphLaunch_ptsz)

// Stream capture: while any capture is open the shim records no timing events, since an event
// recorded on a capturing (or, in global mode, the legacy) stream would change the app's graph.
#define BEGIN_CAPTURE1(fn)                   \
  EXPORT CUresult fn(CUstream s) {           \
    trk_capture(+1);                         \
    CALL_REAL(fn, s);                        \
    if (r_ != CUDA_SUCCESS) trk_capture(-1); \
    return r_;                               \
  }
BEGIN_CAPTURE1(cuStreamBeginCapture)
BEGIN_CAPTURE1(cuStreamBeginCapture_ptsz)
#define BEGIN_CAPTURE2(fn)                           \
  EXPORT CUresult fn(CUstream s, CUstreamCaptureMode m) { \
    trk_capture(+1);                                 \
    CALL_REAL(fn, s, m);                             \
    if (r_ != CUDA_SUCCESS) trk_capture(-1);         \
    return r_;                                       \
  }
BEGIN_CAPTURE2(cuStreamBeginCapture_v2)
BEGIN_CAPTURE2(cuStreamBeginCapture_v2_ptsz)
#define BEGIN_CAPTURE_G(fn)                                                                         \
  EXPORT CUresult fn(CUstream s, CUgraph g, const void *deps, const void *edges, size_t n,          \
                     CUstreamCaptureMode m) {                                                       \
    trk_capture(+1);                                                                                \
    CALL_REAL(fn, s, g, deps, edges, n, m);                                                         \
    if (r_ != CUDA_SUCCESS) trk_capture(-1);                                                        \
    return r_;                                                                                      \
  }
BEGIN_CAPTURE_G(cuStreamBeginCaptureToGraph)
BEGIN_CAPTURE_G(cuStreamBeginCaptureToGraph_ptsz)
#define END_CAPTURE(fn)                                                                   \
  EXPORT CUresult fn(CUstream s, CUgraph *g) {                                            \
    CALL_REAL(fn, s, g);                                                                  \
    /* the capture ends unless the stream was not capturing (illegal state) */            \
    if (r_ != 401 && r_ != CUDA_ERROR_INVALID_VALUE && r_ != 400) trk_capture(-1);        \
    return r_;                                                                            \
  }
END_CAPTURE(cuStreamEndCapture)
END_CAPTURE(cuStreamEndCapture_ptsz)

// ---- the table ----
// Cheap on purpose: read the environment and fill the table; nothing is opened or started. Run
// from the constructor, or earlier from the first dlsym/driver call that beats it.
static void table_init(void) {
  config_load();
#define X(sym, q, l, h, pt, lb) \
  hooks[H_##sym] = (hook_t){.name = #sym, .query = q, .lo = l, .hi = h, .ptsz = pt, .lib = lb, .wrapper = (void *)&sym};
  HOOKS(X)
#undef X
}

__attribute__((constructor)) static void hooks_init(void) { pthread_once(&table_once, table_init); }

// ptxmig_shim_info identifies the library (ptxmig ps/Detect, tests).
EXPORT const char ptxmig_shim_version[] = PTXMIG_SHIM_VERSION;
EXPORT const char *ptxmig_shim_info(void) { return ptxmig_shim_version; }
