package store

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// TestTamperedManifestNamesField edits every field of a sealed manifest without resealing it,
// as a careless hand or a disk would: each edit is refused, naming exactly what changed.
func TestTamperedManifestNamesField(t *testing.T) {
	good, id, err := EncodeManifest(goldenManifest())
	if err != nil {
		t.Fatal(err)
	}
	parent := `"parent":"` + strings.Repeat("0f", 32) + `",`
	chunk1 := `,{"offset":65536,"size":100000,"hash":"b69cf6296505efce986acbd8141c4f8c29e43e327d5ac87de505ac35be69a3ad","stored":812}`
	core := `files["core-4242.img"]`
	tests := []struct {
		name     string
		old, new string
		want     []string
	}{
		{"format-version", `"format_version":"2.0"`, `"format_version":"2.1"`, []string{"format_version"}},
		{"format-downgrade", `"format_version":"2.0"`, `"format_version":"1.0"`, []string{"format_version"}},
		{"format-downgrade-1.1", `"format_version":"2.0"`, `"format_version":"1.1"`, []string{"format_version"}},
		{"name", `"name":"trainer-1"`, `"name":"trainer-2"`, []string{"name"}},
		{"parent", `"parent":"0f`, `"parent":"1f`, []string{"parent"}},
		{"parent-removed", parent, ``, []string{"parent removed"}},
		{"created", `07.89Z`, `07.88Z`, []string{"created"}},
		{"meta-kind", `"kind":"cuda"`, `"kind":"cpu"`, []string{"meta.kind"}},
		{"meta-host", `gpu-host-7`, `gpu-host-8`, []string{"meta.host"}},
		{"meta-kernel", `6.8.0-49-generic`, `6.8.0-50-generic`, []string{"meta.kernel"}},
		{"meta-driver", `580.159.04`, `580.159.05`, []string{"meta.driver"}},
		{"meta-cuda", `"cuda":"13.0"`, `"cuda":"12.4"`, []string{"meta.cuda"}},
		{"meta-criu", `4.1.1`, `4.1.2`, []string{"meta.criu"}},
		{"meta-gpu-uuid", `GPU-3b2c`, `GPU-3b2d`, []string{"meta.gpus"}},
		{"meta-gpu-memory", `150754820096`, `150754820095`, []string{"meta.gpus"}},
		{"meta-visible-added", `"pid":4242`, `"visible_gpus":[{"index":0}],"pid":4242`, []string{"meta.visible_gpus added"}},
		{"meta-pid", `"pid":4242`, `"pid":4243`, []string{"meta.pid"}},
		{"meta-cmdline", `"--steps","100"`, `"--steps","1000"`, []string{"meta.cmdline"}},
		{"meta-extra-value", `"a":"1"`, `"a":"9"`, []string{`meta.extra["a"]`}},
		{"meta-extra-added", `"b":"2"`, `"b":"2","tree":"[]"`, []string{`meta.extra["tree"] added`}},
		{"meta-extra-removed", `"a":"1",`, ``, []string{`meta.extra["a"] removed`}},
		{"hash-algorithm", `"hash":"blake3-256","chunk_size"`, `"hash":"blake3-255","chunk_size"`, []string{"hash"}},
		{"chunk-size", `"chunk_size":131072`, `"chunk_size":262144`, []string{"chunk_size"}},
		{"file-mode", `"mode":384`, `"mode":448`, []string{core + ".mode"}},
		{"file-size", `"size":165536`, `"size":165537`, []string{core + ".size"}},
		{"file-type", `"path":"empty","type":"file"`, `"path":"empty","type":"dir"`, []string{`files["empty"].type`}},
		{"file-size-added", `"path":"ptxmig","type":"dir","mode":493`, `"path":"ptxmig","type":"dir","mode":493,"size":5`, []string{`files["ptxmig"].size added`}},
		{"file-unknown-field", `"path":"empty","type":"file","mode":420`, `"path":"empty","type":"file","mode":420,"xattr":"x"`, []string{`files["empty"]: a field this ptxmig does not know`}},
		{"chunk-reference", `"hash":"b69c`, `"hash":"c69c`, []string{core + ".chunks[1] (offset 65536)"}},
		{"chunk-stored", `"stored":812`, `"stored":813`, []string{core + ".chunks[1] (offset 65536)"}},
		{"chunk-zero", `"zero":true`, `"zero":false`, []string{core + ".chunks[0] (offset 0)"}},
		{"chunk-offset", `"offset":65536`, `"offset":65535`, []string{core + ".chunks[1] (offset 65535)"}},
		{"chunk-removed", chunk1, ``, []string{core + ".chunks: 1 entries, the manifest was written with 2"}},
		{"path-bytes", `"ptxmig/current"`, `"ptxmig/cUrrent"`, []string{`files[3].path (now "ptxmig/cUrrent")`}},
		{"path-escape", `"path":"empty"`, `"path":"../empty"`, []string{`files[1].path (now "../empty")`}},
		{"symlink-target", `../core-4242.img`, `/etc/shadow`, []string{`files["ptxmig/current"].target`}},
		{"file-added", `{"path":"empty"`, `{"path":"dd","type":"dir","mode":493},{"path":"empty"`,
			[]string{"files: 5 entries, the manifest was written with 4", `files["dd"] added (or its path changed)`}},
		{"file-removed", `{"path":"empty","type":"file","mode":420},`, ``,
			[]string{"files: 3 entries, the manifest was written with 4", "1 file entries removed (or their paths changed)"}},
		{"field-added", `"chunk_size":131072`, `"chunk_size":131072,"setuid":true`, []string{"setuid added"}},
		{"duplicate-field", `"mode":420}`, `"mode":420,"mode":511}`, []string{`files["empty"].mode`}}, // the last one counts
		{"auth-index", `"alg":"blake3-256","check"`, `"alg":5,"check"`, []string{"the auth member (the authentication index) is damaged; which field changed is unknown"}},
		{"auth-check", `"host":"742bbad0"`, `"host":"742bbad1"`, []string{"the auth member (the authentication index) was edited; which field changed is unknown"}},
		{"auth-entry", `"eefd`, `"eefe`, []string{"the auth member (the authentication index) was edited; which field changed is unknown"}},
		{"whitespace", `"name":"trainer-1"`, `"name": "trainer-1"`, []string{"the id, or bytes outside every field (formatting), were edited"}},
		{"invalid-json", `"mode":384`, `"mode":384,,`, []string{"the manifest is no longer valid JSON (invalid character ',' looking for beginning of object key string)"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if n := bytes.Count(good, []byte(tt.old)); n != 1 {
				t.Fatalf("%q occurs %d times in the golden manifest", tt.old, n)
			}
			b := bytes.Replace(good, []byte(tt.old), []byte(tt.new), 1)
			assertMismatch(t, b, id, tt.want)
		})
	}
	// Edits of the seal itself.
	last := len(good) - 4 // the id's last hex digit
	idEdit := bytes.Clone(good)
	idEdit[last] ^= 1
	assertMismatch(t, idEdit, string(idEdit[last-63:last+1]), []string{"the id, or bytes outside every field (formatting), were edited"})
	a, z := bytes.Index(good, []byte(`,"auth":`)), bytes.Index(good, []byte(idTail))
	noAuth := append(bytes.Clone(good[:a]), good[z:]...)
	assertMismatch(t, noAuth, id, []string{"the auth member (the authentication index) was removed"})
	// A valid but different index (an older image's) still names the fields that differ.
	other := goldenManifest()
	other.Meta = bytes.Replace(other.Meta, []byte(`"gpu-host-7"`), []byte(`"elsewhere"`), 1)
	ob, _, _ := EncodeManifest(other)
	oa, oz := bytes.Index(ob, []byte(`,"auth":`)), bytes.Index(ob, []byte(idTail))
	swapped := append(append(bytes.Clone(good[:a]), ob[oa:oz]...), good[z:]...)
	assertMismatch(t, swapped, id, []string{"meta.host"})

	// Without its id a sealed-format manifest is refused; a 1.0 one with an id too.
	if _, err := DecodeManifest(append(bytes.Clone(good[:z]), "}\n"...)); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "end with their id") {
		t.Errorf("1.1 manifest without id: %v", err)
	}
	if _, err := DecodeManifest(bytes.Replace(good, []byte(`"format_version":"2.0"`), []byte(`"format_version":"1.0"`), 1)); !errors.Is(err, ErrCorrupt) {
		t.Errorf("1.0 manifest with an id: %v", err)
	}
}

func assertMismatch(t *testing.T, b []byte, id string, want []string) {
	t.Helper()
	_, err := DecodeManifest(b)
	var mm *ManifestMismatchError
	if !errors.As(err, &mm) || !errors.Is(err, ErrCorrupt) {
		t.Fatalf("DecodeManifest of an edited manifest: %v", err)
	}
	if mm.ID != id {
		t.Errorf("mismatch names id %s, want %s", mm.ID, id)
	}
	if !reflect.DeepEqual(mm.Changes, want) {
		t.Errorf("changes %q\nwant      %q", mm.Changes, want)
	}
	if !strings.Contains(err.Error(), want[0]) {
		t.Errorf("error %q does not name %q", err, want[0])
	}
}

// putTamperTarget stores an image with two files of several chunks under name.
func putTamperTarget(t *testing.T, s *Store, name string) *Manifest {
	t.Helper()
	src := t.TempDir()
	os.Mkdir(filepath.Join(src, "sub"), 0o755)
	writeRandom(t, filepath.Join(src, "sub", "pages-1.img"), 3*testChunk, 3)
	writeRandom(t, filepath.Join(src, "core.img"), 2*testChunk+17, 4)
	m, _, err := s.Put(context.Background(), src, PutOptions{Name: name, ChunkSize: testChunk, Meta: Metadata(`{"kind":"cpu","host":"h1","pid":77}`)})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestTamperedImageRefusedEverywhere edits the manifest of a stored image in place: every read
// (Get, List, Materialize, Export) refuses it naming the field, and Verify reports one problem
// per changed field.
func TestTamperedImageRefusedEverywhere(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name  string
		edit  func(m *Manifest, b []byte) []byte
		field string
	}{
		{"mode", func(m *Manifest, b []byte) []byte {
			return bytes.Replace(b, []byte(`"path":"core.img","type":"file","mode":420`), []byte(`"path":"core.img","type":"file","mode":511`), 1)
		}, `files["core.img"].mode`},
		{"chunk-reference", func(m *Manifest, b []byte) []byte {
			// Point a chunk of one file at a chunk of another: both exist, only the id can tell.
			return bytes.Replace(b, []byte(m.Files[2].Chunks[1].Hash.String()), []byte(m.Files[0].Chunks[1].Hash.String()), 1)
		}, `files["sub/pages-1.img"].chunks[1] (offset 65536)`},
		{"path", func(m *Manifest, b []byte) []byte {
			return bytes.Replace(b, []byte(`"path":"core.img"`), []byte(`"path":"core.imh"`), 1)
		}, `files[0].path (now "core.imh")`},
		{"created", func(m *Manifest, b []byte) []byte {
			return bytes.Replace(b, []byte(`"created":"2`), []byte(`"created":"1`), 1)
		}, "created"},
		{"metadata", func(m *Manifest, b []byte) []byte {
			return bytes.Replace(b, []byte(`"pid":77`), []byte(`"pid":1`), 1)
		}, "meta.pid"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := openTestStore(t)
			m := putTamperTarget(t, s, "img")
			p := s.manifestPath("img")
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			edited := tt.edit(m, b)
			if bytes.Equal(edited, b) {
				t.Fatal("edit changed nothing")
			}
			if err := os.WriteFile(p, edited, 0o600); err != nil {
				t.Fatal(err)
			}
			names := func(what string, err error) {
				t.Helper()
				if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tt.field) {
					t.Errorf("%s of an edited image: %v, want it to name %s", what, err, tt.field)
				}
			}
			_, err = s.Get("img")
			names("Get", err)
			if _, err := s.Get(m.ID[:12]); !errors.Is(err, ErrNotFound) {
				t.Errorf("Get by id of an edited image: %v", err)
			}
			if ms, err := s.List(); err != nil || len(ms) != 0 {
				t.Errorf("List shows an edited image: %v %v", ms, err)
			}
			dst := filepath.Join(t.TempDir(), "dst")
			_, err = s.Materialize(ctx, "img", dst, GetOptions{})
			names("Materialize", err)
			if _, err := os.Lstat(dst); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("refused materialize created %s", dst)
			}
			names("Export", s.Export(ctx, "img", &bytes.Buffer{}))
			r, err := s.Verify(ctx, "img")
			names("Verify", err)
			if r == nil || len(r.Problems) != 1 || r.Problems[0].Path != "(manifest)" || r.Problems[0].Field != tt.field || !strings.Contains(r.Problems[0].Err, m.ID) {
				t.Errorf("verify report %+v, want one problem naming %s", r, tt.field)
			}
		})
	}
}

// TestResealedManifestChangesID: whoever edits a manifest and reseals it makes a different image:
// its id changes, so a reference by id or an import that expects the id refuses it.
func TestResealedManifestChangesID(t *testing.T) {
	ctx := context.Background()
	a := openTestStore(t)
	m := putTamperTarget(t, a, "img")
	var stream bytes.Buffer
	if err := a.Export(ctx, "img", &stream); err != nil {
		t.Fatal(err)
	}
	// Rewrite the stream's manifest with another mode, sealed properly.
	edited := *m
	edited.Files = append([]File(nil), m.Files...)
	edited.Files[0].Mode = 0o4777 &^ 0o4000
	raw, newID, err := EncodeManifest(&edited)
	if err != nil || newID == m.ID {
		t.Fatalf("reseal: %v", err)
	}
	forged := forgeStream(t, stream.Bytes(), raw, newID)

	b := openTestStore(t)
	if _, _, err := b.ImportWith(ctx, bytes.NewReader(forged), ImportOptions{ExpectID: m.ID[:16]}); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "not the expected "+m.ID[:16]) {
		t.Fatalf("import of a resealed image expecting the original id: %v", err)
	}
	if _, _, err := b.ImportWith(ctx, bytes.NewReader(stream.Bytes()), ImportOptions{ExpectID: m.ID[:16]}); err != nil {
		t.Fatalf("import of the original expecting its id: %v", err)
	}
	c := openTestStore(t)
	got, _, err := c.ImportWith(ctx, bytes.NewReader(forged), ImportOptions{})
	if err != nil || got.ID != newID {
		t.Fatalf("import of the resealed image: %v", err)
	}
	if _, err := c.Get(m.ID); !errors.Is(err, ErrNotFound) {
		t.Errorf("the resealed image answers to the original id: %v", err)
	}
	if _, _, err := c.ImportWith(ctx, bytes.NewReader(forged), ImportOptions{Name: "x", ExpectID: "xyz"}); err == nil || !strings.Contains(err.Error(), "hex digits") {
		t.Errorf("bad ExpectID: %v", err)
	}
}

// forgeStream replaces the manifest of an export stream (and the id in its end record).
func forgeStream(t *testing.T, stream, manifest []byte, id string) []byte {
	t.Helper()
	var out bytes.Buffer
	out.WriteString(exportMagic)
	writeRecord(&out, recManifest, manifest)
	rest := stream[len(exportMagic):]
	n := int(le64(rest[1:9]))
	rest = rest[recHeaderLen+n:]
	out.Write(rest[:len(rest)-32])
	idb, err := ParseChunkID(id)
	if err != nil {
		t.Fatal(err)
	}
	out.Write(idb[:])
	return out.Bytes()
}

func le64(b []byte) uint64 {
	var v uint64
	for i := 7; i >= 0; i-- {
		v = v<<8 | uint64(b[i])
	}
	return v
}

// TestLegacyImage: an image written before authentication (format 1.0) stays readable: it
// materializes, verifies (with a warning that its manifest cannot be checked), exports and
// imports under its id; importing it under a new name seals the copy.
func TestLegacyImage(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	m := putTamperTarget(t, s, "new")
	old := *m
	old.Name, old.FormatVersion = "old", "1.0"
	raw, err := jsonEncodeRaw(&old)
	if err != nil {
		t.Fatal(err)
	}
	raw = append(raw, '\n')
	if err := os.WriteFile(s.manifestPath("old"), raw, 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := s.Get("old")
	if err != nil || got.Authenticated() || got.ID != manifestID(raw) {
		t.Fatalf("Get of a 1.0 image: %+v %v", got, err)
	}
	if g, err := s.Get("new"); err != nil || !g.Authenticated() {
		t.Fatalf("Get of a 1.1 image: %v", err)
	}
	r, err := s.Verify(ctx, "old")
	if err != nil || !r.OK() || r.Authenticated || len(r.Warnings) != 1 || !strings.Contains(r.Warnings[0], "predates manifest authentication") {
		t.Fatalf("verify of a 1.0 image: %v %+v", err, r)
	}
	if r, err := s.Verify(ctx, "new"); err != nil || !r.Authenticated || len(r.Warnings) != 0 {
		t.Fatalf("verify of a 1.1 image: %v %+v", err, r)
	}
	dst := filepath.Join(t.TempDir(), "dst")
	if _, err := s.Materialize(ctx, "old", dst, GetOptions{}); err != nil {
		t.Fatal(err)
	}
	var stream bytes.Buffer
	if err := s.Export(ctx, "old", &stream); err != nil {
		t.Fatal(err)
	}
	b := openTestStore(t)
	imp, err := b.Import(ctx, bytes.NewReader(stream.Bytes()))
	if err != nil || imp.ID != got.ID || imp.Authenticated() {
		t.Fatalf("import of a 1.0 image: %v", err)
	}
	sealed, _, err := b.ImportWith(ctx, bytes.NewReader(stream.Bytes()), ImportOptions{Name: "sealed"})
	if err != nil || !sealed.Authenticated() || sealed.ID == got.ID {
		t.Fatalf("import of a 1.0 image under a new name: %v", err)
	}
	if g, err := b.Get("sealed"); err != nil || !g.Authenticated() || g.ID != sealed.ID {
		t.Fatalf("the sealed copy: %v", err)
	}
	if _, _, err := b.ImportWith(ctx, bytes.NewReader(stream.Bytes()), ImportOptions{Name: "x", ExpectID: got.ID}); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "not authenticated") {
		t.Errorf("expecting the id of a 1.0 image: %v", err)
	}
}
