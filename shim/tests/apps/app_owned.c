// Owned-memory test app (fake driver; Go test checkpoint/owned_test.go): allocates, through the
// driver API, region A (6 MiB, rewritten every step after checking it still holds the step
// before's pattern), region B (10 MiB, written once: "weights"),
// region C (4 KiB, below the owned minimum: the driver's), and a pitched region P, fills them
// with a known pattern, then every STEP_MS writes A with the step number and checks all of them
// through copies to the host. It writes "step N ok" (or "step N BAD ...", and exits 3) to
// $APP_STATE as one line replaced each step, so a test can follow it across a CRIU dump and
// restore. Before the loop it prints the pointer queries (range of an interior pointer of A and
// B, IPC of B) on stdout: "range A base size", "ipc B rc".
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "common.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuCtxSetCurrent(void *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemGetAddressRange_v2(CUdeviceptr *, size_t *, CUdeviceptr);
CUresult cuIpcGetMemHandle(void *, CUdeviceptr);

static void fill(uint32_t *h, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; i++) h[i] = (uint32_t)(i * 2654435761u) ^ seed;
}

static void put_state(const char *path, const char *text) {
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  ssize_t w = write(fd, text, strlen(text));
  (void)w;
  close(fd);
  rename(tmp, path);
}

int main(void) {
  const char *state = getenv("APP_STATE");
  long step_ms = getenv("STEP_MS") ? atol(getenv("STEP_MS")) : 50;
  if (!state) return 2;
  void *ctx;
  CK(cuInit(0));
  CK(cuDevicePrimaryCtxRetain(&ctx, 0));
  CK(cuCtxSetCurrent(ctx));
  const size_t na = 6 << 20, nb = 10 << 20, nc = 4096, pw = 1000, ph = 300;
  CUdeviceptr a, b, c, p;
  size_t pitch;
  CK(cuMemAlloc_v2(&a, na));
  CK(cuMemAlloc_v2(&b, nb));
  CK(cuMemAlloc_v2(&c, nc));
  CK(cuMemAllocPitch_v2(&p, &pitch, pw * 4, ph, 4));
  uint32_t *h = malloc(nb), *g = malloc(nb);
  fill(h, nb / 4, 0xb0b0);
  CK(cuMemcpyHtoD_v2(b, h, nb));
  fill(h, nc / 4, 0xc0c0);
  CK(cuMemcpyHtoD_v2(c, h, nc));
  fill(h, pitch * ph / 4, 0xd0d0);
  CK(cuMemcpyHtoD_v2(p, h, pitch * ph));
  CUdeviceptr base;
  size_t size;
  CK(cuMemGetAddressRange_v2(&base, &size, a + 12345));
  printf("range A %s %zu\n", base == a ? "base" : "other", size);
  char ipc[64];
  printf("ipc B %d\n", cuIpcGetMemHandle(ipc, b));
  printf("pitch %zu\n", pitch);
  fflush(stdout);
  // APP_EXTRA_MIB: one more region, written once and never checked (throughput experiments).
  size_t extra = getenv("APP_EXTRA_MIB") ? (size_t)atol(getenv("APP_EXTRA_MIB")) << 20 : 0;
  if (extra) {
    CUdeviceptr x;
    CK(cuMemAlloc_v2(&x, extra));
    for (size_t o = 0; o < extra; o += nb) {
      fill(h, nb / 4, (uint32_t)o);
      CK(cuMemcpyHtoD_v2(x + o, h, extra - o < nb ? extra - o : nb));
    }
  }
  for (unsigned long s = 1;; s++) {
    const char *bad = NULL;
    if (s > 1) {  // A still holds the last step's pattern: memory moved while it slept is not stale
      fill(h, na / 4, (uint32_t)(s - 1));
      CK(cuMemcpyDtoH_v2(g, a, na));
      if (memcmp(g, h, na)) bad = "A (stale)";
    }
    fill(h, na / 4, (uint32_t)s);
    CK(cuMemcpyHtoD_v2(a, h, na));
    CK(cuMemcpyDtoH_v2(g, a, na));
    if (!bad && memcmp(g, h, na)) bad = "A";
    fill(h, nb / 4, 0xb0b0);
    CK(cuMemcpyDtoH_v2(g, b, nb));
    if (!bad && memcmp(g, h, nb)) bad = "B";
    fill(h, nc / 4, 0xc0c0);
    CK(cuMemcpyDtoH_v2(g, c, nc));
    if (!bad && memcmp(g, h, nc)) bad = "C";
    fill(h, pitch * ph / 4, 0xd0d0);
    CK(cuMemcpyDtoH_v2(g, p, pitch * ph));
    if (!bad && memcmp(g, h, pitch * ph)) bad = "P";
    char line[128];
    snprintf(line, sizeof line, "step %lu %s%s\n", s, bad ? "BAD " : "ok", bad ? bad : "");
    put_state(state, line);
    if (bad) return 3;
    struct timespec ts = {step_ms / 1000, (step_ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
  }
}
