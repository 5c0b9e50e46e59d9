package gpu

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

func fakeDevice(uuid, name string, used uint64, procs []nvml.ProcessInfo, power nvml.Return) *mock.Device {
	var bus [32]int8
	for i, c := range "00000000:1B:00.0" {
		bus[i] = int8(c)
	}
	return &mock.Device{
		GetUUIDFunc:                  func() (string, nvml.Return) { return uuid, nvml.SUCCESS },
		GetNameFunc:                  func() (string, nvml.Return) { return name, nvml.SUCCESS },
		GetCudaComputeCapabilityFunc: func() (int, int, nvml.Return) { return 9, 0, nvml.SUCCESS },
		GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) {
			return nvml.Memory{Total: 100 << 30, Used: used, Free: 100<<30 - used}, nvml.SUCCESS
		},
		GetMinorNumberFunc:             func() (int, nvml.Return) { return 3, nvml.SUCCESS },
		GetPciInfoFunc:                 func() (nvml.PciInfo, nvml.Return) { return nvml.PciInfo{BusId: bus}, nvml.SUCCESS },
		GetUtilizationRatesFunc:        func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{Gpu: 37}, nvml.SUCCESS },
		GetPowerUsageFunc:              func() (uint32, nvml.Return) { return 123456, power },
		GetComputeRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) { return procs, nvml.SUCCESS },
	}
}

func TestInventoryDevices(t *testing.T) {
	devs := []*mock.Device{
		fakeDevice("GPU-aaaa", "NVIDIA H200", 1<<30, []nvml.ProcessInfo{{Pid: 20, UsedGpuMemory: 300}, {Pid: 10, UsedGpuMemory: 700},
			{Pid: 30, UsedGpuMemory: ^uint64(0)}, {Pid: 0, UsedGpuMemory: 5}}, nvml.SUCCESS),
		fakeDevice("GPU-bbbb", "NVIDIA H200", 0, nil, nvml.ERROR_NOT_SUPPORTED),
	}
	shut := 0
	lib := &mock.Interface{
		InitFunc:                   func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc:               func() nvml.Return { shut++; return nvml.SUCCESS },
		DeviceGetCountFunc:         func() (int, nvml.Return) { return len(devs), nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(n int) (nvml.Device, nvml.Return) { return devs[n], nvml.SUCCESS },
	}
	inv, err := OpenWith(lib)
	if err != nil {
		t.Fatal(err)
	}
	got, err := inv.Devices()
	if err != nil {
		t.Fatal(err)
	}
	want0 := Device{Index: 0, UUID: "GPU-aaaa", Name: "NVIDIA H200", ComputeCap: "9.0", BusID: "0000:1b:00.0", Minor: 3,
		MemoryUsed: 1 << 30, MemoryTotal: 100 << 30, Utilization: 37, PowerW: 123.456,
		Processes: []Process{{PID: 10, UsedMemory: 700}, {PID: 20, UsedMemory: 300}, {PID: 30, UsedMemory: 0}}} // 30: NVML_VALUE_NOT_AVAILABLE; pid 0 dropped
	if !reflect.DeepEqual(got[0], want0) {
		t.Errorf("device 0 = %+v\nwant %+v", got[0], want0)
	}
	if got[1].PowerW != -1 || got[1].Processes != nil || got[1].MemoryFree() != 100<<30 {
		t.Errorf("device 1 = %+v", got[1])
	}
	if u := UsedBy(got, 20); len(u) != 1 || u[0].Device.UUID != "GPU-aaaa" || u[0].Memory != 300 {
		t.Errorf("UsedBy(20) = %+v", u)
	}
	if d, err := Find(got, "1"); err != nil || d.UUID != "GPU-bbbb" {
		t.Errorf("Find(1) = %+v, %v", d, err)
	}
	if d, err := Find(got, "gpu-AAAA"); err != nil || d.Index != 0 {
		t.Errorf("Find(uuid) = %+v, %v", d, err)
	}
	if _, err := Find(got, "7"); !errors.Is(err, ErrNoSuchGPU) {
		t.Errorf("Find(7) = %v", err)
	}
	if err := inv.Close(); err != nil || shut != 1 {
		t.Errorf("close: %v, shutdowns %d", err, shut)
	}
}

func TestOpenNoDriver(t *testing.T) {
	lib := &mock.Interface{InitFunc: func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }}
	if _, err := OpenWith(lib); !errors.Is(err, ErrNoDriver) {
		t.Fatalf("OpenWith = %v, want ErrNoDriver", err)
	}
}

func TestScanCUDAProcesses(t *testing.T) {
	root := t.TempDir()
	mk := func(pid, maps, comm, cmdline string, fds map[string]string) {
		d := filepath.Join(root, pid)
		if err := os.MkdirAll(filepath.Join(d, "fd"), 0o700); err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(d, "maps"), []byte(maps), 0o600)
		os.WriteFile(filepath.Join(d, "comm"), []byte(comm+"\n"), 0o600)
		os.WriteFile(filepath.Join(d, "cmdline"), []byte(cmdline), 0o600)
		for n, target := range fds {
			if err := os.Symlink(target, filepath.Join(d, "fd", n)); err != nil {
				t.Fatal(err)
			}
		}
	}
	mk("100", "7f00-7f01 r-xp 0 08:01 5 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04\n", "counter", "./counter\x00--mib\x0064\x00",
		map[string]string{"3": "/dev/nvidiactl", "4": "/dev/nvidia1", "5": "/dev/nvidia1", "6": "/dev/nvidia-uvm"})
	mk("200", "7f00-7f01 r-xp 0 08:01 5 /usr/lib/libc.so.6\n", "bash", "bash\x00", nil)
	mk("300", "1-2 r-xp 0 0 0 /opt/ptxmig/lib/libptxmig.so\n3-4 r-xp 0 0 0 /usr/lib/libcuda.so.1\n", "python3", "python3\x00train.py\x00", nil)
	os.MkdirAll(filepath.Join(root, "self"), 0o700)
	got, err := ScanCUDAProcesses(root)
	if err != nil {
		t.Fatal(err)
	}
	want := []ProcInfo{
		{PID: 100, Comm: "counter", Cmdline: []string{"./counter", "--mib", "64"}, Minors: []int{1}},
		{PID: 300, Comm: "python3", Cmdline: []string{"python3", "train.py"}, Shim: true},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("scan = %+v\nwant %+v", got, want)
	}
}

// TestPeerPath: NVML's read P2P status between two GPUs, by UUID: OK is a path, any other status
// none, an unknown UUID an error.
func TestPeerPath(t *testing.T) {
	a, b, c := &mock.Device{}, &mock.Device{}, &mock.Device{}
	lib := &mock.Interface{
		InitFunc: func() nvml.Return { return nvml.SUCCESS },
		DeviceGetHandleByUUIDFunc: func(u string) (nvml.Device, nvml.Return) {
			switch u {
			case "GPU-a":
				return a, nvml.SUCCESS
			case "GPU-b":
				return b, nvml.SUCCESS
			case "GPU-c":
				return c, nvml.SUCCESS
			}
			return nil, nvml.ERROR_NOT_FOUND
		},
		DeviceGetP2PStatusFunc: func(x, y nvml.Device, i nvml.GpuP2PCapsIndex) (nvml.GpuP2PStatus, nvml.Return) {
			if i != nvml.P2P_CAPS_INDEX_READ {
				return 0, nvml.ERROR_INVALID_ARGUMENT
			}
			if (x == a && y == b) || (x == b && y == a) {
				return nvml.P2P_STATUS_OK, nvml.SUCCESS
			}
			return nvml.P2P_STATUS_NOT_SUPPORTED, nvml.SUCCESS
		},
	}
	inv, err := OpenWith(lib)
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		a, b    string
		want    bool
		wantErr bool
	}{{"GPU-a", "GPU-b", true, false}, {"GPU-b", "GPU-a", true, false}, {"GPU-a", "GPU-c", false, false}, {"GPU-a", "GPU-x", false, true}} {
		got, err := inv.PeerPath(tt.a, tt.b)
		if got != tt.want || (err != nil) != tt.wantErr {
			t.Errorf("PeerPath(%s, %s) = %v, %v; want %v (error %v)", tt.a, tt.b, got, err, tt.want, tt.wantErr)
		}
	}
}
