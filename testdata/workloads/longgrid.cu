// longgrid: a long kernel made of many short, independent blocks (block-granular preemption).
//
//   longgrid [--seconds S | --blocks N] [--work W] [--block-ms M] [--repeat R] [--queue] [--device D]
//
// Each repeat launches hashgrid (hashgrid.h) on the legacy default stream: N blocks of 256
// threads, each running W rounds of an integer hash (about M ms per block while a full wave is
// resident), then folding its block hash into its own slice of a device buffer. A checksum kernel
// then reduces the buffer. The buffer is not reset between repeats and a block's update is not
// idempotent, so a block that ran twice or was skipped changes every later result.
//
// --seconds S (default 30) calibrates N (and W, unless --work is given) from short timed runs so
// the kernel takes about S seconds; --blocks N --work W fixes both (W defaults to 16384 with
// --blocks). The chosen values are printed, and `longgrid --blocks N --work W --repeat R` prints
// the same lines (but pid). Calibration details go to stderr.
//
// stdout (line-buffered):
//   pid P
//   params blocks=N work=W repeat=R
//   then per repeat r = 1..R:
//     started            after cudaDeviceSynchronize, right before the long launch
//     result HEX16       checksum of the buffer after repeat r (a pure function of N, W, r)
//   done
// Self-check after each repeat: every block ran exactly r times (counted on the device), and a
// few sampled blocks match a host recomputation. A failure prints "check FAILED ..." and exits 1
// (no "done"). CUDA errors exit 2.
#include <unistd.h>
#include "hashgrid.h"

int main(int argc, char **argv) {
  if (has_flag(argc, argv, "--help") || has_flag(argc, argv, "-h")) {
    std::printf("usage: longgrid [--seconds S | --blocks N] [--work W] [--block-ms M] [--repeat R] [--queue] [--device D]\n");
    return 0;
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  int dev = std::atoi(flag(argc, argv, "--device", "0"));
  double seconds = std::atof(flag(argc, argv, "--seconds", "30"));
  double block_ms = std::atof(flag(argc, argv, "--block-ms", "2"));
  unsigned long long blocks = std::strtoull(flag(argc, argv, "--blocks", "0"), nullptr, 10);
  unsigned long long work = std::strtoull(flag(argc, argv, "--work", "0"), nullptr, 10);
  long repeat = std::strtol(flag(argc, argv, "--repeat", "1"), nullptr, 10);
  bool queue = has_flag(argc, argv, "--queue");
  if (seconds <= 0 || block_ms <= 0 || repeat < 1 || blocks > 2147483647ull || work > 0xffffffffull) {
    std::fprintf(stderr, "longgrid: need --seconds > 0, --block-ms > 0, --repeat >= 1, --blocks < 2^31, --work < 2^32\n");
    return 2;
  }
  CHECK(cudaSetDevice(dev));
  std::printf("pid %d\n", (int)getpid());
  if (blocks == 0) {
    hg_calib c = hg_calibrate(dev, seconds, block_ms, (unsigned int)work);
    blocks = c.blocks;
    work = c.work;
  } else if (work == 0) {
    work = 16384;
  }
  std::printf("params blocks=%llu work=%llu repeat=%ld\n", blocks, work, repeat);

  unsigned long long *out, *acc;
  unsigned int *runs;
  CHECK(cudaMalloc(&out, blocks * sizeof(*out)));
  CHECK(cudaMalloc(&runs, blocks * sizeof(*runs)));
  CHECK(cudaMalloc(&acc, 2 * sizeof(*acc)));
  CHECK(cudaMemset(out, 0, blocks * sizeof(*out)));
  CHECK(cudaMemset(runs, 0, blocks * sizeof(*runs)));
  const int nsamples = 6;
  uint32_t ids[nsamples];
  unsigned long long expect[nsamples] = {};
  hg_samples((uint32_t)blocks, ids, nsamples);
  int fold_grid = hg_fold_grid(dev);

  for (long r = 1; r <= repeat; r++) {
    unsigned int seed = (unsigned int)r;
    CHECK(cudaMemset(acc, 0, 2 * sizeof(*acc)));
    CHECK(cudaDeviceSynchronize());
    std::printf("started\n");
    std::fflush(stdout);
    double t0 = hg_now_s();
    hashgrid<<<(unsigned int)blocks, HG_THREADS>>>(out, runs, (unsigned int)work, seed);
    CHECK_LAUNCH();
    // By default the host waits for the long kernel before queuing the fold, so the long kernel
    // is its stream's last submission while it runs (the shim's tail rule preempts only such a
    // kernel). --queue submits the fold right behind it instead (the shim then drains it).
    if (!queue) CHECK(cudaStreamSynchronize(0));
    hg_fold<<<fold_grid, HG_THREADS>>>(out, runs, blocks, (unsigned int)r, acc);
    CHECK_LAUNCH();
    unsigned long long h[2];
    CHECK(cudaMemcpy(h, acc, sizeof(h), cudaMemcpyDeviceToHost));
    std::fprintf(stderr, "longgrid: repeat %ld took %.2f s\n", r, hg_now_s() - t0);
    if (h[1] != 0) {
      std::printf("check FAILED repeat %ld: %llu of %llu blocks did not run exactly %ld times\n", r, h[1],
                  blocks, r);
      return 1;
    }
    for (int i = 0; i < nsamples; i++) {
      unsigned long long got = 0;
      CHECK(cudaMemcpy(&got, out + ids[i], sizeof(got), cudaMemcpyDeviceToHost));
      expect[i] = hg_combine(expect[i], hg_block_hash(ids[i], (uint32_t)blocks, (uint32_t)work, seed));
      if (got != expect[i]) {
        std::printf("check FAILED repeat %ld: block %u holds %016llx, host computes %016llx\n", r, ids[i], got,
                    expect[i]);
        return 1;
      }
    }
    std::printf("result %016llx\n", h[0]);
  }
  CHECK(cudaFree(out));
  CHECK(cudaFree(runs));
  CHECK(cudaFree(acc));
  std::printf("done\n");
  return 0;
}
