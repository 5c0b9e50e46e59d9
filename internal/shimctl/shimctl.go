// Package shimctl talks to libptxmig, the LD_PRELOAD shim, over its per-process control socket
// (protocol: docs/SHIM-PROTOCOL.md), and detects which processes run under it.
package shimctl

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultSocketDir is where the shim creates <pid>.sock unless PTXMIG_SOCKET_DIR says otherwise.
const DefaultSocketDir = "/run/ptxmig"

// ProtoVersion is the newest protocol version this client speaks; MinProtoVersion the oldest it
// accepts. Version 2 adds preemption (quiesce, detach, resume); a version-1 shim has none.
const (
	ProtoVersion    = 2
	MinProtoVersion = 1
)

// maxReply bounds one reply line; the largest replies (module lists) stay far below it.
const maxReply = 64 << 20

// replyLimit bounds, per request, a reply's bytes and the JSON objects and arrays in it. The
// process under the shim is not trusted, and decoding costs far more than the text: a reply of
// 4 MiB of `{}` list elements took over 400 MiB of heap to decode. The requests a checkpoint
// makes (quiesce, detach, resume, and status while twins stop) answer with a few KiB; the
// listings a person asks for (kernels, dump-modules) may be large.
type replyLimit struct{ bytes, objects int }

var replyLimits = map[string]replyLimit{
	"quiesce": {1 << 20, 1 << 18},
	"detach":  {1 << 20, 1 << 18},
	"resume":  {1 << 20, 1 << 18},
	"status":  {16 << 20, 1 << 18},
}

func limitOf(cmd string) replyLimit {
	if l, ok := replyLimits[cmd]; ok {
		return l
	}
	return replyLimit{maxReply, 1 << 20}
}

var (
	// ErrNoShim: the process has no control socket (not started under the shim, not using CUDA
	// yet, or the socket directory differs).
	ErrNoShim = errors.New("no ptxmig shim control socket")
	// ErrProtocol: the reply is not what the protocol allows.
	ErrProtocol = errors.New("shim protocol error")
	// ErrShim: the shim answered with an error.
	ErrShim = errors.New("shim refused the request")
	// ErrPeer: the socket named after a PID is served by another process (a stale or planted
	// socket); nothing is sent to it.
	ErrPeer = errors.New("control socket not served by the expected process")
)

// SocketDir returns the socket directory: dir if set, else $PTXMIG_SOCKET_DIR, else the default.
func SocketDir(dir string) string {
	if dir != "" {
		return dir
	}
	if d := os.Getenv("PTXMIG_SOCKET_DIR"); strings.HasPrefix(d, "/") {
		return d
	}
	return DefaultSocketDir
}

// SocketPath is the control socket of pid under dir.
func SocketPath(dir string, pid int) string {
	return filepath.Join(SocketDir(dir), strconv.Itoa(pid)+".sock")
}

// Detect reports whether pid runs under the shim: its control socket exists in the default
// directory (or $PTXMIG_SOCKET_DIR) and the process maps the shim (IsShimLib).
func Detect(pid int) (sock string, ok bool) { return DetectIn("", pid) }

// DetectIn is Detect with an explicit socket directory ("" for the default).
func DetectIn(dir string, pid int) (sock string, ok bool) {
	if pid <= 0 {
		return "", false
	}
	sock = SocketPath(dir, pid)
	st, err := os.Lstat(sock)
	if err != nil || st.Mode().Type() != os.ModeSocket {
		return "", false
	}
	if ok, err := MapsHaveShim(pid); err != nil || !ok {
		return "", false
	}
	return sock, true
}

// ShimLibPattern is the one rule for "runs under the shim", used by every command: the process
// maps a file whose base name matches this pattern (path.Match syntax): libptxmig.so,
// libptxmig.so.1, libptxmig-san.so, from any directory, also once deleted.
const ShimLibPattern = "libptxmig*.so*"

// IsShimLib reports whether path, a mapped file's path as /proc/PID/maps shows it (a
// " (deleted)" suffix is ignored), is the shim library: its base name matches ShimLibPattern.
func IsShimLib(path string) bool {
	base := filepath.Base(strings.TrimSuffix(path, " (deleted)"))
	ok, _ := filepath.Match(ShimLibPattern, base)
	return ok
}

// MapsHaveShim reports whether /proc/PID/maps of pid maps the shim library (IsShimLib).
func MapsHaveShim(pid int) (bool, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return false, err
	}
	defer f.Close()
	ok, err := MapsListingHasShim(f)
	if err != nil {
		return false, fmt.Errorf("/proc/%d/maps: %w", pid, err)
	}
	return ok, nil
}

// MapsListingHasShim reports whether a /proc/PID/maps listing maps the shim library (IsShimLib).
func MapsListingHasShim(r io.Reader) (bool, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// address perms offset dev inode pathname; the path is the 6th field and may hold spaces.
		fields := strings.Fields(sc.Text())
		if len(fields) >= 6 && IsShimLib(strings.Join(fields[5:], " ")) {
			return true, nil
		}
	}
	return false, sc.Err()
}

// Client is one connection to a shim. It is not safe for concurrent use.
type Client struct {
	conn  net.Conn
	r     *bufio.Reader
	path  string
	proto int // the shim's protocol version, from its last reply
}

// Proto is the protocol version the shim answered with (0 before any reply).
func (c *Client) Proto() int { return c.proto }

// Dial connects to the control socket at path.
func Dial(ctx context.Context, path string) (*Client, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("dial %s: %w: %v", path, ErrNoShim, err)
		}
		return nil, fmt.Errorf("dial %s: %w", path, err)
	}
	return &Client{conn: conn, r: bufio.NewReaderSize(conn, 64<<10), path: path}, nil
}

// DialPID connects to pid's socket in dir ("" for the default directory) and checks, with
// SO_PEERCRED, that pid itself listens on it: ptxmig runs as root and must not talk to a socket
// another process left or planted under that name.
func DialPID(ctx context.Context, dir string, pid int) (*Client, error) {
	if pid <= 0 {
		return nil, fmt.Errorf("pid %d: must be positive", pid)
	}
	c, err := Dial(ctx, SocketPath(dir, pid))
	if err != nil {
		return nil, err
	}
	got, err := peerPID(c.conn)
	if err == nil && got != pid {
		err = fmt.Errorf("%w: %s is served by pid %d, not %d", ErrPeer, c.path, got, pid)
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// peerPID returns the PID of the process at the other end of a Unix socket connection (for a
// listening server: the process that called listen).
func peerPID(conn net.Conn) (int, error) {
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		return 0, fmt.Errorf("%w: not a Unix socket connection", ErrPeer)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return 0, fmt.Errorf("peer credentials: %w", err)
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, fmt.Errorf("peer credentials: %w", err)
	}
	if cerr != nil {
		return 0, fmt.Errorf("peer credentials: %w", cerr)
	}
	return int(cred.Pid), nil
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

type envelope struct {
	OK     *bool           `json:"ok"`
	Proto  int             `json:"proto"`
	Cmd    string          `json:"cmd"`
	Error  string          `json:"error"`
	Result json.RawMessage `json:"result"`
}

// Raw sends one request and returns the validated "result" member of the reply.
func (c *Client) Raw(ctx context.Context, cmd string, args map[string]any) (json.RawMessage, error) {
	return c.rawWith(ctx, cmd, args, nil)
}

// rawWith is Raw with f's descriptor attached to the request (SCM_RIGHTS) when f is not nil.
func (c *Client) rawWith(ctx context.Context, cmd string, args map[string]any, f *os.File) (json.RawMessage, error) {
	req := map[string]any{"cmd": cmd}
	for k, v := range args {
		req[k] = v
	}
	line, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("%s: encode request: %w", cmd, err)
	}
	deadline := time.Now().Add(30 * time.Second)
	if d, ok := ctx.Deadline(); ok {
		deadline = d
	}
	if err := c.conn.SetDeadline(deadline); err != nil {
		return nil, fmt.Errorf("%s: %w", cmd, err)
	}
	stop := context.AfterFunc(ctx, func() { c.conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := c.send(append(line, '\n'), f); err != nil {
		return nil, fmt.Errorf("%s: send to %s: %w", cmd, c.path, err)
	}
	lim := limitOf(cmd)
	reply, err := readLine(c.r, lim.bytes)
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%s: %w", cmd, ctx.Err())
		}
		return nil, fmt.Errorf("%s: read from %s: %w", cmd, c.path, err)
	}
	res, proto, err := parseReply(cmd, reply)
	if proto > 0 {
		c.proto = proto
	}
	// Counted before anything decodes the result: brackets inside strings count too (an
	// over-estimate, never an under-estimate).
	if n := bytes.Count(res, []byte("{")) + bytes.Count(res, []byte("[")); err == nil && n > lim.objects {
		return nil, fmt.Errorf("%s: %w: reply with more than %d objects and lists", cmd, ErrProtocol, lim.objects)
	}
	return res, err
}

func readLine(r *bufio.Reader, max int) ([]byte, error) {
	var buf []byte
	for {
		chunk, err := r.ReadSlice('\n')
		buf = append(buf, chunk...)
		if len(buf) > max {
			return nil, fmt.Errorf("%w: reply longer than %d bytes", ErrProtocol, max)
		}
		if err == nil {
			return buf, nil
		}
		if !errors.Is(err, bufio.ErrBufferFull) {
			if errors.Is(err, io.EOF) {
				return nil, fmt.Errorf("%w: connection closed before a complete reply", ErrProtocol)
			}
			return nil, err
		}
	}
}

// parseReply validates one reply line of the protocol and returns its result and the shim's
// protocol version.
func parseReply(cmd string, line []byte) (json.RawMessage, int, error) {
	var env envelope
	dec := json.NewDecoder(bytes.NewReader(line))
	if err := dec.Decode(&env); err != nil {
		return nil, 0, fmt.Errorf("%s: %w: reply is not JSON: %v", cmd, ErrProtocol, err)
	}
	if env.OK == nil {
		return nil, 0, fmt.Errorf("%s: %w: reply has no \"ok\"", cmd, ErrProtocol)
	}
	if env.Proto < MinProtoVersion || env.Proto > ProtoVersion {
		return nil, 0, fmt.Errorf("%s: %w: shim speaks protocol %d, this ptxmig %d to %d", cmd, ErrProtocol, env.Proto, MinProtoVersion, ProtoVersion)
	}
	if !*env.OK {
		if env.Error == "" {
			return nil, env.Proto, fmt.Errorf("%s: %w: error reply without a message", cmd, ErrProtocol)
		}
		return nil, env.Proto, fmt.Errorf("%s: %w: %s", cmd, ErrShim, env.Error)
	}
	if env.Cmd != cmd || len(env.Result) == 0 || env.Result[0] != '{' {
		return nil, env.Proto, fmt.Errorf("%s: %w: reply for %q without an object result", cmd, ErrProtocol, env.Cmd)
	}
	return env.Result, env.Proto, nil
}

// Status asks for the process overview.
func (c *Client) Status(ctx context.Context) (*Status, error) { return c.status(ctx, nil) }

// StatusBrief is Status without the module list, which the shim builds by hashing every module
// image the first time it is asked (1.8 s for a PyTorch rank on an H200 host, module loads
// waiting meanwhile): what an operation's preflight and alignment ask. A shim that predates it
// answers with the whole status.
func (c *Client) StatusBrief(ctx context.Context) (*Status, error) {
	return c.status(ctx, map[string]any{"brief": 1})
}

func (c *Client) status(ctx context.Context, args map[string]any) (*Status, error) {
	raw, err := c.Raw(ctx, "status", args)
	if err != nil {
		return nil, err
	}
	var s Status
	if err := json.Unmarshal(raw, &s); err != nil {
		return nil, fmt.Errorf("status: %w: %v", ErrProtocol, err)
	}
	if s.PID <= 0 {
		return nil, fmt.Errorf("status: %w: pid %d", ErrProtocol, s.PID)
	}
	return &s, nil
}

// Kernels asks for per-kernel launch accounting.
func (c *Client) Kernels(ctx context.Context) (*Kernels, error) {
	raw, err := c.Raw(ctx, "kernels", nil)
	if err != nil {
		return nil, err
	}
	var k Kernels
	if err := json.Unmarshal(raw, &k); err != nil {
		return nil, fmt.Errorf("kernels: %w: %v", ErrProtocol, err)
	}
	for _, x := range k.Kernels {
		if x.Time != nil && (x.Time.P50 < 0 || x.Time.P99 < x.Time.P50 || x.Timed == 0) {
			return nil, fmt.Errorf("kernels: %w: inconsistent entry for %v", ErrProtocol, x.Name)
		}
	}
	return &k, nil
}

// DumpModules asks the shim to write every captured image, PTX and cubin into dir (absolute; the
// shim creates it 0700 if missing and writes files 0600 as the process's user).
func (c *Client) DumpModules(ctx context.Context, dir string) (*Dump, error) {
	if !filepath.IsAbs(dir) {
		return nil, fmt.Errorf("dump-modules: dir %q must be absolute", dir)
	}
	raw, err := c.Raw(ctx, "dump-modules", map[string]any{"dir": dir})
	if err != nil {
		return nil, err
	}
	var d Dump
	if err := json.Unmarshal(raw, &d); err != nil {
		return nil, fmt.Errorf("dump-modules: %w: %v", ErrProtocol, err)
	}
	if d.Dir != dir || d.Index != "index.json" {
		return nil, fmt.Errorf("dump-modules: %w: dumped into %q (index %q), asked for %q", ErrProtocol, d.Dir, d.Index, dir)
	}
	return &d, nil
}

// send writes b, with f's descriptor attached to its first bytes when f is not nil.
func (c *Client) send(b []byte, f *os.File) error {
	if f == nil {
		_, err := c.conn.Write(b)
		return err
	}
	uc, ok := c.conn.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("a descriptor needs a unix socket")
	}
	n, _, err := uc.WriteMsgUnix(b, syscall.UnixRights(int(f.Fd())), nil)
	if err == nil && n < len(b) {
		_, err = c.conn.Write(b[n:])
	}
	return err
}
