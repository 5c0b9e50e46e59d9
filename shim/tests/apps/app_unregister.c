// A registration whose bytes go away. The runtime registers a fatbin that lives in an mmap'd
// region, the app loads it with cuLibraryLoadData (as the runtime does lazily), then the
// registration ends (__cudaUnregisterFatBinary) and the region is unmapped, as dlclose does to a
// library's image. The shim borrows registered bytes in place, so it must give the still-loaded
// library a private copy before the unregister returns; status and dumps afterwards must not touch
// the unmapped pages. FATBIN names the fatbin container to use. With FAKE_CUDART_REGISTER_FAIL the
// runtime's registration fails (returns NULL) and the app unregisters the NULL handle as nvcc's
// generated code does: the shim must not keep borrowing bytes it can never be told are gone.
#include <string.h>
#include <sys/mman.h>

#include "common.h"

void **__cudaRegisterFatBinary(void *wrapper);
void __cudaUnregisterFatBinary(void **handle);
int cuInit(unsigned flags);
int cuDevicePrimaryCtxRetain(void **ctx, int dev);
int cuCtxSetCurrent(void *ctx);
int cuLibraryLoadData(void **lib, const void *code, void *jo, void **jv, unsigned nj, void *lo, void **lv, unsigned nl);

typedef struct {
  int magic, version;
  const void *data;
  void *filename;
} fatbin_wrapper;

int main(void) {
  const char *path = getenv("FATBIN");
  FILE *f = path ? fopen(path, "rb") : NULL;
  if (!f) {
    fprintf(stderr, "app_unregister: set FATBIN to a fatbin container\n");
    return 2;
  }
  static unsigned char buf[1 << 20];
  size_t n = fread(buf, 1, sizeof buf, f);
  fclose(f);
  size_t len = (n + 4095) & ~(size_t)4095;
  unsigned char *img = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (img == MAP_FAILED) return 2;
  memcpy(img, buf, n);
  CK(mprotect(img, len, PROT_READ));
  fatbin_wrapper w = {0x466243b1, 1, img, NULL};
  void **h = __cudaRegisterFatBinary(&w);
  if ((h == NULL) != (getenv("FAKE_CUDART_REGISTER_FAIL") != NULL)) return 2;
  CK(cuInit(0));
  void *ctx, *lib;
  CK(cuDevicePrimaryCtxRetain(&ctx, 0));
  CK(cuCtxSetCurrent(ctx));
  CK(cuLibraryLoadData(&lib, &w, NULL, NULL, 0, NULL, NULL, 0));
  __cudaUnregisterFatBinary(h);
  CK(munmap(img, len));
  printf("unregister ok\n");
  wait_harness();
  return 0;
}
