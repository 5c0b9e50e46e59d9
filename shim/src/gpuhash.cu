// ptxmig_chunk_hash: the GPU side of ptxmig-gpuhash-1 (definition and CPU reference: gpuhash.h).
// Not built with the shim: gen-gpuhash.sh (make gpuhash) turns it into PTX, embedded in
// gpuhash_ptx.h. No #include, so any nvcc compiles it without the CCCL headers.
//
// The region [base, base + len) is split into chunks of `chunk` bytes (the last one shorter; all
// lengths multiples of 8). Launch it with 1-D blocks and grid.x = nchunks * bpc: block b handles
// chunk c = b / bpc, part p = b % bpc; its threads stride over the chunk's words from
// p * blockDim.x + threadIdx.x in steps of bpc * blockDim.x, accumulate the two lane sums (word
// index relative to the chunk's start), reduce them within each warp, and lane 0 of each warp adds
// them into out[2c] and out[2c + 1] (which the caller zeroes first). The host finishes each chunk
// with ptxmig_gpuhash_final(&out[2c], chunk length). Blocks past the last chunk do nothing, nor does
// a launch with chunk < 8 or bpc == 0. Any block shape works (the warp reduction covers partial
// warps; threads with the same threadIdx.x in other rows repeat the work), but the shim launches
// 1-D blocks. base and out must be 8-byte aligned. Words are read with ld.global.nc (const
// __restrict__): the region must not change while the kernel runs.

typedef unsigned long long u64;

__device__ __forceinline__ u64 fmix64(u64 x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

__device__ __forceinline__ u64 smix64(u64 x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

extern "C" __global__ void ptxmig_chunk_hash(const unsigned long long *__restrict__ base,
                                             unsigned long long len, unsigned long long chunk,
                                             unsigned int bpc, unsigned long long *__restrict__ out) {
  if (chunk < 8 || bpc == 0) return;
  u64 nchunks = (len + chunk - 1) / chunk;
  u64 c = blockIdx.x / bpc;
  unsigned int p = blockIdx.x % bpc;
  if (c >= nchunks) return;  // the whole block: no warp below is left partial by this
  u64 start = c * chunk;
  u64 nw = (len - start < chunk ? len - start : chunk) / 8;
  const unsigned long long *w = base + start / 8;
  u64 s1 = 0, s2 = 0;
  u64 step = (u64)bpc * blockDim.x;
  for (u64 i = (u64)p * blockDim.x + threadIdx.x; i < nw; i += step) {
    u64 v = w[i];  // read-only and restrict: ld.global.nc
    s1 += fmix64(v ^ (i * 0x9E3779B97F4A7C15ULL + 1));
    s2 += smix64(v + (i + 1) * 0xC2B2AE3D27D4EB4FULL);
  }
  // Warp reduction over the lanes that exist (the last warp of a block may be partial).
  unsigned int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  unsigned int nthreads = blockDim.x * blockDim.y * blockDim.z;
  unsigned int lane = tid & 31, wstart = tid - lane;
  unsigned int width = nthreads - wstart < 32 ? nthreads - wstart : 32;
  unsigned int mask = width == 32 ? 0xffffffffu : (1u << width) - 1;
  for (unsigned int off = 16; off > 0; off >>= 1) {
    u64 a = __shfl_down_sync(mask, s1, off);
    u64 b = __shfl_down_sync(mask, s2, off);
    if (lane + off < width) {
      s1 += a;
      s2 += b;
    }
  }
  if (lane == 0) {
    atomicAdd(out + 2 * c, s1);
    atomicAdd(out + 2 * c + 1, s2);
  }
}
