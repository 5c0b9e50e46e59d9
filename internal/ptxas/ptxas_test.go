package ptxas

import (
	"bytes"
	"context"
	"errors"
	"os"
	"testing"

	"github.com/ptxmig/ptxmig/internal/testreq"
)

// findOrSkip returns ptxas, skipping with a reason when it is absent (make test installs it).
func findOrSkip(t *testing.T) string {
	t.Helper()
	bin, err := Find()
	if err != nil {
		testreq.Skip(t, "ptxas", "%v", err)
	}
	return bin
}

func TestAssembleReal(t *testing.T) {
	bin := findOrSkip(t)
	ptx, err := os.ReadFile("testdata/saxpy.ptx")
	if err != nil {
		t.Fatal(err)
	}
	for _, arch := range []string{"sm_80", "sm_90"} {
		cubin, err := Assemble(context.Background(), bin, ptx, arch)
		if err != nil {
			t.Fatalf("%s: %v", arch, err)
		}
		if !bytes.HasPrefix(cubin, []byte("\x7fELF")) {
			t.Fatalf("%s: output is not an ELF cubin (%d bytes)", arch, len(cubin))
		}
	}
}

func TestAssembleRejectsBadPTX(t *testing.T) {
	bin := findOrSkip(t)
	bad := []byte(".version 7.0\n.target sm_80\n.address_size 64\n.visible .entry k() { frobnicate.u32 %r1; }\n")
	_, err := Assemble(context.Background(), bin, bad, "sm_80")
	var pe *Error
	if !errors.As(err, &pe) || pe.Output == "" {
		t.Fatalf("want *Error with ptxas diagnostics, got %v", err)
	}
}

func TestVersionAndMaxISA(t *testing.T) {
	bin := findOrSkip(t)
	maj, min, err := Version(context.Background(), bin)
	if err != nil {
		t.Fatal(err)
	}
	if isa := MaxISA(maj, min); isa < 70 {
		t.Fatalf("ptxas %d.%d: MaxISA %d, want >= 70", maj, min, isa)
	}
	tests := []struct{ maj, min, want int }{{12, 4, 84}, {13, 0, 90}, {11, 8, 0}}
	for _, tt := range tests {
		if got := MaxISA(tt.maj, tt.min); got != tt.want {
			t.Errorf("MaxISA(%d,%d) = %d, want %d", tt.maj, tt.min, got, tt.want)
		}
	}
}
