// Word kernels shared by the counter-style workloads: an LCG step per word, and an
// order-independent 64-bit checksum (sum of a position-mixed value per word, mod 2^64).
#pragma once
#include <cstdint>

__global__ void advance(uint32_t *a, size_t n, uint32_t step) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    a[i] = a[i] * 1664525u + 1013904223u + step;
}

__global__ void checksum(const uint32_t *a, size_t n, unsigned long long *out) {
  unsigned long long s = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned long long v = ((unsigned long long)a[i] << 32 | (unsigned long long)(i & 0xffffffffu));
    v ^= v >> 29; v *= 0xbf58476d1ce4e5b9ull; v ^= v >> 32;
    s += v;
  }
  atomicAdd(out, s);
}
