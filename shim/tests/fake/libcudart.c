// A fake libcudart.so for the shim's CI tests. Like the real shared runtime it registers fatbins
// from nvcc-generated constructors and reaches the driver only through dlopen("libcuda.so.1") +
// dlsym("cuGetProcAddress_v2") + the resolver, loading modules with cuLibraryLoadData and
// launching with cuLaunchKernelEx on first use (lazy loading).
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))
typedef struct { unsigned x, y, z; } dim3;
typedef int (*gpa_t)(const char *, void **, int, unsigned long long, int *);

static gpa_t gpa;
static int last_error;
static struct reg { void **handle; const void *host; const char *name; void *kernel; } regs[64];
static int nregs;
static struct bin { const void *wrapper; void *lib; } bins[16];
static int nbins;
static struct { dim3 g, b; size_t sh; void *s; } pending_cfg;

static int driver(void) {
  if (gpa) return 0;
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return 35;  // cudaErrorInsufficientDriver
  gpa_t g = (gpa_t)dlsym(h, "cuGetProcAddress_v2");
  if (!g) return 35;
  int (*init)(unsigned) = NULL;
  int (*retain)(void **, int) = NULL;
  int (*setcur)(void *) = NULL;
  g("cuInit", (void **)&init, 12000, 0, NULL);
  g("cuDevicePrimaryCtxRetain", (void **)&retain, 12000, 0, NULL);
  g("cuCtxSetCurrent", (void **)&setcur, 12000, 0, NULL);
  void *ctx;
  if (!init || init(0) || !retain || retain(&ctx, 0) || !setcur || setcur(ctx)) return 3;
  gpa = g;
  return 0;
}

EXPORT void **__cudaRegisterFatBinary(void *wrapper) {
  if (nbins == 16 || getenv("FAKE_CUDART_REGISTER_FAIL")) return NULL;  // a registration that fails
  bins[nbins].wrapper = wrapper;
  return (void **)&bins[nbins++];
}
EXPORT void __cudaRegisterFatBinaryEnd(void **h) { (void)h; }
EXPORT void __cudaUnregisterFatBinary(void **h) { (void)h; }
EXPORT void __cudaRegisterFunction(void **h, const char *hostFun, char *deviceFun, const char *deviceName, int tl,
                                   void *tid, void *bid, void *bd, void *gd, int *ws) {
  (void)deviceFun; (void)tl; (void)tid; (void)bid; (void)bd; (void)gd; (void)ws;
  if (nregs < 64) regs[nregs++] = (struct reg){h, hostFun, deviceName, NULL};
}
EXPORT void __cudaRegisterVar(void **h, char *hv, char *da, const char *dn, int ext, size_t sz, int c, int g) {
  (void)h; (void)hv; (void)da; (void)dn; (void)ext; (void)sz; (void)c; (void)g;
}
EXPORT void __cudaRegisterManagedVar(void **h, void **hv, char *da, const char *dn, int ext, size_t sz, int c, int g) {
  (void)h; (void)hv; (void)da; (void)dn; (void)ext; (void)sz; (void)c; (void)g;
}
EXPORT char __cudaInitModule(void **h) { (void)h; return 1; }
EXPORT unsigned __cudaPushCallConfiguration(dim3 g, dim3 b, size_t sh, void *s) {
  pending_cfg.g = g; pending_cfg.b = b; pending_cfg.sh = sh; pending_cfg.s = s;
  return 0;
}
EXPORT int __cudaPopCallConfiguration(dim3 *g, dim3 *b, size_t *sh, void *s) {
  *g = pending_cfg.g; *b = pending_cfg.b; *sh = pending_cfg.sh; *(void **)s = pending_cfg.s;
  return 0;
}

typedef struct { unsigned gx, gy, gz, bx, by, bz, sh; void *s; void *attrs; unsigned n; } cfg_t;
// kernel_of loads the registering fatbin (first use) and returns the CUkernel of a host stub.
static int kernel_of(const void *func, void **out) {
  int e = driver();
  if (e) return e;
  struct reg *r = NULL;
  for (int i = 0; i < nregs; i++)
    if (regs[i].host == func) r = &regs[i];
  if (!r) return 98;  // cudaErrorInvalidDeviceFunction
  struct bin *bn = (struct bin *)r->handle;
  if (!bn->lib) {
    int (*load)(void **, const void *, void *, void *, unsigned, void *, void *, unsigned) = NULL;
    gpa("cuLibraryLoadData", (void **)&load, 12000, 0, NULL);
    if (!load || load(&bn->lib, bn->wrapper, NULL, NULL, 0, NULL, NULL, 0)) return 200;
  }
  if (!r->kernel) {
    int (*getk)(void **, void *, const char *) = NULL;
    gpa("cuLibraryGetKernel", (void **)&getk, 12000, 0, NULL);
    if (!getk || getk(&r->kernel, bn->lib, r->name)) return 98;
  }
  *out = r->kernel;
  return 0;
}
// CUDA 13 launch stubs: __cudaGetKernel once per stub, then __cudaLaunchKernel.
EXPORT int __cudaGetKernel(void **out, const void *func) { return last_error = kernel_of(func, out); }
EXPORT int __cudaLaunchKernel(void *kernel, dim3 g, dim3 b, void **args, size_t sh, void *s) {
  int (*launch)(const cfg_t *, void *, void **, void **) = NULL;
  if (driver()) return last_error = 35;
  gpa("cuLaunchKernelEx", (void **)&launch, 12000, 0, NULL);
  cfg_t c = {g.x, g.y, g.z, b.x, b.y, b.z, (unsigned)sh, s, NULL, 0};
  if (!launch || launch(&c, kernel, args, NULL)) return last_error = 719;
  return 0;
}
EXPORT int cudaLaunchKernel(const void *func, dim3 g, dim3 b, void **args, size_t sh, void *s) {
  void *k;
  int e = kernel_of(func, &k);
  if (e) return last_error = e;
  return __cudaLaunchKernel(k, g, b, args, sh, s);
}
EXPORT int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
EXPORT int cudaGetDriverEntryPoint(const char *sym, void **pfn, unsigned long long flags, int *st) {
  if (driver()) return 35;
  return gpa(sym, pfn, 13000, flags, st) ? 500 : 0;
}
EXPORT int cudaGetDriverEntryPointByVersion(const char *sym, void **pfn, unsigned ver, unsigned long long flags, int *st) {
  if (driver()) return 35;
  return gpa(sym, pfn, (int)ver, flags, st) ? 500 : 0;
}
