package criu

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// ErrFailed means CRIU reported a failed dump or restore; the *Error carries its log tail.
var ErrFailed = errors.New("criu failed")

// ErrStart means CRIU could not be started (nothing was done).
var ErrStart = errors.New("cannot start criu")

// Error is a failed CRIU request. CRIU's RPC answer rarely says why ("err:0"); the reason is in
// its log, so the error carries the log's path and last lines.
type Error struct {
	Op      string   // "dump pid 42", "restore"
	Msg     string   // CRIU's RPC message or the transport failure
	Err     error    // what failed (a *StallError when the watchdog ended CRIU)
	Cause   string   // the first real error line of the log ("" when none was found)
	LogPath string   // full log
	Tail    []string // last lines of the log
}

func (e *Error) Error() string {
	// A CRIU killed for making no progress logged no error: the stall is the cause.
	if errors.Is(e.Err, ErrStalled) {
		return fmt.Sprintf("criu %s: %v", e.Op, e.Err)
	}
	// CRIU's RPC message is often just the first error line of its log, harmless ones included:
	// the cause found in the log leads, and the log's path is left to the caller (it keeps the
	// log somewhere the staging directory's removal does not reach).
	if e.Cause != "" {
		return fmt.Sprintf("criu %s: %s", e.Op, e.Cause)
	}
	return fmt.Sprintf("criu %s: %s", e.Op, e.Msg)
}

func newError(op string, err error, logPath string) *Error {
	return &Error{Op: op, Msg: err.Error(), Err: err, Cause: LogCause(logPath), LogPath: logPath, Tail: LogTail(logPath, 20)}
}

// harmless are error lines CRIU logs that do not make an operation fail (it goes on after them);
// a failure headline must name the real cause instead.
var harmless = []string{
	"Can't setup RLIMIT_NOFILE",                  // rlimit: raising its own fd limit failed; CRIU continues
	"Can't get suspend state",                    // optional kernel feature probes
	"Unable to get $HOME directory",              // CRIU looks for a config file
	"Failed to fetch exit_code",                  // a zombie already gone
	"kerndat: Can't load",                        // cached kernel data, recomputed
	"Couldn't read /proc/sys/kernel/ns_last_pid", // fallback exists
}

// LogCause returns the first line of a CRIU log that reports an error ("Error (file:line):" or
// "Error:"), without its timestamp and source position, skipping errors CRIU logs and then
// survives. "" when the log is unreadable or has none.
func LogCause(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		if c, ok := errorLine(sc.Text()); ok {
			return c
		}
	}
	return ""
}

// errorLine extracts the message of a CRIU error line: "(00.012345) Error (criu/x.c:12): msg".
func errorLine(line string) (string, bool) {
	i := strings.Index(line, "Error (")
	if i < 0 {
		return "", false
	}
	rest := line[i+len("Error ("):]
	j := strings.Index(rest, "): ")
	if j < 0 {
		return "", false
	}
	msg := strings.TrimSpace(rest[j+3:])
	for _, h := range harmless {
		if strings.Contains(msg, h) {
			return "", false
		}
	}
	return msg, msg != ""
}

// Is makes every *Error match ErrFailed.
func (e *Error) Is(target error) bool { return target == ErrFailed }

// Unwrap gives what failed (errors.Is(err, ErrStalled) for a CRIU the watchdog ended).
func (e *Error) Unwrap() error { return e.Err }

// LogTail returns the last n lines of the file at path (fewer when it is shorter), or nil.
func LogTail(path string, n int) []string {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > 4*n {
			lines = append(lines[:0], lines[len(lines)-n:]...)
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return lines
}

// maxReply bounds one CRIU RPC message; a longer one is reported, not truncated silently.
const maxReply = 1 << 20

// spawn says how a CRIU process starts.
type spawn struct {
	onStart  func(pid int) // called once CRIU runs, before the request is sent
	cgroupFD int           // > 0: start CRIU in this cgroup v2 directory (CLONE_INTO_CGROUP)
	// The watchdog: CRIU is killed when it makes no progress (its log at logPath, its CPU time,
	// progress()) for stall (see Bound: 0 is DefaultStall, < 0 no bound).
	stall    time.Duration
	logPath  string
	progress func() int64
}

// swrk runs one `criu swrk` process for one request. Unlike go-criu's own loop it creates the
// socket pair close-on-exec and hands CRIU its end through ExtraFiles (no fd leaks into concurrent
// forks), reads replies of any size up to maxReply and checks for truncation, and puts CRIU in its
// own process group so a Ctrl-C aimed at ptxmig does not kill CRIU halfway through: ptxmig lets a
// started CRIU request finish and rolls back afterwards. So does the operation's guardian when
// ptxmig dies: CRIU killed while its parasite code runs inside a process being dumped can kill
// that process, so the guardian waits for CRIU to finish (it exits once it finds ptxmig's end of
// the socket closed), then rolls back; the pid OnStart reports is how it finds CRIU.
func swrk(bin string, req *rpc.CriuReq, onNotify func(*rpc.CriuNotify) error, sp spawn) (*rpc.CriuResp, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socketpair: %w", err)
	}
	cln := os.NewFile(uintptr(fds[0]), "criu-client")
	srv := os.NewFile(uintptr(fds[1]), "criu-server")
	defer cln.Close()

	var stderr bytes.Buffer
	cmd := exec.Command(bin, "swrk", "3")
	cmd.ExtraFiles = []*os.File{srv}
	cmd.Stdout = &stderr
	cmd.Stderr = &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if sp.cgroupFD > 0 {
		cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, sp.cgroupFD
	}
	if err := cmd.Start(); err != nil {
		srv.Close()
		return nil, fmt.Errorf("%w: %s swrk: %w", ErrStart, bin, err)
	}
	srv.Close()
	if sp.onStart != nil {
		sp.onStart(cmd.Process.Pid)
	}
	wd := watch(cmd.Process.Pid, sp.logPath, sp.stall, sp.progress)
	resp, err := exchange(cln, req, onNotify)
	cln.Close() // CRIU exits when its socket closes
	werr := cmd.Wait()
	if serr := wd.stop(); serr != nil {
		return resp, serr
	}
	if err != nil {
		if out := strings.TrimSpace(stderr.String()); out != "" {
			err = fmt.Errorf("%w; criu output: %s", err, out)
		}
		return resp, err
	}
	if werr != nil {
		slog.Debug("criu swrk exited with an error after a successful request", "err", werr, "output", stderr.String())
	}
	return resp, nil
}

func exchange(sk *os.File, req *rpc.CriuReq, onNotify func(*rpc.CriuNotify) error) (*rpc.CriuResp, error) {
	buf := make([]byte, maxReply)
	for {
		b, err := proto.Marshal(req)
		if err != nil {
			return nil, fmt.Errorf("marshal criu request: %w", err)
		}
		if _, err := sk.Write(b); err != nil {
			return nil, fmt.Errorf("send criu request: %w", err)
		}
		n, _, rflags, _, err := unix.Recvmsg(int(sk.Fd()), buf, nil, 0)
		if err != nil {
			return nil, fmt.Errorf("read criu reply: %w", err)
		}
		if rflags&unix.MSG_TRUNC != 0 {
			return nil, fmt.Errorf("criu reply longer than %d bytes", maxReply)
		}
		if n == 0 {
			return nil, errors.New("criu closed the connection without a reply (it crashed or was killed)")
		}
		resp := &rpc.CriuResp{}
		if err := proto.Unmarshal(buf[:n], resp); err != nil {
			return nil, fmt.Errorf("decode criu reply: %w", err)
		}
		if !resp.GetSuccess() {
			msg := resp.GetCrErrmsg()
			if msg == "" {
				msg = "operation failed"
			}
			if e := resp.GetCrErrno(); e != 0 {
				msg += ": " + syscall.Errno(e).Error()
			}
			return resp, errors.New(msg)
		}
		if resp.GetType() != rpc.CriuReqType_NOTIFY {
			if resp.GetType() != req.GetType() {
				return resp, fmt.Errorf("criu answered %s to %s", resp.GetType(), req.GetType())
			}
			return resp, nil
		}
		if onNotify != nil {
			if err := onNotify(resp.GetNotify()); err != nil {
				return resp, fmt.Errorf("notify %s: %w", resp.GetNotify().GetScript(), err)
			}
		}
		req = &rpc.CriuReq{Type: rpc.CriuReqType_NOTIFY.Enum(), NotifySuccess: proto.Bool(true)}
	}
}

// DumpOptions describe one dump. ImagesDir must exist and be empty; CRIU writes its log there.
type DumpOptions struct {
	PID            int
	ImagesDir      string
	LogFile        string // name inside ImagesDir; default "dump.log"
	LeaveRunning   bool   // resume the process after the dump
	LeaveStopped   bool   // leave it stopped (SIGSTOP) after the dump instead of killing it
	ShellJob       bool   // the process belongs to a shell's session/terminal
	TCPEstablished bool   // dump established TCP connections
	NetworkLock    string // how CRIU blocks the connections meanwhile: "" (CRIU's default, iptables), "iptables" or "nftables"
	FileLocks      bool
	ExtUnixSk      bool
	// OnStart is called with CRIU's pid once it runs (the operation's journal records it, so
	// that a guardian can make sure it is gone).
	OnStart func(pid int)
	// Stream: CRIU sends its image files to the streamer socket in ImagesDir (package
	// imgstream), which the caller serves, instead of writing them; only its log (and stats)
	// land in ImagesDir.
	Stream bool
	// Stall: CRIU is killed (and the dump fails with ErrStalled) when it makes no progress for
	// this long: its log does not grow, it uses no CPU time and Progress does not change.
	// 0 means DefaultStall, < 0 no bound.
	Stall    time.Duration
	Progress func() int64 // optional: a counter of the caller's (bytes streamed)
}

// RestoreOptions describe one restore. The restored process is detached: it outlives ptxmig.
type RestoreOptions struct {
	ImagesDir      string
	WorkDir        string // where the log goes; default ImagesDir
	LogFile        string // default "restore.log"
	ShellJob       bool
	TCPEstablished bool
	NetworkLock    string // as DumpOptions.NetworkLock: the dump's method
	FileLocks      bool
	ExtUnixSk      bool
	// CgroupDir, when set, is a cgroup v2 directory (under the cgroup2 mount) CRIU starts in, so
	// that every restored process is born there; CRIU is then told to leave cgroups alone (its
	// own placement would follow paths relative to the restorer's cgroup, or re-create missing
	// ones). Processes must be placed in the other hierarchies (cgroup v1) by the caller.
	CgroupDir string
	// IgnoreCgroups tells CRIU to leave cgroups alone (implied by CgroupDir).
	IgnoreCgroups bool
	OnStart       func(pid int) // as DumpOptions.OnStart
	// Stream: CRIU reads its image files from the streamer socket in ImagesDir, which the caller
	// serves (package imgstream).
	Stream   bool
	Stall    time.Duration // as DumpOptions.Stall
	Progress func() int64  // as DumpOptions.Progress
}

// BuildDumpOpts turns DumpOptions into CRIU's RPC options with the images dir as fd imgFD.
func BuildDumpOpts(o DumpOptions, imgFD int) (*rpc.CriuOpts, error) {
	if o.PID <= 0 {
		return nil, fmt.Errorf("dump: bad pid %d", o.PID)
	}
	if o.LeaveRunning && o.LeaveStopped {
		return nil, errors.New("dump: leave-running and leave-stopped are exclusive")
	}
	opts := &rpc.CriuOpts{
		ImagesDirFd: proto.Int32(int32(imgFD)),
		Pid:         proto.Int32(int32(o.PID)),
		LogLevel:    proto.Int32(4),
		LogFile:     proto.String(orDefault(o.LogFile, "dump.log")),
	}
	if err := setNetworkLock(opts, o.NetworkLock); err != nil {
		return nil, fmt.Errorf("dump: %w", err)
	}
	opts.GhostLimit = proto.Uint32(GhostLimit)
	setBool(&opts.LeaveRunning, o.LeaveRunning)
	setBool(&opts.LeaveStopped, o.LeaveStopped)
	setBool(&opts.ShellJob, o.ShellJob)
	setBool(&opts.TcpEstablished, o.TCPEstablished)
	setBool(&opts.FileLocks, o.FileLocks)
	setBool(&opts.ExtUnixSk, o.ExtUnixSk)
	return opts, nil
}

// BuildRestoreOpts turns RestoreOptions into CRIU's RPC options (images dir fd imgFD, work dir
// fd workFD or -1).
func BuildRestoreOpts(o RestoreOptions, imgFD, workFD int) (*rpc.CriuOpts, error) {
	opts := &rpc.CriuOpts{
		ImagesDirFd: proto.Int32(int32(imgFD)),
		LogLevel:    proto.Int32(4),
		LogFile:     proto.String(orDefault(o.LogFile, "restore.log")),
	}
	if err := setNetworkLock(opts, o.NetworkLock); err != nil {
		return nil, fmt.Errorf("restore: %w", err)
	}
	if workFD >= 0 {
		opts.WorkDirFd = proto.Int32(int32(workFD))
	}
	setBool(&opts.ShellJob, o.ShellJob)
	setBool(&opts.TcpEstablished, o.TCPEstablished)
	setBool(&opts.FileLocks, o.FileLocks)
	setBool(&opts.ExtUnixSk, o.ExtUnixSk)
	if o.IgnoreCgroups || o.CgroupDir != "" {
		opts.ManageCgroupsMode = rpc.CriuCgMode_IGNORE.Enum()
	}
	return opts, nil
}

// GhostLimit is the largest deleted file still open in the tree (a "ghost" file, whose content CRIU
// must save) that a dump takes (CRIU's default: 1 MiB). NCCL keeps a deleted 33 MiB /dev/shm file
// open in each rank even with its shared-memory transport off (2x H200, NCCL 2.28.9, 2026-11-28).
const GhostLimit = 1 << 30

// Network lock methods (DumpOptions.NetworkLock).
const (
	NetworkLockIptables = "iptables"
	NetworkLockNftables = "nftables"
)

// setNetworkLock sets the RPC's network lock method; "" leaves CRIU's default.
func setNetworkLock(opts *rpc.CriuOpts, method string) error {
	switch method {
	case "":
	case NetworkLockIptables:
		opts.NetworkLock = rpc.CriuNetworkLockMethod_IPTABLES.Enum()
	case NetworkLockNftables:
		opts.NetworkLock = rpc.CriuNetworkLockMethod_NFTABLES.Enum()
	default:
		return fmt.Errorf("unknown network lock method %q (want iptables or nftables)", method)
	}
	return nil
}

func setBool(dst **bool, v bool) {
	if v {
		*dst = proto.Bool(true)
	}
}

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// Dumper runs CRIU dumps and restores with the binary Bin.
type Dumper struct {
	Bin     string
	netLock func() string
}

// NetworkLock is how this CRIU should block established TCP connections while it dumps and
// restores them: nftables where it can (CRIU's default, iptables, needs the iptables command,
// which many hosts lack), else iptables. Asked once.
func (d *Dumper) NetworkLock() string {
	if d.netLock == nil {
		d.netLock = sync.OnceValue(func() string {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if _, err := output(ctx, d.Bin, "check", "--feature", "network_lock_nftables"); err == nil {
				return NetworkLockNftables
			}
			return NetworkLockIptables
		})
	}
	return d.netLock()
}

// NewDumper finds CRIU (see Find) and checks its version.
func NewDumper(ctx context.Context) (*Dumper, string, error) {
	bin, text, err := Check(ctx)
	if err != nil {
		return nil, text, err
	}
	return &Dumper{Bin: bin}, text, nil
}

// DumpResult reports a finished dump.
type DumpResult struct {
	Duration time.Duration
	LogPath  string
}

// Dump checkpoints the process tree rooted at o.PID into o.ImagesDir. On failure the error is an
// *Error with the log tail.
func (d *Dumper) Dump(ctx context.Context, o DumpOptions) (*DumpResult, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	dir, err := openDir(o.ImagesDir)
	if err != nil {
		return nil, fmt.Errorf("dump pid %d: %w", o.PID, err)
	}
	defer dir.Close()
	opts, err := BuildDumpOpts(o, int(dir.Fd()))
	if err != nil {
		return nil, err
	}
	logPath := filepath.Join(o.ImagesDir, opts.GetLogFile())
	sp := spawn{onStart: o.OnStart, stall: o.Stall, logPath: logPath, progress: o.Progress}
	t0 := time.Now()
	if o.Stream {
		err = d.streamDump(opts, o, sp)
	} else {
		_, err = swrk(d.Bin, &rpc.CriuReq{Type: rpc.CriuReqType_DUMP.Enum(), Opts: opts}, nil, sp)
	}
	res := &DumpResult{Duration: time.Since(t0), LogPath: logPath}
	if err != nil {
		return res, newError(fmt.Sprintf("dump pid %d", o.PID), err, logPath)
	}
	return res, nil
}

// RestoreResult reports a finished restore.
type RestoreResult struct {
	PID      int
	Duration time.Duration
	LogPath  string
}

// Restore restores the process tree in o.ImagesDir, detached, and returns the root's PID.
func (d *Dumper) Restore(ctx context.Context, o RestoreOptions) (*RestoreResult, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	dir, err := openDir(o.ImagesDir)
	if err != nil {
		return nil, fmt.Errorf("restore: %w", err)
	}
	defer dir.Close()
	workFD := -1
	logDir := o.ImagesDir
	if o.WorkDir != "" {
		wd, err := openDir(o.WorkDir)
		if err != nil {
			return nil, fmt.Errorf("restore: %w", err)
		}
		defer wd.Close()
		workFD = int(wd.Fd())
		logDir = o.WorkDir
	}
	opts, err := BuildRestoreOpts(o, int(dir.Fd()), workFD)
	if err != nil {
		return nil, err
	}
	logPath := filepath.Join(logDir, opts.GetLogFile())
	sp := spawn{onStart: o.OnStart, stall: o.Stall, logPath: logPath, progress: o.Progress}
	if o.CgroupDir != "" {
		cg, err := openDir(o.CgroupDir)
		if err != nil {
			return nil, fmt.Errorf("restore: cgroup: %w", err)
		}
		defer cg.Close()
		sp.cgroupFD = int(cg.Fd())
	}
	t0 := time.Now()
	if o.Stream {
		pid, err := d.streamRestore(opts, o, sp)
		res := &RestoreResult{PID: pid, Duration: time.Since(t0), LogPath: logPath}
		if errors.Is(err, ErrStart) {
			return res, err
		}
		if err != nil {
			return res, newError("restore", err, logPath)
		}
		return res, nil
	}
	var notifiedPID int32
	resp, err := swrk(d.Bin, &rpc.CriuReq{Type: rpc.CriuReqType_RESTORE.Enum(), Opts: opts}, func(n *rpc.CriuNotify) error {
		if n.GetScript() == "post-restore" {
			notifiedPID = n.GetPid()
		}
		return nil
	}, sp)
	res := &RestoreResult{Duration: time.Since(t0), LogPath: logPath}
	if errors.Is(err, ErrStart) {
		return res, err
	}
	if err != nil {
		return res, newError("restore", err, logPath)
	}
	res.PID = int(resp.GetRestore().GetPid())
	if res.PID <= 0 {
		res.PID = int(notifiedPID)
	}
	if res.PID <= 0 {
		return res, newError("restore", errors.New("criu reported success but no pid"), logPath)
	}
	return res, nil
}

// openDir opens a directory without following a symlink in its last component.
func openDir(path string) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open directory %s: %w", path, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}

// CheckKernel runs `criu check` and returns its output on failure.
func CheckKernel(ctx context.Context, bin string) error {
	out, err := output(ctx, bin, "check")
	if err != nil {
		return fmt.Errorf("%s check: %w: %s", bin, err, lastLine(out))
	}
	return nil
}

func lastLine(b []byte) string {
	s := strings.TrimSpace(string(b))
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		s = s[i+1:]
	}
	return s
}
