/* probe-peer MODE [MIB] — does the driver restore a process that uses peer access between two GPUs
 * when the access is turned off for the checkpoint? Measured on one process that another process
 * (scripts/cuckpt) locks, checkpoints, restores and unlocks while it waits.
 *
 *   peer-keep     enable peer access between devices 0 and 1 both ways, check that a kernel on
 *                 each device reads and writes the other's memory, print "ready", wait for a line
 *                 on stdin, check again. The control: driver 580 was seen to refuse the restore of
 *                 such a process (CUDA_ERROR_INVALID_VALUE, docs/PLATFORM.md).
 *   peer-toggle   the same, but peer access is disabled both ways before "ready" and enabled again
 *                 after the line: does the driver restore a process whose peer access was turned
 *                 off for the checkpoint, and does peer access work again after (also with the
 *                 GPUs swapped by the restore's pairs)?
 *   peer-toggle-late     peer-toggle as a runtime does it when an app enables peer access before
 *                 its peer device holds memory (cudaDeviceEnablePeerAccess in twogpu: device 0's
 *                 access to device 1 is enabled before device 1's buffer exists). After the line
 *                 each enable's answer is printed, and one that failed is tried again after the
 *                 other: is its answer an order effect?
 *   peer-toggle-fresh    peer-toggle-late with device 1's context as bare as a runtime's fresh
 *                 one at the first enable: its module is loaded after the link is on.
 *   peer-toggle-big      peer-toggle with device 1 also holding one allocation of MIB (the
 *                 buffers the kernels read stay at most 64 MiB): does the size of the peer's
 *                 memory decide whether its link comes back?
 *   peer-toggle-split    the same MIB in allocations of 64 MiB.
 *   peer-toggle-thread   peer-toggle with the enables after the line made by another thread
 *                 that pushes each context (as the shim's control thread does).
 *   vmm-peer      a context on device 0 only: map memory created on device 1 (cuMemCreate,
 *                 cuMemSetAccess for device 0: a peer mapping without cuCtxEnablePeerAccess), copy
 *                 device 0's memory into it, check it, unmap and release it before "ready"; after
 *                 the line, check device 0's memory and do it again. Does a VMM peer mapping made
 *                 and dropped before the checkpoint leave the driver able to restore the process
 *                 (issue 34: owned memory copied into memory kept on the target GPU)?
 *
 * (Device-to-device moves through memory another process keeps: scripts/probe-holder.c.)
 * Prints "fact: ..." lines and "FAIL: ..." on the first failure (exit 1). MIB (default 1024, at
 * most 64 used) sizes the buffers.
 * Build: cc -O2 -o probe-peer probe-peer.c -ldl (no CUDA headers). Run: scripts/probe-peer.sh. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef uint64_t CUdeviceptr;

static CUresult (*cuInit)(unsigned), (*cuDeviceGet)(int *, int), (*cuDeviceGetCount)(int *),
    (*cuDevicePrimaryCtxRetain)(void **, int), (*cuCtxSetCurrent)(void *), (*cuCtxPushCurrent)(void *), (*cuCtxPopCurrent)(void **), (*cuCtxEnablePeerAccess)(void *, unsigned),
    (*cuCtxDisablePeerAccess)(void *), (*cuMemAlloc)(CUdeviceptr *, size_t), (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t),
    (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t), (*cuCtxSynchronize)(void), (*cuModuleLoadData)(void **, const void *),
    (*cuModuleGetFunction)(void **, void *, const char *),
    (*cuLaunchKernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **),
    (*cuGetErrorName)(CUresult, const char **), (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long),
    (*cuMemAddressFree)(CUdeviceptr, size_t), (*cuMemCreate)(unsigned long long *, size_t, const void *, unsigned long long),
    (*cuMemRelease)(unsigned long long), (*cuMemMap)(CUdeviceptr, size_t, size_t, unsigned long long, unsigned long long),
    (*cuMemUnmap)(CUdeviceptr, size_t), (*cuMemSetAccess)(CUdeviceptr, size_t, const void *, size_t),
    (*cuMemcpyDtoD)(CUdeviceptr, CUdeviceptr, size_t);

/* copy(dst, src, n): dst[i] = src[i] + 1 for i < n (32-bit words); reads one device's memory and
 * writes the other's when given pointers on both. */
static const char *ptx =
    ".version 7.0\n.target sm_70\n.address_size 64\n"
    ".visible .entry copy(.param .u64 dst, .param .u64 src, .param .u32 n)\n{\n"
    "  .reg .pred %p;\n  .reg .b32 %r<7>;\n  .reg .b64 %rd<6>;\n"
    "  ld.param.u64 %rd1, [dst];\n  ld.param.u64 %rd2, [src];\n  ld.param.u32 %r1, [n];\n"
    "  mov.u32 %r2, %ctaid.x;\n  mov.u32 %r3, %ntid.x;\n  mov.u32 %r4, %tid.x;\n  mad.lo.s32 %r5, %r2, %r3, %r4;\n"
    "  setp.ge.u32 %p, %r5, %r1;\n  @%p bra DONE;\n"
    "  mul.wide.u32 %rd3, %r5, 4;\n  add.s64 %rd4, %rd2, %rd3;\n  add.s64 %rd5, %rd1, %rd3;\n"
    "  ld.global.u32 %r6, [%rd4];\n  add.u32 %r6, %r6, 1;\n  st.global.u32 [%rd5], %r6;\n"
    "DONE:\n  ret;\n}\n";

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}
static const char *ename(CUresult r) {
  const char *s = "?";
  if (cuGetErrorName) cuGetErrorName(r, &s);
  return s;
}
#define CK(call)                                                              \
  do {                                                                        \
    CUresult r_ = (call);                                                     \
    if (r_) {                                                                 \
      printf("FAIL: %s: %s (%d) at line %d\n", #call, ename(r_), r_, __LINE__); \
      exit(1);                                                                \
    }                                                                         \
  } while (0)
#define SYM(n, name)                                                            \
  if (!(*(void **)&n = dlsym(h, name "_v2")) && !(*(void **)&n = dlsym(h, name))) { \
    printf("FAIL: no %s in libcuda\n", name);                                   \
    return 1;                                                                   \
  }

static void *ctx[2], *fn[2];
static size_t extra_mib;  // peer-toggle-big/-split: more memory on device 1
static int split;
static uint32_t *host;

static void wait_line(void) {
  printf("ready %d\n", getpid());
  fflush(stdout);
  char b[64];
  if (!fgets(b, sizeof b, stdin)) {
    printf("FAIL: stdin closed\n");
    exit(1);
  }
}

/* on device d's context: dst[i] = src[i] + 1; then check dst holds want + 1. */
static int run_copy(int d, CUdeviceptr dst, CUdeviceptr src, uint32_t n, uint32_t want0) {
  CK(cuCtxSetCurrent(ctx[d]));
  void *args[] = {&dst, &src, &n};
  CK(cuLaunchKernel(fn[d], (n + 255) / 256, 1, 1, 256, 1, 1, 0, 0, args, 0));
  CK(cuCtxSynchronize());
  CK(cuMemcpyDtoH(host, dst, (size_t)n * 4));
  for (uint32_t i = 0; i < n; i++)
    if (host[i] != want0 + i * 3 + 1) return 0;
  return 1;
}

static void fill(int d, CUdeviceptr p, uint32_t n, uint32_t base) {
  for (uint32_t i = 0; i < n; i++) host[i] = base + i * 3;
  CK(cuCtxSetCurrent(ctx[d]));
  CK(cuMemcpyHtoD(p, host, (size_t)n * 4));
}

static void peer_check(const char *when, CUdeviceptr a, CUdeviceptr b, uint32_t n) {
  // a on device 0, b on device 1: device 1's kernel reads a and writes b, device 0's reads b
  // (holding a + 1) and writes a.
  fill(0, a, n, 7);
  int r1 = run_copy(1, b, a, n, 7);   // peer read by device 1
  int r0 = run_copy(0, a, b, n, 8);   // peer read by device 0 (b holds 7 + 3i + 1)
  printf("fact: %s: device 1 reads device 0's memory: %s; device 0 reads device 1's: %s\n", when, r1 ? "ok" : "WRONG",
         r0 ? "ok" : "WRONG");
  if (!r1 || !r0) exit(1);
}

/* enable_from: device d's context gets access to the other's, from this thread (pushing the
 * context when push); prints the answer, returns it. */
static CUresult enable_from(int d, int push, const char *when) {
  void *x;
  CUresult r = push ? cuCtxPushCurrent(ctx[d]) : cuCtxSetCurrent(ctx[d]);
  if (r == 0) r = cuCtxEnablePeerAccess(ctx[1 - d], 0);
  if (push) cuCtxPopCurrent(&x);
  printf("fact: %s: enabling device %d's access to device %d's memory%s: %s (%d)\n", when, d, 1 - d,
         push ? " (another thread, context pushed)" : "", ename(r), r);
  return r;
}

/* reenable: after the restore, both links on again, a failed one tried once more after the other. */
static void *reenable(void *push) {
  double t0 = now();
  CUresult r0 = enable_from(0, push != NULL, "after the restore");
  CUresult r1 = enable_from(1, push != NULL, "after the restore");
  if (r0) r0 = enable_from(0, push != NULL, "after the restore, again after the other link");
  if (r1) r1 = enable_from(1, push != NULL, "after the restore, again after the other link");
  if (r0 || r1) {
    printf("FAIL: peer access could not be enabled again after the restore\n");
    exit(1);
  }
  printf("fact: peer access enabled again both ways after the restore (%.2f ms)\n", now() - t0);
  return NULL;
}

static void load(int d) {
  void *mod;
  CK(cuCtxSetCurrent(ctx[d]));
  CK(cuModuleLoadData(&mod, ptx));
  CK(cuModuleGetFunction(&fn[d], mod, "copy"));
}

static void peer(int toggle, int late, int fresh, int thread, uint32_t n) {
  CUdeviceptr a, b;
  CK(cuCtxSetCurrent(ctx[0]));
  CK(cuMemAlloc(&a, (size_t)n * 4));
  if (late) CK(cuCtxEnablePeerAccess(ctx[1], 0));  // device 1 holds no memory of ours yet
  if (fresh) load(1);
  CK(cuCtxSetCurrent(ctx[1]));
  CK(cuMemAlloc(&b, (size_t)n * 4));
  if (extra_mib) {
    size_t piece = split ? 64 : extra_mib;
    CUdeviceptr x;
    for (size_t done = 0; done < extra_mib; done += piece) CK(cuMemAlloc(&x, piece << 20));
    printf("fact: device 1 also holds %zu MiB in allocations of %zu MiB\n", extra_mib, piece);
  }
  if (!late) {
    CK(cuCtxSetCurrent(ctx[0]));
    CK(cuCtxEnablePeerAccess(ctx[1], 0));
  }
  CK(cuCtxSetCurrent(ctx[1]));
  CK(cuCtxEnablePeerAccess(ctx[0], 0));
  peer_check("before the checkpoint, peer access on", a, b, n);
  if (toggle) {
    CK(cuCtxSetCurrent(ctx[0]));
    CK(cuCtxDisablePeerAccess(ctx[1]));
    CK(cuCtxSetCurrent(ctx[1]));
    CK(cuCtxDisablePeerAccess(ctx[0]));
    printf("fact: peer access disabled both ways for the checkpoint\n");
  }
  wait_line();
  if (toggle && thread) {
    pthread_t th;
    if (pthread_create(&th, NULL, reenable, (void *)1) || pthread_join(th, NULL)) {
      printf("FAIL: no thread\n");
      exit(1);
    }
  } else if (toggle) {
    reenable(NULL);
  }
  // Contents of a survived? (b was last written by device 0's kernel: a = b + 1 = 7 + 3i + 2.)
  CK(cuCtxSetCurrent(ctx[0]));
  CK(cuMemcpyDtoH(host, a, (size_t)n * 4));
  int kept = 1;
  for (uint32_t i = 0; i < n; i++) kept &= host[i] == 9 + i * 3;
  printf("fact: device memory kept across the checkpoint: %s\n", kept ? "yes" : "NO");
  peer_check("after the restore", a, b, n);
}

/* vmm_round: on device 0's context, copy a (device 0) into memory created on device 1 and mapped
 * for device 0, read it back, then drop the mapping and the memory. */
static void vmm_round(const char *when, CUdeviceptr a, uint32_t n, uint32_t base) {
  struct { int type, htypes; struct { int type, id; } loc; void *win32; unsigned char flags[8]; } prop = {0};
  struct { struct { int type, id; } loc; int flags; } acc = {{1, 0}, 3};
  prop.type = 1;     /* CU_MEM_ALLOCATION_TYPE_PINNED */
  prop.loc.type = 1; /* CU_MEM_LOCATION_TYPE_DEVICE */
  prop.loc.id = 1;
  size_t sz = (((size_t)n * 4) + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
  CUdeviceptr m;
  unsigned long long hd;
  double t0 = now();
  CK(cuCtxSetCurrent(ctx[0]));
  CK(cuMemAddressReserve(&m, sz, 2u << 20, 0, 0));
  CK(cuMemCreate(&hd, sz, &prop, 0));
  CK(cuMemMap(m, sz, 0, hd, 0));
  CK(cuMemSetAccess(m, sz, &acc, 1));
  CK(cuMemcpyDtoD(m, a, (size_t)n * 4));
  CK(cuCtxSynchronize());
  CK(cuMemcpyDtoH(host, m, (size_t)n * 4));
  int ok = 1;
  for (uint32_t i = 0; i < n; i++) ok &= host[i] == base + i * 3;
  CK(cuMemUnmap(m, sz));
  CK(cuMemRelease(hd));
  CK(cuMemAddressFree(m, sz));
  printf("fact: %s: device 0 copied %u KiB into device 1's memory through a VMM peer mapping, then dropped it: %s (%.2f ms)\n",
         when, n / 256, ok ? "ok" : "WRONG", now() - t0);
  if (!ok) exit(1);
}

static void vmm_peer(uint32_t n) {
  CUdeviceptr a;
  CK(cuCtxSetCurrent(ctx[0]));
  CK(cuMemAlloc(&a, (size_t)n * 4));
  fill(0, a, n, 11);
  vmm_round("before the checkpoint", a, n, 11);
  wait_line();
  CK(cuCtxSetCurrent(ctx[0]));
  CK(cuMemcpyDtoH(host, a, (size_t)n * 4));
  int kept = 1;
  for (uint32_t i = 0; i < n; i++) kept &= host[i] == 11 + i * 3;
  printf("fact: device memory kept across the checkpoint: %s\n", kept ? "yes" : "NO");
  if (!kept) exit(1);
  fill(0, a, n, 13);
  vmm_round("after the restore", a, n, 13);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: probe-peer peer-keep|peer-toggle[-late|-fresh|-big|-split|-thread]|vmm-peer [MIB]\n");
    return 2;
  }
  const char *mode = argv[1];
  size_t mib = argc > 2 ? strtoull(argv[2], 0, 10) : 1024;
  setvbuf(stdout, 0, _IOLBF, 0);
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) {
    printf("FAIL: %s\n", dlerror());
    return 1;
  }
  SYM(cuInit, "cuInit") SYM(cuDeviceGet, "cuDeviceGet") SYM(cuDeviceGetCount, "cuDeviceGetCount")
  SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain") SYM(cuCtxSetCurrent, "cuCtxSetCurrent")
  SYM(cuCtxPushCurrent, "cuCtxPushCurrent") SYM(cuCtxPopCurrent, "cuCtxPopCurrent")
  SYM(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess") SYM(cuCtxDisablePeerAccess, "cuCtxDisablePeerAccess")
  SYM(cuMemAlloc, "cuMemAlloc") SYM(cuMemcpyHtoD, "cuMemcpyHtoD") SYM(cuMemcpyDtoH, "cuMemcpyDtoH")
  SYM(cuModuleLoadData, "cuModuleLoadData")
  SYM(cuModuleGetFunction, "cuModuleGetFunction") SYM(cuLaunchKernel, "cuLaunchKernel")
  SYM(cuGetErrorName, "cuGetErrorName") SYM(cuMemAddressReserve, "cuMemAddressReserve")
  SYM(cuMemAddressFree, "cuMemAddressFree") SYM(cuMemCreate, "cuMemCreate") SYM(cuMemRelease, "cuMemRelease")
  SYM(cuMemMap, "cuMemMap") SYM(cuMemUnmap, "cuMemUnmap") SYM(cuMemSetAccess, "cuMemSetAccess")
  SYM(cuMemcpyDtoD, "cuMemcpyDtoD")
  /* CUDA 13's cuCtxSynchronize_v2 takes a context: the plain name. */
  if (!(*(void **)&cuCtxSynchronize = dlsym(h, "cuCtxSynchronize"))) {
    printf("FAIL: no cuCtxSynchronize\n");
    return 1;
  }
  int count = 0;
  CK(cuInit(0));
  CK(cuDeviceGetCount(&count));
  if (count < 2) {
    printf("FAIL: needs 2 GPUs, has %d\n", count);
    return 1;
  }
  int vmm = !strcmp(mode, "vmm-peer"), fresh = strstr(mode, "-fresh") != NULL;
  for (int d = 0; d < (vmm ? 1 : 2); d++) { /* vmm-peer: a context on device 0 only */
    int dev;
    CK(cuDeviceGet(&dev, d));
    CK(cuDevicePrimaryCtxRetain(&ctx[d], dev));
    if (d == 0 || !fresh) load(d);
  }
  uint32_t n = (uint32_t)((mib << 20) / 4 > (64u << 20) / 4 ? (64u << 20) / 4 : (mib << 20) / 4);
  host = malloc((size_t)(64u << 20));
  if (!host) return 1;
  if (strstr(mode, "-big") || strstr(mode, "-split")) extra_mib = mib, split = strstr(mode, "-split") != NULL;
  if (!strcmp(mode, "peer-keep") || !strncmp(mode, "peer-toggle", 11))
    peer(strcmp(mode, "peer-keep") != 0, strstr(mode, "-late") != NULL || fresh, fresh, strstr(mode, "-thread") != NULL, n);
  else if (vmm)
    vmm_peer(n);
  else {
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
  }
  printf("PASS: %s\n", mode);
  return 0;
}
