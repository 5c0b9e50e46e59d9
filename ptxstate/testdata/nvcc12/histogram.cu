// 256-bin byte histogram: one sub-histogram per warp in shared memory (shared atomics), merged
// into the global histogram with one global atomic per bin and block; grid-stride over words.
#define BINS 256
#define WARPS 8  // blockDim.x == 32 * WARPS

extern "C" __global__ void histogram_bytes(const unsigned *data, unsigned nwords, unsigned *hist) {
    __shared__ unsigned sub[WARPS][BINS];
    for (unsigned i = threadIdx.x; i < WARPS * BINS; i += blockDim.x) (&sub[0][0])[i] = 0;
    __syncthreads();
    unsigned *mine = sub[threadIdx.x / 32];
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < nwords; i += blockDim.x * gridDim.x) {
        unsigned w = data[i];
        for (int k = 0; k < 4; k++, w >>= 8) atomicAdd(&mine[w & 0xffu], 1u);
    }
    __syncthreads();
    for (unsigned bin = threadIdx.x; bin < BINS; bin += blockDim.x) {
        unsigned s = 0;
        for (int w = 0; w < WARPS; w++) s += sub[w][bin];
        if (s) atomicAdd(&hist[bin], s);
    }
}

// 64 bins of the top 6 bits of each byte, counted with warp-aggregated votes instead of atomics.
extern "C" __global__ void histogram64_vote(const unsigned char *data, unsigned n, unsigned *hist) {
    __shared__ unsigned counts[64];
    if (threadIdx.x < 64) counts[threadIdx.x] = 0;
    __syncthreads();
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    bool valid = i < n;
    unsigned bin = valid ? data[i] >> 2 : 64u;
    unsigned peers = __match_any_sync(0xffffffffu, bin);
    unsigned lane = threadIdx.x & 31;
    if (valid && (__ffs(peers) - 1) == (int)lane) atomicAdd(&counts[bin], __popc(peers));
    __syncthreads();
    if (threadIdx.x < 64 && counts[threadIdx.x]) atomicAdd(&hist[threadIdx.x], counts[threadIdx.x]);
}
