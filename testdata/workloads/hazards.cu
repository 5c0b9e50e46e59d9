// hazards: one long many-block kernel L with every preemption hazard of
// ../shared/notes/preemption-runtime.md §4/§7 built around it.
//
//   hazards [--seconds S | --blocks N] [--work W] [--eblocks M] [--block-ms B] [--only a,b,...]
//           [--device D]
//
// L is hashgrid (hashgrid.h: independent blocks of about B ms each, default 2) on a blocking
// stream s1, sized by calibration to run about S seconds (default 30) alone; --blocks N --work W
// fix it instead (W defaults to 16384 with --blocks). Around L, each enabled hazard queues work
// whose result depends on L having finished completely; "fold" below is hg_fold over L's buffer,
// which also counts the blocks of L that had not run exactly once when it ran:
//   a  on s1 behind L: fold -> copy into pinned host memory -> event ev. The main thread polls
//      cudaEventQuery(ev) (1 ms sleeps) and, once it reports completion, reads the pinned copy.
//   b  a second stream s2 (non-blocking) waits on ev (recorded right behind L when a is off),
//      then folds L's buffer and copies the result to pinned memory.
//   c  on s1: fold -> pinned copy -> cudaLaunchHostFunc; the host function reads the pinned copy.
//   d  on s1: fold -> pinned copy; a thread then sits in cudaStreamSynchronize(s1) while L runs
//      and reads the pinned copy when it returns (no other call in between).
//   e  two host threads with their own streams (e1: blocking, 1-D grid; e2: non-blocking, 2-D grid
//      of 1000 x M/1000 when M is a multiple of 1000) each run hashgrid with M blocks (default
//      N/4 rounded to a multiple of 1000, so about S/4 seconds each) on their own buffer, fold it,
//      copy the result to pinned memory and wait in cudaStreamSynchronize on their stream.
//   f  legacy default stream: a fold of L's buffer on cudaStreamLegacy (ordered behind L only by
//      the legacy stream's implicit synchronisation with the blocking stream s1), then a
//      synchronous cudaMemcpy of its result. (e1 is launched after it, so e1's blocking stream is
//      queued behind it.)
// L always runs; --only selects hazards (default all). Every part must equal a fold of L's buffer
// taken after everything finished, with no block missing or repeated; L, e1 and e2 are also
// checked against a host recomputation of a few sampled blocks.
//
// stdout (line-buffered; everything but the pid is a pure function of N, W, M and --only):
//   pid P
//   params blocks=N work=W eblocks=M only=LETTERS
//   started           after cudaDeviceSynchronize, right before L's launch
//   queued            every hazard's work is submitted and every helper thread is about to block
//   part L HEX16      fold of L's buffer after all work
//   part X HEX16      per enabled hazard, in the order a b c d e1 e2 f
//   result HEX16      all parts combined
//   done
// A failed check prints "check FAILED ..." and exits 1 (no "done"); CUDA errors exit 2. Phase
// timing goes to stderr. With everything enabled the long phase takes about 1.5 x S seconds on
// one GPU (L, e1 and e2 share it).
#include <unistd.h>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include "hashgrid.h"

namespace {

const unsigned long long kSentinel = 0xdeaddeaddeaddeadull;

struct Buf {
  unsigned long long *out = nullptr;
  unsigned int *runs = nullptr;
  unsigned long long n = 0;
};

Buf alloc_buf(unsigned long long n) {
  Buf b;
  b.n = n;
  CHECK(cudaMalloc(&b.out, n * sizeof(*b.out)));
  CHECK(cudaMalloc(&b.runs, n * sizeof(*b.runs)));
  CHECK(cudaMemset(b.out, 0, n * sizeof(*b.out)));
  CHECK(cudaMemset(b.runs, 0, n * sizeof(*b.runs)));
  return b;
}

void free_buf(Buf &b) {
  CHECK(cudaFree(b.out));
  CHECK(cudaFree(b.runs));
}

// Start line for the helper threads: main releases them after L and the queued hazards, and waits
// until each is about to enter its blocking call.
struct Gate {
  std::mutex m;
  std::condition_variable cv;
  int set_up = 0, ready = 0;
  bool go = false;
  void arrive(int Gate::*count) {
    std::lock_guard<std::mutex> l(m);
    this->*count += 1;
    cv.notify_all();
  }
  void wait_count(int Gate::*count, int want) {
    std::unique_lock<std::mutex> l(m);
    cv.wait(l, [&] { return this->*count >= want; });
  }
  void wait_go() {
    std::unique_lock<std::mutex> l(m);
    cv.wait(l, [&] { return go; });
  }
  void release() {
    std::lock_guard<std::mutex> l(m);
    go = true;
    cv.notify_all();
  }
};

struct HostFnCtx {
  const volatile unsigned long long *src;  // pinned copy written on s1 before the host function
  std::atomic<unsigned long long> sum{kSentinel}, bad{kSentinel};
  std::atomic<int> calls{0};
};

void CUDART_CB host_fn(void *p) {  // (c): runs on a CUDA thread; must not call CUDA
  HostFnCtx *c = static_cast<HostFnCtx *>(p);
  c->sum = c->src[0];
  c->bad = c->src[1];
  c->calls++;
}

struct Part {
  const char *name;
  unsigned long long sum = kSentinel, bad = kSentinel;
};

bool check_samples(const char *name, const Buf &b, unsigned int work, unsigned int seed) {
  const int k = 4;
  uint32_t ids[k];
  hg_samples((uint32_t)b.n, ids, k);
  for (int i = 0; i < k; i++) {
    unsigned long long got = 0;
    CHECK(cudaMemcpy(&got, b.out + ids[i], sizeof(got), cudaMemcpyDeviceToHost));
    unsigned long long want = hg_combine(0, hg_block_hash(ids[i], (uint32_t)b.n, work, seed));
    if (got != want) {
      std::printf("check FAILED %s: block %u holds %016llx, host computes %016llx\n", name, ids[i], got, want);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char **argv) {
  if (has_flag(argc, argv, "--help") || has_flag(argc, argv, "-h")) {
    std::printf("usage: hazards [--seconds S | --blocks N] [--work W] [--eblocks M] [--block-ms B] "
                "[--only a,b,c,d,e,f] [--device D]\n");
    return 0;
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  int dev = std::atoi(flag(argc, argv, "--device", "0"));
  double seconds = std::atof(flag(argc, argv, "--seconds", "30"));
  double block_ms = std::atof(flag(argc, argv, "--block-ms", "2"));
  unsigned long long blocks = std::strtoull(flag(argc, argv, "--blocks", "0"), nullptr, 10);
  unsigned long long work = std::strtoull(flag(argc, argv, "--work", "0"), nullptr, 10);
  unsigned long long eblocks = std::strtoull(flag(argc, argv, "--eblocks", "0"), nullptr, 10);
  if (seconds <= 0 || block_ms <= 0 || blocks > 2147483647ull || eblocks > 2147483647ull ||
      work > 0xffffffffull) {
    std::fprintf(stderr, "hazards: need --seconds > 0, --block-ms > 0, --blocks/--eblocks < 2^31, --work < 2^32\n");
    return 2;
  }
  bool on[6] = {};  // a..f
  {
    std::string only = flag(argc, argv, "--only", "a,b,c,d,e,f");
    size_t i = 0;
    while (i <= only.size()) {
      size_t j = only.find(',', i);
      if (j == std::string::npos) j = only.size();
      std::string t = only.substr(i, j - i);
      if (t.size() != 1 || t[0] < 'a' || t[0] > 'f') {
        std::fprintf(stderr, "hazards: --only takes a comma-separated list of a,b,c,d,e,f (got \"%s\")\n",
                     only.c_str());
        return 2;
      }
      on[t[0] - 'a'] = true;
      i = j + 1;
    }
  }
  const bool A = on[0], B = on[1], C = on[2], D = on[3], E = on[4], F = on[5];
  std::string letters;
  for (int i = 0; i < 6; i++)
    if (on[i]) letters += (char)('a' + i);

  CHECK(cudaSetDevice(dev));
  std::printf("pid %d\n", (int)getpid());
  if (blocks == 0) {
    hg_calib c = hg_calibrate(dev, seconds, block_ms, (unsigned int)work);
    blocks = c.blocks;
    work = c.work;
  } else if (work == 0) {
    work = 16384;
  }
  if (eblocks == 0) eblocks = (blocks / 4 + 500) / 1000 * 1000;
  if (eblocks == 0) eblocks = 1000;
  std::printf("params blocks=%llu work=%llu eblocks=%llu only=%s\n", blocks, work, eblocks, letters.c_str());
  const unsigned int W = (unsigned int)work;
  const unsigned int kSeedL = 0x4c, kSeedE1 = 0xe1, kSeedE2 = 0xe2;
  const int fold_grid = hg_fold_grid(dev);

  // Buffers, pinned result slots, device accumulators (zeroed once: every fold has its own).
  Buf L = alloc_buf(blocks), E1, E2;
  if (E) {
    E1 = alloc_buf(eblocks);
    E2 = alloc_buf(eblocks);
  }
  enum { kA, kB, kC, kD, kE1, kE2, kF, kRef, kE1Ref, kE2Ref, kSlots };
  unsigned long long *dacc, *pin;
  CHECK(cudaMalloc(&dacc, kSlots * 2 * sizeof(*dacc)));
  CHECK(cudaMemset(dacc, 0, kSlots * 2 * sizeof(*dacc)));
  CHECK(cudaMallocHost(&pin, kSlots * 2 * sizeof(*pin)));
  for (int i = 0; i < kSlots * 2; i++) pin[i] = kSentinel;
  auto dslot = [&](int s) { return dacc + 2 * s; };
  auto pslot = [&](int s) { return static_cast<volatile unsigned long long *>(pin + 2 * s); };

  cudaStream_t s1, s2 = nullptr;
  CHECK(cudaStreamCreate(&s1));  // blocking: synchronises with the legacy default stream (f)
  if (B) CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t ev = nullptr;
  if (A || B) CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  HostFnCtx hctx;
  hctx.src = pslot(kC);

  Gate gate;
  int nthreads = (D ? 1 : 0) + (E ? 2 : 0);
  std::thread td, te1, te2;
  Part pd{"d"}, pe1{"e1"}, pe2{"e2"};
  if (D) {
    td = std::thread([&] {
      CHECK(cudaSetDevice(dev));
      gate.arrive(&Gate::set_up);
      gate.wait_go();
      gate.arrive(&Gate::ready);
      CHECK(cudaStreamSynchronize(s1));  // (d): blocks while L runs
      pd.sum = pslot(kD)[0];
      pd.bad = pslot(kD)[1];
    });
  }
  auto e_thread = [&](Buf &buf, bool blocking, bool two_d, unsigned int seed, int slot, Part &part) {
    CHECK(cudaSetDevice(dev));
    cudaStream_t s;
    if (blocking) CHECK(cudaStreamCreate(&s));
    else CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    dim3 grid((unsigned int)buf.n);
    if (two_d && buf.n % 1000 == 0) grid = dim3(1000, (unsigned int)(buf.n / 1000));
    gate.arrive(&Gate::set_up);
    gate.wait_go();
    hashgrid<<<grid, HG_THREADS, 0, s>>>(buf.out, buf.runs, W, seed);
    CHECK_LAUNCH();
    hg_fold<<<fold_grid, HG_THREADS, 0, s>>>(buf.out, buf.runs, buf.n, 1, dslot(slot));
    CHECK_LAUNCH();
    CHECK(cudaMemcpyAsync(pin + 2 * slot, dslot(slot), 2 * sizeof(*pin), cudaMemcpyDeviceToHost, s));
    gate.arrive(&Gate::ready);
    CHECK(cudaStreamSynchronize(s));  // (e): each thread blocks on its own stream
    part.sum = pslot(slot)[0];
    part.bad = pslot(slot)[1];
    CHECK(cudaStreamDestroy(s));
  };
  if (E) {
    te1 = std::thread(e_thread, std::ref(E1), true, false, kSeedE1, (int)kE1, std::ref(pe1));
    te2 = std::thread(e_thread, std::ref(E2), false, true, kSeedE2, (int)kE2, std::ref(pe2));
  }
  gate.wait_count(&Gate::set_up, nthreads);

  // ---- the long phase ----
  auto fold_L = [&](int slot, cudaStream_t s) {
    hg_fold<<<fold_grid, HG_THREADS, 0, s>>>(L.out, L.runs, L.n, 1, dslot(slot));
    CHECK_LAUNCH();
  };
  auto copy_out = [&](int slot, cudaStream_t s) {
    CHECK(cudaMemcpyAsync(pin + 2 * slot, dslot(slot), 2 * sizeof(*pin), cudaMemcpyDeviceToHost, s));
  };
  CHECK(cudaDeviceSynchronize());
  std::printf("started\n");
  std::fflush(stdout);
  double t0 = hg_now_s();
  hashgrid<<<(unsigned int)blocks, HG_THREADS, 0, s1>>>(L.out, L.runs, W, kSeedL);
  CHECK_LAUNCH();
  if (A) {  // (a) work and an event behind L on its stream
    fold_L(kA, s1);
    copy_out(kA, s1);
  }
  if (A || B) CHECK(cudaEventRecord(ev, s1));
  if (B) {  // (b) another stream waits on that event, then works on L's output
    CHECK(cudaStreamWaitEvent(s2, ev, 0));
    fold_L(kB, s2);
    copy_out(kB, s2);
  }
  if (C) {  // (c) a host function behind L
    fold_L(kC, s1);
    copy_out(kC, s1);
    CHECK(cudaLaunchHostFunc(s1, host_fn, &hctx));
  }
  if (D) {  // (d) the result a thread in cudaStreamSynchronize(s1) will read
    fold_L(kD, s1);
    copy_out(kD, s1);
  }
  if (F) fold_L(kF, cudaStreamLegacy);  // (f) legacy default stream behind the blocking stream s1
  gate.release();
  gate.wait_count(&Gate::ready, nthreads);
  std::printf("queued\n");
  std::fflush(stdout);

  Part pa{"a"}, pb{"b"}, pc{"c"}, pf{"f"};
  if (A) {  // poll the event, then trust it: read the pinned copy without synchronising
    for (;;) {
      cudaError_t e = cudaEventQuery(ev);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) CHECK(e);
      usleep(1000);
    }
    cudaError_t e = cudaGetLastError();  // cudaErrorNotReady is not an error
    if (e != cudaErrorNotReady) CHECK(e);
    pa.sum = pslot(kA)[0];
    pa.bad = pslot(kA)[1];
  }
  if (F) {  // synchronous copy on the legacy stream
    unsigned long long h[2];
    CHECK(cudaMemcpy(h, dslot(kF), sizeof(h), cudaMemcpyDeviceToHost));
    pf.sum = h[0];
    pf.bad = h[1];
  }
  if (D) td.join();
  if (E) {
    te1.join();
    te2.join();
  }
  CHECK(cudaStreamSynchronize(s1));
  if (B) {
    CHECK(cudaStreamSynchronize(s2));
    pb.sum = pslot(kB)[0];
    pb.bad = pslot(kB)[1];
  }
  if (C) {
    if (hctx.calls != 1) {
      std::printf("check FAILED c: the host function ran %d times\n", hctx.calls.load());
      return 1;
    }
    pc.sum = hctx.sum;
    pc.bad = hctx.bad;
  }
  CHECK(cudaDeviceSynchronize());
  std::fprintf(stderr, "hazards: long phase took %.2f s\n", hg_now_s() - t0);

  // ---- reference folds and checks ----
  fold_L(kRef, s1);
  if (E) {
    hg_fold<<<fold_grid, HG_THREADS, 0, s1>>>(E1.out, E1.runs, E1.n, 1, dslot(kE1Ref));
    CHECK_LAUNCH();
    hg_fold<<<fold_grid, HG_THREADS, 0, s1>>>(E2.out, E2.runs, E2.n, 1, dslot(kE2Ref));
    CHECK_LAUNCH();
  }
  unsigned long long ref[kSlots * 2];
  CHECK(cudaMemcpyAsync(ref, dacc, sizeof(ref), cudaMemcpyDeviceToHost, s1));
  CHECK(cudaStreamSynchronize(s1));
  if (ref[2 * kRef + 1] != 0) {
    std::printf("check FAILED L: %llu of %llu blocks did not run exactly once\n", ref[2 * kRef + 1], blocks);
    return 1;
  }
  if (!check_samples("L", L, W, kSeedL)) return 1;
  Part *parts_on_L[] = {A ? &pa : nullptr, B ? &pb : nullptr, C ? &pc : nullptr, D ? &pd : nullptr,
                        F ? &pf : nullptr};
  for (Part *p : parts_on_L) {
    if (!p) continue;
    if (p->bad != 0 || p->sum != ref[2 * kRef]) {
      std::printf("check FAILED %s: its fold of L saw %llu unfinished blocks, sum %016llx (final %016llx)\n",
                  p->name, p->bad, p->sum, ref[2 * kRef]);
      return 1;
    }
  }
  if (E) {
    struct { Part *p; int refslot; Buf *b; unsigned int seed; } es[] = {{&pe1, kE1Ref, &E1, kSeedE1},
                                                                       {&pe2, kE2Ref, &E2, kSeedE2}};
    for (auto &x : es) {
      if (x.p->bad != 0 || ref[2 * x.refslot + 1] != 0 || x.p->sum != ref[2 * x.refslot]) {
        std::printf("check FAILED %s: fold saw %llu unfinished blocks, sum %016llx (final %016llx, %llu)\n",
                    x.p->name, x.p->bad, x.p->sum, ref[2 * x.refslot], ref[2 * x.refslot + 1]);
        return 1;
      }
      if (!check_samples(x.p->name, *x.b, W, x.seed)) return 1;
    }
  }

  // ---- output ----
  unsigned long long result = hg_mix64(ref[2 * kRef] ^ 0x4cull);
  std::printf("part L %016llx\n", ref[2 * kRef]);
  Part *all[] = {A ? &pa : nullptr, B ? &pb : nullptr, C ? &pc : nullptr, D ? &pd : nullptr,
                 E ? &pe1 : nullptr, E ? &pe2 : nullptr, F ? &pf : nullptr};
  unsigned long long tag = 0;
  for (Part *p : all) {
    tag++;
    if (!p) continue;
    std::printf("part %s %016llx\n", p->name, p->sum);
    result = hg_combine(result, p->sum ^ tag);
  }
  std::printf("result %016llx\n", result);

  if (ev) CHECK(cudaEventDestroy(ev));
  if (s2) CHECK(cudaStreamDestroy(s2));
  CHECK(cudaStreamDestroy(s1));
  CHECK(cudaFreeHost(pin));
  CHECK(cudaFree(dacc));
  free_buf(L);
  if (E) {
    free_buf(E1);
    free_buf(E2);
  }
  std::printf("done\n");
  return 0;
}
