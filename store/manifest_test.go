package store

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/golden"
)

var (
	goldenChunk = func() []byte {
		b := make([]byte, 100000)
		for i := range b {
			b[i] = byte(i*7 + i/256)
		}
		return b
	}()
)

// goldenManifest is a fixed manifest covering every entry type and metadata field.
func goldenManifest() *Manifest {
	h := HashChunk(goldenChunk)
	return &Manifest{
		FormatVersion: FormatVersion, Name: "trainer-1", Parent: strings.Repeat("0f", 32),
		Created: time.Date(2026, 3, 4, 5, 6, 7, 890000000, time.UTC),
		// The metadata as ptxmig before format 2.0 wrote it (the fixtures of formats 1.0 and 1.1
		// hold these bytes): opaque to the store.
		Meta: Metadata(`{"kind":"cuda","host":"gpu-host-7","kernel":"6.8.0-49-generic","driver":"580.159.04","cuda":"13.0","criu":"4.1.1",` +
			`"gpus":[{"index":1,"uuid":"GPU-3b2c1d4e-0000-1111-2222-333344445555","name":"NVIDIA H200","compute_cap":"9.0","memory_bytes":150754820096}],` +
			`"pid":4242,"cmdline":["python3","train.py","--steps","100"],"extra":{"a":"1","b":"2"}}`),
		Hash: HashAlgorithm, ChunkSize: 131072,
		Files: []File{
			{Path: "core-4242.img", Type: TypeFile, Mode: 0o600, Size: 100000 + 65536, Chunks: []Chunk{
				{Offset: 0, Size: 65536, Zero: true},
				{Offset: 65536, Size: 100000, Hash: h, Stored: 812}}},
			{Path: "empty", Type: TypeFile, Mode: 0o644},
			{Path: "ptxmig", Type: TypeDir, Mode: 0o755},
			{Path: "ptxmig/current", Type: TypeSymlink, Mode: 0o777, Target: "../core-4242.img"},
		},
	}
}

// TestGoldenFormat pins the on-disk format: the chunk hash function, the chunk file header, a
// zstd chunk file written by this version, and the manifest encoding and id. A change here is a
// format change: bump FormatVersion and update docs/FORMAT.md.
func TestGoldenFormat(t *testing.T) {
	check := func(name string, got []byte) {
		t.Helper()
		if !golden.Check(t, filepath.Join("testdata", name), got) {
			t.Errorf("%s changed: this is an on-disk format change", name)
		}
	}
	// BLAKE3-256 of known inputs (the empty input's is the published test vector).
	hashes := "empty " + HashChunk(nil).String() + "\n" + "golden-chunk " + HashChunk(goldenChunk).String() + "\n"
	if !strings.HasPrefix(hashes, "empty af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262") {
		t.Errorf("BLAKE3 of empty input: %s", hashes)
	}
	check("chunk-hashes.golden", []byte(hashes))

	// A raw chunk file is fully determined by the format.
	e, err := newEncoder(65536)
	if err != nil {
		t.Fatal(err)
	}
	random := make([]byte, 5000)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range random {
		random[i] = byte(r.Uint32())
	}
	rawFile := e.encode(random, nil)
	if rawFile[4] != codecRaw {
		t.Fatalf("incompressible data not stored raw: codec %d", rawFile[4])
	}
	check("chunk-raw.golden", rawFile[:chunkHeaderLen])

	// A zstd chunk file from this version must keep decoding to the same bytes, whatever later
	// encoders produce.
	zfile := e.encode(goldenChunk, nil)
	if golden.Update() {
		os.WriteFile(filepath.Join("testdata", "chunk-zstd.bin"), zfile, 0o644)
	}
	old, err := os.ReadFile(filepath.Join("testdata", "chunk-zstd.bin"))
	if err != nil {
		t.Fatal(err)
	}
	d, _ := newDecoder(1)
	defer d.close()
	raw, _, err := d.decode(old, HashChunk(goldenChunk), nil, nil)
	if err != nil || !bytes.Equal(raw, goldenChunk) {
		t.Fatalf("golden zstd chunk no longer decodes: %v", err)
	}
	if old[4] != codecZstd {
		t.Errorf("golden chunk codec %d", old[4])
	}
	// The bounded decoder every reader uses accepts it too.
	cd, err := newChunkDecoder(1, len(goldenChunk))
	if err != nil {
		t.Fatal(err)
	}
	defer cd.close()
	if raw, err := cd.decode(old, HashChunk(goldenChunk), len(goldenChunk), &chunkBufs{}); err != nil || !bytes.Equal(raw, goldenChunk) {
		t.Fatalf("golden zstd chunk through the bounded decoder: %v", err)
	}

	b, id, err := EncodeManifest(goldenManifest())
	if err != nil {
		t.Fatal(err)
	}
	check("manifest-v2.0.golden.json", b)
	check("manifest-v2.0.id", []byte(id+"\n"))
	m, err := DecodeManifest(b)
	if err != nil || m.ID != id || !m.Authenticated() {
		t.Fatalf("decode golden manifest: %v", err)
	}
	if !bytes.HasSuffix(b, []byte(`,"id":"`+id+"\"}\n")) {
		t.Errorf("sealed manifest does not end with its id")
	}

	// A manifest written before authentication (format 1.0, by ptxmig before this version) stays
	// readable: its id is the hash of its bytes, and it says it is not authenticated. These
	// fixtures are never regenerated.
	old, err = os.ReadFile(filepath.Join("testdata", "manifest-v1.0.json"))
	if err != nil {
		t.Fatal(err)
	}
	oldID, err := os.ReadFile(filepath.Join("testdata", "manifest-v1.0.id"))
	if err != nil {
		t.Fatal(err)
	}
	m, err = DecodeManifest(old)
	if err != nil || m.ID != strings.TrimSpace(string(oldID)) || m.Authenticated() || m.FormatVersion != "1.0" {
		t.Fatalf("format 1.0 manifest: %v", err)
	}
	want := goldenManifest()
	want.FormatVersion, want.ID = "1.0", m.ID
	if !reflect.DeepEqual(m, want) {
		t.Errorf("format 1.0 manifest decodes to\n%+v\nwant\n%+v", m, want)
	}
	// Re-encoding it seals it as the current format, under a new id.
	if b, id, err := EncodeManifest(m); err != nil || id == m.ID || !bytes.Contains(b, []byte(`"format_version":"`+FormatVersion+`"`)) {
		t.Errorf("re-encoding a 1.0 manifest: %v", err)
	}
	// A sealed manifest written before format 2.0 (1.1, by ptxmig before this version) stays
	// readable and authenticated, with its id. These fixtures are never regenerated.
	v11, err := os.ReadFile(filepath.Join("testdata", "manifest-v1.1.golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	v11ID, err := os.ReadFile(filepath.Join("testdata", "manifest-v1.1.id"))
	if err != nil {
		t.Fatal(err)
	}
	m, err = DecodeManifest(v11)
	if err != nil || m.ID != strings.TrimSpace(string(v11ID)) || !m.Authenticated() || m.FormatVersion != "1.1" {
		t.Fatalf("format 1.1 manifest: %v", err)
	}
	want = goldenManifest()
	want.FormatVersion, want.ID = "1.1", m.ID
	if !reflect.DeepEqual(m, want) {
		t.Errorf("format 1.1 manifest decodes to\n%+v\nwant\n%+v", m, want)
	}
}

func TestChunkCodecRoundTrip(t *testing.T) {
	e, _ := newEncoder(1 << 20)
	d, _ := newDecoder(1)
	defer d.close()
	floats := make([]byte, 1<<20)
	for i := 0; i < len(floats); i += 4 {
		putF32(floats[i:], float32(i%1000)*0.001+float32(i%7)*1e-5)
	}
	bf16 := make([]byte, 1<<20)
	for i := 0; i < len(bf16); i += 2 {
		bf16[i], bf16[i+1] = byte(i*31>>3), 0x3c+byte(i%3)
	}
	text := bytes.Repeat([]byte("ptxmig stores images "), 50000)
	rnd := make([]byte, 1<<20)
	for i := range rnd {
		rnd[i] = byte((i*2654435761)>>7 ^ i>>11)
	}
	tests := []struct {
		name  string
		data  []byte
		codec byte
	}{
		{"text", text, codecZstd},
		{"floats", floats, codecZstd},
		{"bf16", bf16, codecZstd},
		{"odd-length", text[:12345], codecZstd},
		{"one-byte", []byte{7}, codecRaw},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := e.encode(tt.data, nil)
			if f[4] != tt.codec {
				t.Errorf("codec %d, want %d (filter %d, %d → %d bytes)", f[4], tt.codec, f[5], len(tt.data), len(f))
			}
			raw, _, err := d.decode(f, HashChunk(tt.data), nil, nil)
			if err != nil || !bytes.Equal(raw, tt.data) {
				t.Fatalf("round trip: %v", err)
			}
			if f[4] == codecZstd && (len(f)-chunkHeaderLen)*100 > len(tt.data)*97 {
				t.Errorf("compressed chunk saves under 3%%: %d → %d", len(tt.data), len(f))
			}
		})
	}
	for _, w := range []int{2, 4} {
		for _, n := range []int{0, 1, 5, 4096, 4099} {
			src := text[:n]
			sh := shuffle(nil, src, w)
			back := make([]byte, n)
			unshuffle(back, sh, w)
			if !bytes.Equal(back, src) {
				t.Errorf("shuffle %d of %d bytes does not invert", w, n)
			}
		}
	}
}

func TestManifestValidation(t *testing.T) {
	base := goldenManifest
	h := HashChunk([]byte("x"))
	tests := []struct {
		name   string
		mutate func(m *Manifest)
		want   error
	}{
		{"ok", func(m *Manifest) {}, nil},
		{"dotdot", func(m *Manifest) { m.Files[1].Path = "../etc/passwd" }, ErrCorrupt},
		{"dotdot-inner", func(m *Manifest) { m.Files[1].Path = "ptxmig/../../x" }, ErrCorrupt},
		{"absolute", func(m *Manifest) { m.Files[0].Path = "/etc/cron.d/x" }, ErrCorrupt},
		{"dot", func(m *Manifest) { m.Files[0].Path = "." }, ErrCorrupt},
		{"unclean", func(m *Manifest) { m.Files[1].Path = "empty/" }, ErrCorrupt},
		{"through-symlink", func(m *Manifest) {
			m.Files = append(m.Files, File{Path: "ptxmig/current/x", Type: TypeFile, Mode: 0o600})
		}, ErrCorrupt},
		{"missing-parent", func(m *Manifest) {
			m.Files = append(m.Files, File{Path: "zz/x", Type: TypeFile, Mode: 0o600})
		}, ErrCorrupt},
		{"unsorted", func(m *Manifest) { m.Files[0], m.Files[1] = m.Files[1], m.Files[0] }, ErrCorrupt},
		{"duplicate", func(m *Manifest) { m.Files[1] = m.Files[0] }, ErrCorrupt},
		{"setuid", func(m *Manifest) { m.Files[1].Mode = 0o4755 }, ErrCorrupt},
		{"bad-type", func(m *Manifest) { m.Files[1].Type = "device" }, ErrCorrupt},
		{"gap", func(m *Manifest) { m.Files[0].Chunks[1].Offset++ }, ErrCorrupt},
		{"size-mismatch", func(m *Manifest) { m.Files[0].Size++ }, ErrCorrupt},
		{"chunk-too-big", func(m *Manifest) { m.Files[0].Chunks[1].Size = 1 << 20; m.Files[0].Size = 65536 + 1<<20 }, ErrCorrupt},
		{"zero-with-hash", func(m *Manifest) { m.Files[0].Chunks[0].Hash = h }, ErrCorrupt},
		{"no-hash", func(m *Manifest) { m.Files[0].Chunks[1].Hash = ChunkID{} }, ErrCorrupt},
		{"dir-with-chunks", func(m *Manifest) { m.Files[2].Chunks = m.Files[0].Chunks }, ErrCorrupt},
		{"symlink-no-target", func(m *Manifest) { m.Files[3].Target = "" }, ErrCorrupt},
		{"bad-name", func(m *Manifest) { m.Name = "../x" }, ErrCorrupt},
		{"bad-parent", func(m *Manifest) { m.Parent = "../x" }, ErrCorrupt},
		{"hash-alg", func(m *Manifest) { m.Hash = "md5" }, ErrCorrupt},
		{"chunk-size", func(m *Manifest) { m.ChunkSize = 1 << 30 }, ErrCorrupt},
		{"major-3", func(m *Manifest) { m.FormatVersion = "3.0" }, ErrUnsupportedVersion},
		{"major-0", func(m *Manifest) { m.FormatVersion = "0.9" }, ErrUnsupportedVersion},
		{"minor-2.9", func(m *Manifest) { m.FormatVersion = "2.9" }, nil},
		{"minor-9", func(m *Manifest) { m.FormatVersion = "1.9" }, nil},
		{"bad-version", func(m *Manifest) { m.FormatVersion = "x" }, ErrCorrupt},
		// What metadata members mean is internal/imagedesc's to check (a negative pid or GPU
		// index: imagedesc's TestValidation); the store bounds its strings, at any depth.
		{"visible-gpus", func(m *Manifest) { m.Meta = setMeta(m.Meta, `"visible_gpus":[{"index":0,"uuid":"GPU-a"}],`) }, nil},
		{"visible-long-name", func(m *Manifest) {
			m.Meta = setMeta(m.Meta, `"visible_gpus":[{"name":"`+strings.Repeat("x", 65<<10)+`"}],`)
		}, ErrCorrupt},
		{"long-key", func(m *Manifest) { m.Meta = setMeta(m.Meta, `"`+strings.Repeat("k", 65<<10)+`":1,`) }, ErrCorrupt},
		{"long-extra", func(m *Manifest) { m.Meta = setMeta(m.Meta, `"extra":{"a":"`+strings.Repeat("x", 65<<10)+`"},`) }, ErrCorrupt},
		{"meta-empty-object", func(m *Manifest) { m.Meta = Metadata(`{}`) }, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := base()
			tt.mutate(m)
			// Encode without validation, as a hostile writer would, and seal it: the id is right.
			b := hostileEncode(t, m)
			_, err := DecodeManifest(b)
			if tt.want == nil && err != nil || tt.want != nil && !errors.Is(err, tt.want) {
				t.Errorf("DecodeManifest: %v, want %v", err, tt.want)
			}
			if _, _, err := EncodeManifest(m); (err == nil) != (tt.want == nil) && !strings.Contains(tt.name, "version") && !strings.HasPrefix(tt.name, "major") {
				t.Errorf("EncodeManifest accepted/refused inconsistently: %v", err)
			}
		})
	}
	if _, err := DecodeManifest([]byte(`{"format_version":"1.0","id":"` + strings.Repeat("a", 64) + `"}`)); !errors.Is(err, ErrCorrupt) {
		t.Errorf("manifest with id field: %v", err)
	}
	// Metadata that is not one JSON object (a sealed manifest cannot even be sealed with it).
	for _, meta := range []string{`[1]`, `"x"`, `3`} {
		b := []byte(`{"format_version":"1.0","name":"a","created":"2026-03-04T05:06:07Z","meta":` + meta + `,"hash":"blake3-256","chunk_size":4096,"files":[]}`)
		if _, err := DecodeManifest(b); !errors.Is(err, ErrCorrupt) {
			t.Errorf("manifest with meta %s: %v", meta, err)
		}
	}
	if _, err := DecodeManifest([]byte(`{"format_version":"1.0","name":"a","created":"2026-03-04T05:06:07Z","hash":"blake3-256","chunk_size":4096,"files":[]}`)); err != nil {
		t.Errorf("manifest without meta: %v", err)
	}
}

// setMeta inserts members (each followed by a comma) at the start of a metadata object.
func setMeta(md Metadata, members string) Metadata {
	return Metadata("{" + members + string(md[1:]))
}

// TestHostileManifestNeverEscapes stores a manifest crafted to write outside the target (as an
// attacker controlling an export stream could) and checks that import refuses it.
func TestHostileManifestNeverEscapes(t *testing.T) {
	s := openTestStore(t)
	outside := t.TempDir()
	for _, p := range []string{"../escaped", "/tmp/escaped", "a/../../escaped"} {
		m := goldenManifest()
		m.Parent = ""
		m.Files = []File{{Path: p, Type: TypeFile, Mode: 0o644}}
		b := hostileEncode(t, m)
		var stream bytes.Buffer
		stream.WriteString(exportMagic)
		writeRecord(&stream, recManifest, b)
		_, err := s.Import(context.Background(), &stream)
		if !errors.Is(err, ErrCorrupt) {
			t.Errorf("import of manifest with path %q: %v", p, err)
		}
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 0 {
		t.Errorf("something escaped: %v", ents)
	}
	if ms, _ := s.List(); len(ms) != 0 {
		t.Errorf("hostile manifest stored")
	}
}

// hostileEncode encodes m without validation and seals it, as a hostile writer would.
func hostileEncode(t testing.TB, m *Manifest) []byte {
	t.Helper()
	raw, err := jsonEncodeRaw(m)
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := sealManifest(raw)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func FuzzDecodeManifest(f *testing.F) {
	b, _, _ := EncodeManifest(goldenManifest())
	f.Add(b)
	f.Add(bytes.Replace(b, []byte(`"mode":384`), []byte(`"mode":385`), 1)) // edited, not resealed
	f.Add(bytes.Replace(b, []byte(`"files":[{`), []byte(`"files":{"x":[{`), 1))
	f.Add([]byte(`{"format_version":"1.0"}`))
	f.Add([]byte(`{"format_version":"2.0","files":[]}`))
	f.Add([]byte(`{"format_version":"1.0","name":"a","hash":"blake3-256","chunk_size":4096,"files":[{"path":"a","type":"file","size":1,"chunks":[{"offset":0,"size":1,"zero":true}]}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := DecodeManifest(b)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrUnsupportedVersion) {
				t.Fatalf("error without sentinel: %v", err)
			}
			return
		}
		// Whatever decodes is valid: it re-encodes, and the re-encoding decodes to the same.
		b2, id2, err := EncodeManifest(m)
		if err != nil {
			t.Fatalf("decoded manifest does not re-encode: %v", err)
		}
		m2, err := DecodeManifest(b2)
		if err != nil || m2.ID != id2 || len(m2.Files) != len(m.Files) {
			t.Fatalf("re-encoded manifest: %v", err)
		}
		for _, f := range m.Files {
			if validPath(f.Path) != nil || strings.HasPrefix(f.Path, "..") {
				t.Fatalf("unsafe path accepted: %q", f.Path)
			}
		}
	})
}

// A manifest (an untrusted import's first record) with more objects than any real one is refused
// before it is decoded: decoding `{}` entries costs about 60 times their bytes.
func TestManifestObjectBound(t *testing.T) {
	var b strings.Builder
	b.WriteString(`{"format_version":"1.0","name":"x","files":[{"path":"f","type":"file","mode":384,"size":0,"chunks":[`)
	for i := range maxManifestObjects + 1 {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString("{}")
	}
	b.WriteString("]}]}\n")
	if b.Len() > maxManifestBytes {
		t.Fatalf("test manifest of %d bytes is over the byte limit: it would not reach the object bound", b.Len())
	}
	_, err := DecodeManifest([]byte(b.String()))
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "objects") {
		t.Fatalf("DecodeManifest: %v; want a refusal for its objects", err)
	}
}
