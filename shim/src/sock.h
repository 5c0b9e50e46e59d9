// Socket I/O shared by the control socket (ctl.c) and the owned-memory transfer (vmm.c).
#ifndef PTXMIG_SOCK_H
#define PTXMIG_SOCK_H
#include <stddef.h>

// sock_send sends all of p on the stream socket sock, with the descriptor passfd attached to the
// first bytes (SCM_RIGHTS) unless it is -1; retries on EINTR, never raises SIGPIPE. 0, or -1 on failure.
int sock_send(int sock, const char *p, size_t n, int passfd);

#endif
