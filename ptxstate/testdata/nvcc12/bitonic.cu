// Bitonic sorting network: each block sorts a chunk of key/value pairs in shared memory; larger
// arrays are finished by global compare-exchange passes and shared-memory merges.
#define CHUNK 1024  // pairs per block; blockDim.x == CHUNK / 2

__device__ __forceinline__ void cmpx(unsigned &ka, unsigned &va, unsigned &kb, unsigned &vb, bool up) {
    if ((ka > kb) == up) {
        unsigned t = ka; ka = kb; kb = t;
        t = va; va = vb; vb = t;
    }
}

extern "C" __global__ void bitonic_sort_chunk(unsigned *keys, unsigned *vals, int ascending) {
    __shared__ unsigned k[CHUNK], v[CHUNK];
    unsigned base = blockIdx.x * CHUNK, t = threadIdx.x;
    k[t] = keys[base + t];
    v[t] = vals[base + t];
    k[t + CHUNK / 2] = keys[base + t + CHUNK / 2];
    v[t + CHUNK / 2] = vals[base + t + CHUNK / 2];
    for (unsigned size = 2; size <= CHUNK; size <<= 1) {
        bool up = ((t & (size / 2)) != 0) != (ascending != 0);
        if (size == CHUNK) up = ascending != 0;
        for (unsigned stride = size / 2; stride > 0; stride >>= 1) {
            __syncthreads();
            unsigned pos = 2 * t - (t & (stride - 1));
            cmpx(k[pos], v[pos], k[pos + stride], v[pos + stride], up);
        }
    }
    __syncthreads();
    keys[base + t] = k[t];
    vals[base + t] = v[t];
    keys[base + t + CHUNK / 2] = k[t + CHUNK / 2];
    vals[base + t + CHUNK / 2] = v[t + CHUNK / 2];
}

extern "C" __global__ void bitonic_merge_global(unsigned *keys, unsigned *vals, unsigned n, unsigned size, unsigned stride, int ascending) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n / 2) return;
    unsigned cmp = i & (n / 2 - 1);
    bool up = ((cmp & (size / 2)) != 0) != (ascending != 0);
    unsigned pos = 2 * i - (i & (stride - 1));
    unsigned ka = keys[pos], kb = keys[pos + stride], va = vals[pos], vb = vals[pos + stride];
    cmpx(ka, va, kb, vb, up);
    keys[pos] = ka; keys[pos + stride] = kb;
    vals[pos] = va; vals[pos + stride] = vb;
}
