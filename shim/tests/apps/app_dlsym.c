// Reaches the driver through dlopen("libcuda.so.1") + dlsym(handle, ...), which LD_PRELOAD alone
// does not see.
#include <dlfcn.h>

#include "common.h"

typedef int CUresult;
#define SYM(var, name)                                               \
  do {                                                               \
    *(void **)&var = dlsym(h, name);                                 \
    if (!var) { fprintf(stderr, "dlsym %s: %s\n", name, dlerror()); return 2; } \
  } while (0)

int main(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
  CUresult (*init)(unsigned), (*retain)(void **, int), (*setcur)(void *), (*load)(void **, const void *),
      (*getfn)(void **, void *, const char *), (*alloc)(unsigned long long *, size_t), (*memfree)(unsigned long long),
      (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **),
      (*unload)(void *);
  long (*calls)(const char *);
  SYM(init, "cuInit"); SYM(retain, "cuDevicePrimaryCtxRetain"); SYM(setcur, "cuCtxSetCurrent");
  SYM(load, "cuModuleLoadData"); SYM(getfn, "cuModuleGetFunction"); SYM(alloc, "cuMemAlloc_v2");
  SYM(memfree, "cuMemFree_v2"); SYM(launch, "cuLaunchKernel"); SYM(unload, "cuModuleUnload");
  SYM(calls, "fake_calls");
  if (dlsym(h, "cuNoSuchFunction") != NULL) return 4;
  void *ctx, *mod, *fn;
  unsigned long long d;
  CK(init(0));
  CK(retain(&ctx, 0));
  CK(setcur(ctx));
  CK(load(&mod, test_ptx));
  CK(getfn(&fn, mod, "k_test"));
  CK(alloc(&d, 3 << 20));
  int n = 64;
  void *args[] = {&d, &n};
  for (int i = 0; i < 7; i++) CK(launch(fn, 2, 2, 1, 32, 2, 1, 0, NULL, args, NULL));
  printf("fake cuLaunchKernel=%ld\n", calls("cuLaunchKernel"));
  wait_harness();
  CK(memfree(d));
  CK(unload(mod));
  return 0;
}
