package store

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func writeRandom(t testing.TB, p string, n int, seed uint64) []byte {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, 7))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return b
}

// assertNoGarbage fails unless every chunk file is referenced by an image and tmp/ is empty.
func assertNoGarbage(t testing.TB, s *Store) {
	t.Helper()
	ms, bad, err := s.listAll()
	if err != nil || len(bad) > 0 {
		t.Fatalf("list: %v %v", err, bad)
	}
	live := map[ChunkID]bool{}
	for _, m := range ms {
		for _, id := range m.ChunkIDs() {
			live[id] = true
		}
	}
	n := 0
	filepath.WalkDir(filepath.Join(s.dir, "chunks"), func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		id, err := ParseChunkID(d.Name())
		if err != nil || !live[id] {
			t.Errorf("garbage in store: %s", p)
		}
		n++
		return nil
	})
	if n != len(live) {
		t.Errorf("%d chunk files, %d referenced chunks", n, len(live))
	}
	if ents, _ := os.ReadDir(s.tmpDir()); len(ents) > 0 {
		t.Errorf("%d temp files left", len(ents))
	}
}

func TestDedupAcrossImages(t *testing.T) {
	s := openTestStore(t)
	ctx := context.Background()
	a, b := t.TempDir(), t.TempDir()
	const n = 40 * testChunk
	data := writeRandom(t, filepath.Join(a, "pages-1.img"), n, 1)
	// b shares all but three chunks of a, under another file name, plus a small new file.
	data = bytes.Clone(data)
	for _, k := range []int{3, 17, 30} {
		data[k*testChunk+5] ^= 0xff
	}
	if err := os.WriteFile(filepath.Join(b, "pages-2.img"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	writeRandom(t, filepath.Join(b, "core.img"), 1000, 2)
	_, st1, err := s.Put(ctx, a, PutOptions{Name: "a", ChunkSize: testChunk})
	if err != nil {
		t.Fatal(err)
	}
	if st1.DedupChunks != 0 || st1.WrittenBytes < n {
		t.Errorf("first put: %+v", st1)
	}
	_, st2, err := s.Put(ctx, b, PutOptions{Name: "b", ChunkSize: testChunk, Parent: "a"})
	if err != nil {
		t.Fatal(err)
	}
	if st2.DedupChunks != 37 || st2.DedupBytes != 37*testChunk {
		t.Errorf("second put dedup %d chunks / %d bytes, want 37 / %d", st2.DedupChunks, st2.DedupBytes, 37*testChunk)
	}
	if st2.WrittenBytes > 4*testChunk+2000 {
		t.Errorf("second put wrote %d bytes, want about 3 chunks + 1000", st2.WrittenBytes)
	}
	// Removing a keeps b's chunks; gc removes only a's 3 unshared chunks.
	if err := s.Remove("a"); err != nil {
		t.Fatal(err)
	}
	gs, err := s.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if gs.ChunksRemoved != 3 || gs.ChunksKept != 41 {
		t.Errorf("gc %+v, want 3 removed, 41 kept", gs)
	}
	if r, err := s.Verify(ctx, "b"); err != nil || !r.OK() {
		t.Fatalf("verify b after gc: %v", err)
	}
	assertNoGarbage(t, s)
}

func TestZeroChunksTouchNoDisk(t *testing.T) {
	s := openTestStore(t)
	src := t.TempDir()
	f, err := os.Create(filepath.Join(src, "sparse"))
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(1 << 30) // a 1 GiB hole: must be skipped without reading 1 GiB
	f.Close()
	if err := os.WriteFile(filepath.Join(src, "zeros"), make([]byte, 3*DefaultChunkSize), 0o644); err != nil {
		t.Fatal(err)
	}
	m, st, err := s.Put(context.Background(), src, PutOptions{Name: "z"})
	if err != nil {
		t.Fatal(err)
	}
	if st.WrittenBytes != 0 || st.ZeroBytes != 1<<30+3*DefaultChunkSize || m.StoredBytes() != 0 {
		t.Errorf("stats %+v, stored %d: want everything zero", st, m.StoredBytes())
	}
	dst := filepath.Join(t.TempDir(), "out")
	if _, err := s.Materialize(context.Background(), "z", dst, GetOptions{}); err != nil {
		t.Fatal(err)
	}
	sameTree(t, src, dst)
}

func TestCorruptionDetected(t *testing.T) {
	tests := []struct {
		name   string
		damage func(t *testing.T, p string)
	}{
		{"flip-payload-byte", func(t *testing.T, p string) {
			b, _ := os.ReadFile(p)
			b[len(b)/2] ^= 0x01
			os.WriteFile(p, b, 0o600)
		}},
		{"flip-header-byte", func(t *testing.T, p string) {
			b, _ := os.ReadFile(p)
			b[8] ^= 0x01
			os.WriteFile(p, b, 0o600)
		}},
		{"truncate", func(t *testing.T, p string) {
			os.Truncate(p, 100)
		}},
		{"delete", func(t *testing.T, p string) { os.Remove(p) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := openTestStore(t)
			ctx := context.Background()
			src := t.TempDir()
			os.Mkdir(filepath.Join(src, "sub"), 0o755)
			writeRandom(t, filepath.Join(src, "sub", "pages-1.img"), 5*testChunk, 3)
			writeRandom(t, filepath.Join(src, "other.img"), 1000, 4)
			m, _, err := s.Put(ctx, src, PutOptions{Name: "c", ChunkSize: testChunk})
			if err != nil {
				t.Fatal(err)
			}
			if m.Files[1].Path != "sub" || m.Files[2].Path != "sub/pages-1.img" {
				t.Fatalf("unexpected file order %v", m.Files)
			}
			bad := m.Files[2].Chunks[2] // sub/pages-1.img at 2*testChunk
			tt.damage(t, s.chunkPath(bad.Hash))

			r, err := s.Verify(ctx, "c")
			if !errors.Is(err, ErrCorrupt) || r == nil || len(r.Problems) != 1 {
				t.Fatalf("verify: err %v, report %+v", err, r)
			}
			p := r.Problems[0]
			if p.Path != "sub/pages-1.img" || p.Offset != 2*testChunk || p.Chunk != bad.Hash.String() {
				t.Errorf("problem %+v, want sub/pages-1.img at %d", p, 2*testChunk)
			}
			if !strings.Contains(err.Error(), "sub/pages-1.img at offset 131072") {
				t.Errorf("verify error does not name file and offset: %v", err)
			}
			dst := filepath.Join(t.TempDir(), "dst")
			_, err = s.Materialize(ctx, "c", dst, GetOptions{})
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "sub/pages-1.img at offset 131072") {
				t.Fatalf("materialize of corrupt image: %v", err)
			}
			if _, err := os.Lstat(dst); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("failed materialize left %s behind", dst)
			}
			// Export refuses too; the exporter never ships a bad chunk.
			if err := s.Export(ctx, "c", &bytes.Buffer{}); !errors.Is(err, ErrCorrupt) {
				t.Errorf("export of corrupt image: %v", err)
			}
		})
	}
}

func TestCorruptManifest(t *testing.T) {
	s := openTestStore(t)
	ctx := context.Background()
	src := t.TempDir()
	writeRandom(t, filepath.Join(src, "f"), 1000, 5)
	if _, _, err := s.Put(ctx, src, PutOptions{Name: "m"}); err != nil {
		t.Fatal(err)
	}
	p := s.manifestPath("m")
	b, _ := os.ReadFile(p)
	os.WriteFile(p, bytes.Replace(b, []byte(`"size":1000`), []byte(`"size":1001`), 1), 0o600)
	if _, err := s.Get("m"); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Get of edited manifest: %v", err)
	}
	if r, err := s.Verify(ctx, "m"); !errors.Is(err, ErrCorrupt) || r == nil || r.Problems[0].Path != "(manifest)" {
		t.Fatalf("verify of edited manifest: %v %+v", err, r)
	}
	if _, err := s.GC(ctx); err == nil || !strings.Contains(err.Error(), "unreadable") {
		t.Fatalf("gc with a corrupt manifest must refuse, got %v", err)
	}
	if err := s.Remove("m"); err != nil {
		t.Fatalf("remove corrupt image: %v", err)
	}
	if _, err := s.GC(ctx); err != nil {
		t.Fatal(err)
	}
	assertNoGarbage(t, s)
}

func TestPutErrors(t *testing.T) {
	s := openTestStore(t)
	ctx := context.Background()
	src := t.TempDir()
	writeRandom(t, filepath.Join(src, "f"), 10, 6)
	if _, _, err := s.Put(ctx, src, PutOptions{Name: "x"}); err != nil {
		t.Fatal(err)
	}
	fifo := t.TempDir()
	if err := mkfifo(filepath.Join(fifo, "pipe")); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		src  string
		o    PutOptions
		want error
	}{
		{"exists", src, PutOptions{Name: "x"}, ErrExists},
		{"empty-name", src, PutOptions{Name: ""}, ErrInvalidName},
		{"slash", src, PutOptions{Name: "a/b"}, ErrInvalidName},
		{"dotdot", src, PutOptions{Name: ".."}, ErrInvalidName},
		{"dot-prefix", src, PutOptions{Name: ".hidden"}, ErrInvalidName},
		{"id-like", src, PutOptions{Name: strings.Repeat("ab", 32)}, ErrInvalidName},
		{"no-parent", src, PutOptions{Name: "y", Parent: "nope"}, ErrNotFound},
		{"fifo", fifo, PutOptions{Name: "y"}, ErrUnsupportedFile},
		{"missing-src", filepath.Join(src, "nope"), PutOptions{Name: "y"}, fs.ErrNotExist},
		{"tiny-chunks", src, PutOptions{Name: "y", ChunkSize: 100}, nil},
		{"tiny-memory", src, PutOptions{Name: "y", MemoryLimit: 1000}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := s.Put(ctx, tt.src, tt.o)
			if err == nil || (tt.want != nil && !errors.Is(err, tt.want)) {
				t.Fatalf("Put: %v, want %v", err, tt.want)
			}
		})
	}
	if ms, _ := s.List(); len(ms) != 1 {
		t.Errorf("failed puts left images: %d", len(ms))
	}
	if _, err := s.GC(ctx); err != nil {
		t.Fatal(err)
	}
	assertNoGarbage(t, s)
}

// A failed materialize into an existing directory cleans up without following the image's
// symlinks: a link to a host file must not get that file chmodded or removed.
func TestFailedMaterializeLeavesSymlinkTargetsAlone(t *testing.T) {
	s := openTestStore(t)
	ctx := context.Background()
	host := filepath.Join(t.TempDir(), "host-file")
	if err := os.WriteFile(host, []byte("host"), 0o644); err != nil {
		t.Fatal(err)
	}
	src := t.TempDir()
	if err := os.Symlink(host, filepath.Join(src, "a-link")); err != nil {
		t.Fatal(err)
	}
	writeRandom(t, filepath.Join(src, "b-data"), 2*testChunk, 8)
	m, _, err := s.Put(ctx, src, PutOptions{Name: "x", ChunkSize: testChunk})
	if err != nil {
		t.Fatal(err)
	}
	if m.Files[0].Type != TypeSymlink || m.Files[1].Path != "b-data" {
		t.Fatalf("unexpected files %+v", m.Files)
	}
	if err := os.Remove(s.chunkPath(m.Files[1].Chunks[1].Hash)); err != nil {
		t.Fatal(err)
	}
	dst := t.TempDir()
	if _, err := s.Materialize(ctx, "x", dst, GetOptions{}); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("materialize with a missing chunk: %v", err)
	}
	if ents, _ := os.ReadDir(dst); len(ents) != 0 {
		t.Errorf("failed materialize left %v in %s", ents, dst)
	}
	fi, err := os.Stat(host)
	if err != nil {
		t.Fatalf("symlink target after cleanup: %v", err)
	}
	if fi.Mode().Perm() != 0o644 {
		t.Fatalf("symlink target mode %v after cleanup, want untouched 0644", fi.Mode().Perm())
	}
}

func TestMaterializeTargetChecks(t *testing.T) {
	s := openTestStore(t)
	ctx := context.Background()
	src := t.TempDir()
	writeRandom(t, filepath.Join(src, "f"), 10, 6)
	if _, _, err := s.Put(ctx, src, PutOptions{Name: "x"}); err != nil {
		t.Fatal(err)
	}
	full := t.TempDir()
	os.WriteFile(filepath.Join(full, "keep"), []byte("mine"), 0o644)
	if _, err := s.Materialize(ctx, "x", full, GetOptions{}); !errors.Is(err, ErrNotEmpty) {
		t.Errorf("materialize into non-empty dir: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(full, "keep")); string(b) != "mine" {
		t.Errorf("existing file touched")
	}
	file := filepath.Join(t.TempDir(), "file")
	os.WriteFile(file, nil, 0o644)
	if _, err := s.Materialize(ctx, "x", file, GetOptions{}); !errors.Is(err, ErrNotEmpty) {
		t.Errorf("materialize onto a file: %v", err)
	}
	if _, err := s.Materialize(ctx, "nope", t.TempDir(), GetOptions{}); !errors.Is(err, ErrNotFound) {
		t.Errorf("materialize unknown image: %v", err)
	}
	empty := t.TempDir()
	if _, err := s.Materialize(ctx, "x", empty, GetOptions{}); err != nil {
		t.Errorf("materialize into an empty dir: %v", err)
	}
}

func TestOpenPermissions(t *testing.T) {
	base := t.TempDir()
	s, err := Open(filepath.Join(base, "a", "store"))
	if err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(s.Dir())
	if fi.Mode().Perm() != 0o700 {
		t.Errorf("new store mode %v", fi.Mode())
	}
	loose := filepath.Join(base, "loose")
	os.Mkdir(loose, 0o777)
	os.Chmod(loose, 0o777)
	if _, err := Open(loose); !errors.Is(err, ErrInsecure) {
		t.Errorf("open world-writable store: %v", err)
	}
	readable := filepath.Join(base, "readable")
	os.Mkdir(readable, 0o755)
	if _, err := Open(readable); err != nil {
		t.Errorf("open 0755 store: %v", err)
	}
	if fi, _ := os.Stat(readable); fi.Mode().Perm() != 0o700 {
		t.Errorf("0755 store not tightened: %v", fi.Mode())
	}
	link := filepath.Join(base, "link")
	os.Symlink(readable, link)
	if _, err := Open(link); !errors.Is(err, ErrInsecure) {
		t.Errorf("open symlinked store: %v", err)
	}
	// Every file the store writes is 0600, every directory 0700.
	src := t.TempDir()
	writeRandom(t, filepath.Join(src, "f"), 100000, 1)
	if _, _, err := s.Put(context.Background(), src, PutOptions{Name: "p", ChunkSize: MinChunkSize}); err != nil {
		t.Fatal(err)
	}
	filepath.WalkDir(s.Dir(), func(p string, d fs.DirEntry, err error) error {
		fi, _ := d.Info()
		want := fs.FileMode(0o600)
		if d.IsDir() {
			want = 0o700
		}
		if fi.Mode().Perm() != want {
			t.Errorf("%s: mode %v, want %v", p, fi.Mode().Perm(), want)
		}
		return nil
	})
	// A future store version is refused.
	os.WriteFile(filepath.Join(s.Dir(), storeMarker), []byte(`{"format":"ptxmig-store","version":2}`), 0o600)
	if _, err := Open(s.Dir()); !errors.Is(err, ErrUnsupportedVersion) {
		t.Errorf("open future store: %v", err)
	}
}
