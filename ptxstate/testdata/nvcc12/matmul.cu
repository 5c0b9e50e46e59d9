// C = A * B with square shared-memory tiles (templated tile size), row-major, sizes multiples of
// the tile; blockDim = (TS, TS).
template <int TS>
__device__ void matmul_tile(float *C, const float *A, const float *B, int n, int k) {
    __shared__ float As[TS][TS];
    __shared__ float Bs[TS][TS];
    int row = blockIdx.y * TS + threadIdx.y, col = blockIdx.x * TS + threadIdx.x;
    float acc = 0.f;
    for (int t = 0; t < k; t += TS) {
        As[threadIdx.y][threadIdx.x] = A[row * k + t + threadIdx.x];
        Bs[threadIdx.y][threadIdx.x] = B[(t + threadIdx.y) * n + col];
        __syncthreads();
#pragma unroll
        for (int i = 0; i < TS; i++) acc = fmaf(As[threadIdx.y][i], Bs[i][threadIdx.x], acc);
        __syncthreads();
    }
    C[row * n + col] = acc;
}

extern "C" __global__ void __launch_bounds__(256) matmul16(float *C, const float *A, const float *B, int n, int k) {
    matmul_tile<16>(C, A, B, n, k);
}
extern "C" __global__ void __launch_bounds__(1024) matmul32(float *C, const float *A, const float *B, int n, int k) {
    matmul_tile<32>(C, A, B, n, k);
}
