// dlsymlog.so: an LD_PRELOAD probe that appends to $DLSYMLOG every dlsym lookup of an NVIDIA
// library's symbol (names starting "nv", "__nv" or "cu"), with the library that answered. Used
// by probe-jit.sh to see how a framework reaches NVRTC, nvJitLink and the driver's linker. Not
// for use under the shim (both define dlsym).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real;

void *dlsym(void *h, const char *name) {
  if (!real) real = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
  if (!real) real = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
  void *r = real ? real(h, name) : NULL;
  const char *path = getenv("DLSYMLOG");
  if (path && name && (strncmp(name, "nv", 2) == 0 || strncmp(name, "__nv", 4) == 0 || strncmp(name, "cuLink", 6) == 0 ||
                       strncmp(name, "cuModuleLoad", 12) == 0 || strncmp(name, "cuLibraryLoad", 13) == 0)) {
    Dl_info di = {0};
    FILE *f = fopen(path, "a");
    if (f) {
      fprintf(f, "dlsym(%s) -> %s\n", name, r && dladdr(r, &di) && di.dli_fname ? di.dli_fname : "(null)");
      fclose(f);
    }
  }
  return r;
}
