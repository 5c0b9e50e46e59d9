package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/seccomp"
	"github.com/ptxmig/ptxmig/internal/shimctl"
)

func init() {
	register(&cli.Command{
		Name:      "run",
		Usage:     "start a command with the ptxmig shim (libptxmig.so) preloaded",
		ArgsUsage: "-- CMD [ARGS...]",
		Description: "Like env or nice, ptxmig run checks what it can (the shim, CMD, the socket directory), puts\n" +
			"the shim first in LD_PRELOAD (an existing LD_PRELOAD is kept), sets PTXMIG_SOCKET_DIR and\n" +
			"execs CMD. CMD replaces ptxmig: same PID, parent, session (except when the session's leader is\n" +
			"outside this PID namespace, as under `docker exec`: CMD then leads a session of its own, which\n" +
			"CRIU needs), terminal and open files, and no ptxmig process stays behind to wait for it or\n" +
			"write to its files. A checkpoint or restore of CMD does not involve ptxmig run. Flags of\n" +
			"ptxmig end at CMD (or at --): everything after it is CMD's own command line.\n\n" +
			"Exit status, as env(1) and timeout(1): CMD's own status, untouched, once it runs. Before the\n" +
			"exec ptxmig run uses only its own codes, so they never pass for CMD's: 125 ptxmig run itself\n" +
			"failed (bad flags, no shim, unusable socket directory; nothing started), 126 CMD was found but\n" +
			"cannot be executed (not executable, bad #! interpreter or ELF loader), 127 CMD was not found.\n\n" +
			"The shim sees every CUDA module load and kernel launch of CMD and opens a control socket\n" +
			"<socket-dir>/<pid>.sock on CMD's first CUDA call; `ptxmig kernels PID` and `ptxmig modules PID`\n" +
			"read it. The shim is found at --shim, else $PTXMIG_SHIM, else libptxmig.so next to ptxmig, in\n" +
			"../lib, or in /usr/local/lib. Shim settings (environment): PTXMIG_SAMPLE_FIRST (time the first\n" +
			"N launches of each kernel, default 20), PTXMIG_SAMPLE_EVERY (then 1 in M, default 100; 0\n" +
			"stops), PTXMIG_CAPTURE_MAX_MB (module bytes kept, default 2048), PTXMIG_SELF_TIME=1 (measure\n" +
			"the shim's own time per launch; `ptxmig kernels` reports it), PTXMIG_DEBUG=1 (log to stderr),\n" +
			"PTXMIG_MID_BLOCK_MAX_MB (device memory for one mid-block twin launch's save areas, default\n" +
			"2048; a launch needing more stops between blocks only).\n\n" +
			"Preemption: with --preempt auto or always the shim loads twins of the app's PTX kernels that\n" +
			"stop between blocks when ptxmig checkpoints the app. Kernels with safe points inside their\n" +
			"blocks (polled loops, CTA-wide barriers) also get a mid-block twin that stops there, saving\n" +
			"registers and shared memory, so a kernel whose blocks run for minutes stops within\n" +
			"microseconds instead of holding the checkpoint until they end. By default (auto) the shim\n" +
			"launches the mid-block twin only where a block twin could not stop in time: a grid that fits\n" +
			"in one wave of resident blocks, or blocks expected to run longer than half of\n" +
			"PTXMIG_PREEMPT_MIN_US; other launches get the cheaper block twin. --mid-block makes every twin\n" +
			"mid-block (other long kernels ran slower: matrixMul 1.4x, docs/BENCHMARKS.md); --mid-block=false\n" +
			"keeps block twins only. `ptxmig kernels PID` shows which kernels have which twin.\n\n" +
			"Owned memory: with --owned-memory the shim serves the app's cuMemAlloc and cuMemAllocPitch of\n" +
			"at least PTXMIG_OWNED_MIN_KB (default 1024) from CUDA VMM mappings of its own. A checkpoint then\n" +
			"copies that memory out itself at link speed (skipping chunks unchanged since the process's\n" +
			"previous image, found by a GPU hash) and releases it before the driver checkpoint, which has\n" +
			"none of it to copy; a restore maps it again at the same addresses and loads it back. Memory\n" +
			"the shim does not own (smaller or stream-ordered allocations, peer access in use, VMM out of\n" +
			"memory) is left to the driver, as without the flag. Owned memory cannot be shared by CUDA IPC.\n\n" +
			"Jobs: NCCL's default transports map GPU memory between the ranks, which the NVIDIA driver\n" +
			"cannot restore, so ptxmig refuses to checkpoint such a job. --nccl-sockets starts it with the\n" +
			"transports it can take: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_CUMEM_ENABLE=0 (the ranks\n" +
			"exchange data through sockets: slower collectives) and USE_LIBUV=0 (PyTorch's TCPStore\n" +
			"without libuv), and it implies --no-io-uring (torchrun's agent creates an io_uring instance\n" +
			"through libuv whatever its store is told). Nothing is changed without the flag; a variable\n" +
			"already set to another value stops ptxmig run (125).\n\n" +
			"Peer access: a process that enabled peer access between its GPUs (XLA does in every JAX\n" +
			"process on a host with several GPUs; PyTorch for copies between GPUs) has it turned off by the\n" +
			"shim for each checkpoint, after the quiesce, and on again when it resumes (driver 580 restores\n" +
			"such a process only so); one that also holds a cudaMalloc allocation over 256 MiB is refused\n" +
			"(driver 580 cannot give peer access back toward it after a restore; JAX preallocates one, and\n" +
			"XLA_PYTHON_CLIENT_PREALLOCATE=false helps only while its buffers stay small). --no-peer-access\n" +
			"instead makes its GPUs answer as a pair without a\n" +
			"peer path (PCIe without P2P: cuDeviceCanAccessPeer 0, an enable refused as unsupported) and\n" +
			"sets NCCL_P2P_DISABLE=1: frameworks then copy between the GPUs through host memory (slower)\n" +
			"and no peer access is ever on. It changes nothing on a host with one GPU.\n\n" +
			"io_uring: CRIU cannot checkpoint an io_uring instance, so ptxmig refuses a process that holds\n" +
			"one. --no-io-uring starts CMD with a seccomp filter under which io_uring_setup(2) fails with\n" +
			"ENOSYS, as on a kernel without io_uring; programs that use it when it is there (libuv, in\n" +
			"PyTorch's TCPStore and torchrun's agent) fall back to epoll. Every other system call is untouched;\n" +
			"the filter is inherited by CMD's children and restored with them. Without CAP_SYS_ADMIN the\n" +
			"kernel asks for no_new_privs first, so setuid programs started by CMD then gain no privileges.\n\n" +
			"Examples:\n" +
			"   ptxmig run -- python3 train.py --steps 200\n" +
			"   ptxmig run --nccl-sockets -- python3 train_ddp.py   # ranks by mp.spawn: a checkpointable job\n" +
			"   ptxmig run --nccl-sockets -- torchrun --standalone --nproc-per-node 4 train_ddp.py\n" +
			"   ptxmig run --no-io-uring -- python3 serve.py   # io_uring_setup fails, libuv uses epoll\n" +
			"   ptxmig run --no-peer-access -- python3 jax_train.py   # JAX on several GPUs, no peer access\n" +
			"   ptxmig run --preempt always ./longgrid --seconds 30\n" +
			"   ptxmig run --mid-block -- ./longkernel --seconds 600   # stop inside its blocks\n" +
			"   ptxmig run --mid-block=false -- python3 jit_app.py   # block-granular twins only\n" +
			"   ptxmig run --owned-memory -- python3 serve.py   # checkpoints copy GPU memory at link speed\n" +
			"   ptxmig run --socket-dir /tmp/ptxmig -- ./app > app.log 2>&1 &   # $! is the app's PID",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "shim", Usage: "`PATH` of libptxmig.so", EnvVars: []string{"PTXMIG_SHIM"}},
			&cli.StringFlag{Name: "preempt", Value: "auto", EnvVars: []string{"PTXMIG_PREEMPT"},
				Usage: "preemptible kernels (`MODE`): auto (twins for long or untimed kernels), always, or off (launch originals only)"},
			&cli.BoolFlag{Name: "mid-block",
				Usage: "every twin also stops inside a block where the kernel allows it (costs other kernels time); --mid-block=false: block-granular twins only; without the flag, $PTXMIG_MID_BLOCK (auto, 1 or 0) decides, else auto (see above)"},
			&cli.BoolFlag{Name: "owned-memory", EnvVars: []string{"PTXMIG_OWNED_MEMORY"},
				Usage: "the shim serves device allocations from VMM mappings it moves itself at checkpoint and restore (fast; no CUDA IPC of them)"},
			&cli.BoolFlag{Name: "nccl-sockets",
				Usage: "a multi-process NCCL job that ptxmig can checkpoint: its ranks exchange data through sockets (" + strings.Join(ncclSocketEnv, " ") + "); implies --no-io-uring"},
			&cli.BoolFlag{Name: "no-peer-access",
				Usage: "CMD's GPUs answer as a pair without a peer path (no peer access, NCCL_P2P_DISABLE=1): never any peer access to turn off"},
			&cli.BoolFlag{Name: "no-io-uring",
				Usage: "io_uring_setup(2) fails with ENOSYS in CMD and its children (a seccomp filter), so that nothing holds an io_uring instance, which CRIU cannot checkpoint"},
			socketDirFlag(),
		},
		Action: runAction,
	})
}

// socketDirFlag is shared by the commands that reach the shim's control socket.
func socketDirFlag() cli.Flag {
	return &cli.StringFlag{Name: "socket-dir", Value: shimctl.DefaultSocketDir, EnvVars: []string{"PTXMIG_SOCKET_DIR"},
		Usage: "`DIR` of the shim's control sockets"}
}

// errShimNotFound: no libptxmig.so at any of the places looked at.
var errShimNotFound = errors.New("libptxmig.so not found")

// findShim returns the shim library to preload: explicit path first, then the places an
// installation puts it relative to the ptxmig executable.
func findShim(explicit, exe string) (string, error) {
	if explicit != "" {
		st, err := os.Stat(explicit)
		if err != nil {
			return "", fmt.Errorf("--shim %s: %w", explicit, err)
		}
		if st.IsDir() {
			return "", fmt.Errorf("--shim %s: is a directory", explicit)
		}
		return filepath.Abs(explicit)
	}
	var tried []string
	cands := []string{}
	if exe != "" {
		dir := filepath.Dir(exe)
		cands = append(cands, filepath.Join(dir, "libptxmig.so"), filepath.Join(dir, "..", "lib", "libptxmig.so"))
	}
	cands = append(cands, "/usr/local/lib/libptxmig.so")
	for _, c := range cands {
		if st, err := os.Stat(c); err == nil && st.Mode().IsRegular() {
			return filepath.Abs(c)
		}
		tried = append(tried, c)
	}
	return "", fmt.Errorf("%w (tried %s); pass --shim PATH or set PTXMIG_SHIM", errShimNotFound, strings.Join(tried, ", "))
}

// preloadEnv returns env with the shim first in LD_PRELOAD (keeping what was there) and the
// shim's settings (name → value; each replaces an inherited definition).
func preloadEnv(env []string, shim string, settings map[string]string) []string {
	out := make([]string, 0, len(env)+1+len(settings))
	preload := shim
	for _, kv := range env {
		name, val, _ := strings.Cut(kv, "=")
		switch _, set := settings[name]; {
		case name == "LD_PRELOAD":
			if val != "" {
				preload = shim + " " + val
			}
		case set:
		default:
			out = append(out, kv)
		}
	}
	out = append(out, "LD_PRELOAD="+preload)
	names := make([]string, 0, len(settings))
	for k := range settings {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		out = append(out, k+"="+settings[k])
	}
	return out
}

// maxSocketDirLen: the shim binds <dir>/<pid>.sock, a socket path holds at most 107 bytes
// (sun_path) and a PID at most 7 digits (pid_max <= 4194304).
const maxSocketDirLen = 107 - len("/4194304.sock")

// checkSocketDir refuses a socket directory the shim could not use: it creates the directory
// itself (mode 0700, last component only) and binds <pid>.sock in it. After the exec nobody would
// report the problem; the shim only logs it under PTXMIG_DEBUG=1.
func checkSocketDir(dir string) error {
	if !filepath.IsAbs(dir) {
		return exitcode.Usagef("run: --socket-dir %q must be absolute", dir)
	}
	if len(dir) > maxSocketDirLen {
		return exitcode.Usagef("run: --socket-dir %q is %d bytes, over %d: <pid>.sock under it would not fit a socket path", dir, len(dir), maxSocketDirLen)
	}
	const fix = "pass --socket-dir DIR or set PTXMIG_SOCKET_DIR"
	st, err := os.Stat(dir)
	switch {
	case err == nil && !st.IsDir():
		return exitcode.Refusedf("run: --socket-dir %s is not a directory; %s", dir, fix)
	case err == nil:
		if err := unix.Access(dir, unix.W_OK|unix.X_OK); err != nil {
			return exitcode.Refusedf("run: --socket-dir %s: the shim cannot create its socket there: %v; %s", dir, err, fix)
		}
	case errors.Is(err, fs.ErrNotExist):
		parent := filepath.Dir(filepath.Clean(dir))
		if pst, err := os.Stat(parent); err != nil || !pst.IsDir() {
			return exitcode.Refusedf("run: --socket-dir %s does not exist, nor does its parent directory %s (the shim creates the last component only); %s", dir, parent, fix)
		}
		if err := unix.Access(parent, unix.W_OK|unix.X_OK); err != nil {
			return exitcode.Refusedf("run: --socket-dir %s does not exist and the shim cannot create it in %s: %v; %s", dir, parent, err, fix)
		}
	default:
		return exitcode.Refusedf("run: --socket-dir %s: %v; %s", dir, err, fix)
	}
	return nil
}

// lookCommand finds CMD as execvp would (through $PATH unless the name holds a slash).
func lookCommand(name string) (string, error) {
	path, err := exec.LookPath(name)
	if err == nil {
		return path, nil
	}
	var ee *exec.Error
	switch {
	case errors.Is(err, exec.ErrNotFound):
		return "", exitcode.Wrap(exitcode.RunNotFound, fmt.Errorf("command %q not found in $PATH", esc(name)))
	case errors.As(err, &ee) && errors.Is(ee.Err, fs.ErrNotExist):
		return "", exitcode.Wrap(exitcode.RunNotFound, fmt.Errorf("command %s not found", esc(name)))
	case errors.As(err, &ee) && errors.Is(ee.Err, fs.ErrPermission):
		return "", exitcode.Wrap(exitcode.RunNoExec, fmt.Errorf("command %s is not an executable file", esc(name)))
	}
	return "", exitcode.Wrap(exitcode.RunNoExec, fmt.Errorf("command %s: %w", esc(name), err))
}

// runAction checks everything that can be checked, then execs CMD in place of ptxmig: CMD keeps
// ptxmig's PID, parent, session, terminal and file descriptors, and no ptxmig process is left to
// wait for it, forward signals or write to its files (a wrapper that outlives CMD breaks CRIU's
// restore of CMD: it writes into the files CMD shares with it). CMD's exit status is its own;
// ptxmig run's own failures exit 125, 126 or 127 (run maps every other status to 125).
// ncclSocketEnv is what --nccl-sockets sets: NCCL transports a driver checkpoint can take (no GPU
// or host memory mapped between the ranks) and PyTorch's TCPStore without libuv's io_uring, which
// CRIU cannot dump (2x H200, 2026-11-28: a 2-rank DDP job started so was checkpointed whole with
// --leave-running and ran on; docs/PLATFORM.md).
var ncclSocketEnv = []string{"NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1", "NCCL_CUMEM_ENABLE=0", "USE_LIBUV=0"}

// noPeerEnv is what --no-peer-access sets: the shim answers for GPUs without a peer path, and
// NCCL (whose own P2P transport does not ask the CUDA API in every case) keeps off it too.
var noPeerEnv = []string{"PTXMIG_PEER_ACCESS=0", "NCCL_P2P_DISABLE=1"}

func runAction(c *cli.Context) error {
	args := c.Args().Slice()
	if len(args) > 0 && args[0] == "--" {
		args = args[1:]
	}
	if len(args) == 0 {
		return exitcode.Usagef("run: no command given: ptxmig run [--shim PATH] [--socket-dir DIR] -- CMD [ARGS...]")
	}
	mode := c.String("preempt")
	switch mode {
	case "auto", "always", "off":
	default:
		return exitcode.Usagef("run: --preempt %q: want auto, always or off", mode)
	}
	sockDir := c.String("socket-dir")
	if err := checkSocketDir(sockDir); err != nil {
		return err
	}
	exe, _ := os.Executable()
	shim, err := findShim(c.String("shim"), exe)
	if err != nil {
		return exitcode.Wrap(exitcode.Refused, fmt.Errorf("run: %w", err))
	}
	path, err := lookCommand(args[0])
	if err != nil {
		return exitcode.Wrap(exitcode.Of(err), fmt.Errorf("run: %w; nothing was started", err))
	}
	settings := map[string]string{"PTXMIG_SOCKET_DIR": sockDir, "PTXMIG_PREEMPT": mode, "PTXMIG_MID_BLOCK": "0"}
	mb, err := midBlockSetting(c)
	if err != nil {
		return err
	}
	settings["PTXMIG_MID_BLOCK"] = mb
	settings["PTXMIG_OWNED_MEMORY"] = "0"
	if c.Bool("owned-memory") {
		settings["PTXMIG_OWNED_MEMORY"] = "1"
	}
	for _, f := range []struct {
		flag string
		env  []string
	}{{"nccl-sockets", ncclSocketEnv}, {"no-peer-access", noPeerEnv}} {
		if !c.Bool(f.flag) {
			continue
		}
		for _, kv := range f.env {
			k, v, _ := strings.Cut(kv, "=")
			if have, ok := os.LookupEnv(k); ok && have != v {
				return exitcode.Usagef("run: --%s sets %s, which the environment sets to %q: unset it or drop the flag", f.flag, kv, have)
			}
			settings[k] = v
		}
	}
	if exe != "" {
		settings["PTXMIG_HELPER"] = exe // the shim instruments PTX with `ptxmig ptx instrument`, outside the app
	}
	if os.Geteuid() != 0 && os.Getenv("PTXMIG_PTX_CACHE") == "" {
		// The shim refuses a cache directory writable by others or owned by another user: a
		// non-root app gets its own (root's default is /var/cache/ptxmig/ptx).
		if dir, err := os.UserCacheDir(); err == nil {
			settings["PTXMIG_PTX_CACHE"] = filepath.Join(dir, "ptxmig", "ptx")
		}
	}
	envv := preloadEnv(os.Environ(), shim, settings)
	env(c).Log.Debug("run: exec", "path", path, "shim", shim, "socket_dir", sockDir, "cmd", args)

	// Hand back the signals main asked for: a SIGINT or SIGHUP that was ignored when ptxmig
	// started is ignored again (exec keeps ignored signals, and resets handled ones to default).
	// Limit: other signals ignored at start (SIGQUIT, SIGTERM…) reach CMD with their default
	// action, since the Go runtime handles them from startup and keeps no readable record of
	// the inherited disposition. A signal that came in meanwhile cancelled the context: then
	// CMD is not started.
	signal.Reset()
	if err := c.Context.Err(); err != nil {
		return fmt.Errorf("run: %w before %s was started", err, args[0])
	}
	// A session whose leader is outside this PID namespace (session 0 here: `docker exec`
	// without a terminal, CI runners) cannot be checkpointed by CRIU: CMD gets a session of its
	// own instead. (Elsewhere CMD keeps ptxmig's session; there is no terminal to lose here.)
	if st, err := proc.ReadStat(os.Getpid()); err == nil && st.SID == 0 {
		if _, err := unix.Setsid(); err != nil {
			env(c).Log.Debug("run: cannot start a session for CMD", "err", err)
		}
	}
	if c.Bool("no-io-uring") || c.Bool("nccl-sockets") {
		// Last, right before the exec: the filter binds ptxmig's own threads as well.
		newPrivs, err := seccomp.DenyIOURing()
		if err != nil {
			return exitcode.Wrap(exitcode.RunFailed, fmt.Errorf("run: --no-io-uring: %w; nothing was started", err))
		}
		if !newPrivs {
			env(c).Log.Debug("run: no_new_privs set for the seccomp filter (no CAP_SYS_ADMIN)")
		}
	}
	err = unix.Exec(path, args, envv)
	// Still here: the kernel refused the exec (format, permissions, resources); nothing started.
	if errors.Is(err, unix.ENOENT) {
		err = fmt.Errorf("%w (its #! interpreter or ELF loader is missing)", err)
	}
	return exitcode.Wrap(exitcode.RunNoExec, fmt.Errorf("run: exec %s: %w", esc(path), err))
}

// midBlockDefault is the shim's PTXMIG_MID_BLOCK when neither --mid-block nor the environment
// says: "auto", a kernel's second, mid-block twin only where its block twin could not stop in time.
const midBlockDefault = "auto"

// midBlockSetting is the shim's PTXMIG_MID_BLOCK: "1" (--mid-block: every twin mid-block), "0"
// (--mid-block=false: block twins only) or "auto"; without the flag the environment's
// PTXMIG_MID_BLOCK (auto, or a boolean), else midBlockDefault.
func midBlockSetting(c *cli.Context) (string, error) {
	if c.IsSet("mid-block") {
		if c.Bool("mid-block") {
			return "1", nil
		}
		return "0", nil
	}
	v, ok := os.LookupEnv("PTXMIG_MID_BLOCK")
	if !ok || v == "" {
		return midBlockDefault, nil
	}
	if v == "auto" {
		return v, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return "", exitcode.Usagef("run: PTXMIG_MID_BLOCK=%q: want auto, 1 or 0", v)
	}
	if b {
		return "1", nil
	}
	return "0", nil
}
