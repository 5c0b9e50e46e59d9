// twogpu: one process with a context, memory and kernels on each of two GPUs, exchanging data
// between them every step — the multi-GPU process that checkpoint, restore --gpu-map and migrate
// must move as a whole.
//
//   twogpu [--mib N] [--steps K] [--interval-ms M] [--p2p]
//
// Device 0 holds N MiB and device 1 holds 2N MiB (so the two GPUs can be told apart by the memory
// the process uses on each). Each step advances every word on both devices (an LCG step that
// depends on the step and the device), then mixes: the first MiB of device 0's buffer is copied
// into device 1's buffer (cudaMemcpyPeer, staged by the driver), or, with --p2p, peer access is
// enabled both ways and a kernel on device 1 reads device 0's memory directly, then one on device
// 0 reads device 1's (both links are used: a link lost across a checkpoint faults). It prints
// "step I checksum HEX16 HEX16" (one checksum per device) and at the end "final checksum HEX16
// HEX16": a pure function of (N, K, --p2p), so a run that was checkpointed, restored with the GPUs
// swapped or migrated in between must print the same lines as an uninterrupted one.
#include <cuda_runtime.h>
#include <unistd.h>
#include <algorithm>
#include "common.h"
#include "words.h"

__global__ void seed(uint32_t *a, size_t n, uint32_t salt) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    a[i] = (uint32_t)(i * 2654435761u) ^ 0x9e3779b9u ^ salt;
}

// mix folds src's words into dst's (runs on dst's device; src is the other device's memory,
// reached over peer access).
__global__ void mix(uint32_t *dst, const uint32_t *src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dst[i] ^= src[i] * 2246822519u;
}

int main(int argc, char **argv) {
  if (has_flag(argc, argv, "--help") || has_flag(argc, argv, "-h")) {
    std::printf("usage: twogpu [--mib N] [--steps K] [--interval-ms M] [--p2p]\n");
    return 0;
  }
  size_t mib = std::strtoull(flag(argc, argv, "--mib", "64"), nullptr, 10);
  long steps = std::strtol(flag(argc, argv, "--steps", "100"), nullptr, 10);
  long interval = std::strtol(flag(argc, argv, "--interval-ms", "100"), nullptr, 10);
  bool p2p = has_flag(argc, argv, "--p2p");
  if (mib == 0 || steps <= 0 || interval < 0) {
    std::fprintf(stderr, "twogpu: --mib and --steps must be positive, --interval-ms >= 0\n");
    return 2;
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  int count = 0;
  CHECK(cudaGetDeviceCount(&count));
  if (count < 2) {
    std::fprintf(stderr, "twogpu: needs two visible GPUs, sees %d\n", count);
    return 2;
  }
  if (p2p) {
    int can01 = 0, can10 = 0;
    CHECK(cudaDeviceCanAccessPeer(&can01, 0, 1));
    CHECK(cudaDeviceCanAccessPeer(&can10, 1, 0));
    if (!can01 || !can10) {
      std::fprintf(stderr, "twogpu: --p2p: the GPUs cannot access each other's memory\n");
      return 2;
    }
  }
  std::printf("pid %d", (int)getpid());
  uint32_t *a[2];
  size_t n[2];
  unsigned long long *sum[2];
  int grid[2];
  for (int d = 0; d < 2; d++) {
    CHECK(cudaSetDevice(d));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, d));
    std::printf(" device %d uuid ", d);
    print_uuid(prop.uuid);
    n[d] = (size_t)(d + 1) * mib * (1u << 20) / sizeof(uint32_t);
    grid[d] = prop.multiProcessorCount * 8;
    CHECK(cudaMalloc(&a[d], n[d] * sizeof(uint32_t)));
    CHECK(cudaMalloc(&sum[d], sizeof(unsigned long long)));
    if (p2p) CHECK(cudaDeviceEnablePeerAccess(1 - d, 0));
    seed<<<grid[d], 256>>>(a[d], n[d], 0x51ed270bu * (uint32_t)(d + 1));
    CHECK_LAUNCH();
  }
  std::printf(" mib %zu steps %ld%s\n", mib, steps, p2p ? " p2p" : "");
  const size_t mixn = std::min(n[0], (size_t)(1u << 20) / sizeof(uint32_t));
  unsigned long long host[2] = {0, 0};
  for (long s = 1; s <= steps; s++) {
    for (int d = 0; d < 2; d++) {
      CHECK(cudaSetDevice(d));
      advance<<<grid[d], 256>>>(a[d], n[d], (uint32_t)(2 * s + d));
      CHECK_LAUNCH();
      CHECK(cudaDeviceSynchronize());
    }
    CHECK(cudaSetDevice(1));
    if (p2p) {
      mix<<<grid[1], 256>>>(a[1], a[0], mixn);
      CHECK_LAUNCH();
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaSetDevice(0));
      mix<<<grid[0], 256>>>(a[0], a[1] + mixn, mixn);  // device 1 holds 2N: a[1] + mixn is in it
      CHECK_LAUNCH();
    } else {
      CHECK(cudaMemcpyPeer(a[1], 1, a[0], 0, mixn * sizeof(uint32_t)));
    }
    CHECK(cudaDeviceSynchronize());
    for (int d = 0; d < 2; d++) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaMemset(sum[d], 0, sizeof(unsigned long long)));
      checksum<<<grid[d], 256>>>(a[d], n[d], sum[d]);
      CHECK_LAUNCH();
      CHECK(cudaMemcpy(&host[d], sum[d], sizeof(host[d]), cudaMemcpyDeviceToHost));
    }
    std::printf("step %ld checksum %016llx %016llx\n", s, host[0], host[1]);
    if (interval > 0) usleep((useconds_t)interval * 1000);
  }
  std::printf("final checksum %016llx %016llx\n", host[0], host[1]);
  for (int d = 0; d < 2; d++) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaFree(a[d]));
    CHECK(cudaFree(sum[d]));
  }
  return 0;
}
