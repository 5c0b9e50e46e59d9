// Kernels whose blocks run long and have mid-block safe points (ptxmig ptx instrument
// --mid-block): uniform loops (loop sites) and CTA-wide barriers (barrier sites), with live
// registers, predicates, static and dynamic shared memory and non-idempotent atomics across the
// sites, so that a block saved at a site and resumed elsewhere must continue exactly where it
// stopped (a replayed or skipped stretch changes the results). Every trip count is a kernel
// parameter, the same for all threads of a block.

// Monte Carlo with a per-thread xorshift state (the longkernel workload's loop) plus a global
// histogram of the draws: atomics are not idempotent, so a replayed stretch shows.
extern "C" __global__ void mc_hist(unsigned long long iters, unsigned long long *hits, unsigned *hist) {
    unsigned long long tid = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    unsigned long long x = (tid + 1) * 0x9E3779B97F4A7C15ull;
    unsigned long long in = 0;
    for (unsigned long long k = 0; k < iters; k++) {
        x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
        unsigned long long r = x * 0x2545F4914F6CDD1Dull;
        unsigned long long px = r >> 40, py = (r >> 16) & 0xffffffull;
        in += (px * px + py * py) < (1ull << 48);
        if ((k & 63) == 0) atomicAdd(&hist[r & 255], 1u);
    }
    hits[tid] = in;
}

// Rounds of a shared-memory tree reduction: each round stages values in shared memory, reduces
// them with barriers in between, and folds the sum into a running register value; a predicate
// computed before the rounds is used after them.
extern "C" __global__ void smem_rounds(const float *in, float *out, unsigned *count, int rounds, int n) {
    __shared__ float buf[256];
    __shared__ float acc[4];
    unsigned t = threadIdx.x;
    unsigned gid = blockIdx.x * blockDim.x + t;
    bool odd = (in[gid % n] > 0.0f);
    float run = 0.0f;
    if (t < 4) acc[t] = 0.0f;
    __syncthreads();
    for (int r = 0; r < rounds; r++) {
        buf[t] = in[(gid + (unsigned)r * 977u) % n] * (float)(r + 1);
        __syncthreads();
        for (unsigned s = 128; s > 0; s >>= 1) {
            if (t < s) buf[t] += buf[t + s];
            __syncthreads();
        }
        run += buf[0] * 0.5f;
        if (t == 0) acc[r & 3] += buf[0];
        __syncthreads();
    }
    out[gid] = odd ? run : -run;
    if (t < 4) out[gridDim.x * blockDim.x + blockIdx.x * 4 + t] = acc[t];
    if (odd) atomicAdd(count, 1u);
}

// A 1-D stencil iterated in dynamic shared memory (blockDim.x + 2 floats): every step reads the
// neighbours written in the previous step, between two barriers.
extern "C" __global__ void dyn_stencil(const float *in, float *out, int steps) {
    extern __shared__ float cell[];
    unsigned t = threadIdx.x, nt = blockDim.x;
    unsigned gid = blockIdx.x * nt + t;
    cell[t + 1] = in[gid];
    if (t == 0) { cell[0] = 0.0f; cell[nt + 1] = 0.0f; }
    __syncthreads();
    for (int s = 0; s < steps; s++) {
        float v = 0.25f * cell[t] + 0.5f * cell[t + 1] + 0.25f * cell[t + 2] + 0.001f * (float)s;
        __syncthreads();
        cell[t + 1] = v;
        __syncthreads();
    }
    out[gid] = cell[t + 1];
}

// Nested uniform loops with no barrier: two loop sites, the inner one's state (j, h) and the
// outer one's (i, acc) both live at the inner header.
extern "C" __global__ void nested_mix(unsigned *out, int outer, int inner, unsigned seed) {
    unsigned gid = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned acc = seed ^ gid;
    for (int i = 0; i < outer; i++) {
        unsigned h = acc * 2654435761u + (unsigned)i;
        for (int j = 0; j < inner; j++) {
            h ^= h << 13; h ^= h >> 17; h ^= h << 5;
            h += (unsigned)j;
        }
        acc = acc * 31u + h;
    }
    out[gid] = acc;
}
