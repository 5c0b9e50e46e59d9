// ckpt PID: drives the driver checkpoint API on another process, as ptxmig does: lock,
// checkpoint (device memory to host), restore, unlock. Exit 0 when every step succeeded.
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*fn_t)(int, void *);
int main(int argc, char **argv) {
  if (argc != 2) { fprintf(stderr, "usage: ckpt PID\n"); return 2; }
  int pid = atoi(argv[1]);
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) { fprintf(stderr, "ckpt: %s\n", dlerror()); return 1; }
  int (*init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
  const char *names[] = {"cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
                         "cuCheckpointProcessUnlock"};
  if (!init || init(0)) { fprintf(stderr, "ckpt: cuInit failed\n"); return 1; }
  for (int i = 0; i < 4; i++) {
    fn_t f = (fn_t)dlsym(h, names[i]);
    unsigned char args[64];  // every *Args struct: zeroed, lock timeout 10 s
    memset(args, 0, sizeof args);
    if (i == 0) { unsigned t = 10000; memcpy(args, &t, sizeof t); }
    if (!f) { fprintf(stderr, "ckpt: %s not in this driver\n", names[i]); return 1; }
    int r = f(pid, args);
    if (r) { fprintf(stderr, "ckpt: %s(%d) = %d\n", names[i], pid, r); return 1; }
    printf("%s ok\n", names[i]);
  }
  return 0;
}
