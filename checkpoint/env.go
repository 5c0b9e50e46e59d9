// Package checkpoint saves a running process — its GPU state through the NVIDIA driver's
// checkpoint API, the process itself through CRIU — into the image store, as one transaction
// that rolls back on any failure (see Execute).
package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/store"
)

// ErrRefused marks preflight refusals: nothing was touched.
var ErrRefused = errors.New("refused")

// Refusal is a preflight failure; it wraps ErrRefused and the cause.
type Refusal struct{ Err error }

func (r *Refusal) Error() string            { return r.Err.Error() }
func (r *Refusal) Unwrap() []error          { return []error{ErrRefused, r.Err} }
func refusef(format string, a ...any) error { return &Refusal{Err: fmt.Errorf(format, a...)} }

// Driver is the part of the NVIDIA driver API the flows use (cudackpt.Driver implements it).
type Driver interface {
	State(pid int) (cudackpt.State, error)
	Lock(pid int, timeout time.Duration) error
	Checkpoint(pid int) error
	Restore(pid int, pairs []cudackpt.Pair) error
	Unlock(pid int) error
}

// CRIU is the part of CRIU the flows use (*criu.Dumper implements it).
type CRIU interface {
	Dump(ctx context.Context, o criu.DumpOptions) (*criu.DumpResult, error)
	Restore(ctx context.Context, o criu.RestoreOptions) (*criu.RestoreResult, error)
}

// ImageStore is the part of the store checkpoint and restore use (*store.Store implements it).
type ImageStore interface {
	Put(ctx context.Context, srcDir string, o store.PutOptions) (*store.Manifest, *store.Stats, error)
	Prestage(ctx context.Context, dir string, o store.PutOptions) (*store.Prestage, error)
	Get(ref string) (*store.Manifest, error)
	Materialize(ctx context.Context, ref, dstDir string, o store.GetOptions) (*store.Stats, error)
	Dir() string
}

// Env is everything a checkpoint touches. The CLI builds it from the real driver, NVML, CRIU and
// store (NewEnv); tests substitute parts and inject failures through Hook.
type Env struct {
	Driver      Driver     // nil: no usable NVIDIA driver (DriverErr says why)
	DriverErr   error      //
	GPUs        gpu.Lister // nil: no NVML
	CRIU        CRIU       // nil: no usable CRIU (CRIUErr says why)
	CRIUErr     error      //
	CRIUVersion string
	Store       ImageStore
	Host        HostInfo
	Hook        Hook // runs before each step; tests inject failures with it
	Log         *slog.Logger
	Euid        int
}

// logger is e.Log, or slog's default when unset.
func (e *Env) logger() *slog.Logger {
	if e.Log == nil {
		return slog.Default()
	}
	return e.Log
}

// HostInfo is recorded in every image's manifest.
type HostInfo struct {
	Host, Kernel, Driver, CUDA string
}

// ReadHostInfo reads the host name and kernel release; Driver/CUDA come from NVML when present.
func ReadHostInfo(drv *gpu.DriverInfo) HostInfo {
	h := HostInfo{}
	h.Host, _ = os.Hostname()
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		h.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	if drv != nil {
		h.Driver, h.CUDA = drv.Driver, drv.CUDA
	}
	return h
}

// NewEnv opens the real components: the driver (cuInit), NVML, CRIU and the store at storeDir.
// Missing GPU components are recorded, not fatal: a CPU process needs only CRIU. Close releases.
func NewEnv(ctx context.Context, storeDir string, log *slog.Logger) (*Env, func(), error) {
	if log == nil {
		log = slog.Default()
	}
	env := &Env{Log: log, Euid: os.Geteuid()}
	closers := []func(){}
	closeAll := func() {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
	}
	if storeDir != "" {
		st, err := store.Open(storeDir)
		if err != nil {
			return nil, closeAll, refusef("store %s: %w", storeDir, err)
		}
		env.Store = st
	}
	if d, err := cudackpt.Open(); err != nil {
		env.DriverErr = err
		log.Debug("no CUDA driver", "err", err)
	} else {
		env.Driver = d
	}
	var di *gpu.DriverInfo
	if inv, err := gpu.Open(); err != nil {
		log.Debug("no NVML", "err", err)
	} else {
		env.GPUs = inv
		closers = append(closers, func() { _ = inv.Close() })
		if d, err := inv.Driver(); err == nil {
			di = &d
		}
	}
	env.Host = ReadHostInfo(di)
	if d, text, err := criu.NewDumper(ctx); err != nil {
		env.CRIUErr = err
	} else {
		env.CRIU, env.CRIUVersion = d, text
	}
	return env, closeAll, nil
}

// ProcessAlive reports whether pid exists and is not a zombie.
func ProcessAlive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}

// WaitGone waits until pid no longer exists (not even as a zombie), up to timeout.
func WaitGone(ctx context.Context, pid int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("pid %d still exists after %s", pid, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// KillAndWait sends SIGKILL and waits until pid is dead (a zombie counts as dead).
func KillAndWait(pid int, timeout time.Duration) error {
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("kill pid %d: %w", pid, err)
	}
	deadline := time.Now().Add(timeout)
	for ProcessAlive(pid) {
		if time.Now().After(deadline) {
			return fmt.Errorf("pid %d still alive %s after SIGKILL", pid, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

// Comm returns /proc/PID/comm.
func Comm(pid int) string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	return strings.TrimSpace(string(b))
}

// processState reads the state letter of /proc/PID/stat ('R', 'S', 'T', 'Z', ...).
func processState(pid int) byte {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 || i+2 >= len(b) {
		return 0
	}
	return b[i+2]
}
