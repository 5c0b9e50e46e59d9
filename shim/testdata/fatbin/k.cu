// Fixture kernels for the fatbin parser tests (gen.sh). Small on purpose: the fatbins stay a few KB.
#include <cuda_runtime.h>

extern "C" __global__ void fx_scale(float *x, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= a;
}

__device__ int fx_counter;

template <typename T>
__global__ void fx_add(T *out, const T *in, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] += in[i];
  if (i == 0) atomicAdd(&fx_counter, 1);
}

// Host entry point the CI test (fake libcudart) calls: it goes through the nvcc-generated launch
// stubs, so the shim sees __cudaRegisterFatBinary/__cudaRegisterFunction and cudaLaunchKernel.
extern "C" int fx_launch(float *x, int n) {
  fx_scale<<<(n + 127) / 128, 128>>>(x, 2.0f, n);
  fx_add<float><<<(n + 127) / 128, 128>>>(x, x, n);
  return (int)cudaGetLastError();
}
