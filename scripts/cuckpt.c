/* cuckpt PID ACTION... — the driver checkpoint API by PID, each call timed (like cuda-checkpoint).
 * ACTION: lock[:TIMEOUT_MS] | checkpoint | restore[:OLD=NEW[,OLD=NEW...]] | unlock | state | tid
 * Prints "ACTION MS" per call; exits 1 on the first failure. No CUDA headers: types declared here. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef struct { unsigned char b[16]; } uuid_t_;
typedef struct { unsigned int timeoutMs, r0; uint64_t r1[7]; } lock_args;
typedef struct { uint64_t r[8]; } plain_args;
typedef struct { uuid_t_ o, n; } pair;
typedef struct { pair *pairs; unsigned int count; char r[44]; uint64_t r1; } restore_args;
static int (*cuInit)(unsigned), (*getState)(int, int *), (*lockp)(int, lock_args *), (*ckpt)(int, plain_args *),
    (*rest)(int, restore_args *), (*unlock)(int, plain_args *), (*errname)(int, const char **), (*restoreTid)(int, int *);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }
static int parse_uuid(const char *s, uuid_t_ *u) {
  if (!strncmp(s, "GPU-", 4)) s += 4;
  int n = 0;
  for (; *s && n < 32; s++) {
    if (*s == '-') continue;
    int v = (*s >= '0' && *s <= '9') ? *s - '0' : (*s >= 'a' && *s <= 'f') ? *s - 'a' + 10 : -1;
    if (v < 0) return -1;
    u->b[n / 2] = n % 2 ? u->b[n / 2] | v : v << 4;
    n++;
  }
  return n == 32 ? 0 : -1;
}
int main(int argc, char **argv) {
  if (argc < 3) { fprintf(stderr, "usage: cuckpt PID ACTION...\n"); return 2; }
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) { fprintf(stderr, "no NVIDIA driver: %s\n", dlerror()); return 1; }
  *(void **)&cuInit = dlsym(h, "cuInit"); *(void **)&getState = dlsym(h, "cuCheckpointProcessGetState");
  *(void **)&lockp = dlsym(h, "cuCheckpointProcessLock"); *(void **)&ckpt = dlsym(h, "cuCheckpointProcessCheckpoint");
  *(void **)&rest = dlsym(h, "cuCheckpointProcessRestore"); *(void **)&unlock = dlsym(h, "cuCheckpointProcessUnlock");
  *(void **)&errname = dlsym(h, "cuGetErrorName"); *(void **)&restoreTid = dlsym(h, "cuCheckpointProcessGetRestoreThreadId");
  if (!cuInit || !getState || !lockp || !ckpt || !rest || !unlock) { fprintf(stderr, "driver lacks the checkpoint API\n"); return 1; }
  double t0 = now();
  if (cuInit(0)) { fprintf(stderr, "cuInit failed\n"); return 1; }
  printf("cuInit %.1f\n", now() - t0);
  int pid = atoi(argv[1]);
  for (int i = 2; i < argc; i++) {
    char *a = argv[i], *arg = strchr(a, ':');
    if (arg) *arg++ = 0;
    int r = 0; double s = now();
    if (!strcmp(a, "lock")) { lock_args l; memset(&l, 0, sizeof l); l.timeoutMs = arg ? atoi(arg) : 0; r = lockp(pid, &l); }
    else if (!strcmp(a, "checkpoint")) { plain_args p; memset(&p, 0, sizeof p); r = ckpt(pid, &p); }
    else if (!strcmp(a, "unlock")) { plain_args p; memset(&p, 0, sizeof p); r = unlock(pid, &p); }
    else if (!strcmp(a, "state")) { int st = -1; r = getState(pid, &st); printf("state %d\n", st); }
    else if (!strcmp(a, "tid")) { int tid = -1; r = restoreTid ? restoreTid(pid, &tid) : 1; printf("restore tid %d\n", tid); }
    else if (!strcmp(a, "restore")) {
      pair pairs[16]; unsigned n = 0; restore_args ra; memset(&ra, 0, sizeof ra);
      for (char *tok = arg ? strtok(arg, ",") : NULL; tok && n < 16; tok = strtok(NULL, ",")) {
        char *eq = strchr(tok, '='); if (!eq) { fprintf(stderr, "bad pair %s\n", tok); return 2; }
        *eq = 0;
        if (parse_uuid(tok, &pairs[n].o) || parse_uuid(eq + 1, &pairs[n].n)) { fprintf(stderr, "bad uuid\n"); return 2; }
        n++;
      }
      if (n) { ra.pairs = pairs; ra.count = n; }
      r = rest(pid, &ra);
    } else { fprintf(stderr, "unknown action %s\n", a); return 2; }
    if (r) { const char *e = "?"; if (errname) errname(r, &e); fprintf(stderr, "%s: %s (%d)\n", a, e, r); return 1; }
    printf("%s %.1f\n", a, now() - s);
  }
  return 0;
}
