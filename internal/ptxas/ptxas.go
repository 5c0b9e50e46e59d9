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
	dir, err := os.MkdirTemp("", "ptxas-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	in, out := filepath.Join(dir, "in.ptx"), filepath.Join(dir, "out.cubin")
	if err := os.WriteFile(in, ptx, 0o600); err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, bin, "-arch="+arch, "-o", out, in)
	var diag bytes.Buffer
	cmd.Stdout, cmd.Stderr = &diag, &diag
	if err := cmd.Run(); err != nil {
		return nil, &Error{Arch: arch, Output: diag.String(), Err: err}
	}
	return os.ReadFile(out)
}
