// ptxmig-gpuhash-1: the change-detection hash the shim computes on the GPU over device memory
// (kernel ptxmig_chunk_hash, gpuhash.cu; its PTX embedded in gpuhash_ptx.h), and its CPU reference.
// Sums are commutative, so the value does not depend on the launch geometry:
//   input: a chunk of n bytes, n a multiple of 8; w_i = the little-endian u64 at byte 8i, i < n/8
//   fmix64(x): x ^= x>>33; x *= 0xff51afd7ed558ccd; x ^= x>>33; x *= 0xc4ceb9fe1a85ec53; x ^= x>>33
//   smix64(x) (splitmix64's finalizer): x ^= x>>30; x *= 0xbf58476d1ce4e5b9; x ^= x>>27;
//             x *= 0x94d049bb133111eb; x ^= x>>31
//   s1 = sum of fmix64(w_i ^ (i * 0x9E3779B97F4A7C15 + 1))      mod 2^64
//   s2 = sum of smix64(w_i + (i + 1) * 0xC2B2AE3D27D4EB4F)      mod 2^64
//   h1 = fmix64(s1 ^ n), h2 = smix64(s2 + n); the 16-byte hash is h1 then h2, little-endian.
// The GPU kernel accumulates (s1, s2) per chunk into a zeroed u64 pair with atomic adds; the host
// finishes with ptxmig_gpuhash_final.
#ifndef PTXMIG_GPUHASH_H
#define PTXMIG_GPUHASH_H

#include <stdint.h>
#include <string.h>

#define PTXMIG_GPUHASH_NAME "ptxmig-gpuhash-1"
#define PTXMIG_GPUHASH_KERNEL "ptxmig_chunk_hash"

static inline uint64_t ptxmig_gpuhash_fmix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

static inline uint64_t ptxmig_gpuhash_smix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

static inline uint64_t ptxmig_gpuhash_le64(const unsigned char *p) {
  uint64_t v;
  memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

// ptxmig_gpuhash_sums ADDS into sums the terms of words [first_word, first_word + nbytes/8) of a
// chunk, reading them from chunk (which holds the chunk's bytes from word first_word on). A chunk
// hashed in pieces gives the same sums as one call; nbytes is a multiple of 8 (a tail is ignored).
static inline void ptxmig_gpuhash_sums(const void *chunk, uint64_t nbytes, uint64_t first_word, uint64_t sums[2]) {
  const unsigned char *p = (const unsigned char *)chunk;
  uint64_t s1 = sums[0], s2 = sums[1], nw = nbytes / 8;
  for (uint64_t k = 0; k < nw; k++) {
    uint64_t w = ptxmig_gpuhash_le64(p + 8 * k), i = first_word + k;
    s1 += ptxmig_gpuhash_fmix64(w ^ (i * 0x9E3779B97F4A7C15ULL + 1));
    s2 += ptxmig_gpuhash_smix64(w + (i + 1) * 0xC2B2AE3D27D4EB4FULL);
  }
  sums[0] = s1;
  sums[1] = s2;
}

// ptxmig_gpuhash_final turns a chunk's sums into its 16-byte hash (nbytes: the chunk's length).
static inline void ptxmig_gpuhash_final(const uint64_t sums[2], uint64_t nbytes, uint8_t out[16]) {
  uint64_t h[2] = {ptxmig_gpuhash_fmix64(sums[0] ^ nbytes), ptxmig_gpuhash_smix64(sums[1] + nbytes)};
  for (int j = 0; j < 2; j++)
    for (int b = 0; b < 8; b++) out[8 * j + b] = (uint8_t)(h[j] >> (8 * b));
}

// ptxmig_gpuhash hashes one whole chunk of nbytes bytes.
static inline void ptxmig_gpuhash(const void *chunk, uint64_t nbytes, uint8_t out[16]) {
  uint64_t sums[2] = {0, 0};
  ptxmig_gpuhash_sums(chunk, nbytes, 0, sums);
  ptxmig_gpuhash_final(sums, nbytes, out);
}

#endif
