// twin_harness: checks and times ptxmig preemptible twins against their original kernels.
//
//   twin_harness SPEC PTXDIR OUT.md [--runs N] [--preempt-runs R] [--seed S] [--only KERNEL]
//                [--tune "MIN,MAX,DIV;..."]
//
// For every line of SPEC (see kernels.spec) it loads PTXDIR/FILE (an instrumented module holding
// both KERNEL and KERNEL__ptxmig) and, on the same random inputs with poisoned outputs:
//   1. runs the original with the spec's grid;
//   2. runs the twin straight through (flag never set) on min(blocks, occupancy x SMs) CTAs
//      (occupancy of the twin, cuOccupancyMaxActiveBlocksPerMultiprocessor) with the default claim
//      sizes (control-block tuning fields zero) and compares every output buffer bit for bit;
//   3. R times: runs the twin while the host sets the preempt flag at random moments from a
//      non-blocking side stream, relaunching with the same control block until every block is
//      done (several preemptions per run), and compares bit for bit again;
//   4. times original vs twin (CUDA events, median of N) and the preemption latency (side-stream
//      event after the flag write -> kernel-stream event after the twin ends);
//   5. times the twin again for each --tune claim-size setting (batch_min,batch_max,batch_div of
//      the control block; default "1,1,1;1,16,4;4,32,4"), each also checked bit for bit.
// Writes a markdown table to OUT.md; exits 1 on any mismatch, 2 on setup errors.
// Driver API only; the control block layout mirrors shim/include/ptxmig_ctrl.h.
#include <cuda.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

// The case being run and its phase: a kernel fault kills the context, so the harness cannot go on
// to the next kernel; it names the kernel and phase that faulted, then exits 2.
static std::string gKernel = "(setup)", gPhase = "";

#define CK(call)                                                                  \
  do {                                                                            \
    CUresult r_ = (call);                                                         \
    if (r_ != CUDA_SUCCESS) {                                                     \
      const char *s_ = "?";                                                       \
      cuGetErrorString(r_, &s_);                                                  \
      fprintf(stderr, "%s:%d: kernel %s (%s): %s: %s (CUresult %d)\n", __FILE__,  \
              __LINE__, gKernel.c_str(), gPhase.c_str(), #call, s_, (int)r_);     \
      exit(2);                                                                    \
    }                                                                             \
  } while (0)

struct Ctl {  // == struct ptxmig_ctl (version 3; a version-2 twin reads the first 64 bytes)
  uint64_t next_block, total_blocks, blocks_done;
  uint32_t grid_x, grid_y, grid_z, preempt, status, magic, version, batch_max, batch_min, batch_div;
  uint64_t save_area;
  uint32_t record_bytes, saved, resume_count, resume_cursor;
  uint64_t resume_area;
  uint32_t save_capacity, force_visit;
  uint64_t reserved;
};
static_assert(sizeof(Ctl) == 112, "control block size");
static_assert(offsetof(Ctl, save_area) == 64 && offsetof(Ctl, resume_area) == 88 && offsetof(Ctl, force_visit) == 100, "v3 layout");
static_assert(offsetof(Ctl, preempt) == 36 && offsetof(Ctl, batch_max) == 52 && offsetof(Ctl, batch_div) == 60, "control block layout");
static const size_t kOffPreempt = 36;

struct Tune { unsigned bmin, bmax, bdiv; };

struct Param {
  std::string kind;  // in inout out zero scalar
  std::string type;
  size_t count = 0;  // elements (buffers)
  std::string value; // scalars
  CUdeviceptr dev = 0;
  CUdeviceptr devInit = 0;          // device copy of init: resets are device-to-device copies
  std::vector<unsigned char> init;  // host initial contents (buffers)
  unsigned char scalar[8] = {0};
};

struct Case {
  std::string file, kernel;
  unsigned grid[3], block[3], smem;
  std::vector<Param> params;
};

static size_t typeSize(const std::string &t) {
  if (t == "f32" || t == "i32" || t == "u32") return 4;
  if (t == "f64" || t == "i64") return 8;
  if (t == "u8") return 1;
  fprintf(stderr, "unknown type %s\n", t.c_str());
  exit(2);
}

static void parseDims(const std::string &s, unsigned d[3]) {
  if (sscanf(s.c_str(), "%u,%u,%u", &d[0], &d[1], &d[2]) != 3) {
    fprintf(stderr, "bad dims %s\n", s.c_str());
    exit(2);
  }
}

static std::vector<Case> readSpec(const char *path) {
  std::ifstream in(path);
  if (!in) { perror(path); exit(2); }
  std::vector<Case> cases;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ss(line);
    Case c;
    std::string g, b;
    if (!(ss >> c.file >> c.kernel >> g >> b >> c.smem)) { fprintf(stderr, "bad spec line: %s\n", line.c_str()); exit(2); }
    parseDims(g, c.grid);
    parseDims(b, c.block);
    std::string p;
    while (ss >> p) {
      Param q;
      size_t a = p.find(':'), z = p.rfind(':');
      if (a == std::string::npos) { fprintf(stderr, "bad param %s\n", p.c_str()); exit(2); }
      if (a != z) {
        q.kind = p.substr(0, a);
        q.type = p.substr(a + 1, z - a - 1);
        q.count = strtoull(p.c_str() + z + 1, nullptr, 10);
      } else {
        q.kind = "scalar";
        q.type = p.substr(0, a);
        q.value = p.substr(a + 1);
      }
      c.params.push_back(q);
    }
    cases.push_back(c);
  }
  return cases;
}

static inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// fillRandom fills a buffer's initial contents: element i is a hash of (key, i), so the contents
// depend only on the seed and the spec, and the fill runs on every host core (2^28-element
// buffers take seconds with a sequential generator).
static void fillRandom(Param &q, uint64_t key) {
  size_t es = typeSize(q.type);
  q.init.assign(q.count * es, 0);
  if (q.kind == "out") { std::fill(q.init.begin(), q.init.end(), 0xA5); return; }  // poison
  if (q.kind == "zero") return;
  auto fill = [&q, es, key](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; i++) {
      unsigned char *d = q.init.data() + i * es;
      uint64_t r = splitmix64(key ^ (i * 0xd1342543de82ef95ull)), r2 = splitmix64(r);
      if (q.type == "f32") { float v = (float)((int64_t)(r % 2000001) - 1000000) / 1e6f; memcpy(d, &v, 4); }
      else if (q.type == "f64") { double v = (double)((int64_t)(r % 2000001) - 1000000) / 1e6; memcpy(d, &v, 8); }
      else if (q.type == "i32") { int32_t v = (int32_t)(r % 2001) - 1000; if (r2 % 8 == 0) v = 0; memcpy(d, &v, 4); }
      else if (q.type == "u32") { uint32_t v = (uint32_t)r; memcpy(d, &v, 4); }
      else if (q.type == "i64") { int64_t v = (int64_t)(r % 2001) - 1000; memcpy(d, &v, 8); }
      else if (q.type == "u8") { d[0] = (unsigned char)r; }
    }
  };
  unsigned nt = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
  if (q.count < (1u << 16)) nt = 1;
  std::vector<std::thread> ts;
  size_t chunk = (q.count + nt - 1) / nt;
  for (unsigned t = 0; t < nt; t++) {
    size_t lo = std::min(q.count, t * chunk), hi = std::min(q.count, lo + chunk);
    ts.emplace_back(fill, lo, hi);
  }
  for (auto &t : ts) t.join();
}

static void setScalar(Param &q) {
  if (q.type == "f32") { float v = strtof(q.value.c_str(), nullptr); memcpy(q.scalar, &v, 4); }
  else if (q.type == "f64") { double v = strtod(q.value.c_str(), nullptr); memcpy(q.scalar, &v, 8); }
  else if (q.type == "i32" || q.type == "u32") { int32_t v = (int32_t)strtoll(q.value.c_str(), nullptr, 0); memcpy(q.scalar, &v, 4); }
  else if (q.type == "i64") { int64_t v = strtoll(q.value.c_str(), nullptr, 0); memcpy(q.scalar, &v, 8); }
  else { fprintf(stderr, "bad scalar type %s\n", q.type.c_str()); exit(2); }
}

static void resetBuffers(Case &c, CUstream s) {
  for (auto &q : c.params)
    if (q.kind != "scalar") CK(cuMemcpyDtoDAsync(q.dev, q.devInit, q.init.size(), s));
}

static bool compareOutputs(Case &c, std::vector<std::vector<unsigned char>> &ref, std::string &why) {
  size_t k = 0;
  for (auto &q : c.params) {
    if (q.kind == "scalar" || q.kind == "in") continue;
    std::vector<unsigned char> got(q.init.size());
    CK(cuMemcpyDtoH(got.data(), q.dev, got.size()));
    if (ref.size() <= k) { ref.push_back(got); k++; continue; }
    if (memcmp(got.data(), ref[k].data(), got.size()) != 0) {
      size_t i = 0;
      while (got[i] == ref[k][i]) i++;
      char buf[160];
      snprintf(buf, sizeof buf, "buffer %zu differs first at byte %zu (got %02x want %02x)", k, i, got[i], ref[k][i]);
      why = buf;
      return false;
    }
    k++;
  }
  return true;
}

static double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
static double pct(std::vector<double> v, double p) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  size_t i = (size_t)std::ceil(p * v.size()) - 1;
  return v[std::min(i, v.size() - 1)];
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: twin_harness SPEC PTXDIR OUT.md [--runs N] [--preempt-runs R] [--seed S] [--only KERNEL]\n");
    return 2;
  }
  int runs = 20, preemptRuns = 3;
  uint64_t seed = 20240601;
  std::string only, tuneArg = "1,1,1;1,16,4;4,32,4", v2dir, forceArg = "1,2,3,5,8,13,21";
  bool mid = false, varyW = true, verbose = getenv("TWIN_HARNESS_VERBOSE") != nullptr;
  for (int i = 4; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--runs")) runs = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--preempt-runs")) preemptRuns = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--seed")) seed = strtoull(argv[i + 1], nullptr, 0);
    else if (!strcmp(argv[i], "--only")) only = argv[i + 1];
    else if (!strcmp(argv[i], "--tune")) tuneArg = argv[i + 1];
    else if (!strcmp(argv[i], "--mid")) mid = atoi(argv[i + 1]) != 0;
    else if (!strcmp(argv[i], "--v2dir")) v2dir = argv[i + 1];
    else if (!strcmp(argv[i], "--force")) forceArg = argv[i + 1];
    else if (!strcmp(argv[i], "--vary-ctas")) varyW = atoi(argv[i + 1]) != 0;
    else { fprintf(stderr, "unknown flag %s\n", argv[i]); return 2; }
  }
  if ((argc - 4) % 2 != 0) { fprintf(stderr, "flag %s needs a value\n", argv[argc - 1]); return 2; }
  if (runs < 1 || preemptRuns < 0) { fprintf(stderr, "--runs must be >= 1 and --preempt-runs >= 0\n"); return 2; }
  std::vector<Tune> tunes;
  {
    std::istringstream ts(tuneArg);
    std::string item;
    while (std::getline(ts, item, ';')) {
      if (item.empty()) continue;
      Tune t;
      if (sscanf(item.c_str(), "%u,%u,%u", &t.bmin, &t.bmax, &t.bdiv) != 3) { fprintf(stderr, "bad --tune item %s (want MIN,MAX,DIV)\n", item.c_str()); return 2; }
      tunes.push_back(t);
    }
  }
  std::vector<Case> cases = readSpec(argv[1]);
  if (cases.empty()) { fprintf(stderr, "%s: no cases\n", argv[1]); return 2; }
  CUdevice dev;
  CUcontext ctx;
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  int sms = 0;
  CK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
  char devName[128];
  CK(cuDeviceGetName(devName, sizeof devName, dev));
  CUstream s, side;
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CK(cuStreamCreate(&side, CU_STREAM_NON_BLOCKING));
  CUdeviceptr dctl;
  CK(cuMemAlloc(&dctl, sizeof(Ctl)));
  CUevent e0, e1, eflag;
  CK(cuEventCreate(&e0, CU_EVENT_DEFAULT));
  CK(cuEventCreate(&e1, CU_EVENT_DEFAULT));
  CK(cuEventCreate(&eflag, CU_EVENT_DEFAULT));
  std::mt19937_64 rng(seed);

  FILE *out = fopen(argv[3], "w");
  if (!out) { perror(argv[3]); return 2; }
  fprintf(out, "Device: %s (%d SMs). Spec %s. Seed %llu, median of %d timed runs, %d preempted runs per kernel.\n"
          "Twin: control block in device memory (cuMemAlloc), preempt flag raised by cuMemsetD32Async on a non-blocking side stream; "
          "default claim sizes (batch_min/max/div = 0, i.e. the kernel's defaults).\n\n",
          devName, sms, argv[1], (unsigned long long)seed, runs, preemptRuns);
  fprintf(out, "| kernel | blocks | twin CTAs | straight | preempted (preemptions) | original ms | twin ms | slowdown | block-wave us | preempt latency p50/p99 us |\n");
  fprintf(out, "|---|---|---|---|---|---|---|---|---|---|\n");
  int failures = 0;
  std::vector<double> ratios;
  std::vector<std::vector<double>> tuneRatios(tunes.size());
  std::string tuneRows, midRows;

  for (auto &c : cases) {
    if (!only.empty() && c.kernel != only) continue;
    gKernel = c.file + " " + c.kernel;
    gPhase = "load";
    std::string path = std::string(argv[2]) + "/" + c.file;
    std::ifstream f(path, std::ios::binary);
    if (!f) { fprintf(stderr, "%s: cannot read\n", path.c_str()); return 2; }
    std::string ptx((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    CUmodule mod;
    CUfunction orig, twin;
    char log[8192] = {0};
    CUjit_option opts[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void *vals[] = {log, (void *)(uintptr_t)sizeof log};
    if (cuModuleLoadDataEx(&mod, ptx.c_str(), 2, opts, vals) != CUDA_SUCCESS) {
      fprintf(stderr, "%s: JIT failed: %s\n", path.c_str(), log);
      return 2;
    }
    CK(cuModuleGetFunction(&orig, mod, c.kernel.c_str()));
    if (cuModuleGetFunction(&twin, mod, (c.kernel + "__ptxmig").c_str()) != CUDA_SUCCESS) {
      fprintf(stderr, "%s: no twin %s__ptxmig (was the module instrumented?)\n", path.c_str(), c.kernel.c_str());
      fprintf(out, "| %s | - | - | NO TWIN | - | - | - | - | - | - |\n", c.kernel.c_str());
      failures++;
      continue;
    }
    if (c.smem > 48 * 1024) {
      CK(cuFuncSetAttribute(orig, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, c.smem));
      CK(cuFuncSetAttribute(twin, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, c.smem));
    }
    // Buffers and arguments.
    std::vector<void *> args, targs;
    for (auto &q : c.params) {
      if (q.kind == "scalar") { setScalar(q); continue; }
      fillRandom(q, rng());
      CK(cuMemAlloc(&q.dev, q.init.size()));
      CK(cuMemAlloc(&q.devInit, q.init.size()));
      CK(cuMemcpyHtoD(q.devInit, q.init.data(), q.init.size()));
    }
    for (auto &q : c.params) args.push_back(q.kind == "scalar" ? (void *)q.scalar : (void *)&q.dev);
    targs = args;
    targs.push_back(&dctl);
    uint64_t total = (uint64_t)c.grid[0] * c.grid[1] * c.grid[2];
    unsigned threads = c.block[0] * c.block[1] * c.block[2];
    int perSM = 0;
    CK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&perSM, twin, threads, c.smem));
    unsigned workers = (unsigned)std::min<uint64_t>(total, (uint64_t)std::max(perSM, 1) * sms);
    Ctl h0 = {};
    h0.total_blocks = total;
    h0.grid_x = c.grid[0]; h0.grid_y = c.grid[1]; h0.grid_z = c.grid[2];
    h0.magic = 0x4d585450u; h0.version = 2;  // batch_* = 0: the twin's default claim sizes
    // Mid-block twins (--mid 1): the record layout the module carries, two save areas, version 3.
    uint32_t midDesc[5] = {0, 0, 0, 0, 0};  // {format 2, register slots, static shared, sites, local bytes}
    bool hasMid = false;
    CUdeviceptr areaA = 0, areaB = 0;
    uint32_t recBytes = 0, cap = 0;
    if (mid) {
      CUdeviceptr dd;
      size_t dsz = 0;
      if (cuModuleGetGlobal(&dd, &dsz, mod, ("__ptxmig_mid_" + c.kernel).c_str()) == CUDA_SUCCESS && dsz == 20) {
        CK(cuMemcpyDtoH(midDesc, dd, 20));
        hasMid = midDesc[0] == 2;
      }
      if (hasMid) {
        // 64 + (8 x slots + local) x threads + static shared + dynamic shared (counted even when the kernel
        // saves none: a larger record is harmless), rounded to 16
        uint64_t rb = (64 + (8ull * midDesc[1] + midDesc[4]) * threads + midDesc[2] + c.smem + 15) & ~15ull;
        recBytes = (uint32_t)rb;
        cap = 2 * workers + 64;
        CK(cuMemAlloc(&areaA, (size_t)cap * recBytes));
        CK(cuMemAlloc(&areaB, (size_t)cap * recBytes));
        h0.version = 3;
        h0.save_area = areaA;
        h0.record_bytes = recBytes;
        h0.save_capacity = cap;
      }
    }
    // Between two launches of a mid-block twin: the records one launch saved are resumed by the
    // next, from the other area (the areas swap), and the flag is lowered.
    uint64_t records = 0;
    auto prepRelaunch = [&](Ctl cur) {
      if (!hasMid) return;
      uint32_t n = std::min(cur.saved, cur.save_capacity);
      records += n;
      cur.resume_area = cur.save_area;
      cur.resume_count = n;
      cur.resume_cursor = 0;
      cur.save_area = cur.save_area == areaA ? areaB : areaA;
      cur.saved = 0;
      cur.preempt = 0;
      CK(cuMemcpyHtoD(dctl, &cur, sizeof cur));
    };
    auto finished = [&](const Ctl &h) { return hasMid ? h.blocks_done >= total : h.next_block >= total; };
    auto launchOrig = [&]() {
      CK(cuLaunchKernel(orig, c.grid[0], c.grid[1], c.grid[2], c.block[0], c.block[1], c.block[2], c.smem, s, args.data(), nullptr));
    };
    auto resetCtl = [&]() { CK(cuMemcpyHtoDAsync(dctl, &h0, sizeof h0, s)); };
    auto launchTwinW = [&](unsigned w) {
      CK(cuLaunchKernel(twin, w, 1, 1, c.block[0], c.block[1], c.block[2], c.smem, s, targs.data(), nullptr));
    };
    auto launchTwin = [&]() { launchTwinW(workers); };
    auto readCtl = [&]() { Ctl h; CK(cuStreamSynchronize(s)); CK(cuMemcpyDtoH(&h, dctl, sizeof h)); return h; };

    // 1. reference
    gPhase = "original";
    std::vector<std::vector<unsigned char>> ref;
    std::string why;
    resetBuffers(c, s);
    launchOrig();
    CK(cuStreamSynchronize(s));
    compareOutputs(c, ref, why);
    // 2. straight
    gPhase = "twin, straight";
    resetBuffers(c, s);
    resetCtl();
    launchTwin();
    Ctl h = readCtl();
    bool straight = h.blocks_done == total && h.next_block >= total && h.status == 0 && compareOutputs(c, ref, why);
    if (!straight && why.empty())
      why = "control block: blocks_done " + std::to_string(h.blocks_done) + " of " + std::to_string(total) + ", status " + std::to_string(h.status);
    // 4a. timing (needed first for the preemption window)
    gPhase = "timing original and twin";
    std::vector<double> to, tt;
    for (int r = 0; r < runs; r++) {
      float ms;
      CK(cuEventRecord(e0, s)); launchOrig(); CK(cuEventRecord(e1, s));
      CK(cuEventSynchronize(e1)); CK(cuEventElapsedTime(&ms, e0, e1)); to.push_back(ms);
      resetCtl();
      CK(cuEventRecord(e0, s)); launchTwin(); CK(cuEventRecord(e1, s));
      CK(cuEventSynchronize(e1)); CK(cuEventElapsedTime(&ms, e0, e1)); tt.push_back(ms);
    }
    double mo = median(to), mt = median(tt);
    double waves = std::ceil((double)total / workers);
    double waveUs = mo * 1000.0 / waves;
    // 3. preempted runs
    gPhase = "twin, preempted";
    bool preemptOK = true;
    int preemptions = 0;
    std::vector<double> lat;
    std::uniform_real_distribution<double> frac(0.02, 0.9);
    for (int r = 0; r < preemptRuns && preemptOK; r++) {
      resetBuffers(c, s);
      resetCtl();
      CK(cuStreamSynchronize(s));
      int launches = 0;
      for (;;) {
        launchTwin();
        launches++;
        // Remaining work shrinks with each launch; aim the flag inside what is left.
        Ctl cur;
        CK(cuMemcpyDtoH(&cur, dctl, sizeof cur));  // racy snapshot is fine: only steers the delay
        double left = mt * 1000.0 * (1.0 - std::min(1.0, (double)cur.blocks_done / total));
        bool setFlag = launches <= 6;
        if (setFlag) {
          auto d = std::chrono::microseconds((long)(frac(rng) * std::max(left, 20.0)));
          std::this_thread::sleep_for(d);
          CK(cuMemsetD32Async(dctl + kOffPreempt, 1, 1, side));
          CK(cuEventRecord(eflag, side));
        }
        CK(cuEventRecord(e1, s));
        CK(cuStreamSynchronize(side));
        Ctl after = readCtl();
        if (setFlag && after.blocks_done < total) {
          float ms;
          if (cuEventElapsedTime(&ms, eflag, e1) == CUDA_SUCCESS && ms >= 0) lat.push_back(ms * 1000.0);
          preemptions++;
        }
        if (finished(after)) {
          if (after.blocks_done != total) { preemptOK = false; why = "blocks_done != total after the final launch"; }
          break;
        }
        prepRelaunch(after);
        CK(cuMemsetD32Async(dctl + kOffPreempt, 0, 1, s));
        if (launches > 100000) { preemptOK = false; why = "no progress"; break; }
      }
      if (preemptOK && !compareOutputs(c, ref, why)) preemptOK = false;
    }
    uint64_t preemptRecords = records;
    // 3b. Mid-block: every CTA forced to stop at its v-th site vote of each of the first four launches, relaunched
    // with other CTA counts (all, a third, a half), until every block is done; bit for bit again.
    bool forceOK = true;
    uint64_t forcedRecords = 0;
    int forcedLaunches = 0;
    std::string forceList;
    // One forced run: every CTA stops at its v-th site vote (thread-loops: each thread at its v-th
    // poll) in each of the first four launches, with save areas of cap records, relaunched (on
    // other CTA counts when vary) until every block is done; then bit for bit. label prefixes why.
    auto forcedRun = [&](unsigned v, uint32_t cap, bool vary, const std::string &label) {
      resetBuffers(c, s);
      Ctl hf = h0;
      hf.force_visit = v;
      hf.save_capacity = cap;
      CK(cuMemcpyHtoDAsync(dctl, &hf, sizeof hf, s));
      for (int l = 0;; l++) {
        unsigned w = !vary ? workers : l % 3 == 1 ? std::max(1u, workers / 3) : l % 3 == 2 ? workers / 2 + 1 : workers;
        launchTwinW(w);
        forcedLaunches++;
        Ctl a = readCtl();
        if (verbose && (l < 8 || l % 10000 == 0))
          printf("  %s launch %d ctas %u: next_block %llu blocks_done %llu saved %u resume %u/%u status %u\n", label.c_str(), l, w,
                 (unsigned long long)a.next_block, (unsigned long long)a.blocks_done, a.saved, a.resume_cursor, a.resume_count, a.status);
        if (a.blocks_done >= total) {
          if (a.blocks_done != total) { why = label + ": blocks_done " + std::to_string(a.blocks_done) + " > total"; return false; }
          break;
        }
        // Forced stops in the first four launches only: a record advances by one stretch
        // between votes per launch, so forcing every launch takes (votes per block) launches.
        if (l >= 3) a.force_visit = 0;
        prepRelaunch(a);
        if (l > 100000) { why = label + ": no progress"; return false; }
      }
      if (!compareOutputs(c, ref, why)) { why = label + ": " + why; return false; }
      return true;
    };
    if (hasMid) {
      gPhase = "twin, forced mid-block stops";
      records = 0;
      std::istringstream fs(forceArg);
      std::string item;
      while (forceOK && std::getline(fs, item, ',')) {
        unsigned v = (unsigned)strtoul(item.c_str(), nullptr, 10);
        if (v == 0) continue;
        forceList += (forceList.empty() ? "" : ",") + item;
        forceOK = forcedRun(v, h0.save_capacity, varyW, "forced visit " + item);
      }
      // 3c. A save area too small for every stop (a quarter of the CTAs' records): a CTA refused a
      // record runs on (a vote does not stop it; a thread-loop's stopped threads go back to their
      // sites and the CTA stops no more in that launch); bit for bit again.
      if (forceOK) {
        gPhase = "twin, forced stops, small save area";
        uint32_t small = std::max(1u, workers / 4);
        forceList += ";1 with " + std::to_string(small) + " records";
        forceOK = forcedRun(1, small, false, "small save area");
      }
      forcedRecords = records;
      if (forceOK && forcedRecords == 0) { forceOK = false; why = "forced: no CTA stopped mid-block"; }
    }
    // 4b. The block-granular twin of the same kernel (--v2dir: the module instrumented without
    // --mid-block), timed in the same run with a version-2 control block.
    double mv2 = NAN;
    CUmodule mod2 = nullptr;
    if (hasMid && !v2dir.empty()) {
      gPhase = "v2 twin";
      std::ifstream f2(v2dir + "/" + c.file, std::ios::binary);
      std::string ptx2((std::istreambuf_iterator<char>(f2)), std::istreambuf_iterator<char>());
      CUfunction twin2;
      if (!ptx2.empty() && cuModuleLoadDataEx(&mod2, ptx2.c_str(), 0, nullptr, nullptr) == CUDA_SUCCESS &&
          cuModuleGetFunction(&twin2, mod2, (c.kernel + "__ptxmig").c_str()) == CUDA_SUCCESS) {
        int per2 = 0;
        CK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&per2, twin2, threads, c.smem));
        unsigned w2 = (unsigned)std::min<uint64_t>(total, (uint64_t)std::max(per2, 1) * sms);
        Ctl h2 = h0;
        h2.version = 2;
        std::vector<double> t2;
        for (int r = 0; r < runs; r++) {
          float ms;
          CK(cuMemcpyHtoDAsync(dctl, &h2, sizeof h2, s));
          CK(cuEventRecord(e0, s));
          CK(cuLaunchKernel(twin2, w2, 1, 1, c.block[0], c.block[1], c.block[2], c.smem, s, targs.data(), nullptr));
          CK(cuEventRecord(e1, s));
          CK(cuEventSynchronize(e1)); CK(cuEventElapsedTime(&ms, e0, e1)); t2.push_back(ms);
        }
        mv2 = median(t2);
      }
    }
    if (hasMid) {
      char mrow[512];
      snprintf(mrow, sizeof mrow, "| %s | %u | %u | %u | %u | %s | %s (%s; %llu records, %d launches) | %s (%llu records) | %.3f | %.3f | %.3f | %.3f | %.3f | %.1f / %.1f |\n",
               c.kernel.c_str(), midDesc[3], midDesc[1], recBytes, workers, straight ? "ok" : "MISMATCH", forceOK ? "ok" : "MISMATCH",
               forceList.c_str(), (unsigned long long)forcedRecords, forcedLaunches, preemptOK ? "ok" : "MISMATCH",
               (unsigned long long)preemptRecords, mo, mv2, mt, mt / mv2, mt / mo, pct(lat, 0.5), pct(lat, 0.99));
      midRows += mrow;
      if (!forceOK) failures++;
      printf("%-40s mid-block: forced=%s (%llu records) preempted records=%llu v2=%.3fms v3=%.3fms x%.3f of v2 %s\n", c.kernel.c_str(),
             forceOK ? "ok" : "MISMATCH", (unsigned long long)forcedRecords, (unsigned long long)preemptRecords, mv2, mt, mt / mv2, why.c_str());
    } else if (mid) {
      printf("%-40s no mid-block twin (no eligible site): block-granular only\n", c.kernel.c_str());
    }
    // 5. claim-size sweep: same launches with explicit tuning fields, checked and timed.
    char head[256];
    snprintf(head, sizeof head, "| %s | %llu | %.3f (x%.3f)", c.kernel.c_str(), (unsigned long long)total, mt, mt / mo);
    std::string row = head;
    for (size_t ti = 0; ti < tunes.size(); ti++) {
      Ctl ht = h0;
      gPhase = "twin, tune " + std::to_string(tunes[ti].bmin) + "," + std::to_string(tunes[ti].bmax) + "," + std::to_string(tunes[ti].bdiv);
      ht.batch_min = tunes[ti].bmin; ht.batch_max = tunes[ti].bmax; ht.batch_div = tunes[ti].bdiv;
      auto resetTune = [&]() { CK(cuMemcpyHtoDAsync(dctl, &ht, sizeof ht, s)); };
      resetBuffers(c, s);
      resetTune();
      launchTwin();
      Ctl hv = readCtl();
      std::string twhy;
      bool ok = hv.blocks_done == total && hv.next_block >= total && compareOutputs(c, ref, twhy);
      std::vector<double> tv;
      for (int r = 0; r < runs; r++) {
        float ms;
        resetTune();
        CK(cuEventRecord(e0, s)); launchTwin(); CK(cuEventRecord(e1, s));
        CK(cuEventSynchronize(e1)); CK(cuEventElapsedTime(&ms, e0, e1)); tv.push_back(ms);
      }
      double m = median(tv);
      tuneRatios[ti].push_back(m / mo);
      char cell[64];
      snprintf(cell, sizeof cell, " | %.3f (x%.3f)%s", m, m / mo, ok ? "" : " MISMATCH");
      row += cell;
      if (!ok) {
        failures++;
        printf("%-40s tune %u,%u,%u: MISMATCH %s\n", c.kernel.c_str(), tunes[ti].bmin, tunes[ti].bmax, tunes[ti].bdiv, twhy.c_str());
      }
    }
    tuneRows += row + " |\n";
    double slow = mt / mo;
    ratios.push_back(slow);
    if (mo < 0.2) printf("%-40s note: original takes %.3f ms (< 0.2 ms): launch overhead weighs on the ratio\n", c.kernel.c_str(), mo);
    fprintf(out, "| %s | %llu | %u | %s | %s (%d) | %.3f | %.3f | %.3f | %.1f | %.1f / %.1f |\n", c.kernel.c_str(),
            (unsigned long long)total, workers, straight ? "ok" : "MISMATCH", preemptOK ? "ok" : "MISMATCH", preemptions,
            mo, mt, slow, waveUs, pct(lat, 0.5), pct(lat, 0.99));
    fflush(out);
    printf("%-40s straight=%s preempted=%s (%d preemptions) orig=%.3fms twin=%.3fms x%.3f lat p99=%.1fus %s\n", c.kernel.c_str(),
           straight ? "ok" : "MISMATCH", preemptOK ? "ok" : "MISMATCH", preemptions, mo, mt, slow, pct(lat, 0.99), why.c_str());
    if (!straight || !preemptOK) failures++;
    if (preemptOK && preemptRuns > 0 && preemptions == 0) {
      printf("%-40s warning: no launch was actually preempted\n", c.kernel.c_str());
    }
    gPhase = "cleanup";
    if (areaA) CK(cuMemFree(areaA));
    if (areaB) CK(cuMemFree(areaB));
    if (mod2) CK(cuModuleUnload(mod2));
    for (auto &q : c.params) {
      if (q.dev) CK(cuMemFree(q.dev));
      if (q.devInit) CK(cuMemFree(q.devInit));
    }
    CK(cuModuleUnload(mod));
  }
  double g = 0;
  for (double r : ratios) g += std::log(r);
  if (!ratios.empty()) g = std::exp(g / ratios.size());
  fprintf(out, "\nGeometric-mean slowdown (twin/original, flag never set): %.3f over %zu kernels. Failures: %d.\n", g, ratios.size(), failures);
  if (!tunes.empty()) {
    fprintf(out, "\nClaim-size sweep (batch_min,batch_max,batch_div in the control block; twin ms, median of %d, and slowdown):\n\n| kernel | blocks | default ms", runs);
    for (auto &t : tunes) fprintf(out, " | %u,%u,%u", t.bmin, t.bmax, t.bdiv);
    fprintf(out, " |\n|---|---|---");
    for (size_t ti = 0; ti < tunes.size(); ti++) fprintf(out, "|---");
    fprintf(out, "|\n%s| geomean | | %.3f", tuneRows.c_str(), g);
    for (auto &rs : tuneRatios) {
      double tg = 0;
      for (double r : rs) tg += std::log(r);
      fprintf(out, " | %.3f", rs.empty() ? NAN : std::exp(tg / rs.size()));
    }
    fprintf(out, " |\n");
  }
  if (!midRows.empty()) {
    fprintf(out, "\nMid-block twins (control block v3; forced: every CTA stops at its N-th site vote in each of the first four launches, relaunched on all, a third and a half of the CTAs; "
                 "preempted: the flag raised at random moments; times: median of %d, no stop):\n\n"
                 "| kernel | sites | register slots | record bytes | twin CTAs | straight | forced | preempted | original ms | v2 twin ms | v3 twin ms | v3/v2 | v3/original | preempt latency p50/p99 us |\n"
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n%s", runs, midRows.c_str());
  }
  printf("geomean slowdown %.3f over %zu kernels; failures %d\n", g, ratios.size(), failures);
  fclose(out);
  return failures ? 1 : 0;
}
