package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/exitcode"
	procpkg "github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

func TestPreloadEnv(t *testing.T) {
	tests := []struct {
		name string
		in   []string
		want []string
	}{
		{"none", []string{"A=1"}, []string{"A=1", "LD_PRELOAD=/s.so", "PTXMIG_SOCKET_DIR=/run/x"}},
		{"kept", []string{"LD_PRELOAD=/other.so:/x.so", "B=2"}, []string{"B=2", "LD_PRELOAD=/s.so /other.so:/x.so", "PTXMIG_SOCKET_DIR=/run/x"}},
		{"empty", []string{"LD_PRELOAD="}, []string{"LD_PRELOAD=/s.so", "PTXMIG_SOCKET_DIR=/run/x"}},
		{"socket dir replaced", []string{"PTXMIG_SOCKET_DIR=/old"}, []string{"LD_PRELOAD=/s.so", "PTXMIG_SOCKET_DIR=/run/x"}},
	}
	for _, tt := range tests {
		if got := preloadEnv(tt.in, "/s.so", map[string]string{"PTXMIG_SOCKET_DIR": "/run/x"}); !reflect.DeepEqual(got, tt.want) {
			t.Errorf("%s: preloadEnv = %q, want %q", tt.name, got, tt.want)
		}
	}
	got := preloadEnv([]string{"PTXMIG_PREEMPT=off", "PTXMIG_HELPERX=1"}, "/s.so", map[string]string{"PTXMIG_PREEMPT": "auto", "PTXMIG_HELPER": "/bin/ptxmig"})
	want := []string{"PTXMIG_HELPERX=1", "LD_PRELOAD=/s.so", "PTXMIG_HELPER=/bin/ptxmig", "PTXMIG_PREEMPT=auto"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("settings: preloadEnv = %q, want %q", got, want)
	}
}

func TestFindShim(t *testing.T) {
	dir := t.TempDir()
	bin, lib := filepath.Join(dir, "bin"), filepath.Join(dir, "lib")
	os.MkdirAll(bin, 0o755)
	os.MkdirAll(lib, 0o755)
	exe := filepath.Join(bin, "ptxmig")
	if _, err := findShim(filepath.Join(dir, "nope.so"), exe); err == nil {
		t.Fatal("missing --shim accepted")
	}
	os.WriteFile(filepath.Join(lib, "libptxmig.so"), []byte("x"), 0o644)
	got, err := findShim("", exe)
	if err != nil || got != filepath.Join(lib, "libptxmig.so") {
		t.Fatalf("../lib: %q %v", got, err)
	}
	os.WriteFile(filepath.Join(bin, "libptxmig.so"), []byte("x"), 0o644)
	if got, _ := findShim("", exe); got != filepath.Join(bin, "libptxmig.so") {
		t.Fatalf("next to the executable: %q", got)
	}
	if _, err := os.Stat("/usr/local/lib/libptxmig.so"); err != nil {
		if _, err := findShim("", filepath.Join(t.TempDir(), "ptxmig")); !errors.Is(err, errShimNotFound) {
			t.Fatalf("no shim anywhere: %v", err)
		}
	}
}

// TestCheckSocketDir: the socket directory must let the shim bind <pid>.sock after the exec.
func TestCheckSocketDir(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	longest := dir + "/" + strings.Repeat("x", maxSocketDirLen-len(dir)-1)
	type socketDirCase struct {
		name, dir string
		code      int // 0: accepted
	}
	tests := []socketDirCase{
		{"existing", dir, 0},
		{"trailing slash", dir + "/", 0},
		{"created by the shim", filepath.Join(dir, "sock"), 0},
		{"longest", longest, 0},
		{"relative", "sock", exitcode.Usage},
		{"too long", longest + "x", exitcode.Usage},
		{"parent missing", filepath.Join(dir, "a", "b"), exitcode.Refused},
		{"a file", file, exitcode.Refused},
		{"under a file", filepath.Join(file, "sock"), exitcode.Refused},
	}
	if os.Geteuid() != 0 { // root may write anywhere
		ro := filepath.Join(dir, "ro")
		if err := os.Mkdir(ro, 0o500); err != nil {
			t.Fatal(err)
		}
		tests = append(tests, socketDirCase{"not writable", ro, exitcode.Refused},
			socketDirCase{"parent not writable", filepath.Join(ro, "sock"), exitcode.Refused})
	}
	for _, tt := range tests {
		code := 0
		if err := checkSocketDir(tt.dir); err != nil {
			code = exitcode.Of(err)
		}
		if code != tt.code {
			t.Errorf("%s: checkSocketDir(%q): exit %d, want %d", tt.name, tt.dir, code, tt.code)
		}
	}
}

// TestShimReadersExitCodes: kernels and modules refuse a process without a socket, and bad PIDs.
func TestShimReadersExitCodes(t *testing.T) {
	if _, _, code := runCLI(t, "kernels", "--socket-dir", t.TempDir(), strconv.Itoa(os.Getpid())); code != exitcode.Refused {
		t.Errorf("kernels of a process without a socket: exit %d, want 3", code)
	}
	if _, _, code := runCLI(t, "kernels", "4194304"); code != exitcode.NotFound {
		t.Errorf("kernels of no process: exit %d, want 6", code)
	}
	if _, _, code := runCLI(t, "modules", "abc"); code != exitcode.Usage {
		t.Errorf("modules abc: exit %d, want 2", code)
	}
}

// runFixture: a ptxmig binary and stand-in shim libraries. ptxmig run execs, so it is tested
// through the real binary, never in-process.
type runFixture struct {
	bin, shim, other, sock string
}

func newRunFixture(t *testing.T) runFixture {
	t.Helper()
	cc, err := exec.LookPath("cc")
	if err != nil {
		testreq.Skip(t, "cc", "no C compiler (cc) to build a stand-in shim library for LD_PRELOAD")
	}
	dir := t.TempDir()
	f := runFixture{bin: filepath.Join(dir, "bin", "ptxmig"), shim: filepath.Join(dir, "lib", "libstand-in.so"),
		other: filepath.Join(dir, "lib", "libother.so"), sock: filepath.Join(dir, "sock")}
	if out, err := exec.Command("go", "build", "-o", f.bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	if err := os.Mkdir(filepath.Dir(f.shim), 0o755); err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(dir, "stand-in.c")
	if err := os.WriteFile(src, []byte("int ptxmig_stand_in;\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, lib := range []string{f.shim, f.other} {
		if out, err := exec.Command(cc, "-shared", "-fPIC", "-o", lib, src).CombinedOutput(); err != nil {
			t.Fatalf("cc: %v\n%s", err, out)
		}
	}
	return f
}

// cmd returns ptxmig with an environment free of the variables run reads or sets, plus extra.
func (f runFixture) cmd(args []string, extra ...string) *exec.Cmd {
	c := exec.Command(f.bin, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "LD_PRELOAD=") && !strings.HasPrefix(kv, "PTXMIG_") {
			c.Env = append(c.Env, kv)
		}
	}
	c.Env = append(c.Env, extra...)
	return c
}

// runArgs: ptxmig run with the stand-in shim and the fixture's socket directory.
func (f runFixture) runArgs(cmd ...string) []string {
	return append([]string{"run", "--shim", f.shim, "--socket-dir", f.sock, "--"}, cmd...)
}

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// TestRun checks the exec model with real processes: the app is ptxmig's process, with the shim
// preloaded, its exit status and death are its own, and ptxmig writes nothing once it has started.
func TestRun(t *testing.T) {
	f := newRunFixture(t)

	t.Run("the app replaces ptxmig", func(t *testing.T) {
		c := f.cmd(f.runArgs("sh", "-c", "echo $$; exec sleep 30"), "LD_PRELOAD="+f.other)
		stdout, err := c.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = c.Process.Kill(); _ = c.Wait() }()
		pid := c.Process.Pid
		line, err := bufio.NewReader(stdout).ReadString('\n')
		if err != nil {
			t.Fatalf("reading the app's pid: %v", err)
		}
		if got := strings.TrimSpace(line); got != strconv.Itoa(pid) {
			t.Fatalf("the app's pid is %s, ptxmig's was %d: not the same process", got, pid)
		}
		proc := "/proc/" + strconv.Itoa(pid)
		waitFor(t, "the app to exec sleep", func() bool {
			exe, _ := os.Readlink(proc + "/exe")
			return filepath.Base(exe) == "sleep"
		})
		stat, err := os.ReadFile(proc + "/stat")
		if err != nil {
			t.Fatal(err)
		}
		if fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:])); fields[1] != strconv.Itoa(os.Getpid()) {
			t.Errorf("the app's parent is %s, want ptxmig's parent %d", fields[1], os.Getpid())
		}
		// The exe link changes before the new image's environment is set up (execve fills
		// env_start/env_end later): an empty environ is the exec still under way.
		var environ []byte
		waitFor(t, "the app's environment", func() bool {
			environ, err = os.ReadFile(proc + "/environ")
			return err != nil || len(environ) > 0
		})
		if err != nil {
			t.Fatal(err)
		}
		vars := strings.Split(string(environ), "\x00")
		for _, want := range []string{"LD_PRELOAD=" + f.shim + " " + f.other, "PTXMIG_SOCKET_DIR=" + f.sock} {
			if !slices.Contains(vars, want) {
				t.Errorf("the app's environment lacks %s: %q", want, vars)
			}
		}
		// /proc/PID/exe names sleep as soon as the exec is done, before the dynamic loader has
		// mapped the preloaded libraries: wait for them.
		waitFor(t, "the shim "+f.shim+" mapped in the app", func() bool {
			maps, err := os.ReadFile(proc + "/maps")
			return err == nil && strings.Contains(string(maps), f.shim)
		})
		// No process of ptxmig's binary is left anywhere.
		procs, _ := filepath.Glob("/proc/[0-9]*/exe")
		for _, p := range procs {
			if exe, _ := os.Readlink(p); exe == f.bin {
				t.Errorf("%s still runs ptxmig", filepath.Dir(p))
			}
		}
	})

	t.Run("environment flags", func(t *testing.T) {
		// --nccl-sockets sets the job's transports, --no-peer-access tells the shim to answer for
		// GPUs without a peer path and keeps NCCL's P2P off; without them nothing is set; an
		// agreeing environment is fine; a conflicting value is ptxmig run's own failure (125), and
		// nothing starts.
		for _, tc := range []struct {
			flag, show, want, unset, agree, conflict, names string
		}{
			{"--nccl-sockets", `echo "$NCCL_P2P_DISABLE|$NCCL_SHM_DISABLE|$NCCL_CUMEM_ENABLE|$USE_LIBUV"`, "1|1|0|0\n", "|||\n",
				"NCCL_P2P_DISABLE=1", "NCCL_CUMEM_ENABLE=1", "NCCL_CUMEM_ENABLE"},
			{"--no-peer-access", `echo "$PTXMIG_PEER_ACCESS|$NCCL_P2P_DISABLE"`, "0|1\n", "|\n",
				"NCCL_P2P_DISABLE=1", "NCCL_P2P_DISABLE=0", "--no-peer-access sets NCCL_P2P_DISABLE=1"},
		} {
			args := []string{"run", tc.flag, "--shim", f.shim, "--socket-dir", f.sock, "--", "sh", "-c", tc.show}
			if out, err := f.cmd(args).Output(); err != nil || string(out) != tc.want {
				t.Errorf("%s: %q %v, want %q", tc.flag, out, err, tc.want)
			}
			if out, err := f.cmd(f.runArgs("sh", "-c", tc.show)).Output(); err != nil || string(out) != tc.unset {
				t.Errorf("without %s: %q %v", tc.flag, out, err)
			}
			if out, err := f.cmd(args, tc.agree).Output(); err != nil || string(out) != tc.want {
				t.Errorf("%s with %s: %q %v", tc.flag, tc.agree, out, err)
			}
			c := f.cmd(args, tc.conflict)
			var errb bytes.Buffer
			c.Stderr = &errb
			err := c.Run()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != 125 || !strings.Contains(errb.String(), tc.names) { // run's own failure
				t.Errorf("%s against %s: %v, %s", tc.flag, tc.conflict, err, errb.String())
			}
		}
	})

	t.Run("no io_uring", func(t *testing.T) {
		// --no-io-uring (and --nccl-sockets, which implies it) starts the app under one more
		// seccomp filter than ptxmig's caller has (a container may have its own); without either
		// flag there is none more. What the filter does: internal/seccomp's and checkpoint's tests.
		own := seccompFilters(t, os.Getpid())
		show := `grep '^Seccomp_filters:' /proc/$$/status | cut -f2`
		for _, tc := range []struct {
			flags []string
			more  int
		}{{nil, 0}, {[]string{"--no-io-uring"}, 1}, {[]string{"--nccl-sockets"}, 1}} {
			args := append(append([]string{"run"}, tc.flags...), "--shim", f.shim, "--socket-dir", f.sock, "--", "sh", "-c", show)
			out, err := f.cmd(args).Output()
			if err != nil {
				t.Fatalf("%v: %v", tc.flags, err)
			}
			if got, want := strings.TrimSpace(string(out)), strconv.Itoa(own+tc.more); got != want {
				t.Errorf("%v: the app has %s seccomp filters, want %s", tc.flags, got, want)
			}
		}
	})

	t.Run("session", func(t *testing.T) {
		// The app keeps ptxmig's session, except where that session's leader is outside the PID
		// namespace (session 0 in /proc: docker exec, CI runners): CRIU cannot dump such a
		// process, so the app then leads a session of its own.
		out, err := f.cmd(f.runArgs("sh", "-c", `echo $$ $(cut -d' ' -f6 /proc/$$/stat)`)).Output()
		if err != nil {
			t.Fatal(err)
		}
		var pid, sid int
		if _, err := fmt.Sscan(string(out), &pid, &sid); err != nil {
			t.Fatalf("app printed %q: %v", out, err)
		}
		self, err := procpkg.ReadStat(os.Getpid())
		if err != nil {
			t.Fatal(err)
		}
		want := self.SID
		if self.SID == 0 {
			want = pid
		}
		if sid != want {
			t.Errorf("the app's session is %d, want %d (ptxmig's session %d)", sid, want, self.SID)
		}
	})

	t.Run("exit status is the app's", func(t *testing.T) {
		tests := []struct {
			script         string
			code           int
			sig            syscall.Signal // the app died of it
			stdout, stderr string
		}{
			{`echo "$LD_PRELOAD|$PTXMIG_SOCKET_DIR"`, 0, 0, f.shim + "|" + f.sock + "\n", ""},
			{`exit 3`, 3, 0, "", ""},
			{`exit 2`, 2, 0, "", ""},
			{`echo oops >&2; exit 1`, 1, 0, "", "oops\n"},
			{`kill -TERM $$`, -1, syscall.SIGTERM, "", ""},
			{`exit 125`, 125, 0, "", ""},
			{`exit 127`, 127, 0, "", ""},
		}
		for _, tt := range tests {
			c := f.cmd(f.runArgs("sh", "-c", tt.script))
			var out, errb bytes.Buffer
			c.Stdout, c.Stderr = &out, &errb
			err := c.Run()
			var ee *exec.ExitError
			if err != nil && !errors.As(err, &ee) {
				t.Fatalf("sh -c %q: %v", tt.script, err)
			}
			code, sig := c.ProcessState.ExitCode(), syscall.Signal(0)
			if ws := c.ProcessState.Sys().(syscall.WaitStatus); ws.Signaled() {
				sig = ws.Signal()
			}
			if code != tt.code || sig != tt.sig || out.String() != tt.stdout || errb.String() != tt.stderr {
				t.Errorf("run sh -c %q: exit %d signal %v stdout %q stderr %q; want %d %v %q %q",
					tt.script, code, sig, out.String(), errb.String(), tt.code, tt.sig, tt.stdout, tt.stderr)
			}
		}
	})

	t.Run("mid-block setting", func(t *testing.T) {
		// auto by default; --mid-block and PTXMIG_MID_BLOCK=1 make every twin mid-block, =false and
		// 0 none.
		tests := []struct {
			flags []string
			env   []string
			want  string
		}{
			{nil, nil, midBlockDefault + "\n"},
			{nil, []string{"PTXMIG_MID_BLOCK="}, midBlockDefault + "\n"},
			{[]string{"--mid-block"}, nil, "1\n"},
			{nil, []string{"PTXMIG_MID_BLOCK=1"}, "1\n"},
			{[]string{"--mid-block=false"}, []string{"PTXMIG_MID_BLOCK=1"}, "0\n"},
			{[]string{"--mid-block=false"}, nil, "0\n"},
			{nil, []string{"PTXMIG_MID_BLOCK=auto"}, "auto\n"},
			{nil, []string{"PTXMIG_MID_BLOCK=0"}, "0\n"},
			{nil, []string{"PTXMIG_MID_BLOCK=true"}, "1\n"},
			{[]string{"--mid-block"}, []string{"PTXMIG_MID_BLOCK=auto"}, "1\n"},
		}
		for _, tt := range tests {
			args := append(append([]string{"run", "--shim", f.shim, "--socket-dir", f.sock}, tt.flags...), "--", "sh", "-c", `echo "$PTXMIG_MID_BLOCK"`)
			out, err := f.cmd(args, tt.env...).Output()
			if err != nil || string(out) != tt.want {
				t.Errorf("run %v with %v: %v, PTXMIG_MID_BLOCK=%q, want %q", tt.flags, tt.env, err, out, tt.want)
			}
		}
		// A value the shim would not understand: refused before anything starts.
		args := []string{"run", "--shim", f.shim, "--socket-dir", f.sock, "--", "sh", "-c", "echo started"}
		out, err := f.cmd(args, "PTXMIG_MID_BLOCK=sometimes").Output()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 125 || len(out) != 0 {
			t.Errorf("run with PTXMIG_MID_BLOCK=sometimes: %v, output %q; want exit 125 and nothing", err, out)
		}
	})

	t.Run("words after CMD are CMD's", func(t *testing.T) {
		// No "--": flags of ptxmig end at CMD, like env(1); --json and --help here are the app's.
		c := f.cmd([]string{"run", "--shim", f.shim, "--socket-dir", f.sock, "sh", "-c", `echo "$1 $2"`, "x", "--json", "--help"})
		out, err := c.Output()
		if err != nil || string(out) != "--json --help\n" {
			t.Errorf("run sh -c ... --json --help: %v, stdout %q", err, out)
		}
	})

	t.Run("killed app: ptxmig writes nothing to its files", func(t *testing.T) {
		logPath := filepath.Join(t.TempDir(), "app.log")
		log, err := os.Create(logPath)
		if err != nil {
			t.Fatal(err)
		}
		defer log.Close()
		c := f.cmd(f.runArgs("sh", "-c", `echo "started $$"; exec sleep 30`))
		c.Stdout, c.Stderr = log, log
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		var first string
		waitFor(t, "the app's first line", func() bool {
			b, _ := os.ReadFile(logPath)
			first = string(b)
			return strings.HasSuffix(first, "\n")
		})
		appPid, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(first, "started ")))
		if err != nil {
			t.Fatalf("the app wrote %q", first)
		}
		if err := syscall.Kill(appPid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		err = c.Wait()
		if ws := c.ProcessState.Sys().(syscall.WaitStatus); !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
			t.Errorf("wait: %v, want death by SIGKILL", err)
		}
		if b, _ := os.ReadFile(logPath); string(b) != first {
			t.Errorf("the app's output file holds %q, want only the app's %q", b, first)
		}
	})

	t.Run("refusals start nothing", func(t *testing.T) {
		dir := t.TempDir()
		marker := filepath.Join(dir, "started")
		app := []string{"sh", "-c", "touch " + marker}
		plain := filepath.Join(dir, "plain")
		if err := os.WriteFile(plain, []byte("echo hi\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		badInterp := filepath.Join(dir, "bad-interp")
		if err := os.WriteFile(badInterp, []byte("#!/no/such/interpreter\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		type refusal struct {
			name string
			args []string
			code int
			msg  string
		}
		// ptxmig run's own failures: 125 (run itself), 126 (cannot execute), 127 (not found), as
		// env(1) and timeout(1); never a status the app could have returned itself.
		tests := []refusal{
			{"no command", []string{"run", "--shim", f.shim}, 125, "no command given"},
			{"no command after --", []string{"run", "--shim", f.shim, "--"}, 125, "no command given"},
			{"unknown flag", []string{"run", "--shim", f.shim, "--bogus", "--", app[0], app[1], app[2]}, 125, "flag provided but not defined"},
			{"bad --preempt", []string{"run", "--shim", f.shim, "--preempt", "sometimes", "--", app[0], app[1], app[2]}, 125, "--preempt"},
			{"bad global flag", []string{"--log-level", "loud", "run", "--shim", f.shim, "--", app[0], app[1], app[2]}, 125, "--log-level"},
			{"command not in PATH", f.runArgs("ptxmig-no-such-command"), 127, `command "ptxmig-no-such-command" not found in $PATH`},
			{"missing program", f.runArgs("/no/such/program"), 127, "command /no/such/program not found"},
			{"not executable", f.runArgs(plain), 126, "is not an executable file"},
			{"missing --shim", []string{"run", "--shim", "/no/such/libptxmig.so", "--", app[0], app[1], app[2]}, 125, "--shim /no/such/libptxmig.so"},
			{"relative socket dir", []string{"run", "--shim", f.shim, "--socket-dir", "sock", "--", app[0], app[1], app[2]}, 125, "must be absolute"},
			{"socket dir without parent", []string{"run", "--shim", f.shim, "--socket-dir", "/no/such/dir", "--", app[0], app[1], app[2]}, 125, "does not exist"},
			{"socket dir is a file", []string{"run", "--shim", f.shim, "--socket-dir", plain, "--", app[0], app[1], app[2]}, 125, "not a directory"},
			{"exec fails", f.runArgs(badInterp), 126, "interpreter"},
		}
		if _, err := os.Stat("/usr/local/lib/libptxmig.so"); err != nil {
			// The binary's own directory and ../lib hold no libptxmig.so.
			tests = append(tests, refusal{"no shim anywhere", []string{"run", "--", app[0], app[1], app[2]}, 125, "libptxmig.so not found"})
		}
		for _, tt := range tests {
			c := f.cmd(tt.args)
			var out, errb bytes.Buffer
			c.Stdout, c.Stderr = &out, &errb
			_ = c.Run()
			if code := c.ProcessState.ExitCode(); code != tt.code || !strings.Contains(errb.String(), tt.msg) || out.Len() != 0 {
				t.Errorf("%s: exit %d stdout %q stderr %q; want %d and %q", tt.name, code, out.String(), errb.String(), tt.code, tt.msg)
			}
			if _, err := os.Stat(marker); err == nil {
				t.Fatalf("%s: the app was started", tt.name)
			}
		}
	})
}

// seccompFilters is the Seccomp_filters count of /proc/PID/status (0 on a kernel without it).
func seccompFilters(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Seccomp_filters:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil {
				t.Fatalf("%q: %v", l, err)
			}
			return n
		}
	}
	t.Skip("this kernel's /proc/PID/status has no Seccomp_filters line (Linux < 5.9)")
	return 0
}
