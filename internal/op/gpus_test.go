package op_test

import (
	"errors"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/cudackpt/cudackpttest"
	"github.com/ptxmig/ptxmig/internal/op"
)

// TestDriverProcess: which processes of a tree go through the driver. libcuda loaded and a
// running CUDA state: yes. Loaded but unknown to the driver, or never initialized (a
// torch.compile worker: CUDA_ERROR_NOT_INITIALIZED): CRIU alone. A state other than running, or
// another driver error: refused before anything is touched, and so is a process the driver cannot
// checkpoint that maps the GPU's device files (CRIU cannot dump the mapping).
func TestDriverProcess(t *testing.T) {
	self := os.Getpid()
	tests := []struct {
		name    string
		libcuda bool
		known   bool
		state   cudackpt.State
		err     error
		device  string // an NVIDIA device file it maps
		want    bool
		refused bool
	}{
		{name: "no libcuda"},
		{name: "running", libcuda: true, known: true, state: cudackpt.Running, want: true},
		{name: "unknown to the driver", libcuda: true},
		{name: "never initialized", libcuda: true, known: true, err: &cudackpt.Error{Op: "cuCheckpointProcessGetState", Code: 3, Name: "CUDA_ERROR_NOT_INITIALIZED"}},
		{name: "never initialized, maps the GPU", libcuda: true, known: true, device: "/dev/nvidiactl",
			err: &cudackpt.Error{Op: "cuCheckpointProcessGetState", Code: 3, Name: "CUDA_ERROR_NOT_INITIALIZED"}, refused: true},
		{name: "unknown to the driver, maps the GPU", libcuda: true, device: "/dev/nvidia-uvm", refused: true},
		{name: "locked", libcuda: true, known: true, state: cudackpt.Locked, refused: true},
		{name: "other error", libcuda: true, known: true, err: &cudackpt.Error{Op: "cuCheckpointProcessGetState", Code: 304, Name: "CUDA_ERROR_OPERATING_SYSTEM"}, refused: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			drv := cudackpttest.New("GPU-00000000-0000-0000-0000-000000000000", nil)
			if tt.known {
				drv.Procs[self] = &cudackpttest.Proc{State: tt.state}
			}
			if tt.err != nil {
				drv.FailNext["state "+strconv.Itoa(self)] = tt.err
			}
			env := &op.Env{Driver: drv, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
				UsesCUDA:      func(int) (bool, error) { return tt.libcuda, nil },
				MapsDevice:    func(int) (string, error) { return tt.device, nil },
				DriverVersion: func() (string, error) { return "580.159.04", nil }}
			got, err := env.DriverProcess(self)
			if tt.refused {
				if !errors.Is(err, op.ErrRefused) || (tt.device != "" && !strings.Contains(err.Error(), tt.device)) {
					t.Fatalf("DriverProcess = %v, %v; want a refusal", got, err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("DriverProcess = %v, %v; want %v", got, err, tt.want)
			}
		})
	}
}
