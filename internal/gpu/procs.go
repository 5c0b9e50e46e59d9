package gpu

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimctl"
)

// ProcInfo describes a process that has the CUDA driver loaded.
type ProcInfo struct {
	PID     int      `json:"pid"`
	Comm    string   `json:"comm"`
	Cmdline []string `json:"cmdline"`
	Shim    bool     `json:"shim"`          // the shim is mapped (shimctl.IsShimLib): started under `ptxmig run`
	Minors  []int    `json:"device_minors"` // /dev/nvidiaN it has open
}

// ScanCUDAProcesses lists the processes under procRoot (normally /proc) that map libcuda.so —
// including checkpointed ones, which hold no GPU and so are invisible to NVML.
func ScanCUDAProcesses(procRoot string) ([]ProcInfo, error) {
	ents, err := os.ReadDir(procRoot)
	if err != nil {
		return nil, fmt.Errorf("scan %s: %w", procRoot, err)
	}
	self := os.Getpid()
	var out []ProcInfo
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 || pid == self {
			continue
		}
		pi, ok := inspect(procRoot, pid)
		if ok {
			out = append(out, pi)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].PID < out[j].PID })
	return out, nil
}

// Inspect reads one process; ok is false when it does not map libcuda (or is gone).
func Inspect(pid int) (ProcInfo, bool) { return inspect("/proc", pid) }

func inspect(procRoot string, pid int) (ProcInfo, bool) {
	dir := filepath.Join(procRoot, strconv.Itoa(pid))
	cuda, shim, err := scanMaps(filepath.Join(dir, "maps"))
	if err != nil || !cuda {
		return ProcInfo{}, false
	}
	pi := ProcInfo{PID: pid, Shim: shim}
	if b, err := os.ReadFile(filepath.Join(dir, "comm")); err == nil {
		pi.Comm = strings.TrimSpace(string(b))
	}
	pi.Cmdline = ReadCmdline(procRoot, pid)
	if targets, err := proc.FDTargets(procRoot, pid); err == nil {
		seen := map[int]bool{}
		for _, t := range targets {
			if n, ok := strings.CutPrefix(t, "/dev/nvidia"); ok {
				if m, err := strconv.Atoi(n); err == nil && !seen[m] {
					seen[m] = true
					pi.Minors = append(pi.Minors, m)
				}
			}
		}
		sort.Ints(pi.Minors)
	}
	return pi, true
}

// MapsCUDA reports whether /proc/PID/maps shows libcuda.so (the process uses the CUDA driver)
// and the shim library (shimctl.IsShimLib: it runs under the ptxmig shim).
func MapsCUDA(pid int) (cuda, shim bool, err error) {
	return scanMaps(fmt.Sprintf("/proc/%d/maps", pid))
}

func scanMaps(path string) (cuda, shim bool, err error) {
	f, err := os.Open(path)
	if err != nil {
		return false, false, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Bytes()
		i := bytes.LastIndexByte(line, '/')
		if i < 0 {
			continue
		}
		base := line[i+1:]
		if bytes.HasPrefix(base, []byte("libcuda.so")) {
			cuda = true
		}
		if shimctl.IsShimLib(string(base)) {
			shim = true
		}
	}
	return cuda, shim, sc.Err()
}

// MapsDevice returns the first NVIDIA device file (/dev/nvidia*) that pid maps into its memory,
// "" when none. CRIU cannot dump such a mapping itself: only a process whose CUDA state the driver
// checkpoints first gets rid of it.
func MapsDevice(pid int) (string, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return "", err
	}
	defer f.Close()
	return mappedDevice(f)
}

// mappedDevice scans a maps listing for an NVIDIA device file.
func mappedDevice(r io.Reader) (string, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		if i := bytes.Index(sc.Bytes(), []byte(" /dev/nvidia")); i >= 0 {
			return string(bytes.TrimSpace(sc.Bytes()[i:])), nil
		}
	}
	return "", sc.Err()
}

// ReadCmdline returns the command line of pid (nil when unreadable).
func ReadCmdline(procRoot string, pid int) []string { return proc.Cmdline(procRoot, pid) }
