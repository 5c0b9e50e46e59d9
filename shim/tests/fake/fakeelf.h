// The fake compilers' "cubin": a 64-bit little-endian ELF header, one section header, and one
// PROGBITS section of 32 bytes holding a hash of what was compiled, so that different inputs give
// different cubins whose extent the shim can read from the headers (fb_elf_size).
#ifndef FAKE_ELF_H
#define FAKE_ELF_H
#include <stdint.h>
#include <string.h>

#define FAKE_ELF_SIZE 160  // header 64, section header 64, section 32

static inline void fake_elf(uint8_t out[FAKE_ELF_SIZE], const void *data, size_t n) {
  memset(out, 0, FAKE_ELF_SIZE);
  static const uint8_t ident[] = {0x7f, 'E', 'L', 'F', 2, 1, 1};
  memcpy(out, ident, sizeof ident);
  uint64_t shoff = 64, off = 128, size = 32;
  uint16_t shes = 64, shn = 1;
  memcpy(out + 0x28, &shoff, 8);
  memcpy(out + 0x3a, &shes, 2);
  memcpy(out + 0x3c, &shn, 2);
  uint32_t type = 1;  // SHT_PROGBITS
  memcpy(out + 64 + 4, &type, 4);
  memcpy(out + 64 + 0x18, &off, 8);
  memcpy(out + 64 + 0x20, &size, 8);
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, four rounds of it
  const uint8_t *p = data;
  for (int r = 0; r < 4; r++) {
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    h ^= (uint64_t)r;
    memcpy(out + 128 + 8 * r, &h, 8);
  }
}
#endif
