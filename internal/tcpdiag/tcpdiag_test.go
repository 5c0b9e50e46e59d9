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

// closing leaves a loopback connection (network tcp4 or tcp6 on host) closing on a listener's
// port and returns the port, the
// listener closed: the side that accepted closes first, and the client closes too (TIME_WAIT) or
// keeps its end open (FIN_WAIT2, the accepted side orphaned) until the test ends.
func closing(t *testing.T, network, host string, clientCloses bool) uint16 {
	t.Helper()
	l, err := net.Listen(network, net.JoinHostPort(host, "0"))
	if err != nil {
		testreq.Skip(t, "ipv6", "%s: %v", network, err) // only IPv6 can be missing here
	}
	defer l.Close()
	c, err := net.Dial(network, l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	a, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	time.Sleep(50 * time.Millisecond) // the FIN reaches the client
	if clientCloses {
		c.Close()
	} else {
		t.Cleanup(func() { c.Close() })
	}
	return uint16(l.Addr().(*net.TCPAddr).Port)
}

// bindPlain binds a TCP socket to host:port (127.0.0.1 or ::1) without SO_REUSEADDR, as CRIU
// restores a listening socket of an application that did not set it.
func bindPlain(host string, port uint16) error {
	fam, sa := unix.AF_INET, unix.Sockaddr(&unix.SockaddrInet4{Port: int(port), Addr: [4]byte{127, 0, 0, 1}})
	if host == "::1" {
		fam, sa = unix.AF_INET6, &unix.SockaddrInet6{Port: int(port), Addr: [16]byte{15: 1}}
	}
	fd, err := unix.Socket(fam, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Bind(fd, sa)
}

// TestEndClosing: a connection closing on a port (TIME_WAIT, or FIN_WAIT2 while its peer keeps
// its end open) is listed among the Closing states (local and remote address, state, no inode),
// makes a plain bind of the port fail with EADDRINUSE, and once ended by Destroy the bind
// succeeds; ending it again is not an error.
func TestEndClosing(t *testing.T) {
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "ending sockets needs CAP_NET_ADMIN")
	}
	for _, tt := range []struct {
		name, network, host string
		clientCloses        bool
		state               int
	}{
		{"TIME_WAIT", "tcp4", "127.0.0.1", true, StateTimeWait},
		{"FIN_WAIT2", "tcp4", "127.0.0.1", false, StateFinWait2},
		{"TIME_WAIT over IPv6", "tcp6", "::1", true, StateTimeWait},
	} {
		t.Run(tt.name, func(t *testing.T) {
			port := closing(t, tt.network, tt.host, tt.clientCloses)
			var got []Socket
			for deadline := time.Now().Add(5 * time.Second); len(got) == 0 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
				var err error
				if got, err = List(port, Closing...); err != nil {
					t.Fatal(err)
				}
			}
			if len(got) != 1 {
				t.Fatalf("closing sockets on port %d: %v, want 1", port, got)
			}
			s := got[0]
			if s.State != tt.state || s.Local.Addr().String() != tt.host || s.Local.Port() != port || s.Remote.Port() == 0 || s.Inode != 0 {
				t.Fatalf("listed %+v (%s), want %s with no inode", s, s, tt.name)
			}
			if err := bindPlain(tt.host, port); !errors.Is(err, unix.EADDRINUSE) {
				t.Fatalf("bind of a port with a connection in %s: %v, want EADDRINUSE", tt.name, err)
			}
			if err := Destroy(s); errors.Is(err, ErrNotSupported) {
				testreq.Skip(t, "sock-destroy", "%v", err)
			} else if err != nil {
				t.Fatal(err)
			}
			if left, err := List(port, Closing...); err != nil || len(left) != 0 {
				t.Fatalf("after Destroy: %v %v", left, err)
			}
			if err := bindPlain(tt.host, port); err != nil {
				t.Fatalf("bind after the %s socket was ended: %v", tt.name, err)
			}
			if err := Destroy(s); err != nil {
				t.Fatalf("ending it again: %v", err)
			}
		})
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
