// emptyloop N: launches an empty kernel N times and prints the host-side cost of each launch call
// (p50/p99, ns). The queue is drained every 128 launches outside the timed calls, so the numbers
// are launch overhead, not GPU throughput. Used with and without the shim (gputest/run.sh).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>

__global__ void empty_kernel() {}

static double now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 100000;
  cudaFree(0);
  for (int i = 0; i < 1000; i++) empty_kernel<<<1, 1>>>();  // warm up (and pass the shim's sampled first launches)
  cudaDeviceSynchronize();
  std::vector<double> t(n);
  for (int i = 0; i < n; i++) {
    double a = now_ns();
    empty_kernel<<<1, 1>>>();
    t[i] = now_ns() - a;
    if (i % 128 == 127) cudaDeviceSynchronize();
  }
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { fprintf(stderr, "emptyloop: %s\n", cudaGetErrorString(e)); return 1; }
  std::sort(t.begin(), t.end());
  printf("launch_ns p50=%.0f p99=%.0f n=%d\n", t[n / 2], t[(size_t)(n * 0.99)], n);
  return 0;
}
