package placement

import (
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/gpu"
)

func TestSharedGPUWarning(t *testing.T) {
	dev := func(i int, uuid string, pids ...int) gpu.Device {
		d := gpu.Device{Index: i, UUID: uuid}
		for _, p := range pids {
			d.Processes = append(d.Processes, gpu.Process{PID: p})
		}
		return d
	}
	own := func(pid int) bool { return pid == 100 }
	tests := []struct {
		name    string
		targets []gpu.Device
		want    string // "" : no warning
	}{
		{"no targets", nil, ""},
		{"empty GPU", []gpu.Device{dev(1, "u1")}, ""},
		{"only the process itself", []gpu.Device{dev(1, "u1", 100)}, ""},
		{"another process", []gpu.Device{dev(1, "u1", 100, 4242)}, "GPU 1 also runs pid 4242: "},
		{"two GPUs, sorted pids, each GPU once", []gpu.Device{dev(0, "u0", 9, 7), dev(1, "u1", 5), dev(0, "u0", 9, 7)},
			"GPU 0 also runs pid 7, 9; GPU 1 also runs pid 5: "},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := SharedGPUWarning(tt.targets, own)
			if tt.want == "" {
				if got != "" {
					t.Fatalf("got %q, want no warning", got)
				}
				return
			}
			if !strings.HasPrefix(got, tt.want) || !strings.Contains(got, "Xid 109") {
				t.Fatalf("got %q, want it to start with %q and name Xid 109", got, tt.want)
			}
		})
	}
}

func TestUsedTargets(t *testing.T) {
	pairs := []Pair{{To: gpu.Device{Index: 1}, Used: true}, {To: gpu.Device{Index: 0}}}
	if got := UsedTargets(pairs); len(got) != 1 || got[0].Index != 1 {
		t.Fatalf("UsedTargets = %+v, want GPU 1 only", got)
	}
}
