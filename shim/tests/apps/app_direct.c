// Reaches the driver through directly linked symbols (-lcuda), as Triton/cupy/NCCL do.
#include <sys/wait.h>

#include "common.h"

typedef int CUresult;
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuCtxSetCurrent(void *);
CUresult cuCtxEnablePeerAccess(void *, unsigned);
CUresult cuCtxDisablePeerAccess(void *);
CUresult cuModuleLoadData(void **, const void *);
CUresult cuModuleGetFunction(void **, void *, const char *);
CUresult cuModuleUnload(void *);
CUresult cuMemAlloc_v2(unsigned long long *, size_t);
CUresult cuMemFree_v2(unsigned long long);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
CUresult cuLaunchKernel_ptsz(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
long fake_calls(const char *);

int main(void) {
  void *ctx, *mod, *fn;
  unsigned long long d;
  CK(cuInit(0));
  CK(cuDevicePrimaryCtxRetain(&ctx, 0));
  CK(cuCtxSetCurrent(ctx));
  CK(cuModuleLoadData(&mod, test_ptx));
  CK(cuModuleGetFunction(&fn, mod, "k_test"));
  CK(cuMemAlloc_v2(&d, 1 << 20));
  // Peer access: two links enabled, one disabled, one refused call (the shim's status counts 1).
  CK(cuCtxEnablePeerAccess(ctx, 0));
  CK(cuCtxEnablePeerAccess(ctx, 0));
  CK(cuCtxDisablePeerAccess(ctx));
  if (cuCtxEnablePeerAccess(NULL, 0) == 0) return 4;
  int n = 1024;
  void *args[] = {&d, &n};
  for (int i = 0; i < 5; i++) CK(cuLaunchKernel(fn, 4, 1, 1, 256, 1, 1, 0, NULL, args, NULL));
  for (int i = 0; i < 3; i++) CK(cuLaunchKernel_ptsz(fn, 8, 1, 1, 128, 1, 1, 0, NULL, args, NULL));
  // A failed launch reaches the app unchanged and is not counted as a launch.
  if (cuLaunchKernel(fn, 0, 1, 1, 128, 1, 1, 0, NULL, args, NULL) != 1) return 3;
  // fork after CUDA: the child exits through atexit and must leave the parent's socket alone.
  pid_t c = fork();
  if (c == 0) exit(0);
  waitpid(c, NULL, 0);
  printf("fake cuLaunchKernel=%ld cuLaunchKernel_ptsz=%ld\n", fake_calls("cuLaunchKernel"), fake_calls("cuLaunchKernel_ptsz"));
  wait_harness();
  CK(cuMemFree_v2(d));
  CK(cuModuleUnload(mod));
  return 0;
}
