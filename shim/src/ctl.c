// The control socket: one Unix stream socket per process, line-delimited JSON requests and replies
// (docs/SHIM-PROTOCOL.md). It runs on its own thread with every signal blocked, started on the
// first CUDA activity (never in a constructor), serves up to 16 connections at once (one may hold
// the quiesce lease), and only talks to peers with the same uid or root.
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "base.h"
#include "ctl.h"
#include "json.h"
#include "preempt.h"
#include "sock.h"
#include "track.h"
#include "vmm.h"

#define MAX_LINE (64 * 1024)

static pthread_mutex_t start_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int started_pid;  // pid that owns the running control thread (0: none)
static int listen_fd = -1;
static char sock_path[sizeof(((struct sockaddr_un *)0)->sun_path)];

// ---- the status reply ----
// The interception counters belong to hooks.c, the module above this one: it hands their writer
// in at init (ctl_set_interception).
static void (*_Atomic interception)(jbuf *b);
void ctl_set_interception(void (*write)(jbuf *b)) { atomic_store(&interception, write); }

static void report_status(jbuf *b, int brief) {
  char exe[512];
  ssize_t el = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (el < 0) el = 0;
  jb_printf(b, "{\"pid\":%d,\"shim\":\"%s\",\"proto\":%d,\"exe\":", (int)getpid(), PTXMIG_SHIM_VERSION,
            PTXMIG_PROTO_VERSION);
  jb_str(b, exe, (size_t)el);
  trk_report_status(b, brief);
  jb_key(b, "interception");
  void (*w)(jbuf *) = atomic_load(&interception);
  if (w) w(b);
  else jb_s(b, "{}");
  jb_key(b, "collectives");
  preempt_collectives_report(b);
  jb_key(b, "preempt");
  preempt_report_status(b);
  jb_key(b, "owned_memory");
  vmm_report_status(b);
  jb_s(b, "}");
}

static void reply_error(int fd, const char *msg) {
  jbuf b = {0};
  jb_printf(&b, "{\"ok\":false,\"proto\":%d,\"error\":", PTXMIG_PROTO_VERSION);
  jb_str(&b, msg, strlen(msg));
  jb_s(&b, "}\n");
  if (!b.oom) sock_send(fd, b.p, b.len, -1);
  free(b.p);
}

// ---- connections ----
// The server is one thread polling the listening socket and up to MAX_CONN connections, so a
// connection kept open (the quiesce lease, held during a whole checkpoint) never blocks others.
// A connection idle for IDLE_S is closed, except the lease's. Replies are sent blocking, with a
// 10 s send timeout.
#define MAX_CONN 16
#define IDLE_S 10
typedef struct {
  int fd;
  char *buf;
  size_t len, pos;  // pos: past the line being handled
  int discarding, lease, close_after;
  int armed;  // this connection armed the collective alignment: closing it disarms
  int passed_fd;  // a descriptor ptxmig attached to the line being read (SCM_RIGHTS), or -1
  uint64_t last_ns;
} conn;

// take_fd hands the descriptor passed with the current line to the request that uses it (mem-stash
// and mem-unstash: a target copy); one no request took is closed after the line.
static int take_fd(conn *c) {
  int fd = c->passed_fd;
  c->passed_fd = -1;
  return fd;
}
static void drop_fd(conn *c) {
  if (c->passed_fd >= 0) close(c->passed_fd);
  c->passed_fd = -1;
}
static conn conns[MAX_CONN];


static void send_ok(conn *c, const char *cmd, jbuf *res) {
  jbuf b = {0};
  jb_printf(&b, "{\"ok\":true,\"proto\":%d,\"cmd\":\"%s\",\"result\":", PTXMIG_PROTO_VERSION, cmd);
  jb_s(&b, res->p ? res->p : "{}");
  jb_s(&b, "}\n");
  if (b.oom || res->oom) reply_error(c->fd, "out of memory building the reply");
  else if (sock_send(c->fd, b.p, b.len, -1)) c->close_after = 1;
  free(b.p);
}

// parse_budget: budget_ms, 1..60000 (default 10); -1 when invalid.
static long parse_budget(const char *v) {
  if (!v) return 10;
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || *end || x < 1 || x > 60000) return -1;
  return x;
}

static unsigned long long parse_u64(const char *v, unsigned long long def) {
  if (!v) return def;
  char *end;
  errno = 0;
  unsigned long long x = strtoull(v, &end, 10);
  return errno || *end ? ~0ull : x;
}

// handle_mem answers the owned-memory requests (vmm.c). Those that act on the memory belong to
// the connection holding the quiesce lease, or, in a process restored while detached (no lease),
// to any connection while the process is not running.
static void handle_mem(conn *c, const char *cmd, const char *dir, const char *chunk, const char *slots,
                       const char *hash, const char *skip, const char *unpin, const char *target_bytes) {
  char err[300] = "";
  jbuf b = {0};
  int rc;
  if (strcmp(cmd, "mem-status") == 0) {
    vmm_report_status(&b);
    send_ok(c, cmd, &b);
    free(b.p);
    return;
  }
  if (strcmp(cmd, "mem-prepare") == 0 || strcmp(cmd, "mem-precopy") == 0) {  // while the process runs, any connection
    rc = strcmp(cmd, "mem-prepare") == 0 ? vmm_cmd_prepare(&b, err, sizeof err) : vmm_cmd_precopy(parse_u64(unpin, 0) == 1, &b, err, sizeof err);
    if (rc) reply_error(c->fd, err);
    else send_ok(c, cmd, &b);
    free(b.p);
    return;
  }
  int st = preempt_state();
  if (st == 0 || (st == 1 && !c->lease)) {
    reply_error(c->fd, st == 0 ? "mem: not quiesced" : "mem: only the connection that quiesced may move owned memory");
    return;
  }
  if (st == 2) c->lease = 1;  // a restored (detached) process: this connection now leads
  if (strcmp(cmd, "mem-begin") == 0) {
    unsigned long long ch = parse_u64(chunk, 4u << 20), sl = parse_u64(slots, 8), h = parse_u64(hash, 0);
    rc = vmm_cmd_begin(c->fd, dir, ch, sl > 1000 ? 0 : (unsigned)sl, h == 1, err, sizeof err);
    if (rc == 0) return;  // replied, with the ring's descriptor
  } else if (strcmp(cmd, "mem-copy") == 0 || strcmp(cmd, "mem-fill") == 0) {
    // The transfer reads the socket itself: what the connection already read past this line
    // (ptxmig's first messages) goes to it first.
    if (vmm_feed(c->buf + c->pos, c->len - c->pos)) {
      rc = -1;
      snprintf(err, sizeof err, "%s: too much sent ahead of the transfer", cmd);
    } else {
      c->len = c->pos;
      rc = cmd[4] == 'c' ? vmm_cmd_copy(c->fd, skip, &b, err, sizeof err) : vmm_cmd_fill(c->fd, &b, err, sizeof err);
    }
  } else if (strcmp(cmd, "mem-release") == 0) {
    rc = vmm_cmd_release(&b, err, sizeof err);
  } else if (strcmp(cmd, "mem-end") == 0) {
    rc = vmm_cmd_end(&b);
  } else if (strcmp(cmd, "mem-stash") == 0) {
    int fd = take_fd(c);  // a target copy (migrate, device to device), or -1
    unsigned long long tb = parse_u64(target_bytes, 0);
    if (fd >= 0 && (tb == 0 || tb == ~0ull)) {
      rc = -1;
      snprintf(err, sizeof err, "mem-stash: a target copy needs target_bytes, its size");
    } else {
      rc = vmm_cmd_stash(fd, tb, &b, err, sizeof err);
    }
    if (fd >= 0) close(fd);
  } else if (strcmp(cmd, "mem-unstash") == 0) {
    int fd = take_fd(c);
    rc = vmm_cmd_unstash(fd, &b, err, sizeof err);  // the stash is freed after the resume (vmm_stash_drop)
    if (fd >= 0) close(fd);
  } else {
    rc = -1;
    snprintf(err, sizeof err,
             "unknown cmd %s (want mem-status, mem-begin, mem-copy, mem-fill, mem-release, mem-end, mem-prepare, mem-precopy, "
             "mem-stash or mem-unstash)", cmd);
  }
  if (rc) reply_error(c->fd, err);
  else send_ok(c, cmd, &b);
  free(b.p);
}

// handle_line answers one request.
static void handle_line(conn *c, const char *line, size_t n) {
  static const char *const keys[] = {"cmd", "dir", "#budget_ms", "#chunk_bytes", "#slots", "#hash", "skip", "#at", "#brief", "#unpin",
                                     "#target_bytes"};
  enum { NKEYS = sizeof keys / sizeof keys[0] };
  char *vals[NKEYS];
  char err[256];
  int fd = c->fd;
  if (json_flat_parse(line, n, keys, vals, NKEYS, err, sizeof err) < 0) {
    char msg[300];
    snprintf(msg, sizeof msg, "malformed request: %s", err);
    reply_error(fd, msg);
    return;
  }
  const char *cmd = vals[0];
  jbuf b = {0};
  if (!cmd) {
    reply_error(fd, "malformed request: missing \"cmd\"");
  } else if (strcmp(cmd, "status") == 0) {
    report_status(&b, vals[8] && strcmp(vals[8], "0") != 0);
    send_ok(c, cmd, &b);
  } else if (strcmp(cmd, "kernels") == 0) {
    report_kernels(&b);
    send_ok(c, cmd, &b);
  } else if (strcmp(cmd, "dump-modules") == 0) {
    if (!vals[1]) reply_error(fd, "dump-modules: missing \"dir\"");
    else if (report_dump(&b, vals[1], err, sizeof err)) reply_error(fd, err);
    else send_ok(c, cmd, &b);
  } else if (strcmp(cmd, "quiesce") == 0) {
    long budget = parse_budget(vals[2]);
    if (budget < 0) {
      reply_error(fd, "quiesce: budget_ms must be an integer from 1 to 60000");
    } else {
      if (preempt_quiesce(&b, (unsigned)budget)) {
        c->lease = 1;  // this connection holds the quiesce: closing it resumes
        c->armed = 0;  // (and the resume ends the alignment)
        shim_log("quiesced (lease on this connection)");
      }
      send_ok(c, cmd, &b);
    }
  } else if (strcmp(cmd, "align") == 0) {
    unsigned long long at = parse_u64(vals[7], ~0ull);
    if (at == ~0ull) {
      reply_error(fd, "align: \"at\" must be a collective count (0 disarms)");
    } else {
      int r = preempt_align(&b, at, err, sizeof err);
      if (r < 0) {
        reply_error(fd, err);
      } else {
        if (r > 0) c->armed = 1;
        if (at == 0) c->armed = 0;
        send_ok(c, cmd, &b);
      }
    }
  } else if (strncmp(cmd, "mem-", 4) == 0) {
    handle_mem(c, cmd, vals[1], vals[3], vals[4], vals[5], vals[6], vals[9], vals[10]);
  } else if (strcmp(cmd, "detach") == 0) {
    vmm_conn_closed();  // the ring is gone before CRIU dumps the process
    if (!c->lease) {
      reply_error(fd, preempt_state() == 0 ? "detach: not quiesced" : "detach: only the connection that quiesced may detach");
    } else if (preempt_detach(&b)) {
      reply_error(fd, "detach: not quiesced");
    } else {
      c->lease = 0;
      c->close_after = 1;  // no connection may stay open into a CRIU dump: the shim closes its end
      send_ok(c, cmd, &b);
    }
  } else if (strcmp(cmd, "peer-off") == 0 || strcmp(cmd, "peer-on") == 0) {
    // Peer access off for a checkpoint (quiesced, the lease's connection), on again after (the
    // lease's, or any connection to a restored process); a resume turns it on by itself.
    int on = strcmp(cmd, "peer-on") == 0, st = preempt_state();
    if (st == 0 || (!c->lease && !(on && st == 2))) {
      reply_error(fd, st == 0 ? "peer: not quiesced" : "peer: only the connection that quiesced may change peer access");
    } else if (trk_peer_set(on, &b, err, sizeof err)) {
      reply_error(fd, err);
    } else {
      send_ok(c, cmd, &b);
    }
  } else if (strcmp(cmd, "resume") == 0) {
    if (trk_peer_pending() && trk_peer_set(1, &b, err, sizeof err)) {
      reply_error(fd, err);  // peer access stays off: the process stays held (a later resume retries)
    } else if (vmm_stashed() && vmm_cmd_unstash(-1, &b, err, sizeof err)) {
      reply_error(fd, err);  // the memory stays stashed: the process stays held (a later resume retries)
    } else if (vmm_released()) {
      reply_error(fd, "resume: owned device memory is released; load it first (mem-begin load, mem-fill)");
    } else {
      free(b.p);  // an unstash's report is not part of the resume's reply
      b = (jbuf){0};
      vmm_conn_closed();
      for (int i = 0; i < MAX_CONN; i++) conns[i].lease = 0;
      preempt_resume(&b);
      send_ok(c, cmd, &b);
      vmm_stash_drop();
    }
  } else {
    reply_error(fd, "unknown cmd (want status, kernels, dump-modules, align, quiesce, peer-off, peer-on, detach, resume or mem-*)");
  }
  free(b.p);
  for (int i = 0; i < NKEYS; i++) free(vals[i]);
}

static void conn_close(conn *c) {
  if (c->fd < 0) return;
  drop_fd(c);
  close(c->fd);
  c->fd = -1;
  free(c->buf);
  c->buf = NULL;
  if (c->armed) {  // the aligning ptxmig went away before quiescing: let the process run on
    c->armed = 0;
    jbuf b = {0};
    char err[64];
    if (preempt_align(&b, 0, err, sizeof err) >= 0) shim_log("align connection closed: disarmed");
    free(b.p);
  }
  if (c->lease) {
    c->lease = 0;
    vmm_conn_closed();
    if (preempt_state() == 1 && vmm_stashed()) {
      // The memory is in the process (a migrate's ptxmig went away): put it back, then resume.
      jbuf b = {0};
      char err[300];
      if (vmm_cmd_unstash(-1, &b, err, sizeof err)) shim_log("lease connection closed while owned memory is stashed: %s; the process stays held", err);
      else shim_log("lease connection closed while owned memory is stashed: loaded back (%s)", b.p ? b.p : "");
      free(b.p);
    }
    if (preempt_state() == 1 && vmm_released()) {
      // Resuming now would run kernels on memory that is not there: stay held until a ptxmig
      // (the guardian's rollback, `ptxmig recover`) loads it and resumes. Detached, as after a
      // restore, so that the connection of that ptxmig may load it (handle_mem).
      jbuf b = {0};
      preempt_detach(&b);
      free(b.p);
      shim_log("lease connection closed while owned memory is released: the process stays held (detached)");
    } else if (preempt_state() == 1) {  // quiesced and not detached: the client went away
      jbuf b = {0};
      char err[300];
      if (trk_peer_pending() && trk_peer_set(1, &b, err, sizeof err)) {
        // Running without its peer access would fault its kernels: stay held, detached, until a
        // ptxmig (the guardian's rollback, `ptxmig recover`) resumes it, which tries again.
        free(b.p);
        b = (jbuf){0};
        preempt_detach(&b);
        free(b.p);
        shim_log("lease connection closed: %s; the process stays held (detached)", err);
        return;
      }
      free(b.p);
      b = (jbuf){0};
      preempt_resume(&b);
      shim_log("lease connection closed before detach: resumed (%s)", b.p ? b.p : "");
      free(b.p);
      vmm_stash_drop();
    }
  }
}

static void conn_open(int fd) {
  struct ucred cr;
  socklen_t cl = sizeof cr;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) || (cr.uid != 0 && cr.uid != geteuid())) {
    reply_error(fd, "permission denied: peer uid differs from the process owner");
    close(fd);
    return;
  }
  int i;
  for (i = 0; i < MAX_CONN && conns[i].fd >= 0; i++) {
  }
  char *buf = i < MAX_CONN ? malloc(MAX_LINE + 1) : NULL;
  if (!buf) {
    reply_error(fd, "busy: too many connections");
    close(fd);
    return;
  }
  struct timeval tv = {10, 0};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  conns[i] = (conn){.fd = fd, .buf = buf, .passed_fd = -1, .last_ns = shim_now_ns()};
}

// conn_read reads what is there and answers every complete line.
static void conn_read(conn *c) {
  struct iovec io = {.iov_base = c->buf + c->len, .iov_len = MAX_LINE - c->len};
  union {
    char buf[CMSG_SPACE(4 * sizeof(int))];
    struct cmsghdr align;
  } u;
  struct msghdr m = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
  ssize_t r = recvmsg(c->fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  // Descriptors ptxmig attached: the first is kept for the line being read, others are closed.
  for (struct cmsghdr *h = r > 0 ? CMSG_FIRSTHDR(&m) : NULL; h; h = CMSG_NXTHDR(&m, h)) {
    if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t k = 0; k < n; k++) {
      int fd;
      memcpy(&fd, CMSG_DATA(h) + k * sizeof(int), sizeof fd);
      if (c->passed_fd < 0) c->passed_fd = fd;
      else close(fd);
    }
  }
  if (r < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (r <= 0) {
    conn_close(c);
    return;
  }
  c->last_ns = shim_now_ns();
  c->len += (size_t)r;
  size_t start = 0;
  for (size_t i = 0; i < c->len && !c->close_after; i++) {
    if (c->buf[i] != '\n') continue;
    if (c->discarding) {
      c->discarding = 0;
    } else if (memchr(c->buf + start, 0, i - start)) {
      reply_error(c->fd, "malformed request: NUL byte");
    } else if (i > start) {
      c->pos = i + 1;
      handle_line(c, c->buf + start, i - start);
    }
    drop_fd(c);  // a descriptor goes with one line only, whatever became of it
    start = i + 1;
  }
  if (c->close_after) {  // detached (the lease was dropped first), or a reply could not be sent
    conn_close(c);
    return;
  }
  memmove(c->buf, c->buf + start, c->len - start);
  c->len -= start;
  if (c->len == MAX_LINE) {  // a line longer than the limit: refuse it, skip to its end
    reply_error(c->fd, "malformed request: line longer than 65536 bytes");
    drop_fd(c);
    c->discarding = 1;
    c->len = 0;
  }
}

static ino_t sock_ino;  // the socket file this process bound (0: unknown)

// bind_listen creates the listening socket at path (removing a stale file first); -1 on error.
static int bind_listen(const char *path) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  unlink(sa.sun_path);  // a stale socket of an earlier process with this pid
  struct stat st;
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) || chmod(sa.sun_path, 0600) || listen(fd, 8) ||
      stat(sa.sun_path, &st)) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  sock_ino = st.st_ino;
  return fd;
}

// relisten: once a second, if the socket file is gone (a restore that did not re-create it, a
// cleaner emptying the directory), bind a new listening socket at the same path. A file that is
// there but not ours (another process's socket) is left alone.
static int relisten(int lfd) {
  struct stat st;
  if (!sock_path[0] || stat(sock_path, &st) == 0 || errno != ENOENT) return lfd;
  mkdir(cfg.socket_dir, 0700);
  int nfd = bind_listen(sock_path);
  if (nfd < 0) {
    LOG_ONCE("control socket %s vanished and could not be re-created: %s", sock_path, strerror(errno));
    return lfd;
  }
  shim_log("control socket %s re-created", sock_path);
  pthread_mutex_lock(&start_mu);
  close(lfd);
  listen_fd = nfd;
  pthread_mutex_unlock(&start_mu);
  return nfd;
}

static void *ctl_thread(void *arg) {
  int lfd = (int)(intptr_t)arg;
  uint64_t last_check = shim_now_ns();
  for (int i = 0; i < MAX_CONN; i++) conns[i].fd = -1;
  for (;;) {
    if (shim_now_ns() - last_check > 1000000000ull) {
      vmm_tick();
      lfd = relisten(lfd);
      last_check = shim_now_ns();
    }
    struct pollfd pf[MAX_CONN + 1];
    int idx[MAX_CONN + 1], np = 0;
    pf[np] = (struct pollfd){.fd = lfd, .events = POLLIN};
    idx[np++] = -1;
    for (int i = 0; i < MAX_CONN; i++)
      if (conns[i].fd >= 0) {
        pf[np] = (struct pollfd){.fd = conns[i].fd, .events = POLLIN};
        idx[np++] = i;
      }
    int r = poll(pf, (nfds_t)np, 1000);
    if (r < 0 && errno != EINTR) {
      struct timespec ts = {0, 100 * 1000 * 1000};
      nanosleep(&ts, NULL);
      continue;
    }
    if (r > 0 && pf[0].revents) {
      if (pf[0].revents & (POLLNVAL | POLLERR)) {
        if (fcntl(lfd, F_GETFD) < 0) break;  // closed after fork or at exit
      }
      int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
      if (fd >= 0) conn_open(fd);
    }
    for (int k = 1; r > 0 && k < np; k++)
      if (pf[k].revents && conns[idx[k]].fd >= 0) conn_read(&conns[idx[k]]);
    uint64_t now = shim_now_ns();
    for (int i = 0; i < MAX_CONN; i++)
      if (conns[i].fd >= 0 && !conns[i].lease && now - conns[i].last_ns > (uint64_t)IDLE_S * 1000000000ull)
        conn_close(&conns[i]);
  }
  return NULL;
}

static void ctl_cleanup(void) {
  struct stat st;
  // Only our own socket file: after a restore elsewhere the path may name another process's.
  if (atomic_load(&started_pid) == (int)getpid() && sock_path[0] && stat(sock_path, &st) == 0 &&
      (!sock_ino || st.st_ino == sock_ino))
    unlink(sock_path);
}

// The control thread does not exist in the child; the parent's socket stays the parent's.
static void atfork_child(void) {
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
  fd = bind_listen(sa.sun_path);
  if (fd < 0) goto fail;
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
