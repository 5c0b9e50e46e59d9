// Package ptxas finds and runs NVIDIA's PTX assembler, the ground truth for "is this PTX valid".
package ptxas

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
)

// ErrNotFound means no ptxas was found (scripts/install-ptxas.sh installs one).
var ErrNotFound = errors.New("ptxas not found (run scripts/install-ptxas.sh, or set PTXAS)")

// Find returns the ptxas to use: $PTXAS, ptxas on PATH, $CUDA_HOME/bin, /usr/local/cuda/bin.
func Find() (string, error) {
	if p := os.Getenv("PTXAS"); p != "" {
		return p, nil
	}
	if p, err := exec.LookPath("ptxas"); err == nil {
		return p, nil
	}
	for _, dir := range []string{os.Getenv("CUDA_HOME"), "/usr/local/cuda"} {
		if dir == "" {
			continue
		}
		p := filepath.Join(dir, "bin", "ptxas")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", ErrNotFound
}

var versionRE = regexp.MustCompile(`release (\d+)\.(\d+)`)

// Version returns the CUDA release of a ptxas binary, e.g. 12, 4.
func Version(ctx context.Context, bin string) (major, minor int, err error) {
	out, err := exec.CommandContext(ctx, bin, "--version").CombinedOutput()
	if err != nil {
		return 0, 0, fmt.Errorf("%s --version: %w", bin, err)
	}
	m := versionRE.FindSubmatch(out)
	if m == nil {
		return 0, 0, fmt.Errorf("%s --version: unrecognised output %q", bin, out)
	}
	major, _ = strconv.Atoi(string(m[1]))
	minor, _ = strconv.Atoi(string(m[2]))
	return major, minor, nil
}

// MaxISA returns the newest PTX ISA version (as major*10+minor) a ptxas release accepts.
// CUDA 12.4 → 8.4, 12.8 → 8.7, 13.0 → 9.0 (from the PTX ISA release notes).
func MaxISA(cudaMajor, cudaMinor int) int {
	switch {
	case cudaMajor >= 13:
		return 90
	case cudaMajor == 12:
		return map[int]int{0: 80, 1: 81, 2: 82, 3: 83, 4: 84, 5: 85, 6: 85, 8: 87, 9: 88}[cudaMinor]
	default:
		return 0
	}
}

// Error is a failed assembly with ptxas's own diagnostics.
type Error struct {
	Arch   string
	Output string
	Err    error
}

func (e *Error) Error() string { return fmt.Sprintf("ptxas -arch=%s: %v\n%s", e.Arch, e.Err, e.Output) }
func (e *Error) Unwrap() error { return e.Err }

// Assemble assembles ptx for arch (e.g. "sm_90") and returns the cubin bytes.
func Assemble(ctx context.Context, bin string, ptx []byte, arch string) ([]byte, error) {
	cubin, _, err := run(ctx, bin, ptx, arch)
	return cubin, err
}

// Registers assembles ptx for arch with ptxas -v and returns the registers each entry function
// uses, by name: what the twin of a kernel may use without fitting fewer CTAs per SM than it.
func Registers(ctx context.Context, bin string, ptx []byte, arch string) (map[string]int, error) {
	_, diag, err := run(ctx, bin, ptx, arch, "-v")
	if err != nil {
		return nil, err
	}
	return ParseRegisters(diag), nil
}

// run assembles ptx for arch in a temporary directory and returns the cubin and ptxas's output.
func run(ctx context.Context, bin string, ptx []byte, arch string, flags ...string) ([]byte, string, error) {
	dir, err := os.MkdirTemp("", "ptxas-")
	if err != nil {
		return nil, "", err
	}
	defer os.RemoveAll(dir)
	in, out := filepath.Join(dir, "in.ptx"), filepath.Join(dir, "out.cubin")
	if err := os.WriteFile(in, ptx, 0o600); err != nil {
		return nil, "", err
	}
	cmd := exec.CommandContext(ctx, bin, append(append([]string{"-arch=" + arch}, flags...), "-o", out, in)...)
	var diag bytes.Buffer
	cmd.Stdout, cmd.Stderr = &diag, &diag
	if err := cmd.Run(); err != nil {
		return nil, "", &Error{Arch: arch, Output: diag.String(), Err: err}
	}
	cubin, err := os.ReadFile(out)
	return cubin, diag.String(), err
}

var (
	entryRE = regexp.MustCompile(`Compiling entry function '([^']+)'`)
	usedRE  = regexp.MustCompile(`Used (\d+) registers`)
)

// ParseRegisters reads ptxas -v's report: each "Compiling entry function 'K'" line is followed by
// a "Used N registers" line for K (device functions, reported as "Function properties for", are
// not entries and are skipped).
func ParseRegisters(out string) map[string]int {
	regs := map[string]int{}
	cur := ""
	for _, l := range strings.Split(out, "\n") {
		if m := entryRE.FindStringSubmatch(l); m != nil {
			cur = m[1]
			continue
		}
		if m := usedRE.FindStringSubmatch(l); m != nil && cur != "" {
			if n, err := strconv.Atoi(m[1]); err == nil {
				regs[cur] = n
			}
			cur = ""
		}
	}
	return regs
}

// SameOccupancyRegs returns the most registers per thread a kernel may use while fitting as many
// warps per SM as one that uses regs, on arch: registers are allocated per warp in units of 8 per
// thread from 64 Ki per SM, and an SM holds at most 64 warps (48 on sm_86, sm_87, sm_89 and sm_12x,
// 32 on sm_75). So a twin capped at this keeps its original's occupancy for every block size, and
// is not made to spill below what occupancy needs (a 20-register kernel's twin may use 32).
func SameOccupancyRegs(regs int, arch string) int {
	if regs <= 0 {
		return 0
	}
	maxWarps := 64
	switch {
	case arch == "sm_75":
		maxWarps = 32
	case strings.HasPrefix(arch, "sm_86"), strings.HasPrefix(arch, "sm_87"), strings.HasPrefix(arch, "sm_89"), strings.HasPrefix(arch, "sm_12"):
		maxWarps = 48
	}
	const regsPerSM, unit, maxRegs = 65536, 8, 255
	warpsOf := func(r int) int { return min(maxWarps, regsPerSM/(32*((r+unit-1)/unit*unit))) }
	want := warpsOf(regs)
	best := regs
	for r := (regs + unit - 1) / unit * unit; r <= maxRegs; r += unit {
		if warpsOf(r) < want {
			break
		}
		best = r
	}
	return min(best, maxRegs)
}
