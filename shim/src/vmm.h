// Owned device memory (vmm.c, PTXMIG_OWNED_MEMORY=1): large cuMemAlloc* served from VMM mappings
// the shim creates, and the transfer commands that move that memory at a checkpoint and restore
// (docs/SHIM-PROTOCOL.md, "Owned device memory").
#ifndef PTXMIG_VMM_H
#define PTXMIG_VMM_H
#include <stddef.h>
#include <stdint.h>

#include "base.h"
#include "json.h"

// ---- the allocation wrappers' side ----
// vmm_alloc/vmm_free: CUDA_SUCCESS, or -1 when the shim does not serve the call (the driver must).
int vmm_alloc(CUdeviceptr *p, size_t size);
int vmm_free(CUdeviceptr p);
int vmm_range(CUdeviceptr p, CUdeviceptr *base, size_t *size);  // 1 when p is owned memory
int vmm_ipc_refuse(CUdeviceptr p);                                // 1: owned, refuse the IPC handle

// ---- the control socket's side (control thread, the lease connection) ----
int vmm_released(void);  // the physical memory was released (mem-release) and not re-created yet
void vmm_report_status(jbuf *b);
void vmm_conn_closed(void);  // the lease connection went away (or detached): drop the transfer session
// Each command answers into b (0) or fails with err (-1); sock is the connection's socket, on
// which begin, copy and fill talk to ptxmig beyond the reply.
int vmm_cmd_begin(int sock, const char *dir, uint64_t chunk, unsigned slots, int hash, char *err, size_t errlen);
int vmm_cmd_copy(int sock, const char *skip, jbuf *b, char *err, size_t errlen);
int vmm_cmd_fill(int sock, jbuf *b, char *err, size_t errlen);
int vmm_feed(const char *p, size_t n);  // bytes read past the request line: the session's input
int vmm_cmd_release(jbuf *b, char *err, size_t errlen);
int vmm_cmd_end(jbuf *b);
// The stash (migrate): mem-prepare readies it while the process runs, mem-precopy rounds fill it
// while it still runs; mem-stash copies the rest of the memory
// into the process's own host memory and releases it; mem-unstash re-creates and refills it
// (nothing to do when nothing is stashed), and vmm_stash_drop frees it after the resume.
int vmm_stashed(void);  // the released memory is in the stash
int vmm_cmd_prepare(jbuf *b, char *err, size_t errlen);
int vmm_cmd_precopy(int unpin, jbuf *b, char *err, size_t errlen);
int vmm_cmd_stash(int fd, uint64_t target_bytes, jbuf *b, char *err, size_t errlen);  // fd: a target copy, or -1
int vmm_cmd_unstash(int fd, jbuf *b, char *err, size_t errlen);  // fd: the target copy, or -1
void vmm_stash_drop(void);  // after the resume's reply: unpin and free an unstashed or unused stash
void vmm_tick(void);        // control thread, every second: frees a drained or stale prepared stash

#endif
