// Package gpu reads the NVIDIA GPUs of this host through NVML (go-nvml, loaded at run time).
package gpu

import (
	"errors"
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// ErrNoDriver means NVML (and so the NVIDIA driver) is not present on this host.
var ErrNoDriver = errors.New("no NVIDIA driver (libnvidia-ml.so.1 not found or driver not loaded)")

// NVMLError turns an NVML return code into an error: nil for SUCCESS (nvml.Return is itself a
// non-nil error value, so never return r directly), one wrapping ErrNoDriver for the "no
// driver" codes, else "op: NVML's message". Every NVML caller maps codes through it.
func NVMLError(op string, r nvml.Return) error {
	switch r {
	case nvml.SUCCESS:
		return nil
	case nvml.ERROR_LIBRARY_NOT_FOUND, nvml.ERROR_DRIVER_NOT_LOADED:
		return fmt.Errorf("%s: %w", op, ErrNoDriver)
	default:
		return fmt.Errorf("%s: %s", op, nvml.ErrorString(r))
	}
}

// DriverInfo is what `ptxmig version` reports about the NVIDIA stack.
type DriverInfo struct {
	Driver string `json:"driver"`
	CUDA   string `json:"cuda"`
}

// ReadDriverInfo initialises NVML, reads the driver and CUDA versions, and shuts NVML down.
func ReadDriverInfo() (DriverInfo, error) {
	lib := nvml.New()
	if r := lib.Init(); r != nvml.SUCCESS {
		return DriverInfo{}, NVMLError("nvml init", r)
	}
	defer lib.Shutdown()
	drv, r := lib.SystemGetDriverVersion()
	if err := NVMLError("driver version", r); err != nil {
		return DriverInfo{}, err
	}
	cv, r := lib.SystemGetCudaDriverVersion_v2()
	if err := NVMLError("cuda version", r); err != nil {
		return DriverInfo{}, err
	}
	return DriverInfo{Driver: drv, CUDA: FormatCUDAVersion(cv)}, nil
}

// FormatCUDAVersion renders the driver's CUDA version integer (e.g. 13000) as "13.0".
func FormatCUDAVersion(v int) string {
	return fmt.Sprintf("%d.%d", v/1000, (v%1000)/10)
}
