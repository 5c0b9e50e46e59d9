package rebalance

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/ptxmig/ptxmig/internal/gpu"
)

// nvmlValueNotAvailable is NVML_VALUE_NOT_AVAILABLE, reported as UsedGpuMemory when unknown.
const nvmlValueNotAvailable = ^uint64(0)

// OpenNVML initialises lib (nvml.New() when nil) and returns it with its Shutdown.
func OpenNVML(lib nvml.Interface) (nvml.Interface, func(), error) {
	if lib == nil {
		lib = nvml.New()
	}
	if err := gpu.NVMLError("nvml init", lib.Init()); err != nil {
		return nil, nil, err
	}
	return lib, func() { lib.Shutdown() }, nil
}

// Clock is time for the runner and the observer; tests use a fake.
type Clock interface {
	Now() time.Time
	// Sleep waits d or until ctx ends (then it returns ctx.Err()).
	Sleep(ctx context.Context, d time.Duration) error
}

// RealClock is the wall clock.
type RealClock struct{}

func (RealClock) Now() time.Time { return time.Now() }

func (RealClock) Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Location is where a process is now.
type Location struct {
	Alive bool     `json:"alive"`
	GPUs  []string `json:"gpus"` // UUIDs where NVML lists it as a compute process
}

// Observer samples the node and finds processes.
type Observer interface {
	Observe(ctx context.Context, window time.Duration) (Observation, error)
	Locate(ctx context.Context, pid int) (Location, error)
}

// NVMLObserver observes through NVML (an initialised nvml.Interface) and /proc.
type NVMLObserver struct {
	Lib   nvml.Interface
	Proc  ProcReader
	Clock Clock
	// Interval between utilization and power reads within the window (default 250 ms).
	Interval time.Duration
}

type devInfo struct {
	dev nvml.Device
	g   GPU
}

func (o *NVMLObserver) devices() ([]devInfo, error) {
	n, r := o.Lib.DeviceGetCount()
	if err := gpu.NVMLError("device count", r); err != nil {
		return nil, err
	}
	out := make([]devInfo, 0, n)
	for i := 0; i < n; i++ {
		d, r := o.Lib.DeviceGetHandleByIndex(i)
		if err := gpu.NVMLError(fmt.Sprintf("device %d", i), r); err != nil {
			return nil, err
		}
		g := GPU{Index: i}
		if g.UUID, r = d.GetUUID(); r != nvml.SUCCESS {
			return nil, gpu.NVMLError(fmt.Sprintf("device %d uuid", i), r)
		}
		if g.Name, r = d.GetName(); r != nvml.SUCCESS {
			return nil, gpu.NVMLError(fmt.Sprintf("device %d name", i), r)
		}
		maj, mnr, r := d.GetCudaComputeCapability()
		if r != nvml.SUCCESS {
			return nil, gpu.NVMLError(fmt.Sprintf("device %d compute capability", i), r)
		}
		g.ComputeCap = fmt.Sprintf("%d.%d", maj, mnr)
		if lim, r := d.GetEnforcedPowerLimit(); r == nvml.SUCCESS {
			g.PowerLimitW = float64(lim) / 1000
		}
		out = append(out, devInfo{dev: d, g: g})
	}
	return out, nil
}

// Observe samples utilization and power every Interval for window (at least once), then reads
// memory, the compute processes and their utilization over the window, and /proc for each.
func (o *NVMLObserver) Observe(ctx context.Context, window time.Duration) (Observation, error) {
	devs, err := o.devices()
	if err != nil {
		return Observation{}, err
	}
	interval := o.Interval
	if interval <= 0 {
		interval = 250 * time.Millisecond
	}
	start := o.Clock.Now()
	utilSum := make([]float64, len(devs))
	powerSum := make([]float64, len(devs))
	powerN := make([]int, len(devs))
	for {
		for i, d := range devs {
			u, r := d.dev.GetUtilizationRates()
			if err := gpu.NVMLError(fmt.Sprintf("GPU %d utilization", i), r); err != nil {
				return Observation{}, err
			}
			utilSum[i] += float64(u.Gpu) / 100
			devs[i].g.Samples++
			if mw, r := d.dev.GetPowerUsage(); r == nvml.SUCCESS {
				powerSum[i] += float64(mw) / 1000
				powerN[i]++
			}
		}
		elapsed := o.Clock.Now().Sub(start)
		if elapsed >= window {
			break
		}
		if err := o.Clock.Sleep(ctx, min(interval, window-elapsed)); err != nil {
			return Observation{}, fmt.Errorf("sampling GPUs: %w", err)
		}
	}
	obs := Observation{Time: o.Clock.Now(), Window: window}
	byPID := map[int]*Process{}
	for i := range devs {
		g := &devs[i].g
		g.Util = clamp(utilSum[i]/float64(g.Samples), 0, 1)
		if powerN[i] > 0 {
			g.PowerW = powerSum[i] / float64(powerN[i])
		}
		mem, r := devs[i].dev.GetMemoryInfo()
		if err := gpu.NVMLError(fmt.Sprintf("GPU %d memory", i), r); err != nil {
			return Observation{}, err
		}
		g.MemTotal, g.MemUsed = mem.Total, mem.Used
		obs.GPUs = append(obs.GPUs, *g)

		procs, r := devs[i].dev.GetComputeRunningProcesses()
		if err := gpu.NVMLError(fmt.Sprintf("GPU %d processes", i), r); err != nil {
			return Observation{}, err
		}
		util, utilKnown := processUtil(devs[i].dev, uint64(start.UnixMicro()))
		for _, pi := range procs {
			pid := int(pi.Pid)
			if pid <= 0 {
				continue
			}
			p := byPID[pid]
			if p == nil {
				p = &Process{PID: pid, MemKnown: true, UtilKnown: true}
				byPID[pid] = p
			}
			p.GPUs = append(p.GPUs, g.UUID)
			if pi.UsedGpuMemory == nvmlValueNotAvailable {
				p.MemKnown = false
			} else {
				p.MemBytes += pi.UsedGpuMemory
			}
			if utilKnown {
				p.Util += util[pid]
			} else {
				p.UtilKnown = false
			}
		}
	}
	pids := make([]int, 0, len(byPID))
	for pid := range byPID {
		pids = append(pids, pid)
	}
	sort.Ints(pids)
	for _, pid := range pids {
		p := byPID[pid]
		info, err := o.Proc.Read(pid)
		if err != nil {
			p.InfoErr = err.Error()
		} else {
			p.Comm, p.Cmdline, p.StartTicks, p.StartTime = info.Comm, info.Cmdline, info.StartTicks, info.StartTime
			p.EnvPin, p.EnvKnown, p.UnderShim, p.Session = info.EnvPin, info.EnvKnown, info.UnderShim, info.SID
		}
		obs.Procs = append(obs.Procs, *p)
	}
	return obs, nil
}

// processUtil averages each process's SM utilization samples since lastSeen (µs). NVML answers
// ERROR_NOT_FOUND when no process ran a kernel in that time: every process is idle, which is
// known. Other failures (NOT_SUPPORTED on MIG, …) leave the shares unknown.
func processUtil(dev nvml.Device, lastSeen uint64) (map[int]float64, bool) {
	samples, r := dev.GetProcessUtilization(lastSeen)
	switch r {
	case nvml.SUCCESS:
	case nvml.ERROR_NOT_FOUND:
		return map[int]float64{}, true
	default:
		return nil, false
	}
	sum := map[int]float64{}
	n := map[int]int{}
	for _, s := range samples {
		if s.Pid == 0 || s.TimeStamp < lastSeen {
			continue
		}
		sum[int(s.Pid)] += float64(min(s.SmUtil, 100)) / 100
		n[int(s.Pid)]++
	}
	for pid := range sum {
		sum[pid] /= float64(n[pid])
	}
	return sum, true
}

// Locate reports whether pid is alive and on which GPUs NVML lists it.
func (o *NVMLObserver) Locate(ctx context.Context, pid int) (Location, error) {
	var loc Location
	if _, err := o.Proc.Read(pid); err == nil {
		loc.Alive = true
	} else if !errors.Is(err, ErrNoProcess) {
		return loc, err
	}
	devs, err := o.devices()
	if err != nil {
		return loc, err
	}
	for i, d := range devs {
		procs, r := d.dev.GetComputeRunningProcesses()
		if err := gpu.NVMLError(fmt.Sprintf("GPU %d processes", i), r); err != nil {
			return loc, err
		}
		for _, p := range procs {
			if int(p.Pid) == pid {
				loc.GPUs = append(loc.GPUs, d.g.UUID)
				break
			}
		}
	}
	return loc, nil
}
