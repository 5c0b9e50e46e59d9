// counter: a deterministic, self-checking runtime-API workload for checkpoint/restore tests.
//
//   counter [--mib N] [--frozen-mib F] [--steps K] [--interval-ms M] [--device D] [--busy]
//
// Allocates N MiB of device memory, seeds it, then runs K steps. Each step advances every word
// with an LCG step that depends on the step number, reduces the buffer to a 64-bit checksum and
// prints "step I checksum HEX16". Between steps it sleeps M ms (or, with --busy, keeps the GPU busy
// with kernels on a separate scratch buffer for M ms). The final line "final checksum HEX16" is a
// pure function of (N, K): an uninterrupted run reproduces it exactly, so a run that was
// checkpointed, restored or migrated in between must print the same value. --frozen-mib F adds F
// MiB seeded once and never written again (model weights: what an incremental checkpoint skips);
// its checksum is printed as "frozen checksum HEX16" before the final line.
#include <cuda_runtime.h>
#include <unistd.h>
#include <time.h>
#include "common.h"
#include "words.h"

__global__ void seed(uint32_t *a, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    a[i] = (uint32_t)(i * 2654435761u) ^ 0x9e3779b9u;
}

__global__ void spin(float *x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    float v = x[i];
    for (int k = 0; k < 4096; k++) v = v * 0.999f + 0.001f;
    x[i] = v;
  }
}

static double now_ms() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
  if (has_flag(argc, argv, "--help") || has_flag(argc, argv, "-h")) {
    std::printf("usage: counter [--mib N] [--frozen-mib F] [--steps K] [--interval-ms M] [--device D] [--busy]\n");
    return 0;
  }
  size_t mib = std::strtoull(flag(argc, argv, "--mib", "64"), nullptr, 10);
  size_t frozen_mib = std::strtoull(flag(argc, argv, "--frozen-mib", "0"), nullptr, 10);
  long steps = std::strtol(flag(argc, argv, "--steps", "100"), nullptr, 10);
  long interval = std::strtol(flag(argc, argv, "--interval-ms", "100"), nullptr, 10);
  int dev = std::atoi(flag(argc, argv, "--device", "0"));
  bool busy = has_flag(argc, argv, "--busy");
  if (mib == 0 || steps <= 0 || interval < 0) {
    std::fprintf(stderr, "counter: --mib and --steps must be positive, --interval-ms >= 0\n");
    return 2;
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  CHECK(cudaSetDevice(dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("pid %d device %d uuid ", (int)getpid(), dev);
  print_uuid(prop.uuid);
  std::printf(" mib %zu steps %ld\n", mib, steps);

  size_t n = mib * (1u << 20) / sizeof(uint32_t);
  uint32_t *a;
  unsigned long long *sum;
  float *scratch;
  const int scratch_n = 1 << 20;
  CHECK(cudaMalloc(&a, n * sizeof(uint32_t)));
  CHECK(cudaMalloc(&sum, sizeof(*sum)));
  CHECK(cudaMalloc(&scratch, scratch_n * sizeof(float)));
  CHECK(cudaMemset(scratch, 0, scratch_n * sizeof(float)));
  int grid = prop.multiProcessorCount * 8;
  seed<<<grid, 256>>>(a, n);
  CHECK_LAUNCH();
  size_t fn = frozen_mib * (1u << 20) / sizeof(uint32_t);
  uint32_t *frozen = nullptr;
  if (fn) {
    CHECK(cudaMalloc(&frozen, fn * sizeof(uint32_t)));
    seed<<<grid, 256>>>(frozen, fn);
    CHECK_LAUNCH();
    advance<<<grid, 256>>>(frozen, fn, 0x5eed);
    CHECK_LAUNCH();
  }
  unsigned long long host = 0;
  for (long s = 1; s <= steps; s++) {
    advance<<<grid, 256>>>(a, n, (uint32_t)s);
    CHECK_LAUNCH();
    CHECK(cudaMemset(sum, 0, sizeof(*sum)));
    checksum<<<grid, 256>>>(a, n, sum);
    CHECK_LAUNCH();
    CHECK(cudaMemcpy(&host, sum, sizeof(host), cudaMemcpyDeviceToHost));
    std::printf("step %ld checksum %016llx\n", s, host);
    if (busy) {
      double end = now_ms() + interval;
      while (now_ms() < end) {
        spin<<<scratch_n / 256, 256>>>(scratch, scratch_n);
        CHECK_LAUNCH();
        CHECK(cudaDeviceSynchronize());
      }
    } else if (interval > 0) {
      usleep((useconds_t)interval * 1000);
    }
  }
  if (frozen) {
    unsigned long long fh = 0;
    CHECK(cudaMemset(sum, 0, sizeof(*sum)));
    checksum<<<grid, 256>>>(frozen, fn, sum);
    CHECK_LAUNCH();
    CHECK(cudaMemcpy(&fh, sum, sizeof(fh), cudaMemcpyDeviceToHost));
    std::printf("frozen checksum %016llx\n", fh);
    CHECK(cudaFree(frozen));
  }
  std::printf("final checksum %016llx\n", host);
  CHECK(cudaFree(a));
  CHECK(cudaFree(sum));
  CHECK(cudaFree(scratch));
  return 0;
}
