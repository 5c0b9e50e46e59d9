// Package proc is ptxmig's one reader of /proc: process status, command lines, memory figures,
// process trees and ancestry, and the signals ptxmig sends to whole trees (continue, kill). Parsers
// take bytes so that tests (and the rebalancer's fake /proc roots) can feed them directly.
package proc

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Root is the mount point of procfs.
const Root = "/proc"

// MaxSmall bounds what is read of one small /proc file (stat, cmdline, environ, status).
const MaxSmall = 1 << 20

// ErrNoProcess: the process does not exist (or is a zombie, where that matters).
var ErrNoProcess = errors.New("no such process")

// Stat is what ptxmig uses of /proc/PID/stat.
type Stat struct {
	PID        int    `json:"pid"`
	Comm       string `json:"comm"`
	State      byte   `json:"-"`
	PPID       int    `json:"ppid"`
	PGID       int    `json:"pgid"`
	SID        int    `json:"sid"`
	TTY        int    `json:"tty_nr"` // controlling terminal's device number; 0: none
	StartTicks uint64 `json:"-"`      // start time after boot, in clock ticks
	CPUTicks   uint64 `json:"-"`      // CPU time used (user + system), in clock ticks
}

// Zombie reports whether the process has exited and waits to be reaped (or is dead).
func (s Stat) Zombie() bool { return s.State == 'Z' || s.State == 'X' }

// Stopped reports whether the process is stopped by a signal or traced.
func (s Stat) Stopped() bool { return s.State == 'T' || s.State == 't' }

// ParseStat parses /proc/PID/stat. The command name may hold spaces and parentheses, so fields
// are counted from the last ')'.
func ParseStat(b []byte) (Stat, error) {
	var s Stat
	open, end := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
	if open < 1 || end < open {
		return s, errors.New("malformed stat: no (comm)")
	}
	pid, err := strconv.Atoi(string(bytes.TrimSpace(b[:open])))
	if err != nil || pid <= 0 {
		return s, fmt.Errorf("malformed stat: pid %q", bytes.TrimSpace(b[:open]))
	}
	s.PID, s.Comm = pid, string(b[open+1:end])
	f := bytes.Fields(b[end+1:])
	// f[0] is field 3 (state), f[1] ppid, f[2] pgrp, f[3] session, f[4] tty_nr, f[11] utime,
	// f[12] stime, f[19] starttime.
	if len(f) < 20 {
		return s, fmt.Errorf("malformed stat: %d fields after comm", len(f))
	}
	if len(f[0]) != 1 {
		return s, fmt.Errorf("malformed stat: state %q", f[0])
	}
	s.State = f[0][0]
	ints := []*int{&s.PPID, &s.PGID, &s.SID, &s.TTY}
	for i, p := range ints {
		v, err := strconv.ParseInt(string(f[1+i]), 10, 32)
		if err != nil {
			return s, fmt.Errorf("malformed stat: field %d: %w", 4+i, err)
		}
		*p = int(v)
	}
	if s.StartTicks, err = strconv.ParseUint(string(f[19]), 10, 64); err != nil {
		return s, fmt.Errorf("malformed stat: starttime: %w", err)
	}
	for i, name := range []string{"utime", "stime"} {
		v, err := strconv.ParseUint(string(f[11+i]), 10, 64)
		if err != nil {
			return s, fmt.Errorf("malformed stat: %s: %w", name, err)
		}
		s.CPUTicks += v
	}
	return s, nil
}

// ReadFile reads at most limit bytes of /proc/PID/name under root ("" means Root).
func ReadFile(root string, pid int, name string, limit int64) ([]byte, error) {
	if root == "" {
		root = Root
	}
	f, err := os.Open(filepath.Join(root, strconv.Itoa(pid), name))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, limit))
}

// FDTargets returns what the open file descriptors of pid name (the links /proc/PID/fd/N under
// root, "" meaning Root: a path, or "anon_inode:[…]", "socket:[…]"…), skipping any closed while
// they are read.
func FDTargets(root string, pid int) ([]string, error) {
	if root == "" {
		root = Root
	}
	dir := filepath.Join(root, strconv.Itoa(pid), "fd")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(ents))
	for _, e := range ents {
		if t, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil {
			out = append(out, t)
		}
	}
	return out, nil
}

// ReadStat reads and parses /proc/PID/stat; a missing process gives an error wrapping ErrNoProcess.
func ReadStat(pid int) (Stat, error) {
	b, err := ReadFile(Root, pid, "stat", MaxSmall)
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
		return Stat{}, fmt.Errorf("pid %d: %w", pid, ErrNoProcess)
	}
	if err != nil {
		return Stat{}, fmt.Errorf("pid %d: %w", pid, err)
	}
	s, err := ParseStat(b)
	if err != nil {
		return s, fmt.Errorf("pid %d: %w", pid, err)
	}
	return s, nil
}

// WaitDead waits for cmd's process to end and then reaps it (cmd.Wait). It does not wait on the
// process while it lives: were this process tracing a thread of it (package hold), the kernel
// would report that thread's ptrace-stops to the wait, and cmd.Wait would take a stop for the end
// of the process. For harnesses that start the processes ptxmig then checkpoints.
func WaitDead(cmd *exec.Cmd) error {
	for {
		if s, err := ReadStat(cmd.Process.Pid); err != nil || s.Zombie() {
			return cmd.Wait()
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ThreadState is the state letter of thread tid of process pid ('R', 'S', 'T' stopped, 't'
// traced, ...), 0 when it is gone or unreadable.
func ThreadState(pid, tid int) byte {
	b, err := os.ReadFile(filepath.Join(Root, strconv.Itoa(pid), "task", strconv.Itoa(tid), "stat"))
	if err != nil {
		return 0
	}
	s, err := ParseStat(b)
	if err != nil {
		return 0
	}
	return s.State
}

// ThreadStopped reports whether thread tid of pid is stopped (a group-stop, or a tracer's stop), as
// Stat.Stopped does for a process.
func ThreadStopped(pid, tid int) bool {
	s := ThreadState(pid, tid)
	return s == 'T' || s == 't'
}

// Exists reports whether /proc/PID exists (a zombie exists).
func Exists(pid int) bool {
	_, err := os.Stat(filepath.Join(Root, strconv.Itoa(pid)))
	return err == nil
}

// Alive reports whether pid exists and is not a zombie.
func Alive(pid int) bool {
	s, err := ReadStat(pid)
	return err == nil && !s.Zombie()
}

// State is the state letter of pid ('R', 'S', 'T', 'Z', ...), 0 when it is gone.
func State(pid int) byte {
	s, err := ReadStat(pid)
	if err != nil {
		return 0
	}
	return s.State
}

// Comm is /proc/PID/comm ("" when unreadable).
func Comm(pid int) string {
	b, _ := ReadFile(Root, pid, "comm", MaxSmall)
	return strings.TrimSpace(string(b))
}

// Cmdline is the command line of pid under root ("" means Root); nil when unreadable or empty.
func Cmdline(root string, pid int) []string {
	b, err := ReadFile(root, pid, "cmdline", MaxSmall)
	if err != nil {
		return nil
	}
	return ParseCmdline(b)
}

// ParseCmdline splits /proc/PID/cmdline (NUL-separated, usually NUL-terminated).
func ParseCmdline(b []byte) []string {
	b = bytes.TrimSuffix(b, []byte{0})
	if len(b) == 0 {
		return nil
	}
	parts := bytes.Split(b, []byte{0})
	out := make([]string, len(parts))
	for i, p := range parts {
		out[i] = string(p)
	}
	return out
}

// ParseBootTime reads the "btime" line of /proc/stat.
func ParseBootTime(b []byte) (time.Time, error) {
	for line := range bytes.SplitSeq(b, []byte{'\n'}) {
		if v, ok := bytes.CutPrefix(line, []byte("btime ")); ok {
			s, err := strconv.ParseInt(string(bytes.TrimSpace(v)), 10, 64)
			if err != nil || s <= 0 {
				return time.Time{}, fmt.Errorf("malformed btime %q", v)
			}
			return time.Unix(s, 0), nil
		}
	}
	return time.Time{}, errors.New("no btime in /proc/stat")
}

// KB reads a "Key:   123 kB" line of a /proc file (status, meminfo) in bytes; 0 when the file or
// the key is missing or the value does not parse.
func KB(path, key string) uint64 {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), key); ok {
			kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil || kb > math.MaxUint64>>10 {
				return 0
			}
			return kb << 10
		}
	}
	return 0
}

// RSS is pid's resident set size in bytes (0 when unknown).
func RSS(pid int) uint64 { return KB(filepath.Join(Root, strconv.Itoa(pid), "status"), "VmRSS:") }

// MemAvailable is /proc/meminfo's MemAvailable in bytes (0 when unknown).
func MemAvailable() uint64 { return KB(filepath.Join(Root, "meminfo"), "MemAvailable:") }

// Children lists the children of every thread of pid, sorted (needs CONFIG_PROC_CHILDREN, which
// every distribution kernel has).
func Children(pid int) []int {
	tasks, err := os.ReadDir(filepath.Join(Root, strconv.Itoa(pid), "task"))
	if err != nil {
		return nil
	}
	seen := map[int]bool{}
	var out []int
	for _, t := range tasks {
		b, err := os.ReadFile(filepath.Join(Root, strconv.Itoa(pid), "task", t.Name(), "children"))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			if c, err := strconv.Atoi(f); err == nil && c > 0 && !seen[c] {
				seen[c] = true
				out = append(out, c)
			}
		}
	}
	sort.Ints(out)
	return out
}

// maxTree bounds a tree walk (a fork bomb must not make ptxmig loop).
const maxTree = 1 << 16

// Tree returns pid and all its descendants, root first, then breadth-first. Processes that
// vanish during the walk are left out; the root missing is ErrNoProcess.
func Tree(pid int) ([]Stat, error) {
	root, err := ReadStat(pid)
	if err != nil {
		return nil, err
	}
	out := []Stat{root}
	seen := map[int]bool{pid: true}
	for i := 0; i < len(out); i++ {
		for _, c := range Children(out[i].PID) {
			if seen[c] {
				continue
			}
			seen[c] = true
			s, err := ReadStat(c)
			if err != nil {
				continue
			}
			if len(out) >= maxTree {
				return out, fmt.Errorf("pid %d has more than %d descendants", pid, maxTree)
			}
			out = append(out, s)
		}
	}
	return out, nil
}

// PIDs returns the pids of stats, in order.
func PIDs(stats []Stat) []int {
	out := make([]int, len(stats))
	for i, s := range stats {
		out[i] = s.PID
	}
	return out
}

// Ancestors returns the parent chain of pid, nearest first, up to and including pid 1.
func Ancestors(pid int) []int {
	var out []int
	seen := map[int]bool{pid: true}
	for cur := pid; ; {
		s, err := ReadStat(cur)
		if err != nil || s.PPID <= 0 || seen[s.PPID] {
			return out
		}
		out = append(out, s.PPID)
		seen[s.PPID] = true
		cur = s.PPID
	}
}

// WaitGone waits until pid no longer exists (not even as a zombie), up to timeout.
func WaitGone(ctx context.Context, pid int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for Exists(pid) {
		if time.Now().After(deadline) {
			return fmt.Errorf("pid %d still exists after %s", pid, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}

// Kill sends SIGKILL to every pid and waits until each is dead (a zombie counts as dead), up to
// timeout in all. Pids already gone are fine. Zombies that are the caller's children (it is their
// parent or their subreaper, as in tests) are reaped, so that their pids are free again.
//
// Descendants are signalled before their ancestors (killOrder), so that a caller killed halfway
// leaves every survivor still under a living root: whoever finishes the job (the guardian,
// `ptxmig recover`) finds them in the root's tree, even those forked after it was recorded.
func Kill(pids []int, timeout time.Duration) error {
	defer reap(pids)
	parents := make(map[int]int, len(pids))
	for _, pid := range pids {
		if s, err := ReadStat(pid); err == nil {
			parents[pid] = s.PPID
		}
	}
	var errs []error
	for _, pid := range killOrder(pids, parents) {
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, fmt.Errorf("kill pid %d: %w", pid, err))
		}
	}
	deadline := time.Now().Add(timeout)
	for _, pid := range pids {
		for Alive(pid) {
			if time.Now().After(deadline) {
				errs = append(errs, fmt.Errorf("pid %d still alive %s after SIGKILL", pid, timeout))
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	return errors.Join(errs...)
}

// killOrder orders pids so that each comes after every one of its descendants among them (by
// parents: pid → parent pid); pids at the same depth keep their order. Pure, for Kill.
func killOrder(pids []int, parents map[int]int) []int {
	in := make(map[int]bool, len(pids))
	for _, pid := range pids {
		in[pid] = true
	}
	depths := make(map[int]int, len(pids))
	for _, pid := range pids {
		d := 0 // a chain longer than the pids is a loop in parents (a pid reused meanwhile): it stops there
		for p, ok := parents[pid]; ok && in[p] && d < len(pids); p, ok = parents[p] {
			d++
		}
		depths[pid] = d
	}
	out := slices.Clone(pids)
	slices.SortStableFunc(out, func(a, b int) int { return depths[b] - depths[a] })
	return out
}

// reap waits for those of pids that are zombie children of this process. When this process is a
// child subreaper (PR_SET_CHILD_SUBREAPER, as tests are) it waits up to a second for orphans,
// which reach it only once their parent is dead; otherwise init reaps them and it does not wait.
func reap(pids []int) {
	self := os.Getpid()
	var subreaper int32
	_ = unix.Prctl(unix.PR_GET_CHILD_SUBREAPER, uintptr(unsafe.Pointer(&subreaper)), 0, 0, 0)
	wait := time.Duration(0)
	if subreaper != 0 {
		wait = time.Second
	}
	deadline := time.Now().Add(wait)
	for {
		pending := false
		for _, pid := range pids {
			s, err := ReadStat(pid)
			if err != nil {
				continue
			}
			if s.Zombie() && s.PPID == self {
				var ws syscall.WaitStatus
				if wpid, err := syscall.Wait4(pid, &ws, syscall.WNOHANG, nil); wpid == 0 && err == nil {
					pending = true // a zombie main thread whose other threads are still exiting
				}
				continue
			}
			if s.Zombie() {
				pending = true // its parent may die and hand it to us
			}
		}
		if !pending || time.Now().After(deadline) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Continue sends SIGCONT to every pid and checks, up to timeout in all, that each has left the
// stopped state. Pids already gone are fine.
func Continue(pids []int, timeout time.Duration) error {
	var errs []error
	for _, pid := range pids {
		if err := syscall.Kill(pid, syscall.SIGCONT); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, fmt.Errorf("SIGCONT pid %d: %w", pid, err))
		}
	}
	deadline := time.Now().Add(timeout)
	for _, pid := range pids {
		for {
			s, err := ReadStat(pid)
			if err != nil || !s.Stopped() {
				break
			}
			if time.Now().After(deadline) {
				errs = append(errs, fmt.Errorf("pid %d still stopped %s after SIGCONT", pid, timeout))
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	return errors.Join(errs...)
}

// Describe summarises the states of pids for an operator: "running", "stopped (pids 3, 4)",
// "gone", or a mix.
func Describe(pids []int) string {
	var running, stopped, gone []string
	for _, pid := range pids {
		s, err := ReadStat(pid)
		switch {
		case err != nil || s.Zombie():
			gone = append(gone, strconv.Itoa(pid))
		case s.Stopped():
			stopped = append(stopped, strconv.Itoa(pid))
		default:
			running = append(running, strconv.Itoa(pid))
		}
	}
	var parts []string
	add := func(what string, l []string) {
		switch {
		case len(l) == 0:
		case len(l) == len(pids) && len(pids) == 1:
			parts = append(parts, fmt.Sprintf("pid %s is %s", l[0], what))
		default:
			parts = append(parts, fmt.Sprintf("%s: pid %s", what, strings.Join(l, ", ")))
		}
	}
	add("running", running)
	add("stopped", stopped)
	add("gone", gone)
	return strings.Join(parts, "; ")
}

// ClockTicks is USER_HZ, the unit of the start times /proc reports (100 on every Linux ABI).
const ClockTicks = 100

// SinceBoot is the time since boot on CLOCK_BOOTTIME, the clock /proc start times count on.
func SinceBoot() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

// StartedAt is when the process started, after boot (to the clock tick).
func (s Stat) StartedAt() time.Duration {
	return time.Duration(s.StartTicks) * (time.Second / ClockTicks)
}

// StartedSince reports whether the process started at or after t (CLOCK_BOOTTIME): its start,
// rounded down to a clock tick, is no earlier than t rounded down to one. A process that started
// in the same tick just before t counts as started since: callers compare against a moment taken
// before anything they may have started.
func (s Stat) StartedSince(t time.Duration) bool {
	tick := time.Second / ClockTicks
	return s.StartedAt() >= t/tick*tick
}

// Same reports whether pid is still the process that started at start (clock ticks after boot,
// /proc/PID/stat field 22) and is not a zombie: the pid was not reused by another process.
func Same(pid int, start uint64) bool {
	s, err := ReadStat(pid)
	return err == nil && !s.Zombie() && s.StartTicks == start
}

// BootID is this boot's random id (/proc/sys/kernel/random/boot_id): pids and start times mean
// nothing across boots.
func BootID() (string, error) {
	b, err := os.ReadFile(filepath.Join(Root, "sys/kernel/random/boot_id"))
	if err != nil {
		return "", err
	}
	id := strings.TrimSpace(string(b))
	if len(id) < 16 || len(id) > 64 || strings.Trim(id, "0123456789abcdef-") != "" {
		return "", fmt.Errorf("malformed boot id %q", id)
	}
	return id, nil
}

// Group lists the live processes of process group pgid (a scan of /proc); pgid 0 lists every
// live process.
func Group(pgid int) []Stat {
	ents, err := os.ReadDir(Root)
	if err != nil {
		return nil
	}
	var out []Stat
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		if s, err := ReadStat(pid); err == nil && (pgid == 0 || s.PGID == pgid) && !s.Zombie() {
			out = append(out, s)
		}
	}
	return out
}
