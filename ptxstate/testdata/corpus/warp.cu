// Warp collectives: shuffles and votes.
extern "C" __global__ void warp_sum(const float *in, float *out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = i < n ? in[i] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) out[i / 32] = v;
}

extern "C" __global__ void warp_vote(const int *in, unsigned *ballots, int *flags, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int v = i < n ? in[i] : 0;
  unsigned b = __ballot_sync(0xffffffffu, v > 0);
  int any = __any_sync(0xffffffffu, v < 0);
  int all = __all_sync(0xffffffffu, v != 0);
  if ((threadIdx.x & 31) == 0) {
    ballots[i / 32] = b;
    flags[i / 32] = any * 2 + all;
  }
}
