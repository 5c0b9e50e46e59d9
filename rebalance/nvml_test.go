package rebalance

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"

	"github.com/ptxmig/ptxmig/internal/gpu"
)

// fakeClock advances only when slept on.
type fakeClock struct{ t time.Time }

func (c *fakeClock) Now() time.Time { return c.t }
func (c *fakeClock) Sleep(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c.t = c.t.Add(d)
	return nil
}

type fakeProcs map[int]ProcInfo

func (f fakeProcs) Read(pid int) (ProcInfo, error) {
	if p, ok := f[pid]; ok {
		return p, nil
	}
	return ProcInfo{}, fmt.Errorf("pid %d: %w", pid, ErrNoProcess)
}

// mockDevice is an H200 whose utilization readings cycle through util.
func mockDevice(i int, util []uint32, procs []nvml.ProcessInfo, putil func(uint64) ([]nvml.ProcessUtilizationSample, nvml.Return)) *mock.Device {
	n := 0
	return &mock.Device{
		GetUUIDFunc:                  func() (string, nvml.Return) { return uuidOf(i), nvml.SUCCESS },
		GetNameFunc:                  func() (string, nvml.Return) { return "NVIDIA H200", nvml.SUCCESS },
		GetCudaComputeCapabilityFunc: func() (int, int, nvml.Return) { return 9, 0, nvml.SUCCESS },
		GetEnforcedPowerLimitFunc:    func() (uint32, nvml.Return) { return 700000, nvml.SUCCESS },
		GetPowerUsageFunc:            func() (uint32, nvml.Return) { return uint32(100000 + 5000*int(util[n%len(util)])), nvml.SUCCESS },
		GetUtilizationRatesFunc: func() (nvml.Utilization, nvml.Return) {
			u := util[n%len(util)]
			n++
			return nvml.Utilization{Gpu: u}, nvml.SUCCESS
		},
		GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) {
			return nvml.Memory{Total: 141 * gib, Used: 10 * gib, Free: 131 * gib}, nvml.SUCCESS
		},
		GetComputeRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) { return procs, nvml.SUCCESS },
		GetProcessUtilizationFunc:      putil,
	}
}

func mockLib(devs ...*mock.Device) *mock.Interface {
	return &mock.Interface{
		InitFunc:           func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc:       func() nvml.Return { return nvml.SUCCESS },
		DeviceGetCountFunc: func() (int, nvml.Return) { return len(devs), nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			if i < 0 || i >= len(devs) {
				return nil, nvml.ERROR_INVALID_ARGUMENT
			}
			return devs[i], nvml.SUCCESS
		},
	}
}

func TestNVMLObserver(t *testing.T) {
	clock := &fakeClock{t: t0}
	start := uint64(t0.UnixMicro())
	var seen0 uint64
	dev0 := mockDevice(0, []uint32{90, 100, 80, 100, 100},
		[]nvml.ProcessInfo{{Pid: 100, UsedGpuMemory: 2 * gib}, {Pid: 101, UsedGpuMemory: 3 * gib}, {Pid: 300, UsedGpuMemory: gib}},
		func(last uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
			seen0 = last
			return []nvml.ProcessUtilizationSample{
				{Pid: 100, TimeStamp: start + 1, SmUtil: 60}, {Pid: 100, TimeStamp: start + 2, SmUtil: 40},
				{Pid: 101, TimeStamp: start + 1, SmUtil: 45},
				{Pid: 101, TimeStamp: start - 1, SmUtil: 99}, // before the window: ignored
			}, nvml.SUCCESS
		})
	// GPU 1 is idle: NVML answers NOT_FOUND for process utilization. pid 300 spans both GPUs,
	// pid 200 has no memory figure.
	dev1 := mockDevice(1, []uint32{0},
		[]nvml.ProcessInfo{{Pid: 200, UsedGpuMemory: ^uint64(0)}, {Pid: 300, UsedGpuMemory: gib}},
		func(uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) { return nil, nvml.ERROR_NOT_FOUND })
	// GPU 2 does not support process utilization (MIG): shares are unknown.
	dev2 := mockDevice(2, []uint32{50},
		[]nvml.ProcessInfo{{Pid: 400, UsedGpuMemory: gib}},
		func(uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED })
	procs := fakeProcs{
		100: {Comm: "counter", StartTicks: 5, StartTime: t0.Add(-time.Hour), EnvKnown: true, UnderShim: true},
		101: {Comm: "counter", StartTicks: 6, EnvKnown: true, EnvPin: true},
		200: {Comm: "idle"}, 300: {Comm: "multi"}, 400: {Comm: "mig"},
	}
	o := &NVMLObserver{Lib: mockLib(dev0, dev1, dev2), Proc: procs, Clock: clock, Interval: 250 * time.Millisecond}
	obs, err := o.Observe(context.Background(), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if seen0 != start {
		t.Errorf("process utilization asked since %d, want the window start %d", seen0, start)
	}
	if len(obs.GPUs) != 3 || obs.Window != time.Second || !obs.Time.Equal(t0.Add(time.Second)) {
		t.Fatalf("observation %+v", obs)
	}
	g0 := obs.GPUs[0]
	if g0.Samples != 5 || math.Abs(g0.Util-0.94) > 1e-9 || math.Abs(g0.PowerW-570) > 1e-9 || g0.PowerLimitW != 700 ||
		g0.ComputeCap != "9.0" || g0.MemFree() != 131*gib {
		t.Errorf("GPU 0: %+v", g0)
	}
	byPID := map[int]Process{}
	for _, p := range obs.Procs {
		byPID[p.PID] = p
	}
	if p := byPID[100]; !p.UtilKnown || math.Abs(p.Util-0.5) > 1e-9 || p.MemBytes != 2*gib || !p.UnderShim || p.Comm != "counter" || p.StartTicks != 5 {
		t.Errorf("pid 100: %+v", p)
	}
	if p := byPID[101]; !p.EnvPin || math.Abs(p.Util-0.45) > 1e-9 {
		t.Errorf("pid 101: %+v", p)
	}
	if p := byPID[200]; p.MemKnown || !p.UtilKnown || p.Util != 0 {
		t.Errorf("pid 200 (idle GPU, no memory figure): %+v", p)
	}
	if p := byPID[300]; len(p.GPUs) != 2 || p.MemBytes != 2*gib || p.InfoErr != "" {
		t.Errorf("pid 300 (two GPUs): %+v", p)
	}
	if p := byPID[400]; p.UtilKnown {
		t.Errorf("pid 400 (no process utilization): %+v", p)
	}

	loc, err := o.Locate(context.Background(), 300)
	if err != nil || !loc.Alive || len(loc.GPUs) != 2 {
		t.Errorf("locate 300: %+v %v", loc, err)
	}
	if loc, err := o.Locate(context.Background(), 999); err != nil || loc.Alive || len(loc.GPUs) != 0 {
		t.Errorf("locate gone: %+v %v", loc, err)
	}
}

func TestNVMLErrors(t *testing.T) {
	lib := mockLib()
	lib.InitFunc = func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }
	if _, _, err := OpenNVML(lib); !errors.Is(err, gpu.ErrNoDriver) {
		t.Errorf("no library: %v", err)
	}
	dev := mockDevice(0, []uint32{10}, nil, nil)
	dev.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{}, nvml.ERROR_GPU_IS_LOST }
	o := &NVMLObserver{Lib: mockLib(dev), Proc: fakeProcs{}, Clock: &fakeClock{t: t0}}
	if _, err := o.Observe(context.Background(), 0); err == nil || err.Error() != "GPU 0 utilization: "+nvml.ErrorString(nvml.ERROR_GPU_IS_LOST) {
		t.Errorf("lost GPU: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	o = &NVMLObserver{Lib: mockLib(mockDevice(0, []uint32{10}, nil, nil)), Proc: fakeProcs{}, Clock: &fakeClock{t: t0}}
	if _, err := o.Observe(ctx, time.Second); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v", err)
	}
}
