package tcpdiag

import (
	"errors"
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/testreq"
)

// timeWait leaves a loopback connection in TIME_WAIT on a listener's port (the side that accepted
// closes first) and returns the port, the listener closed.
func timeWait(t *testing.T) uint16 {
	t.Helper()
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := net.Dial("tcp4", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	a, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	time.Sleep(50 * time.Millisecond) // the FIN reaches the client
	c.Close()
	return uint16(l.Addr().(*net.TCPAddr).Port)
}

// bindPlain binds a TCP socket to 127.0.0.1:port without SO_REUSEADDR, as CRIU restores a
// listening socket of an application that did not set it.
func bindPlain(port uint16) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Bind(fd, &unix.SockaddrInet4{Port: int(port), Addr: [4]byte{127, 0, 0, 1}})
}

// TestEndTimeWait: a connection in TIME_WAIT on a port is listed (local and remote address,
// state, no inode), makes a plain bind of the port fail with EADDRINUSE, and once ended by
// Destroy the bind succeeds; ending it again is not an error.
func TestEndTimeWait(t *testing.T) {
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "ending sockets needs CAP_NET_ADMIN")
	}
	port := timeWait(t)
	var tw []Socket
	for deadline := time.Now().Add(5 * time.Second); len(tw) == 0 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		var err error
		if tw, err = List(port, StateTimeWait); err != nil {
			t.Fatal(err)
		}
	}
	if len(tw) != 1 {
		t.Fatalf("TIME_WAIT sockets on port %d: %v, want 1", port, tw)
	}
	s := tw[0]
	if s.State != StateTimeWait || s.Local.Addr().String() != "127.0.0.1" || s.Local.Port() != port || s.Remote.Port() == 0 || s.Inode != 0 {
		t.Fatalf("listed %+v (%s)", s, s)
	}
	if err := bindPlain(port); !errors.Is(err, unix.EADDRINUSE) {
		t.Fatalf("bind of a port with a connection in TIME_WAIT: %v, want EADDRINUSE", err)
	}
	if err := Destroy(s); errors.Is(err, ErrNotSupported) {
		testreq.Skip(t, "sock-destroy", "%v", err)
	} else if err != nil {
		t.Fatal(err)
	}
	if left, err := List(port, StateTimeWait); err != nil || len(left) != 0 {
		t.Fatalf("after Destroy: %v %v", left, err)
	}
	if err := bindPlain(port); err != nil {
		t.Fatalf("bind after the TIME_WAIT socket was ended: %v", err)
	}
	if err := Destroy(s); err != nil {
		t.Fatalf("ending it again: %v", err)
	}
}

// TestListListening: a listening socket is listed with its inode; states out of range are refused.
func TestListListening(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	port := uint16(l.Addr().(*net.TCPAddr).Port)
	got, err := List(port, StateListen)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].State != StateListen || got[0].Inode == 0 || got[0].String() != "127.0.0.1:"+strconv.Itoa(int(port))+" -> 0.0.0.0:0 (LISTEN)" {
		t.Fatalf("listening sockets on %d: %v", port, got)
	}
	if _, err := List(port, 32); err == nil {
		t.Fatal("state 32 accepted")
	}
}

// TestParseRejects: a reply too short or of an unknown family is an error, not a socket.
func TestParseRejects(t *testing.T) {
	if _, err := parse(make([]byte, msgLen-1)); err == nil {
		t.Error("short message accepted")
	}
	b := make([]byte, msgLen)
	b[0] = 99
	if _, err := parse(b); err == nil {
		t.Error("family 99 accepted")
	}
}
