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

#include "../src/fatbin.h"
#include "../src/sha256.h"
#include "../src/shim.h"

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

// The shim's logger and config are referenced by the parser objects linked in.
shim_config cfg;
void shim_log(const char *fmt, ...) { (void)fmt; }

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
  if (argc < 2) run_fixtures("testdata/fatbin");
  for (int i = 1; i < argc; i++) run_fixtures(argv[i]);
  printf("%s: %d passed, %d skipped, %d failed (%d failed checks)\n", prog, n_passed, n_skipped, n_failed, failures);
  return failures ? 1 : 0;
}
