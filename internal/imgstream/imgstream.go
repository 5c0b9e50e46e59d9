// Package imgstream serves CRIU's image-streamer socket, so that CRIU's image files flow
// between CRIU and ptxmig's store over pipes instead of through a directory.
//
// The protocol (CRIU's criu/img-streamer.c, `criu dump|restore --stream`): CRIU connects to
// DIR/streamer-capture.sock (dump) or DIR/streamer-serve.sock (restore), one stream connection
// for the whole operation (its forked restorers share it under a lock). For every image file it
// sends a request — a little-endian u32 length and an img_streamer_request_entry protobuf
// holding the file name — and then one byte carrying a pipe end (SCM_RIGHTS). On dump that is
// the read end: CRIU writes the file into the pipe and closes it. On restore the streamer first
// answers an img_streamer_reply_entry (u32 length, protobuf) saying whether the file exists;
// only if it does does CRIU send the write end, into which the streamer writes the file. CRIU
// closes the connection when it needs no more files.
//
// Everything read from the socket is validated: the peer must be a process this one started,
// running as this user; requests are bounded; names are plain file names; a received descriptor
// must be a pipe end of the right direction.
package imgstream

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protowire"
)

// Socket names CRIU connects to inside its images directory.
const (
	CaptureSocket = "streamer-capture.sock"
	ServeSocket   = "streamer-serve.sock"
)

// Limits on what a peer may send.
const (
	MaxName     = 255     // bytes of a file name
	MaxFiles    = 1 << 16 // files per operation
	maxRequest  = 4096    // bytes of one request message
	maxOOB      = 64      // room for a few descriptors per read
	pipeSize    = 1 << 20 // pipe buffer asked for (the default 64 KiB costs a wakeup per 64 KiB)
	sunPathSize = 108     // sizeof(sockaddr_un.sun_path)
)

// ErrNoPeer means the socket was closed before CRIU connected (it failed, or was not told to
// stream).
var ErrNoPeer = errors.New("no streamer connection")

// ErrProtocol marks anything the peer sent that the protocol does not allow.
var ErrProtocol = errors.New("image streamer protocol violation")

// Mode is the direction of a stream.
type Mode int

// Modes: Capture receives a dump's files, Serve sends a restore's.
const (
	Capture Mode = iota
	Serve
)

func (m Mode) socket() string {
	if m == Serve {
		return ServeSocket
	}
	return CaptureSocket
}

// Stats counts what crossed the socket.
type Stats struct {
	Files   int   `json:"files"`
	Missing int   `json:"missing,omitempty"` // restore: files CRIU asked for that the image does not hold
	Bytes   int64 `json:"bytes"`
}

// Server is one listening streamer socket, for one CRIU operation.
type Server struct {
	mode  Mode
	ln    *net.UnixListener
	path  string
	once  sync.Once
	moved atomic.Int64 // bytes received (as they arrive) or served (once each file is done)
}

// Listen creates the socket for mode in dir (owner-only). CRIU must be started after Listen
// returns; the socket is removed by Close.
func Listen(dir string, mode Mode) (*Server, error) {
	path := filepath.Join(dir, mode.socket())
	addr := path
	if TooLong(dir) {
		// Bind through the directory's descriptor: /proc/self/fd/N/NAME fits any directory.
		d, err := os.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
		if err != nil {
			return nil, fmt.Errorf("image streamer socket: %w", err)
		}
		defer d.Close()
		addr = fmt.Sprintf("/proc/self/fd/%d/%s", d.Fd(), mode.socket())
	}
	// dir is private to ptxmig (0700), so nobody reaches the socket before it is made owner-only
	// (a process-wide umask would race with other goroutines creating files).
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: addr, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("image streamer socket %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		os.Remove(path)
		return nil, fmt.Errorf("image streamer socket %s: %w", path, err)
	}
	// Removed by path on Close (the descriptor used to bind is gone by then).
	ln.SetUnlinkOnClose(false)
	return &Server{mode: mode, ln: ln, path: path}, nil
}

// TooLong reports whether a streamer socket in dir has a path longer than a Unix socket address
// holds (107 bytes): then it must be reached through a descriptor of dir (/proc/self/fd/N/...),
// as Listen does and CRIU is told to.
func TooLong(dir string) bool {
	return len(filepath.Join(dir, CaptureSocket)) >= sunPathSize || len(filepath.Join(dir, ServeSocket)) >= sunPathSize
}

// Path is the socket's path.
func (s *Server) Path() string { return s.path }

// Close stops listening and removes the socket. A connection already accepted stays open, so
// closing once CRIU has exited ends a Capture or Serve that is still waiting for it.
func (s *Server) Close() error {
	s.once.Do(func() {
		s.ln.Close()
		os.Remove(s.path)
	})
	return nil
}

// accept waits for CRIU's connection until ctx ends, then stops listening (one connection per
// operation) and checks the peer.
func (s *Server) accept(ctx context.Context) (*net.UnixConn, error) {
	stop := context.AfterFunc(ctx, func() { s.Close() })
	c, err := s.ln.AcceptUnix()
	stop()
	s.Close()
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("no connection from CRIU: %w", context.Cause(ctx))
		}
		if errors.Is(err, net.ErrClosed) {
			return nil, fmt.Errorf("%w: CRIU never connected to %s", ErrNoPeer, s.path)
		}
		return nil, fmt.Errorf("accept on %s: %w", s.path, err)
	}
	if err := checkPeer(c); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// checkPeer accepts only a process this one started (CRIU is ptxmig's child), of the same user.
func checkPeer(c *net.UnixConn) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if cerr != nil {
		return fmt.Errorf("image streamer peer credentials: %w", cerr)
	}
	if int(cred.Uid) != os.Geteuid() {
		return fmt.Errorf("%w: peer pid %d runs as uid %d, not %d", ErrProtocol, cred.Pid, cred.Uid, os.Geteuid())
	}
	if pp := parentOf(int(cred.Pid)); pp != os.Getpid() {
		return fmt.Errorf("%w: peer pid %d is not a process ptxmig started (its parent is %d)", ErrProtocol, cred.Pid, pp)
	}
	return nil
}

// parentOf reads a process's parent pid (-1 when it cannot).
func parentOf(pid int) int {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return -1
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return -1
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 2 {
		return -1
	}
	pp, err := strconv.Atoi(f[1])
	if err != nil {
		return -1
	}
	return pp
}

// Capture accepts CRIU's connection and receives the files of a dump. Each file's bytes go to
// sink, called in a goroutine of its own (CRIU writes several files at once): sink must read r
// to its end or return an error. An error of sink, or of the connection, closes every pipe, so
// CRIU fails instead of waiting. Capture returns once CRIU has closed its connection and every
// sink has returned, with the first error. Cancelling ctx aborts it.
func (s *Server) Capture(ctx context.Context, sink func(name string, r io.Reader) error) (Stats, error) {
	if s.mode != Capture {
		return Stats{}, errors.New("imgstream: Capture on a serve socket")
	}
	return s.run(ctx, func(ctx context.Context, name string, f *os.File, st *stats) error {
		return sink(name, &countingReader{r: f, n: &s.moved})
	})
}

// Source is what Serve reads files from.
type Source interface {
	// Has reports whether the image holds a regular file name.
	Has(name string) bool
	// WriteFile writes the file's bytes, in order, to w.
	WriteFile(ctx context.Context, name string, w io.Writer) (int64, error)
}

// Serve accepts CRIU's connection and serves the files of a restore from src. A file CRIU stops
// reading early (it closed its end) is not an error. An error of src (a corrupt chunk) closes
// that file's pipe, so CRIU fails on a short read before the restored processes run, and is
// returned. Serve returns once CRIU has closed its connection and every file is done.
func (s *Server) Serve(ctx context.Context, src Source) (Stats, error) {
	if s.mode != Serve {
		return Stats{}, errors.New("imgstream: Serve on a capture socket")
	}
	return s.run(ctx, func(ctx context.Context, name string, f *os.File, st *stats) error {
		n, err := src.WriteFile(ctx, name, f)
		s.moved.Add(n)
		if errors.Is(err, syscall.EPIPE) {
			return nil // CRIU read what it needed
		}
		return err
	}, src)
}

type stats struct {
	files, missing int
}

type countingReader struct {
	r io.Reader
	n *atomic.Int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n.Add(int64(n))
	return n, err
}

// Moved is how many bytes have moved so far: read while Capture runs, it is CRIU's progress.
func (s *Server) Moved() int64 { return s.moved.Load() }

// run is the connection loop shared by both modes: requests are read one after the other, each
// file is handled in its own goroutine by xfer.
func (s *Server) run(ctx context.Context, xfer func(context.Context, string, *os.File, *stats) error, src ...Source) (Stats, error) {
	c, err := s.accept(ctx)
	if err != nil {
		return Stats{}, err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	defer c.Close()

	var (
		st    stats
		wg    sync.WaitGroup
		mu    sync.Mutex
		open  = map[*os.File]bool{}
		seen  = map[string]bool{}
		first error
	)
	fail := func(err error) {
		mu.Lock()
		if first == nil {
			first = err
			for f := range open {
				f.Close() // CRIU sees a broken pipe instead of waiting
			}
		}
		mu.Unlock()
		cancel(err)
	}
	r := &msgReader{c: c}
	defer r.closeFDs()
	for {
		name, err := r.request()
		if err == io.EOF {
			break // CRIU needs no more files
		}
		if err != nil {
			if ctx.Err() != nil {
				err = context.Cause(ctx)
			}
			fail(err)
			break
		}
		if s.mode == Capture && seen[name] {
			fail(fmt.Errorf("%w: file %q sent twice", ErrProtocol, name))
			break
		}
		if len(seen) >= MaxFiles {
			fail(fmt.Errorf("%w: more than %d files", ErrProtocol, MaxFiles))
			break
		}
		seen[name] = true
		if s.mode == Serve && len(r.fds) > 0 {
			// CRIU sends a pipe only after the reply: descriptors with a request are not allowed.
			fail(fmt.Errorf("%w: descriptors sent with the request for %q", ErrProtocol, name))
			break
		}
		if s.mode == Serve {
			exists := src[0].Has(name)
			if err := r.reply(exists); err != nil {
				fail(err)
				break
			}
			if !exists {
				st.missing++
				continue
			}
		}
		f, err := r.pipe(s.mode)
		if err != nil {
			fail(fmt.Errorf("file %q: %w", name, err))
			break
		}
		st.files++
		mu.Lock()
		if first != nil {
			mu.Unlock()
			f.Close()
			break
		}
		open[f] = true
		mu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := xfer(ctx, name, f, &st)
			mu.Lock()
			if open[f] {
				delete(open, f)
				f.Close()
			}
			mu.Unlock()
			if err != nil {
				fail(fmt.Errorf("image file %s: %w", name, err))
			}
		}()
	}
	wg.Wait()
	out := Stats{Files: st.files, Missing: st.missing, Bytes: s.moved.Load()}
	mu.Lock()
	defer mu.Unlock()
	if first != nil {
		return out, first
	}
	if ctx.Err() != nil {
		return out, context.Cause(ctx)
	}
	return out, nil
}

// msgReader reads CRIU's messages off the stream socket: bytes and the descriptors that came
// with them.
type msgReader struct {
	c   *net.UnixConn
	buf []byte
	fds []int
	tmp [maxRequest + 8]byte
	oob [maxOOB]byte
}

func (r *msgReader) fill() error {
	n, oobn, flags, _, err := r.c.ReadMsgUnix(r.tmp[:], r.oob[:])
	n, oobn = max(n, 0), max(oobn, 0) // -1 with an error
	if oobn > 0 {
		msgs, perr := unix.ParseSocketControlMessage(r.oob[:oobn])
		if perr != nil {
			return fmt.Errorf("%w: control message: %v", ErrProtocol, perr)
		}
		for _, m := range msgs {
			fds, perr := unix.ParseUnixRights(&m)
			if perr != nil {
				return fmt.Errorf("%w: control message: %v", ErrProtocol, perr)
			}
			for _, fd := range fds {
				unix.CloseOnExec(fd)
			}
			r.fds = append(r.fds, fds...)
		}
	}
	if flags&unix.MSG_CTRUNC != 0 {
		return fmt.Errorf("%w: more descriptors than one file needs", ErrProtocol)
	}
	r.buf = append(r.buf, r.tmp[:n]...)
	if n == 0 && oobn == 0 && (err == nil || errors.Is(err, io.EOF)) {
		return io.EOF
	}
	return err
}

// need reads until k bytes are buffered; a connection that ends between messages is io.EOF,
// one that ends inside a message io.ErrUnexpectedEOF.
func (r *msgReader) need(k int) error {
	for len(r.buf) < k {
		if err := r.fill(); err != nil {
			if err == io.EOF && len(r.buf) > 0 {
				return io.ErrUnexpectedEOF
			}
			return err
		}
	}
	return nil
}

// request reads one file request and returns the validated name.
func (r *msgReader) request() (string, error) {
	if err := r.need(4); err != nil {
		return "", err
	}
	n := int(binary.LittleEndian.Uint32(r.buf))
	if n == 0 || n > maxRequest {
		return "", fmt.Errorf("%w: request of %d bytes", ErrProtocol, n)
	}
	if err := r.need(4 + n); err != nil {
		return "", err
	}
	msg := r.buf[4 : 4+n]
	r.buf = r.buf[4+n:]
	return decodeRequest(msg)
}

// decodeRequest parses img_streamer_request_entry { required string filename = 1; }.
func decodeRequest(msg []byte) (string, error) {
	var name string
	found := false
	for len(msg) > 0 {
		num, typ, k := protowire.ConsumeTag(msg)
		if k < 0 {
			return "", fmt.Errorf("%w: bad request: %v", ErrProtocol, protowire.ParseError(k))
		}
		msg = msg[k:]
		if num == 1 && typ == protowire.BytesType {
			v, k := protowire.ConsumeBytes(msg)
			if k < 0 {
				return "", fmt.Errorf("%w: bad request: %v", ErrProtocol, protowire.ParseError(k))
			}
			name, found, msg = string(v), true, msg[k:]
			continue
		}
		k = protowire.ConsumeFieldValue(num, typ, msg)
		if k < 0 {
			return "", fmt.Errorf("%w: bad request: %v", ErrProtocol, protowire.ParseError(k))
		}
		msg = msg[k:]
	}
	if !found {
		return "", fmt.Errorf("%w: request without a file name", ErrProtocol)
	}
	if err := ValidName(name); err != nil {
		return "", err
	}
	return name, nil
}

// ValidName accepts a plain file name: CRIU's image files live in one directory.
func ValidName(name string) error {
	switch {
	case name == "" || name == "." || name == "..":
		return fmt.Errorf("%w: file name %q", ErrProtocol, name)
	case len(name) > MaxName:
		return fmt.Errorf("%w: file name of %d bytes", ErrProtocol, len(name))
	case !utf8.ValidString(name):
		return fmt.Errorf("%w: file name %q is not UTF-8", ErrProtocol, name)
	case strings.ContainsRune(name, '/'):
		return fmt.Errorf("%w: file name %q has a '/'", ErrProtocol, name)
	}
	for _, c := range name {
		if c < 0x20 || c == 0x7f {
			return fmt.Errorf("%w: file name %q has a control character", ErrProtocol, name)
		}
	}
	if name == CaptureSocket || name == ServeSocket {
		return fmt.Errorf("%w: file name %q is the streamer's socket", ErrProtocol, name)
	}
	return nil
}

// reply answers a restore request: img_streamer_reply_entry { required bool exists = 1; }.
func (r *msgReader) reply(exists bool) error {
	var msg []byte
	msg = protowire.AppendTag(msg, 1, protowire.VarintType)
	msg = protowire.AppendVarint(msg, protowire.EncodeBool(exists))
	out := binary.LittleEndian.AppendUint32(nil, uint32(len(msg)))
	if _, err := r.c.Write(append(out, msg...)); err != nil {
		return fmt.Errorf("reply to CRIU: %w", err)
	}
	return nil
}

// pipe reads the one byte that carries a file's pipe end and checks the descriptor: a pipe,
// opened for reading (capture) or writing (serve).
func (r *msgReader) pipe(mode Mode) (*os.File, error) {
	if err := r.need(1); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, fmt.Errorf("waiting for the pipe: %w", err)
	}
	r.buf = r.buf[1:]
	if len(r.fds) != 1 {
		return nil, fmt.Errorf("%w: %d descriptors with a file, want 1", ErrProtocol, len(r.fds))
	}
	fd := r.fds[0]
	r.fds = r.fds[:0]
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("received descriptor: %w", err)
	}
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("received descriptor: %w", err)
	}
	want := unix.O_RDONLY
	if mode == Serve {
		want = unix.O_WRONLY
	}
	if st.Mode&unix.S_IFMT != unix.S_IFIFO || fl&unix.O_ACCMODE != want {
		unix.Close(fd)
		return nil, fmt.Errorf("%w: received descriptor is not a pipe end of the right direction", ErrProtocol)
	}
	_, _ = unix.FcntlInt(uintptr(fd), unix.F_SETPIPE_SZ, pipeSize) // best effort
	// Non-blocking, the pipe joins Go's poller: closing it (on a failure elsewhere) interrupts a
	// transfer waiting on it. CRIU closed its copy of this end when it sent it.
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("received descriptor: %w", err)
	}
	return os.NewFile(uintptr(fd), "criu-pipe"), nil
}

// closeFDs closes descriptors received but never used.
func (r *msgReader) closeFDs() {
	for _, fd := range r.fds {
		unix.Close(fd)
	}
	r.fds = nil
}

// Grace is how long a stream may take to finish once CRIU has exited (its last pipes drained
// into the store) before it is cancelled: nothing should hold a pipe or the connection then.
var Grace = 30 * time.Second

// Consequence reports whether a streamer error only follows from CRIU failing first: it never
// connected, or its connection ended in the middle of a message, or the stream was cancelled.
func Consequence(err error) bool {
	return errors.Is(err, ErrNoPeer) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, context.Canceled)
}

// With runs criu (a dump or restore told to stream through srv) while serve (srv.Capture or
// srv.Serve, bound to their arguments) runs in the background, and returns both errors. Once
// criu returns, srv stops listening (a CRIU that never connected ends the serve) and the stream
// gets Grace to finish before it is cancelled; srv is closed on return.
func With(ctx context.Context, srv *Server, serve func(context.Context) error, criu func() error) (criuErr, streamErr error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		defer srv.Close()
		done <- serve(sctx)
	}()
	criuErr = criu()
	srv.Close()
	select {
	case streamErr = <-done:
	case <-time.After(Grace):
		cancel()
		streamErr = fmt.Errorf("the stream did not end %s after CRIU exited: %w", Grace, <-done)
	}
	return criuErr, streamErr
}
