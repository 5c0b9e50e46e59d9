// The ground floor: configuration, logging, the clock, and the real dlsym and driver. It calls no
// other module of the shim, so any of them can use it from anywhere, the dlsym path included.
#include "base.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

shim_config cfg;

static unsigned env_uint(const char *name, unsigned def) {
  const char *v = getenv(name);
  if (!v || !*v) return def;
  char *end;
  unsigned long x = strtoul(v, &end, 10);
  if (*end || x > 1000000000ul) return def;
  return (unsigned)x;
}

void config_load(void) {
  const char *d = getenv("PTXMIG_DEBUG");
  cfg.debug = d && d[0] == '1';
  const char *sd = getenv("PTXMIG_SOCKET_DIR");
  snprintf(cfg.socket_dir, sizeof cfg.socket_dir, "%s", sd && sd[0] == '/' ? sd : "/run/ptxmig");
  cfg.sample_first = env_uint("PTXMIG_SAMPLE_FIRST", 20);
  cfg.sample_every = env_uint("PTXMIG_SAMPLE_EVERY", 100);
  cfg.capture_max = (uint64_t)env_uint("PTXMIG_CAPTURE_MAX_MB", 2048) << 20;
  const char *lc = getenv("PTXMIG_LIBCUDA");
  snprintf(cfg.libcuda, sizeof cfg.libcuda, "%s", lc && *lc ? lc : "libcuda.so.1");
  const char *st = getenv("PTXMIG_SELF_TIME");
  cfg.self_time = st && st[0] == '1';
  const char *pm = getenv("PTXMIG_PREEMPT");
  cfg.preempt = !pm ? PM_OFF : strcmp(pm, "auto") == 0 ? PM_AUTO : strcmp(pm, "always") == 0 ? PM_ALWAYS : PM_OFF;
  cfg.preempt_min_us = env_uint("PTXMIG_PREEMPT_MIN_US", 5000);
  cfg.preempt_batch_max = env_uint("PTXMIG_PREEMPT_BATCH_MAX", 0);
  cfg.preempt_hold = env_uint("PTXMIG_PREEMPT_HOLD", 1) != 0;
  cfg.preempt_long_us = env_uint("PTXMIG_PREEMPT_LONG_US", 10000);
  if (cfg.preempt_batch_max > 65536) cfg.preempt_batch_max = 65536;
  const char *ps = getenv("PTXMIG_PREEMPT_SASS");
  cfg.preempt_sass = !(ps && strcmp(ps, "keep") == 0);
  cfg.ptx_cubin = env_uint("PTXMIG_PTX_CUBIN", 1) != 0;
  const char *mb = getenv("PTXMIG_MID_BLOCK");
  // auto (unset, empty, "auto", or a value it does not know: `ptxmig run` refuses those), 1, 0
  cfg.mid_block = MB_AUTO;
  if (mb && (strcmp(mb, "0") == 0 || strcmp(mb, "1") == 0)) cfg.mid_block = mb[0] == '1' ? MB_ON : MB_OFF;
  cfg.mid_max_bytes = (uint64_t)env_uint("PTXMIG_MID_BLOCK_MAX_MB", 2048) << 20;
  cfg.owned = env_uint("PTXMIG_OWNED_MEMORY", 0) != 0;
  cfg.owned_min = (uint64_t)env_uint("PTXMIG_OWNED_MIN_KB", 1024) << 10;
  cfg.no_peer = env_uint("PTXMIG_PEER_ACCESS", 1) == 0;
  const char *pc = getenv("PTXMIG_PTX_CACHE");
  snprintf(cfg.ptx_cache, sizeof cfg.ptx_cache, "%s", pc ? pc : "/var/cache/ptxmig/ptx");
  const char *hp = getenv("PTXMIG_HELPER");
  snprintf(cfg.helper, sizeof cfg.helper, "%s", hp && hp[0] == '/' ? hp : "");
  cfg.helper_timeout_ms = env_uint("PTXMIG_HELPER_TIMEOUT_MS", 60000);
  cfg.helper_max_bytes = (uint64_t)env_uint("PTXMIG_HELPER_MAX_MB", 256) << 20;
}

uint64_t shim_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void shim_log(const char *fmt, ...) {
  if (!cfg.debug) return;
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  int n = snprintf(buf, sizeof buf, "ptxmig-shim[%d]: ", (int)getpid());
  if (n > 0 && (size_t)n < sizeof buf) vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
  va_end(ap);
  size_t len = strlen(buf);
  if (len + 1 < sizeof buf) buf[len++] = '\n';
  ssize_t w = write(2, buf, len);
  (void)w;
}

// ---- the real dlsym and the real driver ----
static dlsym_fn glibc_dlsym;
static pthread_once_t dlsym_once = PTHREAD_ONCE_INIT;
NO_SAN static void dlsym_init(void) {
  static const char *vers[] = {"GLIBC_2.34", "GLIBC_2.17", "GLIBC_2.2.5"};
  for (size_t i = 0; i < sizeof vers / sizeof vers[0] && !glibc_dlsym; i++)
    glibc_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", vers[i]);
}
NO_SAN dlsym_fn real_dlsym_ptr(void) {
  pthread_once(&dlsym_once, dlsym_init);
  return glibc_dlsym;
}
void *real_dlsym(void *h, const char *name) {
  dlsym_fn f = real_dlsym_ptr();
  return f ? f(h, name) : NULL;
}

static void *cuda_h;
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static void cuda_open(void) {
  cuda_h = dlopen(cfg.libcuda, RTLD_NOW | RTLD_LOCAL);
  if (!cuda_h) LOG_ONCE("cannot open the real driver %s: %s", cfg.libcuda, dlerror());
}
void *libcuda_handle(void) {
  pthread_once(&cuda_once, cuda_open);
  return cuda_h;
}
void *drv_sym(const char *name) {
  void *h = libcuda_handle();
  return h ? real_dlsym(h, name) : NULL;
}
