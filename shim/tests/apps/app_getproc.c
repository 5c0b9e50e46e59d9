// Reaches the driver the way cudart 12/13 does: dlsym("cuGetProcAddress"), ask it for itself
// (12000 -> the 5-argument resolver), then resolve everything by (name, version, flags), with
// per-thread default stream variants and the library API (cuLibraryLoadData + cuLaunchKernelEx).
#include <dlfcn.h>
#include <string.h>

#include "common.h"

typedef int CUresult;
typedef CUresult (*gpa1_t)(const char *, void **, int, unsigned long long);
typedef CUresult (*gpa2_t)(const char *, void **, int, unsigned long long, int *);
static gpa2_t gpa;
static void *get(const char *name, unsigned long long flags) {
  void *p = NULL;
  int st = -1;
  if (gpa(name, &p, 12080, flags, &st) || st != 0 || !p) {
    fprintf(stderr, "cuGetProcAddress_v2(%s): not found\n", name);
    exit(2);
  }
  return p;
}
typedef struct { unsigned gx, gy, gz, bx, by, bz, sh; void *s; void *attrs; unsigned n; } cfg_t;

int main(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return 2;
  gpa1_t gpa1 = (gpa1_t)dlsym(h, "cuGetProcAddress");
  if (!gpa1 || gpa1("cuGetProcAddress", (void **)&gpa, 12000, 0)) return 2;
  CUresult (*init)(unsigned) = get("cuInit", 0);
  CUresult (*retain)(void **, int) = get("cuDevicePrimaryCtxRetain", 0);
  CUresult (*setcur)(void *) = get("cuCtxSetCurrent", 0);
  // Asked with the per-thread default stream flag, as a cudart built for it asks for every entry
  // point: cuModuleLoadData has no _ptsz variant, and the driver answers with the plain one.
  CUresult (*load)(void **, const void *) = get("cuModuleLoadData", 2);
  CUresult (*getfn)(void **, void *, const char *) = get("cuModuleGetFunction", 0);
  CUresult (*alloc)(unsigned long long *, size_t) = get("cuMemAlloc", 0);
  CUresult (*allocasync)(unsigned long long *, size_t, void *) = get("cuMemAllocAsync", 2);
  CUresult (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **) =
      get("cuLaunchKernel", 2);
  CUresult (*libload)(void **, const void *, void *, void *, unsigned, void *, void *, unsigned) = get("cuLibraryLoadData", 0);
  CUresult (*getk)(void **, void *, const char *) = get("cuLibraryGetKernel", 0);
  CUresult (*launchex)(const cfg_t *, void *, void **, void **) = get("cuLaunchKernelEx", 0);
  CUresult (*exporttable)(const void **, const void *) = get("cuGetExportTable", 0);
  long (*calls)(const char *) = (long (*)(const char *))dlsym(h, "fake_calls");
  void *ctx, *mod, *fn, *lib, *k;
  unsigned long long d, a;
  const void *tbl;
  static const unsigned char uuid[16] = {1, 2, 3};
  CK(init(0));
  CK(exporttable(&tbl, uuid));
  CK(retain(&ctx, 0));
  CK(setcur(ctx));
  CK(load(&mod, test_ptx));
  CK(getfn(&fn, mod, "k_test"));
  CK(alloc(&d, 5 << 20));
  CK(allocasync(&a, 7 << 20, NULL));
  int n = 64;
  void *args[] = {&d, &n};
  for (int i = 0; i < 4; i++) CK(launch(fn, 1, 1, 1, 64, 1, 1, 0, NULL, args, NULL));
  CK(libload(&lib, test_ptx, NULL, NULL, 0, NULL, NULL, 0));
  CK(getk(&k, lib, "k_test"));
  cfg_t c = {3, 1, 1, 96, 1, 1, 0, NULL, NULL, 0};
  for (int i = 0; i < 6; i++) CK(launchex(&c, k, args, NULL));
  printf("fake cuLaunchKernel=%ld cuLaunchKernel_ptsz=%ld cuLaunchKernelEx=%ld cuGetExportTable=%ld cuMemAllocAsync_ptsz=%ld\n",
         calls("cuLaunchKernel"), calls("cuLaunchKernel_ptsz"), calls("cuLaunchKernelEx"), calls("cuGetExportTable"),
         calls("cuMemAllocAsync_ptsz"));
  wait_harness();
  return 0;
}
