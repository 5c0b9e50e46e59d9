// vmmhold: device memory backed by the VMM API that the process itself moves out of the GPU before
// a checkpoint and back after a restore, so that the driver's checkpoint has almost nothing to
// copy (issue: device memory at link speed, step 1; ../shared/probes/vmm.c measured it without
// CRIU in between).
//
//   vmmhold [--mib N] [--staging-mib S] [--steps K] [--interval-ms M] [--device D]
//
// N MiB (default 1024, rounded up to the allocation granularity) are reserved (cuMemAddressReserve),
// backed (cuMemCreate + cuMemMap + cuMemSetAccess) and seeded; a 64 MiB cuMemAlloc region sits
// beside them. Each step advances every word of both regions and prints "step I checksum X"; after
// K steps (default 40, M ms apart, default 100) "final checksum X", a pure function of N and K.
//   SIGUSR1: at the next step boundary, copy the VMM memory to ordinary (pageable) host memory
//            through two pinned staging buffers of S MiB (default 64) on two streams, unmap and
//            release the physical memory (the reservation stays), print "released MS GBPS", and
//            wait: the process can now be checkpointed (the driver keeps only the small region).
//   SIGUSR2: re-create and map the physical memory at the same address, copy the data back the
//            same way, print "reacquired MS GBPS" (or "reacquire FAILED: ..." and exit 3), go on.
// Everything but timings is deterministic. CUDA errors exit 2.
#include <signal.h>
#include <time.h>
#include <unistd.h>
#include "common.h"
#include "words.h"
#include "drvcheck.h"

static volatile sig_atomic_t want_release, want_reacquire;
static void on_usr1(int) { want_release = 1; }
static void on_usr2(int) { want_reacquire = 1; }

static double now_ms() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

__global__ void seed(uint32_t *a, size_t n, uint32_t salt) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    a[i] = (uint32_t)(i * 2654435761u) ^ salt;
}
struct Vmm {
  CUdeviceptr va = 0;
  size_t size = 0;
  CUmemGenericAllocationHandle h = 0;
  CUmemAllocationProp prop = {};
  CUmemAccessDesc access = {};
};

static CUresult vmm_back(Vmm &m) {
  CUresult r = cuMemCreate(&m.h, m.size, &m.prop, 0);
  if (r == CUDA_SUCCESS) r = cuMemMap(m.va, m.size, 0, m.h, 0);
  if (r == CUDA_SUCCESS) r = cuMemSetAccess(m.va, m.size, &m.access, 1);
  return r;
}

// copy moves n bytes between device memory at dev and pageable host memory through two pinned
// staging buffers on two streams (out: device to host).
static void copy(bool out, CUdeviceptr dev, char *host, size_t n, char *stage[2], size_t chunk, CUstream st[2]) {
  size_t off[2] = {0, 0}, len[2] = {0, 0};
  int k = 0;
  for (size_t o = 0; o < n || len[0] || len[1]; k ^= 1) {
    if (len[k]) {  // finish this buffer's previous transfer
      CK(cuStreamSynchronize(st[k]));
      if (out) std::memcpy(host + off[k], stage[k], len[k]);
      len[k] = 0;
    }
    if (o < n) {
      size_t l = n - o < chunk ? n - o : chunk;
      off[k] = o, len[k] = l;
      if (out) {
        CK(cuMemcpyDtoHAsync(stage[k], dev + o, l, st[k]));
      } else {
        std::memcpy(stage[k], host + o, l);
        CK(cuMemcpyHtoDAsync(dev + o, stage[k], l, st[k]));
      }
      o += l;
    }
  }
  CK(cuStreamSynchronize(st[0]));
  CK(cuStreamSynchronize(st[1]));
}

int main(int argc, char **argv) {
  size_t mib = std::strtoull(flag(argc, argv, "--mib", "1024"), nullptr, 10);
  size_t smib = std::strtoull(flag(argc, argv, "--staging-mib", "64"), nullptr, 10);
  long steps = std::strtol(flag(argc, argv, "--steps", "40"), nullptr, 10);
  long interval = std::strtol(flag(argc, argv, "--interval-ms", "100"), nullptr, 10);
  int dev = std::atoi(flag(argc, argv, "--device", "0"));
  if (!mib || !smib || steps < 1 || interval < 0) {
    std::fprintf(stderr, "vmmhold: need --mib > 0, --staging-mib > 0, --steps >= 1, --interval-ms >= 0\n");
    return 2;
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  signal(SIGUSR1, on_usr1);
  signal(SIGUSR2, on_usr2);
  CHECK(cudaSetDevice(dev));
  CHECK(cudaFree(nullptr));  // the primary context, current
  Vmm m;
  m.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  m.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  m.prop.location.id = dev;
  m.access.location = m.prop.location;
  m.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  size_t gran = 0;
  CK(cuMemGetAllocationGranularity(&gran, &m.prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  m.size = ((mib << 20) + gran - 1) / gran * gran;
  CK(cuMemAddressReserve(&m.va, m.size, 0, 0, 0));
  CK(vmm_back(m));
  const size_t plain_n = (64u << 20) / sizeof(uint32_t), vmm_n = m.size / sizeof(uint32_t);
  uint32_t *plain = nullptr;
  unsigned long long *sum = nullptr;
  CHECK(cudaMalloc(&plain, plain_n * sizeof(uint32_t)));
  CHECK(cudaMalloc(&sum, sizeof(*sum)));
  cudaDeviceProp p;
  CHECK(cudaGetDeviceProperties(&p, dev));
  int grid = p.multiProcessorCount * 8;
  uint32_t *vmm = reinterpret_cast<uint32_t *>(m.va);
  seed<<<grid, 256>>>(vmm, vmm_n, 0x9e3779b9u);
  seed<<<grid, 256>>>(plain, plain_n, 0x7f4a7c15u);
  CHECK_LAUNCH();
  CHECK(cudaDeviceSynchronize());
  std::printf("pid %d mib %zu va 0x%llx granularity %zu staging-mib %zu\n", (int)getpid(), m.size >> 20,
              (unsigned long long)m.va, gran, smib);
  char *stage[2];
  CUstream st[2];
  size_t chunk = smib << 20;
  for (int i = 0; i < 2; i++) {
    CK(cuMemAllocHost(reinterpret_cast<void **>(&stage[i]), chunk));
    CK(cuStreamCreate(&st[i], CU_STREAM_NON_BLOCKING));
  }
  unsigned long long host = 0;
  for (long s = 1; s <= steps; s++) {
    if (want_release) {
      want_release = 0;
      char *copyout = static_cast<char *>(std::malloc(m.size));
      if (!copyout) {
        std::printf("release FAILED: no host memory for %zu MiB\n", m.size >> 20);
        return 3;
      }
      CHECK(cudaDeviceSynchronize());
      double t0 = now_ms();
      copy(true, m.va, copyout, m.size, stage, chunk, st);
      CK(cuMemUnmap(m.va, m.size));
      CK(cuMemRelease(m.h));
      double ms = now_ms() - t0;
      std::printf("released %.1f %.1f\n", ms, m.size / 1e6 / ms);
      while (!want_reacquire) usleep(1000);  // checkpointed here: the driver holds 64 MiB + context
      want_reacquire = 0;
      t0 = now_ms();
      CUresult r = vmm_back(m);
      if (r != CUDA_SUCCESS) {
        const char *e = "?";
        cuGetErrorString(r, &e);
        std::printf("reacquire FAILED: mapping at 0x%llx: %s\n", (unsigned long long)m.va, e);
        return 3;
      }
      copy(false, m.va, copyout, m.size, stage, chunk, st);
      std::free(copyout);
      ms = now_ms() - t0;
      std::printf("reacquired %.1f %.1f\n", ms, m.size / 1e6 / ms);
    }
    advance<<<grid, 256>>>(vmm, vmm_n, (uint32_t)s);
    advance<<<grid, 256>>>(plain, plain_n, (uint32_t)s);
    CHECK_LAUNCH();
    CHECK(cudaMemset(sum, 0, sizeof(*sum)));
    checksum<<<grid, 256>>>(vmm, vmm_n, sum);
    checksum<<<grid, 256>>>(plain, plain_n, sum);
    CHECK_LAUNCH();
    CHECK(cudaMemcpy(&host, sum, sizeof(host), cudaMemcpyDeviceToHost));
    std::printf("step %ld checksum %016llx\n", s, host);
    if (interval) usleep((useconds_t)interval * 1000);
  }
  std::printf("final checksum %016llx\n", host);
  return 0;
}
