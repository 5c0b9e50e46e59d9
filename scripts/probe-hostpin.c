/* probe-hostpin MIB — what parking device memory in a process's own host memory costs: for a
 * fresh anonymous mapping of MIB MiB, per way of preparing it (4 KiB pages or transparent huge
 * pages; faulted in by the copy or populated first), the time to populate, cuMemHostRegister, copy
 * MIB from the device, cuMemHostUnregister; and a pageable cuMemcpyDtoH of the same bytes.
 * Prints one line per way. With a second argument, "hold" or "hold-reg": allocate MIB on the device
 * and MIB of host memory (THP, populated; "hold-reg" also cuMemHostRegister'ed), print "ready",
 * wait for a line on stdin (meanwhile checkpoint and restore the process with scripts/cuckpt),
 * then copy host -> device -> host and print whether the bytes survived and the copy rates.
 * Also "threads N": register MIB in N pieces from N threads, the time of all.
 * Build: cc -O2 -pthread -o probe-hostpin probe-hostpin.c -ldl (no CUDA headers). */
#include <pthread.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
typedef int CUresult;
static CUresult (*cuInit)(unsigned), (*cuDeviceGet)(int *, int), (*cuDevicePrimaryCtxRetain)(void **, int),
    (*cuCtxSetCurrent)(void *), (*cuMemAlloc)(uint64_t *, size_t), (*cuMemHostRegister)(void *, size_t, unsigned),
    (*cuMemHostUnregister)(void *), (*cuMemcpyDtoH)(void *, uint64_t, size_t), (*cuMemsetD8)(uint64_t, unsigned char, size_t);
static CUresult (*cuMemcpyHtoD)(uint64_t, const void *, size_t);
struct piece {
  unsigned char *p;
  size_t n;
  int r;  // in: 2 unregisters; out: the result
};
static void *ctx;
static void *reg_piece(void *a) {
  struct piece *x = a;
  cuCtxSetCurrent(ctx);
  if (x->n) x->r = x->r == 2 ? cuMemHostUnregister(x->p) : cuMemHostRegister(x->p, x->n, 0);
  return NULL;
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }
#define SYM(n) if (!(*(void **)&n = dlsym(h, #n "_v2")) && !(*(void **)&n = dlsym(h, #n))) { fprintf(stderr, "no %s\n", #n); return 1; }
int main(int argc, char **argv) {
  size_t n = (argc > 1 ? strtoull(argv[1], 0, 10) : 1024) << 20;
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
  SYM(cuInit) SYM(cuDeviceGet) SYM(cuDevicePrimaryCtxRetain) SYM(cuCtxSetCurrent) SYM(cuMemAlloc) SYM(cuMemHostRegister)
  SYM(cuMemHostUnregister) SYM(cuMemcpyDtoH) SYM(cuMemsetD8) SYM(cuMemcpyHtoD)
  int dev; uint64_t d;
  int hold = argc > 2 && strncmp(argv[2], "hold", 4) == 0;
  size_t dn = hold ? 64u << 20 : n;  // hold: a small device buffer, so the driver's checkpoint time is its own
  if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx) || cuMemAlloc(&d, dn) || cuMemsetD8(d, 7, dn)) {
    fprintf(stderr, "CUDA setup failed\n"); return 1;
  }
  if (hold) {
    int reg = strcmp(argv[2], "hold-reg") == 0;
    unsigned char *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    madvise(p, n, MADV_HUGEPAGE);
    madvise(p, n, MADV_POPULATE_WRITE);
    if (reg && cuMemHostRegister(p, n, 0)) { fprintf(stderr, "register failed\n"); return 1; }
    for (size_t o = 0; o < n; o += dn) cuMemcpyDtoH(p + o, d, n - o < dn ? n - o : dn);
    printf("ready %d\n", reg);
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) return 1;
    int ok = p[0] == 7 && p[n - 1] == 7;
    memset(p, 9, n);
    double t0 = now();
    CUresult r1 = cuMemcpyHtoD(d, p, dn);
    double t1 = now();
    memset(p, 0, dn);
    CUresult r2 = cuMemcpyDtoH(p, d, dn);
    double t2 = now();
    printf("after restore: host bytes kept %d; %zu MiB h->d %.2f ms (%d) d->h %.2f ms (%d) round trip %d\n", ok, dn >> 20, t1 - t0, r1, t2 - t1, r2, p[dn / 3] == 9);
    return 0;
  }
  if (argc > 3 && strcmp(argv[2], "threads") == 0) {
    int nt = atoi(argv[3]);
    if (nt < 1 || nt > 64) return 2;
    unsigned char *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    madvise(p, n, MADV_HUGEPAGE);
    madvise(p, n, MADV_POPULATE_WRITE);
    struct piece ps[64];
    pthread_t th[64];
    size_t each = (n / nt + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    for (int i = 0; i < nt; i++) {
      size_t off = (size_t)i * each;
      ps[i] = (struct piece){p + off, off >= n ? 0 : (n - off < each ? n - off : each), 0};
    }
    double t0 = now();
    for (int i = 0; i < nt; i++) pthread_create(&th[i], NULL, reg_piece, &ps[i]);
    for (int i = 0; i < nt; i++) pthread_join(th[i], NULL);
    double t1 = now();
    int bad = 0;
    for (int i = 0; i < nt; i++) bad |= ps[i].r;
    for (int i = 0; i < nt; i++) ps[i].r = 2;
    for (int i = 0; i < nt; i++) pthread_create(&th[i], NULL, reg_piece, &ps[i]);
    for (int i = 0; i < nt; i++) pthread_join(th[i], NULL);
    printf("threads %d: register %zu MiB %.1f ms (%d) unregister %.1f ms\n", nt, n >> 20, t1 - t0, bad, now() - t1);
    return 0;
  }
  const char *ways[] = {"4k-fresh", "4k-populated", "thp-fresh", "thp-populated", "pageable-4k", "pageable-thp-populated"};
  for (int w = 0; w < 6; w++) {
    unsigned char *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) { perror("mmap"); return 1; }
    int thp = strstr(ways[w], "thp") != NULL, pop = strstr(ways[w], "populated") != NULL, pageable = w >= 4;
    madvise(p, n, thp ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    double t0 = now();
    int pr = pop ? madvise(p, n, MADV_POPULATE_WRITE) : 0;
    double t1 = now();
    CUresult r1 = pageable ? 0 : cuMemHostRegister(p, n, 0);
    double t2 = now();
    CUresult r2 = cuMemcpyDtoH(p, d, n);
    double t3 = now();
    CUresult r3 = pageable ? 0 : cuMemHostUnregister(p);
    double t4 = now();
    printf("%-24s %6zu MiB populate %8.1f ms (%d) register %8.1f ms (%d) copy %8.1f ms %6.1f GB/s (%d) unregister %7.1f ms (%d) check %d\n", ways[w], n >> 20,
           t1 - t0, pr, t2 - t1, r1, t3 - t2, n / ((t3 - t2) * 1e6), r2, t4 - t3, r3, p[n / 2] == 7);
    /* a second register of the same, now present, pages (what an unstash pays) */
    if (!pageable) {
      double t5 = now();
      CUresult r4 = cuMemHostRegister(p, n, 0);
      double t6 = now();
      cuMemHostUnregister(p);
      printf("%-24s %6zu MiB register again %8.1f ms (%d) unregister %7.1f ms\n", ways[w], n >> 20, t6 - t5, r4, now() - t6);
    }
    munmap(p, n);
  }
  return 0;
}
