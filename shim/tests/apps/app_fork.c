// fork while another thread is inside the shim's bookkeeping: the child must be able to use every
// tracking table (allocations, modules, kernels, samples) without deadlocking on a lock the other
// thread held at the moment of the fork. Exits 0 when every child finished in time.
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/wait.h>

#include "common.h"

typedef int CUresult;
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuCtxSetCurrent(void *);
CUresult cuModuleLoadData(void **, const void *);
CUresult cuModuleGetFunction(void **, void *, const char *);
CUresult cuModuleUnload(void *);
CUresult cuMemAlloc_v2(unsigned long long *, size_t);
CUresult cuMemFree_v2(unsigned long long);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);

static void *ctx;
static atomic_int stop;

// one_round touches every table the shim keeps: module (mod_mu), function and launch (k_mu,
// sample_mu: a new function is always sampled), allocation (alloc_mu).
static int one_round(void) {
  void *mod, *fn;
  unsigned long long d;
  int n = 16;
  void *args[] = {&d, &n};
  if (cuModuleLoadData(&mod, test_ptx) || cuModuleGetFunction(&fn, mod, "k_test")) return 1;
  if (cuMemAlloc_v2(&d, 4096)) return 1;
  if (cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, args, NULL)) return 1;
  if (cuMemFree_v2(d) || cuModuleUnload(mod)) return 1;
  return 0;
}

static void *hammer(void *arg) {
  (void)arg;
  CK(cuCtxSetCurrent(ctx));
  while (!atomic_load(&stop))
    if (one_round()) return (void *)1;
  return NULL;
}

int main(int argc, char **argv) {
  int forks = argc > 1 ? atoi(argv[1]) : 300;
  CK(cuInit(0));
  CK(cuDevicePrimaryCtxRetain(&ctx, 0));
  CK(cuCtxSetCurrent(ctx));
  pthread_t t;
  if (pthread_create(&t, NULL, hammer, NULL)) return 2;
  int bad = 0;
  for (int i = 0; i < forks && !bad; i++) {
    pid_t c = fork();
    if (c < 0) return 2;
    if (c == 0) {
      alarm(10);  // a deadlocked child dies of SIGALRM
      CK(cuCtxSetCurrent(ctx));
      _exit(one_round() ? 4 : 0);
    }
    int st;
    if (waitpid(c, &st, 0) != c) return 2;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "app_fork: child %d of %d: %s %d\n", i, forks, WIFSIGNALED(st) ? "killed by signal" : "exit",
              WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
      bad = 1;
    }
  }
  atomic_store(&stop, 1);
  void *r;
  pthread_join(t, &r);
  if (r) {
    fprintf(stderr, "app_fork: hammer thread failed\n");
    return 1;
  }
  if (bad) return 1;
  printf("app_fork: %d forks ok\n", forks);
  return 0;
}
