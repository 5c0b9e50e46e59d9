package gpu

import (
	"strings"
	"testing"
)

func TestMappedDevice(t *testing.T) {
	tests := []struct{ maps, want string }{
		{"7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04\n", ""},
		{"7f00-7f01 rw-s 00000000 00:05 77 /dev/nvidiactl\n7f02-7f03 rw-s 00000000 00:05 78 /dev/nvidia0\n", "/dev/nvidiactl"},
		{"7f00-7f01 rw-p 00000000 00:00 0 \n7f02-7f03 rw-s 00000000 00:05 79 /dev/nvidia-uvm (deleted)\n", "/dev/nvidia-uvm (deleted)"},
		{"7f00-7f01 rw-p 00000000 08:01 13 /home/u/dev/nvidia-notes.txt\n", ""},
	}
	for _, tt := range tests {
		got, err := mappedDevice(strings.NewReader(tt.maps))
		if err != nil || got != tt.want {
			t.Errorf("mappedDevice(%q) = %q, %v; want %q", tt.maps, got, err, tt.want)
		}
	}
}
