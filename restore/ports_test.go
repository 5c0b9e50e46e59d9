package restore

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/hostreq"
	"github.com/ptxmig/ptxmig/internal/tcpdiag"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

// pair connects to l and returns both ends.
func pair(t *testing.T, l net.Listener) (client, server net.Conn) {
	t.Helper()
	c, err := net.Dial("tcp4", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	return c, s
}

// timeWaitOn leaves a connection in TIME_WAIT on l's port (the accepted side closes first).
func timeWaitOn(t *testing.T, l net.Listener) {
	t.Helper()
	c, s := pair(t, l)
	s.Close()
	time.Sleep(50 * time.Millisecond)
	c.Close()
}

// TestFreePortsEndsOnlyClosingConnections: on the image's listening port, freePorts ends the
// connection in TIME_WAIT and leaves alone the connections a process still holds on the same
// port (one open, one it half-closed, FIN_WAIT2 like an orphan), which carry data after; a
// closing connection on another port is not touched either.
func TestFreePortsEndsOnlyClosingConnections(t *testing.T) {
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "ending sockets needs CAP_NET_ADMIN")
	}
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	other, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	port := uint16(l.Addr().(*net.TCPAddr).Port)
	otherPort := uint16(other.Addr().(*net.TCPAddr).Port)
	timeWaitOn(t, l)
	timeWaitOn(t, other)
	live, liveServer := pair(t, l) // held by this process: never ended
	defer live.Close()
	defer liveServer.Close()
	// Half-closed by a process that still holds it: FIN_WAIT2 like an orphan, but with an inode.
	half, halfServer := pair(t, l)
	defer half.Close()
	defer halfServer.Close()
	if err := halfServer.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		held := 0
		if got, err := tcpdiag.List(port, tcpdiag.StateFinWait2); err == nil {
			for _, s := range got {
				if s.Inode != 0 {
					held++
				}
			}
		}
		if held == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no half-closed connection held by this process in FIN_WAIT2: the test proves nothing")
		}
	}

	ls := []hostreq.Listener{{Addr: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port)}}
	ended, err := freePorts(context.Background(), slog.New(slog.NewTextHandler(io.Discard, nil)), ls)
	if err != nil {
		t.Fatal(err)
	}
	if ended != 1 {
		t.Fatalf("ended %d connections, want the one in TIME_WAIT on port %d", ended, port)
	}
	if left, err := tcpdiag.List(port, tcpdiag.Closing...); err != nil || len(left) != 1 || left[0].Inode == 0 {
		t.Fatalf("closing connections left on port %d: %v %v, want only the half-closed one this process holds", port, left, err)
	}
	if left, err := tcpdiag.List(otherPort, tcpdiag.Closing...); err != nil || len(left) != 1 {
		t.Fatalf("closing connections on the other port %d: %v %v, want its one left alone", otherPort, left, err)
	}
	// The live connection on the port still carries data both ways.
	_ = live.SetDeadline(time.Now().Add(3 * time.Second))
	_ = liveServer.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := live.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	if _, err := io.ReadFull(liveServer, b); err != nil || string(b) != "ping" {
		t.Fatalf("the live connection after freePorts: %q %v", b, err)
	}
	_ = half.SetDeadline(time.Now().Add(3 * time.Second))
	_ = halfServer.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := half.Write([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(halfServer, b); err != nil || string(b) != "pong" {
		t.Fatalf("the half-closed connection after freePorts: %q %v", b, err)
	}
}
