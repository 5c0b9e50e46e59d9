// Interception (hooks.c): the driver and runtime entry points libptxmig exports, its dlsym and its
// resolvers; the top of the shim, which no other module calls. Besides the CUDA ABI, it exports
// the library's identity for ptxmig (ps, Detect) and the tests.
#ifndef PTXMIG_HOOKS_H
#define PTXMIG_HOOKS_H

extern const char ptxmig_shim_version[];  // PTXMIG_SHIM_VERSION
const char *ptxmig_shim_info(void);

#endif
