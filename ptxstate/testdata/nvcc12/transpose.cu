// Matrix transpose through a padded shared tile (coalesced reads and writes), and a variant that
// walks the tiles in diagonal order to spread them over memory partitions.
#define T 32
#define ROWS 8  // blockDim = (T, ROWS)

extern "C" __global__ void transpose_padded(float *out, const float *in, int width, int height) {
    __shared__ float tile[T][T + 1];
    int x = blockIdx.x * T + threadIdx.x, y = blockIdx.y * T + threadIdx.y;
    for (int j = 0; j < T; j += ROWS)
        if (x < width && y + j < height) tile[threadIdx.y + j][threadIdx.x] = in[(y + j) * width + x];
    __syncthreads();
    x = blockIdx.y * T + threadIdx.x;
    y = blockIdx.x * T + threadIdx.y;
    for (int j = 0; j < T; j += ROWS)
        if (x < height && y + j < width) out[(y + j) * height + x] = tile[threadIdx.x][threadIdx.y + j];
}

extern "C" __global__ void transpose_diagonal(float *out, const float *in, int width, int height) {
    __shared__ float tile[T][T + 1];
    int bx, by;
    if (width == height) {
        by = blockIdx.x;
        bx = (blockIdx.x + blockIdx.y) % gridDim.x;
    } else {
        int linear = blockIdx.x + gridDim.x * blockIdx.y;
        by = linear % gridDim.y;
        bx = ((linear / gridDim.y) + by) % gridDim.x;
    }
    int x = bx * T + threadIdx.x, y = by * T + threadIdx.y;
    for (int j = 0; j < T; j += ROWS) tile[threadIdx.y + j][threadIdx.x] = in[(y + j) * width + x];
    __syncthreads();
    x = by * T + threadIdx.x;
    y = bx * T + threadIdx.y;
    for (int j = 0; j < T; j += ROWS) out[(y + j) * height + x] = tile[threadIdx.x][threadIdx.y + j];
}
