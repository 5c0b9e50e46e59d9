package criu

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"google.golang.org/protobuf/proto"

	"github.com/ptxmig/ptxmig/internal/imgstream"
)

// CRIU streams its image files (--stream) only when run as a command: its RPC service opens the
// images directory without a streamer (cr-service.c). A streamed dump or restore therefore runs
// `criu dump|restore --stream`, with the same options the RPC request would carry: cliArgs
// renders the RPC options BuildDumpOpts and BuildRestoreOpts build, so both transports share one
// option builder, and refuses any option it cannot render instead of dropping it.

// pidFile is where a streamed restore has CRIU write the restored root's pid (the RPC answer
// carries it otherwise).
const pidFile = "restore.pid"

// cliArgs renders opts as `criu VERB` arguments with images in imagesDir (and the log in
// workDir when set).
func cliArgs(verb string, opts *rpc.CriuOpts, imagesDir, workDir string) ([]string, error) {
	rest := proto.Clone(opts).(*rpc.CriuOpts)
	args := []string{verb, "--stream", "-D", imagesDir}
	if workDir != "" {
		args = append(args, "-W", workDir)
	}
	args = append(args, "-v"+strconv.Itoa(int(opts.GetLogLevel())), "-o", opts.GetLogFile())
	rest.ImagesDirFd, rest.WorkDirFd, rest.LogLevel, rest.LogFile = nil, nil, nil, nil
	if opts.Pid != nil {
		args = append(args, "-t", strconv.Itoa(int(opts.GetPid())))
		rest.Pid = nil
	}
	for _, b := range []struct {
		v    **bool
		flag string
	}{
		{&rest.LeaveRunning, "--leave-running"},
		{&rest.LeaveStopped, "--leave-stopped"},
		{&rest.ShellJob, "--shell-job"},
		{&rest.TcpEstablished, "--tcp-established"},
		{&rest.FileLocks, "--file-locks"},
		{&rest.ExtUnixSk, "--ext-unix-sk"},
	} {
		if *b.v != nil {
			if **b.v {
				args = append(args, b.flag)
			}
			*b.v = nil
		}
	}
	if rest.GhostLimit != nil {
		args = append(args, "--ghost-limit", strconv.FormatUint(uint64(rest.GetGhostLimit()), 10))
		rest.GhostLimit = nil
	}
	if rest.NetworkLock != nil {
		switch rest.GetNetworkLock() {
		case rpc.CriuNetworkLockMethod_IPTABLES:
			args = append(args, "--network-lock", NetworkLockIptables)
		case rpc.CriuNetworkLockMethod_NFTABLES:
			args = append(args, "--network-lock", NetworkLockNftables)
		default:
			return nil, fmt.Errorf("criu %s --stream: network lock %s has no rendering here", verb, rest.GetNetworkLock())
		}
		rest.NetworkLock = nil
	}
	if rest.ManageCgroupsMode != nil {
		if rest.GetManageCgroupsMode() != rpc.CriuCgMode_IGNORE {
			return nil, fmt.Errorf("criu %s --stream: cgroup mode %s has no rendering here", verb, rest.GetManageCgroupsMode())
		}
		args = append(args, "--manage-cgroups=ignore")
		rest.ManageCgroupsMode = nil
	}
	if verb == "restore" {
		// As CRIU's RPC service forces: the restored tree outlives CRIU.
		work := workDir
		if work == "" {
			work = imagesDir
		}
		args = append(args, "--restore-detached", "--pidfile", filepath.Join(work, pidFile))
	}
	if proto.Size(rest) != 0 {
		return nil, fmt.Errorf("criu %s --stream: options without a command-line rendering: %v", verb, rest)
	}
	return args, nil
}

// streamDir is the images directory CRIU is given: the directory itself, or, when its streamer
// socket's path would not fit a Unix socket address, /proc/self/fd/3 with the directory open as
// CRIU's descriptor 3 (imgstream.Listen binds the same way). The caller closes the file.
func streamDir(dir string) (string, *os.File, error) {
	if !imgstream.TooLong(dir) {
		return dir, nil, nil
	}
	f, err := openDir(dir)
	if err != nil {
		return "", nil, err
	}
	return "/proc/self/fd/3", f, nil
}

// command runs one CRIU command for a streamed operation, started as swrk starts CRIU (its own
// process group, the target cgroup, onStart told its pid), with extra as its descriptor 3 when
// set. CRIU is not killed when ctx ends: like a swrk request, a started dump or restore runs to
// its end; it fails on its own once the streamer (which watches ctx) closes its socket.
func command(bin string, args []string, extra *os.File, sp spawn) error {
	var out bytes.Buffer
	cmd := exec.Command(bin, args...)
	if extra != nil {
		cmd.ExtraFiles = []*os.File{extra}
	}
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if sp.cgroupFD > 0 {
		cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, sp.cgroupFD
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("%w: %s %s: %w", ErrStart, bin, args[0], err)
	}
	if sp.onStart != nil {
		sp.onStart(cmd.Process.Pid)
	}
	wd := watch(cmd.Process.Pid, sp.logPath, sp.stall, sp.progress)
	err := cmd.Wait()
	if serr := wd.stop(); serr != nil {
		return serr
	}
	if err != nil {
		if s := strings.TrimSpace(out.String()); s != "" {
			return fmt.Errorf("%w; criu output: %s", err, s)
		}
		return err
	}
	return nil
}

// streamDump runs a dump whose images go to the streamer socket in o.ImagesDir.
func (d *Dumper) streamDump(opts *rpc.CriuOpts, o DumpOptions, sp spawn) error {
	dir, f, err := streamDir(o.ImagesDir)
	if err != nil {
		return err
	}
	if f != nil {
		defer f.Close()
	}
	args, err := cliArgs("dump", opts, dir, "")
	if err != nil {
		return err
	}
	return command(d.Bin, args, f, sp)
}

// streamRestore runs a restore reading its images from the streamer socket in o.ImagesDir and
// returns the restored root's pid.
func (d *Dumper) streamRestore(opts *rpc.CriuOpts, o RestoreOptions, sp spawn) (int, error) {
	work := o.WorkDir
	if work == "" {
		work = o.ImagesDir
	}
	dir, f, err := streamDir(o.ImagesDir)
	if err != nil {
		return 0, err
	}
	if f != nil {
		defer f.Close()
	}
	args, err := cliArgs("restore", opts, dir, work)
	if err != nil {
		return 0, err
	}
	if err := command(d.Bin, args, f, sp); err != nil {
		return 0, err
	}
	b, err := os.ReadFile(filepath.Join(work, pidFile))
	if err != nil {
		return 0, fmt.Errorf("read the restored pid: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return 0, errors.New("criu wrote no valid restored pid")
	}
	return pid, nil
}
