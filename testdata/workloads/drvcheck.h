// CK: a checked CUDA driver-API call for the workloads that use the driver API directly (C or
// C++): on failure, the call, its error string and the line go to stderr, and the program exits 2.
#pragma once
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(call)                                                              \
  do {                                                                        \
    CUresult r_ = (call);                                                     \
    if (r_ != CUDA_SUCCESS) {                                                 \
      const char *s_ = "?";                                                   \
      cuGetErrorString(r_, &s_);                                              \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, s_);      \
      exit(2);                                                                \
    }                                                                         \
  } while (0)
