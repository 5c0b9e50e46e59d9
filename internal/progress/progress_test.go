package progress

import (
	"bytes"
	"testing"
	"time"
)

func TestLine(t *testing.T) {
	tests := []struct {
		done, total int64
		elapsed     time.Duration
		want        string
	}{
		{0, 0, 0, "put ██████████ 100% 0 B/0 B 0 B/s"},
		{512 << 20, 1 << 30, 2 * time.Second, "put █████░░░░░  50% 512.0 MiB/1.0 GiB 256.0 MiB/s"},
		{1 << 30, 1 << 30, time.Second, "put ██████████ 100% 1.0 GiB/1.0 GiB 1.0 GiB/s"},
	}
	for _, tt := range tests {
		if got := Line("put", tt.done, tt.total, tt.elapsed, 10); got != tt.want {
			t.Errorf("Line(%d, %d) = %q, want %q", tt.done, tt.total, got, tt.want)
		}
	}
}

func TestSilentOffTerminal(t *testing.T) {
	var buf bytes.Buffer
	b := New(&buf, "put")
	if b != nil || b.Func() != nil {
		t.Fatal("bar on a non-terminal writer")
	}
	b.Update(1, 2) // nil-safe
	b.Done()
	if buf.Len() != 0 {
		t.Errorf("wrote %q", buf.String())
	}
}
