// Reaches the driver through directly linked symbols (-lcuda), as Triton/cupy/NCCL do.
// With APP_SHARE=1 it also shares memory across processes the ways NCCL and PyTorch do (CUDA IPC,
// VMM shareable handles, memory pools; the fake driver lets one process play both sides), prints
// "ready", and on a line "cleanup" on stdin (or at EOF) undoes all of it, prints "clean" and waits
// for EOF: drive.py checks the shim's "ipc" counts before and after.
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>

#include "common.h"

typedef int CUresult;
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuCtxSetCurrent(void *);
CUresult cuCtxEnablePeerAccess(void *, unsigned);
CUresult cuCtxDisablePeerAccess(void *);
CUresult cuDeviceCanAccessPeer(int *, int, int);
CUresult cuDeviceGetP2PAttribute(int *, int, int, int);
CUresult cuModuleLoadData(void **, const void *);
CUresult cuModuleGetFunction(void **, void *, const char *);
CUresult cuModuleUnload(void *);
CUresult cuMemAlloc_v2(unsigned long long *, size_t);
CUresult cuMemFree_v2(unsigned long long);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
CUresult cuLaunchKernel_ptsz(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
long fake_calls(const char *);
typedef struct { char reserved[64]; } ipc_handle;
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);
CUresult cuIpcGetMemHandle(ipc_handle *, unsigned long long);
CUresult cuIpcOpenMemHandle(unsigned long long *, ipc_handle, unsigned);
CUresult cuIpcOpenMemHandle_v2(unsigned long long *, ipc_handle, unsigned);
CUresult cuIpcCloseMemHandle(unsigned long long);
CUresult cuMemCreate(unsigned long long *, size_t, const void *, unsigned long long);
CUresult cuMemRelease(unsigned long long);
CUresult cuMemAddressReserve(unsigned long long *, size_t, size_t, unsigned long long, unsigned long long);
CUresult cuMemAddressFree(unsigned long long, size_t);
CUresult cuMemMap(unsigned long long, size_t, size_t, unsigned long long, unsigned long long);
CUresult cuMemUnmap(unsigned long long, size_t);
CUresult cuMemSetAccess(unsigned long long, size_t, const void *, size_t);
CUresult cuMemExportToShareableHandle(void *, unsigned long long, int, unsigned long long);
CUresult cuMemImportFromShareableHandle(unsigned long long *, void *, int);
CUresult cuMemRetainAllocationHandle(unsigned long long *, void *);
CUresult cuMemPoolCreate(void **, const void *);
CUresult cuMemPoolDestroy(void *);
CUresult cuMemPoolExportToShareableHandle(void *, void *, int, unsigned long long);
CUresult cuMemPoolImportFromShareableHandle(void **, void *, int, unsigned long long);
CUresult cuMemPoolExportPointer(void *, unsigned long long);
CUresult cuMemPoolImportPointer(unsigned long long *, void *, void *);
CUresult cuMemAllocAsync(unsigned long long *, size_t, void *);
CUresult cuMemFreeAsync(unsigned long long, void *);

#define MB2 ((size_t)2 << 20)
#define POSIX_FD 1  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
static unsigned long long a, pa, va[3], pp;
static void *pool, *ipool;

// share_setup leaves exported: a (CUDA IPC), h1 and h3 (VMM), pool, pp (pool pointer); imported:
// pa (a's handle, one open left), hi1 (VMM), ipool. Everything else is undone before "ready".
static void share_setup(void) {
  ipc_handle ha, ha2, hb;
  unsigned long long b, p2, p3, p4;
  // CUDA IPC: a exported twice (an interior pointer names the same allocation), b exported then freed.
  CK(cuMemAlloc_v2(&a, 1 << 20));
  CK(cuMemAlloc_v2(&b, 1 << 20));
  CK(cuIpcGetMemHandle(&ha, a));
  CK(cuIpcGetMemHandle(&ha2, a + 4096));
  CK(cuIpcGetMemHandle(&hb, b));
  CK(cuMemFree_v2(b));
  // a's handle opened four times (cuda.h's _v2 twice, through cuGetProcAddress, the old symbol):
  // one pointer, reference counted; closed three times.
  CUresult (*open_fn)(unsigned long long *, ipc_handle, unsigned) = NULL;
  int st = -1;
  CK(cuIpcOpenMemHandle_v2(&pa, ha, 1));
  CK(cuIpcOpenMemHandle_v2(&p2, ha, 1));
  CK(cuGetProcAddress_v2("cuIpcOpenMemHandle", (void **)&open_fn, 12000, 0, &st));
  CK(open_fn(&p3, ha, 1));
  CK(cuIpcOpenMemHandle(&p4, ha, 1));
  if (p2 != pa || p3 != pa || p4 != pa) exit(5);
  CK(cuIpcCloseMemHandle(p2));
  CK(cuIpcCloseMemHandle(p3));
  CK(cuIpcCloseMemHandle(p4));
  // VMM (CUmemAllocationProp's head: pinned, POSIX fd, device 0; CUmemAccessDesc: read-write).
  struct { int type, htypes; struct { int type, id; } loc; void *win32; unsigned char flags[8]; } prop = {1, POSIX_FD, {1, 0}, NULL, {0}};
  struct { struct { int type, id; } loc; int flags; } acc = {{1, 0}, 3};
  unsigned long long h1, h2, h3, hr, hi1, hi2;
  int fd1, fd2, fd3;
  CK(cuMemAddressReserve(&va[0], MB2, 0, 0, 0));
  CK(cuMemAddressReserve(&va[1], MB2, 0, 0, 0));
  CK(cuMemAddressReserve(&va[2], 2 * MB2, 0, 0, 0));
  // h1: mapped, exported, its handle released: exported while mapped.
  CK(cuMemCreate(&h1, MB2, &prop, 0));
  CK(cuMemMap(va[0], MB2, 0, h1, 0));
  CK(cuMemSetAccess(va[0], MB2, &acc, 1));
  CK(cuMemExportToShareableHandle(&fd1, h1, POSIX_FD, 0));
  CK(cuMemRelease(h1));
  // h2: exported, then freed NCCL's way (retain, release, unmap, release): no longer exported.
  CK(cuMemCreate(&h2, MB2, &prop, 0));
  CK(cuMemMap(va[1], MB2, 0, h2, 0));
  CK(cuMemExportToShareableHandle(&fd2, h2, POSIX_FD, 0));
  CK(cuMemRetainAllocationHandle(&hr, (void *)(uintptr_t)va[1]));
  CK(cuMemRelease(hr));
  CK(cuMemUnmap(va[1], MB2));
  CK(cuMemRelease(h2));
  // h3: mapped and its handle released first, later retained, exported and released again:
  // exported while mapped (the mapping was made before the export).
  CK(cuMemCreate(&h3, MB2, &prop, 0));
  CK(cuMemMap(va[2], MB2, 0, h3, 0));
  CK(cuMemRelease(h3));
  CK(cuMemRetainAllocationHandle(&hr, (void *)(uintptr_t)va[2]));
  CK(cuMemExportToShareableHandle(&fd3, hr, POSIX_FD, 0));
  CK(cuMemRelease(hr));
  // fd1 imported twice: hi1 mapped next to h3 and released (imported while mapped); hi2 released
  // unmapped (gone).
  CK(cuMemImportFromShareableHandle(&hi1, (void *)(intptr_t)fd1, POSIX_FD));
  CK(cuMemMap(va[2] + MB2, MB2, 0, hi1, 0));
  CK(cuMemRelease(hi1));
  CK(cuMemImportFromShareableHandle(&hi2, (void *)(intptr_t)fd1, POSIX_FD));
  CK(cuMemRelease(hi2));
  close(fd1);
  close(fd2);
  close(fd3);
  // Pools: pool exported, imported twice (ipool kept, ipool2 destroyed); pp's pointer exported and
  // imported (the import freed), pp2's exported and pp2 freed.
  char props[88] = {0}, data[64], data2[64];
  int pfd;
  unsigned long long pp2, ip;
  void *ipool2;
  CK(cuMemPoolCreate(&pool, props));
  CK(cuMemPoolExportToShareableHandle(&pfd, pool, POSIX_FD, 0));
  CK(cuMemPoolImportFromShareableHandle(&ipool, (void *)(intptr_t)pfd, POSIX_FD, 0));
  CK(cuMemPoolImportFromShareableHandle(&ipool2, (void *)(intptr_t)pfd, POSIX_FD, 0));
  CK(cuMemPoolDestroy(ipool2));
  close(pfd);
  CK(cuMemAllocAsync(&pp, 4096, NULL));
  CK(cuMemAllocAsync(&pp2, 4096, NULL));
  CK(cuMemPoolExportPointer(data, pp));
  CK(cuMemPoolExportPointer(data2, pp2));
  CK(cuMemFreeAsync(pp2, NULL));
  CK(cuMemPoolImportPointer(&ip, ipool, data));
  CK(cuMemFree_v2(ip));
}

// share_cleanup undoes what share_setup left; h3 and hi1 are unmapped in one call.
static void share_cleanup(void) {
  CK(cuIpcCloseMemHandle(pa));
  CK(cuMemFree_v2(a));
  CK(cuMemUnmap(va[0], MB2));
  CK(cuMemUnmap(va[2], 2 * MB2));
  CK(cuMemAddressFree(va[0], MB2));
  CK(cuMemAddressFree(va[1], MB2));
  CK(cuMemAddressFree(va[2], 2 * MB2));
  CK(cuMemFreeAsync(pp, NULL));
  CK(cuMemPoolDestroy(ipool));
  CK(cuMemPoolDestroy(pool));
}

// With APP_COLL=1, after the rest, a module with a kernel named like NCCL's collectives; on each
// stdin line "coll N" the app launches it N times and answers "coll done" (a launch held by the
// collective alignment blocks until the gate opens); end of input ends it.
static const char coll_ptx[] =
    ".version 7.0\n.target sm_70\n.address_size 64\n"
    ".visible .entry _Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE()\n{\n\tret;\n}\n";

static int coll_loop(void) {
  void *cmod, *cfn;
  CK(cuModuleLoadData(&cmod, coll_ptx));
  CK(cuModuleGetFunction(&cfn, cmod, "_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE"));
  printf("ready\n");
  fflush(stdout);
  char line[64];
  int n;
  while (fgets(line, sizeof line, stdin)) {
    if (sscanf(line, "coll %d", &n) != 1 || n < 0 || n > 1000) return 7;
    for (int i = 0; i < n; i++) CK(cuLaunchKernel(cfn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
    printf("coll done\n");
    fflush(stdout);
  }
  CK(cuModuleUnload(cmod));
  return 0;
}

// With APP_PEER=1, after the rest: on each stdin line "peer" the app enables peer access to a
// second context handle (any non-NULL handle is a peer to the fake driver) and answers "peer RC";
// "unpeer" disables it ("unpeer RC"); end of input ends it.
static int peer_loop(void) {
  static char other;  // the peer's handle
  printf("ready\n");
  fflush(stdout);
  char line[64];
  while (fgets(line, sizeof line, stdin)) {
    int on = strcmp(line, "peer\n") == 0;
    if (!on && strcmp(line, "unpeer\n") != 0) return 8;
    CUresult r = on ? cuCtxEnablePeerAccess(&other, 0) : cuCtxDisablePeerAccess(&other);
    printf("%s %d\n", on ? "peer" : "unpeer", r);
    fflush(stdout);
  }
  return 0;
}

int main(void) {
  void *ctx, *mod, *fn;
  unsigned long long d;
  CK(cuInit(0));
  CK(cuDevicePrimaryCtxRetain(&ctx, 0));
  CK(cuCtxSetCurrent(ctx));
  CK(cuModuleLoadData(&mod, test_ptx));
  CK(cuModuleGetFunction(&fn, mod, "k_test"));
  CK(cuMemAlloc_v2(&d, 1 << 20));
  // Peer access: a link enabled, enabled again (already enabled: 704), disabled and enabled again,
  // and one refused call (the shim's status counts 1).
  // Refused as unsupported (PTXMIG_PEER_ACCESS=0 under the shim), it carries on without, as
  // frameworks do; what it was told goes to stderr (the reference run without the shim differs).
  int can = -1, p2p = -1;
  CK(cuDeviceCanAccessPeer(&can, 0, 0));
  CK(cuDeviceGetP2PAttribute(&p2p, 2, 0, 0));
  CUresult pe = cuCtxEnablePeerAccess(ctx, 0);
  if (pe == 0) {
    if (cuCtxEnablePeerAccess(ctx, 0) != 704) return 6;  // CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    CK(cuCtxDisablePeerAccess(ctx));
    CK(cuCtxEnablePeerAccess(ctx, 0));
  } else if (pe != 217) {  // CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
    return 5;
  }
  fprintf(stderr, "peer: can %d access-supported %d enable %d\n", can, p2p, pe);
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
  const char *sh = getenv("APP_SHARE");
  int share = sh && sh[0] == '1';
  if (share) share_setup();
  printf("fake cuLaunchKernel=%ld cuLaunchKernel_ptsz=%ld", fake_calls("cuLaunchKernel"), fake_calls("cuLaunchKernel_ptsz"));
  if (share)
    printf(" cuIpcOpenMemHandle_v2=%ld cuIpcOpenMemHandle=%ld cuIpcCloseMemHandle=%ld cuMemExportToShareableHandle=%ld"
           " cuMemImportFromShareableHandle=%ld cuMemRetainAllocationHandle=%ld cuMemPoolImportPointer=%ld",
           fake_calls("cuIpcOpenMemHandle_v2"), fake_calls("cuIpcOpenMemHandle"), fake_calls("cuIpcCloseMemHandle"),
           fake_calls("cuMemExportToShareableHandle"), fake_calls("cuMemImportFromShareableHandle"),
           fake_calls("cuMemRetainAllocationHandle"), fake_calls("cuMemPoolImportPointer"));
  printf("\n");
  const char *co = getenv("APP_COLL"), *pm = getenv("APP_PEER");
  if (pm && pm[0] == '1') {
    int rc = peer_loop();
    if (rc) return rc;
  } else if (co && co[0] == '1') {
    int rc = coll_loop();
    if (rc) return rc;
  } else if (share) {
    printf("ready\n");
    fflush(stdout);
    char line[64];
    if (fgets(line, sizeof line, stdin) && strcmp(line, "cleanup\n") != 0) return 6;
    share_cleanup();
    printf("clean\n");
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
    }
  } else {
    wait_harness();
  }
  CK(cuMemFree_v2(d));
  CK(cuModuleUnload(mod));
  return 0;
}
