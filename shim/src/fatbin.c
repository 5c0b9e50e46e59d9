// Fatbin container walking and entry decoding (see fatbin.h and docs/SHIM-PROTOCOL.md).
#include "fatbin.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base.h"

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t rd32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32; }

// Images larger than this are treated as corrupt: no real fatbin or cubin comes close.
#define FB_MAX_IMAGE ((uint64_t)1 << 32)

int fb_is_elf_kind(uint16_t kind) { return kind == 2 || kind == 0x10; }

const char *fb_strerror(int code) {
  switch (code) {
  case FB_OK: return "ok";
  case FB_ETRUNC: return "truncated";
  case FB_EMAGIC: return "bad magic";
  case FB_EHEADER: return "bad header";
  case FB_ENOZSTD: return "zstd entry but libzstd.so.1 not available";
  case FB_EDECODE: return "payload does not decode";
  case FB_ENOMEM: return "out of memory";
  case FB_EUNSUPP: return "unsupported compression";
  }
  return "unknown error";
}

size_t fb_container_size(const uint8_t *p, size_t avail) {
  if (avail < 16 || rd32(p) != FATBIN_CONTAINER_MAGIC) return 0;
  uint16_t hs = rd16(p + 6);
  uint64_t fat = rd64(p + 8);
  if (rd16(p + 4) != 1 || hs < 16 || hs > 256 || fat > FB_MAX_IMAGE) return 0;
  return (size_t)(hs + fat);
}

int fb_walk(const uint8_t *buf, size_t len, fb_visit_fn visit, void *arg, size_t *containers) {
  size_t pos = 0, n = 0, nc = 0;
  if (containers) *containers = 0;
  if (len < 16) return FB_ETRUNC;
  while (pos < len) {
    // nvcc pads between containers in a section with zeros; skip 8-byte aligned zero padding.
    if (nc > 0 && buf[pos] == 0) {
      pos++;
      continue;
    }
    if (len - pos < 16) return FB_ETRUNC;
    const uint8_t *c = buf + pos;
    if (rd32(c) != FATBIN_CONTAINER_MAGIC) return FB_EMAGIC;
    uint16_t hs = rd16(c + 6);
    uint64_t fat = rd64(c + 8);
    if (rd16(c + 4) != 1 || hs < 16 || hs > 256 || fat > FB_MAX_IMAGE) return FB_EHEADER;
    if (fat > len - pos || hs > len - pos - fat) return FB_ETRUNC;
    size_t end = pos + hs + (size_t)fat, e = pos + hs;
    while (e < end) {
      if (end - e < 64) return FB_ETRUNC;
      const uint8_t *h = buf + e;
      uint32_t ehs = rd32(h + 4);
      uint64_t psz = rd64(h + 8);
      if (ehs < 64 || ehs > 4096) return FB_EHEADER;
      if (ehs > end - e || psz > end - e - ehs) return FB_ETRUNC;
      fb_entry ent;
      memset(&ent, 0, sizeof ent);
      ent.kind = rd16(h);
      ent.header_size = ehs;
      ent.data_size = (size_t)psz;
      uint32_t csz = rd32(h + 0x10);
      ent.minor = rd16(h + 0x18);
      ent.major = rd16(h + 0x1a);
      ent.arch = rd32(h + 0x1c);
      uint32_t noff = rd32(h + 0x20), nlen = rd32(h + 0x24);
      ent.flags = rd64(h + 0x28);
      ent.uncompressed_size = rd64(h + 0x38);
      ent.container = nc;
      ent.offset = e;
      ent.data = h + ehs;
      if (ent.flags & FB_FLAG_ZSTD) ent.compression = FB_COMP_ZSTD;
      else if (ent.flags & FB_FLAG_LZ4) ent.compression = FB_COMP_LZ4;
      if (ent.compression != FB_COMP_NONE) {
        if (csz == 0 || csz > psz) return FB_EHEADER;
        ent.data_size = csz;
        if (ent.uncompressed_size == 0 || ent.uncompressed_size > FB_MAX_IMAGE) return FB_EHEADER;
      }
      // The object name, when its offset lies inside this entry, is informational only.
      if (nlen > 0 && nlen < 4096 && noff >= 64 && noff < ehs + psz && nlen <= ehs + psz - noff) {
        ent.name = (const char *)h + noff;
        ent.name_len = nlen;
      }
      n++;
      if (visit && visit(&ent, arg)) {
        if (containers) *containers = nc + 1;
        return (int)n;
      }
      e += ehs + (size_t)psz;
    }
    pos = end;
    nc++;
  }
  if (containers) *containers = nc;
  return (int)n;
}

int fb_elf_has_text(const uint8_t *p, size_t avail, const char *name, size_t nlen) {
  static const uint8_t ident[] = {0x7f, 'E', 'L', 'F', 2 /*64-bit*/, 1 /*LE*/};
  if (avail < 64 || memcmp(p, ident, sizeof ident) != 0) return 0;
  uint64_t shoff = rd64(p + 0x28);
  uint16_t shes = rd16(p + 0x3a), shn = rd16(p + 0x3c), shstrndx = rd16(p + 0x3e);
  if (shes < 0x40 || shstrndx >= shn || shoff > avail || (uint64_t)shn * shes > avail - shoff) return 0;
  const uint8_t *strh = p + shoff + (uint64_t)shstrndx * shes;
  uint64_t stroff = rd64(strh + 0x18), strsize = rd64(strh + 0x20);
  if (stroff > avail || strsize > avail - stroff) return 0;
  for (uint16_t i = 0; i < shn; i++) {
    uint64_t off = rd32(p + shoff + (uint64_t)i * shes);
    if (off >= strsize || strsize - off <= 6 + (uint64_t)nlen) continue;
    const uint8_t *nm = p + stroff + off;
    if (memcmp(nm, ".text.", 6) == 0 && memcmp(nm + 6, name, nlen) == 0 && nm[6 + nlen] == 0) return 1;
  }
  return 0;
}

int fb_elf_each_text(const uint8_t *p, size_t avail, int (*fn)(void *arg, const char *name, size_t nlen), void *arg) {
  static const uint8_t ident[] = {0x7f, 'E', 'L', 'F', 2 /*64-bit*/, 1 /*LE*/};
  if (avail < 64 || memcmp(p, ident, sizeof ident) != 0) return -1;
  uint64_t shoff = rd64(p + 0x28);
  uint16_t shes = rd16(p + 0x3a), shn = rd16(p + 0x3c), shstrndx = rd16(p + 0x3e);
  if (shes < 0x40 || shstrndx >= shn || shoff > avail || (uint64_t)shn * shes > avail - shoff) return -1;
  const uint8_t *strh = p + shoff + (uint64_t)shstrndx * shes;
  uint64_t stroff = rd64(strh + 0x18), strsize = rd64(strh + 0x20);
  if (stroff > avail || strsize > avail - stroff) return -1;
  for (uint16_t i = 0; i < shn; i++) {
    uint64_t off = rd32(p + shoff + (uint64_t)i * shes);
    if (off >= strsize || strsize - off <= 6) continue;
    const char *nm = (const char *)p + stroff + off;
    const char *end = memchr(nm, 0, strsize - off);  // names end inside the table
    if (!end || memcmp(nm, ".text.", 6) != 0 || end == nm + 6) continue;
    int r = fn(arg, nm + 6, (size_t)(end - nm - 6));
    if (r) return r;
  }
  return 0;
}

size_t fb_elf_size(const uint8_t *p, size_t avail) {
  static const uint8_t ident[] = {0x7f, 'E', 'L', 'F', 2 /*64-bit*/, 1 /*LE*/};
  if (avail < 64 || memcmp(p, ident, sizeof ident) != 0) return 0;
  uint64_t phoff = rd64(p + 0x20), shoff = rd64(p + 0x28);
  uint16_t phes = rd16(p + 0x36), phn = rd16(p + 0x38), shes = rd16(p + 0x3a), shn = rd16(p + 0x3c);
  uint64_t end = 64;
  if (phoff > FB_MAX_IMAGE || shoff > FB_MAX_IMAGE) return 0;
  if (phn && phoff + (uint64_t)phn * phes > end) end = phoff + (uint64_t)phn * phes;
  if (shn && shoff + (uint64_t)shn * shes > end) end = shoff + (uint64_t)shn * shes;
  if (end > avail) return 0;
  if (shn && shes >= 0x28) {
    for (uint16_t i = 0; i < shn; i++) {
      const uint8_t *s = p + shoff + (uint64_t)i * shes;
      uint32_t type = rd32(s + 4);
      uint64_t off = rd64(s + 0x18), sz = rd64(s + 0x20);
      if (type == 8 /*SHT_NOBITS*/ || type == 0) continue;
      if (off > FB_MAX_IMAGE || sz > FB_MAX_IMAGE) return 0;
      if (off + sz > end) end = off + sz;
    }
  }
  if (phn && phes >= 0x38) {
    for (uint16_t i = 0; i < phn; i++) {
      const uint8_t *s = p + phoff + (uint64_t)i * phes;
      uint64_t off = rd64(s + 8), fsz = rd64(s + 0x20);
      if (off > FB_MAX_IMAGE || fsz > FB_MAX_IMAGE) return 0;
      if (off + fsz > end) end = off + fsz;
    }
  }
  if (end > avail || end > FB_MAX_IMAGE) return 0;
  return (size_t)end;
}

long lz4_block_decode(const uint8_t *src, size_t srclen, uint8_t *dst, size_t dstcap) {
  size_t ip = 0, op = 0;
  while (ip < srclen) {
    uint8_t token = src[ip++];
    size_t lit = token >> 4;
    if (lit == 15) {
      uint8_t b;
      do {
        if (ip >= srclen) return -1;
        b = src[ip++];
        lit += b;
      } while (b == 255);
    }
    if (lit > srclen - ip || lit > dstcap - op) return -1;
    memcpy(dst + op, src + ip, lit);
    ip += lit;
    op += lit;
    if (ip == srclen) break;  // the last sequence has literals only
    if (srclen - ip < 2) return -1;
    size_t off = (size_t)src[ip] | (size_t)src[ip + 1] << 8;
    ip += 2;
    if (off == 0 || off > op) return -1;
    size_t mlen = (token & 15u) + 4;
    if ((token & 15u) == 15) {
      uint8_t b;
      do {
        if (ip >= srclen) return -1;
        b = src[ip++];
        mlen += b;
      } while (b == 255);
    }
    if (mlen > dstcap - op) return -1;
    for (size_t k = 0; k < mlen; k++, op++) dst[op] = dst[op - off];  // overlapping copy
  }
  return (long)op;
}

// libzstd is optional and loaded at first use, never from a constructor. Its symbols are looked up
// with glibc's dlsym (base.c): a plain dlsym call would bind to the shim's own exported dlsym.
static struct {
  pthread_once_t once;
  size_t (*decompress)(void *, size_t, const void *, size_t);
  unsigned (*is_error)(size_t);
} zstd = {PTHREAD_ONCE_INIT, NULL, NULL};

static void zstd_load(void) {
  void *h = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return;
  zstd.decompress = (size_t(*)(void *, size_t, const void *, size_t))real_dlsym(h, "ZSTD_decompress");
  zstd.is_error = (unsigned (*)(size_t))real_dlsym(h, "ZSTD_isError");
  if (!zstd.decompress || !zstd.is_error) zstd.decompress = NULL;
}

int zstd_available(void) {
  pthread_once(&zstd.once, zstd_load);
  return zstd.decompress != NULL;
}

long zstd_decode(const uint8_t *src, size_t srclen, uint8_t *dst, size_t dstcap) {
  if (!zstd_available()) return -2;
  size_t r = zstd.decompress(dst, dstcap, src, srclen);
  if (zstd.is_error(r)) return -1;
  return (long)r;
}

int fb_decode(const fb_entry *e, uint8_t **out, size_t *outlen) {
  *out = NULL;
  *outlen = 0;
  size_t n = e->data_size;
  if (e->compression != FB_COMP_NONE) n = (size_t)e->uncompressed_size;
  uint8_t *buf = malloc(n + 1);
  if (!buf) return FB_ENOMEM;
  long got;
  switch (e->compression) {
  case FB_COMP_NONE:
    memcpy(buf, e->data, n);
    got = (long)n;
    break;
  case FB_COMP_LZ4:
    got = lz4_block_decode(e->data, e->data_size, buf, n);
    break;
  case FB_COMP_ZSTD:
    got = zstd_decode(e->data, e->data_size, buf, n);
    if (got == -2) {
      free(buf);
      return FB_ENOZSTD;
    }
    break;
  default:
    free(buf);
    return FB_EUNSUPP;
  }
  if (got < 0) {
    free(buf);
    return FB_EDECODE;
  }
  size_t len = (size_t)got;
  if (e->kind == FB_KIND_PTX) {
    len = strnlen((const char *)buf, len);
  } else if (fb_is_elf_kind(e->kind)) {
    size_t es = fb_elf_size(buf, len);
    if (es) len = es;
  }
  buf[len] = 0;
  *out = buf;
  *outlen = len;
  return FB_OK;
}
