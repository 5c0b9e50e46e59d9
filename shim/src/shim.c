// libptxmig: LD_PRELOAD shim. This first cut only identifies itself; every CUDA call reaches the
// real driver untouched because nothing is interposed yet.
#include <stddef.h>

__attribute__((visibility("default"))) const char ptxmig_shim_version[] = "ptxmig-shim 0";

__attribute__((visibility("default"))) const char *ptxmig_shim_info(void) {
  return ptxmig_shim_version;
}
