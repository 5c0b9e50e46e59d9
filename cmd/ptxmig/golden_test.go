package main

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/golden"
	"github.com/ptxmig/ptxmig/internal/gpu"
)

// runCLI runs the CLI in-process and returns stdout, stderr and the exit status.
func runCLI(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(context.Background(), append([]string{"ptxmig"}, args...), &out, &errb)
	return out.String(), errb.String(), code
}

// checkGolden compares got with the golden file testdata/NAME (internal/golden; -update rewrites).
func checkGolden(t *testing.T, name, got string) {
	t.Helper()
	golden.Check(t, filepath.Join("testdata", name), []byte(got))
}

// TestGoldenHelp pins the help text of the app and of every command and subcommand (hidden ones
// too), and checks that `ptxmig help PATH...` shows the same text as `ptxmig PATH... --help`.
func TestGoldenHelp(t *testing.T) {
	out, _, code := runCLI(t, "--help")
	if code != 0 {
		t.Fatalf("--help exit %d", code)
	}
	checkGolden(t, "help.golden", out)
	forEachCommand(func(path []string, c *cli.Command) {
		out, _, code := runCLI(t, append(path, "--help")...)
		if code != 0 {
			t.Fatalf("%v --help exit %d", path, code)
		}
		checkGolden(t, "help-"+strings.Join(path, "-")+".golden", out)
		if viaHelp, _, code := runCLI(t, append([]string{"help"}, path...)...); code != 0 || viaHelp != out {
			t.Errorf("ptxmig help %s: exit %d, differs from --help:\n%s", strings.Join(path, " "), code, viaHelp)
		}
	})
}

// forEachCommand calls fn for every registered command and subcommand, parents first.
func forEachCommand(fn func(path []string, c *cli.Command)) {
	var walk func(prefix []string, cmds []*cli.Command)
	walk = func(prefix []string, cmds []*cli.Command) {
		for _, c := range cmds {
			p := append(append([]string(nil), prefix...), c.Name)
			fn(p, c)
			walk(p, c.Subcommands)
		}
	}
	walk(nil, commands)
}

func TestGoldenVersion(t *testing.T) {
	defer func(d func() (gpu.DriverInfo, error), c func(context.Context) (string, string, error)) {
		probeDriver, probeCRIU = d, c
	}(probeDriver, probeCRIU)
	version = "v0.0.0-test"
	tests := []struct {
		name   string
		driver func() (gpu.DriverInfo, error)
		criu   func(context.Context) (string, string, error)
	}{
		{"present",
			func() (gpu.DriverInfo, error) { return gpu.DriverInfo{Driver: "580.159.04", CUDA: "13.0"}, nil },
			func(context.Context) (string, string, error) { return "/usr/local/sbin/criu", "4.1.1", nil }},
		{"absent",
			func() (gpu.DriverInfo, error) { return gpu.DriverInfo{}, gpu.ErrNoDriver },
			func(context.Context) (string, string, error) { return "", "", errors.New("criu not found") }},
	}
	for _, tt := range tests {
		probeDriver, probeCRIU = tt.driver, tt.criu
		for _, mode := range []string{"text", "json"} {
			args := []string{"version"}
			if mode == "json" {
				args = []string{"--json", "version"}
			}
			out, _, code := runCLI(t, args...)
			if code != 0 {
				t.Fatalf("%s %s: exit %d", tt.name, mode, code)
			}
			out = strings.ReplaceAll(out, goVersion(), "GOVERSION")
			checkGolden(t, "version-"+tt.name+"-"+mode+".golden", out)
		}
	}
}

func TestExitCodes(t *testing.T) {
	tests := []struct {
		args []string
		want int
	}{
		{[]string{"no-such-command"}, 2},
		{[]string{"--no-such-flag"}, 2},
		{[]string{"--log-level", "loud", "version"}, 2},
		{[]string{"version", "extra"}, 2},
	}
	for _, tt := range tests {
		_, stderr, code := runCLI(t, tt.args...)
		if code != tt.want {
			t.Errorf("ptxmig %v: exit %d, want %d (stderr %q)", tt.args, code, tt.want, stderr)
		}
	}
	out, _, code := runCLI(t, "--json", "version", "extra")
	if code != 2 || !strings.Contains(out, `"kind": "usage"`) {
		t.Errorf("--json usage error: exit %d, stdout %q", code, out)
	}
}
