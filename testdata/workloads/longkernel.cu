// longkernel: one kernel that runs for a long time doing real, deterministic work.
//
//   longkernel [--seconds S | --iters N] [--device D]
//
// Every thread runs N iterations of an integer Monte Carlo estimate of pi (xorshift64* draws,
// points counted inside the quarter circle) and the counts are summed with 64-bit atomics, so the
// result is exact and independent of scheduling. With --seconds, a short calibration run picks N
// so the kernel takes about S seconds; N is printed ("iters N"), and `longkernel --iters N`
// reproduces the result. Prints "result HEX16 pi X" at the end.
#include <cuda_runtime.h>
#include "common.h"

__global__ void monte_carlo(unsigned long long iters, unsigned long long *hits) {
  unsigned long long tid = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  unsigned long long x = (tid + 1) * 0x9E3779B97F4A7C15ull;
  unsigned long long in = 0;
  for (unsigned long long k = 0; k < iters; k++) {
    x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
    unsigned long long r = x * 0x2545F4914F6CDD1Dull;
    unsigned long long px = r >> 40, py = (r >> 16) & 0xffffffull;  // 24-bit coordinates
    in += (px * px + py * py) < (1ull << 48);
  }
  atomicAdd(hits, in);
}

int main(int argc, char **argv) {
  if (has_flag(argc, argv, "--help") || has_flag(argc, argv, "-h")) {
    std::printf("usage: longkernel [--seconds S | --iters N] [--device D]\n");
    return 0;
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  int dev = std::atoi(flag(argc, argv, "--device", "0"));
  CHECK(cudaSetDevice(dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  int blocks = prop.multiProcessorCount * 4, threads = 256;
  unsigned long long *hits;
  CHECK(cudaMalloc(&hits, sizeof(*hits)));
  unsigned long long iters = std::strtoull(flag(argc, argv, "--iters", "0"), nullptr, 10);
  if (iters == 0) {
    double seconds = std::atof(flag(argc, argv, "--seconds", "10"));
    const unsigned long long probe = 1ull << 16;
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    CHECK(cudaMemset(hits, 0, sizeof(*hits)));
    monte_carlo<<<blocks, threads>>>(probe, hits);  // warm-up
    CHECK_LAUNCH();
    CHECK(cudaEventRecord(a));
    monte_carlo<<<blocks, threads>>>(probe, hits);
    CHECK_LAUNCH();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    iters = (unsigned long long)(probe * (seconds * 1000.0 / (ms > 0 ? ms : 1)));
    if (iters == 0) iters = 1;
  }
  std::printf("iters %llu\n", iters);
  CHECK(cudaMemset(hits, 0, sizeof(*hits)));
  monte_carlo<<<blocks, threads>>>(iters, hits);
  CHECK_LAUNCH();
  unsigned long long h = 0;
  CHECK(cudaMemcpy(&h, hits, sizeof(h), cudaMemcpyDeviceToHost));
  double total = (double)iters * blocks * threads;
  std::printf("result %016llx pi %.9f\n", h, 4.0 * (double)h / total);
  CHECK(cudaFree(hits));
  return 0;
}
