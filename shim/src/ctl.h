// The control socket (ctl.c): one Unix socket per process serving ptxmig's requests
// (docs/SHIM-PROTOCOL.md) on its own thread.
#ifndef PTXMIG_CTL_H
#define PTXMIG_CTL_H

#include "json.h"

// ctl_ensure_started starts the control thread on the first CUDA activity (never in a
// constructor); idempotent and cheap after the first call, and again once in a forked child.
void ctl_ensure_started(void);
// ctl_set_interception hands in the writer of the status reply's "interception" member (the
// resolver counters of hooks.c, a JSON object); until then it is {}.
void ctl_set_interception(void (*write)(jbuf *b));

#endif
