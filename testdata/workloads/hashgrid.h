// hashgrid: the long many-block kernel shared by the longgrid and hazards workloads.
//
// hashgrid<<<grid, HG_THREADS>>>(out, runs, work, seed) gives every block its own slice of the
// output (one u64 in out[], one u32 in runs[], indexed by the linear block id
// b = blockIdx.y * gridDim.x + blockIdx.x). Each thread runs `work` rounds of a 32-bit integer hash
// seeded by (b, gridDim, threadIdx, seed); the block reduces its 256 values (warp shuffles, one
// __syncthreads, a fixed-order sum) to a 64-bit block hash h and thread 0 folds it into its slice:
//   out[b] = hg_combine(out[b], h);  runs[b] += 1.
// hg_combine is not idempotent, so a block that ran twice (or not at all) changes the checksum,
// and runs[] counts exact executions. Blocks never communicate, the only barrier is reached by
// every thread, the loop's trip count is a kernel parameter, and %ctaid/%nctaid are used plainly:
// the kernel is eligible for ptxstate's block-granular twin (see docs/PTXSTATE.md).
//
// hg_fold<<<any grid, HG_THREADS>>>(out, runs, n, expect_runs, acc) adds an order-independent
// checksum of out[0..n) to acc[0] and the number of slices with runs[i] != expect_runs to acc[1]
// (acc must be zeroed before). hg_block_hash is the host reference of one block's hash.
#pragma once
#include <cuda_runtime.h>
#include <time.h>
#include "common.h"

#define HG_THREADS 256

__host__ __device__ inline uint32_t hg_mix32(uint32_t x) {  // "lowbias32" integer hash
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

__host__ __device__ inline unsigned long long hg_mix64(unsigned long long z) {  // splitmix64 finaliser
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ull;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebull;
  z ^= z >> 31;
  return z;
}

__host__ __device__ inline unsigned long long hg_combine(unsigned long long prev, unsigned long long h) {
  return hg_mix64(prev ^ h) + h;  // hg_combine(hg_combine(p, h), h) != hg_combine(p, h)
}

// One thread's value: `work` dependent hash rounds (integer only: bit-exact on host and device).
__host__ __device__ inline uint32_t hg_thread(uint32_t b, uint32_t nb, uint32_t tid, uint32_t work,
                                              uint32_t seed) {
  uint32_t x = hg_mix32(b * 0x9e3779b9u ^ hg_mix32(tid + seed * 0x85ebca6bu) ^ hg_mix32(nb));
  for (uint32_t k = 0; k < work; k++) x = hg_mix32(x + k);
  return x;
}

// A thread's contribution to its block's hash (position-mixed so that swapped values show).
__host__ __device__ inline unsigned long long hg_term(uint32_t v, uint32_t tid) {
  return hg_mix64((unsigned long long)v << 32 | tid);
}

__device__ inline unsigned long long hg_warp_sum(unsigned long long s) {
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

__global__ void __launch_bounds__(HG_THREADS)
hashgrid(unsigned long long *out, unsigned int *runs, unsigned int work, unsigned int seed) {
  __shared__ unsigned long long warp_sums[HG_THREADS / 32];
  uint32_t nb = gridDim.x * gridDim.y;
  uint32_t b = blockIdx.y * gridDim.x + blockIdx.x;
  uint32_t v = hg_thread(b, nb, threadIdx.x, work, seed);
  unsigned long long s = hg_warp_sum(hg_term(v, threadIdx.x));
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long h = 0;
    for (int w = 0; w < HG_THREADS / 32; w++) h += warp_sums[w];
    out[b] = hg_combine(out[b], h);
    runs[b] = runs[b] + 1;
  }
}

__global__ void __launch_bounds__(HG_THREADS)
hg_fold(const unsigned long long *out, const unsigned int *runs, unsigned long long n,
        unsigned int expect_runs, unsigned long long *acc) {
  unsigned long long s = 0, bad = 0;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    s += hg_mix64(out[i] + i * 0x9e3779b97f4a7c15ull);
    bad += runs[i] != expect_runs;
  }
  s = hg_warp_sum(s);
  bad = hg_warp_sum(bad);
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(acc, s);
    atomicAdd(acc + 1, bad);
  }
}

// Host reference of block b's hash h (what hashgrid folds into out[b]).
static inline unsigned long long hg_block_hash(uint32_t b, uint32_t nb, uint32_t work, uint32_t seed) {
  unsigned long long h = 0;
  for (uint32_t t = 0; t < HG_THREADS; t++) h += hg_term(hg_thread(b, nb, t, work, seed), t);
  return h;
}

// hg_samples picks k block ids of a grid of nb blocks to check on the host: the first, the last
// and k-2 pseudo-random ones (a pure function of nb).
static inline void hg_samples(uint32_t nb, uint32_t *ids, int k) {
  for (int i = 0; i < k; i++) {
    if (i == 0) ids[i] = 0;
    else if (i == 1) ids[i] = nb - 1;
    else ids[i] = (uint32_t)(hg_mix64(((unsigned long long)nb << 8) + (unsigned long long)i) % nb);
  }
}

static inline int hg_fold_grid(int dev) {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms * 4;
}

// ---- calibration -------------------------------------------------------------------------------

struct hg_calib {
  unsigned int work;        // rounds per thread
  unsigned long long blocks;
  int resident;             // hashgrid blocks resident at once (occupancy x SMs)
  double block_ms;          // measured time of one wave (= one block's run time)
};

// hg_time_ms times one launch of `blocks` blocks (1-D) after a warm-up launch; buffers must hold blocks.
static inline double hg_time_ms(unsigned long long *out, unsigned int *runs, unsigned int blocks,
                                unsigned int work) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  hashgrid<<<blocks, HG_THREADS>>>(out, runs, work, 0);  // warm-up
  CHECK_LAUNCH();
  CHECK(cudaEventRecord(a));
  hashgrid<<<blocks, HG_THREADS>>>(out, runs, work, 0);
  CHECK_LAUNCH();
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return ms > 0.001f ? ms : 0.001;
}

// hg_calibrate chooses (work, blocks) so that one block runs about block_ms milliseconds while a
// full wave is resident, and the whole grid about `seconds` seconds. work > 0 keeps that work
// (only blocks is calibrated). Short timed runs: one wave at a probe work to scale work, then four
// waves at the chosen work to scale blocks. Progress goes to stderr (stdout stays deterministic).
static inline hg_calib hg_calibrate(int dev, double seconds, double block_ms, unsigned int work) {
  hg_calib c{};
  int sms = 0, per_sm = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, hashgrid, HG_THREADS, 0));
  if (per_sm < 1) per_sm = 1;
  c.resident = sms * per_sm;
  const unsigned int waves = 4;
  unsigned int probe_blocks = (unsigned int)c.resident * waves;
  unsigned long long *out;
  unsigned int *runs;
  CHECK(cudaMalloc(&out, probe_blocks * sizeof(*out)));
  CHECK(cudaMalloc(&runs, probe_blocks * sizeof(*runs)));
  if (work == 0) {
    const unsigned int probe_work = 8192;
    double ms = hg_time_ms(out, runs, (unsigned int)c.resident, probe_work);
    double w = probe_work * block_ms / ms;
    w = w < 64 ? 64 : (w > 4e9 ? 4e9 : w);
    work = ((unsigned int)w + 63) / 64 * 64;
    std::fprintf(stderr, "calibrate: %d SMs x %d blocks resident; work %u: one wave %.3f ms -> work %u\n",
                 sms, per_sm, probe_work, ms, work);
  }
  c.work = work;
  double wave_ms = hg_time_ms(out, runs, probe_blocks, work) / waves;
  c.block_ms = wave_ms;
  double nb = seconds * 1000.0 / wave_ms * c.resident;
  nb = nb < 1 ? 1 : (nb > 2147483647.0 ? 2147483647.0 : nb);
  c.blocks = (unsigned long long)nb;
  std::fprintf(stderr, "calibrate: work %u: %.3f ms per wave of %d blocks -> %llu blocks (~%.1f s)\n",
               work, wave_ms, c.resident, c.blocks, (double)c.blocks / c.resident * wave_ms / 1000.0);
  CHECK(cudaFree(out));
  CHECK(cudaFree(runs));
  return c;
}

static inline double hg_now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}
