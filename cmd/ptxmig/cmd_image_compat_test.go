package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/store"
)

// TestLegacyImage reads images written before typed descriptions (manifest format 1.1, the tree,
// cgroups and host files as JSON strings in meta.extra; testdata/legacy-*.ptxmigx, exported by
// that version, never regenerated): import, inspect, images, verify and export/import keep
// working; inspect prints what that version printed (testdata/legacy-image-inspect-text.golden
// was written by it), --json the same manifest plus its description; and the same image in the
// current layout inspects the same.
func TestLegacyImage(t *testing.T) {
	st := t.TempDir()
	imp := func(store, file string, args ...string) {
		t.Helper()
		if _, errOut, code := runCLI(t, append(append([]string{"--store", store, "image", "import"}, args...), filepath.Join("testdata", file))...); code != 0 {
			t.Fatalf("import %s: exit %d %s", file, code, errOut)
		}
	}
	imp(st, "legacy-image.ptxmigx")
	imp(st, "legacy-bad.ptxmigx")
	// The manifest is kept byte for byte, so its id too.
	want, err := os.ReadFile(filepath.Join("testdata", "legacy-image.manifest.json"))
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(filepath.Join(st, "images", "legacy-1.json")); !bytes.Equal(got, want) {
		t.Fatalf("imported manifest differs from the one exported")
	}

	out, errOut, code := runCLI(t, "--store", st, "image", "inspect", "legacy-1")
	if code != 0 {
		t.Fatalf("inspect: exit %d %s", code, errOut)
	}
	checkGolden(t, "legacy-image-inspect-text.golden", out)
	// An image with unreadable fields still inspects, each of them named.
	out, errOut, code = runCLI(t, "--store", st, "image", "inspect", "legacy-bad")
	if code != 0 {
		t.Fatalf("inspect: exit %d %s", code, errOut)
	}
	checkGolden(t, "legacy-bad-inspect-text.golden", out)

	// --json: the manifest as before (testdata/legacy-image-inspect-json.golden, written by the
	// version before), plus the description in the current layout.
	jout, errOut, code := runCLI(t, "--store", st, "--json", "image", "inspect", "legacy-1")
	if code != 0 {
		t.Fatalf("inspect --json: exit %d %s", code, errOut)
	}
	var got, old map[string]json.RawMessage
	if err := json.Unmarshal([]byte(jout), &got); err != nil {
		t.Fatal(err)
	}
	oldOut, err := os.ReadFile(filepath.Join("testdata", "legacy-image-inspect-json.golden"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(oldOut, &old); err != nil {
		t.Fatal(err)
	}
	desc := got["description"]
	delete(got, "description")
	if _, ok := got["description_problems"]; ok {
		t.Errorf("problems in a valid image: %s", got["description_problems"])
	}
	if !reflect.DeepEqual(normJSON(t, got), normJSON(t, old)) {
		t.Errorf("inspect --json of an older image changed:\n%s", jout)
	}
	d, err := imagedesc.Decode(store.Metadata(desc))
	if err != nil || d.Legacy || len(d.Tree) != 2 || d.Devmem[4242] != "0123456789abcdef" || !d.HostFilesRecorded {
		t.Errorf("the description --json gives: %+v (%v)", d, err)
	}
	jout, _, _ = runCLI(t, "--store", st, "--json", "image", "inspect", "legacy-bad")
	if !strings.Contains(jout, `"field": "tree"`) || !strings.Contains(jout, `"field": "host_files"`) || !strings.Contains(jout, `"field": "cgroups"`) {
		t.Errorf("inspect --json of an image with bad fields names them not:\n%s", jout)
	}

	// images --json lists it as before.
	lout, _, _ := runCLI(t, "--store", st, "--json", "images")
	var rows []map[string]json.RawMessage
	if err := json.Unmarshal([]byte(lout), &rows); err != nil || len(rows) != 2 {
		t.Fatalf("images --json: %v\n%s", err, lout)
	}
	oldList, _ := os.ReadFile(filepath.Join("testdata", "legacy-image-ls-json.golden"))
	var oldRows []map[string]json.RawMessage
	if err := json.Unmarshal(oldList, &oldRows); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(normJSON(t, rows[1]), normJSON(t, oldRows[0])) && !reflect.DeepEqual(normJSON(t, rows[0]), normJSON(t, oldRows[0])) {
		t.Errorf("images --json of an older image changed:\n%s", lout)
	}

	// verify; export and import elsewhere (same id); import --name seals a copy in the current
	// format, with the same description.
	if out, errOut, code := runCLI(t, "--store", st, "image", "verify", "legacy-1"); code != 0 {
		t.Errorf("verify: exit %d %s%s", code, out, errOut)
	}
	exp := filepath.Join(t.TempDir(), "x.exp")
	if _, errOut, code := runCLI(t, "--store", st, "image", "export", "-o", exp, "legacy-1"); code != 0 {
		t.Fatalf("export: exit %d %s", code, errOut)
	}
	st2 := t.TempDir()
	if _, errOut, code := runCLI(t, "--store", st2, "image", "import", exp); code != 0 {
		t.Fatalf("import: exit %d %s", code, errOut)
	}
	if got, _ := os.ReadFile(filepath.Join(st2, "images", "legacy-1.json")); !bytes.Equal(got, want) {
		t.Errorf("export and import changed the manifest")
	}
	if _, errOut, code := runCLI(t, "--store", st2, "image", "import", "--name", "renamed", exp); code != 0 {
		t.Fatalf("import --name: exit %d %s", code, errOut)
	}
	s2, err := store.Open(st2)
	if err != nil {
		t.Fatal(err)
	}
	m1, err1 := s2.Get("legacy-1")
	m2, err2 := s2.Get("renamed")
	if err1 != nil || err2 != nil || m2.FormatVersion != store.FormatVersion || !m2.Authenticated() {
		t.Fatalf("import --name: %v %v %+v", err1, err2, m2)
	}
	d1, err1 := imagedesc.Read(m1)
	d2, err2 := imagedesc.Read(m2)
	if err1 != nil || err2 != nil || !reflect.DeepEqual(d1, d2) {
		t.Errorf("import --name changed the description: %+v %+v (%v %v)", d1, d2, err1, err2)
	}

	// The same image in the current layout (written with the description read from the old one)
	// inspects the same, but for its name, id, date and format.
	src := t.TempDir()
	if _, errOut, code := runCLI(t, "--store", st, "image", "extract", "legacy-1", filepath.Join(src, "x")); code != 0 {
		t.Fatalf("extract: exit %d %s", code, errOut)
	}
	d1.Legacy = false
	meta, err := d1.Encode()
	if err != nil {
		t.Fatal(err)
	}
	s1, err := store.Open(st)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := s1.Put(context.Background(), filepath.Join(src, "x"), store.PutOptions{Name: "typed-1", Meta: meta, ChunkSize: 4096}); err != nil {
		t.Fatal(err)
	}
	if m, _ := s1.Get("typed-1"); !bytes.Contains(m.Meta, []byte(`"image":2`)) || bytes.Contains(m.Meta, []byte(`"host.files"`)) {
		t.Errorf("current layout: %s", m.Meta)
	}
	legacyOut, _, _ := runCLI(t, "--store", st, "image", "inspect", "legacy-1")
	typedOut, errOut, code := runCLI(t, "--store", st, "image", "inspect", "typed-1")
	if code != 0 {
		t.Fatalf("inspect: exit %d %s", code, errOut)
	}
	if a, b := skipHeader(legacyOut), skipHeader(typedOut); a != b {
		t.Errorf("inspect of the same image in the current layout differs:\n%s\nwant\n%s", b, a)
	}
	if d3, err := imagedesc.Read(mustGet(t, s1, "typed-1")); err != nil || !reflect.DeepEqual(d3, d1) {
		t.Errorf("current layout reads back as %+v (%v), want %+v", d3, err, d1)
	}
}

// skipHeader drops inspect's name, id, created, format and manifest lines.
func skipHeader(s string) string {
	lines := strings.Split(s, "\n")
	return strings.Join(lines[5:], "\n")
}

func mustGet(t *testing.T, s *store.Store, name string) *store.Manifest {
	t.Helper()
	m, err := s.Get(name)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// normJSON decodes raw members into plain values, so documents compare whatever their layout.
func normJSON(t *testing.T, v any) any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}
