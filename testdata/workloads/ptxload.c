// ptxload: a driver-API app that JIT-loads a PTX file with cuModuleLoadData and launches from it.
//
//   ptxload FILE.ptx [--kernel NAME] [--n N] [--iters K]
//
// NAME(const float *a, const float *b, float *c, int n) must compute c = a + b (vecadd_kernel.cu).
// Prints "ptxload ok kernel=NAME n=N iters=K" after checking every element on the CPU.
#include <string.h>

#include "drvcheck.h"

static const char *flag(int argc, char **argv, const char *name, const char *def) {
  for (int i = 2; i + 1 < argc; i++)
    if (strcmp(argv[i], name) == 0) return argv[i + 1];
  return def;
}

int main(int argc, char **argv) {
  if (argc < 2 || argv[1][0] == '-') {
    fprintf(stderr, "usage: ptxload FILE.ptx [--kernel NAME] [--n N] [--iters K]\n");
    return 2;
  }
  const char *kname = flag(argc, argv, "--kernel", "vecadd");
  int n = atoi(flag(argc, argv, "--n", "1048576"));
  int iters = atoi(flag(argc, argv, "--iters", "10"));
  FILE *f = fopen(argv[1], "rb");
  if (!f) { perror(argv[1]); return 2; }
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *ptx = malloc(len + 1);
  if (!ptx || fread(ptx, 1, len, f) != (size_t)len) { fprintf(stderr, "read %s failed\n", argv[1]); return 2; }
  ptx[len] = 0;
  fclose(f);

  CUdevice dev;
  CUcontext ctx;
  CUmodule mod;
  CUfunction fn;
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CK(cuModuleLoadData(&mod, ptx));
  CK(cuModuleGetFunction(&fn, mod, kname));

  size_t bytes = (size_t)n * sizeof(float);
  float *ha = malloc(bytes), *hb = malloc(bytes), *hc = malloc(bytes);
  for (int i = 0; i < n; i++) { ha[i] = (float)(i % 1000) * 0.5f; hb[i] = (float)(i % 77) - 3.0f; }
  CUdeviceptr da, db, dc;
  CK(cuMemAlloc(&da, bytes));
  CK(cuMemAlloc(&db, bytes));
  CK(cuMemAlloc(&dc, bytes));
  CK(cuMemcpyHtoD(da, ha, bytes));
  CK(cuMemcpyHtoD(db, hb, bytes));
  void *args[] = {&da, &db, &dc, &n};
  for (int k = 0; k < iters; k++) {
    CK(cuMemsetD32(dc, 0x7fc00000u, n));  // poison with NaN so unwritten elements fail
    CK(cuLaunchKernel(fn, (n + 255) / 256, 1, 1, 256, 1, 1, 0, 0, args, NULL));
  }
  CK(cuCtxSynchronize());
  CK(cuMemcpyDtoH(hc, dc, bytes));
  for (int i = 0; i < n; i++) {
    if (hc[i] != ha[i] + hb[i]) {
      fprintf(stderr, "ptxload: mismatch at %d: %f != %f\n", i, hc[i], ha[i] + hb[i]);
      return 1;
    }
  }
  printf("ptxload ok kernel=%s n=%d iters=%d\n", kname, n, iters);
  CK(cuMemFree(da));
  CK(cuMemFree(db));
  CK(cuMemFree(dc));
  CK(cuModuleUnload(mod));
  CK(cuDevicePrimaryCtxRelease(dev));
  free(ha); free(hb); free(hc); free(ptx);
  return 0;
}
