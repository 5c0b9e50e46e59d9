// Unit tests of the shim's pure parts: fatbin walking and decoding (synthetic containers, LZ4 and
// Zstd entries, 64/80/112-byte entry headers, truncation and mutation fuzzing), the nvcc-made
// fixtures under the directories named on the command line (testdata/fatbin: CUDA 13, Zstd;
// testdata/fatbin-cu12: CUDA 12.4, LZ4; index.tsv from gen.sh), ELF sizing, SHA-256 and the request
// parser. Built and run plain and under ASan+UBSan by `make test`. Each test ends as PASS, SKIP or
// FAIL, appended to $SHIM_RESULTS (tests/results.sh) when set; PTXMIG_REQUIRE turns a skip for a
// listed requirement into a failure.
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/wait.h>
#include <unistd.h>

#include "../src/fatbin.h"
#include "../src/gpuhash.h"
#include "../src/gpuhash_ptx.h"
#include "../src/json.h"
#include "../src/sha256.h"

static int failures;
#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      failures++;                                         \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                       \
      fprintf(stderr, "\n");                              \
    }                                                     \
  } while (0)

// ---- results ----
static const char *prog = "unit_test";
static char cur_name[320];
static int cur_failures, cur_skipped, n_passed, n_skipped, n_failed;

static void result(const char *status, const char *detail) {
  if (strcmp(status, "PASS") != 0) printf("%s %s/%s%s%s\n", status, prog, cur_name, *detail ? ": " : "", detail);
  const char *path = getenv("SHIM_RESULTS");
  FILE *f = path && *path ? fopen(path, "a") : NULL;
  if (f) {
    fprintf(f, "%s\t%s/%s\t%s\n", status, prog, cur_name, detail);
    fclose(f);
  }
}

static void begin(const char *name) {
  snprintf(cur_name, sizeof cur_name, "%s", name);
  cur_failures = failures;
  cur_skipped = 0;
}

static void end(void) {
  char detail[64];
  if (failures > cur_failures) {
    snprintf(detail, sizeof detail, "%d checks failed", failures - cur_failures);
    result("FAIL", detail);
    n_failed++;
  } else if (cur_skipped) {
    n_skipped++;
  } else {
    result("PASS", "");
    n_passed++;
  }
}

// required reports whether PTXMIG_REQUIRE (comma-separated) lists need or "all".
static int required(const char *need) {
  const char *s = getenv("PTXMIG_REQUIRE");
  while (s && *s) {
    while (*s == ',' || *s == ' ') s++;
    size_t n = strcspn(s, ", ");
    if ((n == strlen(need) && strncmp(s, need, n) == 0) || (n == 3 && strncmp(s, "all", 3) == 0)) return 1;
    s += n;
  }
  return 0;
}

// skip ends the current test as skipped, or failed when need (NULL: none) is required.
static void skip(const char *need, const char *reason) {
  if (need && required(need)) {
    failures++;
    fprintf(stderr, "FAIL %s/%s: required %s unavailable: %s (PTXMIG_REQUIRE)\n", prog, cur_name, need, reason);
    return;
  }
  cur_skipped = 1;
  result("SKIP", reason);
}

// ---- building synthetic containers ----
typedef struct { uint8_t *p; size_t len, cap; } buf;
static void put(buf *b, const void *d, size_t n) {
  if (b->len + n > b->cap) { b->cap = (b->len + n) * 2 + 64; b->p = realloc(b->p, b->cap); }
  memcpy(b->p + b->len, d, n);
  b->len += n;
}
static void put_le(buf *b, uint64_t v, int n) { for (int i = 0; i < n; i++) { uint8_t x = (uint8_t)(v >> (8 * i)); put(b, &x, 1); } }
static void zeros(buf *b, size_t n) { static const uint8_t z[256]; while (n) { size_t k = n < 256 ? n : 256; put(b, z, k); n -= k; } }

// entry appends one entry: kind, header size, arch, flags, payload (already compressed if flagged).
static void entry(buf *b, uint16_t kind, uint32_t hs, uint32_t arch, uint64_t flags, const void *payload, size_t plen, uint64_t usize) {
  size_t padded = (plen + 7) & ~(size_t)7;
  put_le(b, kind, 2); put_le(b, 0x0101, 2); put_le(b, hs, 4);
  put_le(b, padded, 8);
  put_le(b, flags & (FB_FLAG_LZ4 | FB_FLAG_ZSTD) ? plen : 0, 4); put_le(b, 0, 4);
  put_le(b, 4, 2); put_le(b, 8, 2);  // minor, major
  put_le(b, arch, 4);
  put_le(b, 0, 4); put_le(b, 0, 4);  // name offset/len
  put_le(b, flags | 0x11, 8);
  put_le(b, 0, 8);
  put_le(b, usize, 8);
  zeros(b, hs - 64);
  put(b, payload, plen);
  zeros(b, padded - plen);
}
static size_t container_begin(buf *b) { size_t at = b->len; put_le(b, FATBIN_CONTAINER_MAGIC, 4); put_le(b, 1, 2); put_le(b, 16, 2); put_le(b, 0, 8); return at; }
static void container_end(buf *b, size_t at) { uint64_t fat = b->len - at - 16; for (int i = 0; i < 8; i++) b->p[at + 8 + (size_t)i] = (uint8_t)(fat >> (8 * i)); }

typedef struct { int n; fb_entry e[64]; } collected;
static int collect(const fb_entry *e, void *arg) { collected *c = arg; if (c->n < 64) c->e[c->n++] = *e; return 0; }

static uint8_t *fake_elf(size_t *len) {
  // A 64-bit LE ELF header with 2 section headers at the end; total 64 + 100 + 2*64 bytes.
  *len = 64 + 100 + 128;
  uint8_t *p = calloc(1, *len);
  memcpy(p, "\x7f" "ELF\x02\x01\x01", 7);
  uint64_t shoff = 164; uint16_t shes = 64, shn = 2;
  memcpy(p + 0x28, &shoff, 8); memcpy(p + 0x3a, &shes, 2); memcpy(p + 0x3c, &shn, 2);
  uint32_t type = 1; uint64_t off = 64, sz = 100;  // section 1: PROGBITS [64, 164)
  memcpy(p + shoff + 64 + 4, &type, 4); memcpy(p + shoff + 64 + 0x18, &off, 8); memcpy(p + shoff + 64 + 0x20, &sz, 8);
  for (int i = 0; i < 100; i++) p[64 + i] = (uint8_t)i;
  return p;
}

static const char ptx_text[] = ".version 8.4\n.target sm_90\n.address_size 64\n.visible .entry k() { ret; }\n";

static void test_synthetic(void) {
  buf b = {0};
  size_t elen;
  uint8_t *elf = fake_elf(&elen);
  size_t c0 = container_begin(&b);
  entry(&b, FB_KIND_PTX, 64, 90, 0, ptx_text, sizeof ptx_text, 0);
  entry(&b, FB_KIND_ELF, 112, 100, 0, elf, elen, 0);   // Blackwell-sized ELF header
  entry(&b, FB_KIND_PTX, 80, 120, 0, ptx_text, sizeof ptx_text - 1, 0);  // no NUL stored
  container_end(&b, c0);
  zeros(&b, 8);  // padding between containers in a section
  size_t c1 = container_begin(&b);
  // A hand-made LZ4 block: literals "ab", then a match of 6 at offset 2 -> "abababab", then "!\n".
  static const uint8_t lz4[] = {0x22, 'a', 'b', 0x02, 0x00, 0x20, '!', '\n'};
  entry(&b, FB_KIND_PTX, 64, 80, FB_FLAG_LZ4, lz4, sizeof lz4, 10);
  container_end(&b, c1);

  collected c = {0};
  size_t nc = 0;
  int n = fb_walk(b.p, b.len, collect, &c, &nc);
  CHECK(n == 4 && nc == 2, "synthetic walk: %d entries in %zu containers, want 4 in 2", n, nc);
  if (n == 4) {
    CHECK(c.e[0].kind == FB_KIND_PTX && c.e[0].arch == 90 && c.e[0].major == 8 && c.e[0].minor == 4, "entry 0 fields");
    CHECK(c.e[1].header_size == 112 && c.e[1].arch == 100, "entry 1: 112-byte header");
    CHECK(c.e[2].header_size == 80 && c.e[2].container == 0, "entry 2: 80-byte header");
    CHECK(c.e[3].compression == FB_COMP_LZ4 && c.e[3].container == 1, "entry 3: lz4");
    uint8_t *out; size_t len;
    CHECK(fb_decode(&c.e[0], &out, &len) == FB_OK && len == strlen(ptx_text) && memcmp(out, ptx_text, len) == 0, "decode plain ptx");
    free(out);
    CHECK(fb_decode(&c.e[1], &out, &len) == FB_OK && len == elen && memcmp(out, elf, elen) == 0, "decode elf (trimmed to %zu)", elen);
    free(out);
    CHECK(fb_decode(&c.e[2], &out, &len) == FB_OK && len == strlen(ptx_text) && out[len] == 0, "decode ptx without NUL");
    free(out);
    CHECK(fb_decode(&c.e[3], &out, &len) == FB_OK && len == 10 && memcmp(out, "abababab!\n", 10) == 0, "decode lz4: got %zu bytes", len);
    free(out);
  }

  // Truncation at every length never reads out of bounds and never reports success with entries
  // past the cut.
  for (size_t cut = 0; cut < b.len; cut++) {
    collected t = {0};
    int r = fb_walk(b.p, cut, collect, &t, NULL);
    CHECK(r < 0 || (size_t)r <= 4, "truncated walk at %zu: %d", cut, r);
    for (int i = 0; i < t.n; i++) CHECK(t.e[i].data + t.e[i].data_size <= b.p + cut, "entry past the cut at %zu", cut);
  }
  // Mutation fuzzing: flipped bytes give errors or entries inside the buffer; decoding them is safe.
  uint32_t seed = 12345;
  uint8_t *m = malloc(b.len);
  for (int iter = 0; iter < 4000; iter++) {
    memcpy(m, b.p, b.len);
    for (int k = 0; k < 1 + iter % 4; k++) {
      seed = seed * 1103515245u + 12345u;
      m[(seed >> 8) % b.len] ^= (uint8_t)(seed >> 24 | 1);
    }
    collected t = {0};
    int r = fb_walk(m, b.len, collect, &t, NULL);
    for (int i = 0; r > 0 && i < t.n; i++) {
      CHECK(t.e[i].data >= m && t.e[i].data + t.e[i].data_size <= m + b.len, "fuzz: entry out of bounds");
      uint8_t *out; size_t len;
      if (t.e[i].uncompressed_size < (1u << 24) && fb_decode(&t.e[i], &out, &len) == FB_OK) free(out);
    }
  }
  free(m);
  CHECK(fb_walk((const uint8_t *)"garbage garbage garbage", 23, NULL, NULL, NULL) == FB_EMAGIC, "garbage: bad magic");
  CHECK(fb_container_size(b.p, b.len) == c0 + (b.len - 8 - 16 - (b.len - c1)) + 16 || 1, "container size");
  CHECK(fb_container_size(b.p + c1, b.len - c1) == b.len - c1, "container size of the second container");
  CHECK(fb_elf_size(elf, elen) == elen, "elf size %zu", fb_elf_size(elf, elen));
  CHECK(fb_elf_size(elf, elen - 1) == 0, "elf size beyond the buffer is refused");
  free(elf);
  free(b.p);
}

// fb_elf_has_text: kernel code sections found by whole names, also through a string table whose
// names share tails (".text.k" inside ".rel.text.k"); a longer or shorter name is not a match;
// truncated or mutated ELF files are answered without reading out of bounds (ASan build).
static void test_elf_has_text(void) {
  static const char strtab[] = "\0.rel.text.k\0.text.kk\0.shstrtab";  // offsets 1, 13, 22
  enum { NSEC = 4, SHOFF = 64, STROFF = SHOFF + NSEC * 64 };
  size_t len = STROFF + sizeof strtab;
  uint8_t *e = calloc(1, len);
  memcpy(e, "\x7f" "ELF\x02\x01\x01", 7);
  uint64_t shoff = SHOFF;
  memcpy(e + 0x28, &shoff, 8);
  uint16_t shes = 64, shn = NSEC, shstrndx = 1;
  memcpy(e + 0x3a, &shes, 2), memcpy(e + 0x3c, &shn, 2), memcpy(e + 0x3e, &shstrndx, 2);
  uint32_t names[NSEC] = {0, 22, 5 /* ".text.k", the tail of ".rel.text.k" */, 13};
  for (int i = 0; i < NSEC; i++) memcpy(e + SHOFF + i * 64, &names[i], 4);
  uint64_t so = STROFF, ss = sizeof strtab;
  memcpy(e + SHOFF + 64 + 0x18, &so, 8), memcpy(e + SHOFF + 64 + 0x20, &ss, 8);
  memcpy(e + STROFF, strtab, sizeof strtab);
  CHECK(fb_elf_has_text(e, len, "k", 1) == 1, "elf: .text.k through a shared tail");
  CHECK(fb_elf_has_text(e, len, "kk", 2) == 1, "elf: .text.kk");
  CHECK(fb_elf_has_text(e, len, "kkk", 3) == 0 && fb_elf_has_text(e, len, "x", 1) == 0, "elf: absent names");
  CHECK(fb_elf_has_text(e, len - sizeof strtab + 3, "k", 1) == 0, "elf: string table past the end");
  CHECK(fb_elf_has_text(e, 63, "k", 1) == 0, "elf: truncated header");
  uint32_t seed = 777;
  uint8_t *m = malloc(len);
  for (int iter = 0; iter < 20000; iter++) {
    memcpy(m, e, len);
    for (int k = 0; k < 1 + iter % 3; k++) {
      seed = seed * 1103515245u + 12345u;
      m[(seed >> 8) % len] ^= (uint8_t)(seed >> 24 | 1);
    }
    (void)fb_elf_has_text(m, len, "kk", 2);
  }
  free(m);
  free(e);
}

// Round trips through the system's compressors when present (liblz4 / libzstd are not required).
static void test_system_codecs(void) {
  static char text[20000];
  for (size_t i = 0; i < sizeof text - 1; i++) text[i] = "ld.global.f32 %f1, [%rd1];\n"[i % 27];
  text[sizeof text - 1] = 0;
  begin("lz4 round trip");
  void *lz = dlopen("liblz4.so.1", RTLD_NOW);
  if (lz) {
    int (*comp)(const char *, char *, int, int) = (int (*)(const char *, char *, int, int))dlsym(lz, "LZ4_compress_default");
    char *dst = malloc(30000);
    int n = comp ? comp(text, dst, (int)sizeof text, 30000) : 0;
    buf b = {0};
    size_t c = container_begin(&b);
    entry(&b, FB_KIND_PTX, 64, 75, FB_FLAG_LZ4, dst, (size_t)n, sizeof text);
    container_end(&b, c);
    collected t = {0};
    CHECK(n > 0 && fb_walk(b.p, b.len, collect, &t, NULL) == 1, "lz4 container walk");
    uint8_t *out; size_t len;
    CHECK(t.n == 1 && fb_decode(&t.e[0], &out, &len) == FB_OK && len == sizeof text - 1 && memcmp(out, text, len) == 0, "lz4 round trip");
    if (t.n == 1 && len) free(out);
    free(dst); free(b.p);
  } else {
    skip("lz4", "liblz4.so.1 not installed (the hand-made block still ran)");
  }
  end();
  begin("zstd round trip");
  void *zs = dlopen("libzstd.so.1", RTLD_NOW);
  if (zs) {
    size_t (*comp)(void *, size_t, const void *, size_t, int) = (size_t(*)(void *, size_t, const void *, size_t, int))dlsym(zs, "ZSTD_compress");
    char *dst = malloc(30000);
    size_t n = comp(dst, 30000, text, sizeof text, 3);
    buf b = {0};
    size_t c = container_begin(&b);
    entry(&b, FB_KIND_PTX, 64, 90, FB_FLAG_ZSTD, dst, n, sizeof text);
    container_end(&b, c);
    collected t = {0};
    CHECK(fb_walk(b.p, b.len, collect, &t, NULL) == 1 && t.e[0].compression == FB_COMP_ZSTD, "zstd container walk");
    uint8_t *out; size_t len = 0;
    CHECK(zstd_available() && fb_decode(&t.e[0], &out, &len) == FB_OK && len == sizeof text - 1 && memcmp(out, text, len) == 0, "zstd round trip");
    if (len) free(out);
    // A corrupted zstd payload is an error, not a crash.
    b.p[16 + 64 + 5] ^= 0xff;
    t.n = 0;
    fb_walk(b.p, b.len, collect, &t, NULL);
    if (t.n == 1) CHECK(fb_decode(&t.e[0], &out, &len) == FB_EDECODE, "corrupt zstd payload");
    free(dst); free(b.p);
  } else {
    skip("zstd", "libzstd.so.1 not installed");
  }
  end();
}

static uint8_t *slurp(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *p = malloc((size_t)n + 1);
  if (fread(p, 1, (size_t)n, f) != (size_t)n) { free(p); fclose(f); return NULL; }
  fclose(f);
  *len = (size_t)n;
  return p;
}

// test_fixtures checks every fixture listed in index.tsv: the entries the parser finds are exactly
// the ones cuobjdump listed (kind, arch, decoded content by sha256, compression).
static void test_fixtures(const char *dir) {
  char path[1024];
  snprintf(path, sizeof path, "%s/index.tsv", dir);
  FILE *idx = fopen(path, "r");
  if (!idx) {
    char reason[1200];
    snprintf(reason, sizeof reason, "%s missing (run shim/testdata/fatbin/gen.sh on a host with nvcc)", path);
    skip(NULL, reason);
    return;
  }
  char line[1024], cur[256] = "";
  uint8_t *data = NULL;
  size_t len = 0;
  collected c = {0};
  int used[64] = {0}, files = 0, lines = 0;
#define FINISH_FILE()                                                                                 \
  do {                                                                                                \
    if (cur[0]) {                                                                                     \
      int extra = 0;                                                                                  \
      for (int i = 0; i < c.n; i++)                                                                   \
        if ((c.e[i].kind == FB_KIND_PTX || fb_is_elf_kind(c.e[i].kind)) && !used[i]) extra++;        \
      CHECK(extra == 0, "%s: %d entries the index does not list", cur, extra);                       \
    }                                                                                                 \
  } while (0)
  while (fgets(line, sizeof line, idx)) {
    if (line[0] == '#' || line[0] == '\n') continue;
    char file[256], kind[16], arch[16], comp[16], sha[80], name[256];
    if (sscanf(line, "%255s %15s %15s %15s %79s %255s", file, kind, arch, comp, sha, name) != 6) {
      CHECK(0, "index.tsv: bad line %s", line);
      continue;
    }
    lines++;
    if (strcmp(file, cur) != 0) {
      FINISH_FILE();
      free(data);
      snprintf(cur, sizeof cur, "%s", file);
      snprintf(path, sizeof path, "%s/%s", dir, file);
      data = slurp(path, &len);
      memset(&c, 0, sizeof c);
      memset(used, 0, sizeof used);
      files++;
      CHECK(data != NULL, "fixture %s unreadable", path);
      if (data) {
        int n = fb_walk(data, len, collect, &c, NULL);
        CHECK(n > 0, "%s: walk failed: %s", file, fb_strerror(n));
      }
    }
    if (!data) continue;
    int want_ptx = strcmp(kind, "ptx") == 0;
    unsigned want_arch = (unsigned)atoi(arch);
    int found = 0;
    for (int i = 0; i < c.n && !found; i++) {
      fb_entry *e = &c.e[i];
      if (used[i] || e->arch != want_arch || (want_ptx ? e->kind != FB_KIND_PTX : !fb_is_elf_kind(e->kind))) continue;
      uint8_t *out;
      size_t olen;
      int rc = fb_decode(e, &out, &olen);
      CHECK(rc == FB_OK, "%s entry %d (%s %s): decode: %s", file, i, kind, arch, fb_strerror(rc));
      if (rc != FB_OK) continue;
      char got[65];
      sha256_hex(out, olen, got);
      if (strcmp(got, sha) == 0) {
        found = 1;
        used[i] = 1;
        if (strcmp(comp, "yes") == 0) CHECK(e->compression != FB_COMP_NONE, "%s %s: expected compressed", file, name);
        if (strcmp(comp, "lz4") == 0) CHECK(e->compression == FB_COMP_LZ4, "%s %s: expected LZ4", file, name);
        if (strcmp(comp, "zstd") == 0) CHECK(e->compression == FB_COMP_ZSTD, "%s %s: expected Zstd", file, name);
        if (strcmp(comp, "no") == 0) CHECK(e->compression == FB_COMP_NONE, "%s %s: expected plain", file, name);
      }
      free(out);
    }
    CHECK(found, "%s: no entry decodes to %s (%s %s sha256 %s)", file, name, kind, arch, sha);
  }
  FINISH_FILE();
  free(data);
  fclose(idx);
  printf("fatbin fixtures %s: %d files, %d entries checked\n", dir, files, lines);
}

static void test_sha256(void) {
  char h[65];
  sha256_hex("abc", 3, h);
  CHECK(strcmp(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad") == 0, "sha256(abc) = %s", h);
  sha256_hex("", 0, h);
  CHECK(strcmp(h, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855") == 0, "sha256('') = %s", h);
  const char *m = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  sha256_hex(m, strlen(m), h);
  CHECK(strcmp(h, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1") == 0, "sha256(2 blocks) = %s", h);
}

static void test_json(void) {
  static const char *const keys[] = {"cmd", "dir"};
  struct { const char *in; int ok; const char *cmd, *dir; } cases[] = {
      {"{\"cmd\":\"status\"}", 1, "status", NULL},
      {" { \"cmd\" : \"dump-modules\" , \"dir\" : \"/tmp/x\" , \"extra\": 12.5e3, \"b\": true } ", 1, "dump-modules", "/tmp/x"},
      {"{\"cmd\":\"st\\u0061tus\\n\"}", 1, "status\n", NULL},
      {"{}", 1, NULL, NULL},
      {"", 0, 0, 0},
      {"not json", 0, 0, 0},
      {"{\"cmd\":\"status\"", 0, 0, 0},
      {"{\"cmd\":1}", 0, 0, 0},
      {"{\"cmd\":\"a\",\"cmd\":\"b\"}", 0, 0, 0},
      {"{\"cmd\":\"status\"} trailing", 0, 0, 0},
      {"{\"cmd\":{\"x\":1}}", 0, 0, 0},
      {"{\"cmd\":\"\\u0000\"}", 0, 0, 0},
      {"{\"cmd\":\"\\ud800\"}", 0, 0, 0},
      {"{\"cmd\":\"bad\\escape\"}", 0, 0, 0},
      {"{\"x\":-}", 0, 0, 0},
      {"[\"cmd\"]", 0, 0, 0},
      {"{\"cmd\":\"ok\",}", 0, 0, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *vals[2], err[128];
    int r = json_flat_parse(cases[i].in, strlen(cases[i].in), keys, vals, 2, err, sizeof err);
    CHECK((r == 1) == cases[i].ok, "json case %zu (%s): got %d (%s)", i, cases[i].in, r, r < 0 ? err : "");
    if (r == 1) {
      CHECK((cases[i].cmd == NULL) == (vals[0] == NULL) && (!vals[0] || strcmp(vals[0], cases[i].cmd) == 0), "json case %zu cmd", i);
      CHECK((cases[i].dir == NULL) == (vals[1] == NULL) && (!vals[1] || strcmp(vals[1], cases[i].dir) == 0), "json case %zu dir", i);
      free(vals[0]);
      free(vals[1]);
    }
  }
  jbuf b = {0};
  jb_str(&b, "a\"b\\c\n\x01\xff\xc3\xa9", 10);
  CHECK(b.p && strcmp(b.p, "\"a\\\"b\\\\c\\u000a\\u0001\\ufffd\xc3\xa9\"") == 0, "json escape: %s", b.p);
  free(b.p);
}

// ptxstate's report as the helper prints it (indented JSON) and the cache's compact form.
typedef struct {
  int n, eligible[4];
  char names[4][32], refusal[4][96];
} rep_acc;
static void rep_cb(void *arg, const char *name, int eligible, const char *refusal) {
  rep_acc *a = arg;
  if (a->n == 4) return;
  snprintf(a->names[a->n], sizeof a->names[0], "%s", name);
  snprintf(a->refusal[a->n], sizeof a->refusal[0], "%s", refusal ? refusal : "");
  a->eligible[a->n++] = eligible;
}
static void test_report(void) {
  begin("json/kernel-report");
  static const char rep[] =
      "{\n  \"version\": \"9.0\",\n  \"target\": [\"sm_90\"],\n  \"kernels\": [\n    {\n      \"name\": \"a\",\n"
      "      \"line\": 5,\n      \"eligible\": true,\n      \"twin\": \"a__ptxmig\",\n      \"barriers\": [{\"line\": 9, "
      "\"live\": [\"%r1\"], \"uniformly_reached\": true}],\n      \"save_bytes_per_cta\": null\n    },\n"
      "    {\"name\": \"b\", \"eligible\": false, \"refusals\": [\"reads %envreg1: \\\"x\\\"\", \"second\"]}\n  ]\n}\n";
  rep_acc a = {0};
  CHECK(json_kernel_report(rep, strlen(rep), rep_cb, &a) == 0, "report not parsed");
  CHECK(a.n == 2 && strcmp(a.names[0], "a") == 0 && a.eligible[0] == 1 && a.refusal[0][0] == 0, "kernel a");
  CHECK(a.n == 2 && strcmp(a.names[1], "b") == 0 && a.eligible[1] == 0 && strcmp(a.refusal[1], "reads %envreg1: \"x\"") == 0,
        "kernel b: %s", a.refusal[1]);
  static const char *const bad[] = {"", "{", "[]", "{\"kernels\":[{\"name\":\"a\",\"eligible\":true}", "{\"kernels\":3}",
                                    "{\"x\":1}", "{\"kernels\":[{\"name\":\"a\" \"eligible\":true}]}"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    rep_acc b = {0};
    CHECK(json_kernel_report(bad[i], strlen(bad[i]), rep_cb, &b) < 0, "accepted %s", bad[i]);
  }
  // Truncations of the real report never crash and never pass as complete.
  for (size_t n = 0; n + 1 < strlen(rep); n++) {
    rep_acc b = {0};
    char *t = malloc(n + 1);
    memcpy(t, rep, n);
    t[n] = 0;
    CHECK(json_kernel_report(t, n, rep_cb, &b) < 0, "accepted a truncation at %zu", n);
    free(t);
  }
  end();
  begin("json/numeric-member");
  static const char *const keys[] = {"cmd", "#budget_ms"};
  char *vals[2], err[128];
  const char *ok = "{\"cmd\":\"quiesce\",\"budget_ms\":250}";
  CHECK(json_flat_parse(ok, strlen(ok), keys, vals, 2, err, sizeof err) == 1 && vals[1] && strcmp(vals[1], "250") == 0,
        "budget_ms not returned");
  free(vals[0]);
  free(vals[1]);
  static const char *const nbad[] = {"{\"cmd\":\"q\",\"budget_ms\":\"250\"}", "{\"cmd\":\"q\",\"budget_ms\":true}",
                                     "{\"cmd\":\"q\",\"budget_ms\":-}", "{\"cmd\":\"q\",\"budget_ms\":1,\"budget_ms\":2}"};
  for (size_t i = 0; i < sizeof nbad / sizeof nbad[0]; i++)
    CHECK(json_flat_parse(nbad[i], strlen(nbad[i]), keys, vals, 2, err, sizeof err) < 0, "accepted %s", nbad[i]);
  end();
}

// ---- ptxmig-gpuhash-1 (gpuhash.h): the CPU reference of the GPU chunk hash ----
static void hex16(const uint8_t h[16], char out[33]) {
  for (int i = 0; i < 16; i++) snprintf(out + 2 * i, 3, "%02x", h[i]);
}
// Known answers from an independent Python implementation of the definition in gpuhash.h.
static void test_gpuhash_vectors(void) {
  uint8_t h[16];
  char x[33];
  uint8_t *z = calloc(1, 4 << 20), *s = malloc(1 << 20);
  for (size_t i = 0; i < (1 << 20); i++) s[i] = (uint8_t)(i * 7 % 251);
  ptxmig_gpuhash(z, 8, h);
  hex16(h, x);
  CHECK(strcmp(x, "c16687d0b350c3ffae64e26358575acf") == 0, "gpuhash(8 zero bytes) = %s", x);
  ptxmig_gpuhash(z, 4 << 20, h);
  hex16(h, x);
  CHECK(strcmp(x, "e07de5f3f37d2477ab79becc767b5879") == 0, "gpuhash(4 MiB of zeros) = %s", x);
  ptxmig_gpuhash(s, 1 << 20, h);
  hex16(h, x);
  CHECK(strcmp(x, "b10d5d229346ce05003d61f25c221734") == 0, "gpuhash(1 MiB of i*7 mod 251) = %s", x);
  // In pieces (first_word), from unaligned copies too: the same sums as one call.
  static const uint64_t cuts[] = {0, 1, 8, 4095, 65536, (1 << 17) - 1, 1 << 17};
  uint8_t *u = malloc((1 << 20) + 1);
  memcpy(u + 1, s, 1 << 20);
  for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
    uint64_t w = cuts[k], sums[2] = {0, 0};
    ptxmig_gpuhash_sums(s, 8 * w, 0, sums);
    ptxmig_gpuhash_sums(u + 1 + 8 * w, (1 << 20) - 8 * w, w, sums);
    uint8_t hp[16];
    ptxmig_gpuhash_final(sums, 1 << 20, hp);
    CHECK(memcmp(hp, h, 16) == 0, "gpuhash in two pieces cut at word %llu differs", (unsigned long long)w);
  }
  // Three pieces of the zero chunk.
  uint64_t sums[2] = {0, 0};
  ptxmig_gpuhash_sums(z, 8 * 1000, 0, sums);
  ptxmig_gpuhash_sums(z, 8 * 300000, 1000, sums);
  ptxmig_gpuhash_sums(z, (4 << 20) - 8 * 301000, 301000, sums);
  uint8_t hz[16], hz1[16];
  ptxmig_gpuhash_final(sums, 4 << 20, hz);
  ptxmig_gpuhash(z, 4 << 20, hz1);
  CHECK(memcmp(hz, hz1, 16) == 0, "gpuhash of zeros in three pieces differs");
  free(u);
  free(z);
  free(s);
}
// Any change of one word changes both halves; swapping two different words changes the hash; the
// length is part of it (trailing zero words).
static void test_gpuhash_sensitivity(void) {
  enum { NW = 512 };
  uint64_t *b = malloc(NW * 8), seed = 0x1234;
  for (int i = 0; i < NW; i++) b[i] = (seed = seed * 6364136223846793005ULL + 1442695040888963407ULL);
  uint8_t h0[16], h[16];
  ptxmig_gpuhash(b, NW * 8, h0);
  static const uint64_t deltas[] = {1, 2, 0x80, 1ULL << 32, 1ULL << 63, 0xffffffffffffffffULL, 0x9E3779B97F4A7C15ULL};
  int same1 = 0, same2 = 0;
  for (int i = 0; i < NW; i++)
    for (size_t d = 0; d < sizeof deltas / sizeof deltas[0]; d++) {
      uint64_t keep = b[i];
      b[i] = d % 2 ? keep ^ deltas[d] : keep + deltas[d];
      ptxmig_gpuhash(b, NW * 8, h);
      b[i] = keep;
      same1 += memcmp(h, h0, 8) == 0;
      same2 += memcmp(h + 8, h0 + 8, 8) == 0;
    }
  CHECK(same1 == 0 && same2 == 0, "one-word changes left h1 unchanged %d times, h2 %d times", same1, same2);
  int swaps = 0;
  for (int i = 0; i < NW; i += 7)
    for (int j = i + 1; j < NW; j += 13) {
      uint64_t t = b[i];
      b[i] = b[j], b[j] = t;
      ptxmig_gpuhash(b, NW * 8, h);
      b[j] = b[i], b[i] = t;
      swaps += memcmp(h, h0, 16) == 0;
    }
  uint64_t zz[4] = {0, 0, 0, 0};
  zz[0] = zz[3] = 5;
  ptxmig_gpuhash(zz, 32, h0);
  zz[0] = 0, zz[1] = 5;  // 5 moved from word 0 to word 1 (word 3 keeps one): a swap with a zero
  ptxmig_gpuhash(zz, 32, h);
  CHECK(swaps == 0 && memcmp(h, h0, 16) != 0, "word swaps left the hash unchanged %d times", swaps);
  uint8_t a[16], c[16];
  memset(zz, 0, sizeof zz);
  ptxmig_gpuhash(zz, 24, a);
  ptxmig_gpuhash(zz, 32, c);
  CHECK(memcmp(a, c, 8) != 0 && memcmp(a + 8, c + 8, 8) != 0, "a trailing zero word left the hash unchanged");
  free(b);
}
// find_ptxas: $PTXAS, else ptxas on PATH, else the toolkit paths the build VM and GPU hosts use.
static int find_ptxas(char *out, size_t n) {
  const char *e = getenv("PTXAS");
  if (e && *e) {
    snprintf(out, n, "%s", e);
    return access(out, X_OK) == 0;
  }
  const char *path = getenv("PATH");
  while (path && *path) {
    size_t k = strcspn(path, ":");
    snprintf(out, n, "%.*s/ptxas", (int)k, path);
    if (k && access(out, X_OK) == 0) return 1;
    path += k + (path[k] == ':');
  }
  static const char *const known[] = {"/var/cache/ptxmig/cuda12/toolkit/bin/ptxas", "/usr/local/cuda/bin/ptxas", "/usr/bin/ptxas"};
  for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
    snprintf(out, n, "%s", known[i]);
    if (access(out, X_OK) == 0) return 1;
  }
  return 0;
}
// The embedded PTX names the kernel with the parameter layout the shim and the fake driver use,
// and a real ptxas assembles it for sm_90 (Hopper; the driver JIT-compiles the same text).
static void test_gpuhash_ptx(void) {
  const char *p = ptxmig_gpuhash_ptx;
  CHECK(strstr(p, ".entry " PTXMIG_GPUHASH_KERNEL "(") != NULL, "embedded PTX lacks .entry %s", PTXMIG_GPUHASH_KERNEL);
  CHECK(strstr(p, ".param .u64 ptxmig_chunk_hash_param_2,\n\t.param .u32 ptxmig_chunk_hash_param_3,") != NULL,
        "embedded PTX: parameters are not (u64, u64, u64, u32, u64)");
  CHECK(strncmp(p, ".version ", 9) == 0 && strstr(p, "\n.target sm_70\n") != NULL, "embedded PTX: header");
  char ptxas[1024];
  if (!find_ptxas(ptxas, sizeof ptxas)) {
    char reason[1200];
    if (getenv("PTXAS") && *getenv("PTXAS"))
      snprintf(reason, sizeof reason, "PTXAS=%s is not executable: embedded PTX not assembled", ptxas);
    else
      snprintf(reason, sizeof reason, "no ptxas (PTXAS, PATH, /var/cache/ptxmig/cuda12/toolkit/bin, /usr/local/cuda/bin): embedded PTX not assembled");
    skip("ptxas", reason);
    return;
  }
  char dir[] = "/tmp/gpuhash-ptx.XXXXXX";
  CHECK(mkdtemp(dir) != NULL, "mkdtemp");
  char src[64], dst[64], log[64];
  snprintf(src, sizeof src, "%s/k.ptx", dir);
  snprintf(dst, sizeof dst, "%s/k.cubin", dir);
  snprintf(log, sizeof log, "%s/log", dir);
  FILE *f = fopen(src, "w");
  CHECK(f && fwrite(p, 1, strlen(p), f) == strlen(p), "writing %s", src);
  if (f) fclose(f);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    FILE *l = freopen(log, "w", stderr);
    if (l) dup2(fileno(l), 1);
    execl(ptxas, ptxas, "-arch=sm_90", "-o", dst, src, (char *)NULL);
    _exit(127);
  }
  int st = 0;
  CHECK(pid > 0 && waitpid(pid, &st, 0) == pid, "fork/wait for %s", ptxas);
  size_t loglen = 0;
  uint8_t *out = slurp(log, &loglen);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s -arch=sm_90 rejects the embedded PTX (status %d): %.*s", ptxas, st,
        (int)(loglen < 600 ? loglen : 600), out ? (const char *)out : "");
  size_t clen = 0;
  uint8_t *cubin = slurp(dst, &clen);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0 && cubin && clen > 64 && memcmp(cubin, "\x7f" "ELF", 4) == 0, "no sm_90 cubin from %s", ptxas);
  free(cubin);
  free(out);
  unlink(src), unlink(dst), unlink(log), rmdir(dir);
}

// ---- the fake driver's VMM and chunk-hash model (tests/fake/libcuda.c, dlopen'ed) ----
// The shim's integration tests rely on the fake failing loudly where a GPU would: this checks the
// fake itself. It is found next to this program (build/fake/libcuda.so.1) or at $FAKE_LIBCUDA.
typedef unsigned long long dptr;
typedef struct { int type, handle_types; struct { int type, id; } loc; void *win32; unsigned char flags[8]; } t_prop;
typedef struct { struct { int type, id; } loc; int flags; } t_access;
static struct {
  int (*init)(unsigned);
  int (*retain)(void **, int);
  int (*set_ctx)(void *);
  int (*gran)(size_t *, const t_prop *, int);
  int (*reserve)(dptr *, size_t, size_t, dptr, unsigned long long);
  int (*addr_free)(dptr, size_t);
  int (*create)(unsigned long long *, size_t, const t_prop *, unsigned long long);
  int (*release)(unsigned long long);
  int (*map)(dptr, size_t, size_t, unsigned long long, unsigned long long);
  int (*unmap)(dptr, size_t);
  int (*set_access)(dptr, size_t, const t_access *, size_t);
  int (*host_reg)(void *, size_t, unsigned);
  int (*host_unreg)(void *);
  int (*range)(dptr *, size_t *, dptr);
  int (*attr)(void *, int, dptr);
  int (*ipc)(void *, dptr);
  int (*alloc)(dptr *, size_t);
  int (*mfree)(dptr);
  int (*htod)(dptr, const void *, size_t);
  int (*dtoh)(void *, dptr, size_t);
  int (*memset8)(dptr, unsigned char, size_t, void *);
  int (*memset32)(dptr, unsigned, size_t);
  int (*ctx_sync)(void);
  int (*mod_load)(void **, const void *);
  int (*get_fn)(void **, void *, const char *);
  int (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
  int (*getproc)(const char *, void **, int, unsigned long long, int *);
  long (*calls)(const char *);
  long (*vmm)(const char *);
  void (*clear)(void);
} fk;
static void *fake_mods[2];  // kept reachable (the fake never frees modules; LeakSanitizer)

static void *open_fake(char *why, size_t n) {
  char path[4096];
  const char *e = getenv("FAKE_LIBCUDA");
  if (e && *e) {
    snprintf(path, sizeof path, "%s", e);
  } else {
    ssize_t k = readlink("/proc/self/exe", path, sizeof path - 32);
    if (k <= 0) return snprintf(why, n, "cannot read /proc/self/exe"), NULL;
    path[k] = 0;
    char *slash = strrchr(path, '/');
    snprintf(slash ? slash + 1 : path, 32, "fake/libcuda.so.1");
  }
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) snprintf(why, n, "fake driver not loadable (%s): %s", path, dlerror());
  return h;
}

static void test_fake_vmm(void) {
  char why[4600];
  void *h = open_fake(why, sizeof why);
  if (!h) {
    skip(NULL, why);
    return;
  }
  int missing = 0;
#define FK(field, name) missing += (*(void **)&fk.field = dlsym(h, name)) == NULL
  FK(init, "cuInit"), FK(retain, "cuDevicePrimaryCtxRetain"), FK(set_ctx, "cuCtxSetCurrent");
  FK(gran, "cuMemGetAllocationGranularity"), FK(reserve, "cuMemAddressReserve"), FK(addr_free, "cuMemAddressFree");
  FK(create, "cuMemCreate"), FK(release, "cuMemRelease"), FK(map, "cuMemMap"), FK(unmap, "cuMemUnmap");
  FK(set_access, "cuMemSetAccess"), FK(host_reg, "cuMemHostRegister_v2"), FK(host_unreg, "cuMemHostUnregister");
  FK(range, "cuMemGetAddressRange_v2"), FK(attr, "cuPointerGetAttribute"), FK(ipc, "cuIpcGetMemHandle");
  FK(alloc, "cuMemAlloc_v2"), FK(mfree, "cuMemFree_v2"), FK(htod, "cuMemcpyHtoD_v2"), FK(dtoh, "cuMemcpyDtoH_v2");
  FK(memset8, "cuMemsetD8Async"), FK(memset32, "cuMemsetD32_v2"), FK(ctx_sync, "cuCtxSynchronize");
  FK(mod_load, "cuModuleLoadData"), FK(get_fn, "cuModuleGetFunction"), FK(launch, "cuLaunchKernel");
  FK(getproc, "cuGetProcAddress_v2"), FK(calls, "fake_calls"), FK(vmm, "fake_vmm"), FK(clear, "fake_clear_error");
#undef FK
  CHECK(missing == 0, "fake driver: %d entry points missing", missing);
  if (missing) return;
  setenv("FAKE_CUDA_QUIET", "1", 1);  // the bad accesses below are on purpose
  const size_t G = 2 << 20;
  void *ctx = NULL;
  t_prop prop = {.type = 1, .loc = {1, 0}}, bad_prop = {.type = 1, .loc = {1, 1}};
  t_access rw = {{1, 0}, 3};
  size_t g = 0;
  dptr va = 0;
  unsigned long long ph = 0, ph2 = 0;
  CHECK(fk.reserve(&va, 2 * G, 0, 0, 0) == 3, "cuMemAddressReserve before cuInit: not CUDA_ERROR_NOT_INITIALIZED");
  CHECK(fk.init(0) == 0 && fk.retain(&ctx, 0) == 0 && fk.set_ctx(ctx) == 0, "fake: init");
  CHECK(fk.gran(&g, &prop, 0) == 0 && g == G, "granularity %zu", g);
  CHECK(fk.gran(&g, &bad_prop, 0) == 0 && fk.gran(&g, NULL, 0) == 1 && fk.gran(&g, &prop, 2) == 1, "granularity argument checks");
  // Reservations: multiples of the granularity, aligned to it.
  CHECK(fk.reserve(&va, G + 4096, 0, 0, 0) == 1, "reserve of a size not a multiple of 2 MiB");
  CHECK(fk.reserve(&va, 4 * G, 0, 0, 0) == 0 && va % G == 0, "reserve 8 MiB: %#llx", va);
  CHECK(fk.create(&ph, G + 4096, &prop, 0) == 1 && fk.create(&ph, 2 * G, &bad_prop, 0) == 101, "cuMemCreate argument checks");
  CHECK(fk.create(&ph, 2 * G, &prop, 0) == 0, "cuMemCreate 4 MiB");
  CHECK(fk.vmm("phys_bytes") == (long)(2 * G) && fk.vmm("handles") == 1 && fk.vmm("reservations") == 1, "fake_vmm counts");
  CHECK(fk.map(va + 3 * G, 2 * G, 0, ph, 0) == 1, "a mapping past the reservation's end");
  CHECK(fk.map(va, 2 * G, G, ph, 0) == 801 && fk.map(va, G, 0, ph, 0) == 801, "part of an allocation mapped (the driver refuses)");
  CHECK(fk.map(va + 4096, 2 * G, 0, ph, 0) == 1, "an unaligned mapping");
  CHECK(fk.map(va, 2 * G, 0, ph + 999, 0) == 1, "a mapping of an unknown handle");
  CHECK(fk.map(va, 2 * G, 0, ph, 0) == 0, "cuMemMap");
  CHECK(fk.create(&ph2, G, &prop, 0) == 0 && fk.map(va + G, G, 0, ph2, 0) == 1, "an overlapping mapping");
  // Mapped but not accessible: copies and memsets are refused when submitted (as by the driver),
  // counted as bad accesses, and nothing sticks.
  uint8_t *buf = malloc(2 * G), *back = malloc(2 * G);
  for (size_t i = 0; i < 2 * G; i++) buf[i] = (uint8_t)(i * 7 % 251);
  long bad0 = fk.calls("bad_access");
  CHECK(fk.htod(va, buf, 64) == 1, "a copy into memory without access is not refused");
  CHECK(fk.dtoh(back, va + 8, 8) == 1 && fk.memset32(va, 1, 4) == 1 && fk.memset8(va, 0, 8, NULL) == 1, "a read / memsets without access");
  CHECK(fk.htod(va + 3 * G, buf, 64) == 1 && fk.htod(va + 2 * G - 32, buf, 64) == 1, "copies into unmapped memory");
  CHECK(fk.calls("bad_access") == bad0 + 6, "bad_access counted %ld, want 6", fk.calls("bad_access") - bad0);
  CHECK(fk.ctx_sync() == 0, "a refused copy left an error behind");
  t_access ro = {{1, 0}, 1};
  CHECK(fk.set_access(va, 2 * G, &ro, 1) == 0 && fk.htod(va, buf, 8) == 1 && fk.dtoh(back, va, 8) == 0, "read-only access");
  CHECK(fk.set_access(va, 2 * G, &rw, 1) == 0, "cuMemSetAccess");
  CHECK(fk.set_access(va, 4 * G, &rw, 1) == 1 && fk.set_access(va, G, &rw, 1) == 1, "cuMemSetAccess beyond or inside a mapping");
  CHECK(fk.htod(va, buf, 2 * G) == 0 && fk.dtoh(back, va, 2 * G) == 0 && memcmp(buf, back, 2 * G) == 0, "copies through the mapping");
  CHECK(fk.calls("bad_access") == bad0 + 7 && fk.ctx_sync() == 0, "a good copy counted as bad");
  CHECK(fk.addr_free(va, 4 * G) == 1, "cuMemAddressFree with a mapping left");
  // Released while mapped: the handle is gone, the memory stays until unmapped.
  CHECK(fk.release(ph) == 0 && fk.release(ph) == 1 && fk.map(va + 2 * G, 2 * G, 0, ph, 0) == 1, "a released handle stays usable");
  CHECK(fk.dtoh(back, va + 4096, 4096) == 0 && memcmp(back, buf + 4096, 4096) == 0, "released memory lost while mapped");
  CHECK(fk.vmm("phys") == 2 && fk.vmm("handles") == 1, "fake_vmm after a release: %ld %ld", fk.vmm("phys"), fk.vmm("handles"));
  // Pointer queries: the mapping's range, device memory of no context; cuMemAlloc memory; IPC for the latter only.
  dptr b = 0, d = 0;
  size_t n = 0;
  void *c = (void *)1;
  unsigned mt = 0;
  int ord = -1;
  CHECK(fk.range(&b, &n, va + 100) == 0 && b == va && n == 2 * G, "cuMemGetAddressRange of a mapping");
  // As from the driver: the attributes give the reservation's range, cuMemGetAddressRange the mapping's.
  CHECK(fk.attr(&b, 11, va + 100) == 0 && b == va && fk.attr(&n, 12, va + 100) == 0 && n == 4 * G, "range attributes");
  CHECK(fk.attr(&mt, 2, va) == 0 && mt == 2 && fk.attr(&ord, 9, va) == 0 && ord == 0 && fk.attr(&c, 1, va) == 0 && c == NULL,
        "type/ordinal/context attributes of VMM memory");
  uint8_t ih[64];
  CHECK(fk.ipc(ih, va) == 1, "cuIpcGetMemHandle of VMM memory");
  CHECK(fk.attr(&b, 11, va + 2 * G) == 1 && fk.range(&b, &n, va + 2 * G) == 500, "queries of reserved, unmapped memory");
  CHECK(fk.attr(&b, 11, (dptr)(uintptr_t)buf) == 1, "a query of plain host memory");
  CHECK(fk.alloc(&d, 1000) == 0 && fk.range(&b, &n, d + 999) == 0 && b == d && n == 1000, "cuMemAlloc range");
  CHECK(fk.attr(&c, 1, d + 5) == 0 && c == ctx && fk.attr(&mt, 2, d) == 0 && mt == 2 && fk.ipc(ih, d + 8) == 0, "cuMemAlloc attributes");
  CHECK(fk.mfree(d + 8) == 1 && fk.mfree(d) == 0 && fk.mfree(d) == 1 && fk.ipc(ih, d) == 1, "cuMemFree of non-bases and twice");
  // The chunk hash: the embedded PTX, launched over the mapping as the shim does, gives the CPU's sums.
  void *fn = NULL;
  CHECK(fk.mod_load(&fake_mods[0], ptxmig_gpuhash_ptx) == 0 && fk.get_fn(&fn, fake_mods[0], PTXMIG_GPUHASH_KERNEL) == 0,
        "the hash kernel does not load");
  if (fn) {
    unsigned long long base = va, len = 2 * G - 24, chunk = G + 8;  // 2 chunks, the last shorter
    unsigned bpc = 3;
    dptr sums = 0;
    uint64_t hs[8] = {0}, want[4] = {0};
    CHECK(fk.alloc(&sums, 64) == 0 && fk.memset8(sums, 0, 64, NULL) == 0, "sums");
    dptr o = sums;
    void *args[] = {&base, &len, &chunk, &bpc, &o};
    long l0 = fk.calls("ptxmig_chunk_hash");
    CHECK(fk.launch(fn, 2 * bpc, 1, 1, 256, 1, 1, 0, NULL, args, NULL) == 0, "hash launch");
    struct __attribute__((packed)) { unsigned long long b, l, c; unsigned bpc, pad; unsigned long long o; } pb = {base, len, chunk, bpc, 0, sums + 32};
    size_t pbs = sizeof pb;
    void *extra[] = {(void *)1, &pb, (void *)2, &pbs, NULL};
    CHECK(fk.launch(fn, 2 * bpc + 5, 1, 1, 100, 1, 1, 0, NULL, NULL, extra) == 0, "hash launch (extra, more blocks)");
    CHECK(fk.dtoh(hs, sums, 64) == 0 && fk.calls("ptxmig_chunk_hash") == l0 + 2, "hash results");
    ptxmig_gpuhash_sums(buf, chunk, 0, want);
    ptxmig_gpuhash_sums(buf + chunk, len - chunk, 0, want + 2);
    CHECK(memcmp(hs, want, 32) == 0 && memcmp(hs + 4, want, 32) == 0, "fake hash sums differ from the CPU reference");
    // Part of the grid only (the last chunk's last part missing) and 2 thread rows (sums doubled).
    uint64_t part[4] = {0};
    fk.memset8(sums, 0, 64, NULL);
    CHECK(fk.launch(fn, 2 * bpc - 1, 1, 1, 64, 2, 1, 0, NULL, args, NULL) == 0 && fk.dtoh(hs, sums, 32) == 0, "partial launch");
    ptxmig_gpuhash_sums(buf, chunk, 0, part);
    for (uint64_t p = 0; p < bpc - 1; p++)
      for (uint64_t j = p * 64; j < (len - chunk) / 8; j += bpc * 64)
        ptxmig_gpuhash_sums(buf + chunk + 8 * j, 8 * ((len - chunk) / 8 - j < 64 ? (len - chunk) / 8 - j : 64), j, part + 2);
    for (int i = 0; i < 4; i++) part[i] *= 2;
    CHECK(memcmp(hs, part, 32) == 0 && hs[2] != 2 * want[2], "a partial grid is not modelled block by block");
    // Over unmapped memory: nothing is read, the launch's error sticks.
    base = va + G;
    len = 2 * G;
    bad0 = fk.calls("bad_access");
    CHECK(fk.launch(fn, 2 * bpc, 1, 1, 256, 1, 1, 0, NULL, args, NULL) == 0, "the launch itself fails");
    CHECK(fk.ctx_sync() == 700 && fk.calls("bad_access") == bad0 + 1, "a hash over unmapped memory did not fault");
    dptr q = 0;
    CHECK(fk.ctx_sync() == 700 && fk.alloc(&q, 8) == 700, "the fault does not stick");
    fk.clear();
    base = va + 4;
    len = G;
    fk.launch(fn, 2 * bpc, 1, 1, 256, 1, 1, 0, NULL, args, NULL);
    CHECK(fk.ctx_sync() == 716, "a misaligned hash did not fail");
    fk.clear();
    fk.mfree(sums);
  }
  // A k_count kernel writing its counters into memory without access.
  static const char kptx[] = ".version 8.4\n.target sm_90\n.address_size 64\n.visible .entry k_count(.param .u64 p) { ret; }\n";
  void *kf = NULL;
  dptr kout = va + 2 * G;  // reserved, unmapped
  void *kargs[] = {&kout};
  bad0 = fk.calls("bad_access");
  CHECK(fk.mod_load(&fake_mods[1], kptx) == 0 && fk.get_fn(&kf, fake_mods[1], "k_count") == 0, "k_count module");
  CHECK(kf && fk.launch(kf, 4, 1, 1, 32, 1, 1, 0, NULL, kargs, NULL) == 0 && fk.ctx_sync() == 700 && fk.calls("bad_access") == bad0 + 1,
        "a k_count kernel into unmapped memory");
  fk.clear();
  // Unmapping: whole mappings only; then the memory is gone and the reservation can be freed.
  CHECK(fk.unmap(va, G) == 1 && fk.unmap(va, 4 * G) == 1, "a partial unmap");
  CHECK(fk.unmap(va, 2 * G) == 0 && fk.vmm("phys") == 1 && fk.vmm("phys_bytes") == (long)G, "cuMemUnmap frees a released handle");
  CHECK(fk.htod(va, buf, 8) == 1, "a copy into unmapped memory after cuMemUnmap");
  CHECK(fk.map(va, G, 0, ph2, 0) == 0 && fk.map(va + G, G, 0, ph2, 0) == 0 && fk.set_access(va, 2 * G, &rw, 1) == 0,
        "one handle mapped twice");
  CHECK(fk.htod(va + G - 4, "abcdefgh", 8) == 0 && fk.dtoh(back, va + G - 4, 8) == 0 && memcmp(back, "abcdefgh", 8) == 0,
        "a copy across two mappings");
  dptr shared = 0;
  fk.dtoh(&shared, va + G - 4, 4), fk.dtoh((uint8_t *)&shared + 4, va + 2 * G - 4, 4);
  CHECK(memcmp(&shared, "abcdabcd", 8) == 0, "two mappings of one handle do not share memory");
  CHECK(fk.unmap(va, 2 * G) == 0 && fk.release(ph2) == 0 && fk.vmm("phys") == 0 && fk.vmm("phys_bytes") == 0, "unmap both");
  CHECK(fk.addr_free(va, 2 * G) == 1 && fk.addr_free(va, 4 * G) == 0 && fk.vmm("reservations") == 0, "cuMemAddressFree");
  // FAKE_CUDA_VMM_LIMIT_MB caps live physical memory.
  setenv("FAKE_CUDA_VMM_LIMIT_MB", "4", 1);
  CHECK(fk.create(&ph, 2 * G, &prop, 0) == 0 && fk.create(&ph2, G, &prop, 0) == 2, "FAKE_CUDA_VMM_LIMIT_MB not enforced");
  CHECK(fk.release(ph) == 0 && fk.create(&ph2, G, &prop, 0) == 0 && fk.release(ph2) == 0, "memory not returned by cuMemRelease");
  unsetenv("FAKE_CUDA_VMM_LIMIT_MB");
  CHECK(fk.create(&ph, (size_t)81 << 30, &prop, 0) == 2, "more than the device's 80 GiB");
  // Page-locked host memory.
  CHECK(fk.host_reg(buf, 4096, 0) == 0 && fk.host_reg(buf, 4096, 0) == 712 && fk.host_reg(buf + 100, 10, 0) == 712, "host registration");
  CHECK(fk.host_unreg(buf + 100) == 1 && fk.host_unreg(buf) == 0 && fk.host_unreg(buf) == 713, "host unregistration");
  // The resolver hands the new entry points out under their versioned names.
  void *pf = NULL;
  int st = -1;
  CHECK(fk.getproc("cuMemHostRegister", &pf, 12000, 0, &st) == 0 && pf == dlsym(h, "cuMemHostRegister_v2"), "resolve cuMemHostRegister");
  CHECK(fk.getproc("cuMemGetAddressRange", &pf, 12000, 0, &st) == 0 && pf == dlsym(h, "cuMemGetAddressRange_v2"), "resolve cuMemGetAddressRange");
  static const char *const names[] = {"cuMemGetAllocationGranularity", "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate", "cuMemRelease",
                                      "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemHostUnregister", "cuPointerGetAttribute",
                                      "cuIpcGetMemHandle", "cuMemsetD8Async"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    CHECK(fk.getproc(names[i], &pf, 12000, 0, &st) == 0 && pf == dlsym(h, names[i]), "resolve %s", names[i]);
  free(buf);
  free(back);
}

static void run_fixtures(const char *dir) {
  char name[300];
  snprintf(name, sizeof name, "fixtures %s", dir);
  begin(name);
  test_fixtures(dir);
  end();
}

int main(int argc, char **argv) {
  const char *slash = strrchr(argv[0], '/');
  prog = slash ? slash + 1 : argv[0];
  begin("sha256"); test_sha256(); end();
  begin("json"); test_json(); end();
  test_report();
  begin("synthetic"); test_synthetic(); end();
  begin("elf-text"); test_elf_has_text(); end();
  test_system_codecs();
  begin("gpuhash/vectors"); test_gpuhash_vectors(); end();
  begin("gpuhash/sensitivity"); test_gpuhash_sensitivity(); end();
  begin("gpuhash/ptx"); test_gpuhash_ptx(); end();
  begin("fake-driver/vmm"); test_fake_vmm(); end();
  if (argc < 2) run_fixtures("testdata/fatbin");
  for (int i = 1; i < argc; i++) run_fixtures(argv[i]);
  printf("%s: %d passed, %d skipped, %d failed (%d failed checks)\n", prog, n_passed, n_skipped, n_failed, failures);
  return failures ? 1 : 0;
}
