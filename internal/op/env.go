// Package op is the operation core that checkpoint, restore and migrate share: the environment
// (driver, NVML, CRIU, store), the step/undo transaction (Execute), preflight refusals, staging
// directories, the driver steps with their undos, the failure logs and the image conventions
// (kinds, extra keys, the process tree) that checkpoint writes and restore reads.
package op

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/probe"
	"github.com/ptxmig/ptxmig/store"
)

// Driver is the part of the NVIDIA driver API the flows use (cudackpt.Driver implements it).
type Driver interface {
	State(pid int) (cudackpt.State, error)
	Lock(pid int, timeout time.Duration) error
	Checkpoint(pid int) error
	Restore(pid int, pairs []cudackpt.Pair) error
	Unlock(pid int) error
	// RestoreThreadID is the thread of pid that runs the driver's checkpoint and restore
	// (cudackpt.ErrNoRestoreThread: none to hold the others around, a fake's process).
	RestoreThreadID(pid int) (int, error)
}

// CRIU is the part of CRIU the flows use (*criu.Dumper implements it).
type CRIU interface {
	Dump(ctx context.Context, o criu.DumpOptions) (*criu.DumpResult, error)
	Restore(ctx context.Context, o criu.RestoreOptions) (*criu.RestoreResult, error)
	// NetworkLock is the method to block established TCP connections with (criu.NetworkLock*).
	NetworkLock() string
}

// ImageStore is the part of the store checkpoint and restore use (*store.Store implements it).
type ImageStore interface {
	Put(ctx context.Context, srcDir string, o store.PutOptions) (*store.Manifest, *store.Stats, error)
	Prestage(ctx context.Context, dir string, o store.PutOptions) (*store.Prestage, error)
	Get(ref string) (*store.Manifest, error)
	Materialize(ctx context.Context, ref, dstDir string, o store.GetOptions) (*store.Stats, error)
	// NewIngest and OpenImage stream an image in (a dump) and out (a restore) of the store.
	NewIngest(ctx context.Context, o store.PutOptions) (*store.Ingest, error)
	OpenImage(ctx context.Context, ref string, o store.GetOptions) (*store.ImageReader, error)
	List() ([]*store.Manifest, error)
	Dir() string
	// CheckChunkFiles checks that every chunk of an image is there at its recorded size (a stat
	// each): restore's preflight refuses a truncated or missing one.
	CheckChunkFiles(ctx context.Context, m *store.Manifest) error
}

// Env is everything a checkpoint touches. The CLI builds it from the real driver, NVML, CRIU and
// store (NewEnv); tests substitute parts and inject failures through Hook.
type Env struct {
	Driver      Driver     // nil: no usable NVIDIA driver (DriverErr says why), or not opened yet (DeferGPU)
	DriverErr   error      //
	GPUs        gpu.Lister // nil: no NVML, or not opened yet (DeferGPU)
	CRIU        CRIU       // nil: no usable CRIU (CRIUErr says why)
	CRIUErr     error      //
	CRIUVersion string
	// CRIUStall bounds how long a CRIU dump or restore may make no progress before it is killed
	// and the operation rolled back (criu.ErrStalled); 0 means criu.DefaultStall, < 0 no bound
	// (criu.Bound). The journal records it, so that a guardian applies the same bound.
	CRIUStall time.Duration
	Store     ImageStore
	Host      HostInfo
	Hook      Hook // runs before each step; tests inject failures with it
	// Progress reports the bytes a long step has moved (the image written to or read from the
	// store) against its expected total; nil reports nothing. Like Hook, it belongs to the run,
	// not to the plan: a plan is a value.
	Progress func(done, total int64)
	Log      *slog.Logger
	Euid     int
	// UsesCUDA reports whether a process has the CUDA driver loaded; nil means
	// gpu.MapsCUDA. Tests with a fake driver make CPU processes count as CUDA ones.
	UsesCUDA func(pid int) (bool, error)
	// MapsDevice returns an NVIDIA device file pid maps ("" for none); nil means gpu.MapsDevice.
	MapsDevice func(pid int) (string, error)
	// DriverVersion reads the NVIDIA driver's version for the preflight's feature checks
	// (DriverTooOld); nil means probe.DriverVersion. NewEnv gives the version NVML reported;
	// tests give fake ones.
	DriverVersion func() (string, error)
	// GuardianExe is the program started as each operation's guardian (see Begin); "" starts
	// none (the journal is still written, and `ptxmig recover` acts on it). NewEnv sets it in a
	// program that called EnableGuardian.
	GuardianExe string
	// Recovery is what NewEnv's recovery of interrupted operations found and did.
	Recovery *Report

	gpuDeferred bool     // NewEnvWith's DeferGPU: OpenGPU opens the driver and NVML
	closers     []func() // run by NewEnvWith's returned func, last first
}

// IsCUDA applies e.UsesCUDA (or gpu.MapsCUDA) to pid.
func (e *Env) IsCUDA(pid int) (bool, error) {
	if e.UsesCUDA != nil {
		return e.UsesCUDA(pid)
	}
	cuda, _, err := gpu.MapsCUDA(pid)
	return cuda, err
}

// DriverTooOld returns a *probe.UnsupportedFeatureError ("restore onto another GPU ... needs
// NVIDIA driver >= 580 (found 575.51.03)") when the driver is known to be too old for f
// (probe.DriverCheckpoint, probe.DriverGPURemap: the rules probe.HaveDriverCheckpoint and
// probe.HaveGPURemap apply), else nil. A version that cannot be read or parsed (no driver, no
// NVML) is nil too: then the driver's own calls decide, as without this check.
func (e *Env) DriverTooOld(f probe.Feature) error {
	read := e.DriverVersion
	if read == nil {
		read = probe.DriverVersion
	}
	v, err := read()
	if err != nil {
		return nil
	}
	if err := f.Check(v); errors.Is(err, probe.ErrNotSupported) {
		return err
	}
	return nil
}

// Logger is e.Log, or slog's default when unset.
func (e *Env) Logger() *slog.Logger {
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

// EnvOptions change what NewEnvWith opens.
type EnvOptions struct {
	// DeferGPU leaves the CUDA driver and NVML unopened until OpenGPU: a command that may handle
	// a CPU-only process or image (checkpoint, restore) opens them only once it meets a CUDA one.
	// From a cold page cache they take about 0.3 s to load (2026-11-27, H100 host, driver 580).
	DeferGPU bool
}

// NewEnv is NewEnvWith without options: everything is opened at once.
func NewEnv(ctx context.Context, storeDir string, log *slog.Logger) (*Env, func(), error) {
	return NewEnvWith(ctx, storeDir, log, EnvOptions{})
}

// NewEnvWith opens the real components: the CUDA driver (loaded; cuInit on first use), NVML
// (both unless o.DeferGPU), CRIU and the store at storeDir ("" opens no store: migrate needs
// none). It refuses a non-root caller first, before anything (the store included) is opened or
// created. Missing GPU components are recorded, not fatal: a CPU process needs only CRIU. Then
// it recovers the operations an earlier ptxmig left interrupted (RecoverInterrupted; Recovery
// says what it did; it opens the driver itself if it needs it). The returned func releases what
// was opened, OpenGPU's too.
func NewEnvWith(ctx context.Context, storeDir string, log *slog.Logger, o EnvOptions) (*Env, func(), error) {
	if log == nil {
		log = slog.Default()
	}
	env := &Env{Log: log, Euid: os.Geteuid(), GuardianExe: guardianExe, gpuDeferred: o.DeferGPU}
	closeAll := func() {
		for i := len(env.closers) - 1; i >= 0; i-- {
			env.closers[i]()
		}
	}
	if err := env.RequireRoot("ptxmig"); err != nil {
		return nil, func() {}, err
	}
	if storeDir != "" {
		st, err := store.Open(storeDir)
		if err != nil {
			return nil, closeAll, Refusef("store %s: %w", storeDir, err)
		}
		env.Store = st
	}
	// The driver, NVML and CRIU are independent and each takes tens of milliseconds to load (more
	// from a cold page cache): they are probed at once, so a command does not pay the sum.
	var (
		dumper   *criu.Dumper
		criuText string
		criuErr  error
		wg       sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		start := time.Now()
		dumper, criuText, criuErr = criu.NewDumper(ctx)
		log.Debug("probed CRIU", "took", time.Since(start))
	}()
	if o.DeferGPU {
		env.Host = ReadHostInfo(nil)
	} else {
		env.openGPU()
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		// A signal during the probes kills them (`criu --version`): that is an interruption, not
		// an unusable CRIU.
		return nil, closeAll, fmt.Errorf("interrupted while probing the host: %w", err)
	}
	if criuErr != nil {
		env.CRIUErr = criuErr
	} else {
		env.CRIU, env.CRIUVersion = dumper, criuText
	}
	env.Recovery = env.RecoverInterrupted(ctx)
	return env, closeAll, nil
}

// OpenGPU opens the CUDA driver and NVML that NewEnvWith deferred (DeferGPU), once; it does
// nothing for an Env that opened them already or that a test built. Planning calls it, from one
// goroutine.
func (e *Env) OpenGPU() {
	if e.gpuDeferred {
		e.gpuDeferred = false
		e.openGPU()
	}
}

// openGPU loads the driver and NVML at once and records them (or why not), the host's driver
// versions and NVML's closer.
func (e *Env) openGPU() {
	var (
		drv              *cudackpt.Driver
		inv              *gpu.Inventory
		drvErr, invErr   error
		drvTook, invTook time.Duration
		wg               sync.WaitGroup
	)
	start := time.Now()
	wg.Add(1)
	go func() {
		defer wg.Done()
		// Loaded, not initialized (cudackpt.Open): only CUDA processes need cuInit.
		drv, drvErr = cudackpt.Open()
		drvTook = time.Since(start)
	}()
	inv, invErr = gpu.Open()
	invTook = time.Since(start)
	wg.Wait()
	log := e.Logger()
	log.Debug("probed the GPUs", "took", time.Since(start), "driver", drvTook, "nvml", invTook)
	if drvErr != nil {
		e.DriverErr = drvErr
		log.Debug("no CUDA driver", "err", drvErr)
	} else {
		e.Driver = drv
	}
	var di *gpu.DriverInfo
	if invErr != nil {
		log.Debug("no NVML", "err", invErr)
	} else {
		e.GPUs = inv
		e.closers = append(e.closers, func() { _ = inv.Close() })
		if d, err := inv.Driver(); err == nil {
			di = &d
			e.DriverVersion = func() (string, error) { return d.Driver, nil }
		}
	}
	e.Host = ReadHostInfo(di)
}

// StartDriver initializes the CUDA driver in the background, for an operation that will need it
// after other work (a restore's driver steps come after CRIU's restore): cuInit takes 200-300 ms
// on a GPU that no process is using, which then overlaps that work. The driver's calls wait for
// it and report its failure. A driver without a separate initialization (a fake) is left alone.
func (e *Env) StartDriver() {
	if d, ok := e.Driver.(interface{ Init() error }); ok {
		go func() { _ = d.Init() }()
	}
}

// RequireRoot refuses when the caller is not root: every operation reads, freezes or recreates
// another process, and the store holds process memory.
func (e *Env) RequireRoot(what string) error {
	if e.Euid != 0 {
		return Refusef("%s must run as root: it reads, freezes and recreates other processes, and its store holds their memory (euid %d)", what, e.Euid)
	}
	return nil
}
