// Inter-thread waits: within a CTA (eligible for a twin) and across CTAs (refused), and the
// "last block finishes the reduction" pattern.

// Warp 0 fills a shared table and releases a flag; the other warps wait for it with an acquire
// load through a generic pointer to shared memory.
__device__ __forceinline__ unsigned ld_acquire_cta(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.cta.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

extern "C" __global__ void cta_handoff(const float *in, float *out, int n) {
    __shared__ float table[32];
    __shared__ unsigned ready;
    if (threadIdx.x == 0) ready = 0;
    __syncthreads();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (threadIdx.x < 32) {
        table[threadIdx.x] = in[(blockIdx.x * 32 + threadIdx.x) % n] * 0.5f;
        __syncwarp();
        if (threadIdx.x == 0)
            asm volatile("red.release.cta.shared::cta.or.b32 [%0], 1;" ::"r"((unsigned)__cvta_generic_to_shared(&ready)) : "memory");
    } else {
        while (ld_acquire_cta(&ready) == 0) {
        }
    }
    if (i < n) out[i] = in[i] + table[threadIdx.x % 32];
}

// A chained scan: block b waits until block b-1 published its inclusive prefix in global memory.
extern "C" __global__ void chained_block_sums(const unsigned *in, unsigned *prefix, volatile unsigned *flags, int n) {
    __shared__ unsigned total;
    unsigned v = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (blockIdx.x + 1) * blockDim.x && i < n; i += blockDim.x) v += in[i];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) atomicAdd(&total, v);
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned before = 0;
        if (blockIdx.x > 0) {
            while (flags[blockIdx.x - 1] == 0) {
            }
            before = prefix[blockIdx.x - 1];
        }
        prefix[blockIdx.x] = before + total;
        __threadfence();
        flags[blockIdx.x] = 1;
    }
}

// Sum of an array: every block reduces its part; the block that takes the last ticket adds up
// the partial sums (the ticket counter is reset for the next launch).
__device__ unsigned tickets;

extern "C" __global__ void sum_last_block(const float *in, float *partial, float *result, int n) {
    __shared__ float warp_sums[32];
    __shared__ bool last;
    float s = 0.f;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) s += in[i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.f;
        for (int w = 0; w < blockDim.x / 32; w++) t += warp_sums[w];
        partial[blockIdx.x] = t;
        __threadfence();
        last = atomicInc(&tickets, gridDim.x) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) {
        float t = 0.f;
        for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) t += partial[b];
        for (int o = 16; o > 0; o >>= 1) t += __shfl_down_sync(0xffffffffu, t, o);
        if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = t;
        __syncthreads();
        if (threadIdx.x == 0) {
            float r = 0.f;
            for (int w = 0; w < blockDim.x / 32; w++) r += warp_sums[w];
            *result = r;
        }
    }
}
