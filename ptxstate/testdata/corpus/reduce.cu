// Block reductions through shared memory and barriers.
extern "C" __global__ void reduce_sum(const float *in, float *out, int n) {
  __shared__ float s[256];
  unsigned t = threadIdx.x;
  unsigned i = blockIdx.x * blockDim.x * 2 + t;
  float v = 0.0f;
  if (i < n) v = in[i];
  if (i + blockDim.x < n) v += in[i + blockDim.x];
  s[t] = v;
  __syncthreads();
  for (unsigned k = blockDim.x / 2; k > 0; k >>= 1) {
    if (t < k) s[t] += s[t + k];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}

// Uniform early exit (the whole block leaves together) before the barriers.
extern "C" __global__ void reduce_max_rows(const int *in, int *out, int rows, int cols) {
  __shared__ int s[128];
  if (blockIdx.x >= rows) return;
  int m = -2147483647 - 1;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) m = max(m, in[(size_t)blockIdx.x * cols + c]);
  s[threadIdx.x] = m;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k >>= 1) {
    if (threadIdx.x < k) s[threadIdx.x] = max(s[threadIdx.x], s[threadIdx.x + k]);
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = s[0];
}
