// Asynchronous copies into shared memory (inline PTX): double-buffered cp.async (sm_80+), and on
// sm_90 a TMA bulk copy completed on an mbarrier plus a bulk-group store (the sm_80 build of
// async_bulk_scale uses plain loads and stores).

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

#define TILE 1024  // floats per block; blockDim.x == 256

extern "C" __global__ void pipeline_sum(const float4 *in, float *out, int tiles) {
    __shared__ float4 buf[2][256];
    float acc = 0.f;
    int t = blockIdx.x;
    cp_async16(&buf[0][threadIdx.x], &in[t * 256 + threadIdx.x]);
    cp_async_commit();
    for (int k = 0; t < tiles; k ^= 1) {
        int next = t + gridDim.x;
        if (next < tiles)
            cp_async16(&buf[k ^ 1][threadIdx.x], &in[next * 256 + threadIdx.x]);
        cp_async_commit();
        cp_async_wait1();
        float4 v = buf[k][threadIdx.x];
        acc += v.x + v.y + v.z + v.w;
        t = next;
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

extern "C" __global__ void __launch_bounds__(256) async_bulk_scale(const float *in, float *out, float factor) {
    __shared__ alignas(128) float tile[TILE];
    const float *src = in + (size_t)blockIdx.x * TILE;
    float *dst = out + (size_t)blockIdx.x * TILE;
#if __CUDA_ARCH__ >= 900
    __shared__ alignas(8) unsigned long long bar;
    unsigned sbar = (unsigned)__cvta_generic_to_shared(&bar);
    unsigned stile = (unsigned)__cvta_generic_to_shared(tile);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sbar));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(sbar), "r"(TILE * 4) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(stile), "l"(src), "r"(TILE * 4), "r"(sbar) : "memory");
    }
    unsigned done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done) : "r"(sbar) : "memory");
    for (int i = threadIdx.x; i < TILE; i += blockDim.x) tile[i] *= factor;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(stile), "r"(TILE * 4) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(sbar) : "memory");
    }
#else
    for (int i = threadIdx.x; i < TILE; i += blockDim.x) tile[i] = src[i] * factor;
    __syncthreads();
    for (int i = threadIdx.x; i < TILE; i += blockDim.x) dst[i] = tile[i];
#endif
}
