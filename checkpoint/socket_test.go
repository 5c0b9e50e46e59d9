package checkpoint_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/seccomp"
	"github.com/ptxmig/ptxmig/internal/tcpdiag"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/internal/testreq"
	"github.com/ptxmig/ptxmig/restore"
)

// Sockets with real CRIU: Linux >= 6.16 refuses SO_PASSCRED on TCP sockets, which CRIU < 4.2 read
// on every socket, so neither case below could be dumped with CRIU 4.1.1 on such a kernel.

// startDaemon starts a python3 program in a session of its own, its output in a file (CRIU
// dumps a tree whose descriptors lead nowhere outside it).
func startDaemon(t *testing.T, dir string, args ...string) int {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		testreq.Skip(t, "python3", "the socket tests run python3 programs: %v", err)
	}
	out, err := os.Create(filepath.Join(dir, "daemon.out"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	cmd := exec.Command(py, args...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	go func() { _ = cmd.Wait() }()
	t.Cleanup(func() {
		if stats, err := proc.Tree(pid); err == nil {
			_ = proc.Kill(proc.PIDs(stats), 10*time.Second)
		}
		reapZombies()
	})
	return pid
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// get fetches url within a few seconds; it returns the status and body, or the error.
func get(url string) (int, string, error) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// TestListeningSocket checkpoints an HTTP server (python3 -m http.server) with its listening TCP
// socket, which ends it, restores it, and fetches a file from it: the restored server answers.
func TestListeningSocket(t *testing.T) {
	f := setup(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "hello.txt"), []byte("hello from before the checkpoint\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	pid := startDaemon(t, dir, "-m", "http.server", "--bind", "127.0.0.1", strconv.Itoa(port))
	url := fmt.Sprintf("http://127.0.0.1:%d/hello.txt", port)
	var code int
	var err error
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if code, _, err = get(url); err == nil {
			break
		}
	}
	if code != http.StatusOK {
		t.Fatalf("the server does not answer before the checkpoint: %d %v", code, err)
	}
	if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: "http", StagingRoot: f.stage}); err != nil {
		t.Fatalf("checkpoint of a listening server: %v", err)
	}
	waitGone(t, pid)
	if _, _, err := get(url); err == nil {
		t.Fatal("the server still answers after a checkpoint that ended it")
	}
	r := f.restore(t, "http")
	if r.PID != pid {
		t.Fatalf("restored pid %d, want %d", r.PID, pid)
	}
	code, body, err := get(url)
	if err != nil || code != http.StatusOK || body != "hello from before the checkpoint\n" {
		t.Fatalf("the restored server: %d %q %v", code, body, err)
	}
}

// pingPong is a tree holding both ends of an established loopback TCP connection: the parent
// serves, its child connects; they pass a counter back and forth (each checks it got what it
// sent plus one, or exits), and the parent writes the count to a file every 200 round trips.
const pingPong = `import os, socket, sys, time
state = sys.argv[1]
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.bind(("127.0.0.1", 0)); srv.listen(1)
port = srv.getsockname()[1]
if os.fork() == 0:
    srv.close()
    c = socket.create_connection(("127.0.0.1", port))
    while True:
        b = c.recv(8)
        if len(b) != 8:
            os._exit(3)
        c.sendall((int.from_bytes(b, "big") + 1).to_bytes(8, "big"))
conn, _ = srv.accept()
srv.close()
n = 0
while True:
    conn.sendall(n.to_bytes(8, "big"))
    b = b""
    while len(b) < 8:
        r = conn.recv(8 - len(b))
        if not r:
            sys.exit(4)
        b += r
    if int.from_bytes(b, "big") != n + 1:
        sys.exit(5)
    n += 2
    if n % 200 == 0:
        with open(state + ".tmp", "w") as f: f.write(str(n))
        os.replace(state + ".tmp", state)
    time.sleep(0.0005)
`

// TestEstablishedConnection checkpoints (--tcp-established) a tree holding both ends of a
// loopback TCP connection that carries a counter, once leaving it running and once ending it,
// and restores the image with no flag: the connection carries on from where it was, in order.
// CRIU blocks the connection meanwhile with the method this host has (nftables where CRIU can).
func TestEstablishedConnection(t *testing.T) {
	f := setup(t)
	dir := t.TempDir()
	script := filepath.Join(dir, "pingpong.py")
	if err := os.WriteFile(script, []byte(pingPong), 0o600); err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(dir, "count")
	pid := startDaemon(t, dir, script, state)
	waitCount(t, state, 400)
	res, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: "tcp-live", StagingRoot: f.stage,
		TCPEstablished: true, LeaveRunning: true})
	if err != nil {
		t.Fatalf("checkpoint --tcp-established --leave-running: %v", err)
	}
	if len(res.Tree) != 2 {
		t.Fatalf("checkpointed tree %+v, want the server and its client", res.Tree)
	}
	n := waitCount(t, state, readCount(state)+400) // carries on after a --leave-running checkpoint

	if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: "tcp", StagingRoot: f.stage,
		TCPEstablished: true}); err != nil {
		t.Fatalf("checkpoint --tcp-established: %v", err)
	}
	waitGone(t, pid)
	at := readCount(state)
	if at < n {
		t.Fatalf("count went back from %d to %d", n, at)
	}
	m, err := f.st.Get("tcp")
	if err != nil {
		t.Fatal(err)
	}
	d, err := imagedesc.Read(m)
	if err != nil || !d.TCPEstablished || (d.NetworkLock != criu.NetworkLockNftables &&
		d.NetworkLock != criu.NetworkLockIptables) {
		t.Fatalf("the image does not record its connections and their lock: %s (%v)", m.Meta, err)
	}
	r, err := restore.Run(context.Background(), f.env, restore.Options{Image: "tcp", StagingRoot: f.stage})
	if err != nil {
		t.Fatalf("restore of an image with established connections, no flag given: %v", err)
	}
	t.Cleanup(func() { _ = testproc.KillPID(r.PID, 10*time.Second) })
	waitCount(t, state, at+400) // carries on after the restore
	if !proc.Alive(pid) || len(proc.Children(pid)) != 1 {
		t.Fatalf("the restored tree lost a process: server alive %v, children %v", proc.Alive(pid), proc.Children(pid))
	}
	t.Logf("network lock %s; count %d at the checkpoint, carried on after the restore", d.NetworkLock, at)
}

// ioURingProgram creates an io_uring instance ("map": and maps its submission ring; "open": only
// keeps its descriptor), or, where io_uring_setup fails, carries on without one as libuv does.
// It writes what it got ("io_uring" or "errno N") and does so again at every SIGUSR1.
const ioURingProgram = `#include <errno.h>
#include <linux/io_uring.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
static volatile sig_atomic_t again;
static void on_usr1(int s) { (void)s; again = 1; }
static int try_setup(int map) {
  struct io_uring_params p;
  memset(&p, 0, sizeof p);
  int fd = (int)syscall(__NR_io_uring_setup, 4, &p);
  char b[32];
  int n = fd < 0 ? snprintf(b, sizeof b, "errno %d\n", errno) : snprintf(b, sizeof b, "io_uring\n");
  if (fd >= 0 && map &&
      mmap(0, p.sq_off.array + p.sq_entries * 4, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING) == MAP_FAILED)
    return 3;
  return write(1, b, n) == n ? 0 : 4;
}
int main(int argc, char **argv) {
  int map = argc > 1 && strcmp(argv[1], "map") == 0;
  signal(SIGUSR1, on_usr1);
  if (try_setup(map)) return 2;
  for (;;) {
    pause();
    if (again) { again = 0; if (try_setup(map)) return 2; }
  }
}
`

// denyIOURingEnv makes this test binary install seccomp.DenyIOURing and exec its arguments (as
// `ptxmig run --no-io-uring` does).
const denyIOURingEnv = "PTXMIG_TEST_DENY_IO_URING"

func denyIOURingExec() int {
	if _, err := seccomp.DenyIOURing(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	args := flagArgs(os.Args)
	err := syscall.Exec(args[0], args, os.Environ())
	fmt.Fprintln(os.Stderr, err)
	return 1
}

// flagArgs is what follows "--" in args.
func flagArgs(args []string) []string {
	for i, a := range args {
		if a == "--" {
			return args[i+1:]
		}
	}
	return nil
}

// startIOURing builds ioURingProgram and starts it (through the filter when deny), and waits for
// its first line.
func startIOURing(t *testing.T, mode string, deny bool) (pid int, outPath string) {
	t.Helper()
	dir := t.TempDir()
	src, bin := filepath.Join(dir, "uring.c"), filepath.Join(dir, "uring")
	if err := os.WriteFile(src, []byte(ioURingProgram), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("cc", "-O2", "-o", bin, src).CombinedOutput(); err != nil {
		testreq.Skip(t, "cc", "cannot build the io_uring program: %v\n%s", err, out)
	}
	outPath = filepath.Join(dir, "out")
	out, err := os.Create(outPath)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	cmd := exec.Command(bin, mode)
	if deny {
		cmd = exec.Command(os.Args[0], "-test.run=^$", "--", bin, mode)
		cmd.Env = append(os.Environ(), denyIOURingEnv+"=1")
	}
	var errb strings.Builder
	cmd.Stdout, cmd.Stderr, cmd.SysProcAttr = out, &errb, &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid = cmd.Process.Pid
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { _ = testproc.KillPID(pid, 10*time.Second) })
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if b, _ := os.ReadFile(outPath); strings.HasSuffix(string(b), "\n") {
			break
		}
		select {
		case err := <-exited:
			t.Fatalf("the io_uring program exited: %v\n%s", err, errb.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the io_uring program did not get ready")
		}
	}
	return pid, outPath
}

// TestIOURingRefused: CRIU cannot dump an io_uring instance (and a DDP job whose dump failed on
// one stopped making progress after the rollback): preflight refuses the tree, mapped or only
// open, with exit 3's error naming the way out, before anything is frozen.
func TestIOURingRefused(t *testing.T) {
	f := setup(t)
	for _, mode := range []string{"map", "open"} {
		t.Run(mode, func(t *testing.T) {
			pid, out := startIOURing(t, mode, false)
			if b, _ := os.ReadFile(out); string(b) != "io_uring\n" {
				t.Skipf("this kernel gives no io_uring (sysctl kernel.io_uring_disabled, seccomp): the program got %q", b)
			}
			_, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: "uring-" + mode, StagingRoot: f.stage})
			if !errors.Is(err, op.ErrRefused) || !strings.Contains(err.Error(), "io_uring") || !strings.Contains(err.Error(), "--no-io-uring") {
				t.Fatalf("checkpoint of a process with io_uring (%s): %v; want a refusal naming it and --no-io-uring", mode, err)
			}
			if s, err := proc.ReadStat(pid); err != nil || s.Stopped() {
				t.Fatalf("after the refusal the process is %+v (%v)", s, err)
			}
		})
	}
}

// TestIOURingDenied: the same program started under the filter of `ptxmig run --no-io-uring`
// gets ENOSYS and carries on without io_uring; it is checkpointed and restored by real CRIU, and
// after the restore io_uring_setup still fails: CRIU restored the filter with the process.
func TestIOURingDenied(t *testing.T) {
	f := setup(t)
	pid, out := startIOURing(t, "map", true)
	enosys := fmt.Sprintf("errno %d\n", int(syscall.ENOSYS))
	if b, _ := os.ReadFile(out); string(b) != enosys {
		t.Fatalf("under the filter the program got %q, want %q", b, enosys)
	}
	if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: "uring-denied", StagingRoot: f.stage}); err != nil {
		t.Fatalf("checkpoint of a process under the filter: %v", err)
	}
	if err := proc.WaitGone(context.Background(), pid, 10*time.Second); err != nil {
		t.Fatalf("the checkpointed process did not end: %v", err)
	}
	r, err := restore.Run(context.Background(), f.env, restore.Options{Image: "uring-denied", StagingRoot: f.stage})
	if err != nil {
		t.Fatalf("restore: %v", err)
	}
	if r.PID != pid {
		t.Fatalf("restored pid %d, want %d", r.PID, pid)
	}
	if err := syscall.Kill(pid, syscall.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		b, _ := os.ReadFile(out)
		if strings.Count(string(b), "\n") >= 2 {
			if string(b) != enosys+enosys {
				t.Fatalf("after the restore io_uring_setup gave %q, want ENOSYS again (the filter restored)", b)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the restored program did not answer SIGUSR1: %q", b)
		}
	}
}

// lingerServer listens on a port without SO_REUSEADDR and serves one connection per line it is
// sent ("pong"); it first connects to itself and closes the accepted side first, which leaves
// that connection in TIME_WAIT on its listening port for 60 s, as a job's closed bootstrap
// connections do.
const lingerServer = `import socket, sys, time
port = int(sys.argv[1])
l = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
l.bind(("127.0.0.1", port)); l.listen(4)
c = socket.create_connection(("127.0.0.1", port))
a, _ = l.accept()
a.close(); time.sleep(0.2); c.close()
print("ready", flush=True)
while True:
    a, _ = l.accept()
    a.recv(16); a.sendall(b"pong"); a.close()
`

// ping connects to the server on port and returns its answer.
func ping(port int) (string, error) {
	c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 3*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	return string(b), err
}

// TestListeningPortInTimeWait: a server whose listening socket lacks SO_REUSEADDR is checkpointed
// (which ends it) while a connection of its past lingers in TIME_WAIT on its port, where CRIU's
// bind would fail with EADDRINUSE: the restore ends the lingering connection, CRIU binds the
// port and the restored server answers. Checkpointed again, with another socket listening on
// the port, its restore is refused before anything is touched; once that is gone, it restores.
func TestListeningPortInTimeWait(t *testing.T) {
	f := setup(t)
	dir := t.TempDir()
	script := filepath.Join(dir, "linger.py")
	if err := os.WriteFile(script, []byte(lingerServer), 0o600); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	pid := startDaemon(t, dir, script, strconv.Itoa(port))
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if b, _ := os.ReadFile(filepath.Join(dir, "daemon.out")); strings.Contains(string(b), "ready") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the server did not start")
		}
	}
	if got, err := ping(port); err != nil || got != "pong" {
		t.Fatalf("the server before the checkpoint: %q %v", got, err)
	}
	if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: "linger", StagingRoot: f.stage}); err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	waitGone(t, pid)
	if tw, err := tcpdiag.List(uint16(port), tcpdiag.StateTimeWait); err != nil || len(tw) == 0 {
		t.Fatalf("no connection in TIME_WAIT on port %d after the checkpoint (%v): the test proves nothing", port, err)
	}

	r := f.restore(t, "linger")
	if r.ClosingEnded == 0 {
		t.Errorf("the restore ended no closing connection (result %+v)", r)
	}
	if got, err := ping(port); err != nil || got != "pong" {
		t.Fatalf("the restored server: %q %v", got, err)
	}

	// Another process's socket listens there: refused, nothing touched; then restored.
	if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: "linger-2", StagingRoot: f.stage}); err != nil {
		t.Fatalf("checkpoint of the restored server: %v", err)
	}
	waitGone(t, pid)
	tw, err := tcpdiag.List(uint16(port), tcpdiag.StateTimeWait) // our pings': they would hold the port against the listener
	for _, s := range tw {
		if err == nil {
			err = tcpdiag.Destroy(s)
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	_, err = restore.Run(context.Background(), f.env, restore.Options{Image: "linger-2", StagingRoot: f.stage})
	l.Close()
	if !errors.Is(err, op.ErrRefused) || !strings.Contains(err.Error(), fmt.Sprintf("127.0.0.1:%d", port)) ||
		!strings.Contains(err.Error(), "nothing was touched") {
		t.Fatalf("restore with the port taken: %v, want a refusal naming it", err)
	}
	if proc.Alive(pid) {
		t.Fatal("the refused restore started the process")
	}
	f.restore(t, "linger-2")
	if got, err := ping(port); err != nil || got != "pong" {
		t.Fatalf("the server restored after the refusal: %q %v", got, err)
	}
}
