// A runtime-API app: k_host.o is a real nvcc-built host object (testdata/fatbin/gen.sh) whose
// constructor calls __cudaRegisterFatBinary; the fake libcudart then loads and launches through
// cuGetProcAddress_v2 like the real one. Also resolves a driver entry point through the runtime.
#include "common.h"

int fx_launch(float *x, int n);
int cudaGetDriverEntryPoint(const char *sym, void **pfn, unsigned long long flags, int *st);
long fake_calls(const char *) __attribute__((weak));

int main(void) {
  float x[256] = {0};
  for (int i = 0; i < 3; i++) CK(fx_launch(x, 256));
  int (*alloc)(unsigned long long *, size_t) = NULL;
  int st = -1;
  CK(cudaGetDriverEntryPoint("cuMemAlloc", (void **)&alloc, 0, &st));
  unsigned long long d;
  CK(alloc(&d, 2 << 20));
  printf("runtime ok\n");
  wait_harness();
  return 0;
}
