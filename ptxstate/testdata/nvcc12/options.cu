// European option pricing: closed-form Black-Scholes over a grid-stride loop, and a Monte Carlo
// estimate per option (one block per option, counter-based normals, a warp-shuffle block
// reduction).

// A uniform in (0, 1] from a 64-bit counter (splitmix64 finaliser).
__device__ __forceinline__ float uniform01(unsigned long long x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    return ((unsigned)(x >> 40) + 1u) * (1.0f / 16777216.0f);
}

// A standard normal by Box-Muller from two uniforms.
__device__ __forceinline__ float normal(unsigned long long seed, unsigned long long i) {
    float u1 = uniform01(seed ^ (2 * i)), u2 = uniform01(seed ^ (2 * i + 1));
    return sqrtf(-2.0f * __logf(u1)) * __cosf(6.2831853f * u2);
}

__device__ __forceinline__ float cnd(float d) {
    const float a1 = 0.31938153f, a2 = -0.356563782f, a3 = 1.781477937f, a4 = -1.821255978f, a5 = 1.330274429f;
    float k = __frcp_rn(1.0f + 0.2316419f * fabsf(d));
    float c = 0.3989422804f * __expf(-0.5f * d * d) * (k * (a1 + k * (a2 + k * (a3 + k * (a4 + k * a5)))));
    return d > 0 ? 1.0f - c : c;
}

extern "C" __global__ void black_scholes(float *call, float *put, const float *spot, const float *strike,
                                         const float *years, float rate, float vol, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        float s = spot[i], x = strike[i], t = years[i];
        float sq = sqrtf(t);
        float d1 = (__logf(s / x) + (rate + 0.5f * vol * vol) * t) / (vol * sq);
        float d2 = d1 - vol * sq;
        float e = __expf(-rate * t);
        call[i] = s * cnd(d1) - x * e * cnd(d2);
        put[i] = x * e * (1.0f - cnd(d2)) - s * (1.0f - cnd(d1));
    }
}

extern "C" __global__ void monte_carlo_call(float *price, const float *spot, const float *strike, float years,
                                            float rate, float vol, int paths, unsigned long long seed) {
    __shared__ float partial[32];
    unsigned long long stream = seed + ((unsigned long long)blockIdx.x << 32);
    float s = spot[blockIdx.x], x = strike[blockIdx.x];
    float drift = (rate - 0.5f * vol * vol) * years, diffusion = vol * sqrtf(years);
    float sum = 0.f;
    for (int p = threadIdx.x; p < paths; p += blockDim.x) {
        float st = s * __expf(drift + diffusion * normal(stream, p));
        sum += fmaxf(st - x, 0.f);
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x < 32) {
        sum = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
        if (threadIdx.x == 0) price[blockIdx.x] = __expf(-rate * years) * sum / paths;
    }
}
