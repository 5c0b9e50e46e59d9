// Interception: exported driver symbols, dlsym, cuGetProcAddress[_v2] and
// cudaGetDriverEntryPoint[ByVersion]. Every wrapper calls the exact real function the caller would
// have reached (per ABI and per-thread-stream variant) and only adds bookkeeping around it.
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base.h"
#include "ctl.h"
#include "hooks.h"
#include "instr.h"
#include "jit.h"
#include "json.h"
#include "preempt.h"
#include "track.h"
#include "vmm.h"

// Interception counters (status "interception", and the tests' self-check).
static struct {
  atomic_ulong dlsym_hits, getproc_hits, getproc_v2_hits, entrypoint_hits, by_name, unmatched, passthrough;
} istats;
// report_interception writes them for the status reply (ctl.c, which gets it at table_init).
static void report_interception(jbuf *b) {
  jb_printf(b,
            "{\"dlsym\":%lu,\"cuGetProcAddress\":%lu,\"cuGetProcAddress_v2\":%lu,"
            "\"cudaGetDriverEntryPoint\":%lu,\"by_name\":%lu,\"unmatched\":%lu,\"passthrough\":%lu}",
            atomic_load(&istats.dlsym_hits), atomic_load(&istats.getproc_hits), atomic_load(&istats.getproc_v2_hits),
            atomic_load(&istats.entrypoint_hits), atomic_load(&istats.by_name), atomic_load(&istats.unmatched),
            atomic_load(&istats.passthrough));
}

// ---- hook table ----
// Every call that submits GPU work (gated while quiesced and counted for the tail rule), the
// stream life cycle, and the waits made honest about preempted twins.
#define SUBMIT_HOOKS(X)                                                              \
  X(cuStreamCreate, "cuStreamCreate", 0, 0, 0, 0)                                    \
  X(cuStreamCreateWithPriority, "cuStreamCreateWithPriority", 0, 0, 0, 0)            \
  X(cuStreamDestroy_v2, "cuStreamDestroy", 4000, 0, 0, 0)                            \
  X(cuFuncSetAttribute, "cuFuncSetAttribute", 0, 0, 0, 0)                            \
  X(cuStreamSynchronize, "cuStreamSynchronize", 0, 0, 0, 0)                          \
  X(cuStreamSynchronize_ptsz, "cuStreamSynchronize", 0, 0, 1, 0)                     \
  X(cuStreamQuery, "cuStreamQuery", 0, 0, 0, 0)                                      \
  X(cuStreamQuery_ptsz, "cuStreamQuery", 0, 0, 1, 0)                                 \
  X(cuCtxSynchronize, "cuCtxSynchronize", 0, 0, 0, 0)                                \
  X(cuEventRecord, "cuEventRecord", 0, 0, 0, 0)                                      \
  X(cuEventRecord_ptsz, "cuEventRecord", 0, 0, 1, 0)                                 \
  X(cuEventRecordWithFlags, "cuEventRecordWithFlags", 0, 0, 0, 0)                    \
  X(cuEventRecordWithFlags_ptsz, "cuEventRecordWithFlags", 0, 0, 1, 0)               \
  X(cuStreamWaitEvent, "cuStreamWaitEvent", 0, 0, 0, 0)                              \
  X(cuStreamWaitEvent_ptsz, "cuStreamWaitEvent", 0, 0, 1, 0)                         \
  X(cuLaunchHostFunc, "cuLaunchHostFunc", 0, 0, 0, 0)                                \
  X(cuLaunchHostFunc_ptsz, "cuLaunchHostFunc", 0, 0, 1, 0)                           \
  X(cuStreamAddCallback, "cuStreamAddCallback", 0, 0, 0, 0)                          \
  X(cuStreamAddCallback_ptsz, "cuStreamAddCallback", 0, 0, 1, 0)                     \
  X(cuStreamWaitValue32, "cuStreamWaitValue32", 0, 11070, 0, 0)                      \
  X(cuStreamWaitValue32_ptsz, "cuStreamWaitValue32", 0, 11070, 1, 0)                 \
  X(cuStreamWaitValue64, "cuStreamWaitValue64", 0, 11070, 0, 0)                      \
  X(cuStreamWaitValue64_ptsz, "cuStreamWaitValue64", 0, 11070, 1, 0)                 \
  X(cuStreamWriteValue32, "cuStreamWriteValue32", 0, 11070, 0, 0)                    \
  X(cuStreamWriteValue32_ptsz, "cuStreamWriteValue32", 0, 11070, 1, 0)               \
  X(cuStreamWriteValue64, "cuStreamWriteValue64", 0, 11070, 0, 0)                    \
  X(cuStreamWriteValue64_ptsz, "cuStreamWriteValue64", 0, 11070, 1, 0)               \
  X(cuStreamBatchMemOp, "cuStreamBatchMemOp", 0, 11070, 0, 0)                        \
  X(cuStreamBatchMemOp_ptsz, "cuStreamBatchMemOp", 0, 11070, 1, 0)                   \
  X(cuStreamWaitValue32_v2, "cuStreamWaitValue32", 11070, 0, 0, 0)                  \
  X(cuStreamWaitValue32_v2_ptsz, "cuStreamWaitValue32", 11070, 0, 1, 0)             \
  X(cuStreamWaitValue64_v2, "cuStreamWaitValue64", 11070, 0, 0, 0)                  \
  X(cuStreamWaitValue64_v2_ptsz, "cuStreamWaitValue64", 11070, 0, 1, 0)             \
  X(cuStreamWriteValue32_v2, "cuStreamWriteValue32", 11070, 0, 0, 0)                \
  X(cuStreamWriteValue32_v2_ptsz, "cuStreamWriteValue32", 11070, 0, 1, 0)           \
  X(cuStreamWriteValue64_v2, "cuStreamWriteValue64", 11070, 0, 0, 0)                \
  X(cuStreamWriteValue64_v2_ptsz, "cuStreamWriteValue64", 11070, 0, 1, 0)           \
  X(cuStreamBatchMemOp_v2, "cuStreamBatchMemOp", 11070, 0, 0, 0)                    \
  X(cuStreamBatchMemOp_v2_ptsz, "cuStreamBatchMemOp", 11070, 0, 1, 0)               \
  X(cuMemPrefetchAsync, "cuMemPrefetchAsync", 0, 12020, 0, 0)                        \
  X(cuMemPrefetchAsync_ptsz, "cuMemPrefetchAsync", 0, 12020, 1, 0)                   \
  X(cuMemPrefetchAsync_v2, "cuMemPrefetchAsync", 12020, 0, 0, 0)                     \
  X(cuMemPrefetchAsync_v2_ptsz, "cuMemPrefetchAsync", 12020, 0, 1, 0)                \
  X(cuGraphUpload, "cuGraphUpload", 0, 0, 0, 0)                                      \
  X(cuGraphUpload_ptsz, "cuGraphUpload", 0, 0, 1, 0)                                 \
  X(cuSignalExternalSemaphoresAsync, "cuSignalExternalSemaphoresAsync", 0, 0, 0, 0)  \
  X(cuSignalExternalSemaphoresAsync_ptsz, "cuSignalExternalSemaphoresAsync", 0, 0, 1, 0) \
  X(cuWaitExternalSemaphoresAsync, "cuWaitExternalSemaphoresAsync", 0, 0, 0, 0)      \
  X(cuWaitExternalSemaphoresAsync_ptsz, "cuWaitExternalSemaphoresAsync", 0, 0, 1, 0) \
  X(cuMemcpyAsync, "cuMemcpyAsync", 0, 0, 0, 0)                                      \
  X(cuMemcpyAsync_ptsz, "cuMemcpyAsync", 0, 0, 1, 0)                                 \
  X(cuMemcpyHtoDAsync_v2, "cuMemcpyHtoDAsync", 3020, 0, 0, 0)                        \
  X(cuMemcpyHtoDAsync_v2_ptsz, "cuMemcpyHtoDAsync", 3020, 0, 1, 0)                   \
  X(cuMemcpyDtoHAsync_v2, "cuMemcpyDtoHAsync", 3020, 0, 0, 0)                        \
  X(cuMemcpyDtoHAsync_v2_ptsz, "cuMemcpyDtoHAsync", 3020, 0, 1, 0)                   \
  X(cuMemcpyDtoDAsync_v2, "cuMemcpyDtoDAsync", 3020, 0, 0, 0)                        \
  X(cuMemcpyDtoDAsync_v2_ptsz, "cuMemcpyDtoDAsync", 3020, 0, 1, 0)                   \
  X(cuMemcpyHtoAAsync_v2, "cuMemcpyHtoAAsync", 3020, 0, 0, 0)                        \
  X(cuMemcpyHtoAAsync_v2_ptsz, "cuMemcpyHtoAAsync", 3020, 0, 1, 0)                   \
  X(cuMemcpyAtoHAsync_v2, "cuMemcpyAtoHAsync", 3020, 0, 0, 0)                        \
  X(cuMemcpyAtoHAsync_v2_ptsz, "cuMemcpyAtoHAsync", 3020, 0, 1, 0)                   \
  X(cuMemcpy2DAsync_v2, "cuMemcpy2DAsync", 3020, 0, 0, 0)                            \
  X(cuMemcpy2DAsync_v2_ptsz, "cuMemcpy2DAsync", 3020, 0, 1, 0)                       \
  X(cuMemcpy3DAsync_v2, "cuMemcpy3DAsync", 3020, 0, 0, 0)                            \
  X(cuMemcpy3DAsync_v2_ptsz, "cuMemcpy3DAsync", 3020, 0, 1, 0)                       \
  X(cuMemcpy3DPeerAsync, "cuMemcpy3DPeerAsync", 0, 0, 0, 0)                          \
  X(cuMemcpy3DPeerAsync_ptsz, "cuMemcpy3DPeerAsync", 0, 0, 1, 0)                     \
  X(cuMemcpyPeerAsync, "cuMemcpyPeerAsync", 0, 0, 0, 0)                              \
  X(cuMemcpyPeerAsync_ptsz, "cuMemcpyPeerAsync", 0, 0, 1, 0)                         \
  X(cuMemsetD8Async, "cuMemsetD8Async", 0, 0, 0, 0)                                  \
  X(cuMemsetD8Async_ptsz, "cuMemsetD8Async", 0, 0, 1, 0)                             \
  X(cuMemsetD16Async, "cuMemsetD16Async", 0, 0, 0, 0)                                \
  X(cuMemsetD16Async_ptsz, "cuMemsetD16Async", 0, 0, 1, 0)                           \
  X(cuMemsetD32Async, "cuMemsetD32Async", 0, 0, 0, 0)                                \
  X(cuMemsetD32Async_ptsz, "cuMemsetD32Async", 0, 0, 1, 0)                           \
  X(cuMemsetD2D8Async, "cuMemsetD2D8Async", 0, 0, 0, 0)                              \
  X(cuMemsetD2D8Async_ptsz, "cuMemsetD2D8Async", 0, 0, 1, 0)                         \
  X(cuMemsetD2D16Async, "cuMemsetD2D16Async", 0, 0, 0, 0)                            \
  X(cuMemsetD2D16Async_ptsz, "cuMemsetD2D16Async", 0, 0, 1, 0)                       \
  X(cuMemsetD2D32Async, "cuMemsetD2D32Async", 0, 0, 0, 0)                            \
  X(cuMemsetD2D32Async_ptsz, "cuMemsetD2D32Async", 0, 0, 1, 0)                       \
  X(cuMemcpy, "cuMemcpy", 0, 0, 0, 0)                                                \
  X(cuMemcpy_ptds, "cuMemcpy", 0, 0, 1, 0)                                           \
  X(cuMemcpyHtoD_v2, "cuMemcpyHtoD", 3020, 0, 0, 0)                                  \
  X(cuMemcpyHtoD_v2_ptds, "cuMemcpyHtoD", 3020, 0, 1, 0)                             \
  X(cuMemcpyDtoH_v2, "cuMemcpyDtoH", 3020, 0, 0, 0)                                  \
  X(cuMemcpyDtoH_v2_ptds, "cuMemcpyDtoH", 3020, 0, 1, 0)                             \
  X(cuMemcpyDtoD_v2, "cuMemcpyDtoD", 3020, 0, 0, 0)                                  \
  X(cuMemcpyDtoD_v2_ptds, "cuMemcpyDtoD", 3020, 0, 1, 0)                             \
  X(cuMemcpyDtoA_v2, "cuMemcpyDtoA", 3020, 0, 0, 0)                                  \
  X(cuMemcpyDtoA_v2_ptds, "cuMemcpyDtoA", 3020, 0, 1, 0)                             \
  X(cuMemcpyAtoD_v2, "cuMemcpyAtoD", 3020, 0, 0, 0)                                  \
  X(cuMemcpyAtoD_v2_ptds, "cuMemcpyAtoD", 3020, 0, 1, 0)                             \
  X(cuMemcpyHtoA_v2, "cuMemcpyHtoA", 3020, 0, 0, 0)                                  \
  X(cuMemcpyHtoA_v2_ptds, "cuMemcpyHtoA", 3020, 0, 1, 0)                             \
  X(cuMemcpyAtoH_v2, "cuMemcpyAtoH", 3020, 0, 0, 0)                                  \
  X(cuMemcpyAtoH_v2_ptds, "cuMemcpyAtoH", 3020, 0, 1, 0)                             \
  X(cuMemcpyAtoA_v2, "cuMemcpyAtoA", 3020, 0, 0, 0)                                  \
  X(cuMemcpyAtoA_v2_ptds, "cuMemcpyAtoA", 3020, 0, 1, 0)                             \
  X(cuMemcpy2D_v2, "cuMemcpy2D", 3020, 0, 0, 0)                                      \
  X(cuMemcpy2D_v2_ptds, "cuMemcpy2D", 3020, 0, 1, 0)                                 \
  X(cuMemcpy2DUnaligned_v2, "cuMemcpy2DUnaligned", 3020, 0, 0, 0)                    \
  X(cuMemcpy2DUnaligned_v2_ptds, "cuMemcpy2DUnaligned", 3020, 0, 1, 0)               \
  X(cuMemcpy3D_v2, "cuMemcpy3D", 3020, 0, 0, 0)                                      \
  X(cuMemcpy3D_v2_ptds, "cuMemcpy3D", 3020, 0, 1, 0)                                 \
  X(cuMemcpy3DPeer, "cuMemcpy3DPeer", 0, 0, 0, 0)                                    \
  X(cuMemcpy3DPeer_ptds, "cuMemcpy3DPeer", 0, 0, 1, 0)                               \
  X(cuMemcpyPeer, "cuMemcpyPeer", 0, 0, 0, 0)                                        \
  X(cuMemcpyPeer_ptds, "cuMemcpyPeer", 0, 0, 1, 0)                                   \
  X(cuMemsetD8_v2, "cuMemsetD8", 3020, 0, 0, 0)                                      \
  X(cuMemsetD8_v2_ptds, "cuMemsetD8", 3020, 0, 1, 0)                                 \
  X(cuMemsetD16_v2, "cuMemsetD16", 3020, 0, 0, 0)                                    \
  X(cuMemsetD16_v2_ptds, "cuMemsetD16", 3020, 0, 1, 0)                               \
  X(cuMemsetD32_v2, "cuMemsetD32", 3020, 0, 0, 0)                                    \
  X(cuMemsetD32_v2_ptds, "cuMemsetD32", 3020, 0, 1, 0)                               \
  X(cuMemsetD2D8_v2, "cuMemsetD2D8", 3020, 0, 0, 0)                                  \
  X(cuMemsetD2D8_v2_ptds, "cuMemsetD2D8", 3020, 0, 1, 0)                             \
  X(cuMemsetD2D16_v2, "cuMemsetD2D16", 3020, 0, 0, 0)                                \
  X(cuMemsetD2D16_v2_ptds, "cuMemsetD2D16", 3020, 0, 1, 0)                           \
  X(cuMemsetD2D32_v2, "cuMemsetD2D32", 3020, 0, 0, 0)                                \
  X(cuMemsetD2D32_v2_ptds, "cuMemsetD2D32", 3020, 0, 1, 0)

// X(symbol, query name for cuGetProcAddress fallback or NULL, min version, max version (exclusive,
// 0 = none), per-thread-stream variant, library: 0 driver, 1 runtime)
#define HOOKS(X)                                                                  \
  X(cuInit, "cuInit", 0, 0, 0, 0)                                                 \
  X(cuGetExportTable, NULL, 0, 0, 0, 0)                                           \
  X(cuGetProcAddress, "cuGetProcAddress", 0, 12000, 0, 0)                         \
  X(cuGetProcAddress_v2, "cuGetProcAddress", 12000, 0, 0, 0)                      \
  X(cuCtxCreate_v2, "cuCtxCreate", 3020, 13000, 0, 0)                             \
  X(cuCtxCreate_v3, "cuCtxCreate_v3", 0, 0, 0, 0)                                 \
  X(cuCtxCreate_v4, "cuCtxCreate", 13000, 0, 0, 0)                                \
  X(cuCtxDestroy_v2, "cuCtxDestroy", 4000, 0, 0, 0)                               \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 0, 0, 0, 0)             \
  X(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 11000, 0, 0, 0)    \
  X(cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", 11000, 0, 0, 0)        \
  X(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess", 0, 0, 0, 0)                  \
  X(cuCtxDisablePeerAccess, "cuCtxDisablePeerAccess", 0, 0, 0, 0)                \
  X(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer", 0, 0, 0, 0)                  \
  X(cuDeviceGetP2PAttribute, "cuDeviceGetP2PAttribute", 0, 0, 0, 0)              \
  X(cuModuleLoad, "cuModuleLoad", 0, 0, 0, 0)                                     \
  X(cuModuleLoadData, "cuModuleLoadData", 0, 0, 0, 0)                             \
  X(cuModuleLoadDataEx, "cuModuleLoadDataEx", 0, 0, 0, 0)                         \
  X(cuModuleLoadFatBinary, "cuModuleLoadFatBinary", 0, 0, 0, 0)                   \
  X(cuModuleUnload, "cuModuleUnload", 0, 0, 0, 0)                                 \
  X(cuModuleGetFunction, "cuModuleGetFunction", 0, 0, 0, 0)                       \
  X(cuLibraryLoadData, "cuLibraryLoadData", 0, 0, 0, 0)                           \
  X(cuLibraryLoadFromFile, "cuLibraryLoadFromFile", 0, 0, 0, 0)                   \
  X(cuLibraryUnload, "cuLibraryUnload", 0, 0, 0, 0)                               \
  X(cuLibraryGetKernel, "cuLibraryGetKernel", 0, 0, 0, 0)                         \
  X(cuLibraryGetModule, "cuLibraryGetModule", 0, 0, 0, 0)                         \
  X(cuKernelGetFunction, "cuKernelGetFunction", 0, 0, 0, 0)                       \
  X(cuLinkComplete, "cuLinkComplete", 0, 0, 0, 0)                                 \
  X(cuLinkAddData, "cuLinkAddData", 0, 6050, 0, 0)                                \
  X(cuLinkAddData_v2, "cuLinkAddData", 6050, 0, 0, 0)                             \
  X(cuLinkAddFile, "cuLinkAddFile", 0, 6050, 0, 0)                                \
  X(cuLinkAddFile_v2, "cuLinkAddFile", 6050, 0, 0, 0)                             \
  X(cuLinkDestroy, "cuLinkDestroy", 0, 0, 0, 0)                                   \
  X(cuMemAlloc_v2, "cuMemAlloc", 3020, 0, 0, 0)                                   \
  X(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, 0, 0, 0)                         \
  X(cuMemFree_v2, "cuMemFree", 3020, 0, 0, 0)                                     \
  X(cuMemAllocManaged, "cuMemAllocManaged", 0, 0, 0, 0)                           \
  X(cuMemAllocHost_v2, "cuMemAllocHost", 3020, 0, 0, 0)                           \
  X(cuMemHostAlloc, "cuMemHostAlloc", 0, 0, 0, 0)                                 \
  X(cuMemFreeHost, "cuMemFreeHost", 0, 0, 0, 0)                                   \
  X(cuMemAllocAsync, "cuMemAllocAsync", 0, 0, 0, 0)                               \
  X(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 0, 0, 1, 0)                          \
  X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 0, 0, 0, 0)               \
  X(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 0, 0, 1, 0)          \
  X(cuMemFreeAsync, "cuMemFreeAsync", 0, 0, 0, 0)                                 \
  X(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 0, 0, 1, 0)                            \
  X(cuMemGetAddressRange_v2, "cuMemGetAddressRange", 3020, 0, 0, 0)              \
  X(cuPointerGetAttribute, "cuPointerGetAttribute", 0, 0, 0, 0)                   \
  X(cuIpcGetMemHandle, "cuIpcGetMemHandle", 0, 0, 0, 0)                           \
  X(cuIpcOpenMemHandle, "cuIpcOpenMemHandle", 0, 11000, 0, 0)                     \
  X(cuIpcOpenMemHandle_v2, "cuIpcOpenMemHandle", 11000, 0, 0, 0)                  \
  X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", 0, 0, 0, 0)                       \
  X(cuMemExportToShareableHandle, "cuMemExportToShareableHandle", 0, 0, 0, 0)     \
  X(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", 0, 0, 0, 0) \
  X(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle", 0, 0, 0, 0)       \
  X(cuMemPoolExportToShareableHandle, "cuMemPoolExportToShareableHandle", 0, 0, 0, 0) \
  X(cuMemPoolImportFromShareableHandle, "cuMemPoolImportFromShareableHandle", 0, 0, 0, 0) \
  X(cuMemPoolExportPointer, "cuMemPoolExportPointer", 0, 0, 0, 0)                 \
  X(cuMemPoolImportPointer, "cuMemPoolImportPointer", 0, 0, 0, 0)                 \
  X(cuMemPoolDestroy, "cuMemPoolDestroy", 0, 0, 0, 0)                             \
  X(cuMemCreate, "cuMemCreate", 0, 0, 0, 0)                                       \
  X(cuMemRelease, "cuMemRelease", 0, 0, 0, 0)                                     \
  X(cuMemMap, "cuMemMap", 0, 0, 0, 0)                                             \
  X(cuMemUnmap, "cuMemUnmap", 0, 0, 0, 0)                                         \
  X(cuLaunchKernel, "cuLaunchKernel", 0, 0, 0, 0)                                 \
  X(cuLaunchKernel_ptsz, "cuLaunchKernel", 0, 0, 1, 0)                            \
  X(cuLaunchKernelEx, "cuLaunchKernelEx", 0, 0, 0, 0)                             \
  X(cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 0, 0, 1, 0)                        \
  X(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 0, 0, 0, 0)           \
  X(cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 0, 0, 1, 0)      \
  X(cuLaunchCooperativeKernelMultiDevice, NULL, 0, 0, 0, 0)                       \
  X(cuGraphLaunch, "cuGraphLaunch", 0, 0, 0, 0)                                   \
  X(cuGraphLaunch_ptsz, "cuGraphLaunch", 0, 0, 1, 0)                              \
  X(cuStreamBeginCapture, NULL, 0, 0, 0, 0)                                       \
  X(cuStreamBeginCapture_ptsz, NULL, 0, 0, 1, 0)                                  \
  X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 10010, 0, 0, 0)             \
  X(cuStreamBeginCapture_v2_ptsz, "cuStreamBeginCapture", 10010, 0, 1, 0)        \
  X(cuStreamBeginCaptureToGraph, "cuStreamBeginCaptureToGraph", 0, 0, 0, 0)       \
  X(cuStreamBeginCaptureToGraph_ptsz, "cuStreamBeginCaptureToGraph", 0, 0, 1, 0)  \
  X(cuStreamEndCapture, "cuStreamEndCapture", 0, 0, 0, 0)                         \
  X(cuStreamEndCapture_ptsz, "cuStreamEndCapture", 0, 0, 1, 0)                    \
  SUBMIT_HOOKS(X)                                                                 \
  X(__cudaRegisterFatBinary, NULL, 0, 0, 0, 1)                                    \
  X(__cudaUnregisterFatBinary, NULL, 0, 0, 0, 1)                                  \
  X(__cudaRegisterFunction, NULL, 0, 0, 0, 1)                                     \
  X(cudaGetDriverEntryPoint, NULL, 0, 0, 0, 1)                                    \
  X(cudaGetDriverEntryPoint_ptsz, NULL, 0, 0, 0, 1)                               \
  X(cudaGetDriverEntryPointByVersion, NULL, 0, 0, 0, 1)                           \
  X(cudaGetDriverEntryPointByVersion_ptsz, NULL, 0, 0, 0, 1)

enum {
#define X(sym, q, lo, hi, pt, lib) H_##sym,
  HOOKS(X)
#undef X
      H_COUNT
};

typedef struct {
  const char *name, *query;
  int lo, hi, ptsz, lib;
  void *wrapper;
  void *_Atomic real;
} hook_t;
static hook_t hooks[H_COUNT];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;
static void table_init(void);

static void *hook_real(int i) {
  void *p = atomic_load_explicit(&hooks[i].real, memory_order_acquire);
  if (p) return p;
  pthread_once(&table_once, table_init);
  p = hooks[i].lib ? real_dlsym(RTLD_NEXT, hooks[i].name) : drv_sym(hooks[i].name);
  if (!p) return NULL;
  void *expect = NULL;
  if (!atomic_compare_exchange_strong(&hooks[i].real, &expect, p)) p = expect;
  return p;
}
#define REAL(fn) ((__typeof__(&fn))hook_real(H_##fn))
// A wrapper whose real function cannot be found fails the call the way a missing driver would.
#define CALL_REAL(fn, ...)                                                  \
  __typeof__(&fn) real_ = REAL(fn);                                         \
  if (!real_) {                                                             \
    LOG_ONCE("%s: real function not found in %s", #fn, cfg.libcuda);       \
    return 999; /* CUDA_ERROR_UNKNOWN */                                    \
  }                                                                         \
  CUresult r_ = real_(__VA_ARGS__)

static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;
static void resolve_all(void) {
  for (int i = 0; i < H_COUNT; i++) hook_real(i);
}

static int hook_by_wrapper(void *p) {
  for (int i = 0; i < H_COUNT; i++)
    if (hooks[i].wrapper == p) return i;
  return -1;
}

// substitute returns the wrapper for a real driver function pointer handed out by a resolver, or
// the pointer itself when it is not one we wrap (or cannot be matched safely).
static void *substitute(const char *symbol, void *p, int version, unsigned long long flags) {
  pthread_once(&table_once, table_init);
  pthread_once(&resolve_once, resolve_all);
  ctl_ensure_started();
  if (cfg.debug) shim_log("trace: resolve %s version %d flags %llu -> %p", symbol ? symbol : "(entry point)", version, flags, p);
  if (hook_by_wrapper(p) >= 0) return p;
  for (int i = 0; i < H_COUNT; i++)
    if (!hooks[i].lib && atomic_load(&hooks[i].real) == p) return hooks[i].wrapper;
  // Not an exported driver symbol: the real driver's resolver hands out internal entry points,
  // not the addresses of its exported symbols. (symbol, version range, flags) names exactly one
  // ABI, the one of this hook's exported symbol, so the wrapper (which calls that exported
  // symbol, or adopts p when the driver exports none) serves the caller with the same ABI.
  int ptsz = flags == CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
  // Asked with the per-thread flag for a function without a per-thread variant (no stream: module
  // loads, allocations, peer access; a cudart built for the per-thread default stream asks so for
  // every entry point), the driver hands out the plain one: so does the shim.
  if (ptsz && symbol) {
    int has_pt = 0;
    for (int i = 0; i < H_COUNT && !has_pt; i++)
      has_pt = !hooks[i].lib && hooks[i].ptsz && hooks[i].query && strcmp(hooks[i].query, symbol) == 0 &&
               version >= hooks[i].lo && (!hooks[i].hi || version < hooks[i].hi);
    ptsz = has_pt;
  }
  for (int i = 0; i < H_COUNT && symbol; i++) {
    hook_t *h = &hooks[i];
    if (h->lib || !h->query || strcmp(h->query, symbol) != 0 || h->ptsz != ptsz) continue;
    if (version < h->lo || (h->hi && version >= h->hi)) continue;
    void *expect = NULL;
    if (atomic_compare_exchange_strong(&h->real, &expect, p) || expect) {
      atomic_fetch_add(&istats.by_name, 1);
      return h->wrapper;
    }
    break;
  }
  if (symbol && strncmp(symbol, "cu", 2) == 0) {
    for (int i = 0; i < H_COUNT; i++)
      if (hooks[i].query && strcmp(hooks[i].query, symbol) == 0) {
        atomic_fetch_add(&istats.unmatched, 1);
        shim_log("resolver: %s (version %d, flags %llu) returned an unknown pointer; not wrapped", symbol,
                 version, flags);
        break;
      }
  }
  atomic_fetch_add(&istats.passthrough, 1);
  return p;
}

// ---- dlsym ----
// The exported dlsym is an assembly trampoline (below) that asks dlsym_decide first and otherwise
// tail-jumps into the real dlsym, so the real one sees the caller's return address (RTLD_NEXT).
#define DLSYM_PASS ((void *)1)
static void *dlsym_decide_cu(void *handle, const char *name);
NO_SAN __attribute__((used)) void *ptxmig_dlsym_decide(void *handle, const char *name) {
  if (!name || handle == RTLD_NEXT) return DLSYM_PASS;
  if ((name[0] == 'n' && name[1] == 'v') || (name[0] == '_' && name[1] == '_' && name[2] == 'n')) {
    void *w = jit_dlsym(handle, name);  // NVRTC's and nvJitLink's cubins (jit.c)
    return w ? w : DLSYM_PASS;
  }
  if (name[0] != 'c' || name[1] != 'u') return DLSYM_PASS;
  return dlsym_decide_cu(handle, name);
}
static void *dlsym_decide_cu(void *handle, const char *name) {
  pthread_once(&table_once, table_init);
  int i;
  for (i = 0; i < H_COUNT; i++)
    if (strcmp(hooks[i].name, name) == 0) break;
  if (i == H_COUNT) {
    if (cfg.debug) shim_log("trace: dlsym(%p, %s): not hooked", handle, name);
    return DLSYM_PASS;
  }
  void *r = real_dlsym(handle, name);
  if (!r) return NULL;
  void *mine = hook_real(i);
  if (mine != r) {
    if (cfg.debug) shim_log("trace: dlsym(%p, %s): %p is not the driver's %p", handle, name, r, mine);
    return r;  // a different library's symbol: not ours to wrap
  }
  if (cfg.debug) shim_log("trace: dlsym(%p, %s): wrapped", handle, name);
  atomic_fetch_add(&istats.dlsym_hits, 1);
  ctl_ensure_started();
  return hooks[i].wrapper;
}

#if defined(__x86_64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, @function\n"
        "dlsym:\n"
        "  push %rdi\n"
        "  push %rsi\n"
        "  sub $8, %rsp\n"
        "  call ptxmig_dlsym_decide\n"
        "  cmp $1, %rax\n"
        "  jne 1f\n"
        "  call real_dlsym_ptr\n"
        "  add $8, %rsp\n"
        "  pop %rsi\n"
        "  pop %rdi\n"
        "  test %rax, %rax\n"
        "  jz 2f\n"
        "  jmp *%rax\n"
        "1:\n"
        "  add $24, %rsp\n"
        "  ret\n"
        "2:\n"
        "  ret\n"
        ".size dlsym, .-dlsym\n");
#else
EXPORT void *dlsym(void *handle, const char *name) {
  void *r = ptxmig_dlsym_decide(handle, name);
  if (r != DLSYM_PASS) return r;
  dlsym_fn f = real_dlsym_ptr();
  return f ? f(handle, name) : NULL;
}
#endif

// ---- resolvers ----
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
  CALL_REAL(cuGetProcAddress, symbol, pfn, version, flags);
  if (r_ == CUDA_SUCCESS && pfn && *pfn) {
    atomic_fetch_add(&istats.getproc_hits, 1);
    *pfn = substitute(symbol, *pfn, version, flags);
  }
  return r_;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                                    CUdriverProcAddressQueryResult *status) {
  CALL_REAL(cuGetProcAddress_v2, symbol, pfn, version, flags, status);
  if (r_ == CUDA_SUCCESS && pfn && *pfn && (!status || *status == CU_GET_PROC_ADDRESS_SUCCESS)) {
    atomic_fetch_add(&istats.getproc_v2_hits, 1);
    *pfn = substitute(symbol, *pfn, version, flags);
  }
  return r_;
}

// The runtime's entry-point queries. The 4th argument of cudaGetDriverEntryPoint did not exist
// before CUDA 12, so it is forwarded but never read. cudaGetDriverEntryPoint takes no version:
// matching is by pointer only (the version given here never selects an ABI).
#define ENTRYPOINT(fn)                                                                            \
  EXPORT cudaError_t fn(const char *symbol, void **pfn, unsigned long long flags, void *status) { \
    __typeof__(&fn) real_ = REAL(fn);                                                             \
    if (!real_) return 49; /* cudaErrorCallRequiresNewerDriver */                                 \
    cudaError_t r = real_(symbol, pfn, flags, status);                                            \
    if (r == cudaSuccess && pfn && *pfn) {                                                        \
      atomic_fetch_add(&istats.entrypoint_hits, 1);                                               \
      *pfn = substitute(NULL, *pfn, 0, flags);                                                    \
    }                                                                                             \
    return r;                                                                                     \
  }
ENTRYPOINT(cudaGetDriverEntryPoint)
ENTRYPOINT(cudaGetDriverEntryPoint_ptsz)
#define ENTRYPOINT_V(fn)                                                                            \
  EXPORT cudaError_t fn(const char *symbol, void **pfn, unsigned int version, unsigned long long flags, \
                        int *status) {                                                              \
    __typeof__(&fn) real_ = REAL(fn);                                                               \
    if (!real_) return 49;                                                                          \
    cudaError_t r = real_(symbol, pfn, version, flags, status);                                     \
    if (r == cudaSuccess && pfn && *pfn && (!status || *status == 0)) {                             \
      atomic_fetch_add(&istats.entrypoint_hits, 1);                                                 \
      *pfn = substitute(symbol, *pfn, (int)version, flags);                                         \
    }                                                                                               \
    return r;                                                                                       \
  }
ENTRYPOINT_V(cudaGetDriverEntryPointByVersion)
ENTRYPOINT_V(cudaGetDriverEntryPointByVersion_ptsz)

// cuGetExportTable hands out the driver's private tables. It passes through untouched; the
// wrapper exists only so PTXMIG_DEBUG=1 shows which tables an app asks for.
EXPORT CUresult cuGetExportTable(const void **table, const CUuuid *id) {
  CALL_REAL(cuGetExportTable, table, id);
  if (cfg.debug && id) {
    const unsigned char *b = (const unsigned char *)id->bytes;
    shim_log("trace: cuGetExportTable(%02x%02x%02x%02x-%02x%02x%02x%02x-%02x%02x%02x%02x-%02x%02x%02x%02x) -> %d",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15], (int)r_);
  }
  return r_;
}

// ---- init and contexts ----
EXPORT CUresult cuInit(unsigned flags) {
  ctl_ensure_started();
  CALL_REAL(cuInit, flags);
  if (r_ == CUDA_SUCCESS) trk_cuinit();
  return r_;
}

EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned flags, CUdevice dev) {
  CALL_REAL(cuCtxCreate_v2, pctx, flags, dev);
  if (r_ == CUDA_SUCCESS && pctx) trk_ctx_add(*pctx, dev, 0);
  return r_;
}
EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, void *params, int n, unsigned flags, CUdevice dev) {
  CALL_REAL(cuCtxCreate_v3, pctx, params, n, flags, dev);
  if (r_ == CUDA_SUCCESS && pctx) trk_ctx_add(*pctx, dev, 0);
  return r_;
}
EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned flags, CUdevice dev) {
  CALL_REAL(cuCtxCreate_v4, pctx, params, flags, dev);
  if (r_ == CUDA_SUCCESS && pctx) trk_ctx_add(*pctx, dev, 0);
  return r_;
}
// ctx_gone: the launches, events and samples of a context die with it (before the driver call
// that may destroy it).
static void ctx_gone(CUcontext ctx) {
  preempt_drop_ctx(ctx);
  samples_drop_ctx(ctx);
}
static void primary_gone(CUdevice dev) {
  CUcontext c[TRK_MAX_CTX];
  for (int i = 0, n = trk_primary_ctxs(dev, c); i < n; i++) ctx_gone(c[i]);
}
EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
  ctx_gone(ctx);
  CALL_REAL(cuCtxDestroy_v2, ctx);
  if (r_ == CUDA_SUCCESS) trk_ctx_remove(ctx);
  return r_;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  CALL_REAL(cuDevicePrimaryCtxRetain, pctx, dev);
  if (r_ == CUDA_SUCCESS && pctx) trk_ctx_add(*pctx, dev, 1);
  return r_;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  primary_gone(dev);  // the release may destroy the context and its events
  CALL_REAL(cuDevicePrimaryCtxRelease_v2, dev);
  return r_;
}

EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
  primary_gone(dev);  // the reset destroys the primary context's events, memory and launches
  CALL_REAL(cuDevicePrimaryCtxReset_v2, dev);
  if (r_ == CUDA_SUCCESS) {  // and its peer links
    CUcontext pc[TRK_MAX_CTX];
    for (int i = 0, n = trk_primary_ctxs(dev, pc); i < n; i++) trk_peer_ctx_gone(pc[i]);
  }
  return r_;
}

// ---- modules and libraries ----
// With the preempt mode on, a load of an image with usable PTX loads ptxstate's instrumented PTX
// instead (instr.c); the shim still records (and dumps) the app's original image. Any failure,
// including the driver refusing the instrumented PTX, loads the original exactly as asked.
// Every load entry point goes through load(): the caller's arguments in a load_req, the choice of
// what to load and the bookkeeping in one place.
typedef struct {
  int hook, source;        // the entry point called (H_*) and how track.c records the load (MS_*)
  CUmodule *m;             // where the module goes (module loads) ...
  CUlibrary *lib;          // ... or the library (library loads)
  const void *image;       // the caller's image, or NULL
  const char *path;        // the caller's file, or NULL
  CUjit_option *jo;        // JIT options: cuModuleLoadDataEx and the library loads
  void **jv;
  unsigned nj;
  CUlibraryOption *lo;     // library options
  void **lv;
  unsigned nl;
} load_req;

// The entry points themselves, declared ahead for load_call's casts to their types.
EXPORT CUresult cuModuleLoad(CUmodule *m, const char *fname);
EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image);
EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned n, CUjit_option *o, void **v);
EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *fatbin);
EXPORT CUresult cuLibraryLoadData(CUlibrary *lib, const void *code, CUjit_option *jo, void **jv, unsigned nj,
                                  CUlibraryOption *lo, void **lv, unsigned nl);
EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *lib, const char *fname, CUjit_option *jo, void **jv, unsigned nj,
                                      CUlibraryOption *lo, void **lv, unsigned nl);

// ptx_hook: the entry point that loads instrumented PTX in q's place. cuModuleLoadDataEx and the
// library loads keep the caller's options (cuLibraryLoadFromFile through cuLibraryLoadData); a
// file or a fatbinary goes through cuModuleLoadData.
static int ptx_hook(const load_req *q) {
  switch (q->hook) {
  case H_cuModuleLoad: case H_cuModuleLoadFatBinary: return H_cuModuleLoadData;
  case H_cuLibraryLoadFromFile: return H_cuLibraryLoadData;
  default: return q->hook;
  }
}

// load_call calls entry point hook (found, see load) with q's arguments and what: the caller's
// image or path, or the instrumented PTX.
static CUresult load_call(int hook, const load_req *q, const void *what) {
  void *f = hook_real(hook);
  switch (hook) {
  case H_cuModuleLoad: return ((__typeof__(&cuModuleLoad))f)(q->m, what);
  case H_cuModuleLoadData: return ((__typeof__(&cuModuleLoadData))f)(q->m, what);
  case H_cuModuleLoadDataEx: return ((__typeof__(&cuModuleLoadDataEx))f)(q->m, what, q->nj, q->jo, q->jv);
  case H_cuModuleLoadFatBinary: return ((__typeof__(&cuModuleLoadFatBinary))f)(q->m, what);
  case H_cuLibraryLoadData:
    return ((__typeof__(&cuLibraryLoadData))f)(q->lib, what, q->jo, q->jv, q->nj, q->lo, q->lv, q->nl);
  case H_cuLibraryLoadFromFile:
    return ((__typeof__(&cuLibraryLoadFromFile))f)(q->lib, what, q->jo, q->jv, q->nj, q->lo, q->lv, q->nl);
  }
  return 999;
}

static void swap_failed(kinfo_set *ks, CUresult r) {
  kinfo_set_free(ks);
  instr_failed(ks, "instrumentation failed: the driver refused the instrumented PTX (error %d)", (int)r);
  LOG_ONCE("%s; original loaded (further refusals are not logged)", ks->reason);
}
// swap_prepare instruments what a load is about to load (instr_prepare): the image, the file at
// path, or, for the cubin of a JIT link (or a copy of it), that link's PTX. 1: *ptx is to be
// loaded instead.
static int swap_prepare(const void *image, const char *path, char **ptx, kinfo_set *ks) {
  if (!image && !path) return 0;
  char *linked = instr_link_ptx(image);
  int sw = instr_prepare(linked ? linked : image, 0, linked ? NULL : path, ptx, ks);
  free(linked);
  return sw;
}
#define CU_LIBRARY_BINARY_IS_PRESERVED 1
// preserved: the driver keeps using the caller's buffer (then the shim's PTX is never freed).
static int preserved(const load_req *q) {
  for (unsigned i = 0; q->lo && i < q->nl && i < 64; i++)
    if (q->lo[i] == CU_LIBRARY_BINARY_IS_PRESERVED && (!q->lv || q->lv[i])) return 1;
  return 0;
}

// load: the instrumented PTX when swap_prepare gives one and the driver takes it, else the
// caller's image or file as asked; then the module is tracked (with its twins) when it loaded.
static CUresult load(const load_req *q) {
  int alt = ptx_hook(q);
  if (!hook_real(q->hook) || !hook_real(alt)) return 999;
  kinfo_set ks = {0};
  char *ptx = NULL;
  CUresult r = 999;
  int sw = (q->m || q->lib) && swap_prepare(q->image, q->path, &ptx, &ks);
  if (sw && (r = load_call(alt, q, ptx)) != CUDA_SUCCESS) swap_failed(&ks, r), sw = 0;
  if (!sw || !preserved(q)) free(ptx);
  if (!sw) r = load_call(q->hook, q, q->path ? (const void *)q->path : q->image);
  void *handle = q->m ? (void *)*q->m : q->lib ? (void *)*q->lib : NULL;
  if (r == CUDA_SUCCESS && handle) {
    ctl_ensure_started();
    trk_module_add(q->source, handle, q->image, 0, q->path);
    if (cfg.preempt != PM_OFF) trk_module_twins(handle, &ks);
  }
  kinfo_set_free(&ks);
  return r;
}

EXPORT CUresult cuModuleLoad(CUmodule *m, const char *fname) {
  return load(&(load_req){.hook = H_cuModuleLoad, .source = MS_MODULE_LOAD, .m = m, .path = fname});
}
EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image) {
  return load(&(load_req){.hook = H_cuModuleLoadData, .source = MS_MODULE_LOAD_DATA, .m = m, .image = image});
}
EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned n, CUjit_option *o, void **v) {
  return load(&(load_req){.hook = H_cuModuleLoadDataEx, .source = MS_MODULE_LOAD_DATA_EX, .m = m, .image = image,
                          .jo = o, .jv = v, .nj = n});
}
EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *fatbin) {
  return load(&(load_req){.hook = H_cuModuleLoadFatBinary, .source = MS_MODULE_LOAD_FATBIN, .m = m, .image = fatbin});
}
EXPORT CUresult cuLibraryLoadData(CUlibrary *lib, const void *code, CUjit_option *jo, void **jv, unsigned nj,
                                  CUlibraryOption *lo, void **lv, unsigned nl) {
  return load(&(load_req){.hook = H_cuLibraryLoadData, .source = MS_LIBRARY_LOAD_DATA, .lib = lib, .image = code,
                          .jo = jo, .jv = jv, .nj = nj, .lo = lo, .lv = lv, .nl = nl});
}
EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *lib, const char *fname, CUjit_option *jo, void **jv, unsigned nj,
                                      CUlibraryOption *lo, void **lv, unsigned nl) {
  return load(&(load_req){.hook = H_cuLibraryLoadFromFile, .source = MS_LIBRARY_LOAD_FILE, .lib = lib,
                          .path = fname, .jo = jo, .jv = jv, .nj = nj, .lo = lo, .lv = lv, .nl = nl});
}
EXPORT CUresult cuModuleUnload(CUmodule m) {
  preempt_wait_clean();  // a preempted twin's remainder may still use it
  CALL_REAL(cuModuleUnload, m);
  if (r_ == CUDA_SUCCESS) trk_module_remove(m);
  return r_;
}
EXPORT CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
  CALL_REAL(cuModuleGetFunction, f, m, name);
  if (r_ == CUDA_SUCCESS && f) trk_func_named(*f, m, name);
  return r_;
}
EXPORT CUresult cuLibraryUnload(CUlibrary lib) {
  preempt_wait_clean();  // a preempted twin's remainder may still use it
  CALL_REAL(cuLibraryUnload, lib);
  if (r_ == CUDA_SUCCESS) trk_module_remove(lib);
  return r_;
}
EXPORT CUresult cuLibraryGetKernel(CUkernel *k, CUlibrary lib, const char *name) {
  CALL_REAL(cuLibraryGetKernel, k, lib, name);
  if (r_ == CUDA_SUCCESS && k) trk_func_named(*k, lib, name);
  return r_;
}
EXPORT CUresult cuLibraryGetModule(CUmodule *m, CUlibrary lib) {
  CALL_REAL(cuLibraryGetModule, m, lib);
  if (r_ == CUDA_SUCCESS && m) trk_module_alias(*m, lib);
  return r_;
}
EXPORT CUresult cuKernelGetFunction(CUfunction *f, CUkernel k) {
  CALL_REAL(cuKernelGetFunction, f, k);
  if (r_ == CUDA_SUCCESS && f) trk_func_copy(*f, k);
  return r_;
}
EXPORT CUresult cuLinkComplete(CUlinkState st, void **cubin, size_t *size) {
  CALL_REAL(cuLinkComplete, st, cubin, size);
  if (r_ == CUDA_SUCCESS && cubin && *cubin && size) {
    ctl_ensure_started();
    trk_module_add(MS_LINK_COMPLETE, NULL, *cubin, *size, NULL);
    instr_link_complete(st, *cubin, *size);
  }
  return r_;
}
// A JIT link's PTX input (CuPy with CUPY_COMPILE_WITH_PTX, Numba's older releases): kept so that
// the module loaded from the link's cubin can be instrumented from it (instr_link_ptx). cuda.h
// maps both to _v2 (same parameters); the plain symbols are what cuGetProcAddress gives for
// versions before 6.5 (CuPy 14 asks for cuLinkAddData at 5050) and what older binaries call.
#define LINK_ADD_DATA(fn)                                                                                     \
  EXPORT CUresult fn(CUlinkState st, int type, void *data, size_t size, const char *name, unsigned n,         \
                     CUjit_option *o, void **v) {                                                            \
    CALL_REAL(fn, st, type, data, size, name, n, o, v);                                                      \
    if (r_ == CUDA_SUCCESS) instr_link_input(st, type, data, size, NULL);                                    \
    return r_;                                                                                               \
  }
#define LINK_ADD_FILE(fn)                                                                                     \
  EXPORT CUresult fn(CUlinkState st, int type, const char *path, unsigned n, CUjit_option *o, void **v) {     \
    CALL_REAL(fn, st, type, path, n, o, v);                                                                  \
    if (r_ == CUDA_SUCCESS) instr_link_input(st, type, NULL, 0, path);                                      \
    return r_;                                                                                               \
  }
LINK_ADD_DATA(cuLinkAddData)
LINK_ADD_DATA(cuLinkAddData_v2)
LINK_ADD_FILE(cuLinkAddFile)
LINK_ADD_FILE(cuLinkAddFile_v2)
EXPORT CUresult cuLinkDestroy(CUlinkState st) {
  CALL_REAL(cuLinkDestroy, st);
  instr_link_destroy(st);  // the cubin is gone with the link, whatever the driver answered
  return r_;
}

// The runtime's registration path (shared cudart only; a static cudart calls its own copy).
EXPORT void **__cudaRegisterFatBinary(void *wrapper) {
  ctl_ensure_started();
  __typeof__(&__cudaRegisterFatBinary) real = REAL(__cudaRegisterFatBinary);
  if (!real) {
    LOG_ONCE("__cudaRegisterFatBinary: no CUDA runtime found behind the shim");
    return NULL;
  }
  void **h = real(wrapper);
  if (h) trk_module_add(MS_REGISTER_FATBIN, h, wrapper, 0, NULL);  // NULL: nothing was registered
  return h;
}
// The registered image is borrowed in place (track.c): forget it before the runtime lets the
// library's mapping go.
EXPORT void __cudaUnregisterFatBinary(void **h) {
  trk_module_remove(h);
  __typeof__(&__cudaUnregisterFatBinary) real = REAL(__cudaUnregisterFatBinary);
  if (!real) {
    LOG_ONCE("__cudaUnregisterFatBinary: no CUDA runtime found behind the shim");
    return;
  }
  real(h);
}
EXPORT void __cudaRegisterFunction(void **fatCubinHandle, const char *hostFun, char *deviceFun,
                                   const char *deviceName, int thread_limit, void *tid, void *bid,
                                   void *bDim, void *gDim, int *wSize) {
  __typeof__(&__cudaRegisterFunction) real = REAL(__cudaRegisterFunction);
  if (!real) {
    LOG_ONCE("__cudaRegisterFunction: no CUDA runtime found behind the shim");
    return;
  }
  real(fatCubinHandle, hostFun, deviceFun, deviceName, thread_limit, tid, bid, bDim, gDim, wSize);
}

// ---- memory ----
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size) {
  int o = vmm_alloc(p, size);
  if (o >= 0) {
    if (o == CUDA_SUCCESS) trk_alloc_add(*p, size, AK_OWNED);
    return o;
  }
  CALL_REAL(cuMemAlloc_v2, p, size);
  if (r_ == CUDA_SUCCESS && p) trk_alloc_add(*p, size, AK_DEVICE);
  return r_;
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned elem) {
  // Owned: rows aligned to 512 bytes, which satisfies the pitch alignment of every GPU (the
  // driver's own choice may differ; any pitch it reports is valid to use). Invalid arguments go
  // to the driver, which answers them as it does.
  if (p && pitch && w && h && w <= (1ull << 40) && h <= (1ull << 40) && (elem == 4 || elem == 8 || elem == 16)) {
    size_t pw = (w + 511) & ~(size_t)511;
    if (pw / 512 <= (1ull << 46) / 512 / h) {
      int o = vmm_alloc(p, pw * h);
      if (o >= 0) {
        if (o == CUDA_SUCCESS) *pitch = pw, trk_alloc_add(*p, pw * h, AK_OWNED);
        return o;
      }
    }
  }
  CALL_REAL(cuMemAllocPitch_v2, p, pitch, w, h, elem);
  if (r_ == CUDA_SUCCESS && p && pitch) trk_alloc_add(*p, *pitch * h, AK_PITCH);
  return r_;
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
  preempt_wait_clean();  // a preempted twin's remainder may still use it
  int o = vmm_free(p);
  if (o >= 0) {
    if (o == CUDA_SUCCESS) trk_alloc_remove(p, -1);
    return o;
  }
  CALL_REAL(cuMemFree_v2, p);
  if (r_ == CUDA_SUCCESS) trk_alloc_remove(p, -1), trk_share_free(p);
  return r_;
}
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t size, unsigned flags) {
  CALL_REAL(cuMemAllocManaged, p, size, flags);
  if (r_ == CUDA_SUCCESS && p) trk_alloc_add(*p, size, AK_MANAGED);
  return r_;
}
EXPORT CUresult cuMemAllocHost_v2(void **p, size_t size) {
  CALL_REAL(cuMemAllocHost_v2, p, size);
  if (r_ == CUDA_SUCCESS && p) trk_alloc_add((uint64_t)(uintptr_t)*p, size, AK_HOST);
  return r_;
}
EXPORT CUresult cuMemHostAlloc(void **p, size_t size, unsigned flags) {
  CALL_REAL(cuMemHostAlloc, p, size, flags);
  if (r_ == CUDA_SUCCESS && p) trk_alloc_add((uint64_t)(uintptr_t)*p, size, AK_HOST);
  return r_;
}
EXPORT CUresult cuMemFreeHost(void *p) {
  preempt_wait_clean();  // a preempted twin's remainder may still use it
  CALL_REAL(cuMemFreeHost, p);
  if (r_ == CUDA_SUCCESS) trk_alloc_remove((uint64_t)(uintptr_t)p, AK_HOST);
  return r_;
}
// Stream-ordered allocations are submissions too (gated, counted for the tail rule).
#define GATED(fn, s, ptsz, ...)        \
  __typeof__(&fn) real_ = REAL(fn);    \
  if (!real_) {                        \
    LOG_ONCE("%s: real function not found in %s", #fn, cfg.libcuda); \
    return 999;                        \
  }                                    \
  sub_hold(s, ptsz);                   \
  sub_enter();                         \
  sub_mark(s, ptsz);                   \
  CUresult r_ = real_(__VA_ARGS__);    \
  sub_exit()
#define ALLOC_ASYNC(fn, ptsz)                                        \
  EXPORT CUresult fn(CUdeviceptr *p, size_t size, CUstream s) {      \
    GATED(fn, s, ptsz, p, size, s);                                  \
    if (r_ == CUDA_SUCCESS && p) trk_alloc_add(*p, size, AK_ASYNC);  \
    return r_;                                                       \
  }
ALLOC_ASYNC(cuMemAllocAsync, 0)
ALLOC_ASYNC(cuMemAllocAsync_ptsz, 1)
#define ALLOC_POOL(fn, ptsz)                                                          \
  EXPORT CUresult fn(CUdeviceptr *p, size_t size, CUmemoryPool pool, CUstream s) {    \
    GATED(fn, s, ptsz, p, size, pool, s);                                             \
    if (r_ == CUDA_SUCCESS && p) trk_alloc_add(*p, size, AK_ASYNC);                   \
    return r_;                                                                        \
  }
ALLOC_POOL(cuMemAllocFromPoolAsync, 0)
ALLOC_POOL(cuMemAllocFromPoolAsync_ptsz, 1)
#define FREE_ASYNC(fn, ptsz)                               \
  EXPORT CUresult fn(CUdeviceptr p, CUstream s) {          \
    GATED(fn, s, ptsz, p, s);                              \
    if (r_ == CUDA_SUCCESS) {                              \
      trk_alloc_remove(p, AK_ASYNC);                       \
      trk_share_free(p);                                   \
    }                                                      \
    return r_;                                             \
  }
FREE_ASYNC(cuMemFreeAsync, 0)
FREE_ASYNC(cuMemFreeAsync_ptsz, 1)

// Peer access between contexts: the shim keeps the links the process enabled (track.c), so that
// ptxmig turns them off for a checkpoint and on again after (peer-off / peer-on); driver 580 cannot
// restore a process that had them on at its checkpoint in every case (docs/PLATFORM.md). With
// PTXMIG_PEER_ACCESS=0 (`ptxmig run --no-peer-access`) the GPUs answer as a pair without a peer
// path (PCIe without P2P): no peer access, P2P attributes 0, and an enable is refused as such a
// pair's driver refuses it, so frameworks copy between GPUs through host memory.
EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags) {
  if (cfg.no_peer) {
    trk_peer_refused();
    return CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
  }
  __typeof__(&cuCtxEnablePeerAccess) real = REAL(cuCtxEnablePeerAccess);
  if (!real) return 999; /* CUDA_ERROR_UNKNOWN */
  return trk_peer_enable(peer, flags, real);
}
EXPORT CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
  CALL_REAL(cuDeviceCanAccessPeer, can, dev, peer);
  if (r_ == CUDA_SUCCESS && cfg.no_peer && can) *can = 0;
  return r_;
}
// Every P2P attribute but the performance rank (1) reads 0: access (2), native atomics (3), CUDA
// array access (4), CUDA 13's partial native atomics (5), and any later one, each a capability.
EXPORT CUresult cuDeviceGetP2PAttribute(int *value, int attrib, CUdevice src, CUdevice dst) {
  CALL_REAL(cuDeviceGetP2PAttribute, value, attrib, src, dst);
  if (r_ == CUDA_SUCCESS && cfg.no_peer && value && attrib != 1) *value = 0;
  return r_;
}
EXPORT CUresult cuCtxDisablePeerAccess(CUcontext peer) {
  __typeof__(&cuCtxDisablePeerAccess) real = REAL(cuCtxDisablePeerAccess);
  if (!real) return 999; /* CUDA_ERROR_UNKNOWN */
  return trk_peer_disable(peer, real);
}

// Owned memory answers as one allocation of the size the app asked for (not its mapping's).
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
  if (vmm_range(p, base, size)) return CUDA_SUCCESS;
  CALL_REAL(cuMemGetAddressRange_v2, base, size, p);
  return r_;
}
#define PTR_ATTR_RANGE_START 11
#define PTR_ATTR_RANGE_SIZE 12
EXPORT CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
  CUdeviceptr b;
  size_t n;
  if (data && (attr == PTR_ATTR_RANGE_START || attr == PTR_ATTR_RANGE_SIZE) && vmm_range(p, &b, &n)) {
    if (attr == PTR_ATTR_RANGE_START) memcpy(data, &b, sizeof b);
    else memcpy(data, &n, sizeof n);
    return CUDA_SUCCESS;
  }
  CALL_REAL(cuPointerGetAttribute, data, attr, p);
  return r_;
}
// ---- cross-process sharing ----
// Driver 580 cannot restore a process whose GPU memory another process maps, or that maps another
// process's (cuCheckpointProcessRestore: CUDA_ERROR_NOT_SUPPORTED), so the shim counts exports and
// imports (status "ipc", track.c) and ptxmig refuses such a checkpoint before touching the process.

// The allocation an IPC handle exports is the one holding p (keyed by its base, which cuMemFree
// takes); p itself when the driver cannot say.
static uint64_t alloc_base(CUdeviceptr p) {
  CUresult (*range)(CUdeviceptr *, size_t *, CUdeviceptr) =
      (CUresult(*)(CUdeviceptr *, size_t *, CUdeviceptr))drv_sym("cuMemGetAddressRange_v2");
  CUdeviceptr b = 0;
  size_t n = 0;
  if (range && range(&b, &n, p) == CUDA_SUCCESS && b && p - b < n) return b;
  return p;
}
// CUDA IPC cannot export VMM memory the way it exports cuMemAlloc memory: refused plainly.
EXPORT CUresult cuIpcGetMemHandle(void *handle, CUdeviceptr p) {
  if (vmm_ipc_refuse(p)) return 801;  // CUDA_ERROR_NOT_SUPPORTED
  CALL_REAL(cuIpcGetMemHandle, handle, p);
  if (r_ == CUDA_SUCCESS) trk_share_export(SK_IPC_MEM, alloc_base(p));
  return r_;
}
// cuda.h maps cuIpcOpenMemHandle to _v2 (same parameters); the plain symbol serves older binaries.
#define IPC_OPEN(fn)                                                          \
  EXPORT CUresult fn(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags) { \
    CALL_REAL(fn, p, h, flags);                                               \
    if (r_ == CUDA_SUCCESS && p) trk_share_import(SK_IPC_MEM, *p);            \
    return r_;                                                                \
  }
IPC_OPEN(cuIpcOpenMemHandle)
IPC_OPEN(cuIpcOpenMemHandle_v2)
EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  preempt_wait_clean();  // a preempted twin's remainder may still use it
  CALL_REAL(cuIpcCloseMemHandle, p);
  if (r_ == CUDA_SUCCESS) trk_share_ipc_close(p);
  return r_;
}
EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, CUmemAllocationHandleType t,
                                             unsigned long long flags) {
  CALL_REAL(cuMemExportToShareableHandle, out, h, t, flags);
  if (r_ == CUDA_SUCCESS) trk_share_export(SK_VMM, h);
  return r_;
}
EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, CUmemAllocationHandleType t) {
  CALL_REAL(cuMemImportFromShareableHandle, h, os, t);
  if (r_ == CUDA_SUCCESS && h) trk_share_import(SK_VMM, *h);
  return r_;
}
// A retained handle needs one more cuMemRelease (NCCL frees with retain, release, unmap, release).
EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr) {
  CALL_REAL(cuMemRetainAllocationHandle, h, addr);
  if (r_ == CUDA_SUCCESS && h) trk_share_retain(*h);
  return r_;
}
EXPORT CUresult cuMemPoolExportToShareableHandle(void *out, CUmemoryPool pool, CUmemAllocationHandleType t,
                                                 unsigned long long flags) {
  CALL_REAL(cuMemPoolExportToShareableHandle, out, pool, t, flags);
  if (r_ == CUDA_SUCCESS) trk_share_export(SK_POOL, (uint64_t)(uintptr_t)pool);
  return r_;
}
EXPORT CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *pool, void *h, CUmemAllocationHandleType t,
                                                   unsigned long long flags) {
  CALL_REAL(cuMemPoolImportFromShareableHandle, pool, h, t, flags);
  if (r_ == CUDA_SUCCESS && pool) trk_share_import(SK_POOL, (uint64_t)(uintptr_t)*pool);
  return r_;
}
EXPORT CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *out, CUdeviceptr p) {
  CALL_REAL(cuMemPoolExportPointer, out, p);
  if (r_ == CUDA_SUCCESS) trk_share_export(SK_POOL_PTR, p);
  return r_;
}
EXPORT CUresult cuMemPoolImportPointer(CUdeviceptr *p, CUmemoryPool pool, CUmemPoolPtrExportData *data) {
  CALL_REAL(cuMemPoolImportPointer, p, pool, data);
  if (r_ == CUDA_SUCCESS && p) trk_share_import(SK_POOL_PTR, *p);
  return r_;
}
EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
  CALL_REAL(cuMemPoolDestroy, pool);
  if (r_ == CUDA_SUCCESS) trk_share_pool_destroy((uint64_t)(uintptr_t)pool);
  return r_;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
  CALL_REAL(cuMemCreate, h, size, prop, flags);
  if (r_ == CUDA_SUCCESS && h) trk_alloc_add(*h, size, AK_VMM_PHYS);
  return r_;
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  preempt_wait_clean();  // a preempted twin's remainder may still use it
  CALL_REAL(cuMemRelease, h);
  if (r_ == CUDA_SUCCESS) trk_alloc_remove(h, AK_VMM_PHYS), trk_share_release(h);
  return r_;
}
EXPORT CUresult cuMemMap(CUdeviceptr p, size_t size, size_t off, CUmemGenericAllocationHandle h,
                         unsigned long long flags) {
  CALL_REAL(cuMemMap, p, size, off, h, flags);
  if (r_ == CUDA_SUCCESS) trk_alloc_add(p, size, AK_VMM_MAP), trk_share_map(p, size, h);
  return r_;
}
EXPORT CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
  preempt_wait_clean();
  CALL_REAL(cuMemUnmap, p, size);
  if (r_ == CUDA_SUCCESS) trk_vmm_unmap(p, size), trk_share_unmap(p, size);
  return r_;
}

// ---- launches ----
// launch_end records a launch's outcome (track.c) and counts a collective one for the alignment
// (preempt.c), still inside the gate: an alignment that closes it stops the next submission.
static void launch_end(launch_tok *t, CUresult r) {
  if (launch_post(t, r)) preempt_collective_launched();
}

// Under the gate; with the preempt mode on, a launch of a kernel with a twin may launch the twin
// instead (preempt.c), the launch counted and timed under the original kernel either way.
#define LAUNCH(fn, ptsz)                                                                              \
  EXPORT CUresult fn(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,   \
                     unsigned bz, unsigned shmem, CUstream s, void **params, void **extra) {          \
    __typeof__(&fn) real_ = REAL(fn);                                                                 \
    if (!real_) {                                                                                     \
      LOG_ONCE("%s: real function not found in %s", #fn, cfg.libcuda);                              \
      return 999;                                                                                     \
    }                                                                                                 \
    sub_hold(s, ptsz);                                                                                \
    sub_enter();                                                                                      \
    uint64_t seq = sub_mark(s, ptsz);                                                                 \
    launch_tok t;                                                                                     \
    launch_pre(&t, f, gx, gy, gz, bx, by, bz, s, ptsz, LK_NORMAL);                                    \
    CUresult r_ = 999;                                                                                \
    const char *why = NULL;                                                                           \
    unsigned g_[3] = {gx, gy, gz}, b_[3] = {bx, by, bz};                                              \
    if (!(cfg.preempt != PM_OFF &&                                                                    \
          twin_launch(&t, LK_NORMAL, f, g_, b_, shmem, s, ptsz, params, extra, (launch_fn)real_, NULL, \
                      NULL, seq, &r_, &why))) {                                                       \
      r_ = real_(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);                                 \
      if (r_ == CUDA_SUCCESS) note_original(s, ptsz, t.rec, why);                                     \
    }                                                                                                 \
    launch_end(&t, r_);                                                                               \
    sub_exit();                                                                                       \
    return r_;                                                                                        \
  }
LAUNCH(cuLaunchKernel, 0)
LAUNCH(cuLaunchKernel_ptsz, 1)

#define LAUNCH_COOP(fn, ptsz)                                                                         \
  EXPORT CUresult fn(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,   \
                     unsigned bz, unsigned shmem, CUstream s, void **params) {                        \
    __typeof__(&fn) real_ = REAL(fn);                                                                 \
    if (!real_) return 999;                                                                           \
    sub_hold(s, ptsz);                                                                                \
    sub_enter();                                                                                      \
    sub_mark(s, ptsz);                                                                                \
    launch_tok t;                                                                                     \
    launch_pre(&t, f, gx, gy, gz, bx, by, bz, s, ptsz, LK_COOPERATIVE);                               \
    CUresult r_ = real_(f, gx, gy, gz, bx, by, bz, shmem, s, params);                                 \
    if (r_ == CUDA_SUCCESS) note_original(s, ptsz, t.rec, "cooperative launch");                      \
    launch_end(&t, r_);                                                                               \
    sub_exit();                                                                                       \
    return r_;                                                                                        \
  }
LAUNCH_COOP(cuLaunchCooperativeKernel, 0)
LAUNCH_COOP(cuLaunchCooperativeKernel_ptsz, 1)

#define LAUNCH_EX(fn, ptsz)                                                                        \
  EXPORT CUresult fn(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {         \
    __typeof__(&fn) real_ = REAL(fn);                                                              \
    if (!real_) return 999;                                                                        \
    if (c) sub_hold(c->hStream, ptsz);                                                             \
    sub_enter();                                                                                   \
    uint64_t seq = c ? sub_mark(c->hStream, ptsz) : 0;                                             \
    launch_tok t = {0};                                                                            \
    CUresult r_ = 999;                                                                             \
    const char *why = NULL;                                                                        \
    int kind = LK_EX, twin = 0;                                                                    \
    if (c) {                                                                                       \
      for (unsigned i = 0; c->attrs && i < c->numAttrs && i < 64; i++)                            \
        if (c->attrs[i].id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE && c->attrs[i].value.cooperative)    \
          kind = LK_COOPERATIVE;                                                                   \
      launch_pre(&t, f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY,         \
                 c->blockDimZ, c->hStream, ptsz, kind);                                            \
      unsigned g_[3] = {c->gridDimX, c->gridDimY, c->gridDimZ};                                    \
      unsigned b_[3] = {c->blockDimX, c->blockDimY, c->blockDimZ};                                 \
      twin = cfg.preempt != PM_OFF && twin_launch(&t, kind, f, g_, b_, c->sharedMemBytes, c->hStream, \
                                                  ptsz, params, extra, NULL, c, (launch_ex_fn)real_, \
                                                  seq, &r_, &why);                                 \
    }                                                                                              \
    if (!twin) {                                                                                   \
      r_ = real_(c, f, params, extra);                                                             \
      if (c && r_ == CUDA_SUCCESS) note_original(c->hStream, ptsz, t.rec, why);                    \
    }                                                                                              \
    if (c) launch_end(&t, r_);                                                                     \
    sub_exit();                                                                                    \
    return r_;                                                                                     \
  }
LAUNCH_EX(cuLaunchKernelEx, 0)
LAUNCH_EX(cuLaunchKernelEx_ptsz, 1)

EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *lp, unsigned n, unsigned flags) {
  __typeof__(&cuLaunchCooperativeKernelMultiDevice) real = REAL(cuLaunchCooperativeKernelMultiDevice);
  if (!real) return 999;
  launch_tok t[16];
  unsigned k = n < 16 ? n : 16;
  for (unsigned i = 0; lp && i < n; i++) sub_hold(lp[i].hStream, 0);
  sub_enter();
  for (unsigned i = 0; lp && i < n; i++) sub_mark(lp[i].hStream, 0);
  for (unsigned i = 0; lp && i < k; i++)
    launch_pre(&t[i], lp[i].function, lp[i].gridDimX, lp[i].gridDimY, lp[i].gridDimZ, lp[i].blockDimX,
               lp[i].blockDimY, lp[i].blockDimZ, lp[i].hStream, 0, LK_COOPERATIVE);
  CUresult r_ = real(lp, n, flags);
  for (unsigned i = 0; lp && i < k; i++) {
    if (r_ == CUDA_SUCCESS) note_original(lp[i].hStream, 0, t[i].rec, "cooperative launch");
    launch_end(&t[i], r_);
  }
  sub_exit();
  return r_;
}

#define GRAPH_LAUNCH(fn, ptsz)                                         \
  EXPORT CUresult fn(CUgraphExec g, CUstream s) {                      \
    GATED(fn, s, ptsz, g, s);                                          \
    struct krec *k = trk_graph_launch(g, r_);                          \
    if (r_ == CUDA_SUCCESS) note_original(s, ptsz, k, "graph launch"); \
    return r_;                                                         \
  }
GRAPH_LAUNCH(cuGraphLaunch, 0)
GRAPH_LAUNCH(cuGraphLaunch_ptsz, 1)

// ---- other submissions: gated and counted per stream ----
// SUBMIT(fn, ptsz, (params), (args), stream): an asynchronous submission to stream.
#define SUBMIT(fn, ptsz, PARAMS, ARGS, S)                             \
  EXPORT CUresult fn PARAMS {                                         \
    __typeof__(&fn) real_ = REAL(fn);                                 \
    if (!real_) {                                                     \
      LOG_ONCE("%s: real function not found in %s", #fn, cfg.libcuda); \
      return 999;                                                     \
    }                                                                 \
    sub_hold(S, ptsz);                                                \
    sub_enter();                                                      \
    sub_mark(S, ptsz);                                                \
    CUresult r_ = real_ ARGS;                                         \
    sub_exit();                                                       \
    return r_;                                                        \
  }
// SUBMIT_SYNC: a synchronous copy (legacy stream, or the per-thread one for _ptds); like every
// submission, held first while it would queue behind a twin (sub_hold).
#define SUBMIT_SYNC(fn, ptsz, PARAMS, ARGS)                           \
  EXPORT CUresult fn PARAMS {                                         \
    __typeof__(&fn) real_ = REAL(fn);                                 \
    if (!real_) {                                                     \
      LOG_ONCE("%s: real function not found in %s", #fn, cfg.libcuda); \
      return 999;                                                     \
    }                                                                 \
    sub_hold(NULL, ptsz);                                             \
    sub_enter();                                                      \
    sub_mark(NULL, ptsz);                                             \
    CUresult r_ = real_ ARGS;                                         \
    sub_exit();                                                       \
    return r_;                                                        \
  }
#define SUBMIT2(fn, PARAMS, ARGS, S) SUBMIT(fn, 0, PARAMS, ARGS, S) SUBMIT(fn##_ptsz, 1, PARAMS, ARGS, S)
#define SYNC2(fn, PARAMS, ARGS) SUBMIT_SYNC(fn, 0, PARAMS, ARGS) SUBMIT_SYNC(fn##_ptds, 1, PARAMS, ARGS)
typedef void *CUarray_;
typedef struct {
  int type, id;
} CUmemLocation_;

SUBMIT2(cuEventRecord, (CUevent e, CUstream s), (e, s), s)
SUBMIT2(cuEventRecordWithFlags, (CUevent e, CUstream s, unsigned fl), (e, s, fl), s)
SUBMIT2(cuStreamWaitEvent, (CUstream s, CUevent e, unsigned fl), (s, e, fl), s)
SUBMIT2(cuLaunchHostFunc, (CUstream s, void (*fnp)(void *), void *ud), (s, fnp, ud), s)
SUBMIT2(cuStreamAddCallback, (CUstream s, void (*cb)(CUstream, CUresult, void *), void *ud, unsigned fl),
        (s, cb, ud, fl), s)
SUBMIT2(cuStreamWaitValue32, (CUstream s, CUdeviceptr a, uint32_t v, unsigned fl), (s, a, v, fl), s)
SUBMIT2(cuStreamWaitValue64, (CUstream s, CUdeviceptr a, uint64_t v, unsigned fl), (s, a, v, fl), s)
SUBMIT2(cuStreamWriteValue32, (CUstream s, CUdeviceptr a, uint32_t v, unsigned fl), (s, a, v, fl), s)
SUBMIT2(cuStreamWriteValue64, (CUstream s, CUdeviceptr a, uint64_t v, unsigned fl), (s, a, v, fl), s)
SUBMIT2(cuStreamBatchMemOp, (CUstream s, unsigned n, void *ops, unsigned fl), (s, n, ops, fl), s)
SUBMIT2(cuStreamWaitValue32_v2, (CUstream s, CUdeviceptr a, uint32_t v, unsigned fl), (s, a, v, fl), s)
SUBMIT2(cuStreamWaitValue64_v2, (CUstream s, CUdeviceptr a, uint64_t v, unsigned fl), (s, a, v, fl), s)
SUBMIT2(cuStreamWriteValue32_v2, (CUstream s, CUdeviceptr a, uint32_t v, unsigned fl), (s, a, v, fl), s)
SUBMIT2(cuStreamWriteValue64_v2, (CUstream s, CUdeviceptr a, uint64_t v, unsigned fl), (s, a, v, fl), s)
SUBMIT2(cuStreamBatchMemOp_v2, (CUstream s, unsigned n, void *ops, unsigned fl), (s, n, ops, fl), s)
SUBMIT2(cuMemPrefetchAsync, (CUdeviceptr p, size_t n, CUdevice dv, CUstream s), (p, n, dv, s), s)
SUBMIT2(cuMemPrefetchAsync_v2, (CUdeviceptr p, size_t n, CUmemLocation_ loc, unsigned fl, CUstream s),
        (p, n, loc, fl, s), s)
SUBMIT2(cuGraphUpload, (CUgraphExec g, CUstream s), (g, s), s)
SUBMIT2(cuSignalExternalSemaphoresAsync, (const void *sem, const void *par, unsigned n, CUstream s),
        (sem, par, n, s), s)
SUBMIT2(cuWaitExternalSemaphoresAsync, (const void *sem, const void *par, unsigned n, CUstream s),
        (sem, par, n, s), s)
SUBMIT2(cuMemcpyAsync, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s), s)
SUBMIT2(cuMemcpyHtoDAsync_v2, (CUdeviceptr dst, const void *src, size_t n, CUstream s), (dst, src, n, s), s)
SUBMIT2(cuMemcpyDtoHAsync_v2, (void *dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s), s)
SUBMIT2(cuMemcpyDtoDAsync_v2, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s), s)
SUBMIT2(cuMemcpyHtoAAsync_v2, (CUarray_ a, size_t off, const void *src, size_t n, CUstream s),
        (a, off, src, n, s), s)
SUBMIT2(cuMemcpyAtoHAsync_v2, (void *dst, CUarray_ a, size_t off, size_t n, CUstream s), (dst, a, off, n, s), s)
SUBMIT2(cuMemcpy2DAsync_v2, (const void *p, CUstream s), (p, s), s)
SUBMIT2(cuMemcpy3DAsync_v2, (const void *p, CUstream s), (p, s), s)
SUBMIT2(cuMemcpy3DPeerAsync, (const void *p, CUstream s), (p, s), s)
SUBMIT2(cuMemcpyPeerAsync, (CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n, CUstream s),
        (dst, dc, src, sc, n, s), s)
SUBMIT2(cuMemsetD8Async, (CUdeviceptr p, unsigned char v, size_t n, CUstream s), (p, v, n, s), s)
SUBMIT2(cuMemsetD16Async, (CUdeviceptr p, unsigned short v, size_t n, CUstream s), (p, v, n, s), s)
SUBMIT2(cuMemsetD32Async, (CUdeviceptr p, unsigned v, size_t n, CUstream s), (p, v, n, s), s)
SUBMIT2(cuMemsetD2D8Async, (CUdeviceptr p, size_t pitch, unsigned char v, size_t w, size_t h, CUstream s),
        (p, pitch, v, w, h, s), s)
SUBMIT2(cuMemsetD2D16Async, (CUdeviceptr p, size_t pitch, unsigned short v, size_t w, size_t h, CUstream s),
        (p, pitch, v, w, h, s), s)
SUBMIT2(cuMemsetD2D32Async, (CUdeviceptr p, size_t pitch, unsigned v, size_t w, size_t h, CUstream s),
        (p, pitch, v, w, h, s), s)
SYNC2(cuMemcpy, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n))
SYNC2(cuMemcpyHtoD_v2, (CUdeviceptr dst, const void *src, size_t n), (dst, src, n))
SYNC2(cuMemcpyDtoH_v2, (void *dst, CUdeviceptr src, size_t n), (dst, src, n))
SYNC2(cuMemcpyDtoD_v2, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n))
SYNC2(cuMemcpyDtoA_v2, (CUarray_ a, size_t off, CUdeviceptr src, size_t n), (a, off, src, n))
SYNC2(cuMemcpyAtoD_v2, (CUdeviceptr dst, CUarray_ a, size_t off, size_t n), (dst, a, off, n))
SYNC2(cuMemcpyHtoA_v2, (CUarray_ a, size_t off, const void *src, size_t n), (a, off, src, n))
SYNC2(cuMemcpyAtoH_v2, (void *dst, CUarray_ a, size_t off, size_t n), (dst, a, off, n))
SYNC2(cuMemcpyAtoA_v2, (CUarray_ d, size_t doff, CUarray_ a, size_t off, size_t n), (d, doff, a, off, n))
SYNC2(cuMemcpy2D_v2, (const void *p), (p))
SYNC2(cuMemcpy2DUnaligned_v2, (const void *p), (p))
SYNC2(cuMemcpy3D_v2, (const void *p), (p))
SYNC2(cuMemcpy3DPeer, (const void *p), (p))
SYNC2(cuMemcpyPeer, (CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n), (dst, dc, src, sc, n))
// Synchronous memsets are asynchronous for device memory: plain submissions, no pre-wait.
#define MEMSET2(fn, PARAMS, ARGS) SUBMIT(fn, 0, PARAMS, ARGS, NULL) SUBMIT(fn##_ptds, 1, PARAMS, ARGS, NULL)
MEMSET2(cuMemsetD8_v2, (CUdeviceptr p, unsigned char v, size_t n), (p, v, n))
MEMSET2(cuMemsetD16_v2, (CUdeviceptr p, unsigned short v, size_t n), (p, v, n))
MEMSET2(cuMemsetD32_v2, (CUdeviceptr p, unsigned v, size_t n), (p, v, n))
MEMSET2(cuMemsetD2D8_v2, (CUdeviceptr p, size_t pitch, unsigned char v, size_t w, size_t h), (p, pitch, v, w, h))
MEMSET2(cuMemsetD2D16_v2, (CUdeviceptr p, size_t pitch, unsigned short v, size_t w, size_t h), (p, pitch, v, w, h))
MEMSET2(cuMemsetD2D32_v2, (CUdeviceptr p, size_t pitch, unsigned v, size_t w, size_t h), (p, pitch, v, w, h))

// ---- streams and waits ----
EXPORT CUresult cuStreamCreate(CUstream *s, unsigned flags) {
  CALL_REAL(cuStreamCreate, s, flags);
  if (r_ == CUDA_SUCCESS && s) stream_created(*s, flags);
  return r_;
}
EXPORT CUresult cuStreamCreateWithPriority(CUstream *s, unsigned flags, int prio) {
  CALL_REAL(cuStreamCreateWithPriority, s, flags, prio);
  if (r_ == CUDA_SUCCESS && s) stream_created(*s, flags);
  return r_;
}
// A stream with a preempted twin is destroyed only after the remainder was relaunched on it.
EXPORT CUresult cuStreamDestroy_v2(CUstream s) {
  __typeof__(&cuStreamDestroy_v2) real_ = REAL(cuStreamDestroy_v2);
  if (!real_) return 999;
  sync_scope sc;
  uint64_t g;
  scope_stream(&sc, s, 0);
  honest_wait(&sc, &g);
  return real_(s);
}
// Attributes the app sets on a kernel (notably the dynamic shared memory limit) are set on its twin.
EXPORT CUresult cuFuncSetAttribute(CUfunction f, int attr, int value) {
  CALL_REAL(cuFuncSetAttribute, f, attr, value);
  if (r_ == CUDA_SUCCESS) trk_func_attr(f, attr, value);
  return r_;
}

// Honest waits: while a twin of the scope is preempted and its remainder has not been relaunched,
// the wait sleeps in the shim; a wait that returned from the driver after a twin of its scope was
// preempted during the call waits for the relaunch and calls again.
#define HONEST_SYNC(fn, SCOPE, PARAMS, ARGS)      \
  EXPORT CUresult fn PARAMS {                     \
    __typeof__(&fn) real_ = REAL(fn);             \
    if (!real_) return 999;                       \
    sync_scope sc;                                \
    SCOPE;                                        \
    for (;;) {                                    \
      uint64_t g;                                 \
      honest_wait(&sc, &g);                       \
      CUresult r_ = real_ ARGS;                   \
      if (!honest_again(&sc, g)) return r_;       \
    }                                             \
  }
HONEST_SYNC(cuStreamSynchronize, scope_stream(&sc, s, 0), (CUstream s), (s))
HONEST_SYNC(cuStreamSynchronize_ptsz, scope_stream(&sc, s, 1), (CUstream s), (s))
HONEST_SYNC(cuCtxSynchronize, scope_ctx(&sc), (void), ())
#define HONEST_QUERY(fn, ptsz)                                                \
  EXPORT CUresult fn(CUstream s) {                                            \
    __typeof__(&fn) real_ = REAL(fn);                                         \
    if (!real_) return 999;                                                   \
    sync_scope sc;                                                            \
    scope_stream(&sc, s, ptsz);                                               \
    if (honest_pending(&sc)) return CUDA_ERROR_NOT_READY;                     \
    uint64_t g;                                                               \
    honest_wait(&sc, &g);                                                     \
    CUresult r_ = real_(s);                                                   \
    return honest_again(&sc, g) && r_ == CUDA_SUCCESS ? CUDA_ERROR_NOT_READY : r_; \
  }
HONEST_QUERY(cuStreamQuery, 0)
HONEST_QUERY(cuStreamQuery_ptsz, 1)

// Stream capture: while any capture is open the shim records no timing events, since an event
// recorded on a capturing (or, in global mode, the legacy) stream would change the app's graph.
#define BEGIN_CAPTURE1(fn)                   \
  EXPORT CUresult fn(CUstream s) {           \
    trk_capture(+1);                         \
    CALL_REAL(fn, s);                        \
    if (r_ != CUDA_SUCCESS) trk_capture(-1); \
    return r_;                               \
  }
BEGIN_CAPTURE1(cuStreamBeginCapture)
BEGIN_CAPTURE1(cuStreamBeginCapture_ptsz)
#define BEGIN_CAPTURE2(fn)                           \
  EXPORT CUresult fn(CUstream s, CUstreamCaptureMode m) { \
    trk_capture(+1);                                 \
    CALL_REAL(fn, s, m);                             \
    if (r_ != CUDA_SUCCESS) trk_capture(-1);         \
    return r_;                                       \
  }
BEGIN_CAPTURE2(cuStreamBeginCapture_v2)
BEGIN_CAPTURE2(cuStreamBeginCapture_v2_ptsz)
#define BEGIN_CAPTURE_G(fn)                                                                         \
  EXPORT CUresult fn(CUstream s, CUgraph g, const void *deps, const void *edges, size_t n,          \
                     CUstreamCaptureMode m) {                                                       \
    trk_capture(+1);                                                                                \
    CALL_REAL(fn, s, g, deps, edges, n, m);                                                         \
    if (r_ != CUDA_SUCCESS) trk_capture(-1);                                                        \
    return r_;                                                                                      \
  }
BEGIN_CAPTURE_G(cuStreamBeginCaptureToGraph)
BEGIN_CAPTURE_G(cuStreamBeginCaptureToGraph_ptsz)
#define END_CAPTURE(fn)                                                                   \
  EXPORT CUresult fn(CUstream s, CUgraph *g) {                                            \
    CALL_REAL(fn, s, g);                                                                  \
    /* the capture ends unless the stream was not capturing (illegal state) */            \
    if (r_ != 401 && r_ != CUDA_ERROR_INVALID_VALUE && r_ != 400) trk_capture(-1);        \
    return r_;                                                                            \
  }
END_CAPTURE(cuStreamEndCapture)
END_CAPTURE(cuStreamEndCapture_ptsz)

// ---- the table ----
// Cheap on purpose: read the environment and fill the table; nothing is opened or started. Run
// from the constructor, or earlier from the first dlsym/driver call that beats it.
static void table_init(void) {
  config_load();
#define X(sym, q, l, h, pt, lb) \
  hooks[H_##sym] = (hook_t){.name = #sym, .query = q, .lo = l, .hi = h, .ptsz = pt, .lib = lb, .wrapper = (void *)&sym};
  HOOKS(X)
#undef X
  ctl_set_interception(report_interception);
}

__attribute__((constructor)) static void hooks_init(void) { pthread_once(&table_once, table_init); }

// ptxmig_shim_info identifies the library (ptxmig ps/Detect, tests).
EXPORT const char ptxmig_shim_version[] = PTXMIG_SHIM_VERSION;
EXPORT const char *ptxmig_shim_info(void) { return ptxmig_shim_version; }
