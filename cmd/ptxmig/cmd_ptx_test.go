package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/ptxas"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

func TestPtxCommands(t *testing.T) {
	corpus := filepath.Join("..", "..", "ptxstate", "testdata", "corpus", "earlyret.ptx")
	out, stderr, code := runCLI(t, "ptx", "analyze", "--json", corpus)
	if code != 0 {
		t.Fatalf("analyze exit %d: %s", code, stderr)
	}
	var r struct {
		Kernels []struct {
			Name     string
			Eligible bool
			Refusals []string
		}
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("analyze --json: %v\n%s", err, out)
	}
	if len(r.Kernels) != 2 || !r.Kernels[0].Eligible || r.Kernels[1].Eligible || len(r.Kernels[1].Refusals) == 0 {
		t.Errorf("analyze: %+v", r.Kernels)
	}

	dst := filepath.Join(t.TempDir(), "out.ptx")
	out, stderr, code = runCLI(t, "ptx", "instrument", "--report", "-o", dst, corpus)
	if code != 0 {
		t.Fatalf("instrument exit %d: %s", code, stderr)
	}
	if !strings.Contains(out, "clamp_tail (line 16): eligible, twin clamp_tail__ptxmig") || !strings.Contains(out, "ret_then_sync (line 72): refused") {
		t.Errorf("instrument --report:\n%s", out)
	}
	data, err := os.ReadFile(dst)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(data), ".entry clamp_tail__ptxmig(") || strings.Contains(string(data), "ret_then_sync__ptxmig") {
		t.Error("instrumented module: wrong set of twins")
	}
	out, _, code = runCLI(t, "ptx", "instrument", "-o", "-", corpus)
	if code != 0 || out != string(data) {
		t.Errorf("instrument -o -: exit %d, output differs from the file", code)
	}

	bad := filepath.Join(t.TempDir(), "bad.ptx")
	if err := os.WriteFile(bad, []byte(".version 8.4\n.visible .entry k()\n{\n\tmov.u32 %r1, 1\n}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, stderr, code = runCLI(t, "ptx", "analyze", bad)
	if code != 1 || !strings.Contains(stderr, "line 4 col 2") {
		t.Errorf("malformed PTX: exit %d, stderr %q", code, stderr)
	}
	_, _, code = runCLI(t, "ptx", "instrument", corpus)
	if code != 2 {
		t.Errorf("instrument without -o: exit %d, want 2", code)
	}
	_, _, code = runCLI(t, "ptx", "analyze", filepath.Join(t.TempDir(), "missing.ptx"))
	if code != 2 {
		t.Errorf("missing file: exit %d, want 2 (a bad argument)", code)
	}
}

// TestPTXInterruptible: a cancelled context (SIGINT/SIGTERM) stops ptx analyze at once, whatever
// ptxstate is doing with the input.
func TestPTXInterruptible(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "big.ptx")
	body := ".version 8.4\n.target sm_80\n.address_size 64\n.visible .entry big(){ .reg .b32 %r<2>; " +
		strings.Repeat("add.s32 %r1, %r1, 1; ", 400000) + "ret; }\n"
	if err := os.WriteFile(big, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var out, errb bytes.Buffer
	code := run(ctx, []string{"ptxmig", "ptx", "analyze", big}, &out, &errb)
	if code != 130 || !strings.Contains(errb.String(), "canceled") {
		t.Fatalf("cancelled analyze: exit %d, stderr %q; want 130", code, errb.String())
	}
}

// TestPtxInstrumentMatchRegisters: --match-registers caps the twins with a real ptxas, and says
// why it did not where no ptxas can be used (the instrumentation goes on without the caps).
func TestPtxInstrumentMatchRegisters(t *testing.T) {
	src := filepath.Join("..", "..", "internal", "ptxas", "testdata", "saxpy.ptx")
	dst := filepath.Join(t.TempDir(), "out.ptx")
	t.Run("no ptxas", func(t *testing.T) {
		t.Setenv("PTXAS", filepath.Join(t.TempDir(), "missing-ptxas"))
		out, stderr, code := runCLI(t, "--json", "ptx", "instrument", "--match-registers", "sm_90", "-o", dst, src)
		if code != 0 {
			t.Fatalf("exit %d: %s", code, stderr)
		}
		var r struct{ Notes []string }
		if err := json.Unmarshal([]byte(out), &r); err != nil || len(r.Notes) != 1 || !strings.Contains(r.Notes[0], "registers not matched") {
			t.Errorf("notes %v (%v)\n%s", r.Notes, err, out)
		}
		data, _ := os.ReadFile(dst)
		if !strings.Contains(string(data), "__ptxmig(") || strings.Contains(string(data), ".maxnreg") {
			t.Error("without ptxas the twins must be written, uncapped")
		}
	})
	t.Run("bad arch", func(t *testing.T) {
		out, _, code := runCLI(t, "--json", "ptx", "instrument", "--match-registers", "sm_9x;rm", "-o", dst, src)
		if code != 0 || !strings.Contains(out, "not an sm_XX architecture") {
			t.Errorf("exit %d: %s", code, out)
		}
	})
	t.Run("ptxas", func(t *testing.T) {
		if _, err := ptxas.Find(); err != nil {
			testreq.Skip(t, "ptxas", "%v", err)
		}
		out, stderr, code := runCLI(t, "ptx", "instrument", "--report", "--match-registers", "sm_90", "-o", dst, src)
		if code != 0 {
			t.Fatalf("exit %d: %s", code, stderr)
		}
		data, _ := os.ReadFile(dst)
		if !strings.Contains(out, ".maxnreg") || !strings.Contains(string(data), ".maxnreg") {
			t.Errorf("no cap:\n%s", out)
		}
	})
}

// TestPtxInstrumentCubin: --cubin writes the instrumented module assembled by the real ptxas (an
// ELF file with both the original and the twin), falls back to PTX with a note where ptxas
// cannot be used, and needs --match-registers.
func TestPtxInstrumentCubin(t *testing.T) {
	src := filepath.Join("..", "..", "internal", "ptxas", "testdata", "saxpy.ptx")
	dst := filepath.Join(t.TempDir(), "out.cubin")
	t.Run("needs an arch", func(t *testing.T) {
		_, stderr, code := runCLI(t, "ptx", "instrument", "--cubin", "-o", dst, src)
		if code != 2 || !strings.Contains(stderr, "--cubin needs --match-registers") {
			t.Errorf("exit %d: %s", code, stderr)
		}
	})
	t.Run("no ptxas", func(t *testing.T) {
		t.Setenv("PTXAS", filepath.Join(t.TempDir(), "missing-ptxas"))
		out, stderr, code := runCLI(t, "--json", "ptx", "instrument", "--match-registers", "sm_90", "--cubin", "-o", dst, src)
		if code != 0 {
			t.Fatalf("exit %d: %s", code, stderr)
		}
		if !strings.Contains(out, "PTX written, not a cubin") {
			t.Errorf("no note:\n%s", out)
		}
		if data, _ := os.ReadFile(dst); !strings.Contains(string(data), "__ptxmig(") {
			t.Error("the fallback must be the instrumented PTX")
		}
	})
	t.Run("ptxas", func(t *testing.T) {
		if _, err := ptxas.Find(); err != nil {
			testreq.Skip(t, "ptxas", "%v", err)
		}
		_, stderr, code := runCLI(t, "ptx", "instrument", "--match-registers", "sm_90", "--cubin", "-o", dst, src)
		if code != 0 {
			t.Fatalf("exit %d: %s", code, stderr)
		}
		data, _ := os.ReadFile(dst)
		if !bytes.HasPrefix(data, []byte("\x7fELF")) {
			t.Fatalf("not an ELF file: %.40q", data)
		}
		for _, sec := range []string{"\x00.text.saxpy\x00", "\x00.text.saxpy__ptxmig\x00"} {
			if !bytes.Contains(data, []byte(sec)) {
				t.Errorf("no section %q in the cubin", sec)
			}
		}
	})
}

// TestPtxInstrumentCubinMidTwinsDropped: with --mid-block-twins, a module that ptxas cannot
// assemble with both kinds of twins (here a ptxas that refuses any module with a mid-block twin;
// on GPUs, a module doubled past the size ptxas is run on) is instrumented again with block twins
// only and assembled: a cubin without K_mid__ptxmig, and a note saying why.
func TestPtxInstrumentCubinMidTwinsDropped(t *testing.T) {
	real, err := ptxas.Find()
	if err != nil {
		testreq.Skip(t, "ptxas", "%v", err)
	}
	src := filepath.Join("..", "..", "ptxstate", "testdata", "nvcc12", "midblock.sm_90.ptx")
	dir := t.TempDir()
	wrap := filepath.Join(dir, "ptxas")
	script := "#!/bin/sh\nfor a; do case $a in *.ptx) if grep -q _mid__ptxmig \"$a\"; then echo 'ptxas fatal: refused on purpose' >&2; exit 1; fi;; esac; done\nexec " + real + " \"$@\"\n"
	if err := os.WriteFile(wrap, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, "out.cubin")
	for _, tc := range []struct {
		ptxas   string
		midTwin bool
		note    string
	}{
		{real, true, ""},
		{wrap, false, "no mid-block twins: PTX written, not a cubin: ptxas"},
	} {
		t.Setenv("PTXAS", tc.ptxas)
		out, stderr, code := runCLI(t, "--json", "ptx", "instrument", "--mid-block-twins", "--match-registers", "sm_90", "--cubin", "-o", dst, src)
		if code != 0 {
			t.Fatalf("ptxas %s: exit %d: %s", tc.ptxas, code, stderr)
		}
		data, _ := os.ReadFile(dst)
		if !bytes.HasPrefix(data, []byte("\x7fELF")) {
			t.Fatalf("ptxas %s: not an ELF file: %.40q", tc.ptxas, data)
		}
		if got := bytes.Contains(data, []byte("_mid__ptxmig")); got != tc.midTwin {
			t.Errorf("ptxas %s: mid-block twin in the cubin %v, want %v", tc.ptxas, got, tc.midTwin)
		}
		if !bytes.Contains(data, []byte("__ptxmig")) {
			t.Errorf("ptxas %s: no block twin in the cubin", tc.ptxas)
		}
		if tc.note != "" && (!strings.Contains(out, tc.note) || !strings.Contains(out, "; block twins only, assembled")) {
			t.Errorf("ptxas %s: no note %q:\n%s", tc.ptxas, tc.note, out)
		}
		if tc.note == "" && strings.Contains(out, "no mid-block twins") {
			t.Errorf("ptxas %s: unexpected note:\n%s", tc.ptxas, out)
		}
	}
}
