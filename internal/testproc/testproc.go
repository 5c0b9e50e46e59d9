// Package testproc builds and starts small real CPU processes with observable, verifiable state,
// for CRIU tests and the CPU demo. The program (csrc/testproc.c, compiled with gcc) advances a hash
// chain over a heap buffer and pwrite()s its progress to a fixed-size state file; Model recomputes
// the chain in Go, so a test can check that a checkpointed and restored process continued exactly.
package testproc

import (
	_ "embed"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ptxmig/ptxmig/internal/proc"
)

// Source is the C source of the test program.
//
//go:embed csrc/testproc.c
var Source []byte

// ErrNoCompiler means gcc is not installed.
var ErrNoCompiler = errors.New("gcc not found (apt-get install gcc)")

// Build compiles the test program into dir and returns the binary's path.
func Build(dir string) (string, error) {
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		return "", ErrNoCompiler
	}
	src := filepath.Join(dir, "ptxmig-testproc.c")
	if err := os.WriteFile(src, Source, 0o600); err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "ptxmig-testproc")
	out, err := exec.Command(gcc, "-O2", "-Wall", "-pthread", "-o", bin, src).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("gcc %s: %w: %s", src, err, out)
	}
	return bin, nil
}

// Options of one test process.
type Options struct {
	MiB        int    // heap size (default 4)
	IntervalMs int    // pause between steps (default 50; negative: none, the process runs flat out)
	Steps      int    // stop after this many steps (0: run until killed)
	Log        bool   // also print each step to Stdout
	UVM        string // a file (>= 4096 bytes) a second thread reads all the time (see csrc/testproc.c)
	Threads    int    // more threads, sleeping 1 ms at a time
	Stdout     string
}

func (o Options) args(state string) []string {
	a := []string{state}
	if o.MiB > 0 {
		a = append(a, "--mib", strconv.Itoa(o.MiB))
	}
	if o.IntervalMs > 0 {
		a = append(a, "--interval-ms", strconv.Itoa(o.IntervalMs))
	} else if o.IntervalMs < 0 {
		a = append(a, "--interval-ms", "0")
	}
	if o.Steps > 0 {
		a = append(a, "--steps", strconv.Itoa(o.Steps))
	}
	if o.Log {
		a = append(a, "--log")
	}
	if o.UVM != "" {
		a = append(a, "--uvm", o.UVM)
	}
	if o.Threads > 0 {
		a = append(a, "--threads", strconv.Itoa(o.Threads))
	}
	return a
}

// UVMSize is the size of an Options.UVM file: what the test process maps and its thread reads.
const UVMSize = 4096

// MakeUVM creates dir/uvm, a file for Options.UVM, and returns its path.
func MakeUVM(dir string) (string, error) {
	path := filepath.Join(dir, "uvm")
	return path, os.WriteFile(path, make([]byte, UVMSize), 0o600)
}

// StartUVM starts bin as Start does, with its state file and a fresh UVM file (MakeUVM) in dir:
// a process with a thread that dies if it runs while the file's pages are gone.
func StartUVM(bin, dir string, o Options) (*Proc, error) {
	uvm, err := MakeUVM(dir)
	if err != nil {
		return nil, err
	}
	o.UVM = uvm
	return Start(bin, filepath.Join(dir, "state"), o)
}

// Proc is a started test process.
type Proc struct {
	PID       int
	StateFile string
	UVM       string // Options.UVM
	MiB       int
	cmd       *exec.Cmd
	exited    chan struct{}
}

// Start runs bin in a new session (setsid, so CRIU needs no shell-job mode) with stdin from
// /dev/null and stdout/stderr to o.Stdout (default /dev/null), and waits for its first record.
// A goroutine reaps it when it dies (proc.WaitDead: never while it lives, so that ptxmig may hold
// its threads), so its PID is freed for a restore.
func Start(bin, stateFile string, o Options) (*Proc, error) {
	if o.MiB == 0 {
		o.MiB = 4
	}
	null, err := os.Open(os.DevNull)
	if err != nil {
		return nil, err
	}
	defer null.Close()
	outPath := o.Stdout
	if outPath == "" {
		outPath = os.DevNull
	}
	out, err := os.OpenFile(outPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer out.Close()
	cmd := exec.Command(bin, o.args(stateFile)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = null, out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	p := &Proc{PID: cmd.Process.Pid, StateFile: stateFile, UVM: o.UVM, MiB: o.MiB, cmd: cmd, exited: make(chan struct{})}
	go func() { _ = proc.WaitDead(cmd); close(p.exited) }()
	if _, err := WaitState(stateFile, func(s State) bool { return s.PID == p.PID }, 10*time.Second); err != nil {
		_ = p.Kill()
		return nil, fmt.Errorf("test process %d never wrote its state: %w", p.PID, err)
	}
	return p, nil
}

// Kill kills the process and waits until it is reaped.
func (p *Proc) Kill() error {
	_ = syscall.Kill(p.PID, syscall.SIGKILL)
	select {
	case <-p.exited:
		return nil
	case <-time.After(10 * time.Second):
		return fmt.Errorf("pid %d not reaped 10 s after SIGKILL", p.PID)
	}
}

// Exited is closed when the process has been reaped.
func (p *Proc) Exited() <-chan struct{} { return p.exited }

// State is one record of the state file.
type State struct {
	PID  int
	Step int
	Hash uint64
	Done bool
}

// ParseState parses a 128-byte record.
func ParseState(b []byte) (State, error) {
	f := strings.Fields(string(b))
	if (len(f) != 8 && len(f) != 10) || f[0] != "pid" || f[2] != "step" || f[4] != "hash" || f[6] != "done" {
		return State{}, fmt.Errorf("bad state record %q", strings.TrimSpace(string(b)))
	}
	if len(f) == 10 {
		// "crc C": FNV-1a of the text before " crc"; a read torn by a concurrent write fails it.
		text := strings.Join(f[:8], " ")
		h := fnv.New32a()
		h.Write([]byte(text))
		if f[8] != "crc" || f[9] != fmt.Sprintf("%08x", h.Sum32()) {
			return State{}, fmt.Errorf("%w: %q", errTorn, strings.TrimSpace(string(b)))
		}
	}
	var s State
	var err error
	if s.PID, err = strconv.Atoi(f[1]); err != nil {
		return State{}, fmt.Errorf("bad pid in state record: %w", err)
	}
	if s.Step, err = strconv.Atoi(f[3]); err != nil {
		return State{}, fmt.Errorf("bad step in state record: %w", err)
	}
	if s.Hash, err = strconv.ParseUint(f[5], 16, 64); err != nil {
		return State{}, fmt.Errorf("bad hash in state record: %w", err)
	}
	s.Done = f[7] == "1"
	return s, nil
}

// ReadState reads the state file. A read that overlaps the process's pwrite of the record can
// see part of the old record and part of the new one (reads of a regular file do not serialise
// with writes); the record's checksum tells, and such a read is retried.
func ReadState(path string) (State, error) {
	deadline := time.Now().Add(2 * time.Second)
	for {
		b, err := os.ReadFile(path)
		if err != nil {
			return State{}, err
		}
		if len(b) != 128 {
			return State{}, fmt.Errorf("state file %s: %d bytes, want 128", path, len(b))
		}
		s, err := ParseState(b)
		if !errors.Is(err, errTorn) || time.Now().After(deadline) {
			return s, err
		}
	}
}

// errTorn is a record whose checksum does not match: read while being written.
var errTorn = errors.New("torn state record")

// WaitState polls the state file until ok(state) or the timeout.
func WaitState(path string, ok func(State) bool, timeout time.Duration) (State, error) {
	deadline := time.Now().Add(timeout)
	var last State
	var lastErr error
	for {
		s, err := ReadState(path)
		if err == nil && ok(s) {
			return s, nil
		}
		last, lastErr = s, err
		if time.Now().After(deadline) {
			if lastErr != nil {
				return last, fmt.Errorf("after %s: %w", timeout, lastErr)
			}
			return last, fmt.Errorf("after %s the state is still %+v", timeout, last)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Model recomputes the program's hash chain.
type Model struct {
	buf  []uint64
	step int
	hash uint64
}

func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// NewModel starts the chain for a process with mib MiB of heap.
func NewModel(mib int) *Model {
	n := mib << 20 / 8
	m := &Model{buf: make([]uint64, n), hash: 0x5054584d4947}
	for j := range m.buf {
		m.buf[j] = mix(uint64(j))
	}
	return m
}

// HashAt advances the model to step (which must not go backwards) and returns the hash there.
func (m *Model) HashAt(step int) (uint64, error) {
	if step < m.step {
		return 0, fmt.Errorf("model is at step %d, cannot go back to %d", m.step, step)
	}
	n := uint64(len(m.buf))
	for m.step < step {
		m.step++
		idx := m.hash % n
		m.hash = mix(m.hash ^ m.buf[idx] ^ uint64(m.step))
		m.buf[idx] ^= m.hash
	}
	return m.hash, nil
}

// Check reports whether s continues the chain exactly.
func (m *Model) Check(s State) error {
	want, err := m.HashAt(s.Step)
	if err != nil {
		return err
	}
	if s.Hash != want {
		return fmt.Errorf("step %d: hash %016x, want %016x: the process did not continue exactly", s.Step, s.Hash, want)
	}
	return nil
}

// Alive reports whether pid exists and is not a zombie.
func Alive(pid int) bool { return proc.Alive(pid) }

// KillPID kills a process that is not our child (e.g. a restored one) and waits until its
// /proc entry is gone or it is a zombie.
func KillPID(pid int, timeout time.Duration) error {
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("kill %d: %w", pid, err)
	}
	deadline := time.Now().Add(timeout)
	for Alive(pid) {
		if time.Now().After(deadline) {
			return fmt.Errorf("pid %d still alive %s after SIGKILL", pid, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
	var ws syscall.WaitStatus
	_, _ = syscall.Wait4(pid, &ws, syscall.WNOHANG, nil) // reap it if we are its parent or subreaper
	return nil
}

// WaitTree waits up to timeout for root's process tree to hold at least n processes (a shell
// that forks its children), and returns it, root first.
func WaitTree(root, n int, timeout time.Duration) ([]proc.Stat, error) {
	var tree []proc.Stat
	for deadline := time.Now().Add(timeout); len(tree) < n; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("the tree of %d did not grow to %d processes in %s: %+v", root, n, timeout, tree)
		}
		tree, _ = proc.Tree(root)
	}
	return tree, nil
}
