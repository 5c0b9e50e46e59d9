// A fake nvJitLink (libnvJitLink.so) for the shim's tests. Like the real library it exports
// versioned names only (__nvJitLinkCreate_13_0, ...). A link takes any inputs; its "cubin" is a
// small ELF holding a hash of all the inputs' bytes (fakeelf.h), which the fake driver loads as a
// binary image. Fake LTO-IR is "LTOIR\n" followed by PTX text: a link created with -lto and -ptx
// also emits that PTX (the inputs' texts, concatenated), as nvJitLinkGetLinkedPtx does.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fakeelf.h"

#define EXPORT __attribute__((visibility("default")))
typedef struct link {
  char *all;  // the inputs' bytes, concatenated
  size_t len;
  int inputs, complete, lto, ptx;
  uint8_t cubin[FAKE_ELF_MAX];
  size_t cubin_len;
  char *ptx_out;
} link;

static int add(link *l, const void *d, size_t n) {
  char *a = realloc(l->all, l->len + n);
  if (!a) return 1;
  memcpy(a + l->len, d, n);
  l->all = a, l->len += n, l->inputs++;
  return 0;
}

EXPORT int __nvJitLinkCreate_13_0(link **h, unsigned n, const char **opts) {
  if (!h || !(*h = calloc(1, sizeof **h))) return 1;
  for (unsigned i = 0; i < n; i++) {
    if (strcmp(opts[i], "-lto") == 0) (*h)->lto = 1;
    if (strcmp(opts[i], "-ptx") == 0) (*h)->ptx = 1;
  }
  return 0;
}
EXPORT int __nvJitLinkAddData_13_0(link *l, int type, const void *data, size_t size, const char *name) {
  (void)type; (void)name;
  if (!l || !data || !size) return 2;  // NVJITLINK_ERROR_UNRECOGNIZED_INPUT
  return add(l, data, size);
}
EXPORT int __nvJitLinkAddFile_13_0(link *l, int type, const char *path) {
  (void)type;
  FILE *f = path ? fopen(path, "rb") : NULL;
  if (!l || !f) return 2;
  char buf[65536];
  size_t n = fread(buf, 1, sizeof buf, f);
  fclose(f);
  return n ? add(l, buf, n) : 2;
}
EXPORT int __nvJitLinkComplete_13_0(link *l) {
  if (!l || !l->inputs) return 3;  // NVJITLINK_ERROR_MISSING_ARCH (any error)
  l->cubin_len = fake_elf(l->cubin, l->all, l->len);
  if (l->lto && l->ptx) {  // the inputs' PTX, without their "LTOIR\n" headers
    if (!(l->ptx_out = calloc(1, l->len + 1))) return 1;
    size_t o = 0;
    for (size_t i = 0; i < l->len;) {
      if (l->len - i >= 6 && memcmp(l->all + i, "LTOIR\n", 6) == 0) {
        i += 6;
        continue;
      }
      if (l->all[i]) l->ptx_out[o++] = l->all[i];
      i++;
    }
  }
  l->complete = 1;
  return 0;
}
EXPORT int __nvJitLinkGetLinkedPtxSize_13_0(link *l, size_t *n) {
  if (!l || !l->complete || !l->ptx_out || !n) return 3;
  *n = strlen(l->ptx_out) + 1;
  return 0;
}
EXPORT int __nvJitLinkGetLinkedPtx_13_0(link *l, char *out) {
  if (!l || !l->complete || !l->ptx_out || !out) return 3;
  memcpy(out, l->ptx_out, strlen(l->ptx_out) + 1);
  return 0;
}
EXPORT int __nvJitLinkGetLinkedCubinSize_13_0(link *l, size_t *n) {
  if (!l || !l->complete || !n) return 3;
  *n = l->cubin_len;
  return 0;
}
EXPORT int __nvJitLinkGetLinkedCubin_13_0(link *l, void *out) {
  if (!l || !l->complete || !out) return 3;
  memcpy(out, l->cubin, l->cubin_len);
  return 0;
}
EXPORT int __nvJitLinkDestroy_13_0(link **h) {
  if (!h || !*h) return 3;
  free((*h)->all);
  free((*h)->ptx_out);
  free(*h);
  *h = NULL;
  return 0;
}
