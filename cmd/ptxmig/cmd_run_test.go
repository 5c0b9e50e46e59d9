package main

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestPreloadEnv(t *testing.T) {
	tests := []struct {
		name string
		in   []string
		want []string
	}{
		{"none", []string{"A=1"}, []string{"A=1", "LD_PRELOAD=/s.so", "PTXMIG_SOCKET_DIR=/run/x"}},
		{"kept", []string{"LD_PRELOAD=/other.so:/x.so", "B=2"}, []string{"B=2", "LD_PRELOAD=/s.so /other.so:/x.so", "PTXMIG_SOCKET_DIR=/run/x"}},
		{"empty", []string{"LD_PRELOAD="}, []string{"LD_PRELOAD=/s.so", "PTXMIG_SOCKET_DIR=/run/x"}},
		{"socket dir replaced", []string{"PTXMIG_SOCKET_DIR=/old"}, []string{"LD_PRELOAD=/s.so", "PTXMIG_SOCKET_DIR=/run/x"}},
	}
	for _, tt := range tests {
		if got := preloadEnv(tt.in, "/s.so", "/run/x"); !reflect.DeepEqual(got, tt.want) {
			t.Errorf("%s: preloadEnv = %q, want %q", tt.name, got, tt.want)
		}
	}
}

func TestFindShim(t *testing.T) {
	dir := t.TempDir()
	bin, lib := filepath.Join(dir, "bin"), filepath.Join(dir, "lib")
	os.MkdirAll(bin, 0o755)
	os.MkdirAll(lib, 0o755)
	exe := filepath.Join(bin, "ptxmig")
	if _, err := findShim(filepath.Join(dir, "nope.so"), exe); err == nil {
		t.Fatal("missing --shim accepted")
	}
	os.WriteFile(filepath.Join(lib, "libptxmig.so"), []byte("x"), 0o644)
	got, err := findShim("", exe)
	if err != nil || got != filepath.Join(lib, "libptxmig.so") {
		t.Fatalf("../lib: %q %v", got, err)
	}
	os.WriteFile(filepath.Join(bin, "libptxmig.so"), []byte("x"), 0o644)
	if got, _ := findShim("", exe); got != filepath.Join(bin, "libptxmig.so") {
		t.Fatalf("next to the executable: %q", got)
	}
	if _, err := os.Stat("/usr/local/lib/libptxmig.so"); err != nil {
		if _, err := findShim("", filepath.Join(t.TempDir(), "ptxmig")); !errors.Is(err, errShimNotFound) {
			t.Fatalf("no shim anywhere: %v", err)
		}
	}
}

// TestRun runs real children: the environment carries the shim, the exit status and a death by
// signal come back as ptxmig's exit status.
func TestRun(t *testing.T) {
	shim := filepath.Join(t.TempDir(), "libptxmig.so")
	os.WriteFile(shim, nil, 0o644) // the loader ignores an empty preload with a warning
	sock := t.TempDir()
	tests := []struct {
		script string
		code   int
		out    string
	}{
		{`echo "$LD_PRELOAD|$PTXMIG_SOCKET_DIR"`, 0, shim + "|" + sock},
		{`exit 7`, 7, ""},
		{`kill -TERM $$`, 128 + 15, ""},
	}
	for _, tt := range tests {
		out, _, code := runCLI(t, "run", "--shim", shim, "--socket-dir", sock, "--", "/bin/sh", "-c", tt.script)
		if code != tt.code || strings.TrimSpace(out) != tt.out {
			t.Errorf("run sh -c %q: exit %d stdout %q, want %d %q", tt.script, code, out, tt.code, tt.out)
		}
	}
	if _, _, code := runCLI(t, "run", "--shim", shim); code != 2 {
		t.Errorf("run without a command: exit %d, want 2", code)
	}
	if _, _, code := runCLI(t, "run", "--shim", shim, "--", "/no/such/program"); code != 3 {
		t.Errorf("run of a missing program: exit %d, want 3", code)
	}
	if _, _, code := runCLI(t, "kernels", "--socket-dir", sock, "999999"); code != 3 {
		t.Errorf("kernels of a process without a socket: exit %d, want 3", code)
	}
	if _, _, code := runCLI(t, "modules", "abc"); code != 2 {
		t.Errorf("modules abc: exit %d, want 2", code)
	}
}
