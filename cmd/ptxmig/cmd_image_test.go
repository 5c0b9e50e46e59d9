package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestImageCommands drives add, images, inspect, verify, extract, export, import, rm and gc
// through the CLI against a real store.
func TestImageCommands(t *testing.T) {
	dir := t.TempDir()
	st, st2 := filepath.Join(dir, "store"), filepath.Join(dir, "store2")
	src := filepath.Join(dir, "src")
	os.MkdirAll(filepath.Join(src, "sub"), 0o755)
	os.WriteFile(filepath.Join(src, "sub", "pages-1.img"), []byte(strings.Repeat("page", 100000)), 0o600)
	os.Symlink("sub/pages-1.img", filepath.Join(src, "link"))

	out, errOut, code := runCLI(t, "--store", st, "--json", "image", "add", "--kind", "cpu", "--label", "job=7", "img", src)
	if code != 0 {
		t.Fatalf("add: %d %s %s", code, out, errOut)
	}
	var add struct {
		ID    string `json:"id"`
		Stats struct {
			LogicalBytes int64   `json:"logical_bytes"`
			Ratio        float64 `json:"ratio"`
		} `json:"stats"`
	}
	if err := json.Unmarshal([]byte(out), &add); err != nil || add.Stats.LogicalBytes != 400000 || add.Stats.Ratio < 10 {
		t.Fatalf("add --json: %v %s", err, out)
	}
	tests := []struct {
		args     []string
		code     int
		contains string
	}{
		{[]string{"image", "add", "img", src}, 3, "already exists"},
		{[]string{"image", "add", "../x", src}, 2, "invalid image name"},
		{[]string{"image", "add", "--chunk-size", "1", "y", src}, 2, "chunk-size"},
		{[]string{"image", "add", "y", src, "--kind", "cpu"}, 0, "added y"},
		{[]string{"image", "add", "z", src, "--bogus"}, 2, "flag provided but not defined"},
		{[]string{"images"}, 0, "img"},
		{[]string{"image", "inspect", add.ID[:8]}, 0, "link -> sub/pages-1.img"},
		{[]string{"image", "inspect", "nope"}, 6, "not found"},
		{[]string{"image", "verify"}, 0, "ok   img"},
		{[]string{"image", "extract", "img", filepath.Join(dir, "out")}, 0, "extracted img"},
		{[]string{"image", "extract", "img", filepath.Join(dir, "out")}, 3, "not empty"},
		{[]string{"image", "export", "-o", filepath.Join(dir, "img.exp"), "img"}, 0, ""},
		{[]string{"--store", st2, "image", "import", filepath.Join(dir, "img.exp")}, 0, "imported img"},
		{[]string{"--store", st2, "image", "import", filepath.Join(dir, "img.exp")}, 3, "already exists"},
		{[]string{"image", "rm", "img"}, 0, "removed img"},
		{[]string{"image", "gc"}, 0, "removed"},
		{[]string{"image", "rm"}, 2, ""},
	}
	for _, tt := range tests {
		args := tt.args
		if args[0] != "--store" {
			args = append([]string{"--store", st}, args...)
		}
		out, errOut, code := runCLI(t, args...)
		if code != tt.code || !strings.Contains(out+errOut, tt.contains) {
			t.Errorf("ptxmig %v: exit %d (want %d), output %q %q (want %q)", tt.args, code, tt.code, out, errOut, tt.contains)
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, "out", "sub", "pages-1.img"))
	if err != nil || len(b) != 400000 {
		t.Errorf("extracted file: %v", err)
	}
	// Corrupt a chunk in store2: verify exits 1 naming the file.
	chunks, _ := filepath.Glob(filepath.Join(st2, "chunks", "*", "*"))
	for _, c := range chunks {
		b, _ := os.ReadFile(c)
		b[8] ^= 1 // the length field of the chunk header
		os.WriteFile(c, b, 0o600)
	}
	out, _, code = runCLI(t, "--store", st2, "image", "verify", "img")
	if code != 1 || !strings.Contains(out, "sub/pages-1.img at offset 0") {
		t.Errorf("verify of a corrupt image: exit %d, %q", code, out)
	}
}
