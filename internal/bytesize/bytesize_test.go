package bytesize

import (
	"math"
	"testing"
)

func TestFormat(t *testing.T) {
	tests := []struct {
		n    int64
		want string
	}{
		{0, "0 B"},
		{512, "512 B"},
		{1023, "1023 B"},
		{1024, "1.0 KiB"},
		{1536, "1.5 KiB"},
		{1<<20 - 1, "1024.0 KiB"}, // rounds up in the smaller unit
		{512 << 20, "512.0 MiB"},
		{3 << 29, "1.5 GiB"},
		{141 << 30, "141.0 GiB"},
		{3 << 40, "3.0 TiB"},
		{5 << 50, "5.0 PiB"},
		{math.MaxInt64, "8.0 EiB"},
		{-1, "-1 B"},
		{-5000, "-5000 B"},
	}
	for _, tt := range tests {
		if got := Format(tt.n); got != tt.want {
			t.Errorf("Format(%d) = %q, want %q", tt.n, got, tt.want)
		}
		if tt.n >= 0 {
			if got := FormatU(uint64(tt.n)); got != tt.want {
				t.Errorf("FormatU(%d) = %q, want %q", tt.n, got, tt.want)
			}
		}
	}
	if got := FormatU(math.MaxUint64); got != "16.0 EiB" {
		t.Errorf("FormatU(MaxUint64) = %q", got)
	}
}
