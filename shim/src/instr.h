// Instrumentation (instr.c): the instrumented PTX a module load takes instead of the app's image
// when the preempt mode is on, the per-kernel twin information that comes with it, and the PTX of
// JIT links (so a module loaded from a link's cubin is instrumented from the link's PTX input).
#ifndef PTXMIG_INSTR_H
#define PTXMIG_INSTR_H
#include <stddef.h>
#include <stdint.h>

#include "json.h"

// Cache key of instrumented PTX: <sha256 of the PTX>-v<this>.ptx. Bump when ptxstate's output changes.
#define PTXMIG_TRANSFORM_VERSION 3

// Per-kernel twin information of an instrumented (or refused) module, from ptxstate's report and
// the PTX's .entry parameter lists. Never freed once a module holds it (kernel records point at it).
typedef struct kinfo {
  char *name;        // the original kernel's name
  int twin;          // the loaded module carries name__ptxmig
  int mid_twin;      // and name_mid__ptxmig, its mid-block twin (PTXMIG_MID_BLOCK=auto)
  char *reason;      // why not (NULL when twin)
  int nparams;       // -1: layout unknown
  uint32_t *off, *size;
  uint32_t args_size;
} kinfo;
typedef struct kinfo_set {
  int n;
  kinfo *k;
  int instrumented;  // the module was loaded from instrumented PTX
  char reason[192];  // module-level reason when not instrumented (or no kernels)
} kinfo_set;

// instr_prepare looks at a module image about to be loaded (image, or a file at path) and, when
// the preempt mode is on and the image has usable PTX, returns 1 with *ptx the instrumented PTX
// (malloc'd, NUL-terminated) to load instead and *ks filled; 0 (with ks->reason) to load the original.
int instr_prepare(const void *image, size_t known, const char *path, char **ptx, kinfo_set *ks);
void kinfo_set_free(kinfo_set *ks);  // frees the kernels (keeps reason)
void instr_failed(kinfo_set *ks, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void instr_stats(jbuf *b);  // the PTX cache's and the helper's counters, as a JSON object

// JIT-compiled cubins. Links (the driver's cuLinkAddData/AddFile, cuLinkComplete, cuLinkDestroy,
// and nvJitLink's through jit.c; state is the link's handle, type a CU_JIT_INPUT_* value) and
// NVRTC's cubins (instr_jit_cubin: the cubin and the PTX it was compiled from). instr_link_ptx
// returns a copy (malloc'd) of the PTX that the cubin at image was compiled from (kept in memory
// or in the PTX cache), or NULL.
#define JIT_INPUT_PTX 1  // CU_JIT_INPUT_PTX
void instr_link_input(void *state, int type, const void *data, size_t size, const char *path);
void instr_link_complete(void *state, const void *cubin, size_t size);
void instr_link_destroy(void *state);
void instr_jit_cubin(const void *cubin, size_t size, const char *ptx, size_t len);
// instr_read_file reads a regular file of less than max bytes (malloc'd, NUL-terminated after
// its *len bytes): a link's input file. NULL when it cannot.
char *instr_read_file(const char *path, size_t max, size_t *len);
char *instr_link_ptx(const void *image);

#endif
