// Package criu locates and drives CRIU (>= 4.0) for ptxmig.
package criu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"syscall"
)

// ErrNotFound means no criu binary was found.
var ErrNotFound = errors.New("criu not found (run scripts/install-criu.sh, or set PTXMIG_CRIU)")

// ErrTooOld means the criu found is older than MinVersion.
var ErrTooOld = errors.New("criu is too old")

// MinVersion is the oldest CRIU ptxmig drives (major*10000 + minor*100 + sub).
const MinVersion = 40000

// Find returns the criu binary to use: $PTXMIG_CRIU, then criu on PATH, then /usr/local/sbin/criu.
func Find() (string, error) {
	if p := os.Getenv("PTXMIG_CRIU"); p != "" {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("PTXMIG_CRIU=%s: %w", p, err)
		}
		return p, nil
	}
	if p, err := exec.LookPath("criu"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/local/sbin/criu", "/usr/sbin/criu"} {
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		}
	}
	return "", ErrNotFound
}

var versionRE = regexp.MustCompile(`(?m)^Version:\s*(\d+)\.(\d+)(?:\.(\d+))?`)

// ParseVersion parses `criu --version` output into major*10000+minor*100+sub and its text form.
func ParseVersion(out string) (int, string, error) {
	m := versionRE.FindStringSubmatch(out)
	if m == nil {
		return 0, "", fmt.Errorf("unrecognised criu --version output %q", out)
	}
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	sub := 0
	text := m[1] + "." + m[2]
	if m[3] != "" {
		sub, _ = strconv.Atoi(m[3])
		text += "." + m[3]
	}
	return major*10000 + minor*100 + sub, text, nil
}

// Version runs `bin --version` and returns the parsed version.
func Version(ctx context.Context, bin string) (int, string, error) {
	out, err := output(ctx, bin, "--version")
	if err != nil {
		return 0, "", fmt.Errorf("%s --version: %w", bin, err)
	}
	return ParseVersion(string(out))
}

// Check finds criu and verifies it is at least MinVersion. It returns the path and version text.
func Check(ctx context.Context) (string, string, error) {
	bin, err := Find()
	if err != nil {
		return "", "", err
	}
	v, text, err := Version(ctx, bin)
	if err != nil {
		return bin, "", err
	}
	if v < MinVersion {
		return bin, text, fmt.Errorf("%s is %s, need >= 4.0: %w", bin, text, ErrTooOld)
	}
	return bin, text, nil
}

// output runs a short CRIU command and returns its combined output. Like every CRIU ptxmig
// starts, it gets SIGKILL if ptxmig dies (the goroutine keeps its OS thread meanwhile: the
// signal follows the thread that forked).
func output(ctx context.Context, bin string, args ...string) ([]byte, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd.CombinedOutput()
}
