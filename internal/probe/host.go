package probe

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/ptxmig/ptxmig/internal/gpu"
)

// Capability is a Linux capability bit (capabilities(7)).
type Capability struct {
	Name string
	Bit  uint
	// Required: CRIU cannot dump or restore without it. The others are needed for some trees
	// (other users' processes and files, network namespaces, TCP connections, resource limits).
	Required bool
}

// CRIUCapabilities are the capabilities CRIU uses to dump and restore process trees with their
// files, sockets and namespaces, running as root. CAP_CHECKPOINT_RESTORE exists from Linux 5.9.
var CRIUCapabilities = []Capability{
	{"CAP_SYS_ADMIN", 21, true}, {"CAP_SYS_PTRACE", 19, true},
	{"CAP_CHOWN", 0, false}, {"CAP_DAC_OVERRIDE", 1, false}, {"CAP_FOWNER", 3, false}, {"CAP_KILL", 5, false},
	{"CAP_SETGID", 6, false}, {"CAP_SETUID", 7, false}, {"CAP_NET_ADMIN", 12, false}, {"CAP_SYS_CHROOT", 18, false},
	{"CAP_SYS_RESOURCE", 24, false}, {"CAP_CHECKPOINT_RESTORE", 40, false},
}

// MissingCapabilities returns the capabilities of want not in this process's effective set,
// skipping the ones the kernel does not know (above /proc/sys/kernel/cap_last_cap).
func MissingCapabilities(want []Capability) ([]Capability, error) {
	eff, err := effectiveCaps("/proc/self/status")
	if err != nil {
		return nil, err
	}
	last := uint(63)
	if b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			last = uint(n)
		}
	}
	var missing []Capability
	for _, c := range want {
		if c.Bit <= last && eff&(1<<c.Bit) == 0 {
			missing = append(missing, c)
		}
	}
	return missing, nil
}

// effectiveCaps reads the CapEff mask of a /proc/PID/status file.
func effectiveCaps(path string) (uint64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "CapEff:"); ok {
			return strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("%s: no CapEff line", path)
}

// GPUState is what doctor reports per GPU beyond the inventory: persistence mode and MIG.
type GPUState struct {
	Index       int    `json:"index"`
	Name        string `json:"name"`
	UUID        string `json:"uuid"`
	ComputeCap  string `json:"compute_capability"`
	Persistence *bool  `json:"persistence_mode,omitempty"` // nil: NVML could not say
	MIG         bool   `json:"mig"`                        // MIG mode enabled (ptxmig does not support it)
}

// GPUStates reads every GPU's identity, persistence mode and MIG mode through NVML. Without a
// driver the error wraps gpu.ErrNoDriver.
func GPUStates() ([]GPUState, error) { return gpuStates(nvml.New()) }

func gpuStates(lib nvml.Interface) ([]GPUState, error) {
	if r := lib.Init(); r != nvml.SUCCESS {
		return nil, gpu.NVMLError("nvml init", r)
	}
	defer lib.Shutdown()
	n, r := lib.DeviceGetCount()
	if err := gpu.NVMLError("device count", r); err != nil {
		return nil, err
	}
	var out []GPUState
	for i := 0; i < n; i++ {
		h, r := lib.DeviceGetHandleByIndex(i)
		if err := gpu.NVMLError(fmt.Sprintf("GPU %d handle", i), r); err != nil {
			return nil, err
		}
		st := GPUState{Index: i}
		st.Name, _ = h.GetName()
		st.UUID, _ = h.GetUUID()
		if maj, mnr, r := h.GetCudaComputeCapability(); r == nvml.SUCCESS {
			st.ComputeCap = fmt.Sprintf("%d.%d", maj, mnr)
		}
		if m, r := h.GetPersistenceMode(); r == nvml.SUCCESS {
			on := m == nvml.FEATURE_ENABLED
			st.Persistence = &on
		}
		if cur, _, r := h.GetMigMode(); r == nvml.SUCCESS {
			st.MIG = cur == nvml.DEVICE_MIG_ENABLE
		}
		out = append(out, st)
	}
	return out, nil
}
