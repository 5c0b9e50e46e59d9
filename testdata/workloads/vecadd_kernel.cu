// The kernel ptxload loads as PTX (compiled with `nvcc -ptx` on the GPU host).
extern "C" __global__ void vecadd(const float *a, const float *b, float *c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}
