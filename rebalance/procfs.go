package rebalance

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// ProcInfo is what /proc says about a process.
type ProcInfo struct {
	Comm       string
	State      byte // R, S, D, Z, ...
	Cmdline    []string
	StartTicks uint64    // start time in clock ticks after boot (stat field 22)
	StartTime  time.Time // wall-clock start, from boot time + StartTicks
	EnvPin     bool
	EnvKnown   bool
	UnderShim  bool
}

// ProcReader reads process information; ProcFS is the real one.
type ProcReader interface {
	Read(pid int) (ProcInfo, error)
}

// ErrNoProcess means the process does not exist (any more).
var ErrNoProcess = errors.New("no such process")

// ProcFS reads /proc (or Root, for tests).
type ProcFS struct {
	Root string // "/proc" when empty
}

// clockTicks is USER_HZ, the unit of /proc/PID/stat times; fixed at 100 by the kernel ABI on
// every architecture Go supports on Linux.
const clockTicks = 100

// Maximum bytes read from each /proc file.
const (
	maxProcSmall = 1 << 20  // stat, cmdline, environ
	maxProcMaps  = 64 << 20 // maps of a large PyTorch process runs to a few MiB
)

// ShimName is the file name of the LD_PRELOAD shim; a process mapping it runs under the shim.
const ShimName = "libptxmig.so"

func (p ProcFS) root() string {
	if p.Root == "" {
		return "/proc"
	}
	return p.Root
}

func (p ProcFS) read(pid int, name string, limit int64) ([]byte, error) {
	f, err := os.Open(filepath.Join(p.root(), strconv.Itoa(pid), name))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, limit))
}

// Read gathers ProcInfo for pid. A missing process gives ErrNoProcess. Unreadable environ or maps
// (no permission) leave EnvKnown false / UnderShim false rather than failing.
func (p ProcFS) Read(pid int) (ProcInfo, error) {
	var info ProcInfo
	stat, err := p.read(pid, "stat", maxProcSmall)
	if errors.Is(err, os.ErrNotExist) {
		return info, fmt.Errorf("pid %d: %w", pid, ErrNoProcess)
	}
	if err != nil {
		return info, fmt.Errorf("pid %d stat: %w", pid, err)
	}
	if info.Comm, info.State, info.StartTicks, err = ParseStat(stat); err != nil {
		return info, fmt.Errorf("pid %d stat: %w", pid, err)
	}
	if info.State == 'Z' || info.State == 'X' {
		return info, fmt.Errorf("pid %d is a zombie: %w", pid, ErrNoProcess)
	}
	if b, err := os.ReadFile(filepath.Join(p.root(), "stat")); err == nil {
		if boot, err := ParseBootTime(b); err == nil {
			info.StartTime = boot.Add(time.Duration(info.StartTicks) * time.Second / clockTicks)
		}
	}
	if b, err := p.read(pid, "cmdline", maxProcSmall); err == nil {
		info.Cmdline = ParseCmdline(b)
	}
	if b, err := p.read(pid, "environ", maxProcSmall); err == nil {
		info.EnvKnown, info.EnvPin = true, EnvHasPin(b)
	}
	if b, err := p.read(pid, "maps", maxProcMaps); err == nil {
		info.UnderShim = MapsHaveShim(b)
	}
	return info, nil
}

// ParseStat parses /proc/PID/stat: the name (which may hold spaces and parentheses), the state
// and the start time in clock ticks (field 22).
func ParseStat(b []byte) (comm string, state byte, startTicks uint64, err error) {
	open, close := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
	if open < 0 || close < open {
		return "", 0, 0, errors.New("malformed stat: no (comm)")
	}
	comm = string(b[open+1 : close])
	fields := bytes.Fields(b[close+1:])
	// fields[0] is field 3 (state); field 22 (starttime) is fields[19].
	if len(fields) < 20 {
		return "", 0, 0, fmt.Errorf("malformed stat: %d fields after comm", len(fields))
	}
	if len(fields[0]) != 1 {
		return "", 0, 0, fmt.Errorf("malformed stat: state %q", fields[0])
	}
	startTicks, err = strconv.ParseUint(string(fields[19]), 10, 64)
	if err != nil {
		return "", 0, 0, fmt.Errorf("malformed stat: starttime: %w", err)
	}
	return comm, fields[0][0], startTicks, nil
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

// EnvHasPin reports whether /proc/PID/environ holds PTXMIG_PIN=1.
func EnvHasPin(b []byte) bool {
	for kv := range bytes.SplitSeq(b, []byte{0}) {
		if string(kv) == "PTXMIG_PIN=1" {
			return true
		}
	}
	return false
}

// MapsHaveShim reports whether /proc/PID/maps maps a file named libptxmig.so (any directory).
func MapsHaveShim(b []byte) bool {
	for line := range bytes.SplitSeq(b, []byte{'\n'}) {
		// address perms offset dev inode pathname; the path is the 6th field and may hold spaces.
		f := bytes.Fields(line)
		if len(f) < 6 {
			continue
		}
		path := bytes.Join(f[5:], []byte{' '})
		if bytes.Equal(bytes.TrimSuffix(filepathBase(path), []byte(" (deleted)")), []byte(ShimName)) {
			return true
		}
	}
	return false
}

func filepathBase(p []byte) []byte {
	if i := bytes.LastIndexByte(p, '/'); i >= 0 {
		return p[i+1:]
	}
	return p
}
