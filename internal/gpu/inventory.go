package gpu

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Process is a compute process on a GPU as NVML reports it.
type Process struct {
	PID        int    `json:"pid"`
	UsedMemory uint64 `json:"used_memory_bytes"` // includes the CUDA context; for placement, not image sizes; 0: unknown
}

// Device is one GPU of this host. Utilization and power are -1 when the GPU does not report them.
type Device struct {
	Index       int       `json:"index"`
	UUID        string    `json:"uuid"`
	Name        string    `json:"name"`
	ComputeCap  string    `json:"compute_capability"`
	BusID       string    `json:"bus_id,omitempty"`
	Minor       int       `json:"minor"` // /dev/nvidiaN
	MemoryUsed  uint64    `json:"memory_used_bytes"`
	MemoryTotal uint64    `json:"memory_total_bytes"`
	Utilization int       `json:"utilization_percent"`
	PowerW      float64   `json:"power_watts"`
	Processes   []Process `json:"processes"`
}

// MemoryFree is the memory not in use.
func (d Device) MemoryFree() uint64 {
	if d.MemoryUsed >= d.MemoryTotal {
		return 0
	}
	return d.MemoryTotal - d.MemoryUsed
}

// Lister is what callers need from an inventory; tests substitute fakes.
type Lister interface {
	Devices() ([]Device, error)
}

// PeerPather is a Lister that can also tell whether two GPUs have a peer path (peer reads
// between them: NVLink or PCIe P2P). Inventory is one; callers that get a Lister without it
// check nothing.
type PeerPather interface {
	PeerPath(uuidA, uuidB string) (bool, error)
}

// Inventory reads GPUs through NVML. Close it when done.
type Inventory struct {
	lib nvml.Interface
}

// Open initialises NVML (libnvidia-ml.so.1, loaded at run time). Without a driver the error wraps
// ErrNoDriver.
func Open() (*Inventory, error) { return OpenWith(nvml.New()) }

// OpenWith uses lib (a mock in tests).
func OpenWith(lib nvml.Interface) (*Inventory, error) {
	if r := lib.Init(); r != nvml.SUCCESS {
		return nil, NVMLError("nvml init", r)
	}
	return &Inventory{lib: lib}, nil
}

// Close shuts NVML down.
func (i *Inventory) Close() error {
	if i == nil || i.lib == nil {
		return nil
	}
	r := i.lib.Shutdown()
	i.lib = nil
	return NVMLError("nvml shutdown", r)
}

// Driver returns the driver and CUDA versions.
func (i *Inventory) Driver() (DriverInfo, error) {
	drv, r := i.lib.SystemGetDriverVersion()
	if err := NVMLError("driver version", r); err != nil {
		return DriverInfo{}, err
	}
	cv, r := i.lib.SystemGetCudaDriverVersion_v2()
	if err := NVMLError("cuda version", r); err != nil {
		return DriverInfo{}, err
	}
	return DriverInfo{Driver: drv, CUDA: FormatCUDAVersion(cv)}, nil
}

// Devices reads every GPU: identity, memory, utilization, power and compute processes.
func (i *Inventory) Devices() ([]Device, error) {
	n, r := i.lib.DeviceGetCount()
	if err := NVMLError("device count", r); err != nil {
		return nil, err
	}
	out := make([]Device, 0, n)
	for idx := 0; idx < n; idx++ {
		h, r := i.lib.DeviceGetHandleByIndex(idx)
		if err := NVMLError(fmt.Sprintf("GPU %d handle", idx), r); err != nil {
			return nil, err
		}
		d, err := readDevice(idx, h)
		if err != nil {
			return nil, err
		}
		out = append(out, d)
	}
	return out, nil
}

// PeerPath reports whether the GPUs with UUIDs a and b have a peer path for reads
// (nvmlDeviceGetP2PStatus with NVML_P2P_CAPS_INDEX_READ: what cuDeviceCanAccessPeer answers).
func (i *Inventory) PeerPath(a, b string) (bool, error) {
	ha, r := i.lib.DeviceGetHandleByUUID(a)
	if err := NVMLError("GPU "+a, r); err != nil {
		return false, err
	}
	hb, r := i.lib.DeviceGetHandleByUUID(b)
	if err := NVMLError("GPU "+b, r); err != nil {
		return false, err
	}
	st, r := i.lib.DeviceGetP2PStatus(ha, hb, nvml.P2P_CAPS_INDEX_READ)
	if err := NVMLError("peer path", r); err != nil {
		return false, err
	}
	return st == nvml.P2P_STATUS_OK, nil
}

func readDevice(idx int, h nvml.Device) (Device, error) {
	d := Device{Index: idx, Utilization: -1, PowerW: -1, Minor: -1}
	var r nvml.Return
	if d.UUID, r = h.GetUUID(); r != nvml.SUCCESS {
		return d, NVMLError(fmt.Sprintf("GPU %d uuid", idx), r)
	}
	if d.Name, r = h.GetName(); r != nvml.SUCCESS {
		return d, NVMLError(fmt.Sprintf("GPU %d name", idx), r)
	}
	maj, mnr, r := h.GetCudaComputeCapability()
	if r != nvml.SUCCESS {
		return d, NVMLError(fmt.Sprintf("GPU %d compute capability", idx), r)
	}
	d.ComputeCap = fmt.Sprintf("%d.%d", maj, mnr)
	mem, r := h.GetMemoryInfo()
	if r != nvml.SUCCESS {
		return d, NVMLError(fmt.Sprintf("GPU %d memory", idx), r)
	}
	d.MemoryUsed, d.MemoryTotal = mem.Used, mem.Total
	if m, r := h.GetMinorNumber(); r == nvml.SUCCESS {
		d.Minor = m
	}
	if pci, r := h.GetPciInfo(); r == nvml.SUCCESS {
		d.BusID = normaliseBusID(int8String(pci.BusId[:]))
	}
	if u, r := h.GetUtilizationRates(); r == nvml.SUCCESS {
		d.Utilization = int(u.Gpu)
	}
	if mw, r := h.GetPowerUsage(); r == nvml.SUCCESS {
		d.PowerW = float64(mw) / 1000
	}
	procs, r := h.GetComputeRunningProcesses()
	if r != nvml.SUCCESS && r != nvml.ERROR_NOT_SUPPORTED {
		return d, NVMLError(fmt.Sprintf("GPU %d processes", idx), r)
	}
	for _, p := range procs {
		if p.Pid == 0 {
			continue
		}
		used := p.UsedGpuMemory
		if used > d.MemoryTotal {
			// NVML_VALUE_NOT_AVAILABLE (all ones: no permission, or another PID namespace).
			// Summed into image and room estimates it would wrap around: record it as unknown.
			used = 0
		}
		d.Processes = append(d.Processes, Process{PID: int(p.Pid), UsedMemory: used})
	}
	sort.Slice(d.Processes, func(a, b int) bool { return d.Processes[a].PID < d.Processes[b].PID })
	return d, nil
}

func int8String(b []int8) string {
	var s strings.Builder
	for _, c := range b {
		if c == 0 {
			break
		}
		s.WriteByte(byte(c))
	}
	return s.String()
}

// normaliseBusID turns NVML's "00000000:00:06.0" into "0000:00:06.0" (lower case), as in sysfs.
func normaliseBusID(s string) string {
	s = strings.ToLower(s)
	if i := strings.IndexByte(s, ':'); i > 4 {
		s = s[i-4:]
	}
	return s
}

// ErrNoSuchGPU means a GPU named by index or UUID is not present.
var ErrNoSuchGPU = errors.New("no such GPU")

// Find returns the device with the given UUID, or index when ref is a number.
func Find(devs []Device, ref string) (Device, error) {
	for _, d := range devs {
		if strings.EqualFold(d.UUID, ref) || fmt.Sprint(d.Index) == ref {
			return d, nil
		}
	}
	return Device{}, fmt.Errorf("GPU %s: %w (this host has %s)", ref, ErrNoSuchGPU, describe(devs))
}

func describe(devs []Device) string {
	if len(devs) == 0 {
		return "no GPUs"
	}
	parts := make([]string, len(devs))
	for i, d := range devs {
		parts[i] = fmt.Sprintf("%d=%s", d.Index, d.UUID)
	}
	return strings.Join(parts, ", ")
}

// UsedBy returns the GPUs on which pid runs compute work, with its memory there.
func UsedBy(devs []Device, pid int) []Usage {
	var out []Usage
	for _, d := range devs {
		for _, p := range d.Processes {
			if p.PID == pid {
				out = append(out, Usage{Device: d, Memory: p.UsedMemory})
			}
		}
	}
	return out
}

// Usage is one GPU a process uses and how much of its memory.
type Usage struct {
	Device Device
	Memory uint64
}
