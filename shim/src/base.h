// The ground floor of libptxmig: configuration, logging, the clock and the real driver. Every other
// module may use it; it uses none of them (shim/check-layers.sh enforces both, see
// docs/DEVELOPING.md).
#ifndef PTXMIG_BASE_H
#define PTXMIG_BASE_H
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda_defs.h"

#define EXPORT __attribute__((visibility("default")))
// For code that can run inside a sanitizer runtime's own initialisation (ASan resolves its
// interceptors through dlsym, so the dlsym path runs before ASan is ready): never instrumented.
#define NO_SAN __attribute__((no_sanitize("address", "undefined")))

#define PTXMIG_SHIM_VERSION "ptxmig-shim 2"
#define PTXMIG_PROTO_VERSION 2

// ---- configuration (read once from the environment, see docs/SHIM-PROTOCOL.md) ----
typedef struct {
  int debug;                 // PTXMIG_DEBUG=1: log to stderr
  char socket_dir[256];      // PTXMIG_SOCKET_DIR, default /run/ptxmig
  unsigned sample_first;     // PTXMIG_SAMPLE_FIRST: time the first N launches of each kernel
  unsigned sample_every;     // PTXMIG_SAMPLE_EVERY: then 1 in M (0: never)
  uint64_t capture_max;      // PTXMIG_CAPTURE_MAX_MB: bytes of module images kept at most
  char libcuda[256];         // PTXMIG_LIBCUDA: the real driver library
  int self_time;             // PTXMIG_SELF_TIME=1: measure the shim's own time on each launch
  int preempt;               // PTXMIG_PREEMPT: PM_OFF (default), PM_AUTO, PM_ALWAYS
  unsigned preempt_min_us;   // PTXMIG_PREEMPT_MIN_US (default 5000)
  unsigned preempt_long_us;   // PTXMIG_PREEMPT_LONG_US (default 10000): auto keeps twins at or above it even when slower
  int preempt_hold;            // PTXMIG_PREEMPT_HOLD (default 1): hold submissions behind twins in flight
  unsigned preempt_batch_max;  // PTXMIG_PREEMPT_BATCH_MAX: twins' largest claim (0: from the sampled block time)
  int preempt_sass;          // PTXMIG_PREEMPT_SASS: 1 jit (default), 0 keep modules with SASS for the GPU
  int ptx_cubin;             // PTXMIG_PTX_CUBIN (default 1): ask the helper for a cubin (ptxas) instead of PTX to JIT
  int mid_block;             // PTXMIG_MID_BLOCK: MB_AUTO (default), MB_OFF (0), MB_ON (1: twins that also stop inside a block,
                             // ptx instrument --mid-block), MB_AUTO (auto: a second, mid-block twin, launched where
                             // a block twin cannot stop in time: one-wave grids, blocks sampled long)
  uint64_t mid_max_bytes;    // PTXMIG_MID_BLOCK_MAX_MB (default 2048): save areas of one launch at most
  int owned;                 // PTXMIG_OWNED_MEMORY=1 (default 0): serve cuMemAlloc* from VMM mappings (vmm.c)
  uint64_t owned_min;        // PTXMIG_OWNED_MIN_KB (default 1024): smaller allocations go to the driver
  int no_peer;               // PTXMIG_PEER_ACCESS=0 (default 1): no peer access between GPUs (hooks.c)
  char ptx_cache[256];       // PTXMIG_PTX_CACHE, default /var/cache/ptxmig/ptx ("" or "off": no cache)
  char helper[256];          // PTXMIG_HELPER: the ptxmig binary ("" : none)
  unsigned helper_timeout_ms;  // PTXMIG_HELPER_TIMEOUT_MS (default 60000)
  uint64_t helper_max_bytes; // PTXMIG_HELPER_MAX_MB: PTX size limit in and out (default 256)
} shim_config;
enum { PM_OFF, PM_AUTO, PM_ALWAYS };
enum { MB_OFF, MB_ON, MB_AUTO };
extern shim_config cfg;
// config_load fills cfg from the environment: cheap (no allocation, no I/O), so the first code
// to run in the process (a constructor, or a dlsym that beats it) can call it.
void config_load(void);

uint64_t shim_now_ns(void);  // CLOCK_MONOTONIC in nanoseconds

// ---- logging: stderr only with PTXMIG_DEBUG=1; each call site logs once ----
void shim_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#define LOG_ONCE(...)                                                  \
  do {                                                                 \
    static atomic_int once_;                                           \
    if (!atomic_exchange(&once_, 1)) shim_log(__VA_ARGS__);            \
  } while (0)

// ---- the real dlsym and the real driver ----
// The shim exports its own dlsym (hooks.c); its own lookups go to glibc's, found with dlvsym.
typedef void *(*dlsym_fn)(void *, const char *);
dlsym_fn real_dlsym_ptr(void);                  // glibc's dlsym (NULL if not found); NO_SAN
void *real_dlsym(void *h, const char *name);   // a lookup through it
void *libcuda_handle(void);       // dlopen'd real driver (NULL if none)
void *drv_sym(const char *name);  // a driver symbol, bypassing every hook

#endif
