// Dynamic shared memory (size chosen at launch): a block-wide inclusive scan.
extern "C" __global__ void scan_dyn(const int *in, int *out, int n) {
  extern __shared__ int buf[];
  int t = threadIdx.x;
  int i = blockIdx.x * blockDim.x + t;
  buf[t] = i < n ? in[i] : 0;
  __syncthreads();
  for (int off = 1; off < blockDim.x; off <<= 1) {
    int v = t >= off ? buf[t - off] : 0;
    __syncthreads();
    buf[t] += v;
    __syncthreads();
  }
  if (i < n) out[i] = buf[t];
}
