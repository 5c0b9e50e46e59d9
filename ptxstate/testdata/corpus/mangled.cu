// C++ kernels with mangled names: a template and an overload in a namespace.
namespace ops {
template <typename T>
__global__ void axpby(T a, const T *x, T b, T *y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + b * y[i];
}
__global__ void fill(int *p, int v, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = v + i;
}
__global__ void fill(float *p, float v, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = v * i;
}
template __global__ void axpby<float>(float, const float *, float, float *, int);
template __global__ void axpby<double>(double, const double *, double, double *, int);
}  // namespace ops
