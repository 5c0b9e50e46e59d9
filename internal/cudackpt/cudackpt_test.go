package cudackpt

import (
	"errors"
	"testing"
)

func TestUUIDRoundTrip(t *testing.T) {
	tests := []struct {
		in, want string
		wantErr  bool
	}{
		{"GPU-5e3a1c2b-0f9d-4e2a-8b7c-1234567890ab", "GPU-5e3a1c2b-0f9d-4e2a-8b7c-1234567890ab", false},
		{"5E3A1C2B-0F9D-4E2A-8B7C-1234567890AB", "GPU-5e3a1c2b-0f9d-4e2a-8b7c-1234567890ab", false},
		{"GPU-5e3a1c2b", "", true},
		{"GPU-5e3a1c2b-0f9d-4e2a-8b7c-1234567890abcd", "", true},
		{"GPU-5e3a1c2b-0f9d-4e2a-8b7c-1234567890ax", "", true},
		{"", "", true},
	}
	for _, tt := range tests {
		u, err := ParseUUID(tt.in)
		if (err != nil) != tt.wantErr {
			t.Errorf("ParseUUID(%q) err = %v, wantErr %v", tt.in, err, tt.wantErr)
			continue
		}
		if err == nil && u.String() != tt.want {
			t.Errorf("ParseUUID(%q) = %s, want %s", tt.in, u, tt.want)
		}
	}
}

func TestErrorSentinels(t *testing.T) {
	tests := []struct {
		code int
		want error
	}{
		{cuNotReady, ErrTimeout},
		{cuNotSupported, ErrNotSupported},
		{cuNotFound, ErrNotCUDA},
		{cuNotInitialized, ErrNotInitialized},
	}
	for _, tt := range tests {
		e := &Error{Op: "op", Code: tt.code, Name: "X", Msg: "y"}
		if !errors.Is(e, tt.want) {
			t.Errorf("code %d does not match %v", tt.code, tt.want)
		}
		if errors.Is(e, ErrNoDriver) {
			t.Errorf("code %d matches ErrNoDriver", tt.code)
		}
	}
}

func TestStateString(t *testing.T) {
	for s, want := range map[State]string{Running: "running", Locked: "locked", Checkpointed: "checkpointed", Failed: "failed", 9: "state-9"} {
		if s.String() != want {
			t.Errorf("State(%d) = %q, want %q", int(s), s.String(), want)
		}
	}
}

// TestOpenWithoutDriver checks the clear failure on a host without libcuda (skips on GPU hosts).
func TestOpenWithoutDriver(t *testing.T) {
	t.Setenv("PTXMIG_LIBCUDA", "/nonexistent/libcuda.so.1")
	d, err := open()
	if err == nil {
		t.Fatalf("open with a missing library succeeded: %+v", d)
	}
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("open: %v, want ErrNoDriver", err)
	}
}
