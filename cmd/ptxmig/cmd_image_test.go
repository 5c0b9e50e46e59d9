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

// TestImageAuthentication: import pins the stream's id with --expect-id and passes --memory on;
// inspect says whether a manifest is authenticated; verify names an edited manifest field and
// warns about a format 1.0 image (its chunks are checked, its manifest cannot be).
func TestImageAuthentication(t *testing.T) {
	dir := t.TempDir()
	st, st2 := filepath.Join(dir, "store"), filepath.Join(dir, "store2")
	src := filepath.Join(dir, "src")
	os.MkdirAll(src, 0o755)
	os.WriteFile(filepath.Join(src, "pages-1.img"), []byte(strings.Repeat("page", 10000)), 0o600)
	out, errOut, code := runCLI(t, "--store", st, "--json", "image", "add", "--label", "job=7", "img", src)
	var add struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal([]byte(out), &add); code != 0 || err != nil || len(add.ID) != 64 {
		t.Fatalf("add: exit %d %v %s %s", code, err, out, errOut)
	}
	exp := filepath.Join(dir, "img.exp")
	if _, errOut, code := runCLI(t, "--store", st, "image", "export", "-o", exp, "img"); code != 0 {
		t.Fatalf("export: exit %d %s", code, errOut)
	}
	other := strings.Map(func(r rune) rune {
		if r == '0' {
			return '1'
		}
		return '0'
	}, add.ID[:8])
	for _, tt := range []struct {
		args     []string
		code     int
		contains string
	}{
		{[]string{"image", "import", "--expect-id", "xyz", exp}, 2, "--expect-id"},
		{[]string{"image", "import", "--expect-id", add.ID[:7], exp}, 2, "at least 8"},
		{[]string{"image", "import", "--expect-id", "", exp}, 2, "--expect-id"},
		{[]string{"image", "import", "--memory", "lots", exp}, 2, "size \"lots\""},
		{[]string{"image", "import", "--memory", "1KiB", exp}, 1, "memory limit too low"},
		{[]string{"image", "import", "--expect-id", other, exp}, 1, "not the expected " + other},
		{[]string{"image", "import", "--name", "copy", "--expect-id", strings.ToUpper(add.ID[:8]), exp}, 0, "imported copy"},
		{[]string{"image", "import", exp, "--expect-id", add.ID, "--memory", "64MiB"}, 0, "imported img"},
	} {
		out, errOut, code := runCLI(t, append([]string{"--store", st2}, tt.args...)...)
		if code != tt.code || !strings.Contains(out+errOut, tt.contains) {
			t.Errorf("ptxmig %q: exit %d (want %d), output %q %q (want %q)", tt.args, code, tt.code, out, errOut, tt.contains)
		}
	}

	inspect := func(ref string) (string, bool) {
		t.Helper()
		out, errOut, code := runCLI(t, "--store", st, "image", "inspect", ref)
		jout, _, jcode := runCLI(t, "--store", st, "--json", "image", "inspect", ref)
		var j struct {
			Authenticated *bool `json:"authenticated"`
		}
		if err := json.Unmarshal([]byte(jout), &j); code != 0 || jcode != 0 || err != nil || j.Authenticated == nil {
			t.Fatalf("inspect %s: exit %d/%d %v %s %s", ref, code, jcode, err, errOut, jout)
		}
		return out, *j.Authenticated
	}
	if out, auth := inspect("img"); !auth || !strings.Contains(out, "manifest:  authenticated") {
		t.Errorf("inspect of a sealed image: authenticated %v:\n%s", auth, out)
	}

	// A format 1.0 image: the manifest as ptxmig wrote it before sealing (no id in it).
	manifest := filepath.Join(st, "images", "img.json")
	raw, err := os.ReadFile(manifest)
	if err != nil {
		t.Fatal(err)
	}
	sealed := string(raw)
	old := strings.Replace(sealed, `"format_version":"1.1"`, `"format_version":"1.0"`, 1)
	old = strings.Replace(old, `,"id":"`+add.ID+`"}`, `}`, 1)
	if old == sealed || strings.Contains(old, add.ID) {
		t.Fatalf("cannot make a format 1.0 manifest from %s", sealed)
	}
	os.WriteFile(manifest, []byte(old), 0o600)
	if out, auth := inspect("img"); auth || !strings.Contains(out, "manifest:  NOT authenticated: format 1.0") {
		t.Errorf("inspect of a format 1.0 image: authenticated %v:\n%s", auth, out)
	}
	out, errOut, code = runCLI(t, "--store", st, "image", "verify", "img")
	if code != 0 || !strings.Contains(out, "ok   img") || !strings.Contains(out, "     warning: manifest format 1.0 predates manifest authentication") {
		t.Errorf("verify of a format 1.0 image: exit %d\n%s%s", code, out, errOut)
	}
	exp10 := filepath.Join(dir, "img10.exp")
	if _, errOut, code := runCLI(t, "--store", st, "image", "export", "-o", exp10, "img"); code != 0 {
		t.Fatalf("export: exit %d %s", code, errOut)
	}
	if _, errOut, code := runCLI(t, "--store", t.TempDir(), "image", "import", "--expect-id", add.ID[:8], exp10); code != 1 || !strings.Contains(errOut, "not authenticated") {
		t.Errorf("import --expect-id of a format 1.0 image: exit %d %s", code, errOut)
	}

	// A sealed manifest edited in place: verify names the field.
	edited := strings.Replace(sealed, `"job":"7"`, `"job":"8"`, 1)
	if edited == sealed {
		t.Fatalf("no label in %s", sealed)
	}
	os.WriteFile(manifest, []byte(edited), 0o600)
	out, errOut, code = runCLI(t, "--store", st, "image", "verify", "img")
	if code != 1 || !strings.Contains(out, `(manifest) field meta.extra["job"]: changed since the image was written`) {
		t.Errorf("verify of an edited manifest: exit %d\n%s%s", code, out, errOut)
	}
}
