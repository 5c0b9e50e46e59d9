// Socket I/O shared by the control socket and the owned-memory transfer (see sock.h).
#include "sock.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>

int sock_send(int sock, const char *p, size_t n, int fd) {
  size_t off = 0;
  while (off < n) {
    struct iovec io = {.iov_base = (void *)(p + off), .iov_len = n - off};
    union {
      char buf[CMSG_SPACE(sizeof(int))];
      struct cmsghdr align;
    } u;
    struct msghdr m = {.msg_iov = &io, .msg_iovlen = 1};
    if (fd >= 0 && off == 0) {
      memset(&u, 0, sizeof u);
      m.msg_control = u.buf;
      m.msg_controllen = sizeof u.buf;
      struct cmsghdr *c = CMSG_FIRSTHDR(&m);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    ssize_t w = sendmsg(sock, &m, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    off += (size_t)w;
  }
  return 0;
}
