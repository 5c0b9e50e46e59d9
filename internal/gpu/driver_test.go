package gpu

import (
	"errors"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

func TestNVMLError(t *testing.T) {
	tests := []struct {
		r        nvml.Return
		want     string // "" for nil
		noDriver bool
	}{
		{nvml.SUCCESS, "", false},
		{nvml.ERROR_LIBRARY_NOT_FOUND, "init: " + ErrNoDriver.Error(), true},
		{nvml.ERROR_DRIVER_NOT_LOADED, "init: " + ErrNoDriver.Error(), true},
		{nvml.ERROR_GPU_IS_LOST, "init: " + nvml.ErrorString(nvml.ERROR_GPU_IS_LOST), false},
	}
	for _, tt := range tests {
		err := NVMLError("init", tt.r)
		if tt.want == "" {
			if err != nil {
				t.Errorf("NVMLError(%d) = %v, want nil", tt.r, err)
			}
			continue
		}
		if err == nil || err.Error() != tt.want || errors.Is(err, ErrNoDriver) != tt.noDriver {
			t.Errorf("NVMLError(%d) = %v, want %q (ErrNoDriver: %v)", tt.r, err, tt.want, tt.noDriver)
		}
	}
}
