// The fake compilers' "cubin": a 64-bit little-endian ELF with one ".text.NAME" section (empty)
// for each ".entry NAME(" in what was compiled (its kernels, as a real cubin has them), a
// section-name table, and one PROGBITS section of 32 bytes holding a hash of what was compiled, so
// that different inputs give different cubins whose extent and kernels the shim can read from the
// headers (fb_elf_size, fb_elf_each_text). FAKE_ELF_MAX bytes at most; fake_elf returns the size.
#ifndef FAKE_ELF_H
#define FAKE_ELF_H
#include <stdint.h>
#include <string.h>

#define FAKE_ELF_MAX 4096
#define FAKE_ELF_KERNELS 16

static inline void fake_sh(uint8_t *sh, uint32_t name, uint32_t type, uint64_t off, uint64_t size) {
  memcpy(sh, &name, 4), memcpy(sh + 4, &type, 4), memcpy(sh + 0x18, &off, 8), memcpy(sh + 0x20, &size, 8);
}

static inline size_t fake_elf(uint8_t out[FAKE_ELF_MAX], const void *data, size_t n) {
  memset(out, 0, FAKE_ELF_MAX);
  static const uint8_t ident[] = {0x7f, 'E', 'L', 'F', 2, 1, 1};
  memcpy(out, ident, sizeof ident);
  // The kernels' names.
  const char *t = data, *e = t + n, *kn[FAKE_ELF_KERNELS];
  size_t kl[FAKE_ELF_KERNELS], nk = 0, names = 1 + 10 + 6;  // "\0.shstrtab\0.hash\0"
  for (const char *s = t; nk < FAKE_ELF_KERNELS && s < e && (s = memmem(s, (size_t)(e - s), ".entry ", 7)); s++) {
    const char *nm = s + 7, *end = nm;
    while (end < e && *end != '(' && *end != ' ' && *end != '\n') end++;
    if (end == nm || names + 6 + (size_t)(end - nm) + 1 > 1024) continue;
    kn[nk] = nm, kl[nk] = (size_t)(end - nm), names += 6 + kl[nk] + 1, nk++;
  }
  // Layout: header, section headers (null, names, hash, one per kernel), the names, the hash.
  uint16_t shn = (uint16_t)(3 + nk), shes = 64, shstrndx = 1;
  uint64_t shoff = 64, stroff = shoff + (uint64_t)shn * 64, hashoff = (stroff + names + 15) & ~15ull;
  char *tab = (char *)out + stroff;
  size_t o = 1;
  memcpy(tab + o, ".shstrtab", 10);
  fake_sh(out + shoff + 64, (uint32_t)o, 3 /* SHT_STRTAB */, stroff, names), o += 10;
  memcpy(tab + o, ".hash", 6);
  fake_sh(out + shoff + 128, (uint32_t)o, 1 /* SHT_PROGBITS */, hashoff, 32), o += 6;
  for (size_t i = 0; i < nk; i++) {
    memcpy(tab + o, ".text.", 6), memcpy(tab + o + 6, kn[i], kl[i]);
    fake_sh(out + shoff + 64 * (3 + i), (uint32_t)o, 1, hashoff, 0), o += 6 + kl[i] + 1;
  }
  memcpy(out + 0x28, &shoff, 8);
  memcpy(out + 0x3a, &shes, 2);
  memcpy(out + 0x3c, &shn, 2);
  memcpy(out + 0x3e, &shstrndx, 2);
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, four rounds of it
  const uint8_t *p = data;
  for (int r = 0; r < 4; r++) {
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    h ^= (uint64_t)r;
    memcpy(out + hashoff + 8 * r, &h, 8);
  }
  return (size_t)(hashoff + 32);
}
#endif
