/* probe-twin-occ CUBIN [BLOCK_MS] — why does a block twin of CuPy's clock-bound spin run at half
 * the original's speed (docs/BENCHMARKS.md, "Long JIT-compiled kernels")? CUBIN is
 * scripts/probe-twin-occ.ptx instrumented by `ptxmig ptx instrument --match-registers sm_90 --cubin`.
 * Launches 64 x SMs blocks of 128 threads, each spinning BLOCK_MS (default 100) by clock64 against
 * the clock rate, as the original and as its twin (W = occupancy x SMs CTAs, the shim's rule), in
 * several variants; for spin_rec also: the blocks that started in the launch's first half block
 * time (how many ran at once), a block's mean wall time, the clock rate it spun at (cycles over
 * wall time) and the mean idle gap on SM 0 between a block's end and the next start there.
 * No CUDA headers. Build and run (GPU bundle):
 *   cc -O2 -o /tmp/pto bench/probe-twin-occ.c -ldl
 *   ./ptxmig ptx instrument --match-registers sm_90 --cubin -o /tmp/t.cubin bench/probe-twin-occ.ptx
 *   /tmp/pto /tmp/t.cubin 100
 * Found with it (H200, 2026-11-29): the twin's leader-only flag load split warp 0 (thread 0 started
 * its spin 50 ms late, 900 ms a launch against the original's 400); docs/PTXSTATE.md. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef uint64_t CUdeviceptr;
typedef void *CUfunction;
typedef void *CUmodule;
struct ctl {  // docs/PTXSTATE.md, control block version 2
  uint64_t next_block, total_blocks, blocks_done;
  uint32_t grid_x, grid_y, grid_z, preempt, status, magic, version, batch_max, batch_min, batch_div;
};

static CUresult (*cuInit)(unsigned), (*cuDeviceGet)(int *, int), (*cuDevicePrimaryCtxRetain)(void **, int),
    (*cuCtxSetCurrent)(void *), (*cuModuleLoad)(CUmodule *, const char *),
    (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *), (*cuMemAlloc)(CUdeviceptr *, size_t),
    (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t), (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t),
    (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t), (*cuCtxSynchronize)(void),
    (*cuDeviceGetAttribute)(int *, int, int), (*cuFuncGetAttribute)(int *, int, CUfunction),
    (*cuFuncSetAttribute)(CUfunction, int, int),
    (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int *, CUfunction, int, size_t),
    (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                      void **, void **);

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }
#define SYM(n) if (!(*(void **)&n = dlsym(h, #n "_v2")) && !(*(void **)&n = dlsym(h, #n))) { fprintf(stderr, "no %s\n", #n); exit(1); }
#define CK(x) do { CUresult r_ = (x); if (r_) { fprintf(stderr, "%s: error %d\n", #x, r_); exit(1); } } while (0)

static int sms, hz_khz, nblocks;
static CUdeviceptr out, rec, ctl;
static unsigned long long spin;

// run: one launch of fn (twin when W > 0: W CTAs and a fresh control block); for spin_rec
// (recs != 0) the blocks started within half a block time of the first one.
static void run(const char *name, CUfunction fn, int twin, unsigned W, uint32_t batch_max, int recs) {
  struct ctl c = {0};
  c.total_blocks = (uint64_t)nblocks, c.grid_x = (uint32_t)nblocks, c.grid_y = c.grid_z = 1;
  c.magic = 0x4d585450u, c.version = 2, c.batch_max = batch_max;
  if (batch_max == 1) c.batch_min = 1;  // as the shim does: else the default minimum (2) wins
  CK(cuMemcpyHtoD(ctl, &c, sizeof c));
  {  // per block: 4 words of thread 0 (0), the first start (all ones: atom.min), the last end (0)
    uint64_t *z = calloc((size_t)nblocks, 48);
    for (int i = 0; i < nblocks; i++) z[6 * i + 4] = UINT64_MAX;
    CK(cuMemcpyHtoD(rec, z, (size_t)nblocks * 48));
    free(z);
  }
  unsigned step = 1;
  void *a3[] = {&out, &spin, &step, &ctl};
  void *a2[] = {&rec, &spin, &ctl};
  void **args = recs ? a2 : a3;
  if (twin) args[recs ? 2 : 3] = &ctl;
  double t0 = now();
  CK(cuLaunchKernel(fn, twin ? W : (unsigned)nblocks, 1, 1, 128, 1, 1, 0, NULL, args, NULL));
  CK(cuCtxSynchronize());
  double ms = now() - t0;
  CK(cuMemcpyDtoH(&c, ctl, sizeof c));
  int first = -1;
  double wall_ms = 0, mhz = 0, gap_ms = 0, all_ms = 0, late_ms = 0;
  if (recs) {  // per block: start, end (globaltimer ns), cycles spun, SM
    uint64_t *r = malloc((size_t)nblocks * 48), lo = UINT64_MAX;
    CK(cuMemcpyDtoH(r, rec, (size_t)nblocks * 48));
    for (int i = 0; i < nblocks; i++) if (r[6 * i] && r[6 * i] < lo) lo = r[6 * i];
    double half_ns = (double)spin / hz_khz * 1e6 / 2;
    first = 0;
    for (int i = 0; i < nblocks; i++) {
      uint64_t *b = r + 6 * i;
      if (b[0] && (double)(b[0] - lo) < half_ns) first++;
      wall_ms += (double)(b[1] - b[0]) / 1e6;
      all_ms += (double)(b[5] - b[4]) / 1e6;
      late_ms += (double)(b[0] - b[4]) / 1e6;
      mhz += (double)b[2] / ((double)(b[1] - b[0]) / 1e3);
    }
    wall_ms /= nblocks, mhz /= nblocks, all_ms /= nblocks, late_ms /= nblocks;
    // the mean time from a block's end to the next start on the same SM after it, over SM 0's blocks
    int n = 0;
    for (int i = 0; i < nblocks; i++) {
      if (r[6 * i + 3] != 0) continue;
      uint64_t best = UINT64_MAX;
      for (int j = 0; j < nblocks; j++)
        if (r[6 * j + 3] == 0 && r[6 * j] >= r[6 * i + 1] && r[6 * j] - r[6 * i + 1] < best) best = r[6 * j] - r[6 * i + 1];
      if (best != UINT64_MAX) gap_ms += (double)best / 1e6, n++;
    }
    if (n) gap_ms /= n;
    free(r);
  }
  printf("run %-28s W=%-5u ms=%8.1f first_wave=%-5d done=%-6llu block_wall_ms=%.1f spin_mhz=%.0f sm0_gap_ms=%.2f all_threads_ms=%.1f t0_late_ms=%.2f\n", name,
         twin ? W : (unsigned)nblocks, ms, first, twin ? (unsigned long long)c.blocks_done : (unsigned long long)nblocks,
         wall_ms, mhz, gap_ms, all_ms, late_ms);
  fflush(stdout);
}

int main(int argc, char **argv) {
  if (argc < 2) { fprintf(stderr, "usage: probe-twin-occ CUBIN [BLOCK_MS]\n"); return 2; }
  double block_ms = argc > 2 ? atof(argv[2]) : 100;
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
  SYM(cuInit) SYM(cuDeviceGet) SYM(cuDevicePrimaryCtxRetain) SYM(cuCtxSetCurrent) SYM(cuModuleLoad)
  SYM(cuModuleGetFunction) SYM(cuMemAlloc) SYM(cuMemsetD8) SYM(cuMemcpyHtoD) SYM(cuMemcpyDtoH)
  *(void **)&cuCtxSynchronize = dlsym(h, "cuCtxSynchronize");  // not _v2: that one takes a context
  if (!cuCtxSynchronize) { fprintf(stderr, "no cuCtxSynchronize\n"); return 1; }
 
  SYM(cuDeviceGetAttribute) SYM(cuFuncGetAttribute) SYM(cuFuncSetAttribute)
  SYM(cuOccupancyMaxActiveBlocksPerMultiprocessor) SYM(cuLaunchKernel)
  int dev;
  void *ctx;
  CUmodule m;
  CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CK(cuModuleLoad(&m, argv[1]));
  CK(cuDeviceGetAttribute(&sms, 16, dev));     // MULTIPROCESSOR_COUNT
  CK(cuDeviceGetAttribute(&hz_khz, 13, dev));  // CLOCK_RATE (kHz), as CuPy's ClockRate
  nblocks = 64 * sms;
  spin = (unsigned long long)(block_ms * hz_khz);
  CK(cuMemAlloc(&out, (size_t)nblocks * 128 * 8)); CK(cuMemsetD8(out, 0, (size_t)nblocks * 128 * 8));
  CK(cuMemAlloc(&rec, (size_t)nblocks * 48)); CK(cuMemAlloc(&ctl, 64));
  const char *names[] = {"spin_count", "spin_count__ptxmig", "spin_rec", "spin_rec__ptxmig"};
  CUfunction f[4];
  int occ[4];
  for (int i = 0; i < 4; i++) {
    int regs, shm, carve;
    CK(cuModuleGetFunction(&f[i], m, names[i]));
    CK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&occ[i], f[i], 128, 0));
    CK(cuFuncGetAttribute(&regs, 4, f[i])); CK(cuFuncGetAttribute(&shm, 1, f[i]));
    CK(cuFuncGetAttribute(&carve, 9, f[i]));
    printf("fn %-20s regs=%d static_smem=%d carveout=%d occupancy=%d\n", names[i], regs, shm, carve, occ[i]);
  }
  printf("sms=%d clock_khz=%d blocks=%d block_ms=%.0f\n", sms, hz_khz, nblocks, block_ms);
  unsigned W = (unsigned)(occ[1] * sms), Wr = (unsigned)(occ[3] * sms);
  run("warm-up original", f[0], 0, 0, 0, 0);
  run("original spin_count", f[0], 0, 0, 0, 0);
  run("twin spin_count", f[1], 1, W, 0, 0);
  run("twin spin_count batch1", f[1], 1, W, 1, 0);
  run("original spin_rec", f[2], 0, 0, 0, 1);
  run("twin spin_rec", f[3], 1, Wr, 0, 1);
  run("twin spin_rec batch1", f[3], 1, Wr, 1, 1);
  run("twin spin_rec W/2", f[3], 1, Wr / 2, 1, 1);
  CK(cuFuncSetAttribute(f[1], 9, 100)); CK(cuFuncSetAttribute(f[3], 9, 100));
  run("twin spin_count carveout100", f[1], 1, W, 1, 0);
  run("twin spin_rec carveout100", f[3], 1, Wr, 1, 1);
  CK(cuFuncSetAttribute(f[1], 9, 0)); CK(cuFuncSetAttribute(f[3], 9, 0));
  run("twin spin_rec carveout0", f[3], 1, Wr, 1, 1);
  run("original spin_count again", f[0], 0, 0, 0, 0);
  return 0;
}
