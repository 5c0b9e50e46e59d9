package gpu

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// Environment variables that decide which GPUs a CUDA process enumerates.
const (
	EnvVisibleDevices = "CUDA_VISIBLE_DEVICES"
	EnvDeviceOrder    = "CUDA_DEVICE_ORDER"
)

// Errors of VisibleDevices.
var (
	// ErrMIG means CUDA_VISIBLE_DEVICES names MIG instances, which ptxmig cannot pair.
	ErrMIG = errors.New("MIG is not supported: CUDA_VISIBLE_DEVICES names MIG instances")
	// ErrDeviceOrder means CUDA_VISIBLE_DEVICES uses indexes on a host with mixed GPU models
	// without CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA then numbers GPUs fastest first, an order NVML
	// does not report, so ptxmig cannot tell which GPUs the indexes name.
	ErrDeviceOrder = errors.New("cannot resolve CUDA_VISIBLE_DEVICES indexes: mixed GPU models and CUDA_DEVICE_ORDER is not PCI_BUS_ID")
)

// VisibleDevices returns the GPUs of devs that a CUDA driver instance started with the
// environment env enumerates, sorted by NVML index. The CUDA driver's rules:
//   - CUDA_VISIBLE_DEVICES unset: every GPU;
//   - otherwise a comma-separated list of CUDA ordinals or GPU UUIDs ("GPU-…", a unique prefix
//     is enough); enumeration stops at the first entry that names no GPU, an ambiguous prefix or
//     a GPU already listed, so an empty or wholly invalid value means no GPUs;
//   - "MIG-…" entries are refused with ErrMIG.
//
// CUDA ordinals equal NVML indexes when CUDA_DEVICE_ORDER=PCI_BUS_ID or all GPUs are the same
// model (CUDA's default fastest-first order ties break by PCI bus id); otherwise an index entry
// returns ErrDeviceOrder.
func VisibleDevices(env map[string]string, devs []Device) ([]Device, error) {
	val, set := env[EnvVisibleDevices]
	if !set {
		out := append([]Device(nil), devs...)
		sort.Slice(out, func(i, j int) bool { return out[i].Index < out[j].Index })
		return out, nil
	}
	pciOrder := strings.TrimSpace(env[EnvDeviceOrder]) == "PCI_BUS_ID" || sameModel(devs)
	var out []Device
	seen := map[string]bool{}
	for _, f := range strings.Split(val, ",") {
		f = strings.TrimSpace(f)
		if hasPrefixFold(f, "MIG-") {
			return nil, fmt.Errorf("%s=%q: %w", EnvVisibleDevices, val, ErrMIG)
		}
		d, ok, err := resolveEntry(f, devs, pciOrder)
		if err != nil {
			return nil, fmt.Errorf("%s=%q: entry %q: %w", EnvVisibleDevices, val, f, err)
		}
		if !ok || seen[d.UUID] {
			break // CUDA ignores this entry and every one after it
		}
		seen[d.UUID] = true
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Index < out[j].Index })
	return out, nil
}

// resolveEntry finds the GPU one CUDA_VISIBLE_DEVICES entry names; ok is false for an entry
// CUDA treats as invalid.
func resolveEntry(f string, devs []Device, pciOrder bool) (Device, bool, error) {
	if n, err := strconv.Atoi(f); err == nil {
		if n < 0 {
			return Device{}, false, nil
		}
		for _, d := range devs {
			if d.Index == n {
				if !pciOrder {
					return Device{}, false, ErrDeviceOrder
				}
				return d, true, nil
			}
		}
		return Device{}, false, nil
	}
	if !hasPrefixFold(f, "GPU-") || len(f) == len("GPU-") {
		return Device{}, false, nil
	}
	var match []Device
	for _, d := range devs {
		if hasPrefixFold(d.UUID, f) {
			match = append(match, d)
		}
	}
	if len(match) != 1 {
		return Device{}, false, nil // unknown or ambiguous prefix
	}
	return match[0], true, nil
}

func hasPrefixFold(s, prefix string) bool {
	return len(s) >= len(prefix) && strings.EqualFold(s[:len(prefix)], prefix)
}

func sameModel(devs []Device) bool {
	for _, d := range devs {
		if d.Name != devs[0].Name {
			return false
		}
	}
	return true
}

// ParseEnviron parses the NUL-separated contents of /proc/PID/environ. The first definition of
// a name wins, as getenv(3) finds it; entries without '=' are skipped.
func ParseEnviron(b []byte) map[string]string {
	env := map[string]string{}
	for _, kv := range bytes.Split(b, []byte{0}) {
		k, v, ok := bytes.Cut(kv, []byte{'='})
		if !ok || len(k) == 0 {
			continue
		}
		if _, dup := env[string(k)]; !dup {
			env[string(k)] = string(v)
		}
	}
	return env
}

// ProcessEnviron reads the environment pid started with (under procRoot, normally /proc).
// Changes the process made later with setenv(3) are not visible there.
func ProcessEnviron(procRoot string, pid int) (map[string]string, error) {
	b, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "environ"))
	if err != nil {
		return nil, fmt.Errorf("environment of pid %d: %w", pid, err)
	}
	return ParseEnviron(b), nil
}

// VisibleTo returns the GPUs the CUDA driver in pid enumerates, from its environment.
func VisibleTo(pid int, devs []Device) ([]Device, error) {
	env, err := ProcessEnviron("/proc", pid)
	if err != nil {
		return nil, err
	}
	vis, err := VisibleDevices(env, devs)
	if err != nil {
		return nil, fmt.Errorf("pid %d: %w", pid, err)
	}
	return vis, nil
}

// DriverSet returns the GPUs a checkpointed process's restore must pair: every GPU of the host,
// sorted by index, whatever the process's CUDA_VISIBLE_DEVICES. Measured on driver 580.159.04
// (2x H200, 2026-11-22): a process started with CUDA_VISIBLE_DEVICES=0 was refused
// (CUDA_ERROR_INVALID_VALUE) with the pairs {0→1} and moved to GPU 1 with {0→1, 1→0}.
func DriverSet(devs []Device) []Device {
	out := append([]Device(nil), devs...)
	sort.Slice(out, func(i, j int) bool { return out[i].Index < out[j].Index })
	return out
}
