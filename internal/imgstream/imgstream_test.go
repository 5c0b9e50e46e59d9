package imgstream

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protowire"
)

// The peer: this test binary re-executed as CRIU's stand-in (the server accepts only a process it
// started), playing one script against the socket.
const peerEnv = "IMGSTREAM_TEST_PEER"

func TestMain(m *testing.M) {
	if script := os.Getenv(peerEnv); script != "" {
		if err := peer(script, os.Getenv(peerEnv+"_SOCK")); err != nil {
			fmt.Fprintln(os.Stderr, "peer:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func request(name string) []byte {
	var msg []byte
	msg = protowire.AppendTag(msg, 1, protowire.BytesType)
	msg = protowire.AppendString(msg, name)
	return append(binary.LittleEndian.AppendUint32(nil, uint32(len(msg))), msg...)
}

// sendFD sends one byte carrying fds, as CRIU's send_fd does.
func sendFD(c *net.UnixConn, fds ...int) error {
	_, _, err := c.WriteMsgUnix([]byte{0}, unix.UnixRights(fds...), nil)
	return err
}

// readReply reads a restore reply and returns exists.
func readReply(c *net.UnixConn) (bool, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return false, err
	}
	msg := make([]byte, binary.LittleEndian.Uint32(hdr[:]))
	if _, err := io.ReadFull(c, msg); err != nil {
		return false, err
	}
	if len(msg) != 2 || msg[0] != 0x08 {
		return false, fmt.Errorf("reply %x", msg)
	}
	return msg[1] == 1, nil
}

// dumpFile asks to send name and returns the pipe's write end (the read end goes to the server).
func dumpFile(c *net.UnixConn, name string) (*os.File, error) {
	if _, err := c.Write(request(name)); err != nil {
		return nil, err
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer r.Close()
	return w, sendFD(c, int(r.Fd()))
}

func peer(script, sock string) error {
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return err
	}
	defer c.Close()
	switch script {
	case "capture": // two files written interleaved, a third empty
		a, err := dumpFile(c, "pages-1.img")
		if err != nil {
			return err
		}
		b, err := dumpFile(c, "pagemap-1.img")
		if err != nil {
			return err
		}
		e, err := dumpFile(c, "empty.img")
		if err != nil {
			return err
		}
		e.Close()
		for i := range 64 {
			if _, err := a.Write(bytes.Repeat([]byte{byte(i)}, 100_000)); err != nil {
				return err
			}
			if _, err := fmt.Fprintf(b, "entry %d\n", i); err != nil {
				return err
			}
		}
		a.Close()
		b.Close()
		return nil
	case "sink-fails": // the server's sink fails: writing on gets EPIPE
		a, err := dumpFile(c, "pages-1.img")
		if err != nil {
			return err
		}
		for range 1000 {
			if _, err := a.Write(make([]byte, 65536)); err != nil {
				if errors.Is(err, syscall.EPIPE) {
					return nil
				}
				return err
			}
		}
		return errors.New("no EPIPE after 64 MB")
	case "bad-name":
		_, err := c.Write(request("../../etc/shadow"))
		return err
	case "control-char":
		_, err := c.Write(request("core\x1b[2J.img"))
		return err
	case "huge-request":
		_, err := c.Write(binary.LittleEndian.AppendUint32(nil, 1<<20))
		return err
	case "no-name":
		_, err := c.Write(binary.LittleEndian.AppendUint32([]byte{}, 2))
		if err == nil {
			_, err = c.Write([]byte{0x10, 0x01}) // field 2, varint
		}
		return err
	case "duplicate":
		for range 2 {
			w, err := dumpFile(c, "core-1.img")
			if err != nil {
				return err
			}
			w.Close()
		}
		return nil
	case "not-a-pipe":
		if _, err := c.Write(request("core-1.img")); err != nil {
			return err
		}
		f, err := os.Open("/etc/hostname")
		if err != nil {
			return err
		}
		return sendFD(c, int(f.Fd()))
	case "wrong-direction":
		if _, err := c.Write(request("core-1.img")); err != nil {
			return err
		}
		r, w, err := os.Pipe()
		if err != nil {
			return err
		}
		defer r.Close()
		return sendFD(c, int(w.Fd()))
	case "two-fds":
		if _, err := c.Write(request("core-1.img")); err != nil {
			return err
		}
		r, w, err := os.Pipe()
		if err != nil {
			return err
		}
		return sendFD(c, int(r.Fd()), int(w.Fd()))
	case "cut":
		_, err := c.Write(request("core-1.img")[:5])
		return err
	case "serve": // one file read whole, one missing, one left early
		for _, name := range []string{"pages-1.img", "missing.img", "big.img"} {
			if _, err := c.Write(request(name)); err != nil {
				return err
			}
			ok, err := readReply(c)
			if err != nil {
				return err
			}
			if !ok {
				if name != "missing.img" {
					return fmt.Errorf("%s reported missing", name)
				}
				continue
			}
			r, w, err := os.Pipe()
			if err != nil {
				return err
			}
			if err := sendFD(c, int(w.Fd())); err != nil {
				return err
			}
			w.Close()
			if name == "big.img" {
				buf := make([]byte, 10)
				_, err := io.ReadFull(r, buf)
				r.Close() // CRIU read what it needed
				if err != nil {
					return err
				}
				continue
			}
			b, err := io.ReadAll(r)
			r.Close()
			if err != nil {
				return err
			}
			if string(b) != "pages of "+name {
				return fmt.Errorf("served %q", b)
			}
		}
		return nil
	case "serve-corrupt":
		if _, err := c.Write(request("pages-1.img")); err != nil {
			return err
		}
		if ok, err := readReply(c); err != nil || !ok {
			return fmt.Errorf("reply %v %v", ok, err)
		}
		r, w, err := os.Pipe()
		if err != nil {
			return err
		}
		if err := sendFD(c, int(w.Fd())); err != nil {
			return err
		}
		w.Close()
		b, _ := io.ReadAll(r)
		if len(b) != 4 {
			return fmt.Errorf("read %d bytes of a file whose second part is corrupt", len(b))
		}
		return nil
	}
	return fmt.Errorf("unknown script %q", script)
}

// startPeer runs the peer script against srv.
func startPeer(t *testing.T, srv *Server, script string) func() error {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), peerEnv+"="+script, peerEnv+"_SOCK="+srv.Path())
	var out bytes.Buffer
	cmd.Stderr = &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return func() error {
		if err := cmd.Wait(); err != nil {
			return fmt.Errorf("%w: %s", err, out.String())
		}
		return nil
	}
}

// listen opens a server socket in a fresh directory, closed when the test ends.
func listen(t *testing.T, mode Mode) *Server {
	t.Helper()
	srv, err := Listen(t.TempDir(), mode)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv
}

type memFiles struct {
	mu    sync.Mutex
	files map[string][]byte
}

func (m *memFiles) sink(name string, r io.Reader) error {
	b, err := io.ReadAll(r)
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.files == nil {
		m.files = map[string][]byte{}
	}
	m.files[name] = b
	return err
}

func TestCapture(t *testing.T) {
	srv := listen(t, Capture)
	if fi, err := os.Stat(srv.Path()); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket %v, %v: want owner-only", fi.Mode(), err)
	}
	wait := startPeer(t, srv, "capture")
	var m memFiles
	st, err := srv.Capture(context.Background(), m.sink)
	if perr := wait(); perr != nil {
		t.Fatal(perr)
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(m.files["pages-1.img"]) != 6_400_000 || !strings.HasPrefix(string(m.files["pagemap-1.img"]), "entry 0\nentry 1\n") ||
		m.files["empty.img"] == nil || len(m.files["empty.img"]) != 0 {
		t.Fatalf("files %d %q %v", len(m.files["pages-1.img"]), m.files["pagemap-1.img"][:16], m.files["empty.img"])
	}
	if st.Files != 3 || st.Bytes != int64(6_400_000+len(m.files["pagemap-1.img"])) {
		t.Fatalf("stats %+v", st)
	}
	if _, err := os.Stat(srv.Path()); !os.IsNotExist(err) {
		t.Errorf("socket left behind: %v", err)
	}
}

// TestCaptureRefusesHostilePeers: every malformed request ends the capture with a protocol error
// naming the problem, and no descriptor is kept.
func TestCaptureRefusesHostilePeers(t *testing.T) {
	tests := []struct {
		script, want string
	}{
		{"bad-name", "has a '/'"},
		{"control-char", "control character"},
		{"huge-request", "request of 1048576 bytes"},
		{"no-name", "without a file name"},
		{"duplicate", "sent twice"},
		{"not-a-pipe", "not a pipe end"},
		{"wrong-direction", "not a pipe end"},
		{"two-fds", "2 descriptors"},
		{"cut", "unexpected EOF"},
	}
	for _, tt := range tests {
		t.Run(tt.script, func(t *testing.T) {
			srv := listen(t, Capture)
			fds := openFDs(t)
			wait := startPeer(t, srv, tt.script)
			var m memFiles
			_, err := srv.Capture(context.Background(), m.sink)
			_ = wait() // the peer may see its connection cut
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want %q", err, tt.want)
			}
			if tt.script != "cut" && !errors.Is(err, ErrProtocol) {
				t.Errorf("%v is not ErrProtocol", err)
			}
			if n := openFDs(t); n > fds {
				t.Errorf("%d descriptors open after, %d before", n, fds)
			}
		})
	}
}

func openFDs(t *testing.T) int {
	t.Helper()
	time.Sleep(20 * time.Millisecond) // let closed pipes' goroutines finish
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func TestCaptureSinkFailureBreaksThePipe(t *testing.T) {
	srv := listen(t, Capture)
	wait := startPeer(t, srv, "sink-fails")
	boom := errors.New("store full")
	_, err := srv.Capture(context.Background(), func(name string, r io.Reader) error {
		_, _ = io.CopyN(io.Discard, r, 1<<20)
		return boom
	})
	if !errors.Is(err, boom) || !strings.Contains(err.Error(), "pages-1.img") {
		t.Fatalf("err = %v", err)
	}
	if perr := wait(); perr != nil {
		t.Fatalf("peer did not see a broken pipe: %v", perr)
	}
}

// TestRefusesStrangers: a process the server did not start may not connect.
func TestRefusesStrangers(t *testing.T) {
	srv := listen(t, Capture)
	go func() {
		c, err := net.Dial("unix", srv.Path())
		if err == nil {
			defer c.Close()
			_, _ = c.Write(request("core-1.img"))
			time.Sleep(100 * time.Millisecond)
		}
	}()
	_, err := srv.Capture(context.Background(), (&memFiles{}).sink)
	if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "not a process ptxmig started") {
		t.Fatalf("err = %v", err)
	}
}

func TestCaptureCancelledBeforeConnect(t *testing.T) {
	srv := listen(t, Capture)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := srv.Capture(ctx, (&memFiles{}).sink); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v", err)
	}
}

// TestListenLongPath: a directory whose socket path exceeds a Unix socket address still works
// (bound through a descriptor), and the socket is removed by its real path.
func TestListenLongPath(t *testing.T) {
	dir := t.TempDir() + "/" + strings.Repeat("d", 100)
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if !TooLong(dir) {
		t.Fatal("TooLong false for a 100-byte directory name")
	}
	srv, err := Listen(dir, Capture)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(srv.Path()); err != nil || fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket at %s: %v %v", srv.Path(), fi, err)
	}
	srv.Close()
	if _, err := os.Lstat(srv.Path()); !os.IsNotExist(err) {
		t.Fatalf("socket left: %v", err)
	}
}

type memSource struct {
	files   map[string]string
	corrupt string // a file whose bytes after the 4th fail
}

func (m memSource) Has(name string) bool { _, ok := m.files[name]; return ok }

func (m memSource) WriteFile(_ context.Context, name string, w io.Writer) (int64, error) {
	data := m.files[name]
	if name == m.corrupt {
		n, err := io.WriteString(w, data[:4])
		if err != nil {
			return int64(n), err
		}
		return int64(n), errors.New("chunk corrupt at offset 4")
	}
	var total int64
	for len(data) > 0 { // in pieces, so a reader that leaves early is noticed
		k := min(len(data), 4096)
		n, err := io.WriteString(w, data[:k])
		total += int64(n)
		if err != nil {
			return total, err
		}
		data = data[k:]
	}
	return total, nil
}

func TestServe(t *testing.T) {
	srv := listen(t, Serve)
	wait := startPeer(t, srv, "serve")
	st, err := srv.Serve(context.Background(), memSource{files: map[string]string{
		"pages-1.img": "pages of pages-1.img",
		"big.img":     strings.Repeat("x", 8<<20), // more than a pipe holds: the reader leaves early
	}})
	if perr := wait(); perr != nil {
		t.Fatal(perr)
	}
	if err != nil {
		t.Fatal(err)
	}
	if st.Files != 2 || st.Missing != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestServeCorruptFileFailsTheRead(t *testing.T) {
	srv := listen(t, Serve)
	wait := startPeer(t, srv, "serve-corrupt")
	_, err := srv.Serve(context.Background(), memSource{files: map[string]string{"pages-1.img": "12345678"}, corrupt: "pages-1.img"})
	if perr := wait(); perr != nil {
		t.Fatal(perr)
	}
	if err == nil || !strings.Contains(err.Error(), "pages-1.img") || !strings.Contains(err.Error(), "corrupt") {
		t.Fatalf("err = %v", err)
	}
}

func TestValidName(t *testing.T) {
	for _, name := range []string{"core-1.img", "pages-12.img", "tmpfs-dev-65.tar.gz.img", "ghost-file-0x1.img"} {
		if err := ValidName(name); err != nil {
			t.Errorf("%q: %v", name, err)
		}
	}
	for _, name := range []string{"", ".", "..", "a/b", "\x00", strings.Repeat("a", 256), "\xff", CaptureSocket} {
		if err := ValidName(name); !errors.Is(err, ErrProtocol) {
			t.Errorf("%q accepted", name)
		}
	}
}
