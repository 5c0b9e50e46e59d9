// bench_launch N: the CPU cost of the shim's launch path against the fake driver (no GPU): N
// cuLaunchKernel calls of one function, timed one by one; prints p50/p99/mean in ns.
#include <stdlib.h>
#include <time.h>

#include "common.h"

typedef int CUresult;
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuCtxSetCurrent(void *);
CUresult cuModuleLoadData(void **, const void *);
CUresult cuModuleGetFunction(void **, void *, const char *);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);

static double now_ns(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec * 1e9 + ts.tv_nsec; }
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 1000000;
  void *ctx, *mod, *fn;
  CK(cuInit(0));
  CK(cuDevicePrimaryCtxRetain(&ctx, 0));
  CK(cuCtxSetCurrent(ctx));
  CK(cuModuleLoadData(&mod, test_ptx));
  CK(cuModuleGetFunction(&fn, mod, "k_test"));
  double *t = malloc(sizeof(double) * (size_t)n), sum = 0;
  for (int i = 0; i < n; i++) {
    double a = now_ns();
    CK(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
    t[i] = now_ns() - a;
    sum += t[i];
  }
  qsort(t, (size_t)n, sizeof t[0], cmp);
  printf("launch_ns p50=%.0f p99=%.0f mean=%.0f n=%d\n", t[n / 2], t[(size_t)(n * 0.99)], sum / n, n);
  return 0;
}
