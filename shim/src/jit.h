// JIT compilers' cubins (jit.c): the entry points of NVRTC and nvJitLink that hand an app a cubin
// compiled from PTX, wrapped where the app looks them up with dlsym, so that the module it loads
// from that cubin gets twins (instr_jit_cubin, instr_link_*).
#ifndef PTXMIG_JIT_H
#define PTXMIG_JIT_H

// jit_dlsym: the shim's wrapper for the symbol name as found through handle when it is one of
// NVRTC's or nvJitLink's wrapped entry points (and preemption is on), else NULL (the caller then
// passes the lookup through to glibc unchanged).
void *jit_dlsym(void *handle, const char *name);

#endif
