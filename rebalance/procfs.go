package rebalance

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimctl"
)

// ProcInfo is what /proc says about a process.
type ProcInfo struct {
	Comm       string
	State      byte // R, S, D, Z, ...
	SID        int  // its session (stat field 6)
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

func (p ProcFS) root() string {
	if p.Root == "" {
		return "/proc"
	}
	return p.Root
}

func (p ProcFS) read(pid int, name string, limit int64) ([]byte, error) {
	return proc.ReadFile(p.root(), pid, name, limit)
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
	st, err := proc.ParseStat(stat)
	if err != nil {
		return info, fmt.Errorf("pid %d stat: %w", pid, err)
	}
	info.Comm, info.State, info.StartTicks, info.SID = st.Comm, st.State, st.StartTicks, st.SID
	if info.State == 'Z' || info.State == 'X' {
		return info, fmt.Errorf("pid %d is a zombie: %w", pid, ErrNoProcess)
	}
	if b, err := os.ReadFile(filepath.Join(p.root(), "stat")); err == nil {
		if boot, err := proc.ParseBootTime(b); err == nil {
			info.StartTime = boot.Add(time.Duration(info.StartTicks) * time.Second / clockTicks)
		}
	}
	if b, err := p.read(pid, "cmdline", maxProcSmall); err == nil {
		info.Cmdline = proc.ParseCmdline(b)
	}
	if b, err := p.read(pid, "environ", maxProcSmall); err == nil {
		info.EnvKnown, info.EnvPin = true, EnvHasPin(b)
	}
	if b, err := p.read(pid, "maps", maxProcMaps); err == nil {
		info.UnderShim, _ = shimctl.MapsListingHasShim(bytes.NewReader(b))
	}
	return info, nil
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
