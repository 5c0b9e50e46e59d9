// A grid-stride loop: the stride reads gridDim, so %nctaid must stay the original grid's.
extern "C" __global__ void scale_gridstride(const double *in, double *out, double f, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
    out[i] = in[i] * f + (double)(i % 7);
}
