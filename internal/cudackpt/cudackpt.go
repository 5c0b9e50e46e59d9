// Package cudackpt binds the NVIDIA driver's process checkpoint API (cuCheckpointProcess*) and the
// few device queries ptxmig needs. libcuda.so.1 is loaded with dlopen at run time, so ptxmig builds
// and runs on hosts without CUDA; Open then fails with ErrNoDriver. The C types are declared here
// (layouts of CUDA 13.0's cuda.h); no CUDA headers are needed to build.
//
// The API acts on another process by PID: Lock (RUNNING→LOCKED), Checkpoint (LOCKED→CHECKPOINTED:
// device memory moves into the target's host memory and the GPUs are released), Restore
// (CHECKPOINTED→LOCKED, optionally remapping GPUs by UUID) and Unlock (LOCKED→RUNNING).
package cudackpt

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct { unsigned char bytes[16]; } ptx_uuid;

typedef struct {
	unsigned int timeoutMs;
	unsigned int reserved0;
	uint64_t reserved1[7];
} ptx_lock_args;

typedef struct { uint64_t reserved[8]; } ptx_ckpt_args;
typedef struct { uint64_t reserved[8]; } ptx_unlock_args;

typedef struct {
	ptx_uuid oldUuid;
	ptx_uuid newUuid;
} ptx_gpu_pair;

typedef struct {
	ptx_gpu_pair *gpuPairs;
	unsigned int gpuPairsCount;
	char reserved[44];
	uint64_t reserved1;
} ptx_restore_args;

typedef CUresult (*fn_init)(unsigned int);
typedef CUresult (*fn_int_out)(int *);
typedef CUresult (*fn_dev_get)(CUdevice *, int);
typedef CUresult (*fn_dev_uuid)(ptx_uuid *, CUdevice);
typedef CUresult (*fn_dev_name)(char *, int, CUdevice);
typedef CUresult (*fn_dev_attr)(int *, int, CUdevice);
typedef CUresult (*fn_dev_mem)(size_t *, CUdevice);
typedef CUresult (*fn_err_str)(CUresult, const char **);
typedef CUresult (*fn_pid_int)(int, int *);
typedef CUresult (*fn_lock)(int, ptx_lock_args *);
typedef CUresult (*fn_ckpt)(int, ptx_ckpt_args *);
typedef CUresult (*fn_restore)(int, ptx_restore_args *);
typedef CUresult (*fn_unlock)(int, ptx_unlock_args *);

static struct {
	void *h;
	fn_init init;
	fn_int_out driverGetVersion, deviceGetCount;
	fn_dev_get deviceGet;
	fn_dev_uuid deviceGetUuid;
	fn_dev_name deviceGetName;
	fn_dev_attr deviceGetAttribute;
	fn_dev_mem deviceTotalMem;
	fn_err_str getErrorName, getErrorString;
	fn_pid_int getState, getRestoreThreadId;
	fn_lock lock;
	fn_ckpt checkpoint;
	fn_restore restore;
	fn_unlock unlock;
} cu;

// ptx_load opens libcuda and resolves every symbol. Returns 0, or 1 when the library is missing,
// or 2 when a symbol is missing (a driver without the checkpoint API); *missing names it.
static int ptx_load(const char *path, const char **missing) {
	if (cu.h) return 0;
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) { *missing = dlerror(); return 1; }
#define SYM(field, name) do { *(void **)(&cu.field) = dlsym(h, name); if (!cu.field) { *missing = name; dlclose(h); memset(&cu, 0, sizeof cu); return 2; } } while (0)
	SYM(init, "cuInit");
	SYM(driverGetVersion, "cuDriverGetVersion");
	SYM(deviceGetCount, "cuDeviceGetCount");
	SYM(deviceGet, "cuDeviceGet");
	SYM(deviceGetUuid, "cuDeviceGetUuid_v2");
	SYM(deviceGetName, "cuDeviceGetName");
	SYM(deviceGetAttribute, "cuDeviceGetAttribute");
	SYM(deviceTotalMem, "cuDeviceTotalMem_v2");
	SYM(getErrorName, "cuGetErrorName");
	SYM(getErrorString, "cuGetErrorString");
	SYM(getState, "cuCheckpointProcessGetState");
	SYM(getRestoreThreadId, "cuCheckpointProcessGetRestoreThreadId");
	SYM(lock, "cuCheckpointProcessLock");
	SYM(checkpoint, "cuCheckpointProcessCheckpoint");
	SYM(restore, "cuCheckpointProcessRestore");
	SYM(unlock, "cuCheckpointProcessUnlock");
#undef SYM
	cu.h = h;
	return 0;
}

static CUresult ptx_init(void) { return cu.init(0); }
static CUresult ptx_driver_version(int *v) { return cu.driverGetVersion(v); }
static CUresult ptx_device_count(int *n) { return cu.deviceGetCount(n); }
static CUresult ptx_device_get(CUdevice *d, int ordinal) { return cu.deviceGet(d, ordinal); }
static CUresult ptx_device_uuid(ptx_uuid *u, CUdevice d) { return cu.deviceGetUuid(u, d); }
static CUresult ptx_device_name(char *s, int n, CUdevice d) { return cu.deviceGetName(s, n, d); }
static CUresult ptx_device_attr(int *v, int attr, CUdevice d) { return cu.deviceGetAttribute(v, attr, d); }
static CUresult ptx_device_mem(size_t *v, CUdevice d) { return cu.deviceTotalMem(v, d); }
static const char *ptx_error_name(CUresult r) { const char *s = 0; if (cu.getErrorName(r, &s) != 0) return 0; return s; }
static const char *ptx_error_string(CUresult r) { const char *s = 0; if (cu.getErrorString(r, &s) != 0) return 0; return s; }
static CUresult ptx_get_state(int pid, int *st) { return cu.getState(pid, st); }
static CUresult ptx_restore_tid(int pid, int *tid) { return cu.getRestoreThreadId(pid, tid); }
static CUresult ptx_lock(int pid, unsigned int timeoutMs) {
	ptx_lock_args a; memset(&a, 0, sizeof a); a.timeoutMs = timeoutMs;
	return cu.lock(pid, &a);
}
static CUresult ptx_checkpoint(int pid) { ptx_ckpt_args a; memset(&a, 0, sizeof a); return cu.checkpoint(pid, &a); }
static CUresult ptx_restore(int pid, ptx_gpu_pair *pairs, unsigned int n) {
	ptx_restore_args a; memset(&a, 0, sizeof a);
	a.gpuPairs = n ? pairs : 0; a.gpuPairsCount = n;
	return cu.restore(pid, &a);
}
static CUresult ptx_unlock(int pid) { ptx_unlock_args a; memset(&a, 0, sizeof a); return cu.unlock(pid, &a); }
_Static_assert(sizeof(ptx_lock_args) == 64, "CUcheckpointLockArgs is 64 bytes");
_Static_assert(sizeof(ptx_ckpt_args) == 64, "CUcheckpointCheckpointArgs is 64 bytes");
_Static_assert(sizeof(ptx_unlock_args) == 64, "CUcheckpointUnlockArgs is 64 bytes");
_Static_assert(sizeof(ptx_restore_args) == 64, "CUcheckpointRestoreArgs is 64 bytes");
_Static_assert(sizeof(ptx_gpu_pair) == 32, "CUcheckpointGpuPair is 32 bytes");
static int ptx_sizes_ok(void) {
	return sizeof(ptx_lock_args) == 64 && sizeof(ptx_ckpt_args) == 64 && sizeof(ptx_unlock_args) == 64 &&
	       sizeof(ptx_restore_args) == 64 && sizeof(ptx_gpu_pair) == 32;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"time"
	"unsafe"

	"github.com/ptxmig/ptxmig/internal/proc"
)

// Sentinel errors. Driver failures are *Error values that match these with errors.Is.
var (
	// ErrNoDriver: libcuda.so.1 could not be loaded (no NVIDIA driver on this host).
	ErrNoDriver = errors.New("no NVIDIA driver (libcuda.so.1 not found)")
	// ErrNotSupported: the driver lacks the checkpoint API (needs >= 570; GPU remap needs >= 580).
	ErrNotSupported = errors.New("the NVIDIA driver has no process checkpoint API (need driver >= 570)")
	// ErrTimeout: Lock timed out (CUDA_ERROR_NOT_READY); the process was left running.
	ErrTimeout = errors.New("lock timed out: a kernel or copy was still running")
	// ErrNotCUDA: the process has no CUDA state the driver knows of.
	ErrNotCUDA = errors.New("process does not use CUDA")
	// ErrNotInitialized: the driver answers CUDA_ERROR_NOT_INITIALIZED about the process: it has
	// loaded libcuda but never initialized CUDA (a torch.compile worker), or the driver lost it.
	ErrNotInitialized = errors.New("the driver has no initialized CUDA in the process")
	// ErrStopped: the process's restore thread is stopped (SIGSTOP, a tracer), and the driver's
	// state query would wait for it for ever (driver 580.159.04, H200): State does not ask.
	ErrStopped = errors.New("the process is stopped: the driver cannot be asked about it until it is continued")
	// ErrNoRestoreThread: the driver names no restore thread for the process (a fake driver's
	// pretend process), so nothing is held around its checkpoint and restore.
	ErrNoRestoreThread = errors.New("no restore thread")
)

// CUDA driver result codes ptxmig treats specially (cuda.h).
const (
	cuSuccess         = 0
	cuInvalidValue    = 1
	cuNotInitialized  = 3
	cuNoDevice        = 100
	cuNotFound        = 500
	cuNotReady        = 600
	cuNotSupported    = 801
	cuIllegalState    = 401
	cuOperatingSystem = 304
)

// Error is a failed driver call.
type Error struct {
	Op   string // the call, e.g. "cuCheckpointProcessLock(pid 42)"
	Code int    // CUresult
	Name string // e.g. CUDA_ERROR_NOT_READY
	Msg  string // the driver's description
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: %s (%d): %s", e.Op, e.Name, e.Code, e.Msg)
}

// Is maps result codes onto the package's sentinels.
func (e *Error) Is(target error) bool {
	switch target {
	case ErrTimeout:
		return e.Code == cuNotReady
	case ErrNotSupported:
		return e.Code == cuNotSupported
	case ErrNotCUDA:
		return e.Code == cuNotFound
	case ErrNotInitialized:
		return e.Code == cuNotInitialized
	}
	return false
}

// State is a process's checkpoint state (CUprocessState).
type State int

// Process states.
const (
	Running      State = 0
	Locked       State = 1
	Checkpointed State = 2
	Failed       State = 3
)

func (s State) String() string {
	switch s {
	case Running:
		return "running"
	case Locked:
		return "locked"
	case Checkpointed:
		return "checkpointed"
	case Failed:
		return "failed"
	}
	return fmt.Sprintf("state-%d", int(s))
}

// UUID is a GPU UUID (CUuuid).
type UUID [16]byte

// String formats the UUID as NVML and nvidia-smi do: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
func (u UUID) String() string {
	b := u[:]
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// ParseUUID parses "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (the "GPU-" prefix is optional).
func ParseUUID(s string) (UUID, error) {
	var u UUID
	in := s
	if len(in) >= 4 && (in[:4] == "GPU-" || in[:4] == "gpu-") {
		in = in[4:]
	}
	n := 0
	for i := 0; i < len(in); i++ {
		c := in[i]
		if c == '-' {
			continue
		}
		var v byte
		switch {
		case c >= '0' && c <= '9':
			v = c - '0'
		case c >= 'a' && c <= 'f':
			v = c - 'a' + 10
		case c >= 'A' && c <= 'F':
			v = c - 'A' + 10
		default:
			return UUID{}, fmt.Errorf("GPU UUID %q: bad character %q", s, c)
		}
		if n >= 32 {
			return UUID{}, fmt.Errorf("GPU UUID %q: too long", s)
		}
		if n%2 == 0 {
			u[n/2] = v << 4
		} else {
			u[n/2] |= v
		}
		n++
	}
	if n != 32 {
		return UUID{}, fmt.Errorf("GPU UUID %q: want 32 hex digits, got %d", s, n)
	}
	return u, nil
}

// Pair remaps one checkpointed GPU onto another at restore.
type Pair struct{ Old, New UUID }

// Device is one CUDA device as the driver reports it.
type Device struct {
	Ordinal     int
	UUID        UUID
	Name        string
	ComputeCap  string // "9.0"
	MemoryTotal uint64
}

// Driver is the loaded driver. Its methods are safe for concurrent use. Each initializes the
// driver first (Init), once per process.
type Driver struct {
	Version int // cuDriverGetVersion, e.g. 13000

	initOnce sync.Once
	initErr  error
}

var (
	openOnce sync.Once
	openDrv  *Driver
	openErr  error
)

// Open loads libcuda.so.1 and reads the driver's version, once per process (later calls return
// the same Driver). It fails with ErrNoDriver when the library is absent and ErrNotSupported when
// the driver has no checkpoint API. It does not initialize the driver: cuInit takes 200-300 ms
// on a GPU that no process is using (2026-11-27, H100, driver 580), which a CPU-only checkpoint
// or restore never needs; the first method that talks to the driver does it (Init).
func Open() (*Driver, error) {
	openOnce.Do(func() { openDrv, openErr = open() })
	return openDrv, openErr
}

func open() (*Driver, error) {
	if C.ptx_sizes_ok() == 0 {
		return nil, errors.New("cudackpt: struct layout mismatch (internal error)")
	}
	path := C.CString(libPath())
	defer C.free(unsafe.Pointer(path))
	var missing *C.char
	switch C.ptx_load(path, &missing) {
	case 1:
		return nil, fmt.Errorf("%w: %s", ErrNoDriver, C.GoString(missing))
	case 2:
		return nil, fmt.Errorf("%w: libcuda has no %s", ErrNotSupported, C.GoString(missing))
	}
	var v C.int // cuDriverGetVersion is one of the calls allowed before cuInit
	if r := C.ptx_driver_version(&v); r != cuSuccess {
		return nil, cuErr("cuDriverGetVersion", r)
	}
	return &Driver{Version: int(v)}, nil
}

// Init initializes the driver (cuInit) once; later calls return the first one's result. A host
// without a usable GPU fails with ErrNoDriver. Calling it early in its own goroutine lets the
// initialization overlap other work (a restore starts it before CRIU's restore).
func (d *Driver) Init() error {
	d.initOnce.Do(func() {
		if r := C.ptx_init(); r != cuSuccess {
			d.initErr = cuErr("cuInit", r)
			if int(r) == cuNoDevice {
				d.initErr = fmt.Errorf("%w: %w", ErrNoDriver, d.initErr)
			}
		}
	})
	return d.initErr
}

// libPath is libcuda.so.1, or $PTXMIG_LIBCUDA (a test or an unusual install).
func libPath() string {
	if p := os.Getenv("PTXMIG_LIBCUDA"); p != "" {
		return p
	}
	return "libcuda.so.1"
}

func cuErr(op string, r C.CUresult) error {
	if r == cuSuccess {
		return nil
	}
	e := &Error{Op: op, Code: int(r), Name: "CUDA_ERROR_UNKNOWN", Msg: "unknown error"}
	if s := C.ptx_error_name(r); s != nil {
		e.Name = C.GoString(s)
	}
	if s := C.ptx_error_string(r); s != nil {
		e.Msg = C.GoString(s)
	}
	return e
}

// State returns the checkpoint state of pid; ErrStopped, without asking the driver, while the
// thread the driver would ask is stopped (ptxmig leaves a process stopped from the driver's
// checkpoint until its restore; package hold).
func (d *Driver) State(pid int) (State, error) {
	if err := d.Init(); err != nil {
		return 0, err
	}
	if tid, err := d.RestoreThreadID(pid); err == nil {
		if proc.ThreadStopped(pid, tid) {
			return 0, fmt.Errorf("pid %d: %w", pid, ErrStopped)
		}
	}
	var st C.int
	if r := C.ptx_get_state(C.int(pid), &st); r != cuSuccess {
		return 0, cuErr(fmt.Sprintf("cuCheckpointProcessGetState(pid %d)", pid), r)
	}
	return State(st), nil
}

// RestoreThreadID returns the thread of pid that the driver uses to restore it.
func (d *Driver) RestoreThreadID(pid int) (int, error) {
	if err := d.Init(); err != nil {
		return 0, err
	}
	var tid C.int
	if r := C.ptx_restore_tid(C.int(pid), &tid); r != cuSuccess {
		return 0, cuErr(fmt.Sprintf("cuCheckpointProcessGetRestoreThreadId(pid %d)", pid), r)
	}
	return int(tid), nil
}

// Lock blocks further CUDA calls of pid and waits for submitted work, for at most timeout
// (0: no limit). On ErrTimeout the process is left running.
func (d *Driver) Lock(pid int, timeout time.Duration) error {
	if err := d.Init(); err != nil {
		return err
	}
	if timeout < 0 {
		// C.uint would wrap a negative count into a 49-day timeout.
		return fmt.Errorf("cuCheckpointProcessLock(pid %d): negative timeout %s", pid, timeout)
	}
	ms := timeout.Milliseconds()
	if timeout > 0 && ms == 0 {
		ms = 1
	}
	if ms > 0xffffffff {
		ms = 0xffffffff
	}
	r := C.ptx_lock(C.int(pid), C.uint(ms))
	return cuErr(fmt.Sprintf("cuCheckpointProcessLock(pid %d, timeout %s)", pid, timeout), r)
}

// Checkpoint moves pid's device memory into its host memory and releases its GPUs.
func (d *Driver) Checkpoint(pid int) error {
	if err := d.Init(); err != nil {
		return err
	}
	return cuErr(fmt.Sprintf("cuCheckpointProcessCheckpoint(pid %d)", pid), C.ptx_checkpoint(C.int(pid)))
}

// Restore brings pid's GPU state back. With pairs, each checkpointed GPU Old is restored onto New;
// the driver requires the pairs to list every GPU the process used.
func (d *Driver) Restore(pid int, pairs []Pair) error {
	if err := d.Init(); err != nil {
		return err
	}
	var p *C.ptx_gpu_pair
	if len(pairs) > 0 {
		cp := (*C.ptx_gpu_pair)(C.calloc(C.size_t(len(pairs)), C.size_t(unsafe.Sizeof(C.ptx_gpu_pair{}))))
		if cp == nil {
			return errors.New("cudackpt: out of memory")
		}
		defer C.free(unsafe.Pointer(cp))
		arr := unsafe.Slice(cp, len(pairs))
		for i, pr := range pairs {
			for j := 0; j < 16; j++ {
				arr[i].oldUuid.bytes[j] = C.uchar(pr.Old[j])
				arr[i].newUuid.bytes[j] = C.uchar(pr.New[j])
			}
		}
		p = cp
	}
	r := C.ptx_restore(C.int(pid), p, C.uint(len(pairs)))
	return cuErr(fmt.Sprintf("cuCheckpointProcessRestore(pid %d, %d GPU pairs)", pid, len(pairs)), r)
}

// Unlock lets pid call CUDA again.
func (d *Driver) Unlock(pid int) error {
	if err := d.Init(); err != nil {
		return err
	}
	return cuErr(fmt.Sprintf("cuCheckpointProcessUnlock(pid %d)", pid), C.ptx_unlock(C.int(pid)))
}

// CUDA device attributes (cuda.h).
const (
	attrCCMajor = 75
	attrCCMinor = 76
)

// Devices lists the CUDA devices visible to ptxmig (honours CUDA_VISIBLE_DEVICES).
func (d *Driver) Devices() ([]Device, error) {
	if err := d.Init(); err != nil {
		return nil, err
	}
	var n C.int
	if r := C.ptx_device_count(&n); r != cuSuccess {
		return nil, cuErr("cuDeviceGetCount", r)
	}
	out := make([]Device, 0, int(n))
	for i := 0; i < int(n); i++ {
		var dev C.CUdevice
		if r := C.ptx_device_get(&dev, C.int(i)); r != cuSuccess {
			return nil, cuErr(fmt.Sprintf("cuDeviceGet(%d)", i), r)
		}
		var u C.ptx_uuid
		if r := C.ptx_device_uuid(&u, dev); r != cuSuccess {
			return nil, cuErr(fmt.Sprintf("cuDeviceGetUuid(%d)", i), r)
		}
		var name [256]C.char
		if r := C.ptx_device_name(&name[0], C.int(len(name)-1), dev); r != cuSuccess {
			return nil, cuErr(fmt.Sprintf("cuDeviceGetName(%d)", i), r)
		}
		name[len(name)-1] = 0 // C.GoString stops inside the buffer even if the driver filled it
		var maj, minr C.int
		if r := C.ptx_device_attr(&maj, attrCCMajor, dev); r != cuSuccess {
			return nil, cuErr(fmt.Sprintf("cuDeviceGetAttribute(%d, major)", i), r)
		}
		if r := C.ptx_device_attr(&minr, attrCCMinor, dev); r != cuSuccess {
			return nil, cuErr(fmt.Sprintf("cuDeviceGetAttribute(%d, minor)", i), r)
		}
		var mem C.size_t
		if r := C.ptx_device_mem(&mem, dev); r != cuSuccess {
			return nil, cuErr(fmt.Sprintf("cuDeviceTotalMem(%d)", i), r)
		}
		dv := Device{Ordinal: i, Name: C.GoString(&name[0]), ComputeCap: fmt.Sprintf("%d.%d", int(maj), int(minr)), MemoryTotal: uint64(mem)}
		for j := 0; j < 16; j++ {
			dv.UUID[j] = byte(u.bytes[j])
		}
		out = append(out, dv)
	}
	return out, nil
}

// FormatVersion renders a driver API version integer (13000) as "13.0".
func FormatVersion(v int) string { return fmt.Sprintf("%d.%d", v/1000, (v%1000)/10) }
