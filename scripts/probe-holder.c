/* probe-holder MIB [GPU] — can another process keep a process's device memory alive across the
 * driver's checkpoint and restore of that process (issue 34, device-to-device migrate)? One run:
 *   child (the "app"): allocates MIB with cuMemCreate (POSIX fd handle type) on GPU 0 at a reserved
 *     address, fills it, exports it as an fd and sends the fd to the parent;
 *   parent (the "holder"): imports the fd, copies the bytes into memory of its own on GPU [GPU]
 *     (default 0; another GPU: a peer copy), drops the import and says so (a handle imported
 *     from an fd cannot be exported again: CUDA_ERROR_INVALID_VALUE, H200, driver 580.159.04);
 *   child: unmaps and releases its handle, closes the fd, keeps the address reservation;
 *   parent: cuCheckpointProcessLock / Checkpoint / Restore / Unlock the child, each timed;
 *   parent: exports its handle as an fd and sends it; child imports it, maps it at the same address,
 *     checks the bytes, writes and reads back.
 * Prints one line per step ("step ms result") and "verdict ok|FAIL: ...". No CUDA headers.
 * Build: cc -O2 -o probe-holder probe-holder.c -ldl */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef uint64_t CUdeviceptr;
typedef unsigned long long CUhandle;
typedef struct {
  int type, handle_types;
  struct { int type, id; } loc;
  void *win32;
  unsigned char flags[8];
} prop_t;  // CUmemAllocationProp
typedef struct { struct { int type, id; } loc; int flags; } access_t;  // CUmemAccessDesc
typedef struct { unsigned char b[16]; } uuid16;
typedef struct { uuid16 o, n; } pair_t;
typedef struct { pair_t *pairs; unsigned int count; char r[44]; uint64_t r1; } restore_args;
typedef struct { unsigned int timeout_ms, r0; uint64_t r1[7]; } lock_args;
typedef struct { uint64_t r[8]; } plain_args;

static CUresult (*cuInit)(unsigned), (*cuDeviceGet)(int *, int), (*cuDevicePrimaryCtxRetain)(void **, int),
    (*cuCtxSetCurrent)(void *), (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long),
    (*cuMemCreate)(CUhandle *, size_t, const prop_t *, unsigned long long), (*cuMemRelease)(CUhandle),
    (*cuMemMap)(CUdeviceptr, size_t, size_t, CUhandle, unsigned long long), (*cuMemUnmap)(CUdeviceptr, size_t),
    (*cuMemSetAccess)(CUdeviceptr, size_t, const access_t *, size_t),
    (*cuMemExportToShareableHandle)(void *, CUhandle, int, unsigned long long),
    (*cuMemImportFromShareableHandle)(CUhandle *, void *, int), (*cuMemsetD32)(CUdeviceptr, unsigned, size_t),
    (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t), (*cuMemcpy)(CUdeviceptr, CUdeviceptr, size_t),
    (*cuCtxSynchronize)(void), (*cuMemAlloc)(CUdeviceptr *, size_t), (*cuDeviceGetUuid)(uuid16 *, int),
    (*cuDeviceGetCount)(int *), (*cuCtxEnablePeerAccess)(void *, unsigned),
    (*ckLock)(int, lock_args *), (*ckCkpt)(int, plain_args *), (*ckRestore)(int, restore_args *), (*ckUnlock)(int, plain_args *);

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }
#define SYM(n) if (!(*(void **)&n = dlsym(h, #n "_v2")) && !(*(void **)&n = dlsym(h, #n))) { fprintf(stderr, "no %s\n", #n); exit(1); }
static void load(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) { fprintf(stderr, "%s\n", dlerror()); exit(1); }
  SYM(cuInit) SYM(cuDeviceGet) SYM(cuDevicePrimaryCtxRetain) SYM(cuCtxSetCurrent) SYM(cuMemAddressReserve) SYM(cuMemCreate)
  SYM(cuMemRelease) SYM(cuMemMap) SYM(cuMemUnmap) SYM(cuMemSetAccess) SYM(cuMemExportToShareableHandle)
  SYM(cuMemImportFromShareableHandle) SYM(cuMemsetD32) SYM(cuMemcpyDtoH) SYM(cuMemcpy) SYM(cuCtxSynchronize) SYM(cuMemAlloc)
  SYM(cuDeviceGetUuid) SYM(cuDeviceGetCount) SYM(cuCtxEnablePeerAccess)
  *(void **)&ckLock = dlsym(h, "cuCheckpointProcessLock");
  *(void **)&ckCkpt = dlsym(h, "cuCheckpointProcessCheckpoint");
  *(void **)&ckRestore = dlsym(h, "cuCheckpointProcessRestore");
  *(void **)&ckUnlock = dlsym(h, "cuCheckpointProcessUnlock");
  if (!ckLock || !ckCkpt || !ckRestore || !ckUnlock) { fprintf(stderr, "no checkpoint API\n"); exit(1); }
}
static void *ctx_on(int dev) {
  int d; void *c;
  if (cuInit(0) || cuDeviceGet(&d, dev) || cuDevicePrimaryCtxRetain(&c, d) || cuCtxSetCurrent(c)) { fprintf(stderr, "context on %d failed\n", dev); exit(1); }
  return c;
}
// One byte, with an fd when fd >= 0.
static void send_msg(int s, char c, int fd) {
  struct msghdr m = {0};
  struct iovec io = {&c, 1};
  char buf[CMSG_SPACE(sizeof(int))];
  m.msg_iov = &io; m.msg_iovlen = 1;
  if (fd >= 0) {
    memset(buf, 0, sizeof buf);
    m.msg_control = buf; m.msg_controllen = sizeof buf;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET; cm->cmsg_type = SCM_RIGHTS; cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof fd);
  }
  if (sendmsg(s, &m, 0) != 1) { perror("sendmsg"); exit(1); }
}
static char recv_msg(int s, int *fd) {
  char c = 0, buf[CMSG_SPACE(sizeof(int))];
  struct iovec io = {&c, 1};
  struct msghdr m = {0};
  m.msg_iov = &io; m.msg_iovlen = 1; m.msg_control = buf; m.msg_controllen = sizeof buf;
  if (recvmsg(s, &m, 0) != 1) { fprintf(stderr, "peer gone\n"); exit(1); }
  struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
  if (fd) *fd = cm && cm->cmsg_type == SCM_RIGHTS ? *(int *)CMSG_DATA(cm) : -1;
  return c;
}
#define STEP(name, call) do { double t0_ = now(); CUresult r_ = (call); printf("%-8s %-28s %8.2f ms  %d\n", who, name, now() - t0_, r_); fflush(stdout); if (r_) { printf("verdict FAIL: %s %s returned %d\n", who, name, r_); fflush(stdout); fail = 1; goto out; } } while (0)

static int app(int s, size_t n) {
  const char *who = "app";
  int fail = 0, fd = -1;
  ctx_on(0);
  prop_t p = {.type = 1, .handle_types = 1, .loc = {1, 0}};
  access_t a = {{1, 0}, 3};
  CUdeviceptr va, small;
  CUhandle hd;
  STEP("reserve", cuMemAddressReserve(&va, n, 0, 0, 0));
  STEP("create (POSIX fd type)", cuMemCreate(&hd, n, &p, 0));
  STEP("map", cuMemMap(va, n, 0, hd, 0));
  STEP("set access", cuMemSetAccess(va, n, &a, 1));
  STEP("fill", cuMemsetD32(va, 0x5a5a1234u, n / 4));
  STEP("small cuMemAlloc", cuMemAlloc(&small, 1 << 20));
  STEP("small fill", cuMemsetD32(small, 0x77u, (1 << 20) / 4));
  STEP("sync", cuCtxSynchronize());
  STEP("export fd", cuMemExportToShareableHandle(&fd, hd, 1, 0));
  send_msg(s, 'E', fd);
  close(fd);
  if (recv_msg(s, NULL) != 'I') { printf("verdict FAIL: holder did not import\n"); return 1; }
  STEP("unmap", cuMemUnmap(va, n));
  STEP("release", cuMemRelease(hd));
  send_msg(s, 'R', -1);  // released: checkpoint me
  if (recv_msg(s, NULL) != 'U') { printf("verdict FAIL: checkpoint cycle failed (see holder)\n"); return 1; }
  if (recv_msg(s, &fd) != 'X' || fd < 0) { printf("verdict FAIL: no fd back\n"); return 1; }
  double t0 = now();
  STEP("import fd", cuMemImportFromShareableHandle(&hd, (void *)(intptr_t)fd, 1));
  close(fd);
  STEP("map at same address", cuMemMap(va, n, 0, hd, 0));
  STEP("set access", cuMemSetAccess(va, n, &a, 1));
  printf("%-8s %-28s %8.2f ms\n", who, "import+map+access", now() - t0);
  unsigned v[4] = {0}, w = 0;
  STEP("read back", cuMemcpyDtoH(v, va + n - sizeof v, sizeof v));
  STEP("read small", cuMemcpyDtoH(&w, small, sizeof w));
  int same = v[0] == 0x5a5a1234u && v[3] == 0x5a5a1234u && w == 0x77u;
  printf("%-8s %-28s %08x %08x small %08x\n", who, "read back", v[0], v[3], w);
  STEP("write", cuMemsetD32(va, 0x01020304u, n / 4));
  STEP("read write", cuMemcpyDtoH(v, va, sizeof v));
  printf("verdict %s: bytes kept across the driver's checkpoint %s, small allocation %s, write after %s\n",
         same && v[0] == 0x01020304u ? "ok" : "FAIL", same ? "yes" : "no", w == 0x77u ? "kept" : "LOST",
         v[0] == 0x01020304u ? "works" : "FAILS");
  fflush(stdout);
  return !(same && v[0] == 0x01020304u);
out:
  return fail;
}

static int holder(int s, pid_t child, size_t n, int gpu) {
  const char *who = "holder";
  int fail = 0, fd;
  CUhandle hd, mine = 0;
  if (recv_msg(s, &fd) != 'E' || fd < 0) { printf("verdict FAIL: no fd from app\n"); return 1; }
  void *c0 = ctx_on(0);
  STEP("import fd", cuMemImportFromShareableHandle(&hd, (void *)(intptr_t)fd, 1));
  close(fd);
  {  // the holder's own memory on GPU (an imported handle cannot be exported again): map both, copy
    prop_t p = {.type = 1, .handle_types = 1, .loc = {1, gpu}};
    access_t a[2] = {{{1, 0}, 3}, {{1, gpu}, 3}};
    CUdeviceptr src, dst;
    STEP("reserve", cuMemAddressReserve(&src, 2 * n, 0, 0, 0));
    dst = src + n;
    STEP("create on target", cuMemCreate(&mine, n, &p, 0));
    STEP("map source", cuMemMap(src, n, 0, hd, 0));
    STEP("map target", cuMemMap(dst, n, 0, mine, 0));
    STEP("access both", cuMemSetAccess(src, 2 * n, a, gpu != 0 ? 2 : 1));
    STEP("copy (cold)", cuMemcpy(dst, src, n));
    STEP("sync", cuCtxSynchronize());
    double t0 = now();
    STEP("copy", cuMemcpy(dst, src, n));
    STEP("sync", cuCtxSynchronize());
    printf("%-8s %-28s %8.1f GB/s\n", who, gpu != 0 ? "peer copy rate" : "device copy rate", n / ((now() - t0) * 1e6));
    unsigned v[4] = {0};
    STEP("read target", cuMemcpyDtoH(v, dst + n - sizeof v, sizeof v));
    printf("%-8s %-28s %08x %08x\n", who, "target's last words", v[2], v[3]);
    STEP("unmap", cuMemUnmap(src, 2 * n));
    STEP("release source", cuMemRelease(hd));
    hd = mine;
  }
  (void)c0;
  send_msg(s, 'I', -1);
  if (recv_msg(s, NULL) != 'R') return 1;
  lock_args l = {.timeout_ms = 10000};
  plain_args z = {0};
  int count = 0;
  if (cuDeviceGetCount(&count) || count < 1 || count > 16) count = 1;
  pair_t pairs[16];
  for (int i = 0; i < count; i++) {
    cuDeviceGetUuid(&pairs[i].o, i);
    int t = gpu != 0 ? (i == 0 ? gpu : i == gpu ? 0 : i) : i;  // GPU 0 <-> GPU
    cuDeviceGetUuid(&pairs[i].n, t);
  }
  restore_args ra = {.pairs = pairs, .count = (unsigned)count};
  STEP("lock", ckLock(child, &l));
  STEP("checkpoint", ckCkpt(child, &z));
  STEP("restore", ckRestore(child, gpu != 0 ? &ra : (restore_args *)&z));
  STEP("unlock", ckUnlock(child, &z));
  send_msg(s, 'U', -1);
  STEP("export fd", cuMemExportToShareableHandle(&fd, hd, 1, 0));
  send_msg(s, 'X', fd);
  close(fd);
  return 0;
out:
  send_msg(s, 'F', -1);
  return fail;
}

int main(int argc, char **argv) {
  size_t n = (argc > 1 ? strtoull(argv[1], 0, 10) : 1024) << 20;
  int gpu = argc > 2 ? atoi(argv[2]) : 0;
  int sv[2];
  load();
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) { perror("socketpair"); return 1; }
  setvbuf(stdout, NULL, _IOLBF, 0);
  pid_t pid = fork();
  if (pid == 0) { close(sv[0]); _exit(app(sv[1], n)); }
  close(sv[1]);
  int r = holder(sv[0], pid, n, gpu), st = 0;
  waitpid(pid, &st, 0);
  printf("exit holder %d app %d\n", r, WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
  return r || !WIFEXITED(st) || WEXITSTATUS(st);
}
