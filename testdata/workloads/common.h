// Shared helpers for ptxmig's GPU workloads: checked CUDA calls and tiny flag parsing.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>

#define CHECK(call)                                                                      \
  do {                                                                                   \
    cudaError_t err_ = (call);                                                           \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                 \
                   cudaGetErrorString(err_));                                            \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

#define CHECK_LAUNCH() CHECK(cudaGetLastError())

// flag returns the value after --name, or def when absent; --name without a value is an error.
static inline const char *flag(int argc, char **argv, const char *name, const char *def) {
  for (int i = 1; i < argc; i++) {
    if (std::strcmp(argv[i], name) == 0) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value for %s\n", name);
        std::exit(2);
      }
      return argv[i + 1];
    }
  }
  return def;
}

static inline bool has_flag(int argc, char **argv, const char *name) {
  for (int i = 1; i < argc; i++)
    if (std::strcmp(argv[i], name) == 0) return true;
  return false;
}

static inline void print_uuid(const cudaUUID_t &u) {
  const unsigned char *b = reinterpret_cast<const unsigned char *>(u.bytes);
  std::printf("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
              b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}
