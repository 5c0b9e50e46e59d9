// JIT compilers' cubins. CuPy compiles its kernels with NVRTC straight to a cubin (nvrtcGetCUBIN),
// and cuda.core's Linker, which numba-cuda uses, links NVVM's output with nvJitLink
// (nvJitLinkGetLinkedCubin): either way the app loads a cubin and never holds the PTX, so its
// kernels would get no twins. Both libraries are loaded with dlopen and reached through dlsym
// (CuPy 14, cuda-bindings 13), so the shim's dlsym hands out wrappers for the few entry points
// that matter, one set per copy of a library (CUDA 12's and 13's can share a process):
//   nvrtcGetCUBIN      also asks the program for its PTX (NVRTC keeps it for a program compiled
//                      for sm_XX too) and records it for the cubin (instr_jit_cubin);
//   nvJitLinkCreate, AddData, AddFile  the link's options and inputs (copied: the app may free
//                      them), and nvJitLinkGetLinkedCubin its output: a link of one PTX input
//                      records that PTX; a link-time-optimized link (-lto) of LTO-IR inputs
//                      only (numba-cuda 0.30 hands NVVM's LTO-IR) is linked a second time by
//                      the shim, the same options plus -ptx, and records the PTX that link
//                      emits, whose kernels are the cubin's (instr.c checks that every function
//                      of the cubin is in it before use); nvJitLinkDestroy drops the record.
// Everything else, and every lookup while preemption is off, passes through untouched. A library
// linked at build time (not reached through dlsym) is not seen: its modules load without twins, as
// before. Lookups of a library's helpers (sizes, the PTX, a second link) go through
// dlopen(RTLD_NOLOAD) of the library the app's symbol came from, which keeps it loaded for the
// life of the process.
#include "jit.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base.h"
#include "instr.h"

#define JIT_LIBS 4                 // distinct copies of NVRTC and nvJitLink in one process
#define JIT_MAX_PTX (64u << 20)    // larger PTX is not kept
#define NVJITLINK_INPUT_PTX 2
#define NVJITLINK_INPUT_ANY 10

// The wrapped entry points (F_*), then the helpers the wrappers call (looked up by the shim).
enum {
  F_NVRTC_GET_CUBIN,
  F_JL_CREATE,
  F_JL_ADD_DATA,
  F_JL_ADD_FILE,
  F_JL_GET_CUBIN,
  F_JL_DESTROY,
  F_WRAPPED,
  F_NVRTC_CUBIN_SIZE = F_WRAPPED,
  F_NVRTC_PTX_SIZE,
  F_NVRTC_PTX,
  F_JL_CUBIN_SIZE,
  F_JL_COMPLETE,
  F_JL_PTX_SIZE,
  F_JL_PTX,
  F_COUNT
};
static const char *const fn_names[F_COUNT] = {
    [F_NVRTC_GET_CUBIN] = "nvrtcGetCUBIN",
    [F_JL_CREATE] = "nvJitLinkCreate",
    [F_JL_ADD_DATA] = "nvJitLinkAddData",
    [F_JL_ADD_FILE] = "nvJitLinkAddFile",
    [F_JL_GET_CUBIN] = "nvJitLinkGetLinkedCubin",
    [F_JL_DESTROY] = "nvJitLinkDestroy",
    [F_NVRTC_CUBIN_SIZE] = "nvrtcGetCUBINSize",
    [F_NVRTC_PTX_SIZE] = "nvrtcGetPTXSize",
    [F_NVRTC_PTX] = "nvrtcGetPTX",
    [F_JL_CUBIN_SIZE] = "nvJitLinkGetLinkedCubinSize",
    [F_JL_COMPLETE] = "nvJitLinkComplete",
    [F_JL_PTX_SIZE] = "nvJitLinkGetLinkedPtxSize",
    [F_JL_PTX] = "nvJitLinkGetLinkedPtx",
};

typedef struct jitlib {
  void *base;           // the library's load address (dladdr), NULL: a free slot
  void *fn[F_COUNT];    // the real entry points (atomic loads and stores)
} jitlib;
static jitlib libs[JIT_LIBS];
static pthread_mutex_t jit_mu = PTHREAD_MUTEX_INITIALIZER;

static void *fn_of(const jitlib *l, int f) { return __atomic_load_n(&l->fn[f], __ATOMIC_ACQUIRE); }

typedef int (*size_fn)(void *, size_t *);

// ---- the wrappers' bodies ----
static int nvrtc_get_cubin(const jitlib *l, void *prog, char *cubin) {
  int r = ((int (*)(void *, char *))fn_of(l, F_NVRTC_GET_CUBIN))(prog, cubin);
  size_fn csize = (size_fn)fn_of(l, F_NVRTC_CUBIN_SIZE), psize = (size_fn)fn_of(l, F_NVRTC_PTX_SIZE);
  int (*get_ptx)(void *, char *) = (int (*)(void *, char *))fn_of(l, F_NVRTC_PTX);
  size_t cn = 0, pn = 0;
  if (r != 0 || !cubin || !csize || !psize || !get_ptx || csize(prog, &cn) != 0 || psize(prog, &pn) != 0 || pn < 2 ||
      pn > JIT_MAX_PTX)
    return r;
  char *ptx = malloc(pn);
  if (ptx && get_ptx(prog, ptx) == 0) {
    instr_jit_cubin(cubin, cn, ptx, pn);
    if (cfg.debug) shim_log("jit: nvrtcGetCUBIN: %zu-byte cubin, its PTX (%zu bytes) kept", cn, pn);
  }
  free(ptx);
  return r;
}

// ---- nvJitLink ----
#define NVJITLINK_INPUT_LTOIR 3
#define JL_LINKS 32       // links open at once that are followed
#define JL_INPUTS 16      // inputs a followed link may have
#define JL_OPTS 32        // options a followed link may have
#define JL_MAX_BYTES (64u << 20)
typedef struct jlinput {
  int type;
  char *data;  // a copy (of the file's contents for nvJitLinkAddFile: the app may remove it)
  size_t size;
} jlinput;
typedef struct jlink {
  void *h;  // NULL: a free slot
  char *opt[JL_OPTS];
  int nopt, nin, lto, lost;  // lost: an input or option the shim could not keep, or of another type
  int done;                  // its cubin's PTX was recorded (a second GetLinkedCubin does nothing)
  size_t bytes;
  jlinput in[JL_INPUTS];
} jlink;
static jlink jlinks[JL_LINKS];
static pthread_mutex_t jl_mu = PTHREAD_MUTEX_INITIALIZER;

static void jl_free(jlink *k) {
  for (int i = 0; i < k->nopt; i++) free(k->opt[i]);
  for (int i = 0; i < k->nin; i++) free(k->in[i].data);
  memset(k, 0, sizeof *k);
}
// jl_take removes h's record from the table and hands it over (in *out); 0 when there is none.
static int jl_take(void *h, jlink *out) {
  int found = 0;
  pthread_mutex_lock(&jl_mu);
  for (int i = 0; i < JL_LINKS && !found; i++)
    if (jlinks[i].h == h) *out = jlinks[i], memset(&jlinks[i], 0, sizeof jlinks[i]), found = 1;
  pthread_mutex_unlock(&jl_mu);
  return found;
}
// jl_put files k (a record with k->h set) in a free slot, or frees it when the table is full.
static void jl_put(jlink *k) {
  pthread_mutex_lock(&jl_mu);
  int i;
  for (i = 0; i < JL_LINKS && jlinks[i].h; i++) {}
  if (i < JL_LINKS) jlinks[i] = *k;
  pthread_mutex_unlock(&jl_mu);
  if (i == JL_LINKS) {
    LOG_ONCE("jit: more than %d nvJitLink links open; further ones get no twins", JL_LINKS);
    jl_free(k);
  }
}

// looks_ptx: an input of unknown type (NVJITLINK_INPUT_ANY) that is PTX text.
static int looks_ptx(const char *p, size_t n) {
  size_t m = n < 4096 ? n : 4096;
  if (!p || m < 16 || memchr(p, 0, m - 1)) return 0;
  char head[4097];
  memcpy(head, p, m);
  head[m] = 0;
  return strstr(head, ".version") && strstr(head, ".target");
}

static int ends_with(const char *s, const char *tail) {
  size_t a = s ? strlen(s) : 0, b = strlen(tail);
  return a >= b && strcmp(s + a - b, tail) == 0;
}

static int jl_create(const jitlib *l, void **hp, unsigned n, const char **opts) {
  int r = ((int (*)(void **, unsigned, const char **))fn_of(l, F_JL_CREATE))(hp, n, opts);
  if (r != 0 || !hp || !*hp) return r;
  jlink k = {.h = *hp}, old;
  if (jl_take(*hp, &old)) jl_free(&old);  // a record left by a handle of the same address
  for (unsigned i = 0; opts && i < n; i++) {
    if (!opts[i]) continue;
    if (k.nopt == JL_OPTS || !(k.opt[k.nopt] = strdup(opts[i]))) {
      k.lost = 1;
      break;
    }
    if (strcmp(opts[i], "-lto") == 0) k.lto = 1;
    k.nopt++;
  }
  jl_put(&k);
  return r;
}

// jl_input records an input of h: size bytes at data (NULL: it could not be read), of nvJitLink's
// type, or named path (a file's input of type ANY: its type from its name).
static void jl_input(void *h, int type, const void *data, size_t size, const char *path) {
  jlink k;
  if (!jl_take(h, &k)) return;  // not followed (created before the shim wrapped nvJitLinkCreate)
  if (type == NVJITLINK_INPUT_ANY) {
    if (path ? ends_with(path, ".ptx") : looks_ptx(data, size)) type = NVJITLINK_INPUT_PTX;
    else if (path && ends_with(path, ".ltoir")) type = NVJITLINK_INPUT_LTOIR;
  }
  jlinput *in = &k.in[k.nin];
  if (k.lost || !data || k.nin == JL_INPUTS || (type != NVJITLINK_INPUT_PTX && type != NVJITLINK_INPUT_LTOIR) ||
      size > JL_MAX_BYTES - k.bytes || !(in->data = malloc(size))) {
    k.lost = 1;
  } else {
    memcpy(in->data, data, size);
    in->type = type, in->size = size;
    k.bytes += size;
    k.nin++;
  }
  if (k.lost) {  // never usable: keep no copies
    for (int i = 0; i < k.nin; i++) free(k.in[i].data);
    k.nin = 0, k.bytes = 0;
    memset(k.in, 0, sizeof k.in);
  }
  jl_put(&k);
}

static int jl_add_data(const jitlib *l, void *h, int type, const void *data, size_t size, const char *name) {
  int r = ((int (*)(void *, int, const void *, size_t, const char *))fn_of(l, F_JL_ADD_DATA))(h, type, data, size, name);
  if (r == 0 && data && size) jl_input(h, type, data, size, NULL);
  if (r == 0 && cfg.debug) shim_log("jit: nvJitLinkAddData %p: input type %d, %zu bytes", h, type, size);
  return r;
}

static int jl_add_file(const jitlib *l, void *h, int type, const char *path) {
  int r = ((int (*)(void *, int, const char *))fn_of(l, F_JL_ADD_FILE))(h, type, path);
  if (r == 0 && path) {  // read outside any lock; a file that cannot be read makes the link unusable
    size_t n = 0;
    char *d = instr_read_file(path, JL_MAX_BYTES, &n);
    jl_input(h, type, d, d ? n : 0, path);
    free(d);
  }
  if (r == 0 && cfg.debug) shim_log("jit: nvJitLinkAddFile %p: input type %d, %s", h, type, path ? path : "(null)");
  return r;
}

// lto_ptx links k's inputs again with k's options and -ptx (the shim's own link, with the app's
// library) and returns the PTX it emits (malloc'd, *len bytes), or NULL.
static char *lto_ptx(const jitlib *l, const jlink *k, size_t *len) {
  int (*create)(void **, unsigned, const char **) = (int (*)(void **, unsigned, const char **))fn_of(l, F_JL_CREATE);
  int (*add)(void *, int, const void *, size_t, const char *) =
      (int (*)(void *, int, const void *, size_t, const char *))fn_of(l, F_JL_ADD_DATA);
  int (*complete)(void *) = (int (*)(void *))fn_of(l, F_JL_COMPLETE);
  size_fn psize = (size_fn)fn_of(l, F_JL_PTX_SIZE);
  int (*get)(void *, char *) = (int (*)(void *, char *))fn_of(l, F_JL_PTX);
  int (*destroy)(void **) = (int (*)(void **))fn_of(l, F_JL_DESTROY);
  if (!create || !add || !complete || !psize || !get || !destroy || k->nopt >= JL_OPTS) return NULL;
  const char *opts[JL_OPTS + 1];
  for (int i = 0; i < k->nopt; i++) opts[i] = k->opt[i];
  opts[k->nopt] = "-ptx";
  void *h = NULL;
  char *ptx = NULL;
  size_t n = 0;
  int ok = create(&h, (unsigned)k->nopt + 1, opts) == 0 && h;
  for (int i = 0; ok && i < k->nin; i++) ok = add(h, k->in[i].type, k->in[i].data, k->in[i].size, "ptxmig-lto") == 0;
  if (ok && complete(h) == 0 && psize(h, &n) == 0 && n > 1 && n < JIT_MAX_PTX && (ptx = malloc(n)) &&
      get(h, ptx) != 0) {
    free(ptx);
    ptx = NULL;
  }
  if (h) destroy(&h);
  *len = ptx ? n : 0;
  return ptx;
}

static int jl_get_cubin(const jitlib *l, void *h, void *cubin) {
  int r = ((int (*)(void *, void *))fn_of(l, F_JL_GET_CUBIN))(h, cubin);
  size_fn size = (size_fn)fn_of(l, F_JL_CUBIN_SIZE);
  size_t n = 0;
  jlink k;
  if (r != 0 || !cubin || !size || size(h, &n) != 0 || !jl_take(h, &k)) return r;
  int all_lto = k.nin > 0;
  for (int i = 0; i < k.nin; i++) all_lto = all_lto && k.in[i].type == NVJITLINK_INPUT_LTOIR;
  if (k.done) {
    // recorded at an earlier call
  } else if (!k.lost && k.nin == 1 && k.in[0].type == NVJITLINK_INPUT_PTX) {
    instr_jit_cubin(cubin, n, k.in[0].data, k.in[0].size);  // the one PTX input is the cubin's
    k.done = 1;
    if (cfg.debug) shim_log("jit: nvJitLinkGetLinkedCubin: %zu-byte cubin of one PTX input", n);
  } else if (!k.lost && k.lto && all_lto) {
    // LTO-IR only: the PTX of a link with -ptx is the whole program (with PTX inputs beside it,
    // whether the emitted PTX holds their kernels too is not known: such a link gets no twins).
    uint64_t t0 = shim_now_ns();
    size_t plen = 0;
    char *ptx = lto_ptx(l, &k, &plen);
    if (ptx) instr_jit_cubin(cubin, n, ptx, plen);
    if (cfg.debug)
      shim_log("jit: nvJitLinkGetLinkedCubin: %zu-byte cubin of an LTO link; %s (%.1f ms)", n,
               ptx ? "its PTX from a second link with -ptx" : "a second link with -ptx gave no PTX",
               (double)(shim_now_ns() - t0) / 1e6);
    if (!ptx) LOG_ONCE("jit: an LTO link's second link with -ptx failed; its kernels get no twins");
    free(ptx);
    k.done = 1;
  } else if (cfg.debug) {
    shim_log("jit: nvJitLinkGetLinkedCubin: %zu-byte cubin; its inputs cannot give the PTX", n);
  }
  jl_put(&k);  // kept until nvJitLinkDestroy (a second GetLinkedCubin records again, harmlessly)
  return r;
}

static int jl_destroy(const jitlib *l, void **hp) {
  // The record goes first: once the real destroy returns, another thread's link can get the
  // same address.
  jlink k;
  if (hp && *hp && jl_take(*hp, &k)) jl_free(&k);
  return ((int (*)(void **))fn_of(l, F_JL_DESTROY))(hp);
}

// One set of wrappers per library slot.
#define WRAPPERS(i)                                                                                              \
  static int nvrtc_get_cubin_##i(void *p, char *c) { return nvrtc_get_cubin(&libs[i], p, c); }                  \
  static int jl_create_##i(void **h, unsigned n, const char **o) { return jl_create(&libs[i], h, n, o); }       \
  static int jl_add_data_##i(void *h, int t, const void *d, size_t n, const char *s) {                          \
    return jl_add_data(&libs[i], h, t, d, n, s);                                                                 \
  }                                                                                                              \
  static int jl_add_file_##i(void *h, int t, const char *p) { return jl_add_file(&libs[i], h, t, p); }          \
  static int jl_get_cubin_##i(void *h, void *c) { return jl_get_cubin(&libs[i], h, c); }                        \
  static int jl_destroy_##i(void **h) { return jl_destroy(&libs[i], h); }
WRAPPERS(0)
WRAPPERS(1)
WRAPPERS(2)
WRAPPERS(3)
#define WRAPPER_ROW(i) \
  {(void *)nvrtc_get_cubin_##i, (void *)jl_create_##i, (void *)jl_add_data_##i, (void *)jl_add_file_##i, (void *)jl_get_cubin_##i, (void *)jl_destroy_##i}
static void *const wrappers[JIT_LIBS][F_WRAPPED] = {WRAPPER_ROW(0), WRAPPER_ROW(1), WRAPPER_ROW(2), WRAPPER_ROW(3)};

// wrapped_fn: the F_* index of a wrapped entry point named name, with nvJitLink's versioned
// spelling (__nvJitLinkAddData_12_0) accepted too (its version suffix in suffix); -1 otherwise.
static int wrapped_fn(const char *name, char suffix[16]) {
  suffix[0] = 0;
  const char *b = strncmp(name, "__", 2) == 0 ? name + 2 : name;
  size_t n = strlen(b);
  // A trailing _<digits>_<digits>.
  size_t i = n;
  while (i > 0 && b[i - 1] >= '0' && b[i - 1] <= '9') i--;
  if (i < n && i > 1 && b[i - 1] == '_') {
    size_t j = i - 1;
    while (j > 0 && b[j - 1] >= '0' && b[j - 1] <= '9') j--;
    if (j < i - 1 && j > 1 && b[j - 1] == '_' && n - (j - 1) < 16) {
      memcpy(suffix, b + j - 1, n - (j - 1) + 1);
      n = j - 1;
    }
  }
  for (int f = 0; f < F_WRAPPED; f++)
    if (strlen(fn_names[f]) == n && strncmp(fn_names[f], b, n) == 0) return f;
  suffix[0] = 0;
  return -1;
}

// helpers looks up, in the library at path, the entry points the wrappers call themselves
// (sizes, the PTX, a second link), plain or with the version suffix of the name the app asked for.
// It takes the dynamic loader's lock (dlopen, dlsym): never call it holding jit_mu, which a
// library constructor's dlsym could be waiting for while the loader lock is held.
// Only the library's own helpers are looked up (NVRTC's or nvJitLink's, by the name the app asked
// for), and dlerror() is cleared after: the app's dlsym succeeded and must leave no error behind.
// 0 when the library cannot be opened again (then it is not wrapped: holding no reference, the
// shim could not know when it is unloaded and another mapped at its address).
static int helpers(const char *path, const char *name, const char *suffix, void *out[F_COUNT]) {
  void *h = dlopen(path, RTLD_NOLOAD | RTLD_LAZY | RTLD_LOCAL);
  if (!h) {
    dlerror();
    return 0;
  }
  int nvrtc = strncmp(name, "nvrtc", 5) == 0;
  for (int f = F_WRAPPED; f < F_COUNT; f++) {
    if ((strncmp(fn_names[f], "nvrtc", 5) == 0) != nvrtc) continue;
    void *p = real_dlsym(h, fn_names[f]);
    if (!p && suffix[0]) {
      char v[96];
      snprintf(v, sizeof v, "__%s%s", fn_names[f], suffix);
      p = real_dlsym(h, v);
    }
    out[f] = p;
  }
  dlerror();
  return 1;
}

// slot_locked: the slot of the library loaded at base, -1 when it has none.
static int slot_locked(void *base) {
  for (int i = 0; i < JIT_LIBS; i++)
    if (libs[i].base == base) return i;
  return -1;
}

void *jit_dlsym(void *handle, const char *name) {
  if (cfg.preempt == PM_OFF || !name) return NULL;
  char suffix[16];
  int f = wrapped_fn(name, suffix);
  if (f < 0) return NULL;
  void *r = real_dlsym(handle, name);
  Dl_info di;
  if (!r || !dladdr(r, &di) || !di.dli_fbase || !di.dli_fname) return NULL;
  pthread_mutex_lock(&jit_mu);
  int i = slot_locked(di.dli_fbase);
  pthread_mutex_unlock(&jit_mu);
  void *h[F_COUNT] = {0};
  if (i < 0 && !helpers(di.dli_fname, name, suffix, h)) return NULL;  // a library not seen yet: outside the lock
  void *w = NULL;
  pthread_mutex_lock(&jit_mu);
  if ((i = slot_locked(di.dli_fbase)) < 0) {  // still new (another thread may have filed it meanwhile)
    for (i = 0; i < JIT_LIBS && libs[i].base; i++) {}
    if (i < JIT_LIBS) {
      for (int k = F_WRAPPED; k < F_COUNT; k++) __atomic_store_n(&libs[i].fn[k], h[k], __ATOMIC_RELEASE);
      libs[i].base = di.dli_fbase;
    } else {
      i = -1;
    }
  }
  if (i >= 0) {
    __atomic_store_n(&libs[i].fn[f], r, __ATOMIC_RELEASE);
    w = wrappers[i][f];
  }
  pthread_mutex_unlock(&jit_mu);
  if (!w) LOG_ONCE("jit: more than %d NVRTC/nvJitLink libraries; %s of %s not wrapped", JIT_LIBS, name, di.dli_fname);
  else if (cfg.debug) shim_log("jit: dlsym(%s) of %s wrapped", name, di.dli_fname);
  return w;
}

// A child forked while another thread held jit_mu would wait on it forever.
static void atfork_child(void) {
  pthread_mutex_init(&jit_mu, NULL);
  pthread_mutex_init(&jl_mu, NULL);
}
__attribute__((constructor)) static void jit_fork_init(void) { pthread_atfork(NULL, NULL, atfork_child); }
