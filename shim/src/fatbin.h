// Fatbin, ELF and PTX image parsing. Pure functions over caller-supplied bytes: every read is bounds
// checked against the length given, so the parser is safe on garbage (it is fuzzed by the tests).
#ifndef PTXMIG_FATBIN_H
#define PTXMIG_FATBIN_H
#include <stddef.h>
#include <stdint.h>

#define FATBIN_WRAPPER_MAGIC 0x466243b1u
#define FATBIN_CONTAINER_MAGIC 0xba55ed50u

enum {
  FB_OK = 0,
  FB_ETRUNC = -1,   // a header or payload runs past the end of the buffer
  FB_EMAGIC = -2,   // not a fatbin container
  FB_EHEADER = -3,  // impossible header field (size, version)
  FB_ENOZSTD = -4,  // Zstd entry but no libzstd.so.1 on this system
  FB_EDECODE = -5,  // compressed payload does not decode to the announced size
  FB_ENOMEM = -6,
  FB_EUNSUPP = -7,  // unknown compression flags
};

enum { FB_KIND_PTX = 1, FB_KIND_ELF = 2 };
enum { FB_COMP_NONE = 0, FB_COMP_LZ4 = 1, FB_COMP_ZSTD = 2 };

#define FB_FLAG_LZ4 0x2000u
#define FB_FLAG_ZSTD 0x8000u

typedef struct {
  uint16_t kind;              // raw kind field: 1 PTX, 2 ELF, 0x10 ELF (alt)
  uint32_t header_size;       // 64, 80 or 112 in practice
  uint32_t arch;              // e.g. 90
  uint16_t major, minor;      // PTX ISA version for PTX entries
  uint64_t flags;
  int compression;            // FB_COMP_*
  size_t container;           // index of the container (0-based) within the walked buffer
  size_t offset;              // offset of the entry header within the walked buffer
  const uint8_t *data;        // payload
  size_t data_size;           // exact bytes of payload to decode (compressed size when compressed)
  uint64_t uncompressed_size; // from the header (0 when absent)
  const char *name;           // object name inside the entry, not NUL-terminated (may be NULL)
  size_t name_len;
} fb_entry;

// fb_is_elf_kind reports whether an entry kind carries an ELF (cubin).
int fb_is_elf_kind(uint16_t kind);

// fb_walk calls visit for every entry of every fatbin container found back to back in
// [buf, buf+len); it stops early when visit returns non-zero. It returns the number of entries
// visited or a negative FB_E* code; *containers (may be NULL) gets the number of containers.
typedef int (*fb_visit_fn)(const fb_entry *e, void *arg);
int fb_walk(const uint8_t *buf, size_t len, fb_visit_fn visit, void *arg, size_t *containers);

// fb_decode decompresses an entry's payload into a fresh malloc'd buffer. PTX is returned as text
// without trailing NUL bytes or padding (a NUL is still stored after it); ELF is trimmed to the
// size its headers describe. Returns FB_OK or a negative FB_E* code.
int fb_decode(const fb_entry *e, uint8_t **out, size_t *outlen);

// fb_container_size returns the total size of the container at p (header + entries), or 0 when p
// does not start with a plausible container header; avail bounds the read (SIZE_MAX: unknown).
size_t fb_container_size(const uint8_t *p, size_t avail);

// fb_elf_size returns the extent of the 64-bit little-endian ELF at p as its headers describe it,
// or 0 when it is not one; avail bounds the read (SIZE_MAX: unknown, trust the headers).
size_t fb_elf_size(const uint8_t *p, size_t avail);

// fb_elf_has_text reports whether the 64-bit little-endian ELF at p (a cubin) has the section
// ".text.<name>" (a kernel's code): section names are read through the section headers and
// compared whole, since string tables may share tails. Anything malformed is "no" (0).
int fb_elf_has_text(const uint8_t *p, size_t avail, const char *name, size_t nlen);
// fb_elf_each_text calls fn with the name after ".text." of each such section of the ELF at p
// (its kernels and device functions), until fn returns non-zero; that value, 0 when all were
// seen, or -1 when the section headers cannot be read.
int fb_elf_each_text(const uint8_t *p, size_t avail, int (*fn)(void *arg, const char *name, size_t nlen), void *arg);

// lz4_block_decode decodes one LZ4 block (no frame) into dst; returns the bytes produced or -1.
long lz4_block_decode(const uint8_t *src, size_t srclen, uint8_t *dst, size_t dstcap);

// zstd_available reports whether libzstd.so.1 could be loaded (it is loaded on first use).
int zstd_available(void);
long zstd_decode(const uint8_t *src, size_t srclen, uint8_t *dst, size_t dstcap);

const char *fb_strerror(int code);

#endif
