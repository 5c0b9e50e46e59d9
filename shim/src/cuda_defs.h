// The few CUDA driver and runtime declarations the shim needs, declared here so that it builds
// without CUDA installed. Only ABI-relevant shapes are reproduced; layouts follow cuda.h (12.x/13.x).
#ifndef PTXMIG_CUDA_DEFS_H
#define PTXMIG_CUDA_DEFS_H
#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_PEER_ACCESS_UNSUPPORTED 217
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_NOT_FOUND 500

typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUlib_st *CUlibrary;
typedef struct CUkern_st *CUkernel;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUlinkState_st *CUlinkState;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef int CUjit_option;
typedef int CUlibraryOption;
typedef int CUstreamCaptureMode;

typedef struct { char bytes[16]; } CUuuid;

#define CU_STREAM_PER_THREAD ((CUstream)0x2)

// cuGetProcAddress flags and status.
#define CU_GET_PROC_ADDRESS_DEFAULT 0
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM 1
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2
typedef enum {
  CU_GET_PROC_ADDRESS_SUCCESS = 0,
  CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
  CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2
} CUdriverProcAddressQueryResult;

// cuLaunchKernelEx configuration (cuda.h CUlaunchConfig_st). Attributes are 72 bytes each in 12.x
// and 13.x: an id, padding and a 64-byte value union.
typedef struct {
  int id;
  char pad[4];
  union {
    char pad[64];
    int cooperative;
  } value;
} CUlaunchAttribute;
#define CU_LAUNCH_ATTRIBUTE_COOPERATIVE 2
typedef struct {
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  CUstream hStream;
  CUlaunchAttribute *attrs;
  unsigned int numAttrs;
} CUlaunchConfig;

// cuLaunchCooperativeKernelMultiDevice parameters (deprecated, still exported).
typedef struct {
  CUfunction function;
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  CUstream hStream;
  void **kernelParams;
} CUDA_LAUNCH_PARAMS;

// Only the leading fields of CUmemAllocationProp are read (type, handle type, location).
typedef struct {
  int type;
  int requestedHandleTypes;
  struct {
    int type;
    int id;
  } location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType, gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

// Cross-process sharing (cuda.h): a CUDA IPC memory handle (CU_IPC_HANDLE_SIZE 64 bytes, passed
// by value), a pool pointer's export data, and the shareable handle type enum.
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { unsigned char reserved[64]; } CUmemPoolPtrExportData;
typedef int CUmemAllocationHandleType;

// Runtime API.
typedef int cudaError_t;
#define cudaSuccess 0

// __cudaRegisterFatBinary's argument.
typedef struct {
  uint32_t magic;
  uint32_t version;
  const void *data;
  const void *filename_or_fatbins;
} ptxmig_fatbin_wrapper;

#endif
