// 2D and 3D grids: %ctaid.y/.z and %nctaid.y/.z must all be virtualised.
extern "C" __global__ void matadd2d(const float *a, const float *b, float *c, int w, int h) {
  int x = blockIdx.x * blockDim.x + threadIdx.x;
  int y = blockIdx.y * blockDim.y + threadIdx.y;
  if (x < w && y < h) c[y * w + x] = a[y * w + x] * 2.0f + b[y * w + x];
}

extern "C" __global__ void transpose2d(const float *in, float *out, int w, int h) {
  __shared__ float tile[32][33];
  int x = blockIdx.x * 32 + threadIdx.x;
  int y = blockIdx.y * 32 + threadIdx.y;
  for (int j = 0; j < 32; j += 8)
    if (x < w && y + j < h) tile[threadIdx.y + j][threadIdx.x] = in[(y + j) * w + x];
  __syncthreads();
  x = blockIdx.y * 32 + threadIdx.x;
  y = blockIdx.x * 32 + threadIdx.y;
  for (int j = 0; j < 32; j += 8)
    if (x < h && y + j < w) out[(y + j) * h + x] = tile[threadIdx.x][threadIdx.y + j];
}

// Writes a fingerprint of every coordinate, so a wrong virtual block id shows up in the output.
extern "C" __global__ void coords3d(unsigned *out, int nx, int ny, int nz) {
  int x = blockIdx.x * blockDim.x + threadIdx.x;
  int y = blockIdx.y * blockDim.y + threadIdx.y;
  int z = blockIdx.z * blockDim.z + threadIdx.z;
  if (x >= nx || y >= ny || z >= nz) return;
  unsigned v = (blockIdx.x * 73856093u) ^ (blockIdx.y * 19349663u) ^ (blockIdx.z * 83492791u);
  v ^= gridDim.x * 3u + gridDim.y * 5u + gridDim.z * 7u;
  out[((size_t)z * ny + y) * nx + x] = v ^ (threadIdx.x + 1000u * threadIdx.y);
}
