// Early returns. The first is divergent with no barrier after it (safe); the second is divergent
// and followed by a barrier that the remaining threads still reach (PTX counts only non-exited
// threads at a barrier), which the plain persistent-thread transform cannot keep.
extern "C" __global__ void clamp_tail(const int *in, int *out, int n, int lo, int hi) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int v = in[i];
  if (v < lo) { out[i] = lo; return; }
  if (v > hi) { out[i] = hi; return; }
  out[i] = v;
}

extern "C" __global__ void ret_then_sync(const float *in, float *out, int n) {
  __shared__ float s[256];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  s[threadIdx.x] = in[i];
  __syncthreads();
  int j = threadIdx.x ^ 1;
  float o = (j < blockDim.x && blockIdx.x * blockDim.x + j < n) ? s[j] : 0.0f;
  out[i] = s[threadIdx.x] + o;
}
