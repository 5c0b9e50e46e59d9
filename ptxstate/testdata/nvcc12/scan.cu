// Work-efficient exclusive scan of one tile per block in shared memory (up-sweep, then
// down-sweep), and the pass that adds the scanned tile sums back.
#define TILE 512  // elements per block; blockDim.x == TILE / 2

extern "C" __global__ void scan_tiles(const unsigned *in, unsigned *out, unsigned *tile_sums, unsigned n) {
    __shared__ unsigned buf[TILE];
    unsigned t = threadIdx.x;
    unsigned base = blockIdx.x * TILE;
    unsigned a = base + 2 * t, b = a + 1;
    buf[2 * t] = a < n ? in[a] : 0u;
    buf[2 * t + 1] = b < n ? in[b] : 0u;
    unsigned stride = 1;
    for (unsigned width = TILE / 2; width > 0; width >>= 1) {
        __syncthreads();
        if (t < width) {
            unsigned hi = stride * (2 * t + 2) - 1, lo = hi - stride;
            buf[hi] += buf[lo];
        }
        stride <<= 1;
    }
    if (t == 0) {
        if (tile_sums) tile_sums[blockIdx.x] = buf[TILE - 1];
        buf[TILE - 1] = 0;
    }
    for (unsigned width = 1; width < TILE; width <<= 1) {
        stride >>= 1;
        __syncthreads();
        if (t < width) {
            unsigned hi = stride * (2 * t + 2) - 1, lo = hi - stride;
            unsigned v = buf[lo];
            buf[lo] = buf[hi];
            buf[hi] += v;
        }
    }
    __syncthreads();
    if (a < n) out[a] = buf[2 * t];
    if (b < n) out[b] = buf[2 * t + 1];
}

extern "C" __global__ void scan_add_sums(unsigned *out, const unsigned *scanned_sums, unsigned n) {
    __shared__ unsigned add;
    if (threadIdx.x == 0) add = scanned_sums[blockIdx.x];
    __syncthreads();
    unsigned i = blockIdx.x * TILE + threadIdx.x;
    for (unsigned k = 0; k < 2; k++, i += TILE / 2)
        if (i < n) out[i] += add;
}
