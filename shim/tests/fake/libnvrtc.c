// A fake NVRTC (libnvrtc.so) for the shim's tests: it "compiles" a program whose source is PTX
// text. The PTX it reports is that source; the cubin is a small ELF (fakeelf.h: its kernels'
// section names and a hash of the source, so that each program's cubin differs) that the fake
// driver loads as a binary image. A program compiled for a virtual architecture (compute_XX) has
// no cubin, as with NVRTC. FAKE_NVRTC_PTX_DROP=NAME: the PTX it reports lacks the kernel NAME
// (renamed), as a PTX that does not match its cubin would.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fakeelf.h"

#define EXPORT __attribute__((visibility("default")))
typedef struct prog {
  char *src;
  int compiled, virt;
  uint8_t cubin[FAKE_ELF_MAX];
  size_t cubin_len;
} prog;

EXPORT int nvrtcCreateProgram(prog **p, const char *src, const char *name, int nh, const char *const *h,
                              const char *const *hn) {
  (void)name; (void)nh; (void)h; (void)hn;
  if (!p || !src) return 3;  // NVRTC_ERROR_INVALID_INPUT
  *p = calloc(1, sizeof **p);
  if (!*p || !((*p)->src = strdup(src))) return 1;  // NVRTC_ERROR_OUT_OF_MEMORY
  return 0;
}
EXPORT int nvrtcCompileProgram(prog *p, int n, const char *const *opts) {
  if (!p) return 4;  // NVRTC_ERROR_INVALID_PROGRAM
  for (int i = 0; i < n; i++)
    if (strstr(opts[i], "compute_")) p->virt = 1;
  p->cubin_len = fake_elf(p->cubin, p->src, strlen(p->src));
  const char *drop = getenv("FAKE_NVRTC_PTX_DROP");
  char *k;
  if (drop && *drop && (k = strstr(p->src, drop))) k[0] = 'X';  // the PTX's kernel renamed
  p->compiled = 1;
  return 0;
}
EXPORT int nvrtcGetPTXSize(prog *p, size_t *n) {
  if (!p || !p->compiled || !n) return 4;
  *n = strlen(p->src) + 1;
  return 0;
}
EXPORT int nvrtcGetPTX(prog *p, char *out) {
  if (!p || !p->compiled || !out) return 4;
  memcpy(out, p->src, strlen(p->src) + 1);
  return 0;
}
EXPORT int nvrtcGetCUBINSize(prog *p, size_t *n) {
  if (!p || !p->compiled || !n) return 4;
  *n = p->virt ? 0 : p->cubin_len;
  return 0;
}
EXPORT int nvrtcGetCUBIN(prog *p, char *out) {
  if (!p || !p->compiled || !out) return 4;
  if (p->virt) return 3;
  memcpy(out, p->cubin, p->cubin_len);
  return 0;
}
EXPORT int nvrtcDestroyProgram(prog **p) {
  if (!p || !*p) return 4;
  free((*p)->src);
  free(*p);
  *p = NULL;
  return 0;
}
