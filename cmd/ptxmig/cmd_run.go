package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/shimctl"
)

func init() {
	register(&cli.Command{
		Name:      "run",
		Usage:     "start a command with the ptxmig shim (libptxmig.so) preloaded",
		ArgsUsage: "-- CMD [ARGS...]",
		Description: "The shim sees every CUDA module load and kernel launch of CMD and opens a control socket\n" +
			"<socket-dir>/<pid>.sock on CMD's first CUDA call; `ptxmig kernels PID` and `ptxmig modules PID`\n" +
			"read it. CMD's environment, output and exit status are unchanged; an existing LD_PRELOAD is kept.\n" +
			"The shim is found at --shim, else $PTXMIG_SHIM, else libptxmig.so next to ptxmig, in ../lib, or\n" +
			"in /usr/local/lib. Shim settings (environment): PTXMIG_SAMPLE_FIRST (time the first N launches\n" +
			"of each kernel, default 20), PTXMIG_SAMPLE_EVERY (then 1 in M, default 100; 0 stops),\n" +
			"PTXMIG_CAPTURE_MAX_MB (module bytes kept, default 2048), PTXMIG_SELF_TIME=1 (measure the\n" +
			"shim's own time per launch; `ptxmig kernels` reports it), PTXMIG_DEBUG=1 (log to stderr).\n\n" +
			"   ptxmig run -- python3 train.py --steps 200",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "shim", Usage: "path of libptxmig.so", EnvVars: []string{"PTXMIG_SHIM"}},
			socketDirFlag(),
		},
		Action: runAction,
	})
}

// socketDirFlag is shared by the commands that reach the shim's control socket.
func socketDirFlag() cli.Flag {
	return &cli.StringFlag{Name: "socket-dir", Value: shimctl.DefaultSocketDir, EnvVars: []string{"PTXMIG_SOCKET_DIR"},
		Usage: "directory of the shim's control sockets"}
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
// socket directory set for the shim.
func preloadEnv(env []string, shim, socketDir string) []string {
	out := make([]string, 0, len(env)+2)
	preload := shim
	for _, kv := range env {
		switch {
		case strings.HasPrefix(kv, "LD_PRELOAD="):
			if old := strings.TrimPrefix(kv, "LD_PRELOAD="); old != "" {
				preload = shim + " " + old
			}
		case strings.HasPrefix(kv, "PTXMIG_SOCKET_DIR="):
		default:
			out = append(out, kv)
		}
	}
	return append(out, "LD_PRELOAD="+preload, "PTXMIG_SOCKET_DIR="+socketDir)
}

func runAction(c *cli.Context) error {
	args := c.Args().Slice()
	if len(args) > 0 && args[0] == "--" {
		args = args[1:]
	}
	if len(args) == 0 {
		return exitcode.Usagef("run: no command given: ptxmig run [--shim PATH] [--socket-dir DIR] -- CMD [ARGS...]")
	}
	exe, _ := os.Executable()
	shim, err := findShim(c.String("shim"), exe)
	if err != nil {
		return exitcode.Wrap(exitcode.Refused, fmt.Errorf("run: %w", err))
	}
	sockDir := c.String("socket-dir")
	if !filepath.IsAbs(sockDir) {
		return exitcode.Usagef("run: --socket-dir %q must be absolute", sockDir)
	}
	path, err := exec.LookPath(args[0])
	if err != nil {
		return exitcode.Wrap(exitcode.Refused, fmt.Errorf("run: %w", err))
	}
	cmd := exec.Command(path, args[1:]...)
	cmd.Args[0] = args[0]
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, env(c).Out, env(c).Err
	cmd.Env = preloadEnv(os.Environ(), shim, sockDir)
	env(c).Log.Debug("run", "shim", shim, "socket_dir", sockDir, "cmd", args)

	// Forward signals to the child. A terminal delivers SIGINT/SIGQUIT/SIGTSTP to the whole
	// foreground group, so those are forwarded only when stdin is not a terminal.
	sigs := []os.Signal{syscall.SIGTERM, syscall.SIGHUP, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGINT, syscall.SIGQUIT}
	ch := make(chan os.Signal, 8)
	signal.Notify(ch, sigs...)
	defer signal.Stop(ch)
	tty := term.IsTerminal(int(os.Stdin.Fd()))
	if err := cmd.Start(); err != nil {
		return exitcode.Wrap(exitcode.Failed, fmt.Errorf("run %s: %w", args[0], err))
	}
	done := make(chan struct{})
	go func() {
		for {
			select {
			case s := <-ch:
				if tty && (s == syscall.SIGINT || s == syscall.SIGQUIT) {
					continue
				}
				_ = cmd.Process.Signal(s)
			case <-done:
				return
			}
		}
	}()
	err = cmd.Wait()
	close(done)
	return childStatus(args[0], err)
}

// childStatus turns the child's end into ptxmig's: the same exit status, or 128+N for signal N.
func childStatus(name string, err error) error {
	if err == nil {
		return nil
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return fmt.Errorf("run %s: %w", name, err)
	}
	if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return exitcode.Wrap(128+int(ws.Signal()), fmt.Errorf("%s killed by signal %v", name, ws.Signal()))
	}
	return exitcode.Wrap(ee.ExitCode(), fmt.Errorf("%s exited with status %d", name, ee.ExitCode()))
}
