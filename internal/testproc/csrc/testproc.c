/* ptxmig-testproc: a small CPU process with observable, verifiable state, for CRIU tests and the
 * CPU demo.
 *
 *   ptxmig-testproc STATEFILE [--mib N] [--interval-ms M] [--steps K] [--log]
 *
 * Holds N MiB (default 4) of heap words seeded with mix(j). Every M ms (default 50) it runs step i:
 *   idx = h % nwords;  h = mix(h ^ buf[idx] ^ i);  buf[idx] ^= h
 * starting from h = 0x5054584d4947 ("PTXMIG"), and pwrite()s one fixed 128-byte record at offset 0
 * of STATEFILE:  "pid P step I hash H16 done D crc C8" padded with spaces, ending in '\n' (C8: FNV-1a
 * of the text before " crc", so that a reader can tell a record torn by a concurrent write). The file's size
 * never changes, so CRIU can restore it after the process ran on. The hash after step i depends on
 * the whole history and the heap, so a restored process that continues the chain exactly proves
 * its memory came back bit for bit. With --steps K it stops after step K (done 1) and exits 0.
 * With --log it also prints "step I hash H16" to stdout.
 *
 * With --uvm FILE (at least 4096 bytes) it maps FILE shared and starts a second thread that reads
 * its first word every 100 us, as a thread of a CUDA process may touch the driver's mappings: a
 * fake driver truncates FILE at "checkpoint" and restores its size at "restore", so the process
 * dies of SIGBUS if that thread runs in between (internal/hold keeps it from running). The main
 * thread (tid = pid) plays the driver's restore thread. With --threads N it starts N more threads
 * that sleep 1 ms at a time (a process with many threads, as frameworks have).
 */
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

static uint32_t fnv1a(const char *p, int n) {
  uint32_t x = 2166136261u;
  for (int i = 0; i < n; i++) x = (x ^ (uint8_t)p[i]) * 16777619u;
  return x;
}

static void record(int fd, long step, uint64_t h, int done) {
  char rec[128];
  memset(rec, ' ', sizeof rec);
  int n = snprintf(rec, sizeof rec, "pid %d step %ld hash %016" PRIx64 " done %d", (int)getpid(), step, h, done);
  if (n > 0 && n < (int)sizeof rec) n += snprintf(rec + n, sizeof rec - (size_t)n, " crc %08" PRIx32, fnv1a(rec, n));
  if (n > 0 && n < (int)sizeof rec) rec[n] = ' ';
  rec[sizeof rec - 1] = '\n';
  if (pwrite(fd, rec, sizeof rec, 0) != (ssize_t)sizeof rec) {
    perror("pwrite");
    exit(3);
  }
}

static void *uvm_reader(void *p) {
  volatile uint64_t *w = p;
  uint64_t sum = 0;
  for (;;) {
    sum += *w;
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
  }
  return (void *)(uintptr_t)sum;
}

static void *sleeper(void *p) {
  for (;;) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  return p;
}

int main(int argc, char **argv) {
  if (argc < 2 || argv[1][0] == '-') {
    fprintf(stderr, "usage: ptxmig-testproc STATEFILE [--mib N] [--interval-ms M] [--steps K] [--log]\n");
    return 2;
  }
  long mib = 4, interval = 50, steps = 0;
  int log = 0;
  const char *uvm = NULL;
  long nthreads = 0;
  for (int i = 2; i < argc; i++) {
    if (!strcmp(argv[i], "--log")) { log = 1; continue; }
    if (i + 1 >= argc) { fprintf(stderr, "missing value for %s\n", argv[i]); return 2; }
    if (!strcmp(argv[i], "--mib")) mib = atol(argv[++i]);
    else if (!strcmp(argv[i], "--interval-ms")) interval = atol(argv[++i]);
    else if (!strcmp(argv[i], "--steps")) steps = atol(argv[++i]);
    else if (!strcmp(argv[i], "--uvm")) uvm = argv[++i];
    else if (!strcmp(argv[i], "--threads")) nthreads = atol(argv[++i]);
    else { fprintf(stderr, "unknown flag %s\n", argv[i]); return 2; }
  }
  if (mib <= 0 || interval < 0 || steps < 0 || nthreads < 0 || nthreads > 4096) { fprintf(stderr, "bad arguments\n"); return 2; }
  size_t n = (size_t)mib * (1u << 20) / sizeof(uint64_t);
  uint64_t *buf = malloc(n * sizeof *buf);
  if (!buf) { perror("malloc"); return 3; }
  for (size_t j = 0; j < n; j++) buf[j] = mix(j);
  int fd = open(argv[1], O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) { perror(argv[1]); return 3; }
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (uvm) {
    int ufd = open(uvm, O_RDWR | O_CLOEXEC);
    void *m = ufd < 0 ? MAP_FAILED : mmap(NULL, 4096, PROT_READ, MAP_SHARED, ufd, 0);
    pthread_t t;
    if (m == MAP_FAILED || pthread_create(&t, NULL, uvm_reader, m)) { perror(uvm); return 3; }
    close(ufd);
  }
  for (long i = 0; i < nthreads; i++) {
    pthread_t t;
    if (pthread_create(&t, NULL, sleeper, NULL)) { perror("pthread_create"); return 3; }
  }
  uint64_t h = 0x5054584d4947ULL;
  record(fd, 0, h, 0);
  for (long i = 1; steps == 0 || i <= steps; i++) {
    if (interval > 0) {
      struct timespec ts = {interval / 1000, (interval % 1000) * 1000000L};
      while (nanosleep(&ts, &ts) != 0) {}
    }
    size_t idx = (size_t)(h % n);
    h = mix(h ^ buf[idx] ^ (uint64_t)i);
    buf[idx] ^= h;
    record(fd, i, h, steps != 0 && i == steps);
    if (log) printf("step %ld hash %016" PRIx64 "\n", i, h);
  }
  return 0;
}
