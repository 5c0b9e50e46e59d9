package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/op"
)

func TestEsc(t *testing.T) {
	tests := []struct{ in, want, lines string }{
		{"plain name-1.img", "plain name-1.img", "plain name-1.img"},
		{"héllo wörld ✓", "héllo wörld ✓", "héllo wörld ✓"},
		{"\x1b[31mred\x1b[0m", `\x1b[31mred\x1b[0m`, `\x1b[31mred\x1b[0m`},
		{"a\nb\tc\rd", `a\nb\tc\rd`, "a\nb\tc\\rd"},
		{"bell\x07 del\x7f nul\x00", `bell\x07 del\x7f nul\x00`, `bell\x07 del\x7f nul\x00`},
		{"c1 \u009b31m", `c1 \x9b31m`, `c1 \x9b31m`},
		{"evil\u202egnp.exe", `evil\u202egnp.exe`, `evil\u202egnp.exe`},
		{"zero\u200bwidth", `zero\u200bwidth`, `zero\u200bwidth`},
		{"bad \xff utf8", `bad \xff utf8`, `bad \xff utf8`},
	}
	for _, tt := range tests {
		if got := esc(tt.in); got != tt.want {
			t.Errorf("esc(%q) = %q, want %q", tt.in, got, tt.want)
		}
		if got := escLines(tt.in); got != tt.lines {
			t.Errorf("escLines(%q) = %q, want %q", tt.in, got, tt.lines)
		}
	}
}

// hostile holds the terminal sequences a crafted image or process name could carry.
const hostile = "\x1b]0;owned\x07\x1b[2J\x1b[31m"

// TestInspectEscapes: an image whose file names, symlink targets and labels hold escape
// sequences prints them escaped (the issue: image inspect printed them raw).
func TestInspectEscapes(t *testing.T) {
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "f"+hostile), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("target"+hostile, filepath.Join(src, "link")); err != nil {
		t.Fatal(err)
	}
	st := filepath.Join(t.TempDir(), "store")
	if _, errOut, code := runCLI(t, "--store", st, "image", "add", "--label", "note="+hostile, "evil", src); code != 0 {
		t.Fatalf("image add: %s", errOut)
	}
	for _, args := range [][]string{{"image", "inspect", "evil"}, {"images"}, {"image", "verify"}} {
		out, errOut, code := runCLI(t, append([]string{"--store", st}, args...)...)
		if code != 0 {
			t.Fatalf("%v: exit %d %s", args, code, errOut)
		}
		if strings.ContainsAny(out+errOut, "\x1b\x07") {
			t.Errorf("%v printed raw control characters:\n%q", args, out)
		}
		if len(args) > 1 && args[1] == "inspect" && (!strings.Contains(out, `f\x1b]0;owned\x07`) || !strings.Contains(out, `link -> target\x1b]0;owned`) || !strings.Contains(out, `note:`)) {
			t.Errorf("inspect does not show the escaped names:\n%s", out)
		}
	}
	// JSON keeps the exact bytes, escaped by JSON itself.
	out, _, _ := runCLI(t, "--store", st, "--json", "image", "inspect", "evil")
	if strings.ContainsAny(out, "\x1b\x07") || !strings.Contains(out, `\u001b]0;owned\u0007`) {
		t.Errorf("inspect --json: %q", out)
	}
}

// TestTreeEscapes: process names (set by whoever runs the process) print escaped.
func TestTreeEscapes(t *testing.T) {
	var b bytes.Buffer
	printTree(&b, []op.TreeProc{{PID: 10, Comm: "sh"}, {PID: 11, PPID: 10, Comm: hostile, CUDA: true}})
	if strings.ContainsAny(b.String(), "\x1b\x07") || !strings.Contains(b.String(), `11 \x1b]0;owned\x07`) {
		t.Errorf("printTree: %q", b.String())
	}
}
