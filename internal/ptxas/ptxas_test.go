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

func TestParseRegisters(t *testing.T) {
	out := `ptxas info    : 0 bytes gmem
ptxas info    : Function properties for helper
    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'k1' for 'sm_90'
ptxas info    : Function properties for k1
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, 8192 bytes smem
ptxas info    : Compiling entry function '_Z2k2Pf__ptxmig' for 'sm_90'
ptxas info    : Used 40 registers, 112 bytes smem, 380 bytes cmem[0]
ptxas info    : Used 12 registers
`
	got := ParseRegisters(out)
	want := map[string]int{"k1": 32, "_Z2k2Pf__ptxmig": 40}
	if len(got) != len(want) || got["k1"] != 32 || got["_Z2k2Pf__ptxmig"] != 40 {
		t.Fatalf("ParseRegisters = %v, want %v", got, want)
	}
}

func TestSameOccupancyRegs(t *testing.T) {
	for _, tc := range []struct {
		regs int
		arch string
		want int
	}{
		{0, "sm_90", 0},
		{20, "sm_90", 32}, // 64 warps either way
		{32, "sm_90", 32},
		{33, "sm_90", 40}, // 40 registers: 51 warps, as 33 (rounded to 40)
		{40, "sm_90", 40},
		{48, "sm_90", 48},   // 42 warps
		{64, "sm_90", 64},   // 32 warps
		{100, "sm_90", 104}, // 19 warps up to 104 (2048/104 = 19)
		{255, "sm_90", 255},
		{20, "sm_89", 40}, // 48 warps at most: 40 registers still give 51
		{20, "sm_75", 64}, // 32 warps at most
	} {
		if got := SameOccupancyRegs(tc.regs, tc.arch); got != tc.want {
			t.Errorf("SameOccupancyRegs(%d, %s) = %d, want %d", tc.regs, tc.arch, got, tc.want)
		}
	}
}

func TestRegistersReal(t *testing.T) {
	bin := findOrSkip(t)
	ptx, err := os.ReadFile("testdata/saxpy.ptx")
	if err != nil {
		t.Fatal(err)
	}
	regs, err := Registers(context.Background(), bin, ptx, "sm_90")
	if err != nil {
		t.Fatal(err)
	}
	if len(regs) == 0 {
		t.Fatal("no entry function reported")
	}
	for k, n := range regs {
		if n <= 0 || n > 255 {
			t.Errorf("%s: %d registers", k, n)
		}
	}
	if _, err := Registers(context.Background(), bin, []byte("not ptx"), "sm_90"); err == nil {
		t.Fatal("Registers accepted garbage")
	}
}
