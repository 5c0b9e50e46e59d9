// Instrumented modules: when a module or library is loaded with PTX inside (a fatbin's PTX entry
// or raw PTX) and PTXMIG_PREEMPT is not off, the shim loads ptxstate's instrumented PTX instead
// (originals untouched plus twins K__ptxmig, one module). The instrumented text comes from a cache
// directory or from the ptxmig helper, spawned as `$PTXMIG_HELPER ptx instrument --report --json
// -o - -` (PTX on stdin, instrumented PTX on stdout, the per-kernel report on stderr). Runs on the
// loading thread, holding no shim lock; any failure means the original loads as before.
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../include/ptxmig_ctrl.h"
#include "base.h"
#include "fatbin.h"
#include "instr.h"
#include "sha256.h"

extern char **environ;

static atomic_ulong st_hits, st_misses, st_helper_failures, st_helper_runs, st_helper_ns;
static atomic_int helper_broken;      // the helper could not be started: do not try again
static atomic_int helper_fail_streak;  // consecutive failures; 8 disable the helper

void instr_failed(kinfo_set *ks, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ks->reason, sizeof ks->reason, fmt, ap);
  va_end(ap);
}

void instr_stats(jbuf *b) {
  jb_printf(b,
            "{\"hits\":%lu,\"misses\":%lu,\"helper_failures\":%lu,\"helper_runs\":%lu,\"helper_ms\":%.3f}",
            atomic_load(&st_hits), atomic_load(&st_misses), atomic_load(&st_helper_failures),
            atomic_load(&st_helper_runs), (double)atomic_load(&st_helper_ns) / 1e6);
}


// ---- the device's compute capability (major*10+minor) ----
static int device_cc(void) {
  CUresult (*cur)(CUcontext *) = (CUresult(*)(CUcontext *))drv_sym("cuCtxGetCurrent");
  CUresult (*cdev)(CUdevice *) = (CUresult(*)(CUdevice *))drv_sym("cuCtxGetDevice");
  CUresult (*attr)(int *, int, CUdevice) = (CUresult(*)(int *, int, CUdevice))drv_sym("cuDeviceGetAttribute");
  CUresult (*count)(int *) = (CUresult(*)(int *))drv_sym("cuDeviceGetCount");
  CUresult (*get)(CUdevice *, int) = (CUresult(*)(CUdevice *, int))drv_sym("cuDeviceGet");
  if (!attr) return 0;
  CUcontext c = NULL;
  CUdevice d;
  int maj = 0, min = 0;
  if (cur && cdev && cur(&c) == CUDA_SUCCESS && c && cdev(&d) == CUDA_SUCCESS) {
    if (attr(&maj, 75, d) == CUDA_SUCCESS && attr(&min, 76, d) == CUDA_SUCCESS) return maj * 10 + min;
    return 0;
  }
  // No current context (a context-independent library load): the lowest of all devices.
  int n = 0, best = 0;
  if (!count || !get || count(&n) != CUDA_SUCCESS) return 0;
  for (int i = 0; i < n && i < 64; i++) {
    if (get(&d, i) != CUDA_SUCCESS || attr(&maj, 75, d) != CUDA_SUCCESS || attr(&min, 76, d) != CUDA_SUCCESS) continue;
    if (!best || maj * 10 + min < best) best = maj * 10 + min;
  }
  return best;
}

// ---- finding the PTX ----
typedef struct {
  int cc, best_arch, nbest, sass_for_dev, nptx;
  fb_entry best;
} pick;
static int pick_entry(const fb_entry *e, void *arg) {
  pick *p = arg;
  if (fb_is_elf_kind(e->kind)) {
    if ((int)e->arch == p->cc) p->sass_for_dev = 1;
    return 0;
  }
  if (e->kind != FB_KIND_PTX) return 0;
  p->nptx++;
  if ((int)e->arch > p->cc) return 0;
  if ((int)e->arch > p->best_arch) {
    p->best_arch = (int)e->arch;
    p->best = *e;
    p->nbest = 1;
  } else if ((int)e->arch == p->best_arch) {
    p->nbest++;
  }
  return 0;
}

static uint8_t *slurp_fd(int fd, size_t max, size_t *len) {
  struct stat st;
  if (fstat(fd, &st) || !S_ISREG(st.st_mode) || (uint64_t)st.st_size > max) return NULL;
  uint8_t *b = malloc((size_t)st.st_size + 1);
  size_t got = 0;
  while (b && got < (size_t)st.st_size) {
    ssize_t r = read(fd, b + got, (size_t)st.st_size - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += (size_t)r;
  }
  if (!b || got != (size_t)st.st_size) {
    free(b);
    return NULL;
  }
  b[got] = 0;
  *len = got;
  return b;
}

// is_elf: an image (the app's, the helper's output or a cached entry) is an ELF file (a cubin).
static int is_elf(const char *b, size_t n) { return n >= 4 && memcmp(b, "\x7f" "ELF", 4) == 0; }

// extract_ptx returns the PTX text to instrument (malloc'd) or NULL with ks->reason.
static char *extract_ptx(const void *image, size_t known, const char *path, kinfo_set *ks, size_t *plen) {
  uint8_t *file = NULL;
  size_t flen = 0;
  if (path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      file = slurp_fd(fd, cfg.helper_max_bytes, &flen);
      close(fd);
    }
    if (!file) {
      instr_failed(ks, "instrumentation failed: module file unreadable or too large");
      return NULL;
    }
    image = file;
    known = flen;
  }
  const uint8_t *p = image;
  uint32_t magic;
  memcpy(&magic, p, 4);
  const uint8_t *fb = NULL;
  size_t fblen = 0;
  if (magic == FATBIN_WRAPPER_MAGIC) {
    const ptxmig_fatbin_wrapper *w = image;
    fb = w->data;
    fblen = fb ? fb_container_size(fb, SIZE_MAX) : 0;
  } else if (magic == FATBIN_CONTAINER_MAGIC) {
    fb = p;
    fblen = fb_container_size(p, known ? known : SIZE_MAX);
  } else if (is_elf((const char *)p, 4)) {
    // A cubin whose PTX the shim never saw compiled (instr_link_ptx): built ahead of time, or
    // JIT-compiled without the shim and loaded from a framework's disk cache.
    free(file);
    instr_failed(ks, "module has no PTX (a cubin not compiled under the shim)");
    return NULL;
  } else {
    size_t n = strnlen((const char *)p, known ? known : cfg.helper_max_bytes + 1);
    if (n > cfg.helper_max_bytes || !memmem(p, n, ".entry", 6)) {
      free(file);
      instr_failed(ks, n > cfg.helper_max_bytes ? "instrumentation failed: PTX over PTXMIG_HELPER_MAX_MB" : "module has no kernels");
      return NULL;
    }
    char *t = malloc(n + 1);
    if (t) {
      memcpy(t, p, n);
      t[n] = 0;
      *plen = n;
    } else {
      instr_failed(ks, "instrumentation failed: out of memory");
    }
    free(file);
    return t;
  }
  if (!fb || !fblen) {
    free(file);
    instr_failed(ks, "instrumentation failed: fatbin not recognised");
    return NULL;
  }
  pick pk = {.cc = device_cc()};
  if (!pk.cc) {
    free(file);
    instr_failed(ks, "instrumentation failed: device compute capability unknown");
    return NULL;
  }
  int rc = fb_walk(fb, fblen, pick_entry, &pk, NULL);
  char *t = NULL;
  if (rc < 0) {
    instr_failed(ks, "instrumentation failed: fatbin: %s", fb_strerror(rc));
  } else if (!pk.nptx) {
    instr_failed(ks, "module has no PTX");
  } else if (!pk.nbest) {
    instr_failed(ks, "module has no PTX for compute_%d or older", pk.cc);
  } else if (pk.nbest > 1) {
    instr_failed(ks, "module has %d PTX entries for compute_%d (not instrumented)", pk.nbest, pk.best_arch);
  } else if (pk.sass_for_dev && !cfg.preempt_sass) {
    instr_failed(ks, "module has SASS for this GPU (PTXMIG_PREEMPT_SASS=keep)");
  } else {
    uint8_t *out;
    size_t len;
    rc = fb_decode(&pk.best, &out, &len);
    if (rc != FB_OK) {
      instr_failed(ks, "instrumentation failed: PTX entry: %s", fb_strerror(rc));
    } else if (len > cfg.helper_max_bytes) {
      free(out);
      instr_failed(ks, "instrumentation failed: PTX over PTXMIG_HELPER_MAX_MB");
    } else {
      t = (char *)out;
      *plen = strnlen(t, len);
      t[*plen] = 0;
    }
  }
  free(file);
  return t;
}

// ---- .entry parsing: names and parameter layouts ----
static const char *skip_ws(const char *s, const char *e) {
  for (;;) {
    while (s < e && (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r')) s++;
    if (e - s >= 2 && s[0] == '/' && s[1] == '/') {
      while (s < e && *s != '\n') s++;
    } else if (e - s >= 2 && s[0] == '/' && s[1] == '*') {
      const char *c = memmem(s + 2, (size_t)(e - s - 2), "*/", 2);
      s = c ? c + 2 : e;
    } else {
      return s;
    }
  }
}
static int ident_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '$' || c == '%' || c == '.';
}
static int type_size(const char *t, size_t n) {
  if (n < 3 || t[0] != '.') return 0;
  char k = t[1];
  if (k != 'b' && k != 'u' && k != 's' && k != 'f') return 0;
  int bits = atoi(t + 2);
  return bits == 8 || bits == 16 || bits == 32 || bits == 64 || bits == 128 ? bits / 8 : 0;
}

typedef void (*entry_fn)(void *arg, const char *name, size_t nlen, const char *params, size_t plen);
// each_entry calls fn for every ".entry NAME (params)" of the PTX text.
static void each_entry(const char *t, size_t n, entry_fn fn, void *arg) {
  const char *s = t, *e = t + n;
  while (s < e) {
    const char *p = memmem(s, (size_t)(e - s), ".entry", 6);
    if (!p) break;
    s = p + 6;
    if (p > t && ident_char(p[-1])) continue;
    if (s >= e || (*s != ' ' && *s != '\t' && *s != '\n')) continue;
    const char *nm = skip_ws(s, e), *ne = nm;
    while (ne < e && ident_char(*ne)) ne++;
    if (ne == nm) continue;
    const char *q = skip_ws(ne, e);
    const char *ps = NULL, *pe = NULL;
    if (q < e && *q == '(') {
      ps = q + 1;
      pe = memchr(ps, ')', (size_t)(e - ps));
      if (!pe) break;
      s = pe + 1;
    }
    fn(arg, nm, (size_t)(ne - nm), ps, ps ? (size_t)(pe - ps) : 0);
  }
}

// param_layout parses ".param .TYPE [.ptr… ][.align N] NAME[[M]]" items; -1 when unrecognised.
static int param_layout(const char *p, size_t n, kinfo *k) {
  uint32_t off[1024], size[1024];
  int np = 0;
  uint32_t cur = 0;
  const char *s = p, *e = p + n;
  for (;;) {
    s = skip_ws(s, e);
    if (s >= e) break;
    if (np == 1024 || e - s < 6 || memcmp(s, ".param", 6) != 0) return -1;
    s += 6;
    uint32_t align = 0, elem = 0, count = 1;
    for (;;) {
      s = skip_ws(s, e);
      if (s >= e || *s != '.') break;
      const char *w = s;
      while (s < e && ident_char(*s)) s++;
      size_t wl = (size_t)(s - w);
      if (wl == 6 && memcmp(w, ".align", 6) == 0) {
        s = skip_ws(s, e);
        align = (uint32_t)strtoul(s, NULL, 10);
        while (s < e && *s >= '0' && *s <= '9') s++;
      } else if (!elem) {
        elem = (uint32_t)type_size(w, wl);
      }
    }
    const char *nm = s;
    while (s < e && ident_char(*s)) s++;
    if (s == nm || !elem) return -1;
    s = skip_ws(s, e);
    if (s < e && *s == '[') {
      count = (uint32_t)strtoul(s + 1, NULL, 10);
      const char *c = memchr(s, ']', (size_t)(e - s));
      if (!c || !count || count > 65536) return -1;
      s = c + 1;
    }
    if (!align) align = elem;
    if (align & (align - 1) || align > 256) return -1;
    cur = (cur + align - 1) & ~(align - 1);
    off[np] = cur;
    size[np] = elem * count;
    cur += elem * count;
    if (cur > 32768) return -1;
    np++;
    s = skip_ws(s, e);
    if (s < e && *s == ',') s++;
  }
  k->nparams = np;
  k->args_size = cur;
  k->off = np ? malloc((size_t)np * sizeof *k->off) : NULL;
  k->size = np ? malloc((size_t)np * sizeof *k->size) : NULL;
  if (np && (!k->off || !k->size)) {
    free(k->off);
    free(k->size);
    k->off = k->size = NULL;
    k->nparams = -1;
    return -1;
  }
  memcpy(k->off, off, (size_t)np * sizeof *off);
  memcpy(k->size, size, (size_t)np * sizeof *size);
  return 0;
}

static void add_kernel(void *arg, const char *name, size_t nlen, const char *params, size_t plen) {
  kinfo_set *ks = arg;
  if (nlen >= sizeof(PTXMIG_TWIN_SUFFIX) - 1 &&
      memcmp(name + nlen - (sizeof(PTXMIG_TWIN_SUFFIX) - 1), PTXMIG_TWIN_SUFFIX, sizeof(PTXMIG_TWIN_SUFFIX) - 1) == 0)
    return;
  if (ks->n % 16 == 0) {
    kinfo *nk = realloc(ks->k, (size_t)(ks->n + 16) * sizeof *nk);
    if (!nk) return;
    ks->k = nk;
  }
  kinfo *k = &ks->k[ks->n];
  memset(k, 0, sizeof *k);
  k->name = strndup(name, nlen);
  if (!k->name) return;
  k->nparams = -1;
  if (params) param_layout(params, plen, k);
  ks->n++;
}

typedef struct {
  kinfo_set *ks;
  const char *twin_name;
  size_t twin_len;
  int found;
} twin_find;
static void find_twin(void *arg, const char *name, size_t nlen, const char *params, size_t plen) {
  (void)params;
  (void)plen;
  twin_find *f = arg;
  if (nlen == f->twin_len && memcmp(name, f->twin_name, nlen) == 0) f->found = 1;
}

static void set_reason(void *arg, const char *name, int eligible, const char *refusal) {
  kinfo_set *ks = arg;
  for (int i = 0; i < ks->n; i++)
    if (strcmp(ks->k[i].name, name) == 0 && !ks->k[i].twin && !ks->k[i].reason && !eligible) {
      size_t n = strlen(refusal ? refusal : "") + 32;
      char *r = malloc(n);
      if (r) snprintf(r, n, "refused by ptxstate: %s", refusal ? refusal : "not eligible");
      ks->k[i].reason = r;
    }
}

// has_entry reports whether the instrumented module (PTX text or a cubin) defines kernel name: in
// PTX an ".entry name", in a cubin its code section ".text.name".
static int has_entry(const char *out, size_t outlen, const char *name, size_t nlen) {
  if (is_elf(out, outlen)) return fb_elf_has_text((const uint8_t *)out, outlen, name, nlen);
  twin_find f = {NULL, name, nlen, 0};
  each_entry(out, outlen, find_twin, &f);
  return f.found;
}

// has_kernel: the module has a kernel named name + suffix (then name_mid__ptxmig is that kernel's
// own twin, not name's mid-block one).
static int has_kernel(const kinfo_set *ks, const char *name, const char *suffix) {
  size_t n = strlen(name), s = strlen(suffix);
  for (int i = 0; i < ks->n; i++)
    if (strlen(ks->k[i].name) == n + s && strncmp(ks->k[i].name, name, n) == 0 && strcmp(ks->k[i].name + n, suffix) == 0)
      return 1;
  return 0;
}

// mark_twins sets kinfo.twin from the instrumented module and the reasons from the report (or the
// cache's .why file, same format).
static int mark_twins(kinfo_set *ks, const char *out, size_t outlen, const char *report, size_t replen) {
  int twins = 0;
  for (int i = 0; i < ks->n; i++) {
    char tn[600];
    int l = snprintf(tn, sizeof tn, "%s" PTXMIG_TWIN_SUFFIX, ks->k[i].name);
    if (l < 0 || (size_t)l >= sizeof tn) continue;
    ks->k[i].twin = has_entry(out, outlen, tn, (size_t)l);
    twins += ks->k[i].twin;
    l = snprintf(tn, sizeof tn, "%s" PTXMIG_MID_TWIN_SUFFIX, ks->k[i].name);
    ks->k[i].mid_twin = cfg.mid_block == MB_AUTO && ks->k[i].twin && l > 0 && (size_t)l < sizeof tn &&
                        has_entry(out, outlen, tn, (size_t)l) && !has_kernel(ks, ks->k[i].name, "_mid");
  }
  if (report && replen) json_kernel_report(report, replen, set_reason, ks);
  for (int i = 0; i < ks->n; i++)
    if (!ks->k[i].twin && !ks->k[i].reason) ks->k[i].reason = strdup("refused by ptxstate");
  return twins;
}

// every original entry must still be in the instrumented module (a sanity check on helper or cache)
static int entries_kept(const kinfo_set *ks, const char *out, size_t outlen) {
  for (int i = 0; i < ks->n; i++)
    if (!has_entry(out, outlen, ks->k[i].name, strlen(ks->k[i].name))) return 0;
  return 1;
}

// ---- the cache ----
// cache_dir_open opens the cache directory, creating it (0700) first when create is set; -1 when
// it is missing, unsafe or off. cache_dir creates it.
static int cache_dir_open(int create);
static int cache_dir(void) { return cache_dir_open(1); }
static int cache_dir_open(int create) {
  if (!cfg.ptx_cache[0] || strcmp(cfg.ptx_cache, "off") == 0 || cfg.ptx_cache[0] != '/') return -1;
  char p[sizeof cfg.ptx_cache];
  snprintf(p, sizeof p, "%s", cfg.ptx_cache);
  for (char *s = p + 1; create && *s; s++) {
    if (*s != '/') continue;
    *s = 0;
    mkdir(p, 0700);
    *s = '/';
  }
  if (create) mkdir(p, 0700);
  int fd = open(p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st;
  // Instrumented PTX runs inside the app: a directory others can write to is never trusted.
  if (fstat(fd, &st) || (st.st_uid != geteuid() && st.st_uid != 0) || (st.st_mode & 022)) {
    LOG_ONCE("PTX cache %s is not owned by this user or is writable by others: not used", p);
    close(fd);
    return -1;
  }
  return fd;
}

static char *cache_read(int dfd, const char *name, size_t max, size_t *len) {
  int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return NULL;
  struct stat st;
  char *b = NULL;
  if (!fstat(fd, &st) && (st.st_uid == geteuid() || st.st_uid == 0) && !(st.st_mode & 022))
    b = (char *)slurp_fd(fd, max, len);
  close(fd);
  return b;
}

static void cache_write(int dfd, const char *name, const char *data, size_t len) {
  char tmp[160];
  snprintf(tmp, sizeof tmp, ".%s.%d.%lx.tmp", name, (int)getpid(), (unsigned long)shim_now_ns());
  int fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return;
  size_t off = 0;
  while (off < len) {
    ssize_t w = write(fd, data + off, len - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) break;
    off += (size_t)w;
  }
  if (close(fd) || off != len || renameat(dfd, tmp, dfd, name)) unlinkat(dfd, tmp, 0);
}

// ---- the helper ----
typedef struct {
  char *p;
  size_t len, cap, max;
  int over;
} obuf;
static int obuf_read(int fd, obuf *b) {
  char tmp[65536];
  ssize_t r = read(fd, tmp, sizeof tmp);
  if (r < 0) return errno == EINTR || errno == EAGAIN ? 1 : -1;
  if (r == 0) return 0;
  if (b->len + (size_t)r > b->max) {
    b->over = 1;
    return 1;
  }
  if (b->len + (size_t)r + 1 > b->cap) {
    size_t nc = b->cap ? b->cap : 65536;
    while (nc < b->len + (size_t)r + 1) nc *= 2;
    char *np = realloc(b->p, nc);
    if (!np) {
      b->over = 1;
      return 1;
    }
    b->p = np;
    b->cap = nc;
  }
  memcpy(b->p + b->len, tmp, (size_t)r);
  b->len += (size_t)r;
  b->p[b->len] = 0;
  return 1;
}

// run_helper feeds ptx to the helper; 0 with *out/*rep filled, or -1 with ks->reason.
// cc (the device's compute capability, 0 if unknown) makes the helper cap each twin's registers
// so that it fits as many CTAs per SM as its original (--match-registers sm_NN; needs ptxas where
// the helper runs, and instruments without the caps otherwise).
static int run_helper(const char *ptx, size_t len, obuf *out, obuf *rep, kinfo_set *ks, int cc) {
  if (!cfg.helper[0]) {
    instr_failed(ks, "instrumentation failed: no helper (PTXMIG_HELPER unset) and not in the cache");
    return -1;
  }
  if (atomic_load(&helper_broken)) {
    instr_failed(ks, "instrumentation failed: helper disabled after earlier failures");
    return -1;
  }
  int in[2] = {-1, -1}, po[2] = {-1, -1}, pe[2] = {-1, -1};
  // stdin is a socket so that writing to a helper that died raises no SIGPIPE (MSG_NOSIGNAL).
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, in) || pipe2(po, O_CLOEXEC) || pipe2(pe, O_CLOEXEC)) {
    instr_failed(ks, "instrumentation failed: pipe: %s", strerror(errno));
    for (int i = 0; i < 2; i++) {
      if (in[i] >= 0) close(in[i]);
      if (po[i] >= 0) close(po[i]);
      if (pe[i] >= 0) close(pe[i]);
    }
    return -1;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[1], 0);
  posix_spawn_file_actions_adddup2(&fa, po[1], 1);
  posix_spawn_file_actions_adddup2(&fa, pe[1], 2);
  posix_spawnattr_t at;
  posix_spawnattr_init(&at);
  sigset_t none, def;
  sigemptyset(&none);
  sigemptyset(&def);
  sigaddset(&def, SIGPIPE);
  sigaddset(&def, SIGCHLD);
  sigaddset(&def, SIGINT);
  sigaddset(&def, SIGTERM);
  posix_spawnattr_setsigmask(&at, &none);
  posix_spawnattr_setsigdefault(&at, &def);
  posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  // The helper gets the app's environment without LD_PRELOAD (it is not a CUDA program).
  size_t ne = 0;
  while (environ && environ[ne]) ne++;
  char **env = calloc(ne + 1, sizeof *env);
  size_t k = 0;
  for (size_t i = 0; env && i < ne; i++)
    if (strncmp(environ[i], "LD_PRELOAD=", 11) != 0) env[k++] = environ[i];
  char arch[16];
  snprintf(arch, sizeof arch, "sm_%d", cc);
  char *argv[16] = {cfg.helper, "ptx", "instrument", "--report", "--json"};
  int na = 5;
  if (cfg.mid_block == MB_ON) argv[na++] = "--mid-block";
  if (cfg.mid_block == MB_AUTO) argv[na++] = "--mid-block-twins";
  if (cc > 0) {
    argv[na++] = "--match-registers";
    argv[na++] = arch;
    if (cfg.ptx_cubin) argv[na++] = "--cubin";
  }
  argv[na++] = "-o";
  argv[na++] = "-";
  argv[na++] = "-";  // flags before the file argument; argv[na] stays NULL
  pid_t pid = -1;
  int e = env ? posix_spawn(&pid, cfg.helper, &fa, &at, argv, env) : ENOMEM;
  free(env);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&at);
  close(in[1]);
  close(po[1]);
  close(pe[1]);
  atomic_fetch_add(&st_helper_runs, 1);
  if (e) {
    close(in[0]);
    close(po[0]);
    close(pe[0]);
    if (e == ENOENT || e == EACCES || e == ENOEXEC) atomic_store(&helper_broken, 1);
    instr_failed(ks, "instrumentation failed: cannot run %s: %s", cfg.helper, strerror(e));
    return -1;
  }
  fcntl(in[0], F_SETFL, O_NONBLOCK);
  uint64_t deadline = shim_now_ns() + (uint64_t)cfg.helper_timeout_ms * 1000000ull;
  size_t sent = 0;
  int open_out = 1, open_err = 1, timed_out = 0, failed = 0;
  int sfd = in[0];
  while (open_out || open_err) {
    struct pollfd pf[3];
    int np = 0, io = -1, ie = -1, is = -1;
    if (open_out) pf[io = np++] = (struct pollfd){.fd = po[0], .events = POLLIN};
    if (open_err) pf[ie = np++] = (struct pollfd){.fd = pe[0], .events = POLLIN};
    if (sfd >= 0) pf[is = np++] = (struct pollfd){.fd = sfd, .events = POLLOUT};
    uint64_t now = shim_now_ns();
    if (now >= deadline) {
      timed_out = 1;
      break;
    }
    uint64_t left_ms = (deadline - now) / 1000000 + 1;
    int r = poll(pf, (nfds_t)np, left_ms > 1000 ? 1000 : (int)left_ms);
    if (r < 0 && errno != EINTR) {
      failed = 1;
      break;
    }
    if (r <= 0) continue;
    if (is >= 0 && pf[is].revents) {
      ssize_t w = send(sfd, ptx + sent, len - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) sent += (size_t)w;
      if ((w < 0 && errno != EAGAIN && errno != EINTR) || sent == len) {
        close(sfd);
        sfd = -1;
      }
    }
    if (io >= 0 && pf[io].revents && obuf_read(po[0], out) <= 0) open_out = 0;
    if (ie >= 0 && pf[ie].revents && obuf_read(pe[0], rep) <= 0) open_err = 0;
  }
  if (sfd >= 0) close(sfd);
  close(po[0]);
  close(pe[0]);
  if (timed_out || failed) kill(pid, SIGKILL);
  int status = 0;
  pid_t w;
  while ((w = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
  }
  // ECHILD: the app reaps children itself (SIGCHLD ignored, or a waitpid(-1) loop); the output
  // is then judged on its own (complete, every entry kept) by the caller.
  int status_known = w == pid;
  if (timed_out) {
    instr_failed(ks, "instrumentation failed: helper timed out after %u ms", cfg.helper_timeout_ms);
    return -1;
  }
  if (failed || out->over || sent != len) {
    instr_failed(ks, "instrumentation failed: helper I/O (output over the limit or input not consumed)");
    return -1;
  }
  if (status_known && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    // The error text is the report's stderr; keep its first line.
    char msg[120] = "";
    if (rep->p) {
      size_t l = strcspn(rep->p, "\n");
      snprintf(msg, sizeof msg, "%.*s", (int)(l < 100 ? l : 100), rep->p);
    }
    instr_failed(ks, "instrumentation failed: helper exit %d%s%s", WIFEXITED(status) ? WEXITSTATUS(status) : -1,
                 msg[0] ? ": " : "", msg);
    return -1;
  }
  if (!out->p || !out->len) {
    instr_failed(ks, "instrumentation failed: helper wrote no PTX");
    return -1;
  }
  return 0;
}

void kinfo_set_free(kinfo_set *ks) {
  for (int i = 0; i < ks->n; i++) {
    free(ks->k[i].name);
    free(ks->k[i].reason);
    free(ks->k[i].off);
    free(ks->k[i].size);
  }
  free(ks->k);
  ks->k = NULL;
  ks->n = 0;
  ks->instrumented = 0;
}

// helper_id identifies the helper binary (size and modification time): a cache entry written by
// another ptxmig (another ptxstate) is not used while a helper is configured.
static void helper_id(char out[64]) {
  struct stat st;
  out[0] = 0;
  if (cfg.helper[0] && stat(cfg.helper, &st) == 0)
    snprintf(out, 64, "%lld-%lld.%09ld", (long long)st.st_size, (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
}

// cache_read_kind reads a cached module that must be a cubin (elf) or PTX text (!elf): an entry of
// the other kind under that name is a miss.
static char *cache_read_kind(int dfd, const char *name, int elf, size_t *len) {
  char *b = cache_read(dfd, name, cfg.helper_max_bytes, len);
  if (b && is_elf(b, *len) != elf) {
    free(b);
    b = NULL;
  }
  return b;
}

// why_text renders the refusals as a report the cache keeps beside the PTX (same JSON shape, plus
// "helper": the helper_id that produced it).
static char *why_text(const kinfo_set *ks, size_t *len) {
  jbuf b = {0};
  char id[64];
  helper_id(id);
  jb_s(&b, "{\"helper\":");
  jb_str(&b, id, strlen(id));
  jb_s(&b, ",\"kernels\":[");
  for (int i = 0; i < ks->n; i++) {
    jb_printf(&b, "%s{\"name\":", i ? "," : "");
    jb_str(&b, ks->k[i].name, strlen(ks->k[i].name));
    jb_printf(&b, ",\"eligible\":%s", ks->k[i].twin ? "true" : "false");
    if (!ks->k[i].twin && ks->k[i].reason) {
      const char *r = ks->k[i].reason;
      if (strncmp(r, "refused by ptxstate: ", 21) == 0) r += 21;
      jb_s(&b, ",\"refusals\":[");
      jb_str(&b, r, strlen(r));
      jb_s(&b, "]");
    }
    jb_s(&b, "}");
  }
  jb_s(&b, "]}\n");
  if (b.oom) {
    free(b.p);
    return NULL;
  }
  *len = b.len;
  return b.p;
}

int instr_prepare(const void *image, size_t known, const char *path, char **ptx_out, kinfo_set *ks) {
  memset(ks, 0, sizeof *ks);
  *ptx_out = NULL;
  if (cfg.preempt == PM_OFF) {
    instr_failed(ks, "preempt mode off");
    return 0;
  }
  if (!image && !path) {
    instr_failed(ks, "instrumentation failed: no image");
    return 0;
  }
  size_t plen = 0;
  char *ptx = extract_ptx(image, known, path, ks, &plen);
  if (!ptx) return 0;
  each_entry(ptx, plen, add_kernel, ks);
  if (!ks->n) {
    free(ptx);
    instr_failed(ks, "module has no kernels");
    return 0;
  }
  char sha[65], name[112], cname[112], why[112];
  sha256_hex(ptx, plen, sha);
  // Per device architecture: the twins' register caps (and a cubin's code) depend on it. The
  // entry is a cubin where the helper could assemble one, else the instrumented PTX.
  int cc = device_cc();
  // Mid-block twins are another transform of the same PTX: "-m" in the name; both kinds of
  // twins (auto), "-b".
  const char *mb = cfg.mid_block == MB_ON ? "-m" : cfg.mid_block == MB_AUTO ? "-b" : "";
  snprintf(name, sizeof name, "%s-v%d%s-sm%d.ptx", sha, PTXMIG_TRANSFORM_VERSION, mb, cc);
  snprintf(cname, sizeof cname, "%s-v%d%s-sm%d.cubin", sha, PTXMIG_TRANSFORM_VERSION, mb, cc);
  snprintf(why, sizeof why, "%s-v%d%s-sm%d.why", sha, PTXMIG_TRANSFORM_VERSION, mb, cc);
  int dfd = cache_dir();
  size_t outlen = 0, wlen = 0;
  char *out = dfd >= 0 && cfg.ptx_cubin && cc > 0 ? cache_read_kind(dfd, cname, 1, &outlen) : NULL;
  if (!out && dfd >= 0) out = cache_read_kind(dfd, name, 0, &outlen);
  char *w = out ? cache_read(dfd, why, 16u << 20, &wlen) : NULL;
  if (out && cfg.helper[0]) {
    // With a helper configured, only entries that same helper binary wrote are used.
    char id[64], want[96];
    helper_id(id);
    snprintf(want, sizeof want, "{\"helper\":\"%s\",", id);
    if (!id[0] || !w || strncmp(w, want, strlen(want)) != 0) {
      free(out);
      out = NULL;
    }
  }
  if (out && entries_kept(ks, out, outlen)) {
    atomic_fetch_add(&st_hits, 1);
    mark_twins(ks, out, outlen, w, wlen);
    free(w);
  } else {
    free(w);
    free(out);
    out = NULL;
    atomic_fetch_add(&st_misses, 1);
    obuf o = {.max = cfg.helper_max_bytes}, r = {.max = 16u << 20};
    uint64_t t0 = shim_now_ns();
    int rc = run_helper(ptx, plen, &o, &r, ks, cc);
    atomic_fetch_add(&st_helper_ns, shim_now_ns() - t0);
    if (rc == 0 && !entries_kept(ks, o.p, o.len)) {
      instr_failed(ks, "instrumentation failed: helper output lacks the original kernels");
      rc = -1;
    }
    if (rc) {
      atomic_fetch_add(&st_helper_failures, 1);
      if (atomic_fetch_add(&helper_fail_streak, 1) + 1 >= 8 && !atomic_exchange(&helper_broken, 1))
        shim_log("instrumentation: 8 helper failures in a row; helper disabled");
      static atomic_int logged;  // the first few failures are logged, then they are only counted
      if (atomic_fetch_add(&logged, 1) < 4) shim_log("%s (original module loaded)", ks->reason);
      free(o.p);
      free(r.p);
      free(ptx);
      if (dfd >= 0) close(dfd);
      char keep[sizeof ks->reason];
      memcpy(keep, ks->reason, sizeof keep);
      kinfo_set_free(ks);
      memcpy(ks->reason, keep, sizeof keep);
      return 0;
    }
    atomic_store(&helper_fail_streak, 0);
    out = o.p;
    outlen = o.len;
    mark_twins(ks, out, outlen, r.over ? NULL : r.p, r.over ? 0 : r.len);
    if (dfd >= 0) {
      char *wt = why_text(ks, &wlen);
      if (wt) cache_write(dfd, why, wt, wlen);  // the .why first: the .ptx or .cubin is the commit
      free(wt);
      cache_write(dfd, is_elf(out, outlen) ? cname : name, out, outlen);
    }
    free(r.p);
  }
  if (dfd >= 0) close(dfd);
  free(ptx);
  int twins = 0;
  for (int i = 0; i < ks->n; i++) twins += ks->k[i].twin;
  if (!twins) {
    // Nothing to gain: load the original (no JIT of PTX where SASS would have loaded).
    free(out);
    instr_failed(ks, "no kernel of the module is eligible");
    return 0;
  }
  ks->instrumented = 1;
  *ptx_out = out;
  return 1;
}

// ---- JIT-compiled modules ----
// CuPy and Numba compile to PTX (NVRTC, NVVM), then to a cubin (NVRTC itself, the driver's link:
// cuLinkAddData + cuLinkComplete, or nvJitLink) and load that cubin, often from a copy made
// before the link is destroyed: the module holds no PTX, so it would get no twins. The shim keeps
// the PTX each such cubin came from, keyed by the cubin's hash: a link whose only input is one
// PTX keeps a copy of that PTX and, once complete, the cubin's hash; NVRTC's cubins come with
// their program's PTX (jit.c, instr_jit_cubin). A module loaded from a cubin with a known hash (the
// link's buffer or any copy of it) is instrumented from the PTX, which holds the same kernels. A
// link with anything else (a library, a cubin, several PTX inputs) leaves its module as it is.
// The last MAX_LINKS are remembered, and each is also written to the PTX cache as
// <cubin sha>.jit-v1.ptx: frameworks cache their cubins on disk (CuPy's kernel cache) and load them
// in later runs without compiling, and the cache finds their PTX again.
#define MAX_LINKS 64
#define MAX_LINK_PTX (64u << 20)
typedef struct linkrec {
  void *state;  // while the link is open (NULL once destroyed)
  char *ptx;    // the one PTX input (NUL-terminated), NULL once the link has any other
  size_t len;
  int inputs;
  int complete;
  char sha[65];  // the cubin's, once complete
} linkrec;
static linkrec links[MAX_LINKS];
static unsigned link_next;     // the slot a new link takes when none is free (round robin)
static atomic_int links_done;  // completed links with a PTX: module loads look only then
static pthread_mutex_t link_mu = PTHREAD_MUTEX_INITIALIZER;

static linkrec *link_find_locked(void *state) {
  for (int i = 0; i < MAX_LINKS; i++)
    if (links[i].state == state) return &links[i];
  return NULL;
}

static void link_clear_locked(linkrec *l) {
  if (l->complete && l->ptx) atomic_fetch_sub(&links_done, 1);
  free(l->ptx);
  *l = (linkrec){0};
}

// link_slot_locked: an unused slot (all zero), else the oldest, cleared (round robin). A kept
// record (a complete link or a JIT cubin's PTX, its state NULL) is not unused.
static linkrec *link_slot_locked(void) {
  for (int i = 0; i < MAX_LINKS; i++)
    if (!links[i].state && !links[i].ptx && !links[i].complete && !links[i].inputs) return &links[i];
  linkrec *l = &links[link_next++ % MAX_LINKS];
  link_clear_locked(l);
  return l;
}

char *instr_read_file(const char *path, size_t max, size_t *len) {
  int fd = path ? open(path, O_RDONLY | O_CLOEXEC) : -1;
  if (fd < 0) return NULL;
  struct stat st;
  char *buf = NULL;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0 && (size_t)st.st_size < max &&
      (buf = malloc((size_t)st.st_size + 1))) {
    size_t got = 0;
    while (got < (size_t)st.st_size) {
      ssize_t n = read(fd, buf + got, (size_t)st.st_size - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += (size_t)n;
    }
    if (got != (size_t)st.st_size) {
      free(buf);
      buf = NULL;
    } else {
      buf[got] = 0;
      *len = got;
    }
  }
  close(fd);
  return buf;
}

void instr_link_input(void *state, int type, const void *data, size_t size, const char *path) {
  if (!state) return;
  char *ptx = NULL;
  size_t len = 0;
  if (type == JIT_INPUT_PTX) {  // copied outside the lock
    if (data && size > 0 && size < MAX_LINK_PTX && (ptx = malloc(size + 1))) {
      memcpy(ptx, data, size);
      ptx[size] = 0;
      len = strlen(ptx);
    } else if (!data && path) {
      ptx = instr_read_file(path, MAX_LINK_PTX, &len);
    }
  }
  pthread_mutex_lock(&link_mu);
  linkrec *l = link_find_locked(state);
  if (!l) *(l = link_slot_locked()) = (linkrec){.state = state};
  l->inputs++;
  if (l->inputs == 1 && ptx) {
    l->ptx = ptx;
    l->len = len;
    ptx = NULL;
  } else if (l->ptx) {  // a second input: the cubin is no longer the PTX's alone
    free(l->ptx);
    l->ptx = NULL;
  }
  pthread_mutex_unlock(&link_mu);
  free(ptx);
}

// The cache's JIT entries: <cubin sha>.jit-v<this>.ptx. Bump to invalidate them all.
#define JIT_CACHE_VERSION "1"

// jit_persist writes <sha>.jit-v1.ptx into the PTX cache (when there is one) unless it is there.
static void jit_persist(const char *sha, const char *ptx, size_t len) {
  int dfd = cache_dir();
  if (dfd < 0) return;
  char name[80];
  snprintf(name, sizeof name, "%s.jit-v" JIT_CACHE_VERSION ".ptx", sha);
  struct stat st;
  if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) cache_write(dfd, name, ptx, len);
  close(dfd);
}

// jit_sha hashes the ELF at cubin, the key of a JIT record for both its recording and its lookup
// (its extent from its own headers, at most size bytes), and returns that extent; 0: not an ELF.
static size_t jit_sha(const void *cubin, size_t size, char sha[65]) {
  const uint8_t *p = cubin;
  if (!p || size < 4 || !is_elf(cubin, size)) return 0;
  size_t n = fb_elf_size(p, size);
  if (n) sha256_hex(p, n, sha);
  return n;
}

void instr_link_complete(void *state, const void *cubin, size_t size) {
  char sha[65];
  if (!jit_sha(cubin, size, sha)) return;  // outside the lock
  char *ptx = NULL;
  size_t len = 0;
  pthread_mutex_lock(&link_mu);
  linkrec *l = state ? link_find_locked(state) : NULL;
  if (l && l->ptx && !l->complete) {
    memcpy(l->sha, sha, sizeof sha);
    l->complete = 1;
    atomic_fetch_add(&links_done, 1);
    if ((ptx = malloc(l->len))) memcpy(ptx, l->ptx, len = l->len);
  }
  pthread_mutex_unlock(&link_mu);
  if (ptx) jit_persist(sha, ptx, len);
  free(ptx);
}

void instr_jit_cubin(const void *cubin, size_t size, const char *ptx, size_t len) {
  char sha[65];
  if (!ptx || !len || len >= MAX_LINK_PTX || !jit_sha(cubin, size, sha)) return;
  char *copy = malloc(len + 1);
  if (!copy) return;
  memcpy(copy, ptx, len);
  copy[len] = 0;
  len = strlen(copy);  // NVRTC's size counts the terminating NUL
  if (!len) {
    free(copy);
    return;
  }
  pthread_mutex_lock(&link_mu);
  linkrec *l = link_slot_locked();
  *l = (linkrec){.ptx = copy, .len = len, .inputs = 1, .complete = 1};
  memcpy(l->sha, sha, sizeof sha);
  atomic_fetch_add(&links_done, 1);
  pthread_mutex_unlock(&link_mu);
  jit_persist(sha, ptx, len);
}

void instr_link_destroy(void *state) {
  pthread_mutex_lock(&link_mu);
  linkrec *l = state ? link_find_locked(state) : NULL;
  if (l && l->complete && l->ptx) {
    l->state = NULL;  // its cubin may still be loaded from a copy: keep the PTX
  } else if (l) {
    link_clear_locked(l);
  }
  pthread_mutex_unlock(&link_mu);
}

// missing_fn (fb_elf_each_text): 1 when the cubin's function name is nowhere in the PTX.
typedef struct {
  const char *ptx;
  size_t len;
  const char *name;
  size_t nlen;
} cubin_fns;
static int missing_fn(void *arg, const char *name, size_t nlen) {
  cubin_fns *c = arg;
  for (const char *s = c->ptx, *e = c->ptx + c->len; s < e && (s = memmem(s, (size_t)(e - s), name, nlen)); s++) {
    char after = s + nlen < e ? s[nlen] : 0;  // the whole identifier, not a prefix of another
    char before = s > c->ptx ? s[-1] : ' ';
    if (!ident_char(after) && !ident_char(before)) return 0;
  }
  c->name = name, c->nlen = nlen;
  return 1;
}

char *instr_link_ptx(const void *image) {
  const uint8_t *p = image;
  char sha[65], *out = NULL;
  // The same key as the recording side's: the ELF's extent from its own headers, hashed.
  size_t size = p && cfg.preempt != PM_OFF ? jit_sha(image, SIZE_MAX, sha) : 0;
  if (!size) return NULL;
  if (atomic_load(&links_done)) {
    pthread_mutex_lock(&link_mu);
    for (int i = 0; i < MAX_LINKS; i++) {
      if (links[i].complete && links[i].ptx && strcmp(links[i].sha, sha) == 0) {
        out = strndup(links[i].ptx, links[i].len);
        break;
      }
    }
    pthread_mutex_unlock(&link_mu);
  }
  if (!out) {  // compiled in an earlier run, loaded from a framework's own cache
    int dfd = cache_dir_open(0);
    if (dfd >= 0) {
      char name[80];
      size_t len = 0;
      snprintf(name, sizeof name, "%s.jit-v" JIT_CACHE_VERSION ".ptx", sha);
      out = cache_read(dfd, name, MAX_LINK_PTX, &len);
      close(dfd);
      if (out && (len == 0 || memchr(out, 0, len))) {  // not text: not ours
        free(out);
        out = NULL;
      }
      if (out && cfg.debug) shim_log("jit: cubin %.12s: PTX from the cache (%zu bytes)", sha, len);
    }
  }
  // Every function of the cubin must be in the PTX: instrumented PTX without one of them would
  // load without it, and the app's lookup of that kernel would fail.
  cubin_fns c = {out, out ? strlen(out) : 0, NULL, 0};
  if (out && fb_elf_each_text(p, size, missing_fn, &c) > 0) {
    LOG_ONCE("jit: a cubin's PTX lacks its function %.*s: the cubin loads as it is (no twins)", (int)c.nlen, c.name);
    free(out);
    out = NULL;
  }
  return out;
}

// A child forked while another thread held link_mu would wait on it forever.
static void atfork_child(void) {
  pthread_mutex_init(&link_mu, NULL);  // held by another thread of the parent, perhaps
  memset(links, 0, sizeof links);      // (the parent's copies leak in the child)
  atomic_store(&links_done, 0);
}
__attribute__((constructor)) static void instr_fork_init(void) { pthread_atfork(NULL, NULL, atfork_child); }
