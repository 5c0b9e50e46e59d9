// Tracking: contexts, module images, functions, allocations and launches, plus the reports the
// control socket serves. Bookkeeping never fails a CUDA call: on any internal failure (out of
// memory, table full) the record is skipped and the failure logged once.
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base.h"
#include "fatbin.h"
#include "json.h"
#include "sha256.h"
#include "track.h"

static const char *const alloc_kind_names[AK_COUNT] = {"device", "pitch", "async", "managed", "host_pinned",
                                                "vmm_physical", "vmm_mapped", "owned"};
static const char *const module_source_names[MS_COUNT] = {
    "__cudaRegisterFatBinary", "cuModuleLoad",      "cuModuleLoadData",      "cuModuleLoadDataEx",
    "cuModuleLoadFatBinary",   "cuLibraryLoadData", "cuLibraryLoadFromFile", "cuLinkComplete"};

// ---- pointer-keyed open-addressing map (keys 0 and ~0 reserved) ----
#define PM_EMPTY 0
#define PM_TOMB UINT64_MAX
typedef struct {
  uint64_t *keys;
  uint64_t *vals;
  size_t cap, n, used;  // used counts tombstones too
} pmap;

static size_t pm_hash(uint64_t k, size_t cap) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return (size_t)k & (cap - 1);
}
static int pm_grow(pmap *m) {
  size_t ncap = m->cap ? m->cap * 2 : 64;
  if (m->n * 4 < m->cap) ncap = m->cap;  // mostly tombstones: rehash in place size
  uint64_t *nk = calloc(ncap, sizeof *nk), *nv = calloc(ncap, sizeof *nv);
  if (!nk || !nv) {
    free(nk);
    free(nv);
    return -1;
  }
  for (size_t i = 0; i < m->cap; i++) {
    uint64_t k = m->keys[i];
    if (k == PM_EMPTY || k == PM_TOMB) continue;
    size_t j = pm_hash(k, ncap);
    while (nk[j] != PM_EMPTY) j = (j + 1) & (ncap - 1);
    nk[j] = k;
    nv[j] = m->vals[i];
  }
  free(m->keys);
  free(m->vals);
  m->keys = nk;
  m->vals = nv;
  m->cap = ncap;
  m->used = m->n;
  return 0;
}
static uint64_t *pm_find(pmap *m, uint64_t k) {
  if (!m->cap || k == PM_EMPTY || k == PM_TOMB) return NULL;
  for (size_t i = pm_hash(k, m->cap), probes = 0; probes < m->cap; i = (i + 1) & (m->cap - 1), probes++) {
    if (m->keys[i] == PM_EMPTY) return NULL;
    if (m->keys[i] == k) return &m->vals[i];
  }
  return NULL;
}
static int pm_put(pmap *m, uint64_t k, uint64_t v) {
  if (k == PM_EMPTY || k == PM_TOMB) return -1;
  uint64_t *p = pm_find(m, k);
  if (p) {
    *p = v;
    return 0;
  }
  if ((m->used + 1) * 4 > m->cap * 3 && pm_grow(m)) return -1;
  size_t i = pm_hash(k, m->cap);
  while (m->keys[i] != PM_EMPTY && m->keys[i] != PM_TOMB) i = (i + 1) & (m->cap - 1);
  if (m->keys[i] == PM_EMPTY) m->used++;
  m->keys[i] = k;
  m->vals[i] = v;
  m->n++;
  return 0;
}
static int pm_del(pmap *m, uint64_t k, uint64_t *old) {
  uint64_t *p = pm_find(m, k);
  if (!p) return -1;
  if (old) *old = *p;
  m->keys[p - m->vals] = PM_TOMB;
  m->n--;
  return 0;
}

static uint64_t start_ns;
__attribute__((constructor)) static void track_init(void) { start_ns = shim_now_ns(); }

// ---- allocations ----
static pthread_mutex_t alloc_mu = PTHREAD_MUTEX_INITIALIZER;
static pmap allocs;   // device-address space: value = size << 4 | kind
static pmap handles;  // VMM physical allocation handles
static struct {
  uint64_t count, bytes, peak_bytes;
} totals[AK_COUNT];

void trk_alloc_add(uint64_t key, uint64_t size, int kind) {
  if (kind < 0 || kind >= AK_COUNT || size >= (1ull << 59)) return;
  pthread_mutex_lock(&alloc_mu);
  pmap *m = kind == AK_VMM_PHYS ? &handles : &allocs;
  uint64_t old;
  if (pm_del(m, key, &old) == 0) {  // a reused address we missed the free of
    totals[old & 15].count--;
    totals[old & 15].bytes -= old >> 4;
  }
  if (pm_put(m, key, size << 4 | (uint64_t)kind) == 0) {
    totals[kind].count++;
    totals[kind].bytes += size;
    if (totals[kind].bytes > totals[kind].peak_bytes) totals[kind].peak_bytes = totals[kind].bytes;
  } else {
    LOG_ONCE("allocation table: out of memory; some allocations are not tracked");
  }
  pthread_mutex_unlock(&alloc_mu);
}

// largest_device_alloc: the size of the largest live cuMemAlloc (or pitched) allocation. Driver
// 580 cannot enable peer access to a context holding one larger than 256 MiB after a restore
// (status "largest_device_alloc"; ptxmig refuses such a process with peer links).
static uint64_t largest_device_alloc(void) {
  uint64_t big = 0;
  pthread_mutex_lock(&alloc_mu);
  for (size_t i = 0; i < allocs.cap; i++) {
    uint64_t k = allocs.keys[i], v = allocs.vals[i];
    if (k == PM_EMPTY || k == PM_TOMB) continue;
    if (((v & 15) == AK_DEVICE || (v & 15) == AK_PITCH) && v >> 4 > big) big = v >> 4;
  }
  pthread_mutex_unlock(&alloc_mu);
  return big;
}

void trk_alloc_remove(uint64_t key, int kind) {
  pthread_mutex_lock(&alloc_mu);
  pmap *m = kind == AK_VMM_PHYS ? &handles : &allocs;
  uint64_t old;
  if (pm_del(m, key, &old) == 0) {
    totals[old & 15].count--;
    totals[old & 15].bytes -= old >> 4;
  }
  pthread_mutex_unlock(&alloc_mu);
}

void trk_vmm_unmap(uint64_t ptr, uint64_t size) {
  pthread_mutex_lock(&alloc_mu);
  for (size_t i = 0; i < allocs.cap; i++) {
    uint64_t k = allocs.keys[i], v = allocs.vals[i];
    if (k == PM_EMPTY || k == PM_TOMB || (v & 15) != AK_VMM_MAP) continue;
    if (k >= ptr && k - ptr < size) {
      allocs.keys[i] = PM_TOMB;
      allocs.n--;
      totals[AK_VMM_MAP].count--;
      totals[AK_VMM_MAP].bytes -= v >> 4;
    }
  }
  pthread_mutex_unlock(&alloc_mu);
}

// ---- cross-process GPU memory sharing (status "ipc") ----
// Memory of this process that another process may map (exports) and memory of another process
// this process maps (imports), as far as the calls the shim sees tell (docs/SHIM-PROTOCOL.md,
// "ipc"). share_mu guards these tables only, for memory work: never held across a driver call.
static pthread_mutex_t share_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int share_any;     // something was ever exported or imported: frees look it up
static const char *const share_kind_names[SK_COUNT] = {"ipc_mem", "vmm", "pool", "pool_ptr"};
// Exports and imports other than VMM handles, by key (allocation base, opened pointer, pool,
// pool pointer); the value of an opened CUDA IPC pointer counts its opens not yet closed (the
// driver returns the same pointer again and counts references), the others are 1.
static pmap sh_exp[SK_COUNT], sh_imp[SK_COUNT];
// A VMM handle exported or imported: SV_EXPORTED | SV_IMPORTED | holds << 8, where holds counts
// the references this process has on it (the create or import, retains) not yet released. It
// stays shared while held or mapped: memory mapped stays alive after its handle is released.
#define SV_EXPORTED 1ull
#define SV_IMPORTED 2ull
static pmap sh_vmm;
static long sh_vmm_n[2];         // handles in sh_vmm exported, imported
// Every cuMemMap mapping (of any handle: one may be exported after it was mapped): address ->
// handle and size; and per handle, its mappings.
static pmap vm_handle, vm_size, vm_count;
static int vm_incomplete;        // a mapping went unrecorded: released shared handles stay counted
static unsigned long sh_calls[2], sh_lost[2];  // successful export/import calls; records lost (no memory)

static void sh_vmm_settle(uint64_t h) {  // share_mu held: forget h once neither held nor mapped
  uint64_t *v = pm_find(&sh_vmm, h);
  if (!v || *v >> 8 || vm_incomplete || pm_find(&vm_count, h)) return;
  if (*v & SV_EXPORTED) sh_vmm_n[0]--;
  if (*v & SV_IMPORTED) sh_vmm_n[1]--;
  pm_del(&sh_vmm, h, NULL);
}

// share_add records one export (dir 0) or import (dir 1); -1 when out of memory.
static int share_add(int dir, int kind, uint64_t key) {
  if (kind == SK_VMM) {
    uint64_t flag = dir ? SV_IMPORTED : SV_EXPORTED;
    uint64_t *v = pm_find(&sh_vmm, key), old = v ? *v : 0;
    // an export holds the reference the handle already is; each import returns one more
    uint64_t holds = (old >> 8) + (dir || !v ? 1 : 0);
    if (pm_put(&sh_vmm, key, holds << 8 | (old & 3) | flag)) return -1;
    if (!(old & flag)) sh_vmm_n[dir]++;
    return 0;
  }
  pmap *m = dir ? &sh_imp[kind] : &sh_exp[kind];
  uint64_t *v = pm_find(m, key);
  if (v && kind == SK_IPC_MEM && dir) return ++*v, 0;
  return v ? 0 : pm_put(m, key, 1);
}
static void share_note(int dir, int kind, uint64_t key) {
  if (kind < 0 || kind >= SK_COUNT) return;
  pthread_mutex_lock(&share_mu);
  sh_calls[dir]++;
  int lost = share_add(dir, kind, key) != 0;
  if (lost) sh_lost[dir]++;  // counted for good: never under-report
  atomic_store(&share_any, 1);
  pthread_mutex_unlock(&share_mu);
  if (lost) LOG_ONCE("sharing table: out of memory; an export or import stays counted for good");
}
void trk_share_export(int kind, uint64_t key) { share_note(0, kind, key); }
void trk_share_import(int kind, uint64_t key) { share_note(1, kind, key); }

void trk_share_ipc_close(uint64_t ptr) {
  if (!atomic_load(&share_any)) return;
  pthread_mutex_lock(&share_mu);
  uint64_t *v = pm_find(&sh_imp[SK_IPC_MEM], ptr);
  if (v && --*v == 0) pm_del(&sh_imp[SK_IPC_MEM], ptr, NULL);
  pthread_mutex_unlock(&share_mu);
}
// A freed allocation is no longer exported (its IPC export or its pool pointer export), and a
// freed imported pool pointer no longer imported.
void trk_share_free(uint64_t ptr) {
  if (!atomic_load(&share_any)) return;
  pthread_mutex_lock(&share_mu);
  pm_del(&sh_exp[SK_IPC_MEM], ptr, NULL);
  pm_del(&sh_exp[SK_POOL_PTR], ptr, NULL);
  pm_del(&sh_imp[SK_POOL_PTR], ptr, NULL);
  pthread_mutex_unlock(&share_mu);
}
void trk_share_pool_destroy(uint64_t pool) {
  if (!atomic_load(&share_any)) return;
  pthread_mutex_lock(&share_mu);
  pm_del(&sh_exp[SK_POOL], pool, NULL);
  pm_del(&sh_imp[SK_POOL], pool, NULL);
  pthread_mutex_unlock(&share_mu);
}

static void vm_unmap_one(uint64_t ptr) {  // share_mu held; ptr is a recorded mapping
  uint64_t h = 0, *c;
  pm_del(&vm_handle, ptr, &h);
  pm_del(&vm_size, ptr, NULL);
  if ((c = pm_find(&vm_count, h)) && --*c == 0) pm_del(&vm_count, h, NULL);
  sh_vmm_settle(h);
}
void trk_share_map(uint64_t ptr, uint64_t size, uint64_t handle) {
  pthread_mutex_lock(&share_mu);
  if (pm_find(&vm_size, ptr)) vm_unmap_one(ptr);  // a mapping whose unmap went unseen
  uint64_t *c = pm_find(&vm_count, handle);
  int bad = pm_put(&vm_handle, ptr, handle) != 0;
  if (!bad && pm_put(&vm_size, ptr, size ? size : 1)) bad = 1, pm_del(&vm_handle, ptr, NULL);
  if (!bad && !c && pm_put(&vm_count, handle, 0)) bad = 1, pm_del(&vm_handle, ptr, NULL), pm_del(&vm_size, ptr, NULL);
  if (!bad) ++*pm_find(&vm_count, handle);
  else vm_incomplete = 1;
  pthread_mutex_unlock(&share_mu);
  if (bad) LOG_ONCE("mapping table: out of memory; released shared VMM handles stay counted");
}
// cuMemUnmap takes whole mappings, one or several adjacent ones: walked from ptr; a range that
// does not start at a recorded mapping (or has gaps) is searched.
void trk_share_unmap(uint64_t ptr, uint64_t size) {
  uint64_t end = ptr + size < ptr ? UINT64_MAX : ptr + size, cur = ptr, *n;
  pthread_mutex_lock(&share_mu);
  while (cur < end && (n = pm_find(&vm_size, cur))) {
    uint64_t next = cur + *n;
    vm_unmap_one(cur);
    if (next <= cur) break;
    cur = next;
  }
  for (size_t i = 0; cur < end && i < vm_size.cap && vm_size.n; i++) {
    uint64_t k = vm_size.keys[i];
    if (k != PM_EMPTY && k != PM_TOMB && k >= cur && k < end) vm_unmap_one(k);  // marks tombstones only
  }
  pthread_mutex_unlock(&share_mu);
}
void trk_share_retain(uint64_t handle) {
  if (!atomic_load(&share_any)) return;
  pthread_mutex_lock(&share_mu);
  uint64_t *v = pm_find(&sh_vmm, handle);
  if (v) *v += 1ull << 8;
  pthread_mutex_unlock(&share_mu);
}
void trk_share_release(uint64_t handle) {
  if (!atomic_load(&share_any)) return;
  pthread_mutex_lock(&share_mu);
  uint64_t *v = pm_find(&sh_vmm, handle);
  if (v && *v >> 8) *v -= 1ull << 8;
  sh_vmm_settle(handle);
  pthread_mutex_unlock(&share_mu);
}

static void share_counts_locked(long exp[SK_COUNT], long imp[SK_COUNT]) {
  for (int k = 0; k < SK_COUNT; k++) {
    exp[k] = k == SK_VMM ? sh_vmm_n[0] : (long)sh_exp[k].n;
    imp[k] = k == SK_VMM ? sh_vmm_n[1] : (long)sh_imp[k].n;
  }
}
static void report_share(jbuf *b) {
  long exp[SK_COUNT], imp[SK_COUNT], te = 0, ti = 0;
  unsigned long calls[2], lost[2];
  pthread_mutex_lock(&share_mu);
  share_counts_locked(exp, imp);
  memcpy(calls, sh_calls, sizeof calls);
  memcpy(lost, sh_lost, sizeof lost);
  pthread_mutex_unlock(&share_mu);
  for (int k = 0; k < SK_COUNT; k++) te += exp[k], ti += imp[k];
  jb_printf(b, "{\"exported\":%ld,\"imported\":%ld", te + (long)lost[0], ti + (long)lost[1]);
  for (int k = 0; k < SK_COUNT; k++)
    jb_printf(b, ",\"%s\":{\"exported\":%ld,\"imported\":%ld}", share_kind_names[k], exp[k], imp[k]);
  jb_printf(b, ",\"export_calls\":%lu,\"import_calls\":%lu,\"untracked\":{\"exported\":%lu,\"imported\":%lu}}",
            calls[0], calls[1], lost[0], lost[1]);
}

// ---- contexts ----
#define MAX_CTX TRK_MAX_CTX
static pthread_mutex_t ctx_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  CUcontext ctx;
  CUdevice dev;
  int primary;
} ctxs[MAX_CTX];
static int nctx;
static atomic_int cu_inited;

void trk_cuinit(void) { atomic_store(&cu_inited, 1); }

void trk_ctx_add(CUcontext ctx, CUdevice dev, int primary) {
  pthread_mutex_lock(&ctx_mu);
  int i;
  for (i = 0; i < nctx; i++)
    if (ctxs[i].ctx == ctx) break;
  if (i == nctx) {
    if (nctx < MAX_CTX) {
      ctxs[nctx].ctx = ctx;
      ctxs[nctx].dev = dev;
      ctxs[nctx].primary = primary;
      nctx++;
    } else {
      LOG_ONCE("context table full");
    }
  }
  pthread_mutex_unlock(&ctx_mu);
}

void trk_ctx_remove(CUcontext ctx) {
  pthread_mutex_lock(&ctx_mu);
  for (int i = 0; i < nctx; i++)
    if (ctxs[i].ctx == ctx) {
      ctxs[i] = ctxs[--nctx];
      break;
    }
  pthread_mutex_unlock(&ctx_mu);
  trk_peer_ctx_gone(ctx);  // its links went with it
}

// ---- modules ----
enum { IMG_NONE, IMG_FATBIN, IMG_ELF, IMG_PTX };
static const char *const img_names[] = {"unknown", "fatbin", "elf", "ptx"};

// A module's image is either a private copy (the caller may free its buffer after the load) or,
// for a fatbin registered by the shared runtime, borrowed in place: those bytes live in the
// registering library's mapped image, which stays mapped until __cudaUnregisterFatBinary (hooked:
// the module is dropped under mod_mu before the real call, so no reader outlives the mapping).
// Loads of bytes already borrowed (the runtime loading a registered fatbin lazily) borrow too and
// are given a private copy if the registration ends while they stay loaded.
typedef struct {
  int id, source, loaded, format;
  void *handle;
  uint8_t *image;
  size_t size;
  int borrowed;       // image points into the app's memory; never freed by the shim
  int borrow_of;      // id of the registration whose bytes a borrowed load shares (0: none)
  char *path;
  const char *drop_reason;  // why no image was kept (NULL when kept)
  uint64_t loaded_ns;
  // Derived lazily by the control thread.
  int analysed;
  char sha[65];
  int nptx, nelf, parse_err;
  char archs[128];
  // preemption: the module's twin information (instr.c), when the preempt mode looked at it
  int has_ks;
  kinfo_set ks;
} module;

static pthread_mutex_t mod_mu = PTHREAD_MUTEX_INITIALIZER;
static module **mods;
static size_t nmods, capmods;
static pmap modmap;  // module/library handle (and aliases) → index + 1
static uint64_t captured_bytes, borrowed_bytes;
static int next_module_id = 1;

// borrowed_source returns the loaded registration whose bytes are exactly [d, d+sz); mod_mu held.
static module *borrowed_source(const uint8_t *d, size_t sz) {
  for (size_t i = 0; i < nmods; i++) {
    module *m = mods[i];
    if (m->loaded && m->borrowed && !m->borrow_of && m->image == d && m->size == sz) return m;
  }
  return NULL;
}

static int classify(const void *image, size_t known, const uint8_t **data, size_t *size) {
  const uint8_t *p = image;
  uint32_t magic;
  memcpy(&magic, p, 4);
  if (magic == FATBIN_WRAPPER_MAGIC) {
    const ptxmig_fatbin_wrapper *w = image;
    if (!w->data) return IMG_NONE;
    *data = w->data;
    *size = fb_container_size(w->data, SIZE_MAX);
    return *size ? IMG_FATBIN : IMG_NONE;
  }
  *data = p;
  if (magic == FATBIN_CONTAINER_MAGIC) {
    *size = fb_container_size(p, known ? known : SIZE_MAX);
    return *size ? IMG_FATBIN : IMG_NONE;
  }
  if (fb_elf_size(p, known ? known : 64) || (p[0] == 0x7f && p[1] == 'E' && p[2] == 'L' && p[3] == 'F')) {
    *size = known ? known : fb_elf_size(p, SIZE_MAX);
    return *size ? IMG_ELF : IMG_NONE;
  }
  size_t n = strnlen((const char *)p, known ? known : (256u << 20));
  if (known && n == known) n--;  // no NUL inside the known size: keep it as text
  *size = n + 1;
  return IMG_PTX;
}

static uint8_t *read_file(const char *path, size_t max, size_t *len, const char **why) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *why = "module file unreadable";
    return NULL;
  }
  struct stat st;
  if (fstat(fd, &st) || !S_ISREG(st.st_mode) || (uint64_t)st.st_size > max) {
    close(fd);
    *why = "module file not a regular file or over the capture budget";
    return NULL;
  }
  uint8_t *b = malloc((size_t)st.st_size + 1);
  size_t got = 0;
  while (b && got < (size_t)st.st_size) {
    ssize_t r = read(fd, b + got, (size_t)st.st_size - got);
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      break;
    }
    got += (size_t)r;
  }
  close(fd);
  if (!b || got != (size_t)st.st_size) {
    free(b);
    *why = "module file read failed";
    return NULL;
  }
  b[got] = 0;
  *len = got;
  return b;
}

// insert_locked adds m to the table (or frees it when the table cannot grow); mod_mu held.
static void insert_locked(module *m) {
  if (nmods == capmods) {
    size_t nc = capmods ? capmods * 2 : 64;
    module **nm = realloc(mods, nc * sizeof *nm);
    if (!nm) {
      LOG_ONCE("module table: out of memory");
      if (!m->borrowed) free(m->image);
      free(m->path);
      free(m);
      return;
    }
    mods = nm;
    capmods = nc;
  }
  m->id = next_module_id++;
  mods[nmods] = m;
  int mapped = m->handle && pm_put(&modmap, (uint64_t)(uintptr_t)m->handle, nmods + 1) == 0;
  if (m->borrowed && !m->borrow_of && !mapped) {
    // A registration that cannot be found by its handle would never be dropped at
    // __cudaUnregisterFatBinary, leaving a pointer into memory the app may unmap: do not borrow.
    m->image = NULL;
    m->size = 0;
    m->borrowed = 0;
    m->drop_reason = "registration not tracked by handle (no handle, or module table out of memory)";
  }
  nmods++;
  if (m->borrowed) borrowed_bytes += m->size;
  else captured_bytes += m->size;
}

void trk_module_add(int source, void *handle, const void *image, size_t known, const char *path) {
  module *m = calloc(1, sizeof *m);
  if (!m) {
    LOG_ONCE("module table: out of memory");
    return;
  }
  m->source = source;
  m->handle = handle;
  m->loaded = 1;
  m->loaded_ns = shim_now_ns();
  pthread_mutex_lock(&mod_mu);
  uint64_t budget = cfg.capture_max > captured_bytes ? cfg.capture_max - captured_bytes : 0;
  pthread_mutex_unlock(&mod_mu);
  if (path) {
    m->path = strdup(path);
    size_t len = 0;
    uint8_t *b = read_file(path, budget, &len, &m->drop_reason);
    if (b) {
      const uint8_t *d;
      size_t sz;
      m->format = classify(b, len, &d, &sz);
      m->image = b;  // an unrecognised or oddly framed file is kept as it is
      m->size = (m->format == IMG_NONE || d != b || sz > len) ? len : sz;
    }
  } else if (image) {
    const uint8_t *d = NULL;
    size_t sz = 0;
    m->format = classify(image, known, &d, &sz);
    if (m->format == IMG_NONE) {
      m->drop_reason = "image format not recognised";
    } else if (source == MS_REGISTER_FATBIN) {
      m->image = (uint8_t *)d;
      m->size = sz;
      m->borrowed = 1;
    } else {
      // A load of exactly the bytes of a live registration shares them. The lookup and the
      // insertion happen under one hold of mod_mu, so the registration cannot end in between.
      pthread_mutex_lock(&mod_mu);
      module *src = borrowed_source(d, sz);
      if (src) {
        m->image = (uint8_t *)d;
        m->size = sz;
        m->borrowed = 1;
        m->borrow_of = src->id;
        insert_locked(m);
        pthread_mutex_unlock(&mod_mu);
        return;
      }
      pthread_mutex_unlock(&mod_mu);
      if (sz > budget) {
        m->drop_reason = "over the capture budget (PTXMIG_CAPTURE_MAX_MB)";
      } else if ((m->image = malloc(sz + 1))) {
        memcpy(m->image, d, sz);
        m->image[sz] = 0;
        m->size = sz;
      } else {
        m->drop_reason = "out of memory";
      }
    }
  }
  pthread_mutex_lock(&mod_mu);
  insert_locked(m);
  pthread_mutex_unlock(&mod_mu);
}

// drop_image forgets a module's image; mod_mu held.
static void drop_image(module *m, const char *why) {
  if (!m->image) return;
  if (m->borrowed) {
    borrowed_bytes -= m->size;
  } else {
    captured_bytes -= m->size;
    free(m->image);
  }
  m->image = NULL;
  m->size = 0;
  m->borrowed = 0;
  m->drop_reason = why;
}

// give_private_copies gives every loaded module that borrows reg's bytes a private copy (reg is going away);
// mod_mu held.
static void give_private_copies(module *reg) {
  for (size_t i = 0; i < nmods; i++) {
    module *m = mods[i];
    if (m == reg || !m->image || m->borrow_of != reg->id) continue;
    uint8_t *c = cfg.capture_max >= captured_bytes + m->size ? malloc(m->size + 1) : NULL;
    if (!c) {
      drop_image(m, "its registration ended and no private copy fitted the capture budget");
      continue;
    }
    memcpy(c, m->image, m->size);
    c[m->size] = 0;
    borrowed_bytes -= m->size;
    captured_bytes += m->size;
    m->image = c;
    m->borrowed = 0;
    m->borrow_of = 0;
  }
}

static void twins_forget_module(void *handle);
void trk_module_remove(void *handle) {
  twins_forget_module(handle);
  pthread_mutex_lock(&mod_mu);
  uint64_t *v = pm_find(&modmap, (uint64_t)(uintptr_t)handle);
  if (v) {
    module *m = mods[*v - 1];
    m->loaded = 0;
    if (m->borrowed && !m->borrow_of) give_private_copies(m);
    drop_image(m, "unloaded");  // only loaded modules are kept; metadata stays for status
    pm_del(&modmap, (uint64_t)(uintptr_t)handle, NULL);
  }
  pthread_mutex_unlock(&mod_mu);
}

void trk_module_alias(void *alias, void *handle) {
  pthread_mutex_lock(&mod_mu);
  uint64_t *v = pm_find(&modmap, (uint64_t)(uintptr_t)handle);
  if (v) pm_put(&modmap, (uint64_t)(uintptr_t)alias, *v);
  pthread_mutex_unlock(&mod_mu);
}

void trk_module_twins(void *handle, kinfo_set *ks) {
  pthread_mutex_lock(&mod_mu);
  uint64_t *v = pm_find(&modmap, (uint64_t)(uintptr_t)handle);
  if (v && !mods[*v - 1]->has_ks) {
    mods[*v - 1]->ks = *ks;
    mods[*v - 1]->has_ks = 1;
    ks->k = NULL;  // moved: never freed, kernel records point into it
    ks->n = 0;
  }
  pthread_mutex_unlock(&mod_mu);
}

int trk_instrumented_modules(void) {
  int n = 0;
  pthread_mutex_lock(&mod_mu);
  for (size_t i = 0; i < nmods; i++) n += mods[i]->loaded && mods[i]->has_ks && mods[i]->ks.instrumented;
  pthread_mutex_unlock(&mod_mu);
  return n;
}

// module_kinfo finds name's twin information in the module of handle; mod_mu held. *mreason gets
// the module's reason (stable: module records are never freed).
static const kinfo *module_kinfo(void *handle, const char *name, const char **mreason, int *is_lib) {
  uint64_t *v = pm_find(&modmap, (uint64_t)(uintptr_t)handle);
  if (!v) return NULL;
  module *m = mods[*v - 1];
  if (is_lib) *is_lib = m->handle == handle && (m->source == MS_LIBRARY_LOAD_DATA || m->source == MS_LIBRARY_LOAD_FILE);
  if (!m->has_ks) {
    if (mreason) *mreason = cfg.preempt == PM_OFF ? "preempt mode off" : "module loaded before the shim looked at it";
    return NULL;
  }
  if (mreason) *mreason = m->ks.reason;
  for (int i = 0; name && i < m->ks.n; i++)
    if (strcmp(m->ks.k[i].name, name) == 0) return &m->ks.k[i];
  return NULL;
}

static int module_id_of(void *handle) {
  int id = 0;
  pthread_mutex_lock(&mod_mu);
  uint64_t *v = pm_find(&modmap, (uint64_t)(uintptr_t)handle);
  if (v) id = mods[*v - 1]->id;
  pthread_mutex_unlock(&mod_mu);
  return id;
}

// ---- kernels and launches ----
static pthread_mutex_t k_mu = PTHREAD_MUTEX_INITIALIZER;
static pmap kmap;  // function/kernel/graph-exec handle → krec*
static krec **krecs;
static size_t nkrecs, capkrecs;
static atomic_ulong total_launches;
static atomic_int capture_open;

static krec *krec_get(void *fn, int is_graph) {
  static __thread void *last_fn;
  static __thread krec *last_rec;
  if (fn == last_fn && last_rec) return last_rec;
  pthread_mutex_lock(&k_mu);
  uint64_t *v = pm_find(&kmap, (uint64_t)(uintptr_t)fn);
  krec *r = v ? (krec *)(uintptr_t)*v : NULL;
  if (!r && fn) {
    if (nkrecs == capkrecs) {
      size_t nc = capkrecs ? capkrecs * 2 : 256;
      krec **nk = realloc(krecs, nc * sizeof *nk);
      if (nk) {
        krecs = nk;
        capkrecs = nc;
      }
    }
    if (nkrecs < capkrecs && (r = calloc(1, sizeof *r))) {
      r->fn = fn;
      r->is_graph = is_graph;
      if (pm_put(&kmap, (uint64_t)(uintptr_t)fn, (uint64_t)(uintptr_t)r)) {
        free(r);
        r = NULL;
      } else {
        krecs[nkrecs++] = r;
      }
    }
    if (!r) LOG_ONCE("kernel table: out of memory; some launches are not counted");
  }
  pthread_mutex_unlock(&k_mu);
  if (r) {
    last_fn = fn;
    last_rec = r;
  }
  return r;
}

// twin_reset forgets what a kernel record knew about its twin (its module went away, or the
// handle value now names another kernel).
static void twin_reset(krec *r) {
  atomic_store(&r->kinfo, NULL);
  atomic_store(&r->kinfo_tried, 0);
  atomic_store(&r->twin_fn_state, 0);
  atomic_store(&r->twin_fn, NULL);
  atomic_store(&r->layout, NULL);  // leaked: a launch in flight may still read it
  atomic_store(&r->attrs_applied, 0);
  atomic_store(&r->no_twin_why, NULL);
  atomic_store(&r->mid_state, 0);
  atomic_store(&r->mid_fn_state, 0);
  atomic_store(&r->mid_fn, NULL);
  atomic_store(&r->mid_attrs_applied, 0);
}

void trk_func_named(void *fn, void *owner, const char *name) {
  krec *r = krec_get(fn, 0);
  if (!r) return;
  int mid = module_id_of(owner);
  if (mid) atomic_store(&r->module_id, mid);
  if (owner && name && mid) {
    pthread_mutex_lock(&mod_mu);
    const kinfo *k = module_kinfo(owner, name, NULL, NULL);
    pthread_mutex_unlock(&mod_mu);
    if (atomic_exchange(&r->owner, owner) != owner) twin_reset(r);  // a handle value reused
    atomic_store(&r->kinfo, k);
  }
  if (name && !atomic_load(&r->name)) {
    char *n = strdup(name), *expect = NULL;
    if (n && !atomic_compare_exchange_strong(&r->name, &expect, n)) free(n);
  }
}

void trk_func_copy(void *fn, void *from) {
  krec *src = krec_get(from, 0), *r = krec_get(fn, 0);
  if (!src || !r) return;
  if (atomic_load(&src->module_id)) atomic_store(&r->module_id, atomic_load(&src->module_id));
  if (atomic_load(&src->owner)) atomic_store(&r->owner, atomic_load(&src->owner));
  if (atomic_load(&src->kinfo)) atomic_store(&r->kinfo, atomic_load(&src->kinfo));
  char *sn = atomic_load(&src->name);
  if (sn && !atomic_load(&r->name)) {
    char *n = strdup(sn), *expect = NULL;
    if (n && !atomic_compare_exchange_strong(&r->name, &expect, n)) free(n);
  }
}

static void twins_forget_module(void *handle) {
  pthread_mutex_lock(&k_mu);
  for (size_t i = 0; i < nkrecs; i++)
    if (atomic_load(&krecs[i]->owner) == handle) {
      atomic_store(&krecs[i]->owner, NULL);
      twin_reset(krecs[i]);
    }
  pthread_mutex_unlock(&k_mu);
}

void trk_func_attr(CUfunction f, int attr, int value) {
  krec *r = krec_get(f, 0);
  if (!r) return;
  pthread_mutex_lock(&k_mu);
  int n = atomic_load(&r->nattrs), i;
  for (i = 0; i < n && r->attrs[i].attr != attr; i++) {
  }
  if (i < 8) {
    r->attrs[i].attr = attr;
    r->attrs[i].value = value;
    if (i == n) atomic_store(&r->nattrs, n + 1);
    atomic_fetch_add(&r->attrs_gen, 1);
  }
  pthread_mutex_unlock(&k_mu);
}

// trk_func_attrs copies the recorded attributes (returns their generation).
int trk_func_attrs(krec *r, int attrs[8][2], int *n) {
  pthread_mutex_lock(&k_mu);
  *n = atomic_load(&r->nattrs);
  for (int i = 0; i < *n; i++) attrs[i][0] = r->attrs[i].attr, attrs[i][1] = r->attrs[i].value;
  int g = atomic_load(&r->attrs_gen);
  pthread_mutex_unlock(&k_mu);
  return g;
}

int trk_capture_open(void) { return atomic_load(&capture_open) > 0; }

void trk_capture(int delta) {
  if (delta > 0) atomic_fetch_add(&capture_open, 1);
  else if (atomic_fetch_sub(&capture_open, 1) <= 0) atomic_store(&capture_open, 0);
}

// ---- sampled GPU time ----
typedef struct sample {
  krec *rec;
  CUevent start, end;
  CUcontext ctx;
  CUstream stream;
  uint64_t blocks;  // the launch's grid size
  int twin;         // the launch ran as the twin
  uint32_t sig[SIG_N];  // its scalar signature (trk_sample_sig; all 0 when not given)
} sample;
#define MAX_PENDING 256
static pthread_mutex_t sample_mu = PTHREAD_MUTEX_INITIALIZER;
static sample pending[MAX_PENDING];
static int npending;
static struct {
  pthread_once_t once;
  CUresult (*event_create)(CUevent *, unsigned);
  CUresult (*event_record)(CUevent, CUstream);
  CUresult (*event_query)(CUevent);
  CUresult (*event_elapsed)(float *, CUevent, CUevent);
  CUresult (*event_destroy)(CUevent);
  CUresult (*ctx_get)(CUcontext *);
  CUresult (*ctx_push)(CUcontext);
  CUresult (*ctx_pop)(CUcontext *);
} ev = {PTHREAD_ONCE_INIT, 0, 0, 0, 0, 0, 0, 0, 0};

static void ev_load(void) {
  ev.event_create = (CUresult(*)(CUevent *, unsigned))drv_sym("cuEventCreate");
  ev.event_record = (CUresult(*)(CUevent, CUstream))drv_sym("cuEventRecord");
  ev.event_query = (CUresult(*)(CUevent))drv_sym("cuEventQuery");
  ev.event_elapsed = (CUresult(*)(float *, CUevent, CUevent))drv_sym("cuEventElapsedTime_v2");
  if (!ev.event_elapsed) ev.event_elapsed = (CUresult(*)(float *, CUevent, CUevent))drv_sym("cuEventElapsedTime");
  ev.event_destroy = (CUresult(*)(CUevent))drv_sym("cuEventDestroy_v2");
  ev.ctx_get = (CUresult(*)(CUcontext *))drv_sym("cuCtxGetCurrent");
  ev.ctx_push = (CUresult(*)(CUcontext))drv_sym("cuCtxPushCurrent_v2");
  ev.ctx_pop = (CUresult(*)(CUcontext *))drv_sym("cuCtxPopCurrent_v2");
  if (!ev.event_create || !ev.event_record || !ev.event_query || !ev.event_elapsed || !ev.event_destroy ||
      !ev.ctx_get) {
    ev.event_create = NULL;
    LOG_ONCE("event API not found in the driver: launch times are not sampled");
  }
}

static void sample_free(sample *s) {
  if (s->start) ev.event_destroy(s->start);
  if (s->end) ev.event_destroy(s->end);
  s->start = s->end = NULL;
}

// Idle events kept for reuse, each with its context, so a sampled launch does not create and
// destroy two events on the app's thread (sampling is ~100-165 of the ~420 ns the shim adds per
// launch in train.py, docs/BENCHMARKS.md). Guarded by sample_mu; emptied for a context before it
// is destroyed or its primary context released (samples_drop_ctx).
#define POOL_MAX 64
static struct {
  CUcontext ctx;
  CUevent ev;
} pool[POOL_MAX];
static int npool;

// sample_recycle_locked gives a finished sample's events to the pool (destroys what does not fit);
// sample_mu held.
static void sample_recycle_locked(sample *s) {
  CUevent e[2] = {s->start, s->end};
  for (int i = 0; i < 2; i++) {
    if (!e[i]) continue;
    if (npool < POOL_MAX) {
      pool[npool].ctx = s->ctx;
      pool[npool++].ev = e[i];
    } else {
      ev.event_destroy(e[i]);
    }
  }
  s->start = s->end = NULL;
}

// event_get takes an idle event of ctx from the pool, or creates one.
static CUresult event_get(CUcontext ctx, CUevent *e) {
  pthread_mutex_lock(&sample_mu);
  for (int i = npool - 1; i >= 0; i--)
    if (pool[i].ctx == ctx) {
      *e = pool[i].ev;
      pool[i] = pool[--npool];
      pthread_mutex_unlock(&sample_mu);
      return CUDA_SUCCESS;
    }
  pthread_mutex_unlock(&sample_mu);
  return ev.event_create(e, 0);
}

static void ring_add(krec *r, float us) {
  r->ring[r->ringpos] = us;
  r->ringpos = (r->ringpos + 1) % RING;
  if (r->nring < RING) r->nring++;
  r->nsampled++;
  r->sum_us += us;
  double mean = r->sum_us / (double)r->nsampled + 1.0;
  atomic_store(&r->mean_us, mean > 4e9 ? 4000000000u : (unsigned)mean);
}

// blk_note keeps the sample with the largest time per block (a preempted twin's sample, which
// covers only part of its blocks, never lowers it), with its launch's scalar signature (under
// sample_mu, as big_note's).
static void blk_note(krec *r, float us, uint64_t blocks, const uint32_t sig[SIG_N]) {
  if (!blocks || !(us > 0)) return;
  if (blocks > 0xffffffffull) blocks = 0xffffffffull;
  float per = us / (float)blocks;
  uint64_t old = atomic_load(&r->blk_sample), nw;
  do {
    float cur;
    uint32_t hi = (uint32_t)(old >> 32);
    memcpy(&cur, &hi, sizeof cur);
    if (old && cur >= per) return;
    memcpy(&hi, &per, sizeof hi);
    nw = (uint64_t)hi << 32 | blocks;
  } while (!atomic_compare_exchange_weak(&r->blk_sample, &old, nw));
  for (int i = 0; i < SIG_N; i++) atomic_store_explicit(&r->blk_sig[i], sig[i], memory_order_relaxed);
}

// big_note keeps the sample with the most blocks, for equal counts the longer one, with its
// launch's scalar signature. Only originals' samples count: a preempted twin's covers part of its
// grid, and would make larger launches look short. (Called under sample_mu: the signature belongs
// to the sample kept; a reader may see a signature a moment before or after its sample, which only
// shifts one estimate.)
static void big_note(krec *r, float us, uint64_t blocks, const uint32_t sig[SIG_N]) {
  if (!blocks || !(us > 0)) return;
  if (blocks > 0xffffffffull) blocks = 0xffffffffull;
  uint64_t u = us >= 4294967294.0f ? 0xffffffffull : (uint64_t)us + 1;
  uint64_t old = atomic_load(&r->big_sample), nw = u << 32 | blocks;
  do {
    uint64_t ob = old & 0xffffffffull, ou = old >> 32;
    if (old && (ob > blocks || (ob == blocks && ou >= u))) return;
  } while (!atomic_compare_exchange_weak(&r->big_sample, &old, nw));
  for (int i = 0; i < SIG_N; i++) atomic_store_explicit(&r->big_sig[i], sig[i], memory_order_relaxed);
}

void trk_sample_sig(launch_tok *t, const uint32_t sig[SIG_N]) {
  if (t->smp) memcpy(t->smp->sig, sig, sizeof t->smp->sig);
}

// samples_harvest collects finished samples without ever waiting: cuEventQuery only.
static void samples_harvest(int max, int from_ctl) {
  if (!ev.event_create) return;
  pthread_mutex_lock(&sample_mu);
  int w = 0, seen = 0;
  for (int i = 0; i < npending; i++) {
    sample *s = &pending[i];
    if (seen >= max) {
      pending[w++] = *s;
      continue;
    }
    seen++;
    int pushed = 0;
    if (from_ctl && ev.ctx_push && ev.ctx_pop && s->ctx) pushed = ev.ctx_push(s->ctx) == CUDA_SUCCESS;
    CUresult q = ev.event_query(s->end);
    if (q == CUDA_ERROR_NOT_READY) {
      pending[w++] = *s;
    } else {
      float ms = 0;
      CUresult el = q == CUDA_SUCCESS ? ev.event_elapsed(&ms, s->start, s->end) : q;
      if (el == CUDA_SUCCESS && ms >= 0) {
        ring_add(s->rec, ms * 1000.0f);
        blk_note(s->rec, ms * 1000.0f, s->blocks, s->sig);
        if (!s->twin) big_note(s->rec, ms * 1000.0f, s->blocks, s->sig);
      }
      if (el == CUDA_SUCCESS) sample_recycle_locked(s);
      else sample_free(s);  // events the driver reports errors for are not reused
    }
    if (pushed) {
      CUcontext c;
      ev.ctx_pop(&c);
    }
  }
  npending = w;
  pthread_mutex_unlock(&sample_mu);
}

void samples_drop_ctx(CUcontext ctx) {
  if (!ev.event_create) return;
  pthread_mutex_lock(&sample_mu);
  int w = 0;
  for (int i = 0; i < npending; i++) {
    if (pending[i].ctx == ctx) sample_free(&pending[i]);
    else pending[w++] = pending[i];
  }
  npending = w;
  w = 0;
  for (int i = 0; i < npool; i++) {
    if (pool[i].ctx == ctx) ev.event_destroy(pool[i].ev);
    else pool[w++] = pool[i];
  }
  npool = w;
  pthread_mutex_unlock(&sample_mu);
}

// ctx_device: the device of a context the shim saw created or retained, or -1.
static CUdevice ctx_device(CUcontext c) {
  CUdevice d = -1;
  pthread_mutex_lock(&ctx_mu);
  for (int i = 0; i < nctx && d < 0; i++)
    if (ctxs[i].ctx == c) d = ctxs[i].dev;
  pthread_mutex_unlock(&ctx_mu);
  return d;
}

int trk_primary_ctxs(CUdevice dev, CUcontext out[MAX_CTX]) {
  int n = 0;
  pthread_mutex_lock(&ctx_mu);
  for (int i = 0; i < nctx; i++)
    if (ctxs[i].primary && ctxs[i].dev == dev) out[n++] = ctxs[i].ctx;
  pthread_mutex_unlock(&ctx_mu);
  return n;
}

// ---- fork ----
// A fork while another thread is inside the bookkeeping would leave the child with that thread's
// locks held forever (the other modules that keep state register their own child handlers). The table locks are only ever held for memory work (never across a driver
// call, never nested), so prepare takes them all and both sides release them. sample_mu is held
// across driver calls (event queries): taking it in prepare could wait on the driver's own fork
// handlers, so the child re-creates it instead, and forgets the parent's pending samples (their
// events belong to the parent's contexts).
static void fork_prepare(void) {
  pthread_mutex_lock(&ctx_mu);
  pthread_mutex_lock(&alloc_mu);
  pthread_mutex_lock(&mod_mu);
  pthread_mutex_lock(&k_mu);
  pthread_mutex_lock(&share_mu);
}
static void fork_parent(void) {
  pthread_mutex_unlock(&share_mu);
  pthread_mutex_unlock(&k_mu);
  pthread_mutex_unlock(&mod_mu);
  pthread_mutex_unlock(&alloc_mu);
  pthread_mutex_unlock(&ctx_mu);
}
static void fork_child(void) {
  fork_parent();
  pthread_mutex_init(&sample_mu, NULL);
  npending = 0;
  npool = 0;
}
__attribute__((constructor)) static void track_fork_init(void) {
  pthread_atfork(fork_prepare, fork_parent, fork_child);
}

static __thread sample tls_sample;  // the sample in flight on this thread between pre and post

// Self-timing (PTXMIG_SELF_TIME=1): the wall time the shim's own bookkeeping adds to each launch,
// launch_pre plus launch_post (the driver's launch itself excluded), summed over all launches.
// It measures the shim's cost inside the real application, where whole-run A/B timings are too
// noisy; the two clock reads it adds per side are included, so it is an upper bound. Off by default.
static atomic_ulong self_launches, self_ns_total;
static inline uint64_t self_clock(void) { return cfg.self_time ? shim_now_ns() : 0; }
// What one clock read costs here (on some VMs the clock is a system call): each launch's self time
// includes about two of them, which readers may subtract. Measured at each kernels report with
// self-timing on (on the control thread, never the app's): the fastest of 16 runs of 64 reads.
static uint64_t clock_cost_ns(void) {
  uint64_t best = UINT64_MAX;
  for (int r = 0; r < 16; r++) {
    uint64_t t0 = shim_now_ns(), t1 = t0;
    for (int i = 0; i < 64; i++) t1 = shim_now_ns();
    if ((t1 - t0) / 64 < best) best = (t1 - t0) / 64;
  }
  return best;
}

static void launch_pre_track(launch_tok *t, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                             unsigned by, unsigned bz, CUstream s, int ptsz, int kind);
void launch_pre(launch_tok *t, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                unsigned bz, CUstream s, int ptsz, int kind) {
  uint64_t t0 = self_clock();
  launch_pre_track(t, f, gx, gy, gz, bx, by, bz, s, ptsz, kind);
  t->self_ns = t0 ? self_clock() - t0 : 0;
}

static void launch_pre_track(launch_tok *t, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                             unsigned by, unsigned bz, CUstream s, int ptsz, int kind) {
  t->smp = NULL;
  t->twin = 0;
  t->rec = krec_get(f, 0);
  krec *r = t->rec;
  if (!r) return;
  unsigned long seq = atomic_fetch_add(&r->seen, 1);
  if (kind == LK_COOPERATIVE) atomic_fetch_add(&r->cooperative, 1);
  t->dims[0] = gx, t->dims[1] = gy, t->dims[2] = gz, t->dims[3] = bx, t->dims[4] = by, t->dims[5] = bz;
  // Sampling decision: the first N launches of each kernel, then 1 in M; never while a stream
  // capture is open anywhere in the process.
  int want = seq < cfg.sample_first || (cfg.sample_every && (seq - cfg.sample_first) % cfg.sample_every == 0);
  if (!want || atomic_load(&capture_open) > 0) return;
  pthread_once(&ev.once, ev_load);
  if (!ev.event_create) return;
  samples_harvest(8, 0);
  pthread_mutex_lock(&sample_mu);
  int full = npending >= MAX_PENDING;
  pthread_mutex_unlock(&sample_mu);
  if (full) return;
  sample *sm = &tls_sample;
  memset(sm, 0, sizeof *sm);
  if (ev.ctx_get(&sm->ctx) != CUDA_SUCCESS || !sm->ctx) return;
  sm->stream = (!s && ptsz) ? CU_STREAM_PER_THREAD : s;
  sm->blocks = (uint64_t)gx * gy * gz;
  if (event_get(sm->ctx, &sm->start) != CUDA_SUCCESS) return;
  if (event_get(sm->ctx, &sm->end) != CUDA_SUCCESS || ev.event_record(sm->start, sm->stream) != CUDA_SUCCESS) {
    sample_free(sm);
    return;
  }
  sm->rec = r;
  t->smp = sm;
}

// count_shape records the launch shape: a few distinct shapes per kernel, the rest counted together.
static void count_shape(krec *r, const unsigned d[6]) {
  unsigned gx = d[0], gy = d[1], gz = d[2], bx = d[3], by = d[4], bz = d[5];
  int ns = atomic_load(&r->nshapes), i;
#define SAME_SHAPE(k)                                                                          \
  (r->shapes[k].g[0] == gx && r->shapes[k].g[1] == gy && r->shapes[k].g[2] == gz &&            \
   r->shapes[k].b[0] == bx && r->shapes[k].b[1] == by && r->shapes[k].b[2] == bz)
  for (i = 0; i < ns; i++)
    if (SAME_SHAPE(i)) break;
  if (i == ns && ns < NSHAPES) {
    pthread_mutex_lock(&k_mu);
    ns = atomic_load(&r->nshapes);
    for (i = 0; i < ns; i++)
      if (SAME_SHAPE(i)) break;
    if (i == ns && ns < NSHAPES) {
      r->shapes[ns].g[0] = gx, r->shapes[ns].g[1] = gy, r->shapes[ns].g[2] = gz;
      r->shapes[ns].b[0] = bx, r->shapes[ns].b[1] = by, r->shapes[ns].b[2] = bz;
      atomic_store(&r->nshapes, ns + 1);
      ns++;
    }
    pthread_mutex_unlock(&k_mu);
  }
#undef SAME_SHAPE
  if (i < ns) atomic_fetch_add(&r->shapes[i].n, 1);
  else atomic_fetch_add(&r->other_shapes, 1);

}

static int launch_post_track(launch_tok *t, CUresult r);

// krec_collective says whether k is a collective kernel: NCCL's (ncclDevKernel_* since NCCL 2.19,
// ncclKernel_* before; mangled, as NCCL 2.28 names them: _Z39ncclDevKernel_AllReduce_...),
// decided once its name is known and remembered in the record.
static int krec_collective(krec *k) {
  int c = atomic_load_explicit(&k->coll, memory_order_relaxed);
  if (c) return c == 1;
  const char *n = atomic_load(&k->name);
  if (!n) return 0;
  if (n[0] == '_' && n[1] == 'Z') {  // a mangled name: _Z<length><name>... (NCCL's kernels are)
    n += 2;
    while (*n >= '0' && *n <= '9') n++;
  }
  c = strncmp(n, "ncclDevKernel", 13) == 0 || strncmp(n, "ncclKernel", 10) == 0 ? 1 : 2;
  atomic_store_explicit(&k->coll, c, memory_order_relaxed);
  return c == 1;
}
int launch_post(launch_tok *t, CUresult r) {
  uint64_t t0 = self_clock();
  int coll = launch_post_track(t, r);
  if (t0) {
    atomic_fetch_add(&self_ns_total, t->self_ns + (self_clock() - t0));
    atomic_fetch_add(&self_launches, 1);
  }
  return coll;
}

static int launch_post_track(launch_tok *t, CUresult r) {
  krec *k = t->rec;
  sample *sm = t->smp;
  if (!k) return 0;
  int coll = 0;
  if (r == CUDA_SUCCESS) {
    atomic_fetch_add(&k->launches, 1);
    atomic_fetch_add(&total_launches, 1);
    count_shape(k, t->dims);
    coll = krec_collective(k);
  } else {
    atomic_fetch_add(&k->failed, 1);
  }
  if (!sm) return coll;
  sm->twin = t->twin;
  if (r != CUDA_SUCCESS || ev.event_record(sm->end, sm->stream) != CUDA_SUCCESS) {
    sample_free(sm);
    return coll;
  }
  pthread_mutex_lock(&sample_mu);
  if (npending < MAX_PENDING) {
    pending[npending++] = *sm;
    sm->start = sm->end = NULL;
  } else {
    sample_recycle_locked(sm);
  }
  pthread_mutex_unlock(&sample_mu);
  return coll;
}

krec *trk_graph_launch(CUgraphExec g, CUresult r) {
  krec *k = krec_get(g, 1);
  if (!k) return NULL;
  if (r == CUDA_SUCCESS) atomic_fetch_add(&k->launches, 1);
  else atomic_fetch_add(&k->failed, 1);
  return k;
}

// ---- reports for the control socket ----

static void jb_ptr(jbuf *b, const void *p) { jb_printf(b, "\"0x%llx\"", (unsigned long long)(uintptr_t)p); }

typedef struct {
  int nptx, nelf;
  char archs[128];
} walk_acc;

static int count_entry(const fb_entry *e, void *arg) {
  walk_acc *a = arg;
  char tag[24];
  if (e->kind == FB_KIND_PTX) {
    a->nptx++;
    snprintf(tag, sizeof tag, "compute_%u", e->arch);
  } else if (fb_is_elf_kind(e->kind)) {
    a->nelf++;
    snprintf(tag, sizeof tag, "sm_%u", e->arch);
  } else {
    return 0;
  }
  // a comma-separated set of distinct tags
  size_t tl = strlen(tag), al = strlen(a->archs);
  for (const char *p = a->archs; *p;) {
    const char *c = strchr(p, ',');
    size_t l = c ? (size_t)(c - p) : strlen(p);
    if (l == tl && memcmp(p, tag, tl) == 0) return 0;
    p += l + (c ? 1 : 0);
  }
  if (al + tl + 2 < sizeof a->archs) snprintf(a->archs + al, sizeof a->archs - al, "%s%s", al ? "," : "", tag);
  return 0;
}

// analyse fills a module's derived fields (hash, entry counts); called with mod_mu held.
static void analyse(module *m) {
  if (m->analysed || !m->image) return;
  sha256_hex(m->image, m->size, m->sha);
  walk_acc a = {0, 0, ""};
  if (m->format == IMG_FATBIN) {
    int n = fb_walk(m->image, m->size, count_entry, &a, NULL);
    if (n < 0) m->parse_err = n;
  } else if (m->format == IMG_ELF) {
    a.nelf = 1;
  } else if (m->format == IMG_PTX) {
    a.nptx = 1;
  }
  m->nptx = a.nptx;
  m->nelf = a.nelf;
  memcpy(m->archs, a.archs, sizeof m->archs);
  m->analysed = 1;
}

static void report_modules(jbuf *b) {
  jb_s(b, "[");
  pthread_mutex_lock(&mod_mu);
  for (size_t i = 0; i < nmods; i++) {
    module *m = mods[i];
    analyse(m);
    jb_printf(b, "%s{\"id\":%d,\"source\":\"%s\",\"handle\":", i ? "," : "", m->id, module_source_names[m->source]);
    jb_ptr(b, m->handle);
    jb_printf(b, ",\"loaded\":%s,\"format\":\"%s\",\"bytes\":%zu", m->loaded ? "true" : "false",
              img_names[m->format], m->size);
    if (m->image) {
      jb_printf(b, ",\"sha256\":\"%s\",\"ptx\":%d,\"elf\":%d,\"image\":\"%s\"", m->sha, m->nptx, m->nelf,
                m->borrowed ? "borrowed" : "copy");
      if (m->borrow_of) jb_printf(b, ",\"same_image_as\":%d", m->borrow_of);
    }
    if (m->archs[0]) {
      jb_key(b, "archs");
      jb_str(b, m->archs, strlen(m->archs));
    }
    if (m->parse_err) jb_printf(b, ",\"parse_error\":\"%s\"", fb_strerror(m->parse_err));
    if (m->path) {
      jb_key(b, "path");
      jb_str(b, m->path, strlen(m->path));
    }
    if (!m->image && m->drop_reason) jb_printf(b, ",\"not_captured\":\"%s\"", m->drop_reason);
    jb_s(b, "}");
  }
  pthread_mutex_unlock(&mod_mu);
  jb_s(b, "]");
}

static void report_devices(jbuf *b) {
  jb_s(b, "[");
  CUresult (*count)(int *) = (CUresult(*)(int *))drv_sym("cuDeviceGetCount");
  CUresult (*get)(CUdevice *, int) = (CUresult(*)(CUdevice *, int))drv_sym("cuDeviceGet");
  CUresult (*name)(char *, int, CUdevice) = (CUresult(*)(char *, int, CUdevice))drv_sym("cuDeviceGetName");
  CUresult (*mem)(size_t *, CUdevice) = (CUresult(*)(size_t *, CUdevice))drv_sym("cuDeviceTotalMem_v2");
  CUresult (*attr)(int *, int, CUdevice) = (CUresult(*)(int *, int, CUdevice))drv_sym("cuDeviceGetAttribute");
  CUresult (*uuid)(unsigned char *, CUdevice) = (CUresult(*)(unsigned char *, CUdevice))drv_sym("cuDeviceGetUuid_v2");
  if (!uuid) uuid = (CUresult(*)(unsigned char *, CUdevice))drv_sym("cuDeviceGetUuid");
  int n = 0;
  if (atomic_load(&cu_inited) && count && get && count(&n) == CUDA_SUCCESS) {
    for (int i = 0; i < n && i < 64; i++) {
      CUdevice d;
      if (get(&d, i) != CUDA_SUCCESS) continue;
      char nm[256] = "";
      size_t total = 0;
      int maj = 0, min = 0;
      unsigned char u[16];
      if (name) name(nm, sizeof nm - 1, d);
      if (mem) mem(&total, d);
      if (attr) {
        attr(&maj, 75, d);  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        attr(&min, 76, d);
      }
      jb_printf(b, "%s{\"ordinal\":%d,\"name\":", i ? "," : "", i);
      jb_str(b, nm, strnlen(nm, sizeof nm));
      jb_printf(b, ",\"total_bytes\":%zu,\"compute_capability\":\"%d.%d\"", total, maj, min);
      if (uuid && uuid(u, d) == CUDA_SUCCESS)
        jb_printf(b,
                  ",\"uuid\":\"GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\"",
                  u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
                  u[14], u[15]);
      jb_s(b, "}");
    }
  }
  jb_s(b, "]");
}

// Peer links the process has enabled between its contexts and not disabled (status
// "peer_access"), each with the context it was enabled from and whether the driver has it on
// (applied), so that ptxmig can turn them off for a checkpoint and on again after (peer-off /
// peer-on): driver 580 restores such a process once its peer access is off (scripts/probe-peer.sh,
// 2x H200). While the process is quiesced or detached, or its links are off, an enable the app
// makes goes into the table only (not applied; the resume applies it), so that no link comes on
// behind a quiesce that reported none; a disable of a link not applied changes only the table.
// preempt.c says when the process is quiesced (trk_peer_hold). peer_mu is never taken by a fork
// handler, whose child starts with an empty table (the parent's contexts are not its own).
#define MAX_PEER 64
#define CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED 704
#define CUDA_ERROR_PEER_ACCESS_NOT_ENABLED 705
#define CUDA_ERROR_TOO_MANY_PEERS 711
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_DEVICE 101
static pthread_mutex_t peer_mu = PTHREAD_MUTEX_INITIALIZER;
typedef struct {
  CUcontext ctx, peer;
  unsigned flags;
  int applied;  // on in the driver
  int stale;    // the driver no longer knows its context or peer: no link at all (purged)
  int fresh;    // enabled while held: never on in the driver yet (one the driver refuses is dropped)
} peer_link;
static peer_link links[MAX_PEER];
static int nlinks, links_lost, peer_off;  // peer_mu; links_lost: applied links the table could not hold
static int peer_hold;                      // peer_mu: quiesced or detached (trk_peer_hold)
static atomic_long peer_refused;
static struct {
  pthread_once_t once;
  CUresult (*get)(CUcontext *), (*push)(CUcontext), (*pop)(CUcontext *), (*sync)(void);
  CUresult (*enable)(CUcontext, unsigned), (*disable)(CUcontext);
  CUresult (*can)(int *, CUdevice, CUdevice);
  CUresult (*ver)(CUcontext, unsigned *);
} pd = {.once = PTHREAD_ONCE_INIT};
static void pd_load(void) {
  *(void **)&pd.get = drv_sym("cuCtxGetCurrent");
  *(void **)&pd.push = drv_sym("cuCtxPushCurrent_v2");
  *(void **)&pd.pop = drv_sym("cuCtxPopCurrent_v2");
  *(void **)&pd.sync = drv_sym("cuCtxSynchronize");
  *(void **)&pd.enable = drv_sym("cuCtxEnablePeerAccess");
  *(void **)&pd.disable = drv_sym("cuCtxDisablePeerAccess");
  *(void **)&pd.can = drv_sym("cuDeviceCanAccessPeer");
  *(void **)&pd.ver = drv_sym("cuCtxGetApiVersion");
}
static int pd_ready(void) {
  pthread_once(&pd.once, pd_load);
  return pd.get && pd.push && pd.pop && pd.sync && pd.enable && pd.disable;
}
static int link_find(CUcontext ctx, CUcontext peer) {  // peer_mu held
  for (int i = 0; i < nlinks; i++)
    if (links[i].ctx == ctx && links[i].peer == peer) return i;
  return -1;
}
static void link_del(int i) { links[i] = links[--nlinks]; }  // peer_mu held
static int deferred(void) { return peer_off || peer_hold; }  // peer_mu held

CUresult trk_peer_enable(CUcontext peer, unsigned flags, CUresult (*real)(CUcontext, unsigned)) {
  CUcontext cur = NULL;
  if (!pd_ready() || pd.get(&cur) != CUDA_SUCCESS) return real(peer, flags);
  pthread_mutex_lock(&peer_mu);
  int i = link_find(cur, peer);
  CUresult r;
  const char *how = "";
  if (deferred()) {  // answered as the driver would, applied at the resume
    how = ", deferred";
    CUdevice dc = -1, dp = -1;
    int can = 1;
    if (cur && peer && (dc = ctx_device(cur)) >= 0 && (dp = ctx_device(peer)) >= 0 && pd.can && pd.can(&can, dc, dp) != CUDA_SUCCESS) can = 1;
    if (!cur || !peer) r = CUDA_ERROR_INVALID_CONTEXT;
    else if (peer == cur) r = CUDA_ERROR_INVALID_DEVICE;
    else if (flags) r = CUDA_ERROR_INVALID_VALUE;
    else if (!can) r = CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
    else if (i >= 0) r = CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    else if (nlinks == MAX_PEER) r = CUDA_ERROR_TOO_MANY_PEERS;
    else links[nlinks++] = (peer_link){cur, peer, flags, 0, 0, 1}, r = CUDA_SUCCESS;
  } else {
    r = real(peer, flags);
    if (r == CUDA_SUCCESS && i < 0) {
      if (nlinks < MAX_PEER) links[nlinks++] = (peer_link){cur, peer, flags, 1, 0, 0};
      else links_lost++;
    } else if ((r == CUDA_SUCCESS || r == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) && i >= 0) {
      links[i].applied = 1, links[i].fresh = 0;  // on in the driver now, whatever the table said
    }
  }
  pthread_mutex_unlock(&peer_mu);
  shim_log("peer access: the app enables context %p -> peer %p (flags %u)%s: %d", (void *)cur, (void *)peer, flags, how, r);
  return r;
}

CUresult trk_peer_disable(CUcontext peer, CUresult (*real)(CUcontext)) {
  CUcontext cur = NULL;
  if (!pd_ready() || pd.get(&cur) != CUDA_SUCCESS) return real(peer);
  pthread_mutex_lock(&peer_mu);
  int i = link_find(cur, peer);
  CUresult r;
  if (i >= 0 && !links[i].applied && deferred()) {
    link_del(i), r = CUDA_SUCCESS;  // not on in the driver: the table is all there is
  } else {
    r = real(peer);  // one fewer link is always safe, quiesced too
    if (i >= 0 && !links[i].applied && r == CUDA_ERROR_PEER_ACCESS_NOT_ENABLED) r = CUDA_SUCCESS;  // as the table said
    if (r == CUDA_SUCCESS && i >= 0) link_del(i);
    else if (r == CUDA_SUCCESS && links_lost > 0) links_lost--;
  }
  pthread_mutex_unlock(&peer_mu);
  shim_log("peer access: the app disables context %p -> peer %p: %d", (void *)cur, (void *)peer, r);
  return r;
}

// peer_apply1, peer_enable_all and purge_stale are below.
static CUresult peer_apply1(int on, int i);
static CUresult peer_enable_all(int *bad, int *changed);
static void purge_stale(void);

void trk_peer_hold(int on) {
  pthread_mutex_lock(&peer_mu);
  peer_hold = on;
  // Running again: links the app enabled since the peer-on (or a quiesce without one) go on now.
  int bad, changed;
  if (!on && !peer_off) peer_enable_all(&bad, &changed);  // a failure is logged there
  purge_stale();
  pthread_mutex_unlock(&peer_mu);
}

void trk_peer_ctx_gone(CUcontext ctx) {
  pthread_mutex_lock(&peer_mu);
  for (int i = nlinks - 1; i >= 0; i--)
    if (links[i].ctx == ctx || links[i].peer == ctx) link_del(i);
  pthread_mutex_unlock(&peer_mu);
}

long trk_peer_links(void) {
  pthread_mutex_lock(&peer_mu);
  long n = nlinks + links_lost;
  pthread_mutex_unlock(&peer_mu);
  return n;
}

long trk_peer_applied(void) {
  pthread_mutex_lock(&peer_mu);
  long n = links_lost;
  for (int i = 0; i < nlinks; i++) n += links[i].applied;
  pthread_mutex_unlock(&peer_mu);
  return n;
}

void trk_peer_refused(void) { atomic_fetch_add(&peer_refused, 1); }

// stale_code: the driver does not know a context handle (destroyed without the shim seeing it,
// such as a primary context released by a runtime): a link naming it is no link.
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_CONTEXT_IS_DESTROYED 709
static int stale_code(CUresult r) {
  return r == CUDA_ERROR_INVALID_HANDLE || r == CUDA_ERROR_INVALID_CONTEXT || r == CUDA_ERROR_CONTEXT_IS_DESTROYED;
}

// peer_apply1 enables (on) or disables link i from its context; a link the driver says names a
// context it does not know is marked stale (success: there is nothing to change; purge_stale
// drops it). peer_mu held.
static CUresult peer_try1(int on, int i) {
  CUcontext x;
  CUresult r = pd.push(links[i].ctx);
  if (r == CUDA_SUCCESS) {
    r = on ? pd.enable(links[i].peer, links[i].flags) : pd.disable(links[i].peer);
    if (r == (on ? CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED : CUDA_ERROR_PEER_ACCESS_NOT_ENABLED)) r = CUDA_SUCCESS;
    pd.pop(&x);
  }
  return r;
}

// ctx_gone: the driver says it does not know c (a destroyed context). A driver without the query
// is taken at the word of the call that failed.
static int ctx_gone(CUcontext c) {
  unsigned v;
  return !pd.ver || stale_code(pd.ver(c, &v));
}

// peer_settle: what link i's answer r means. A stale answer (invalid handle or context) drops the
// link only when the driver does not know its context or its peer: after a driver restore the
// first enable of a link between two live contexts was refused with CUDA_ERROR_INVALID_HANDLE
// (twogpu, 2x H200, driver 580), and such a link must come back, not go. peer_mu held.
static CUresult peer_settle(int on, int i, CUresult r) {
  if (stale_code(r) && (ctx_gone(links[i].ctx) || ctx_gone(links[i].peer))) {
    shim_log("peer access: link %d (context %p, peer %p) names a context the driver does not know (%d): dropped", i + 1,
             (void *)links[i].ctx, (void *)links[i].peer, r);
    links[i].stale = 1;
    return CUDA_SUCCESS;
  }
  if (r == CUDA_SUCCESS) {
    shim_log("peer access: %s link %d (context %p, peer %p)", on ? "enabled" : "disabled", i + 1, (void *)links[i].ctx,
             (void *)links[i].peer);
    links[i].applied = on;
    if (on) links[i].fresh = 0;
    return r;
  }
  shim_log("peer access: %s link %d (context %p, peer %p) failed (%d)%s", on ? "enabling" : "disabling", i + 1, (void *)links[i].ctx,
           (void *)links[i].peer, r, on && links[i].fresh ? ": it was never on (enabled while held), dropped" : "");
  if (on && links[i].fresh) {  // only links that were on before may hold the process
    links[i].stale = 1;
    return CUDA_SUCCESS;
  }
  return r;
}

static CUresult peer_apply1(int on, int i) { return peer_settle(on, i, peer_try1(on, i)); }

// peer_enable_all enables every link that is off (not stale) and returns the first failure, with
// its link's index in *bad. A link the driver refuses is tried once more after the others: after
// a driver restore, twogpu's first enable (device 0 to device 1, which cudart had enabled before
// device 1 held memory) was refused with CUDA_ERROR_INVALID_HANDLE while the other went on (2x
// H200, driver 580; scripts/probe-peer.sh peer-toggle-late asks whether the order decides).
// *changed is set when a link went on. peer_mu held.
static CUresult peer_enable_all(int *bad, int *changed) {
  int retry[MAX_PEER], nr = 0;
  for (int i = 0; i < nlinks; i++) {
    if (links[i].applied || links[i].stale) continue;
    CUresult r = peer_try1(1, i);
    if (r != CUDA_SUCCESS) {
      shim_log("peer access: enabling link %d (context %p, peer %p) failed (%d): tried again after the others", i + 1,
               (void *)links[i].ctx, (void *)links[i].peer, r);
      retry[nr++] = i;
    } else if (peer_settle(1, i, r) == CUDA_SUCCESS && links[i].applied) {
      *changed = 1;
    }
  }
  for (int k = 0; k < nr; k++) {
    int i = retry[k];
    CUresult r = peer_settle(1, i, peer_try1(1, i));
    if (r != CUDA_SUCCESS) {
      *bad = i;
      return r;
    }
    if (links[i].applied) *changed = 1;  // not when it was dropped
  }
  return CUDA_SUCCESS;
}

static void purge_stale(void) {  // peer_mu held
  for (int i = nlinks - 1; i >= 0; i--)
    if (links[i].stale) link_del(i);
}

// peer_report: the links, for status ("peer_links": context, peer, on in the driver).
static void peer_report(jbuf *b) {
  pthread_mutex_lock(&peer_mu);
  jb_s(b, "[");
  for (int i = 0; i < nlinks; i++)
    jb_printf(b, "%s{\"context\":\"%p\",\"peer\":\"%p\",\"on\":%s}", i ? "," : "", (void *)links[i].ctx, (void *)links[i].peer,
              links[i].applied ? "true" : "false");
  jb_s(b, "]");
  pthread_mutex_unlock(&peer_mu);
}

int trk_peer_set(int on, jbuf *b, char *err, size_t errlen) {
  uint64_t t0 = shim_now_ns(), sync_ns = 0;
  if (!pd_ready()) {
    snprintf(err, errlen, "peer-%s: the driver lacks the peer access entry points", on ? "on" : "off");
    return -1;
  }
  int rc = 0, changed = 0;
  if (!on) {
    // No kernel may be reading a peer's memory when its access goes: wait for the work queued in
    // every context with a link on (the quiesce holds new launches, and the hold new links). The
    // wait runs without peer_mu, so that app threads are never blocked on it meanwhile.
    CUcontext sync_ctx[MAX_PEER], gone[MAX_PEER];
    int ns = 0, ng = 0;
    pthread_mutex_lock(&peer_mu);
    for (int i = 0; i < nlinks; i++) {
      int seen = !links[i].applied;
      for (int k = 0; k < ns && !seen; k++) seen = sync_ctx[k] == links[i].ctx;
      if (!seen) sync_ctx[ns++] = links[i].ctx;
    }
    pthread_mutex_unlock(&peer_mu);
    for (int k = 0; k < ns && rc == 0; k++) {
      CUcontext x;
      CUresult r = pd.push(sync_ctx[k]);
      if (r == CUDA_SUCCESS) r = pd.sync(), pd.pop(&x);
      if (stale_code(r) && ctx_gone(sync_ctx[k])) gone[ng++] = sync_ctx[k];  // a context the driver does not know: its links are none
      else if (r != CUDA_SUCCESS)
        snprintf(err, errlen, "peer-off: synchronizing a context before disabling its peer access failed (%d)", r), rc = -1;
    }
    sync_ns = shim_now_ns() - t0;
    pthread_mutex_lock(&peer_mu);
    for (int i = 0; i < nlinks; i++)
      for (int k = 0; k < ng; k++)
        if (links[i].ctx == gone[k]) links[i].stale = 1;
  } else {
    pthread_mutex_lock(&peer_mu);
  }
  if (!on && rc == 0 && links_lost) {
    snprintf(err, errlen, "peer-off: the process enabled more than %d peer links; the shim cannot turn them all off", MAX_PEER);
    rc = -1;
  } else if (!on && rc == 0) {
    int done[MAX_PEER], nd = 0;
    for (int i = 0; i < nlinks && rc == 0; i++) {
      if (!links[i].applied || links[i].stale) continue;
      CUresult r = peer_apply1(0, i);
      if (r == CUDA_SUCCESS) {
        if (!links[i].stale) done[nd++] = i;
        continue;
      }
      snprintf(err, errlen, "peer-off: disabling peer access of link %d of %d failed (%d)", i + 1, nlinks, r);
      rc = -1;
      // Undo: the links disabled go on again. One that will not stays off, and so does the
      // table's state (peer_off), so that the resume tries again.
      int stuck = 0;
      for (int k = nd - 1; k >= 0; k--) stuck += peer_apply1(1, done[k]) != CUDA_SUCCESS;
      if (stuck) {
        peer_off = 1;
        size_t n = strlen(err);
        snprintf(err + n, errlen - n, "; %d link(s) could not be enabled again (the resume retries)", stuck);
      }
    }
    if (rc == 0) changed = nd > 0 || !peer_off, peer_off = 1;
  } else if (on) {
    int bad = -1;
    CUresult r = peer_enable_all(&bad, &changed);
    if (r != CUDA_SUCCESS) snprintf(err, errlen, "peer-on: enabling peer access of link %d of %d failed (%d)", bad + 1, nlinks, r), rc = -1;
    if (rc == 0) changed |= peer_off, peer_off = 0;
  }
  purge_stale();
  int n = nlinks;
  pthread_mutex_unlock(&peer_mu);
  // largest_device_alloc: read here, with the process quiesced, for ptxmig's check (status's, read
  // before the quiesce, may be stale).
  if (rc == 0)
    jb_printf(b, "{\"links\":%d,\"changed\":%s,\"sync_us\":%llu,\"elapsed_us\":%llu,\"largest_device_alloc\":%llu}", n,
              changed ? "true" : "false", (unsigned long long)sync_ns / 1000, (unsigned long long)(shim_now_ns() - t0) / 1000,
              (unsigned long long)largest_device_alloc());
  return rc;
}

int trk_peer_pending(void) {
  pthread_mutex_lock(&peer_mu);
  int p = peer_off;
  for (int i = 0; i < nlinks && !p; i++) p = !links[i].applied;
  pthread_mutex_unlock(&peer_mu);
  return p;
}

static void peer_fork_child(void) {
  pthread_mutex_init(&peer_mu, NULL);
  nlinks = links_lost = peer_off = peer_hold = 0;
}
__attribute__((constructor)) static void peer_fork_init(void) { pthread_atfork(NULL, NULL, peer_fork_child); }

void trk_report_status(jbuf *b, int brief) {
  jb_printf(b, ",\"uptime_s\":%.3f,\"cuda_initialized\":%s", (double)(shim_now_ns() - start_ns) / 1e9,
            atomic_load(&cu_inited) ? "true" : "false");
  int dv = 0;
  CUresult (*ver)(int *) = (CUresult(*)(int *))drv_sym("cuDriverGetVersion");
  if (ver && ver(&dv) == CUDA_SUCCESS) jb_printf(b, ",\"driver_cuda_version\":%d", dv);
  jb_printf(b, ",\"peer_access\":%ld,\"peer_access_off\":%s,\"peer_access_refused\":%ld,\"peer_toggle\":true,\"peer_access_suspended\":%s",
            trk_peer_links(), cfg.no_peer ? "true" : "false", atomic_load(&peer_refused), trk_peer_pending() ? "true" : "false");
  jb_printf(b, ",\"largest_device_alloc\":%llu", (unsigned long long)largest_device_alloc());
  jb_key(b, "peer_links");
  peer_report(b);
  jb_key(b, "ipc");
  report_share(b);
  jb_key(b, "devices");
  report_devices(b);
  jb_key(b, "contexts");
  jb_s(b, "[");
  pthread_mutex_lock(&ctx_mu);
  for (int i = 0; i < nctx; i++) {
    jb_printf(b, "%s{\"handle\":", i ? "," : "");
    jb_ptr(b, ctxs[i].ctx);
    jb_printf(b, ",\"device\":%d,\"primary\":%s}", ctxs[i].dev, ctxs[i].primary ? "true" : "false");
  }
  pthread_mutex_unlock(&ctx_mu);
  jb_s(b, "]");
  jb_key(b, "allocations");
  jb_s(b, "{");
  pthread_mutex_lock(&alloc_mu);
  uint64_t dev_bytes = 0;
  for (int k = 0; k < AK_COUNT; k++) {
    jb_printf(b, "\"%s\":{\"count\":%llu,\"bytes\":%llu,\"peak_bytes\":%llu},", alloc_kind_names[k],
              (unsigned long long)totals[k].count, (unsigned long long)totals[k].bytes,
              (unsigned long long)totals[k].peak_bytes);
    if (k != AK_HOST && k != AK_VMM_MAP) dev_bytes += totals[k].bytes;
  }
  pthread_mutex_unlock(&alloc_mu);
  jb_printf(b, "\"device_bytes\":%llu}", (unsigned long long)dev_bytes);
  pthread_mutex_lock(&mod_mu);
  jb_printf(b, ",\"module_bytes\":{\"copied\":%llu,\"borrowed\":%llu,\"budget\":%llu}",
            (unsigned long long)captured_bytes, (unsigned long long)borrowed_bytes, (unsigned long long)cfg.capture_max);
  pthread_mutex_unlock(&mod_mu);
  // The module list hashes every image the first time (hundreds of MB in a PyTorch process: 1.8 s
  // on an H200 host, under the lock module loads take): brief leaves it out (ptxmig's preflight).
  jb_key(b, "modules");
  if (brief) jb_s(b, "[],\"brief\":true");
  else report_modules(b);
  pthread_mutex_lock(&k_mu);
  size_t nk = 0, ng = 0;
  for (size_t i = 0; i < nkrecs; i++) krecs[i]->is_graph ? ng++ : nk++;
  pthread_mutex_unlock(&k_mu);
  jb_printf(b, ",\"launches\":{\"kernels\":%lu,\"distinct_kernels\":%zu,\"graph_execs\":%zu}",
            atomic_load(&total_launches), nk, ng);
  jb_printf(b, ",\"sampling\":{\"first\":%u,\"every\":%u}", cfg.sample_first, cfg.sample_every);
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

// Names of kernels obtained through paths that carry no name (enumeration, cudart internals) are
// asked of the driver when a report needs them.
static void resolve_name(krec *r) {
  if (atomic_load(&r->name) || r->is_graph) return;
  static CUresult (*fget)(const char **, void *), (*kget)(const char **, void *);
  static CUresult (*fmod)(CUmodule *, void *);
  static int loaded;
  if (!loaded) {
    fget = (CUresult(*)(const char **, void *))drv_sym("cuFuncGetName");
    kget = (CUresult(*)(const char **, void *))drv_sym("cuKernelGetName");
    fmod = (CUresult(*)(CUmodule *, void *))drv_sym("cuFuncGetModule");
    loaded = 1;
  }
  const char *n = NULL;
  if (!(fget && fget(&n, r->fn) == CUDA_SUCCESS && n) && !(kget && kget(&n, r->fn) == CUDA_SUCCESS && n)) return;
  char *d = strdup(n), *expect = NULL;
  if (d && !atomic_compare_exchange_strong(&r->name, &expect, d)) free(d);
  CUmodule m;
  if (!atomic_load(&r->module_id) && fmod && fmod(&m, r->fn) == CUDA_SUCCESS) {
    int id = module_id_of(m);
    if (id) atomic_store(&r->module_id, id);
  }
}

const kinfo *trk_kinfo_of(krec *r, const char **mreason, void **owner, int *is_lib) {
  const kinfo *k = atomic_load(&r->kinfo);
  void *o = atomic_load(&r->owner);
  *mreason = NULL;
  *is_lib = 0;
  // Fast path for launches: settled once the twin was looked up, or the kernel has none. The
  // twin's lookup state says whether the owner is a library (2): the mid-block twin, looked up
  // later, must be looked up the same way (a CUlibrary is not a CUmodule).
  int ts = atomic_load(&r->twin_fn_state);
  if (k && ts != 0) {
    *owner = o;
    *is_lib = ts == 2;
    return k;
  }
  const char *nw = atomic_load(&r->no_twin_why);
  if (!k && nw) {
    *mreason = nw;
    *owner = o;
    return NULL;
  }
  if (!atomic_load(&r->kinfo_tried) || k) {
    // The name and module of kernels reached without a name (enumeration, CUkernel handles).
    if (!k && !o) resolve_name(r);
    char *nm = atomic_load(&r->name);
    if (!o && nm) {
      CUresult (*fmod)(CUmodule *, void *) = (CUresult(*)(CUmodule *, void *))drv_sym("cuFuncGetModule");
      CUmodule m;
      if (fmod && fmod(&m, r->fn) == CUDA_SUCCESS && m) atomic_store(&r->owner, o = m);
    }
    if (o) {
      pthread_mutex_lock(&mod_mu);
      const kinfo *kk = module_kinfo(o, nm, mreason, is_lib);
      pthread_mutex_unlock(&mod_mu);
      if (kk && !k) atomic_store(&r->kinfo, k = kk);
    } else {
      *mreason = "module unknown";
    }
    atomic_store(&r->kinfo_tried, 1);
    if (!k && *mreason) atomic_store(&r->no_twin_why, *mreason);  // module reasons are stable strings
  } else {
    *mreason = o ? NULL : "module unknown";
    if (o) {
      pthread_mutex_lock(&mod_mu);
      module_kinfo(o, NULL, mreason, is_lib);
      pthread_mutex_unlock(&mod_mu);
    }
  }
  *owner = o;
  return k;
}

void report_kernels(jbuf *b) {
  samples_harvest(MAX_PENDING, 1);
  pthread_mutex_lock(&k_mu);
  size_t n = nkrecs;
  krec **snap = n ? malloc(n * sizeof *snap) : NULL;
  if (snap) memcpy(snap, krecs, n * sizeof *snap);
  else n = 0;
  pthread_mutex_unlock(&k_mu);
  jb_s(b, "{\"kernels\":[");
  int first = 1;
  for (size_t i = 0; i < n; i++) {
    krec *r = snap[i];
    if (r->is_graph) continue;
    resolve_name(r);
    jb_s(b, first ? "{\"name\":" : ",{\"name\":");
    first = 0;
    char *nm = atomic_load(&r->name);
    if (nm) jb_str(b, nm, strlen(nm));
    else jb_s(b, "null");
    jb_s(b, ",\"handle\":");
    jb_ptr(b, r->fn);
    jb_printf(b, ",\"module\":%d,\"launches\":%lu,\"failed\":%lu,\"cooperative\":%lu,\"shapes\":[",
              atomic_load(&r->module_id), atomic_load(&r->launches), atomic_load(&r->failed),
              atomic_load(&r->cooperative));
    int ns = atomic_load(&r->nshapes);
    for (int k = 0; k < ns; k++)
      jb_printf(b, "%s{\"grid\":[%u,%u,%u],\"block\":[%u,%u,%u],\"launches\":%lu}", k ? "," : "",
                r->shapes[k].g[0], r->shapes[k].g[1], r->shapes[k].g[2], r->shapes[k].b[0], r->shapes[k].b[1],
                r->shapes[k].b[2], atomic_load(&r->shapes[k].n));
    jb_printf(b, "],\"other_shapes\":%lu", atomic_load(&r->other_shapes));
    float ring[RING];
    unsigned nr;
    uint64_t ns_total;
    double sum;
    pthread_mutex_lock(&sample_mu);
    nr = r->nring;
    memcpy(ring, r->ring, sizeof ring);
    ns_total = r->nsampled;
    sum = r->sum_us;
    pthread_mutex_unlock(&sample_mu);
    jb_printf(b, ",\"timed\":%llu", (unsigned long long)ns_total);
    {
      const char *mr;
      void *o;
      int lib;
      const kinfo *k = trk_kinfo_of(r, &mr, &o, &lib);
      int twin = k && k->twin && atomic_load(&r->twin_fn_state) >= 0;
      const char *why = twin ? NULL
                        : k && k->twin ? "twin not found in the loaded module"
                        : k && k->reason ? k->reason
                        : mr && *mr ? mr
                        : "module has no PTX";
      if (cfg.preempt == PM_OFF) why = "preempt mode off", twin = 0;
      jb_printf(b, ",\"twin\":%s,\"twin_reason\":", twin ? "true" : "false");
      if (why) jb_str(b, why, strlen(why));
      else jb_s(b, "null");
      jb_printf(b, ",\"twin_launches\":%lu,\"twin_fallbacks\":%lu", atomic_load(&r->twin_launches),
                atomic_load(&r->twin_fallbacks));
      if (twin && k->mid_twin) jb_s(b, ",\"mid_twin\":true");
      if (twin && atomic_load(&r->mid_state) == 1)  // read at its first twin launch
        jb_printf(b, ",\"mid_block\":{\"sites\":%u,\"register_slots\":%u,\"static_shared_bytes\":%u,\"local_bytes\":%u,"
                     "\"launches\":%lu,\"stops\":%lu}",
                  r->mid[3], r->mid[1], r->mid[2], r->mid[4], atomic_load(&r->mid_launches), atomic_load(&r->mid_stops));
      const char *ow = atomic_load(&r->original_why);
      if (twin && ow) {  // a kernel with a twin whose last original launch had this reason (auto)
        jb_s(b, ",\"original_reason\":");
        jb_str(b, ow, strlen(ow));
      }
    }
    if (nr) {
      qsort(ring, nr, sizeof ring[0], cmp_float);
      unsigned i50 = (nr - 1) / 2, i99 = (unsigned)((nr - 1) * 99 / 100);
      jb_printf(b, ",\"time_us\":{\"p50\":%.3f,\"p99\":%.3f,\"mean\":%.3f,\"max\":%.3f}", ring[i50], ring[i99],
                sum / (double)ns_total, ring[nr - 1]);
    }
    jb_s(b, "}");
  }
  jb_s(b, "],\"graphs\":[");
  first = 1;
  for (size_t i = 0; i < n; i++) {
    krec *r = snap[i];
    if (!r->is_graph) continue;
    jb_s(b, first ? "{\"exec\":" : ",{\"exec\":");
    first = 0;
    jb_ptr(b, r->fn);
    jb_printf(b, ",\"launches\":%lu,\"failed\":%lu}", atomic_load(&r->launches), atomic_load(&r->failed));
  }
  pthread_mutex_lock(&sample_mu);
  int np = npending;
  pthread_mutex_unlock(&sample_mu);
  jb_printf(b, "],\"total_launches\":%lu,\"sampling\":{\"first\":%u,\"every\":%u,\"pending\":%d,\"capture_open\":%d}",
            atomic_load(&total_launches), cfg.sample_first, cfg.sample_every, np, atomic_load(&capture_open));
  jb_printf(b, ",\"self_time\":{\"enabled\":%s,\"launches\":%lu,\"ns\":%lu,\"clock_ns\":%llu}}",
            cfg.self_time ? "true" : "false", atomic_load(&self_launches), atomic_load(&self_ns_total),
            (unsigned long long)(cfg.self_time ? clock_cost_ns() : 0));
  free(snap);
}

// ---- dump ----

// write_all writes all of data to fd; 0 or an errno value.
static int write_all(int fd, const void *data, size_t len) {
  const uint8_t *p = data;
  size_t off = 0;
  while (off < len) {
    ssize_t w = write(fd, p + off, len - off);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return errno;
    if (w == 0) return EIO;
    off += (size_t)w;
  }
  return 0;
}

// write_blob writes data as DIR/<sha256>.<ext> (0600) unless it already exists; *written is set
// when a new file was created.
static int write_blob(int dfd, const void *data, size_t len, const char *ext, char sha[65], int *written) {
  char name[96];
  sha256_hex(data, len, sha);
  snprintf(name, sizeof name, "%s.%s", sha, ext);
  *written = 0;
  int fd = openat(dfd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return errno == EEXIST ? 0 : -errno;
  int e = write_all(fd, data, len);
  if (close(fd) && !e) e = errno;
  if (e) {
    unlinkat(dfd, name, 0);  // never leave a partial blob under its content hash
    return -e;
  }
  *written = 1;
  return 0;
}

typedef struct {
  int dfd;
  jbuf *idx;
  int first, nptx, ncubin, written, errors;
  jbuf *errs;
} dump_ctx;

static int dump_entry(const fb_entry *e, void *arg) {
  dump_ctx *d = arg;
  int is_ptx = e->kind == FB_KIND_PTX, is_elf = fb_is_elf_kind(e->kind);
  if (!is_ptx && !is_elf) return 0;
  uint8_t *out;
  size_t len;
  static const char *const comp[] = {"none", "lz4", "zstd"};
  jb_printf(d->idx, "%s{\"kind\":\"%s\",\"arch\":\"%s_%u\",\"compression\":\"%s\"", d->first ? "" : ",",
            is_ptx ? "ptx" : "cubin", is_ptx ? "compute" : "sm", e->arch, comp[e->compression]);
  d->first = 0;
  int rc = fb_decode(e, &out, &len);
  if (rc != FB_OK) {
    jb_printf(d->idx, ",\"error\":\"%s\"}", fb_strerror(rc));
    d->errors++;
    return 0;
  }
  char sha[65];
  int w = 0;
  int err = write_blob(d->dfd, out, len, is_ptx ? "ptx" : "cubin", sha, &w);
  free(out);
  if (err) {
    jb_printf(d->idx, ",\"error\":\"write: %s\"}", strerror(-err));
    d->errors++;
    return 0;
  }
  d->written += w;
  is_ptx ? d->nptx++ : d->ncubin++;
  jb_printf(d->idx, ",\"file\":\"%s.%s\",\"bytes\":%zu}", sha, is_ptx ? "ptx" : "cubin", len);
  return 0;
}

int report_dump(jbuf *b, const char *dir, char *err, size_t errlen) {
  if (!dir || dir[0] != '/') {
    snprintf(err, errlen, "dump-modules: dir must be an absolute path");
    return -1;
  }
  if (mkdir(dir, 0700) && errno != EEXIST) {
    snprintf(err, errlen, "dump-modules: mkdir %s: %s", dir, strerror(errno));
    return -1;
  }
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) {
    snprintf(err, errlen, "dump-modules: open %s: %s", dir, strerror(errno));
    return -1;
  }
  // Copy the loaded images out under the lock, then decode and write without it.
  typedef struct {
    int id, source, format;
    uint8_t *img;
    size_t size;
  } snapm;
  pthread_mutex_lock(&mod_mu);
  snapm *s = nmods ? calloc(nmods, sizeof *s) : NULL;
  size_t ns = 0;
  for (size_t i = 0; s && i < nmods; i++) {
    module *m = mods[i];
    if (!m->image) continue;
    s[ns].img = malloc(m->size);
    if (!s[ns].img) continue;
    memcpy(s[ns].img, m->image, m->size);
    s[ns].size = m->size;
    s[ns].id = m->id;
    s[ns].source = m->source;
    s[ns].format = m->format;
    ns++;
  }
  pthread_mutex_unlock(&mod_mu);
  jbuf idx = {0};
  jb_printf(&idx, "{\"pid\":%d,\"shim\":\"%s\",\"modules\":[", (int)getpid(), PTXMIG_SHIM_VERSION);
  dump_ctx d = {.dfd = dfd, .idx = &idx};
  for (size_t i = 0; i < ns; i++) {
    char sha[65];
    int w = 0;
    const char *ext = s[i].format == IMG_FATBIN ? "fatbin" : s[i].format == IMG_ELF ? "cubin" : "ptx";
    size_t len = s[i].size;
    if (s[i].format == IMG_PTX) len = strnlen((const char *)s[i].img, len);
    int e = write_blob(dfd, s[i].img, len, ext, sha, &w);
    jb_printf(&idx, "%s{\"id\":%d,\"source\":\"%s\",\"format\":\"%s\"", i ? "," : "", s[i].id,
              module_source_names[s[i].source], img_names[s[i].format]);
    if (e) {
      jb_printf(&idx, ",\"error\":\"write: %s\"}", strerror(-e));
      d.errors++;
      continue;
    }
    d.written += w;
    jb_printf(&idx, ",\"image\":\"%s.%s\",\"sha256\":\"%s\",\"entries\":[", sha, ext, sha);
    d.first = 1;
    if (s[i].format == IMG_FATBIN) {
      int n = fb_walk(s[i].img, s[i].size, dump_entry, &d, NULL);
      if (n < 0) {
        jb_printf(&idx, "%s{\"error\":\"%s\"}", d.first ? "" : ",", fb_strerror(n));
        d.errors++;
      }
    } else {
      jb_printf(&idx, "{\"kind\":\"%s\",\"file\":\"%s.%s\",\"bytes\":%zu}", s[i].format == IMG_PTX ? "ptx" : "cubin",
                sha, ext, len);
      s[i].format == IMG_PTX ? d.nptx++ : d.ncubin++;
    }
    jb_s(&idx, "]}");
  }
  jb_s(&idx, "]}\n");
  for (size_t i = 0; i < ns; i++) free(s[i].img);
  free(s);
  int rc = 0;
  if (idx.oom) {
    snprintf(err, errlen, "dump-modules: out of memory");
    rc = -1;
  } else {
    // Written through write_all so a short write is retried, and the fd is closed on every path.
    int fd = openat(dfd, "index.json.tmp", O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    int e = fd < 0 ? errno : write_all(fd, idx.p, idx.len);
    if (fd >= 0 && close(fd) && !e) e = errno;
    if (!e && renameat(dfd, "index.json.tmp", dfd, "index.json")) e = errno;
    if (e) {
      if (fd >= 0) unlinkat(dfd, "index.json.tmp", 0);
      snprintf(err, errlen, "dump-modules: write %s/index.json: %s", dir, strerror(e));
      rc = -1;
    }
  }
  close(dfd);
  free(idx.p);
  if (rc == 0) {
    jb_s(b, "{\"dir\":");
    jb_str(b, dir, strlen(dir));
    jb_printf(b, ",\"modules\":%zu,\"ptx\":%d,\"cubin\":%d,\"files_written\":%d,\"errors\":%d,\"index\":\"index.json\"}",
              ns, d.nptx, d.ncubin, d.written, d.errors);
  }
  return rc;
}
