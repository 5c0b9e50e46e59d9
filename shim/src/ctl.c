// The control socket: one Unix stream socket per process, line-delimited JSON requests and replies
// (docs/SHIM-PROTOCOL.md). It runs on its own thread with every signal blocked, started on the
// first CUDA activity (never in a constructor), serves one connection at a time with timeouts,
// and only talks to peers with the same uid or root.
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"

#define MAX_LINE (64 * 1024)

static pthread_mutex_t start_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int started_pid;  // pid that owns the running control thread (0: none)
static int listen_fd = -1;
static char sock_path[sizeof(((struct sockaddr_un *)0)->sun_path)];

static int send_all(int fd, const char *p, size_t n) {
  size_t off = 0;
  while (off < n) {
    ssize_t w = send(fd, p + off, n - off, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    off += (size_t)w;
  }
  return 0;
}

static void reply_error(int fd, const char *msg) {
  jbuf b = {0};
  jb_printf(&b, "{\"ok\":false,\"proto\":%d,\"error\":", PTXMIG_PROTO_VERSION);
  jb_str(&b, msg, strlen(msg));
  jb_s(&b, "}\n");
  if (!b.oom) send_all(fd, b.p, b.len);
  free(b.p);
}

// handle_line answers one request; returns -1 when the connection should close.
static int handle_line(int fd, const char *line, size_t n) {
  static const char *const keys[] = {"cmd", "dir"};
  char *vals[2];
  char err[256];
  if (json_flat_parse(line, n, keys, vals, 2, err, sizeof err) < 0) {
    char msg[300];
    snprintf(msg, sizeof msg, "malformed request: %s", err);
    reply_error(fd, msg);
    return 0;
  }
  const char *cmd = vals[0];
  jbuf b = {0};
  int rc = 0;
  if (!cmd) {
    reply_error(fd, "malformed request: missing \"cmd\"");
  } else if (strcmp(cmd, "status") == 0 || strcmp(cmd, "kernels") == 0 || strcmp(cmd, "dump-modules") == 0) {
    jb_printf(&b, "{\"ok\":true,\"proto\":%d,\"cmd\":\"%s\",\"result\":", PTXMIG_PROTO_VERSION, cmd);
    int ok = 1;
    if (cmd[0] == 's') {
      report_status(&b);
    } else if (cmd[0] == 'k') {
      report_kernels(&b);
    } else if (!vals[1]) {
      ok = 0;
      reply_error(fd, "dump-modules: missing \"dir\"");
    } else if (report_dump(&b, vals[1], err, sizeof err)) {
      ok = 0;
      reply_error(fd, err);
    }
    if (ok) {
      jb_s(&b, "}\n");
      if (b.oom) reply_error(fd, "out of memory building the reply");
      else if (send_all(fd, b.p, b.len)) rc = -1;
    }
  } else {
    char msg[128];
    snprintf(msg, sizeof msg, "unknown cmd (want status, kernels or dump-modules)");
    reply_error(fd, msg);
  }
  free(b.p);
  free(vals[0]);
  free(vals[1]);
  return rc;
}

static void serve(int fd) {
  struct ucred cr;
  socklen_t cl = sizeof cr;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) || (cr.uid != 0 && cr.uid != geteuid())) {
    reply_error(fd, "permission denied: peer uid differs from the process owner");
    return;
  }
  struct timeval tv = {10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  char *buf = malloc(MAX_LINE + 1);
  if (!buf) return;
  size_t len = 0;
  int discarding = 0;
  for (;;) {
    ssize_t r = recv(fd, buf + len, MAX_LINE - len, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    len += (size_t)r;
    size_t start = 0;
    for (size_t i = 0; i < len; i++) {
      if (buf[i] != '\n') continue;
      if (discarding) {
        discarding = 0;
      } else if (memchr(buf + start, 0, i - start)) {
        reply_error(fd, "malformed request: NUL byte");
      } else if (i > start && handle_line(fd, buf + start, i - start)) {
        free(buf);
        return;
      }
      start = i + 1;
    }
    memmove(buf, buf + start, len - start);
    len -= start;
    if (len == MAX_LINE) {  // a line longer than the limit: refuse it, skip to its end
      reply_error(fd, "malformed request: line longer than 65536 bytes");
      discarding = 1;
      len = 0;
    }
  }
  free(buf);
}

static void *ctl_thread(void *arg) {
  int lfd = (int)(intptr_t)arg;
  for (;;) {
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EBADF || errno == EINVAL) break;  // closed after fork or at exit
      struct timespec ts = {0, 100 * 1000 * 1000};
      nanosleep(&ts, NULL);
      continue;
    }
    serve(fd);
    close(fd);
  }
  return NULL;
}

static void ctl_cleanup(void) {
  if (atomic_load(&started_pid) == (int)getpid() && sock_path[0]) unlink(sock_path);
}

static void atfork_child(void) { ctl_atfork_child(); }

void ctl_atfork_child(void) {
  // The control thread does not exist in the child; the parent's socket stays the parent's.
  if (listen_fd >= 0) close(listen_fd);
  listen_fd = -1;
  sock_path[0] = 0;
  atomic_store(&started_pid, 0);
  pthread_mutex_init(&start_mu, NULL);
}

void ctl_ensure_started(void) {
  int pid = (int)getpid();
  if (atomic_load_explicit(&started_pid, memory_order_acquire) == pid) return;
  pthread_mutex_lock(&start_mu);
  if (atomic_load(&started_pid) == pid) {
    pthread_mutex_unlock(&start_mu);
    return;
  }
  static int registered;
  if (!registered) {
    registered = 1;
    pthread_atfork(NULL, NULL, atfork_child);
    atexit(ctl_cleanup);
  }
  atomic_store(&started_pid, pid);  // one attempt per process, successful or not
  if (mkdir(cfg.socket_dir, 0700) && errno != EEXIST) {
    shim_log("control socket: mkdir %s: %s (no socket for this process)", cfg.socket_dir, strerror(errno));
    pthread_mutex_unlock(&start_mu);
    return;
  }
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  int n = snprintf(sa.sun_path, sizeof sa.sun_path, "%s/%d.sock", cfg.socket_dir, pid);
  int fd = -1;
  if (n < 0 || (size_t)n >= sizeof sa.sun_path) {
    shim_log("control socket: path too long under %s", cfg.socket_dir);
    goto out;
  }
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) goto fail;
  unlink(sa.sun_path);  // a stale socket of an earlier process with this pid
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) || chmod(sa.sun_path, 0600) || listen(fd, 8)) goto fail;
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_t t;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&at, 256 * 1024);
  int e = pthread_create(&t, &at, ctl_thread, (void *)(intptr_t)fd);
  pthread_attr_destroy(&at);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (e) {
    errno = e;
    unlink(sa.sun_path);
    goto fail;
  }
  pthread_setname_np(t, "ptxmig-ctl");
  listen_fd = fd;
  memcpy(sock_path, sa.sun_path, sizeof sock_path);
  shim_log("control socket %s", sock_path);
  pthread_mutex_unlock(&start_mu);
  return;
fail:
  shim_log("control socket %s: %s (no socket for this process)", sa.sun_path, strerror(errno));
out:
  if (fd >= 0) close(fd);
  pthread_mutex_unlock(&start_mu);
}
