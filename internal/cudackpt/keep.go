package cudackpt

/*
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUhandle;
// CUmemAllocationProp (32 bytes): type, requestedHandleTypes, location {type, id},
// win32HandleMetaData, allocFlags.
typedef struct {
	int type, handle_types;
	struct { int type, id; } loc;
	void *win32;
	unsigned char flags[8];
} kp_prop;
_Static_assert(sizeof(kp_prop) == 32, "CUmemAllocationProp is 32 bytes");

static struct {
	int loaded;
	CUresult (*dev_get)(CUdevice *, int);
	CUresult (*retain)(CUcontext *, CUdevice);
	CUresult (*unretain)(CUdevice);
	CUresult (*set_current)(CUcontext);
	CUresult (*granularity)(size_t *, const kp_prop *, int);
	CUresult (*create)(CUhandle *, size_t, const kp_prop *, unsigned long long);
	CUresult (*release)(CUhandle);
	CUresult (*export_fd)(void *, CUhandle, int, unsigned long long);
} kp;

// kp_load resolves the calls Keep needs; 0, or 1 with the missing name.
static int kp_load(const char *path, const char **missing) {
	if (kp.loaded) return 0;
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) { *missing = dlerror(); return 1; }
#define KSYM(field, name) do { *(void **)(&kp.field) = dlsym(h, name); if (!kp.field) { *missing = name; return 1; } } while (0)
	KSYM(dev_get, "cuDeviceGet");
	KSYM(retain, "cuDevicePrimaryCtxRetain");
	KSYM(unretain, "cuDevicePrimaryCtxRelease_v2");
	KSYM(set_current, "cuCtxSetCurrent");
	KSYM(granularity, "cuMemGetAllocationGranularity");
	KSYM(create, "cuMemCreate");
	KSYM(release, "cuMemRelease");
	KSYM(export_fd, "cuMemExportToShareableHandle");
#undef KSYM
	kp.loaded = 1;
	return 0;
}

static void kp_prop_of(kp_prop *p, int ordinal) {
	memset(p, 0, sizeof *p);
	p->type = 1;          // CU_MEM_ALLOCATION_TYPE_PINNED
	p->handle_types = 1;  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
	p->loc.type = 1;      // CU_MEM_LOCATION_TYPE_DEVICE
	p->loc.id = ordinal;
}

// kp_enter makes the device's primary context current on this thread (retained once per Keep).
static CUresult kp_enter(int ordinal, int retain) {
	CUdevice d;
	CUcontext c;
	CUresult r = kp.dev_get(&d, ordinal);
	if (r == 0) r = kp.retain(&c, d);
	if (r == 0) {
		r = kp.set_current(c);
		if (!retain) kp.unretain(d);  // only to find it: the Keep's own reference holds it
	}
	return r;
}

// kp_alloc allocates at least bytes on the device (rounded up to its granularity) as memory that
// can be exported as a POSIX fd. *size is what was allocated.
static CUresult kp_alloc(int ordinal, size_t bytes, CUhandle *h, size_t *size) {
	kp_prop p;
	size_t g = 0;
	CUresult r = kp_enter(ordinal, 1);
	if (r) return r;
	kp_prop_of(&p, ordinal);
	r = kp.granularity(&g, &p, 0);
	if (r == 0 && (g == 0 || (g & (g - 1)))) r = 1;  // CUDA_ERROR_INVALID_VALUE
	if (r == 0) {
		*size = (bytes + g - 1) / g * g;
		r = kp.create(h, *size, &p, 0);
	}
	if (r) {
		CUdevice d;
		if (kp.dev_get(&d, ordinal) == 0) kp.unretain(d);
	}
	return r;
}

static CUresult kp_export(int ordinal, CUhandle h, int *fd) {
	CUresult r = kp_enter(ordinal, 0);
	return r ? r : kp.export_fd(fd, h, 1, 0);
}

static CUresult kp_free(int ordinal, CUhandle h) {
	CUresult r = kp_enter(ordinal, 0);
	if (r == 0) r = kp.release(h);
	CUdevice d;
	if (kp.dev_get(&d, ordinal) == 0) kp.unretain(d);
	return r;
}
*/
import "C"

import (
	"fmt"
	"os"
	"sync"
	"unsafe"
)

// Kept is device memory ptxmig allocates and keeps on one GPU while it moves a process there
// (migrate, device to device): the process's shim copies its owned memory into it before the
// driver checkpoint and back out of it on the target after the restore (docs/SHIM-PROTOCOL.md,
// "the target copy"). It lives in ptxmig's own primary context on that GPU, so it goes with
// ptxmig; the process's own host stash stays the copy of record.
type Kept struct {
	Device Device // the GPU it is on
	Size   uint64 // bytes allocated (the request rounded up to the allocation granularity)

	mu      sync.Mutex
	ordinal int
	h       C.CUhandle
	freed   bool
}

// Keep allocates at least bytes of exportable device memory on the GPU with UUID u (one of
// Devices). It initializes the driver and retains that GPU's primary context (200-500 ms the
// first time on a GPU: spend it while the process still runs).
func (d *Driver) Keep(u UUID, bytes uint64) (*Kept, error) {
	if bytes == 0 {
		return nil, fmt.Errorf("keep device memory: no bytes asked")
	}
	devs, err := d.Devices()
	if err != nil {
		return nil, err
	}
	var dev *Device
	for i := range devs {
		if devs[i].UUID == u {
			dev = &devs[i]
		}
	}
	if dev == nil {
		return nil, fmt.Errorf("keep device memory on %s: no such CUDA device visible to ptxmig", u)
	}
	cpath := C.CString(libPath())
	defer C.free(unsafe.Pointer(cpath))
	var missing *C.char
	if C.kp_load(cpath, &missing) != 0 {
		return nil, fmt.Errorf("keep device memory: the driver lacks %s", C.GoString(missing))
	}
	k := &Kept{Device: *dev, ordinal: dev.Ordinal}
	var size C.size_t
	if r := C.kp_alloc(C.int(dev.Ordinal), C.size_t(bytes), &k.h, &size); r != 0 {
		return nil, cuErr(fmt.Sprintf("keep %d bytes on GPU %d (cuMemCreate)", bytes, dev.Ordinal), r)
	}
	k.Size = uint64(size)
	return k, nil
}

// Export returns a new descriptor of the memory (cuMemExportToShareableHandle, POSIX fd), for the
// shim to import; the caller closes it.
func (k *Kept) Export() (*os.File, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.freed {
		return nil, fmt.Errorf("export kept device memory: already freed")
	}
	var fd C.int
	if r := C.kp_export(C.int(k.ordinal), k.h, &fd); r != 0 {
		return nil, cuErr("export kept device memory", r)
	}
	return os.NewFile(uintptr(fd), fmt.Sprintf("ptxmig-kept-gpu%d", k.ordinal)), nil
}

// Free releases the memory (what the shim imported of it goes when the shim drops it); idempotent.
func (k *Kept) Free() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.freed {
		return nil
	}
	k.freed = true
	if r := C.kp_free(C.int(k.ordinal), k.h); r != 0 {
		return cuErr("free kept device memory", r)
	}
	return nil
}
