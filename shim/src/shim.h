// libptxmig internals shared between the interception, tracking and control-socket files.
#ifndef PTXMIG_SHIM_H
#define PTXMIG_SHIM_H
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda_defs.h"

#define EXPORT __attribute__((visibility("default")))
#define PTXMIG_SHIM_VERSION "ptxmig-shim 1"
#define PTXMIG_PROTO_VERSION 1

// ---- configuration (read once from the environment, see docs/SHIM-PROTOCOL.md) ----
typedef struct {
  int debug;                 // PTXMIG_DEBUG=1: log to stderr
  char socket_dir[256];      // PTXMIG_SOCKET_DIR, default /run/ptxmig
  unsigned sample_first;     // PTXMIG_SAMPLE_FIRST: time the first N launches of each kernel
  unsigned sample_every;     // PTXMIG_SAMPLE_EVERY: then 1 in M (0: never)
  uint64_t capture_max;      // PTXMIG_CAPTURE_MAX_MB: bytes of module images kept at most
  char libcuda[256];         // PTXMIG_LIBCUDA: the real driver library
  int self_time;             // PTXMIG_SELF_TIME=1: measure the shim's own time on each launch
} shim_config;
extern shim_config cfg;
void config_load(void);

// ---- logging: stderr only with PTXMIG_DEBUG=1; each call site logs once ----
void shim_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#define LOG_ONCE(...)                                                  \
  do {                                                                 \
    static atomic_int once_;                                           \
    if (!atomic_exchange(&once_, 1)) shim_log(__VA_ARGS__);            \
  } while (0)

// ---- the real driver ----
void *libcuda_handle(void);       // dlopen'd real driver (NULL if none)
void *drv_sym(const char *name);  // a driver symbol, bypassing every hook
void *real_dlsym_fn(void *h, const char *name);

// Interception counters (for status and the self-test).
typedef struct {
  atomic_ulong dlsym_hits, getproc_hits, getproc_v2_hits, entrypoint_hits, by_name, unmatched, passthrough;
} intercept_stats;
extern intercept_stats istats;

// ---- tracking (track.c) ----
enum alloc_kind { AK_DEVICE, AK_PITCH, AK_ASYNC, AK_MANAGED, AK_HOST, AK_VMM_PHYS, AK_VMM_MAP, AK_COUNT };
extern const char *const alloc_kind_names[AK_COUNT];
void trk_alloc_add(uint64_t key, uint64_t size, int kind);
void trk_alloc_remove(uint64_t key, int kind);
void trk_vmm_unmap(uint64_t ptr, uint64_t size);

void trk_ctx_add(CUcontext ctx, CUdevice dev, int primary);
void trk_ctx_remove(CUcontext ctx);
void trk_cuinit(void);

enum module_source {
  MS_REGISTER_FATBIN, MS_MODULE_LOAD, MS_MODULE_LOAD_DATA, MS_MODULE_LOAD_DATA_EX,
  MS_MODULE_LOAD_FATBIN, MS_LIBRARY_LOAD_DATA, MS_LIBRARY_LOAD_FILE, MS_LINK_COMPLETE, MS_COUNT
};
extern const char *const module_source_names[MS_COUNT];
// image: the caller's pointer (wrapper, container, ELF or PTX) or NULL with path set.
void trk_module_add(int source, void *handle, const void *image, size_t known_size, const char *path);
void trk_module_remove(void *handle);
void trk_module_alias(void *alias, void *handle);  // cuLibraryGetModule
void trk_func_named(void *fn, void *owner, const char *name);
void trk_func_copy(void *fn, void *from);  // cuKernelGetFunction: fn gets from's name/module

// Launches.
typedef struct launch_tok {
  struct krec *rec;
  struct sample *smp;
  unsigned dims[6];
  uint64_t self_ns;  // with PTXMIG_SELF_TIME=1: the time launch_pre took
} launch_tok;
enum launch_kind { LK_NORMAL, LK_COOPERATIVE, LK_EX };
void launch_pre(launch_tok *t, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                unsigned by, unsigned bz, CUstream s, int ptsz, int kind);
void launch_post(launch_tok *t, CUresult r);
void trk_graph_launch(CUgraphExec g, CUresult r);
void trk_capture(int delta);
void samples_drop_ctx(CUcontext ctx);
void trk_primary_release(CUdevice dev);  // before a primary context release: drop its samples and events
void samples_harvest(int max, int from_ctl);

// ---- control socket (ctl.c) ----
void ctl_ensure_started(void);  // called on first CUDA activity; idempotent and cheap
void ctl_atfork_child(void);

// ---- JSON output buffer (json.c) ----
typedef struct {
  char *p;
  size_t len, cap;
  int oom;
} jbuf;
void jb_raw(jbuf *b, const char *s, size_t n);
void jb_s(jbuf *b, const char *s);  // raw text
void jb_printf(jbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void jb_str(jbuf *b, const char *s, size_t n);  // quoted, escaped JSON string
void jb_key(jbuf *b, const char *k);            // "k":
// json_get_string parses a flat JSON object and copies string member key into out; returns 1 if
// found, 0 if absent, -1 when the text is not a valid flat JSON object (error text in err).
int json_flat_parse(const char *text, size_t n, const char *const *keys, char **vals, size_t nkeys,
                    char *err, size_t errlen);

// Report builders (track.c) used by the control socket.
void report_status(jbuf *b);
void report_kernels(jbuf *b);
int report_dump(jbuf *b, const char *dir, char *err, size_t errlen);

#endif
