// Preemption (preempt.c): the submission gate, quiesce/detach/resume, twin launches (preemptible
// copies of long kernels), the honest synchronisation the sync wrappers use, and the alignment of
// a quiesce on collective launches. See docs/SHIM-PROTOCOL.md "Preemption".
#ifndef PTXMIG_PREEMPT_H
#define PTXMIG_PREEMPT_H
#include <stddef.h>
#include <stdint.h>

#include "base.h"
#include "json.h"
#include "track.h"

// ---- the gate ----
// Every wrapper that submits GPU work brackets its driver call with sub_enter/sub_exit (the gate:
// sub_enter blocks while the process is quiesced) and records the submission with sub_mark.
// sub_hold, before sub_enter: waits while the submission would queue behind a twin in flight.
void sub_hold(CUstream s, int ptsz);
void sub_enter(void);
void sub_exit(void);
uint64_t sub_mark(CUstream s, int ptsz);
void stream_created(CUstream s, unsigned flags);

// ---- launches ----
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
typedef CUresult (*launch_ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
// twin_launch launches f's twin instead of f when the policy allows: 1 with *res set, or 0 (and
// *why) when the caller must launch the original.
int twin_launch(launch_tok *t, int kind, CUfunction f, const unsigned g[3], const unsigned b[3], unsigned shmem,
                CUstream s, int ptsz, void **params, void **extra, launch_fn lf, const CUlaunchConfig *ex,
                launch_ex_fn lef, uint64_t seq, CUresult *res, const char **why);
// note_original records a launch that ran as the original kernel (why: a static string).
void note_original(CUstream s, int ptsz, krec *r, const char *why);

// ---- honest waits ----
// While a twin of the scope is preempted and its remainder has not been relaunched, a wait sleeps
// in the shim; a wait that returned from the driver after a twin of its scope was preempted during
// the call waits for the relaunch and calls again (honest_again).
typedef struct {
  void *c, *s;  // context record (ctx-wide scope) or stream record
} sync_scope;
void scope_stream(sync_scope *sc, CUstream s, int ptsz);
void scope_ctx(sync_scope *sc);
void honest_wait(const sync_scope *sc, uint64_t *gen);
int honest_again(const sync_scope *sc, uint64_t gen);
int honest_pending(const sync_scope *sc);
void preempt_wait_clean(void);  // sleeps while a twin of the current context awaits its relaunch

// ---- quiesce, detach, resume (the control socket's commands) ----
int preempt_quiesce(jbuf *b, unsigned budget_ms);  // 1: this call quiesced (the lease is the caller's)
int preempt_detach(jbuf *b);
void preempt_resume(jbuf *b);
int preempt_state(void);  // 0 running, 1 quiesced, 2 detached
// Collective alignment: every launch of a collective kernel counts (the launch wrappers call
// preempt_collective_launched); "align" arms the gate to close right after launch number `at`
// (0 disarms and reopens a gate it closed).
void preempt_collective_launched(void);
int preempt_align(jbuf *b, unsigned long long at, char *err, size_t errlen);  // 1: armed
void preempt_collectives_report(jbuf *b);
void preempt_report_status(jbuf *b);

// preempt_drop_ctx forgets a context that is being destroyed (or whose primary context is being
// released): its launches, control-block slabs, events and side stream die with it.
void preempt_drop_ctx(CUcontext ctx);

#endif
