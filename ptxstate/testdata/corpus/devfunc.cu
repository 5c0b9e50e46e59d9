// Calls to non-inlined device functions, one of which reads blockIdx (the instrumenter must
// either virtualise it there too or refuse the kernel).
__device__ __noinline__ float poly(float x, float a, float b, float c) { return (a * x + b) * x + c; }

__device__ __noinline__ int global_index() { return blockIdx.x * blockDim.x + threadIdx.x; }

extern "C" __global__ void apply_poly(const float *in, float *out, int n, float a, float b, float c) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = poly(in[i], a, b, c);
}

extern "C" __global__ void index_via_call(int *out, int n) {
  int i = global_index();
  if (i < n) out[i] = i * 3 + 1;
}
