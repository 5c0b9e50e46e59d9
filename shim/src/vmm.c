// Owned device memory (ptxmig run --owned-memory, PTXMIG_OWNED_MEMORY=1): cuMemAlloc and
// cuMemAllocPitch of at least PTXMIG_OWNED_MIN_KB are served from VMM mappings the shim creates
// (cuMemAddressReserve + cuMemCreate + cuMemMap + cuMemSetAccess), one per allocation, so that at a
// checkpoint the shim can copy them out itself at link speed, release the physical memory (keeping
// the address reservation) before the driver checkpoint, and at restore re-create it at the same
// addresses and copy it back (docs/SHIM-PROTOCOL.md, "Owned device memory"). Anything the shim
// cannot serve this way (too small, no VMM, out of memory, peer access in use) goes to the driver,
// counted.
//
// The transfer runs on the control thread, on the connection holding the quiesce lease, through a
// ring of slots in a memfd shared with ptxmig (passed with SCM_RIGHTS): no Go runtime and no file
// of the process's own is involved, and the ring is gone before CRIU dumps the process.
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base.h"
#include "gpuhash.h"
#include "gpuhash_ptx.h"
#include "json.h"
#include "preempt.h"
#include "sock.h"
#include "track.h"
#include "vmm.h"

typedef struct {
  struct {
    int type, id;
  } location;
  int flags;  // CUmemAccess_flags (an enum: 12 bytes in all)
} mem_access_desc;  // CUmemAccessDesc
_Static_assert(sizeof(mem_access_desc) == 12, "CUmemAccessDesc layout");
#define ACCESS_RW 3
#define LOC_DEVICE 1
#define ALLOC_PINNED 1
#define CUDA_ERROR_NOT_SUPPORTED 801

static struct {
  pthread_once_t once;
  int ok, hash_ok;
  CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*addr_free)(CUdeviceptr, size_t);
  CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
  CUresult (*release)(CUmemGenericAllocationHandle);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const mem_access_desc *, size_t);
  CUresult (*granularity)(size_t *, const CUmemAllocationProp *, int);
  CUresult (*ctx_get)(CUcontext *);
  CUresult (*ctx_dev)(CUdevice *);
  CUresult (*ctx_push)(CUcontext);
  CUresult (*ctx_pop)(CUcontext *);
  CUresult (*ctx_sync)(void);
  CUresult (*host_register)(void *, size_t, unsigned);
  CUresult (*host_unregister)(void *);
  CUresult (*stream_create)(CUstream *, unsigned);
  CUresult (*stream_destroy)(CUstream);
  CUresult (*stream_sync)(CUstream);
  CUresult (*ev_create)(CUevent *, unsigned);
  CUresult (*ev_record)(CUevent, CUstream);
  CUresult (*ev_query)(CUevent);
  CUresult (*ev_sync)(CUevent);
  CUresult (*ev_destroy)(CUevent);
  CUresult (*dtoh_async)(void *, CUdeviceptr, size_t, CUstream);
  CUresult (*htod_async)(CUdeviceptr, const void *, size_t, CUstream);
  CUresult (*dtod_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*import)(CUmemGenericAllocationHandle *, void *, int);
  CUresult (*memset8_async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*mem_alloc)(CUdeviceptr *, size_t);
  CUresult (*mem_free)(CUdeviceptr);
  CUresult (*mod_load)(CUmodule *, const void *);
  CUresult (*mod_unload)(CUmodule);
  CUresult (*mod_get_fn)(CUfunction *, CUmodule, const char *);
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void **, void **);
} v = {.once = PTHREAD_ONCE_INIT};

#define VSYM(field, name) (*(void **)&v.field = drv_sym(name))
static void v_load(void) {
  VSYM(reserve, "cuMemAddressReserve");
  VSYM(addr_free, "cuMemAddressFree");
  VSYM(create, "cuMemCreate");
  VSYM(release, "cuMemRelease");
  VSYM(map, "cuMemMap");
  VSYM(unmap, "cuMemUnmap");
  VSYM(set_access, "cuMemSetAccess");
  VSYM(granularity, "cuMemGetAllocationGranularity");
  VSYM(ctx_get, "cuCtxGetCurrent");
  VSYM(ctx_dev, "cuCtxGetDevice");
  VSYM(ctx_push, "cuCtxPushCurrent_v2");
  VSYM(ctx_pop, "cuCtxPopCurrent_v2");
  VSYM(ctx_sync, "cuCtxSynchronize");
  VSYM(host_register, "cuMemHostRegister_v2");
  VSYM(host_unregister, "cuMemHostUnregister");
  VSYM(stream_create, "cuStreamCreate");
  VSYM(stream_destroy, "cuStreamDestroy_v2");
  VSYM(stream_sync, "cuStreamSynchronize");
  VSYM(ev_create, "cuEventCreate");
  VSYM(ev_record, "cuEventRecord");
  VSYM(ev_query, "cuEventQuery");
  VSYM(ev_sync, "cuEventSynchronize");
  VSYM(ev_destroy, "cuEventDestroy_v2");
  VSYM(dtoh_async, "cuMemcpyDtoHAsync_v2");
  VSYM(htod_async, "cuMemcpyHtoDAsync_v2");
  VSYM(dtod_async, "cuMemcpyDtoDAsync_v2");
  VSYM(import, "cuMemImportFromShareableHandle");
  VSYM(memset8_async, "cuMemsetD8Async");
  VSYM(mem_alloc, "cuMemAlloc_v2");
  VSYM(mem_free, "cuMemFree_v2");
  VSYM(mod_load, "cuModuleLoadData");
  VSYM(mod_unload, "cuModuleUnload");
  VSYM(mod_get_fn, "cuModuleGetFunction");
  VSYM(launch, "cuLaunchKernel");
  v.ok = v.reserve && v.addr_free && v.create && v.release && v.map && v.unmap && v.set_access && v.granularity &&
         v.ctx_get && v.ctx_dev && v.ctx_push && v.ctx_pop && v.ctx_sync && v.stream_create && v.stream_destroy &&
         v.stream_sync && v.ev_create && v.ev_record && v.ev_query && v.ev_sync && v.ev_destroy && v.dtoh_async &&
         v.htod_async;
  v.hash_ok = v.memset8_async && v.mem_alloc && v.mem_free && v.mod_load && v.mod_unload && v.mod_get_fn && v.launch;
  if (!v.ok) LOG_ONCE("owned memory: the driver lacks the VMM entry points; allocations go to the driver");
}
static int v_ready(void) {
  pthread_once(&v.once, v_load);
  return v.ok;
}

// ---- the region table ----
// One region per owned allocation: its reservation, mapped whole while live. Sorted by address.
typedef struct {
  CUdeviceptr va;
  size_t size;   // reserved and mapped (a multiple of the granularity)
  size_t asked;  // what the app asked for
  CUmemGenericAllocationHandle h;
  CUdevice dev;
  CUcontext ctx;
} region;

static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;
static region *regs;
static size_t nregs, cregs;
static int released;  // vmm_mu: every region's physical memory is released (mem-release .. mem-load)
static uint64_t owned_bytes, owned_peak;
static atomic_ulong st_owned, st_fallback, st_freed, st_ipc_refused;
static unsigned char *stash;  // vmm_mu: the stash (mem-prepare or mem-stash .. mem-unstash), see below
static size_t stash_len;
static int stash_state;  // vmm_mu: see below (0: none, 2: stashed)
static uint64_t regs_gen;  // vmm_mu: bumps with every allocation and free (the region table changed)
static uint64_t instance;  // random, per process (kept by a restored process): names its memory

static size_t find_le(CUdeviceptr p) {  // index of the last region starting at or before p, or nregs
  size_t lo = 0, hi = nregs;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (regs[mid].va <= p) lo = mid + 1;
    else hi = mid;
  }
  return lo == 0 ? nregs : lo - 1;
}
static region *region_of(CUdeviceptr p) {  // vmm_mu held
  size_t i = find_le(p);
  return i < nregs && p - regs[i].va < regs[i].size ? &regs[i] : NULL;
}

static size_t granularity(CUdevice dev) {
  static size_t cache[64];
  if (dev >= 0 && dev < 64 && cache[dev]) return cache[dev];
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = ALLOC_PINNED;
  p.location.type = LOC_DEVICE;
  p.location.id = dev;
  size_t g = 0;
  if (v.granularity(&g, &p, 0) != CUDA_SUCCESS || g == 0 || (g & (g - 1))) return 0;
  if (dev >= 0 && dev < 64) cache[dev] = g;
  return g;
}

// map_phys backs [va, va+size) with new physical memory of dev, read-write for dev.
static CUresult map_phys(CUdeviceptr va, size_t size, CUdevice dev, CUmemGenericAllocationHandle *h) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = ALLOC_PINNED;
  p.location.type = LOC_DEVICE;
  p.location.id = dev;
  CUresult r = v.create(h, size, &p, 0);
  if (r != CUDA_SUCCESS) return r;
  r = v.map(va, size, 0, *h, 0);
  if (r != CUDA_SUCCESS) {
    v.release(*h);
    return r;
  }
  mem_access_desc a = {.location = {LOC_DEVICE, dev}, .flags = ACCESS_RW};
  r = v.set_access(va, size, &a, 1);
  if (r != CUDA_SUCCESS) {
    v.unmap(va, size);
    v.release(*h);
  }
  return r;
}

static void unmap_phys(region *g) {
  v.unmap(g->va, g->size);
  v.release(g->h);
  g->h = 0;
}


int vmm_alloc(CUdeviceptr *p, size_t size) {
  if (!cfg.owned || size < cfg.owned_min || size > (1ull << 46) || !p || !v_ready()) return -1;
  if (trk_peer_links() > 0) {
    LOG_ONCE("owned memory: peer access is enabled; new allocations go to the driver (owned memory is not peer-mapped)");
    atomic_fetch_add(&st_fallback, 1);
    return -1;
  }
  CUcontext ctx = NULL;
  CUdevice dev = 0;
  if (v.ctx_get(&ctx) != CUDA_SUCCESS || !ctx || v.ctx_dev(&dev) != CUDA_SUCCESS) return -1;
  size_t g = granularity(dev);
  if (!g) {
    LOG_ONCE("owned memory: no allocation granularity for device %d; allocations go to the driver", dev);
    atomic_fetch_add(&st_fallback, 1);
    return -1;
  }
  size_t n = (size + g - 1) & ~(g - 1);
  sub_enter();  // never while a checkpoint holds the process: the allocation would miss the image
  CUdeviceptr va = 0;
  CUmemGenericAllocationHandle h = 0;
  CUresult r = v.reserve(&va, n, g, 0, 0);
  if (r == CUDA_SUCCESS) {
    r = map_phys(va, n, dev, &h);
    if (r != CUDA_SUCCESS) v.addr_free(va, n);
  }
  if (r != CUDA_SUCCESS) {
    sub_exit();
    shim_log("owned memory: %zu bytes on device %d: VMM failed (%d); the driver allocates them", size, dev, r);
    atomic_fetch_add(&st_fallback, 1);
    return -1;
  }
  pthread_mutex_lock(&vmm_mu);
  if (nregs == cregs) {
    size_t nc = cregs ? 2 * cregs : 64;
    region *nr = realloc(regs, nc * sizeof *nr);
    if (!nr) {
      pthread_mutex_unlock(&vmm_mu);
      unmap_phys(&(region){.va = va, .size = n, .h = h});
      v.addr_free(va, n);
      sub_exit();
      atomic_fetch_add(&st_fallback, 1);
      return -1;
    }
    regs = nr;
    cregs = nc;
  }
  size_t i = find_le(va);
  i = i == nregs ? 0 : i + 1;
  memmove(&regs[i + 1], &regs[i], (nregs - i) * sizeof *regs);
  regs[i] = (region){.va = va, .size = n, .asked = size, .h = h, .dev = dev, .ctx = ctx};
  nregs++;
  regs_gen++;
  owned_bytes += n;
  if (owned_bytes > owned_peak) owned_peak = owned_bytes;
  if (!instance) instance = shim_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&instance;
  pthread_mutex_unlock(&vmm_mu);
  sub_exit();
  atomic_fetch_add(&st_owned, 1);
  *p = va;
  return CUDA_SUCCESS;
}

int vmm_free(CUdeviceptr p) {
  if (!cfg.owned || !p) return -1;
  pthread_mutex_lock(&vmm_mu);
  region *g = region_of(p);
  int owned = g && g->va == p;
  pthread_mutex_unlock(&vmm_mu);
  if (!owned) return -1;
  sub_enter();
  pthread_mutex_lock(&vmm_mu);
  g = region_of(p);
  if (!g || g->va != p) {  // freed meanwhile by another thread
    pthread_mutex_unlock(&vmm_mu);
    sub_exit();
    return CUDA_ERROR_INVALID_VALUE;
  }
  region r = *g;
  // cudaFree's contract: work queued before it that uses the memory completes first.
  CUcontext x;
  if (v.ctx_push(r.ctx) == CUDA_SUCCESS) {
    v.ctx_sync();
    v.ctx_pop(&x);
  }
  if (!released) v.unmap(r.va, r.size), v.release(r.h);
  v.addr_free(r.va, r.size);
  size_t i = (size_t)(g - regs);
  memmove(&regs[i], &regs[i + 1], (nregs - i - 1) * sizeof *regs);
  nregs--;
  regs_gen++;
  owned_bytes -= r.size;
  pthread_mutex_unlock(&vmm_mu);
  sub_exit();
  atomic_fetch_add(&st_freed, 1);
  return CUDA_SUCCESS;
}

int vmm_range(CUdeviceptr p, CUdeviceptr *base, size_t *size) {
  if (!cfg.owned) return 0;
  pthread_mutex_lock(&vmm_mu);
  region *g = region_of(p);
  if (g) {
    if (base) *base = g->va;
    if (size) *size = g->asked;
  }
  pthread_mutex_unlock(&vmm_mu);
  return g != NULL;
}

int vmm_ipc_refuse(CUdeviceptr p) {
  if (!vmm_range(p, NULL, NULL)) return 0;
  atomic_fetch_add(&st_ipc_refused, 1);
  LOG_ONCE("owned memory cannot be shared through CUDA IPC: cuIpcGetMemHandle refused (run without --owned-memory)");
  return 1;
}

int vmm_released(void) {
  pthread_mutex_lock(&vmm_mu);
  int r = released;
  pthread_mutex_unlock(&vmm_mu);
  return r;
}

void vmm_report_status(jbuf *b) {
  pthread_mutex_lock(&vmm_mu);
  jb_printf(b,
            "{\"enabled\":%s,\"min_bytes\":%llu,\"regions\":%zu,\"bytes\":%llu,\"peak_bytes\":%llu,\"released\":%s,"
            "\"stashed\":%s,\"stash_bytes\":%zu,\"allocations\":%lu,\"fallbacks\":%lu,\"frees\":%lu,\"ipc_refused\":%lu}",
            cfg.owned ? "true" : "false", (unsigned long long)cfg.owned_min, nregs, (unsigned long long)owned_bytes,
            (unsigned long long)owned_peak, released ? "true" : "false", stash_state == 2 ? "true" : "false", stash_len, atomic_load(&st_owned),
            atomic_load(&st_fallback), atomic_load(&st_freed), atomic_load(&st_ipc_refused));
  pthread_mutex_unlock(&vmm_mu);
}

static void stash_child_reset(void);
// A child has no CUDA context of its own: the parent's regions are not its memory.
static void atfork_child(void) {
  pthread_mutex_init(&vmm_mu, NULL);
  free(regs);
  regs = NULL;
  nregs = cregs = 0;
  released = 0;
  owned_bytes = 0;
  if (stash) munmap(stash, stash_len);  // the parent's memory, copied on write: not the child's
  stash = NULL;
  stash_len = 0;
  stash_state = 0;
  stash_child_reset();
}
__attribute__((constructor)) static void vmm_fork_init(void) { pthread_atfork(NULL, NULL, atfork_child); }

// ---- the transfer session (control thread, lease connection) ----
#define MAX_SLOTS 64
#define NSTREAMS 4
typedef struct {
  int active, load;  // load: ptxmig fills the slots (restore) instead of the shim (checkpoint)
  int memfd;
  unsigned char *ring;
  size_t slot_bytes, ring_bytes;
  int nslots, pinned;
  uint64_t chunk;  // bytes per chunk
  CUcontext ctx;   // the context the copies run in (the first region's)
  CUstream st[NSTREAMS];
  CUevent ev[MAX_SLOTS];
  int busy[MAX_SLOTS];
  uint64_t nchunks;
  char in[8192];  // line buffer of what ptxmig sent during a copy (it sends at most a slot's worth ahead)
  size_t inlen;
} session;
static session ss = {.memfd = -1};

static uint64_t region_bytes(const region *g) { return (g->asked + 255) & ~(uint64_t)255; }
static uint64_t chunks_of(const region *g, uint64_t chunk) { return (region_bytes(g) + chunk - 1) / chunk; }

static void session_end(void) {
  if (!ss.active) return;
  CUcontext x;
  int pushed = ss.ctx && v.ctx_push(ss.ctx) == CUDA_SUCCESS;
  for (int i = 0; i < NSTREAMS; i++)
    if (ss.st[i]) {
      if (pushed) v.stream_sync(ss.st[i]), v.stream_destroy(ss.st[i]);
      ss.st[i] = NULL;
    }
  for (int i = 0; i < MAX_SLOTS; i++)
    if (ss.ev[i]) {
      if (pushed) v.ev_destroy(ss.ev[i]);
      ss.ev[i] = NULL;
    }
  if (ss.pinned && pushed) v.host_unregister(ss.ring);
  if (pushed) v.ctx_pop(&x);
  if (ss.ring) munmap(ss.ring, ss.ring_bytes);
  if (ss.memfd >= 0) close(ss.memfd);
  memset(&ss, 0, sizeof ss);
  ss.memfd = -1;
}

void vmm_conn_closed(void) { session_end(); }

// vmm_feed hands the session what the connection read past the request line (ptxmig sends its
// first chunks right behind mem-fill); -1 when it does not fit.
int vmm_feed(const char *p, size_t n) {
  if (n > sizeof ss.in - ss.inlen) return -1;
  memcpy(ss.in + ss.inlen, p, n);
  ss.inlen += n;
  return 0;
}

static int fail(char *err, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t n, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, n, fmt, ap);
  va_end(ap);
  return -1;
}

// sync_all waits for the work queued in every context that owns memory (kernels that did not
// stop, copies): what is copied out is what the app's work left.
static int sync_all(char *err, size_t n) {
  CUcontext done[64];
  int nd = 0;
  for (size_t i = 0; i < nregs; i++) {
    int seen = 0;
    for (int k = 0; k < nd; k++) seen |= done[k] == regs[i].ctx;
    if (seen) continue;
    if (nd < 64) done[nd++] = regs[i].ctx;
    CUcontext x;
    if (v.ctx_push(regs[i].ctx) != CUDA_SUCCESS) return fail(err, n, "owned memory: cannot enter the context of %llx", (unsigned long long)regs[i].va);
    CUresult r = v.ctx_sync();
    v.ctx_pop(&x);
    if (r != CUDA_SUCCESS) return fail(err, n, "owned memory: synchronize before the copy failed (%d)", r);
  }
  return 0;
}

static CUmodule hash_mod;
static CUfunction hash_fn;
static CUcontext hash_ctx;

// A span is a device address range hashed in chunks of the caller's chunk size, its first chunk
// being chunk number `first` of the caller's numbering.
typedef struct {
  CUdeviceptr base;
  uint64_t len, first;
} span;

// hash_spans computes the hash (ptxmig-gpuhash-1) of every chunk of every span on the GPU, on
// stream st of ctx (current), into out + 16 * chunk number (other entries untouched); nchunks is
// the size of the numbering.
static int hash_spans(const span *sp, size_t nsp, uint64_t chunk, uint64_t nchunks, CUcontext ctx, CUstream st, uint8_t *out,
                      char *err, size_t n) {
  if (!v.hash_ok) return fail(err, n, "owned memory: the driver lacks what the GPU hash needs");
  if (hash_ctx != ctx) {
    if (hash_mod) v.mod_unload(hash_mod);
    hash_mod = NULL;
    if (v.mod_load(&hash_mod, ptxmig_gpuhash_ptx) != CUDA_SUCCESS ||
        v.mod_get_fn(&hash_fn, hash_mod, PTXMIG_GPUHASH_KERNEL) != CUDA_SUCCESS) {
      hash_mod = NULL;
      return fail(err, n, "owned memory: the GPU hash kernel did not load");
    }
    hash_ctx = ctx;
  }
  CUdeviceptr sums = 0;
  size_t bytes = (size_t)nchunks * 16;
  if (v.mem_alloc(&sums, bytes ? bytes : 16) != CUDA_SUCCESS) return fail(err, n, "owned memory: no device memory for the hash sums");
  CUresult r = v.memset8_async(sums, 0, bytes, st);
  unsigned bpc = (unsigned)(chunk / (256 * 8 * 32));
  if (bpc < 1) bpc = 1;
  for (size_t i = 0; i < nsp && r == CUDA_SUCCESS; i++) {
    unsigned long long base = sp[i].base, len = sp[i].len, ch = chunk;
    CUdeviceptr o = sums + sp[i].first * 16;
    uint64_t nc = (sp[i].len + chunk - 1) / chunk;
    void *args[] = {&base, &len, &ch, &bpc, &o};
    r = v.launch(hash_fn, (unsigned)(nc * bpc), 1, 1, 256, 1, 1, 0, st, args, NULL);
  }
  uint64_t *host = malloc(bytes ? bytes : 16);
  if (r == CUDA_SUCCESS && host) r = v.dtoh_async(host, sums, bytes, st);
  if (r == CUDA_SUCCESS) r = v.stream_sync(st);
  v.mem_free(sums);
  if (!host || r != CUDA_SUCCESS) {
    free(host);
    return fail(err, n, "owned memory: GPU hash failed (%d)", r);
  }
  for (size_t i = 0; i < nsp; i++)
    for (uint64_t k = 0, nc = (sp[i].len + chunk - 1) / chunk; k < nc; k++) {
      uint64_t len = sp[i].len - k * chunk, c = sp[i].first + k;
      ptxmig_gpuhash_final(&host[2 * c], len < chunk ? len : chunk, out + 16 * c);
    }
  free(host);
  return 0;
}

// region_spans: every region, whole, numbered in chunks of chunk (vmm_mu held). NULL: no memory.
static span *region_spans(uint64_t chunk, uint64_t *nchunks) {
  span *sp = malloc((nregs ? nregs : 1) * sizeof *sp);
  uint64_t first = 0;
  for (size_t i = 0; sp && i < nregs; i++) {
    sp[i] = (span){regs[i].va, region_bytes(&regs[i]), first};
    first += chunks_of(&regs[i], chunk);
  }
  *nchunks = first;
  return sp;
}

// hash_all computes the chunk hashes of every region on its GPU into out (16 bytes per chunk,
// regions in order), in the session's context (current) and chunk size.
static int hash_all(uint8_t *out, char *err, size_t n) {
  uint64_t nc;
  span *sp = region_spans(ss.chunk, &nc);
  if (!sp) return fail(err, n, "owned memory: out of memory");
  int rc = hash_spans(sp, nregs, ss.chunk, nc, ss.ctx, ss.st[0], out, err, n);
  free(sp);
  return rc;
}


static int send_line(int sock, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int send_line(int sock, const char *fmt, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (n < 0 || (size_t)n >= sizeof buf) return -1;
  return sock_send(sock, buf, (size_t)n, -1);
}

// begin opens a transfer session: "save" (checkpoint: regions live, the process quiesced) or
// "load" (restore or rollback: regions released; their physical memory is re-created here).
// The reply lists the regions (and, for save with hash, each chunk's GPU hash) and carries the
// ring's memfd.
int vmm_cmd_begin(int sock, const char *dir, uint64_t chunk, unsigned slots, int hash, char *err, size_t errlen) {
  int load = dir && strcmp(dir, "load") == 0;
  if (!dir || (!load && strcmp(dir, "save") != 0)) return fail(err, errlen, "mem-begin: dir must be save or load");
  if (chunk < (64 << 10) || chunk > (64u << 20) || (chunk & 255)) return fail(err, errlen, "mem-begin: chunk_bytes must be a multiple of 256 from 64 KiB to 64 MiB");
  if (slots < 1 || slots > MAX_SLOTS) return fail(err, errlen, "mem-begin: slots must be 1 to %d", MAX_SLOTS);
  if (!v_ready()) return fail(err, errlen, "mem-begin: the driver lacks the VMM entry points");
  int st = preempt_state();
  if (st == 0) return fail(err, errlen, "mem-begin: not quiesced");
  session_end();
  ss.inlen = 0;
  uint64_t t0 = shim_now_ns();
  pthread_mutex_lock(&vmm_mu);
  if (stash_state == 2) {
    pthread_mutex_unlock(&vmm_mu);
    return fail(err, errlen, "mem-begin: owned memory is stashed (mem-unstash first)");
  }
  if (load != released) {
    pthread_mutex_unlock(&vmm_mu);
    return fail(err, errlen, load ? "mem-begin load: owned memory is not released" : "mem-begin save: owned memory is released (load it first)");
  }
  if (!load && sync_all(err, errlen)) {
    pthread_mutex_unlock(&vmm_mu);
    return -1;
  }
  uint64_t t_sync = shim_now_ns();
  int rc = -1;
  ss.chunk = chunk;
  ss.nslots = (int)slots;
  ss.slot_bytes = chunk;
  ss.ring_bytes = chunk * slots;
  ss.ctx = nregs ? regs[0].ctx : NULL;
  ss.load = load;
  ss.nchunks = 0;
  for (size_t i = 0; i < nregs; i++) ss.nchunks += chunks_of(&regs[i], chunk);
  uint8_t *hashes = NULL;
  CUcontext x;
  int pushed = 0;
  size_t remapped = 0;
  if (nregs) {
    if (v.ctx_push(ss.ctx) != CUDA_SUCCESS) {
      fail(err, errlen, "mem-begin: cannot enter the owning context");
      goto out;
    }
    pushed = 1;
  }
  if (load) {
    // The physical memory again, at the same addresses. A failure unmaps what was re-created.
    for (; remapped < nregs; remapped++) {
      CUresult r = map_phys(regs[remapped].va, regs[remapped].size, regs[remapped].dev, &regs[remapped].h);
      if (r != CUDA_SUCCESS) {
        fail(err, errlen, "mem-begin load: re-creating %zu bytes at %llx on device %d failed (%d)", regs[remapped].size,
             (unsigned long long)regs[remapped].va, regs[remapped].dev, r);
        for (size_t k = 0; k < remapped; k++) unmap_phys(&regs[k]);
        goto out;
      }
    }
    released = 0;
  }
  ss.memfd = memfd_create("ptxmig-devmem", MFD_CLOEXEC);
  if (ss.memfd < 0 || ftruncate(ss.memfd, (off_t)ss.ring_bytes)) {
    fail(err, errlen, "mem-begin: memfd: %s", strerror(errno));
    goto out;
  }
  ss.ring = mmap(NULL, ss.ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, ss.memfd, 0);
  if (ss.ring == MAP_FAILED) {
    ss.ring = NULL;
    fail(err, errlen, "mem-begin: mmap the ring: %s", strerror(errno));
    goto out;
  }
  ss.active = 1;
  if (nregs) {
    ss.pinned = v.host_register && v.host_register(ss.ring, ss.ring_bytes, 0) == CUDA_SUCCESS;
    if (!ss.pinned) LOG_ONCE("owned memory: the ring could not be pinned; copies run from pageable memory");
    for (int i = 0; i < NSTREAMS; i++)
      if (v.stream_create(&ss.st[i], 1 /* non-blocking */) != CUDA_SUCCESS) {
        fail(err, errlen, "mem-begin: cannot create a copy stream");
        goto out;
      }
    for (int i = 0; i < ss.nslots; i++)
      if (v.ev_create(&ss.ev[i], 2 /* disable timing */) != CUDA_SUCCESS) {
        fail(err, errlen, "mem-begin: cannot create an event");
        goto out;
      }
  }
  uint64_t t_hash = shim_now_ns();
  if (!load && hash && nregs) {
    hashes = malloc((size_t)ss.nchunks * 16);
    if (!hashes) {
      fail(err, errlen, "mem-begin: out of memory");
      goto out;
    }
    if (hash_all(hashes, err, errlen)) goto out;
  }
  uint64_t t_end = shim_now_ns();
  jbuf b = {0};
  jb_printf(&b, "{\"ok\":true,\"proto\":%d,\"cmd\":\"mem-begin\",\"result\":{\"dir\":\"%s\",\"instance\":\"%016llx\",",
            PTXMIG_PROTO_VERSION, load ? "load" : "save", (unsigned long long)instance);
  jb_printf(&b, "\"chunk_bytes\":%llu,\"slots\":%d,\"pinned\":%s,\"chunks\":%llu,\"hash\":\"%s\",", (unsigned long long)chunk,
            ss.nslots, ss.pinned ? "true" : "false", (unsigned long long)ss.nchunks, hashes ? PTXMIG_GPUHASH_NAME : "");
  jb_printf(&b, "\"sync_us\":%llu,\"remap_us\":%llu,\"hash_us\":%llu,\"regions\":[",
            (unsigned long long)(t_sync - t0) / 1000, load ? (unsigned long long)(t_hash - t_sync) / 1000 : 0ull,
            (unsigned long long)(t_end - t_hash) / 1000);
  uint64_t c = 0;
  for (size_t i = 0; i < nregs; i++) {
    jb_printf(&b, "%s{\"va\":%llu,\"size\":%llu,\"asked\":%llu,\"bytes\":%llu,\"device\":%d", i ? "," : "",
              (unsigned long long)regs[i].va, (unsigned long long)regs[i].size, (unsigned long long)regs[i].asked,
              (unsigned long long)region_bytes(&regs[i]), regs[i].dev);
    uint64_t nc = chunks_of(&regs[i], chunk);
    if (hashes) {
      jb_s(&b, ",\"hashes\":\"");
      static const char hx[] = "0123456789abcdef";
      for (uint64_t k = 0; k < nc; k++, c++) {
        char h[33];
        for (int j = 0; j < 16; j++) h[2 * j] = hx[hashes[16 * c + j] >> 4], h[2 * j + 1] = hx[hashes[16 * c + j] & 15];
        jb_raw(&b, h, 32);
      }
      jb_s(&b, "\"");
    }
    jb_s(&b, "}");
  }
  jb_s(&b, "]}}\n");
  if (b.oom) {
    free(b.p);
    fail(err, errlen, "mem-begin: out of memory building the reply");
    goto out;
  }
  if (sock_send(sock, b.p, b.len, ss.memfd)) {
    free(b.p);
    fail(err, errlen, "mem-begin: send: %s", strerror(errno));
    goto out;
  }
  free(b.p);
  rc = 0;
out:
  free(hashes);
  if (pushed) v.ctx_pop(&x);
  pthread_mutex_unlock(&vmm_mu);
  if (rc) session_end();
  if (rc && load && remapped == nregs && nregs) {  // re-created, but the session failed: release again
    pthread_mutex_lock(&vmm_mu);
    for (size_t k = 0; k < nregs; k++) unmap_phys(&regs[k]);
    released = 1;
    pthread_mutex_unlock(&vmm_mu);
  }
  return rc;
}

// chunk_at maps a global chunk index to its region and offset (vmm_mu held).
static region *chunk_at(uint64_t c, uint64_t *off, uint64_t *len) {
  for (size_t i = 0; i < nregs; i++) {
    uint64_t nc = chunks_of(&regs[i], ss.chunk);
    if (c < nc) {
      *off = c * ss.chunk;
      uint64_t rest = region_bytes(&regs[i]) - *off;
      *len = rest < ss.chunk ? rest : ss.chunk;
      return &regs[i];
    }
    c -= nc;
  }
  return NULL;
}

// read_msg waits up to ms for one line from ptxmig and parses it: 1 with the keys' values
// (-1 when absent), 0 on timeout, -1 on error or a malformed line.
static int read_msg(int sock, int ms, const char *const *keys, long long *out, int nkeys, char *err, size_t errlen) {
  for (;;) {
    char *nl = memchr(ss.in, '\n', ss.inlen);
    if (nl) {
      size_t n = (size_t)(nl - ss.in);
      char *vals[4] = {0};
      char perr[128];
      int r = json_flat_parse(ss.in, n, keys, vals, (size_t)nkeys, perr, sizeof perr);
      memmove(ss.in, nl + 1, ss.inlen - n - 1);
      ss.inlen -= n + 1;
      if (r < 0) return fail(err, errlen, "malformed message during the copy: %s", perr);
      for (int i = 0; i < nkeys; i++) {
        out[i] = -1;
        if (vals[i]) {
          char *end;
          errno = 0;
          long long x = strtoll(vals[i], &end, 10);
          if (!errno && !*end && x >= 0) out[i] = x;
          free(vals[i]);
        }
      }
      return 1;
    }
    if (ss.inlen == sizeof ss.in) return fail(err, errlen, "message during the copy longer than %zu bytes", sizeof ss.in);
    struct pollfd pf = {.fd = sock, .events = POLLIN};
    int pr = poll(&pf, 1, ms);
    if (pr < 0 && errno == EINTR) continue;
    if (pr < 0) return fail(err, errlen, "poll: %s", strerror(errno));
    if (pr == 0) return 0;
    ssize_t r = recv(sock, ss.in + ss.inlen, sizeof ss.in - ss.inlen, 0);
    if (r <= 0) return fail(err, errlen, "ptxmig closed the connection during the copy");
    ss.inlen += (size_t)r;
  }
}

#define PEER_TIMEOUT_MS 60000

// vmm_cmd_copy (save): copies each chunk not marked in skip (hex bitmap, bit c of nibble c/4 is
// chunk c: 1 skip) into a free slot, in order, and tells ptxmig {"chunk","slot","len"} once it is
// there; ptxmig answers {"free":slot} when it no longer needs the slot.
int vmm_cmd_copy(int sock, const char *skip, jbuf *b, char *err, size_t errlen) {
  if (!ss.active || ss.load) return fail(err, errlen, "mem-copy: no save session (mem-begin save first)");
  size_t sl = skip ? strlen(skip) : 0;
  if (sl && sl != (ss.nchunks + 3) / 4) return fail(err, errlen, "mem-copy: skip must have %llu hex digits", (unsigned long long)(ss.nchunks + 3) / 4);
  for (size_t i = 0; i < sl; i++)
    if (!((skip[i] >= '0' && skip[i] <= '9') || (skip[i] >= 'a' && skip[i] <= 'f'))) return fail(err, errlen, "mem-copy: skip is not lower-case hex");
  uint64_t t0 = shim_now_ns();
  pthread_mutex_lock(&vmm_mu);
  CUcontext x;
  if (nregs && v.ctx_push(ss.ctx) != CUDA_SUCCESS) {
    pthread_mutex_unlock(&vmm_mu);
    return fail(err, errlen, "mem-copy: cannot enter the owning context");
  }
  static const char *const keys[] = {"#free"};
  int order[MAX_SLOTS], head = 0, tail = 0;  // slots in copy order, awaiting notification
  uint64_t chunk_of_slot[MAX_SLOTS];
  uint64_t next = 0, copied = 0, bytes = 0, skipped = 0, gpu_ns = 0, peer_ns = 0;
  int rc = 0;
  memset(ss.busy, 0, sizeof ss.busy);
  for (;;) {
    // Issue copies into free slots.
    while (next < ss.nchunks) {
      int skipc = sl && (((skip[next / 4] <= '9' ? skip[next / 4] - '0' : skip[next / 4] - 'a' + 10) >> (next % 4)) & 1);
      if (skipc) {
        next++;
        skipped++;
        continue;
      }
      int s = -1;
      for (int i = 0; i < ss.nslots && s < 0; i++)
        if (!ss.busy[i]) s = i;
      if (s < 0) break;
      uint64_t off, len;
      region *g = chunk_at(next, &off, &len);
      CUstream st = ss.st[next % NSTREAMS];
      CUresult r = v.dtoh_async(ss.ring + (size_t)s * ss.slot_bytes, g->va + off, len, st);
      if (r == CUDA_SUCCESS) r = v.ev_record(ss.ev[s], st);
      if (r != CUDA_SUCCESS) {
        rc = fail(err, errlen, "mem-copy: copy of chunk %llu failed (%d)", (unsigned long long)next, r);
        goto out;
      }
      ss.busy[s] = 1;
      chunk_of_slot[s] = next;
      order[tail++ % MAX_SLOTS] = s;
      next++;
    }
    if (head == tail) break;  // nothing in flight and nothing left
    // Tell ptxmig about the oldest copy once it landed.
    int s = order[head % MAX_SLOTS];
    uint64_t tw = shim_now_ns();
    CUresult r = v.ev_sync(ss.ev[s]);
    gpu_ns += shim_now_ns() - tw;
    if (r != CUDA_SUCCESS) {
      rc = fail(err, errlen, "mem-copy: copy of chunk %llu failed (%d)", (unsigned long long)chunk_of_slot[s], r);
      goto out;
    }
    uint64_t off, len;
    chunk_at(chunk_of_slot[s], &off, &len);
    if (send_line(sock, "{\"chunk\":%llu,\"slot\":%d,\"len\":%llu}\n", (unsigned long long)chunk_of_slot[s], s, (unsigned long long)len)) {
      rc = fail(err, errlen, "mem-copy: send: %s", strerror(errno));
      goto out;
    }
    head++;
    copied++;
    bytes += len;
    ss.busy[s] = 2;  // with ptxmig
    // Collect the slots ptxmig gave back: wait only when no slot is free for the next copy.
    for (;;) {
      int any_free = 0, with_peer = 0;
      for (int i = 0; i < ss.nslots; i++) any_free |= !ss.busy[i], with_peer |= ss.busy[i] == 2;
      int need = next < ss.nchunks ? !any_free : head == tail && with_peer;
      long long f[1];
      uint64_t tp = shim_now_ns();
      int m = read_msg(sock, need ? PEER_TIMEOUT_MS : 0, keys, f, 1, err, errlen);
      if (need) peer_ns += shim_now_ns() - tp;
      if (m < 0) {
        rc = -1;
        goto out;
      }
      if (m == 0) {
        if (need) {
          rc = fail(err, errlen, "mem-copy: ptxmig gave no slot back for %d s", PEER_TIMEOUT_MS / 1000);
          goto out;
        }
        break;
      }
      if (f[0] < 0 || f[0] >= ss.nslots || ss.busy[f[0]] != 2) {
        rc = fail(err, errlen, "mem-copy: ptxmig freed slot %lld, which it does not hold", f[0]);
        goto out;
      }
      ss.busy[f[0]] = 0;
    }
  }
  jb_printf(b,
            "{\"chunks\":%llu,\"copied\":%llu,\"skipped\":%llu,\"bytes\":%llu,\"elapsed_us\":%llu,\"gpu_wait_us\":%llu,"
            "\"peer_wait_us\":%llu}",
            (unsigned long long)ss.nchunks, (unsigned long long)copied, (unsigned long long)skipped,
            (unsigned long long)bytes, (unsigned long long)(shim_now_ns() - t0) / 1000, (unsigned long long)gpu_ns / 1000,
            (unsigned long long)peer_ns / 1000);
out:
  if (nregs) v.ctx_pop(&x);
  pthread_mutex_unlock(&vmm_mu);
  if (rc) session_end();
  return rc;
}

// vmm_cmd_fill (load): ptxmig sends {"chunk","slot","len"} for each chunk it put in a slot and
// {"end":N} after the last (N chunks in all); the shim copies each to the device and answers
// {"free":slot} once the copy is done.
int vmm_cmd_fill(int sock, jbuf *b, char *err, size_t errlen) {
  if (!ss.active || !ss.load) return fail(err, errlen, "mem-fill: no load session (mem-begin load first)");
  uint64_t t0 = shim_now_ns();
  pthread_mutex_lock(&vmm_mu);
  CUcontext x;
  if (nregs && v.ctx_push(ss.ctx) != CUDA_SUCCESS) {
    pthread_mutex_unlock(&vmm_mu);
    return fail(err, errlen, "mem-fill: cannot enter the owning context");
  }
  static const char *const keys[] = {"#chunk", "#slot", "#len", "#end"};
  uint8_t *seen = calloc((size_t)ss.nchunks + 1, 1);
  uint64_t got = 0, bytes = 0, peer_ns = 0;
  long long end = -1;
  int rc = 0;
  memset(ss.busy, 0, sizeof ss.busy);
  if (!seen) {
    rc = fail(err, errlen, "mem-fill: out of memory");
    goto out;
  }
  for (;;) {
    // Give back every slot whose copy landed.
    int inflight = 0;
    for (int i = 0; i < ss.nslots; i++) {
      if (!ss.busy[i]) continue;
      CUresult q = v.ev_query(ss.ev[i]);
      if (q == CUDA_SUCCESS) {
        ss.busy[i] = 0;
        if (send_line(sock, "{\"free\":%d}\n", i)) {
          rc = fail(err, errlen, "mem-fill: send: %s", strerror(errno));
          goto out;
        }
      } else if (q != CUDA_ERROR_NOT_READY) {
        rc = fail(err, errlen, "mem-fill: copy into the device failed (%d)", q);
        goto out;
      } else {
        inflight++;
      }
    }
    if (end >= 0 && !inflight) break;
    if (end >= 0) {
      struct timespec ts = {0, 20000};
      nanosleep(&ts, NULL);
      continue;
    }
    long long f[4];
    uint64_t tp = shim_now_ns();
    int m = read_msg(sock, inflight ? 0 : PEER_TIMEOUT_MS, keys, f, 4, err, errlen);
    if (!inflight) peer_ns += shim_now_ns() - tp;
    if (m < 0) {
      rc = -1;
      goto out;
    }
    if (m == 0) {
      if (!inflight) {
        rc = fail(err, errlen, "mem-fill: nothing from ptxmig for %d s", PEER_TIMEOUT_MS / 1000);
        goto out;
      }
      struct timespec ts = {0, 10000};
      nanosleep(&ts, NULL);
      continue;
    }
    if (f[3] >= 0) {
      end = f[3];
      if ((uint64_t)end != got || got != ss.nchunks) {
        rc = fail(err, errlen, "mem-fill: ended after %llu of %llu chunks", (unsigned long long)got, (unsigned long long)ss.nchunks);
        goto out;
      }
      continue;
    }
    uint64_t off, len;
    region *g = f[0] >= 0 ? chunk_at((uint64_t)f[0], &off, &len) : NULL;
    if (!g || seen[f[0]] || f[1] < 0 || f[1] >= ss.nslots || ss.busy[f[1]] || f[2] < 0 || (uint64_t)f[2] != len) {
      rc = fail(err, errlen, "mem-fill: bad chunk message (chunk %lld slot %lld len %lld)", f[0], f[1], f[2]);
      goto out;
    }
    seen[f[0]] = 1;
    int s = (int)f[1];
    CUstream st = ss.st[(uint64_t)f[0] % NSTREAMS];
    CUresult r = v.htod_async(g->va + off, ss.ring + (size_t)s * ss.slot_bytes, len, st);
    if (r == CUDA_SUCCESS) r = v.ev_record(ss.ev[s], st);
    if (r != CUDA_SUCCESS) {
      rc = fail(err, errlen, "mem-fill: copy of chunk %lld failed (%d)", f[0], r);
      goto out;
    }
    ss.busy[s] = 1;
    got++;
    bytes += len;
  }
  for (int i = 0; i < NSTREAMS; i++) {
    CUresult r = v.stream_sync(ss.st[i]);
    if (r != CUDA_SUCCESS) {
      rc = fail(err, errlen, "mem-fill: copy into the device failed (%d)", r);
      goto out;
    }
  }
  jb_printf(b, "{\"chunks\":%llu,\"bytes\":%llu,\"elapsed_us\":%llu,\"peer_wait_us\":%llu}", (unsigned long long)got,
            (unsigned long long)bytes, (unsigned long long)(shim_now_ns() - t0) / 1000, (unsigned long long)peer_ns / 1000);
out:
  free(seen);
  if (nregs) v.ctx_pop(&x);
  pthread_mutex_unlock(&vmm_mu);
  if (rc) session_end();
  return rc;
}

// vmm_cmd_release unmaps and releases the physical memory of every region (the reservations
// stay): the driver checkpoint then has none of it to copy.
int vmm_cmd_release(jbuf *b, char *err, size_t errlen) {
  if (preempt_state() == 0) return fail(err, errlen, "mem-release: not quiesced");
  session_end();
  uint64_t t0 = shim_now_ns();
  pthread_mutex_lock(&vmm_mu);
  if (released) {
    pthread_mutex_unlock(&vmm_mu);
    return fail(err, errlen, stash_state == 2 ? "mem-release: already released (stashed)" : "mem-release: already released");
  }
  uint64_t bytes = 0;
  if (nregs && sync_all(err, errlen)) {
    pthread_mutex_unlock(&vmm_mu);
    return -1;
  }
  CUcontext x;
  int pushed = nregs && v.ctx_push(regs[0].ctx) == CUDA_SUCCESS;
  for (size_t i = 0; i < nregs; i++) {
    unmap_phys(&regs[i]);
    bytes += regs[i].size;
  }
  if (pushed) v.ctx_pop(&x);
  released = 1;
  pthread_mutex_unlock(&vmm_mu);
  jb_printf(b, "{\"released_bytes\":%llu,\"regions\":%zu,\"elapsed_us\":%llu}", (unsigned long long)bytes, nregs,
            (unsigned long long)(shim_now_ns() - t0) / 1000);
  return 0;
}

int vmm_cmd_end(jbuf *b) {
  session_end();
  jb_printf(b, "{\"released\":%s}", vmm_released() ? "true" : "false");
  return 0;
}

// ---- the stash (migrate): owned memory parked in the process's own host memory ----
// mem-prepare (the process running) readies the stash ahead of the stop: one anonymous mapping of
// the owned bytes (regions back to back), transparent huge pages, populated and pinned (on an
// H200, 8 GiB take 1.3 s to populate and 0.2 s to pin: work that would otherwise be downtime).
// mem-precopy rounds (still running) copy into it every chunk whose GPU hash differs from the hash
// of what the stash holds (hashed by the GPU through the pinned mapping, so a chunk the app wrote
// during its copy is never taken for clean). mem-stash (quiesced) copies what still differs, or
// everything when nothing was pre-copied, unpins the stash (plain process memory while the driver
// checkpoints) and releases the physical memory. mem-unstash re-creates the memory at the same
// addresses and copies it back, pinning piece by piece ahead of the copies; the stash is unpinned
// and freed after the resume's reply (vmm_stash_drop), once the process runs again. The bytes
// never leave the process, so a ptxmig that dies in between loses nothing: a resume, or the lease
// connection closing, unstashes first (ctl.c). A prepared stash left unused for PREPARED_TTL_S is
// freed (vmm_tick).
#define STASH_PIECE (64ull << 20)  // bytes per async copy, round-robin over NSTREAMS streams
#define PIN_PIECE (256ull << 20)   // bytes per registration
#define STASH_CHUNK (4ull << 20)   // the pre-copy's unit
#define PREPARED_TTL_S 60
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
enum { ST_NONE, ST_PREPARED, ST_STASHED, ST_DRAINING };  // stash_state
_Static_assert(ST_STASHED == 2, "status reads stash_state == 2");
static unsigned char *pinned;  // vmm_mu: per PIN_PIECE of the stash, registered with the driver
static uint64_t prepared_ns;   // vmm_mu: when it was prepared (ST_PREPARED)
// Pre-copy state (vmm_mu): per STASH_CHUNK of the regions as they were at round 1 (regs_gen), the
// hash of what the stash holds (valid where hvalid).
static uint8_t *shash, *hvalid;
static uint64_t snchunks, sgen;
static int rounds;
// The target copy (migrate, device to device; see "the target copy" below).
typedef struct {
  int filled;           // the copy holds every region as they were at gen
  uint64_t gen, bytes;  // bytes: the regions' (back to back)
  size_t size;          // the target allocation's, as mapped
} target_copy_state;
static target_copy_state tgt;  // vmm_mu

int vmm_stashed(void) {
  pthread_mutex_lock(&vmm_mu);
  int s = stash_state == ST_STASHED;
  pthread_mutex_unlock(&vmm_mu);
  return s;
}

static uint64_t owned_total(void) {  // vmm_mu held
  uint64_t n = 0;
  for (size_t i = 0; i < nregs; i++) n += region_bytes(&regs[i]);
  return n;
}
static size_t npieces(void) { return (size_t)((stash_len + PIN_PIECE - 1) / PIN_PIECE); }

// pin_piece registers piece k of the stash (the context current); 1 when it is pinned.
static int pin_piece(size_t k) {
  if (!pinned || pinned[k]) return pinned && pinned[k];
  uint64_t off = k * PIN_PIECE, len = stash_len - off < PIN_PIECE ? stash_len - off : PIN_PIECE;
  pinned[k] = v.host_register && v.host_register(stash + off, len, 0) == CUDA_SUCCESS;
  return pinned[k];
}

// stash_unpin unregisters every pinned piece. vmm_mu held.
static void stash_unpin(void) {
  if (!pinned) return;
  CUcontext x;
  int pushed = nregs && v.ctx_push(regs[0].ctx) == CUDA_SUCCESS;
  for (size_t k = 0; k < npieces(); k++)
    if (pinned[k]) v.host_unregister(stash + k * PIN_PIECE), pinned[k] = 0;
  if (pushed) v.ctx_pop(&x);
}

static void precopy_reset(void) {  // vmm_mu held
  free(shash);
  free(hvalid);
  shash = hvalid = NULL;
  snchunks = 0;
  rounds = 0;
}

static void stash_free(void) {  // vmm_mu held
  stash_unpin();
  if (stash) munmap(stash, stash_len);
  free(pinned);
  pinned = NULL;
  stash = NULL;
  stash_len = 0;
  stash_state = ST_NONE;
  tgt.filled = 0;
  precopy_reset();
}

// stash_map maps len bytes for the stash (huge pages where the kernel gives them), populated when
// populate, and pins them (the context current). 0, or -1 with errno.
static int stash_map(size_t len, int populate, uint64_t *populate_ns, uint64_t *pin_ns, int *all_pinned) {
  unsigned char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return -1;
  size_t np = (size_t)((len + PIN_PIECE - 1) / PIN_PIECE);
  unsigned char *pp = calloc(np ? np : 1, 1);
  if (!pp) {
    munmap(p, len);
    errno = ENOMEM;
    return -1;
  }
  madvise(p, len, MADV_HUGEPAGE);
  uint64_t t0 = shim_now_ns();
  if (populate) madvise(p, len, MADV_POPULATE_WRITE);  // older kernels: faulted in by the pin instead
  uint64_t t1 = shim_now_ns();
  stash = p;
  stash_len = len;
  pinned = pp;
  int all = 1;
  for (size_t k = 0; k < np; k++) all &= pin_piece(k);
  if (!all) LOG_ONCE("owned memory: the stash could not be pinned; its copies run from pageable memory");
  *populate_ns = t1 - t0;
  *pin_ns = shim_now_ns() - t1;
  *all_pinned = all;
  return 0;
}

// copy_range issues the copies of stash bytes [lo, hi) to (out) or from their regions, in
// STASH_PIECE pieces round-robin over st. vmm_mu held, the context current.
static CUresult copy_range(int out, uint64_t lo, uint64_t hi, CUstream *st, size_t *n) {
  uint64_t so = 0;
  CUresult r = CUDA_SUCCESS;
  for (size_t i = 0; i < nregs && so < hi && r == CUDA_SUCCESS; i++) {
    uint64_t len = region_bytes(&regs[i]), a = lo > so ? lo : so, b = hi < so + len ? hi : so + len;
    for (uint64_t o = a; o < b && r == CUDA_SUCCESS; o += STASH_PIECE, (*n)++) {
      uint64_t k = b - o < STASH_PIECE ? b - o : STASH_PIECE;
      r = out ? v.dtoh_async(stash + o, regs[i].va + (o - so), k, st[*n % NSTREAMS])
              : v.htod_async(regs[i].va + (o - so), stash + o, k, st[*n % NSTREAMS]);
    }
    so += len;
  }
  return r;
}

static CUresult streams_open(CUstream *st) {
  CUresult r = CUDA_SUCCESS;
  for (int i = 0; i < NSTREAMS && r == CUDA_SUCCESS; i++) r = v.stream_create(&st[i], 1 /* non-blocking */);
  return r;
}
static CUresult streams_close(CUstream *st, CUresult r) {
  for (int i = 0; i < NSTREAMS; i++)
    if (st[i]) {
      CUresult q = v.stream_sync(st[i]);
      if (r == CUDA_SUCCESS) r = q;
      v.stream_destroy(st[i]);
      st[i] = NULL;
    }
  return r;
}

// chunk_span: stash chunk c (STASH_CHUNK numbering of the regions): its stash offset and length.
static void chunk_span(uint64_t c, uint64_t *off, uint64_t *len) {
  uint64_t so = 0;
  for (size_t i = 0; i < nregs; i++) {
    uint64_t nc = chunks_of(&regs[i], STASH_CHUNK), rb = region_bytes(&regs[i]);
    if (c < nc) {
      *off = so + c * STASH_CHUNK;
      *len = rb - c * STASH_CHUNK < STASH_CHUNK ? rb - c * STASH_CHUNK : STASH_CHUNK;
      return;
    }
    c -= nc;
    so += rb;
  }
  *off = *len = 0;
}

// changed_chunks hashes the regions on the GPU and lists, into list (snchunks entries), the
// chunks whose hash differs from the stash's (or that the stash has no hash of). vmm_mu held,
// the context current. Returns the count, or -1.
static int64_t changed_chunks(CUstream st, uint64_t *list, uint64_t *hash_ns, char *err, size_t errlen) {
  uint64_t t0 = shim_now_ns(), nc;
  uint8_t *hd = malloc(snchunks * 16 + 16);
  span *sp = region_spans(STASH_CHUNK, &nc);
  int rc = hd && sp && nc == snchunks ? hash_spans(sp, nregs, STASH_CHUNK, nc, regs[0].ctx, st, hd, err, errlen)
                                      : fail(err, errlen, "owned memory: out of memory");
  free(sp);
  int64_t n = 0;
  for (uint64_t c = 0; rc == 0 && c < snchunks; c++)
    if (!hvalid[c] || memcmp(hd + 16 * c, shash + 16 * c, 16)) list[n++] = c;
  free(hd);
  *hash_ns = shim_now_ns() - t0;
  return rc ? -1 : n;
}

// copy_chunks copies the listed chunks into the stash and waits. vmm_mu held, the context current.
static CUresult copy_chunks(const uint64_t *list, int64_t n, uint64_t *bytes) {
  CUstream st[NSTREAMS] = {0};
  CUresult r = streams_open(st);
  size_t k = 0;
  *bytes = 0;
  for (int64_t i = 0; i < n && r == CUDA_SUCCESS; i++) {
    uint64_t off, len;
    chunk_span(list[i], &off, &len);
    r = copy_range(1, off, off + len, st, &k);
    *bytes += len;
  }
  return streams_close(st, r);
}

// vmm_cmd_prepare (the process running, memory live): ready a stash of the owned bytes.
int vmm_cmd_prepare(jbuf *b, char *err, size_t errlen) {
  if (!v_ready()) return fail(err, errlen, "mem-prepare: the driver lacks the VMM entry points");
  pthread_mutex_lock(&vmm_mu);
  if (released || stash_state == ST_STASHED) {
    pthread_mutex_unlock(&vmm_mu);
    return fail(err, errlen, "mem-prepare: owned memory is released");
  }
  stash_free();
  uint64_t bytes = owned_total();
  CUcontext ctx = nregs ? regs[0].ctx : NULL, x;
  uint64_t gen = regs_gen;
  // Mapped, populated and pinned without the lock: the app's allocations and frees go on
  // meanwhile. Only this (the control) thread touches the stash's variables; other threads read
  // stash_state, which says ST_NONE until the stash is installed below.
  pthread_mutex_unlock(&vmm_mu);
  int all = 0, ok = 0;
  uint64_t pop_ns = 0, pin_ns = 0;
  if (bytes && v.ctx_push(ctx) == CUDA_SUCCESS) {
    ok = stash_map(bytes, 1, &pop_ns, &pin_ns, &all) == 0;
    v.ctx_pop(&x);
  }
  if (ok) {
    pthread_mutex_lock(&vmm_mu);
    stash_state = ST_PREPARED;
    prepared_ns = shim_now_ns();
    sgen = gen;
    pthread_mutex_unlock(&vmm_mu);
  }
  jb_printf(b, "{\"bytes\":%llu,\"pinned\":%s,\"populate_us\":%llu,\"pin_us\":%llu}", (unsigned long long)(ok ? bytes : 0),
            all ? "true" : "false", (unsigned long long)pop_ns / 1000, (unsigned long long)pin_ns / 1000);
  return 0;
}

// vmm_cmd_precopy (the process running, a prepared stash): one round: copy into the stash every
// chunk whose GPU hash differs from the stash's, then hash what the stash now holds (the GPU
// reading it through its pinned mapping). With unpin, the stash is unpinned after the round (a
// stop with little left to copy then skips the unpin; its copies run from pageable memory).
int vmm_cmd_precopy(int unpin, jbuf *b, char *err, size_t errlen) {
  if (!v_ready()) return fail(err, errlen, "mem-precopy: the driver lacks the VMM entry points");
  uint64_t t0 = shim_now_ns();
  pthread_mutex_lock(&vmm_mu);
  int rc = -1;
  CUcontext x;
  CUstream hs = NULL;
  uint64_t *list = NULL, hash_ns = 0, copy_ns = 0, shash_ns = 0, bytes = 0;
  int64_t n = 0;
  if (stash_state != ST_PREPARED || released) {
    pthread_mutex_unlock(&vmm_mu);
    return fail(err, errlen, "mem-precopy: no prepared stash (mem-prepare first)");
  }
  if (sgen != regs_gen || stash_len != owned_total() || !nregs) {
    pthread_mutex_unlock(&vmm_mu);
    return fail(err, errlen, "mem-precopy: the owned allocations changed since mem-prepare");
  }
  if (!shash) {
    uint64_t nc = 0;
    for (size_t i = 0; i < nregs; i++) nc += chunks_of(&regs[i], STASH_CHUNK);
    shash = calloc(nc ? nc : 1, 16);
    hvalid = calloc(nc ? nc : 1, 1);
    snchunks = nc;
    if (!shash || !hvalid) {
      precopy_reset();
      pthread_mutex_unlock(&vmm_mu);
      return fail(err, errlen, "mem-precopy: out of memory");
    }
  }
  if (v.ctx_push(regs[0].ctx) != CUDA_SUCCESS) {
    pthread_mutex_unlock(&vmm_mu);
    return fail(err, errlen, "mem-precopy: cannot enter the owning context");
  }
  list = malloc(snchunks * sizeof *list + 8);
  if (!list || v.stream_create(&hs, 1) != CUDA_SUCCESS) {
    fail(err, errlen, "mem-precopy: out of resources");
    goto out;
  }
  n = changed_chunks(hs, list, &hash_ns, err, errlen);
  if (n < 0) goto out;
  uint64_t t1 = shim_now_ns();
  CUresult r = copy_chunks(list, n, &bytes);
  copy_ns = shim_now_ns() - t1;
  if (r != CUDA_SUCCESS) {
    fail(err, errlen, "mem-precopy: copy failed (%d)", r);
    goto out;
  }
  // What the stash now holds, as the GPU reads it: the truth a later round compares with.
  uint64_t t2 = shim_now_ns();
  span *sp = malloc((size_t)(n ? n : 1) * sizeof *sp);
  if (!sp) {
    fail(err, errlen, "mem-precopy: out of memory");
    goto out;
  }
  int all_pinned = 1;
  for (size_t k = 0; k < npieces(); k++) all_pinned &= pinned[k];
  for (int64_t i = 0; i < n; i++) {
    uint64_t off, len;
    chunk_span(list[i], &off, &len);
    sp[i] = (span){(CUdeviceptr)(uintptr_t)(stash + off), len, list[i]};
  }
  // Only a pinned stash can be read by the GPU; otherwise its chunks stay without a hash (copied
  // again at the stop).
  int hr = n && all_pinned ? hash_spans(sp, (size_t)n, STASH_CHUNK, snchunks, regs[0].ctx, hs, shash, err, errlen) : 0;
  free(sp);
  if (hr) goto out;
  for (int64_t i = 0; i < n; i++) hvalid[list[i]] = (uint8_t)all_pinned;
  shash_ns = shim_now_ns() - t2;
  rounds++;
  if (unpin) stash_unpin();
  jb_printf(b,
            "{\"round\":%d,\"chunks\":%llu,\"copied_chunks\":%lld,\"bytes\":%llu,\"hash_us\":%llu,\"copy_us\":%llu,"
            "\"stash_hash_us\":%llu,\"pinned\":%s,\"elapsed_us\":%llu}",
            rounds, (unsigned long long)snchunks, (long long)n, (unsigned long long)bytes, (unsigned long long)hash_ns / 1000,
            (unsigned long long)copy_ns / 1000, (unsigned long long)shash_ns / 1000, unpin ? "false" : "true",
            (unsigned long long)(shim_now_ns() - t0) / 1000);
  rc = 0;
out:
  if (rc) precopy_reset();  // a failed round leaves no hash to trust
  if (hs) v.stream_destroy(hs);
  free(list);
  v.ctx_pop(&x);
  pthread_mutex_unlock(&vmm_mu);
  return rc;
}

// ---- the target copy (migrate, device to device) ----
// For a migrate, ptxmig keeps memory of the owned size on the target GPU (an allocation of its
// own, exported as a POSIX fd) and hands it to mem-stash: after the stash, the shim imports it,
// maps it read-write for the owned memory's device (a peer mapping when the target is another
// GPU), copies every region into it back to back (the stash's layout) and drops the mapping and
// the handle before the reply, so nothing of another process is mapped when the driver
// checkpoints (driver 580 restores a process whose VMM peer mapping was dropped so:
// scripts/probe-peer.sh vmm-peer). mem-unstash, given the same memory again, copies from it on the
// target, where it is now local, instead of pinning the stash and copying from the host. The stash
// stays the copy of record: no fd, a failed import, map or copy, or regions changed since, and
// the host path runs. A target copy is never mapped outside these two requests.
#define HANDLE_POSIX_FD 1

// target_map imports fd (a POSIX fd handle of at least size bytes) and maps it read-write for
// dev. vmm_mu held, the context current. 0, or a CUresult with what failed in *what.
static CUresult target_map(int fd, size_t size, CUdevice dev, CUdeviceptr *va, CUmemGenericAllocationHandle *h,
                           const char **what) {
  size_t g = granularity(dev);
  *va = 0;
  *h = 0;
  if (!v.import || !v.dtod_async) return *what = "the driver lacks cuMemImportFromShareableHandle", CUDA_ERROR_NOT_SUPPORTED;
  if (!g || size % g) return *what = "its size is not a multiple of the allocation granularity", CUDA_ERROR_INVALID_VALUE;
  CUresult r = v.import(h, (void *)(intptr_t)fd, HANDLE_POSIX_FD);
  if (r != CUDA_SUCCESS) return *what = "import", r;
  r = v.reserve(va, size, g, 0, 0);
  if (r != CUDA_SUCCESS) {
    v.release(*h);
    return *what = "reserve", r;
  }
  r = v.map(*va, size, 0, *h, 0);
  if (r == CUDA_SUCCESS) {
    mem_access_desc a = {.location = {LOC_DEVICE, dev}, .flags = ACCESS_RW};
    r = v.set_access(*va, size, &a, 1);
    if (r != CUDA_SUCCESS) *what = "set access", v.unmap(*va, size);
  } else {
    *what = "map";
  }
  if (r != CUDA_SUCCESS) {
    v.addr_free(*va, size);
    v.release(*h);
  }
  return r;
}

// target_unmap drops the mapping and the imported handle: 0, or the first failure.
static CUresult target_unmap(CUdeviceptr va, size_t size, CUmemGenericAllocationHandle h) {
  CUresult r = v.unmap(va, size), q = v.addr_free(va, size), w = v.release(h);
  return r != CUDA_SUCCESS ? r : q != CUDA_SUCCESS ? q : w;
}

// target_copy copies every region to (out) or from the target copy mapped at base, back to back,
// in STASH_PIECE pieces over NSTREAMS streams, and waits. vmm_mu held, the context current.
static CUresult target_copy(int out, CUdeviceptr base) {
  CUstream st[NSTREAMS] = {0};
  CUresult r = streams_open(st);
  uint64_t so = 0;
  size_t n = 0;
  for (size_t i = 0; i < nregs && r == CUDA_SUCCESS; i++) {
    uint64_t len = region_bytes(&regs[i]);
    for (uint64_t o = 0; o < len && r == CUDA_SUCCESS; o += STASH_PIECE, n++) {
      uint64_t k = len - o < STASH_PIECE ? len - o : STASH_PIECE;
      r = out ? v.dtod_async(base + so + o, regs[i].va + o, k, st[n % NSTREAMS])
              : v.dtod_async(regs[i].va + o, base + so + o, k, st[n % NSTREAMS]);
    }
    so += len;
  }
  return streams_close(st, r);
}

// target_fill (mem-stash, after the stash): copy the regions into the target copy fd names and
// drop it. Its report goes into b; a failure to use it is reported there, not returned (the stash
// holds everything). -1 (with err) only when the copy cannot be unmapped: the process must not be
// checkpointed with another process's memory mapped. vmm_mu held, the context current.
static int target_fill(int fd, uint64_t bytes, jbuf *b, char *err, size_t errlen) {
  uint64_t t0 = shim_now_ns(), total = owned_total();
  CUdeviceptr va = 0;
  CUmemGenericAllocationHandle h = 0;
  const char *what = "";
  CUresult r = CUDA_ERROR_INVALID_VALUE;
  tgt.filled = 0;
  int same = 1;
  for (size_t i = 1; i < nregs; i++) same &= regs[i].dev == regs[0].dev;
  if (!same) what = "the owned memory is on several GPUs";
  else if (bytes < total) what = "it is smaller than the owned memory";
  else r = target_map(fd, bytes, regs[0].dev, &va, &h, &what);
  uint64_t t1 = shim_now_ns();
  if (r == CUDA_SUCCESS) {
    r = target_copy(1, va);
    if (r != CUDA_SUCCESS) what = "copy";
    CUresult u = target_unmap(va, bytes, h);
    if (u != CUDA_SUCCESS) return fail(err, errlen, "mem-stash: dropping the target copy's mapping failed (%d)", u);
  }
  if (r == CUDA_SUCCESS) tgt = (target_copy_state){.filled = 1, .gen = regs_gen, .bytes = total, .size = bytes};
  uint64_t t2 = shim_now_ns();
  jb_printf(b, "{\"filled\":%s,\"bytes\":%llu,\"map_us\":%llu,\"copy_us\":%llu", r == CUDA_SUCCESS ? "true" : "false",
            (unsigned long long)(r == CUDA_SUCCESS ? total : 0), (unsigned long long)(t1 - t0) / 1000, (unsigned long long)(t2 - t1) / 1000);
  if (r != CUDA_SUCCESS) {
    char e[160];
    snprintf(e, sizeof e, "%s (%d): the stash alone is used", what, r);
    jb_s(b, ",\"error\":");
    jb_str(b, e, strlen(e));
  }
  jb_s(b, "}");
  return 0;
}

// target_load (mem-unstash, the regions re-created): copy them from the target copy fd names. 0
// when done; otherwise what failed is in *what and the caller copies from the stash. vmm_mu held,
// the context current.
static CUresult target_load(int fd, const char **what) {
  CUdeviceptr va = 0;
  CUmemGenericAllocationHandle h = 0;
  if (!tgt.filled || tgt.gen != regs_gen || tgt.bytes != owned_total()) return *what = "no target copy of these regions", CUDA_ERROR_INVALID_VALUE;
  size_t size = tgt.size;
  CUresult r = target_map(fd, size, regs[0].dev, &va, &h, what);
  if (r != CUDA_SUCCESS) return r;
  r = target_copy(0, va);
  if (r != CUDA_SUCCESS) *what = "copy";
  CUresult u = target_unmap(va, size, h);
  if (u != CUDA_SUCCESS) shim_log("owned memory: dropping the target copy's mapping failed (%d); it stays mapped in this process", u);
  return r;
}

// vmm_cmd_stash (quiesced, memory live): copy into the stash what it does not hold yet (after
// pre-copy rounds: the chunks whose hash differs; else everything, into a stash mapped now when
// none was prepared or the regions changed since), unpin it, then release the physical memory. On
// failure nothing is released and the stash is gone.
int vmm_cmd_stash(int fd, uint64_t target_bytes, jbuf *b, char *err, size_t errlen) {
  if (preempt_state() == 0) return fail(err, errlen, "mem-stash: not quiesced");
  if (!v_ready()) return fail(err, errlen, "mem-stash: the driver lacks the VMM entry points");
  session_end();
  uint64_t t0 = shim_now_ns();
  pthread_mutex_lock(&vmm_mu);
  if (released) {
    pthread_mutex_unlock(&vmm_mu);
    return fail(err, errlen, stash_state == ST_STASHED ? "mem-stash: already stashed" : "mem-stash: owned memory is released (load it first)");
  }
  int rc = -1, pushed = 0, all = 1, prepared = 0, precopied = 0;
  uint64_t total = owned_total(), bytes = 0, pop_ns = 0, pin_ns = 0, hash_ns = 0, copy_ns = 0, unpin_ns = 0, t_rel = 0;
  jbuf tb = {0};  // the target copy's report
  tgt.filled = 0;
  CUcontext x;
  CUstream hs = NULL;
  uint64_t *list = NULL;
  if (nregs && sync_all(err, errlen)) goto out;
  uint64_t t_sync = shim_now_ns();
  if (nregs) {
    if (v.ctx_push(regs[0].ctx) != CUDA_SUCCESS) {
      fail(err, errlen, "mem-stash: cannot enter the owning context");
      goto out;
    }
    pushed = 1;
    prepared = stash_state == ST_PREPARED && stash_len == total && sgen == regs_gen;
    if (!prepared) {  // none prepared, or the regions changed since: a stash of their size now
      stash_free();
      if (stash_map(total, 0, &pop_ns, &pin_ns, &all)) {
        fail(err, errlen, "mem-stash: %llu bytes of host memory: %s", (unsigned long long)total, strerror(errno));
        goto out;
      }
    }
    if (prepared)
      for (size_t k = 0; k < npieces(); k++) all &= pinned[k];
    precopied = prepared && shash && rounds > 0;
    uint64_t t1 = shim_now_ns();
    CUresult r;
    if (precopied) {
      list = malloc(snchunks * sizeof *list + 8);
      int64_t n = list && v.stream_create(&hs, 1) == CUDA_SUCCESS ? changed_chunks(hs, list, &hash_ns, err, errlen)
                                                                   : fail(err, errlen, "mem-stash: out of resources");
      if (n < 0) {
        stash_free();
        goto out;
      }
      t1 = shim_now_ns();
      r = copy_chunks(list, n, &bytes);
    } else {
      CUstream st[NSTREAMS] = {0};
      size_t k = 0;
      r = streams_open(st);
      if (r == CUDA_SUCCESS) r = copy_range(1, 0, stash_len, st, &k);
      r = streams_close(st, r);
      bytes = total;
    }
    uint64_t t2 = shim_now_ns();
    copy_ns = t2 - t1;
    // The target copy, from the memory still live (the stash holds everything by now).
    if (fd >= 0 && r == CUDA_SUCCESS && target_fill(fd, target_bytes, &tb, err, errlen)) {
      stash_free();
      goto out;
    }
    t2 = shim_now_ns();
    stash_unpin();  // plain process memory again before the driver checkpoint
    unpin_ns = shim_now_ns() - t2;
    if (r != CUDA_SUCCESS) {
      stash_free();
      fail(err, errlen, "mem-stash: copy failed (%d)", r);
      goto out;
    }
    precopy_reset();
    t_rel = shim_now_ns();
    for (size_t i = 0; i < nregs; i++) unmap_phys(&regs[i]);
    released = 1;
    stash_state = ST_STASHED;
  } else {
    stash_free();
    t_rel = shim_now_ns();
  }
  jb_printf(b,
            "{\"regions\":%zu,\"bytes\":%llu,\"copied_bytes\":%llu,\"prepared\":%s,\"precopied\":%s,\"pinned\":%s,"
            "\"sync_us\":%llu,\"populate_us\":%llu,\"pin_us\":%llu,\"hash_us\":%llu,\"copy_us\":%llu,\"unpin_us\":%llu,"
            "\"release_us\":%llu,\"elapsed_us\":%llu%s%s}",
            nregs, (unsigned long long)total, (unsigned long long)bytes, prepared ? "true" : "false",
            precopied ? "true" : "false", all ? "true" : "false", (unsigned long long)(t_sync - t0) / 1000,
            (unsigned long long)pop_ns / 1000, (unsigned long long)pin_ns / 1000, (unsigned long long)hash_ns / 1000,
            (unsigned long long)copy_ns / 1000, (unsigned long long)unpin_ns / 1000,
            (unsigned long long)(shim_now_ns() - t_rel) / 1000, (unsigned long long)(shim_now_ns() - t0) / 1000,
            tb.p ? ",\"target\":" : "", tb.p ? tb.p : "");
  rc = 0;
out:
  free(tb.p);
  if (hs) v.stream_destroy(hs);
  free(list);
  if (pushed) v.ctx_pop(&x);
  pthread_mutex_unlock(&vmm_mu);
  return rc;
}

// vmm_cmd_unstash (released and stashed): re-create every region at its address on its device
// ordinal and copy the stash back, pinning it piece by piece just ahead of the copies (they
// overlap); the stash is unpinned and freed by vmm_stash_drop, after the resume. On failure the
// regions stay released and the stash stays, so that it can be tried again. Nothing stashed: an
// empty reply.
int vmm_cmd_unstash(int fd, jbuf *b, char *err, size_t errlen) {
  if (!v_ready()) return fail(err, errlen, "mem-unstash: the driver lacks the VMM entry points");
  session_end();
  uint64_t t0 = shim_now_ns();
  pthread_mutex_lock(&vmm_mu);
  if (stash_state != ST_STASHED) {
    int nothing = !released;
    pthread_mutex_unlock(&vmm_mu);
    if (nothing) {
      jb_printf(b, "{\"regions\":0,\"bytes\":0,\"pinned\":false,\"remap_us\":0,\"pin_us\":0,\"copy_us\":0,\"elapsed_us\":0,\"from\":\"host\"}");
      return 0;
    }
    return fail(err, errlen, "mem-unstash: owned memory is released but not stashed (mem-begin load)");
  }
  int rc = -1, all = 1;
  uint64_t pin_ns = 0, bytes = stash_len;
  size_t remapped = 0;
  CUcontext x;
  if (v.ctx_push(regs[0].ctx) != CUDA_SUCCESS) {
    pthread_mutex_unlock(&vmm_mu);
    return fail(err, errlen, "mem-unstash: cannot enter the owning context");
  }
  for (; remapped < nregs; remapped++) {
    CUresult r = map_phys(regs[remapped].va, regs[remapped].size, regs[remapped].dev, &regs[remapped].h);
    if (r != CUDA_SUCCESS) {
      fail(err, errlen, "mem-unstash: re-creating %zu bytes at %llx on device %d failed (%d)", regs[remapped].size,
           (unsigned long long)regs[remapped].va, regs[remapped].dev, r);
      break;
    }
  }
  uint64_t t_map = shim_now_ns();
  const char *twhat = NULL;
  int from_target = 0;
  if (remapped == nregs && fd >= 0) {  // the target copy, local now: no pinning, no host copy
    CUresult tr = target_load(fd, &twhat);
    from_target = tr == CUDA_SUCCESS;
    if (from_target) rc = 0;
    else shim_log("owned memory: the target copy was not used (%s, %d); copying from the stash", twhat, tr);
  }
  if (remapped == nregs && !from_target) {
    CUstream st[NSTREAMS] = {0};
    size_t k = 0;
    CUresult r = streams_open(st);
    for (size_t p = 0; p < npieces() && r == CUDA_SUCCESS; p++) {
      uint64_t tp = shim_now_ns();
      all &= pin_piece(p);  // the copies of the pieces before run meanwhile
      pin_ns += shim_now_ns() - tp;
      uint64_t lo = p * PIN_PIECE, hi = lo + PIN_PIECE < stash_len ? lo + PIN_PIECE : stash_len;
      r = copy_range(0, lo, hi, st, &k);
    }
    r = streams_close(st, r);
    if (r == CUDA_SUCCESS) rc = 0;
    else fail(err, errlen, "mem-unstash: copy failed (%d)", r);
  }
  if (rc) {
    for (size_t k = 0; k < remapped; k++) unmap_phys(&regs[k]);
    stash_unpin();
  } else {
    released = 0;
    tgt.filled = 0;
    stash_state = ST_DRAINING;  // unpinned and freed after the resume (vmm_stash_drop)
    uint64_t t_end = shim_now_ns();
    jb_printf(b, "{\"regions\":%zu,\"bytes\":%llu,\"pinned\":%s,\"remap_us\":%llu,\"pin_us\":%llu,\"copy_us\":%llu,\"elapsed_us\":%llu,\"from\":\"%s\"",
              nregs, (unsigned long long)bytes, all && !from_target ? "true" : "false", (unsigned long long)(t_map - t0) / 1000,
              (unsigned long long)pin_ns / 1000, (unsigned long long)(t_end - t_map) / 1000, (unsigned long long)(t_end - t0) / 1000,
              from_target ? "target" : "host");
    if (twhat) {
      jb_s(b, ",\"target_error\":");
      jb_str(b, twhat, strlen(twhat));
    }
    jb_s(b, "}");
  }
  v.ctx_pop(&x);
  pthread_mutex_unlock(&vmm_mu);
  return rc;
}

// vmm_stash_drop, after a resume: the stash of a finished move, or one prepared for a move that
// did not get to its stop (a new move prepares again), is freed.
void vmm_stash_drop(void) {
  pthread_mutex_lock(&vmm_mu);
  if (stash_state == ST_DRAINING || stash_state == ST_PREPARED) stash_free();
  pthread_mutex_unlock(&vmm_mu);
}

void vmm_tick(void) {
  pthread_mutex_lock(&vmm_mu);
  // Not while the process is held: unpinning and unmapping a large stash takes a while, which
  // would delay the resume (that frees a drained stash itself, after its reply).
  if (preempt_state() == 0 && (stash_state == ST_DRAINING || (stash_state == ST_PREPARED &&
                                                              shim_now_ns() - prepared_ns > (uint64_t)PREPARED_TTL_S * 1000000000ull)))
    stash_free();
  pthread_mutex_unlock(&vmm_mu);
}

static void stash_child_reset(void) {  // after fork, in the child (single-threaded)
  free(pinned);
  pinned = NULL;
  precopy_reset();
}
