package store

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/testreq"
)

// randomBytes returns n pseudo-random bytes, the same for the same seed.
func randomBytes(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 7))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func writeRandom(t testing.TB, p string, n int, seed uint64) []byte {
	t.Helper()
	b := randomBytes(n, seed)
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

// TestZeroChunksTouchNoDisk puts a 1 GiB hole and 3 chunks of written zeros, and materializes
// them again. Zero chunks touch no disk: the Put reads no byte of the hole (SEEK_DATA finds it)
// and writes no chunk file; the Materialize reads no chunk file and writes no byte for them, so
// both files come back as holes. Bytes moved are this process's read/write syscall counts
// (/proc/self/io rchar, wchar); the comparison streams and skips ranges that are holes in both.
func TestZeroChunksTouchNoDisk(t *testing.T) {
	const (
		hole  = 1 << 30
		zeros = 3 * DefaultChunkSize
		slack = 1 << 20 // manifests, the store's own files: far below one chunk
	)
	s := openTestStore(t)
	src := t.TempDir()
	if err := os.Truncate(writeEmpty(t, filepath.Join(src, "sparse")), hole); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "zeros"), make([]byte, zeros), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()

	before := readProcIO(t)
	m, st, err := s.Put(ctx, src, PutOptions{Name: "z"})
	if err != nil {
		t.Fatal(err)
	}
	put := readProcIO(t).sub(before)
	if st.WrittenBytes != 0 || st.ZeroBytes != hole+zeros || m.StoredBytes() != 0 {
		t.Errorf("stats %+v, stored %d: want everything zero", st, m.StoredBytes())
	}
	// The written zeros must be read to be recognized; the hole must not be.
	if put.rchar > zeros+slack {
		t.Errorf("put read %d bytes; want at most the %d bytes of written zeros (+%d): the hole was read", put.rchar, zeros, slack)
	}
	if put.wchar > slack {
		t.Errorf("put wrote %d bytes for zero chunks only", put.wchar)
	}
	if n := countFiles(t, filepath.Join(s.dir, "chunks")); n != 0 {
		t.Errorf("put left %d chunk files for zero chunks", n)
	}

	dst := filepath.Join(t.TempDir(), "out")
	before = readProcIO(t)
	if _, err := s.Materialize(ctx, "z", dst, GetOptions{}); err != nil {
		t.Fatal(err)
	}
	get := readProcIO(t).sub(before)
	if get.rchar > slack || get.wchar > slack {
		t.Errorf("materialize read %d and wrote %d bytes for zero chunks only", get.rchar, get.wchar)
	}
	for _, name := range []string{"sparse", "zeros"} {
		a, b := filepath.Join(src, name), filepath.Join(dst, name)
		fa, fb := lstat(t, a), lstat(t, b)
		if fa.Mode() != fb.Mode() || fa.Size() != fb.Size() {
			t.Errorf("%s: %v %d bytes after round trip, want %v %d", name, fb.Mode(), fb.Size(), fa.Mode(), fa.Size())
		}
		if blocks := fb.Sys().(*syscall.Stat_t).Blocks; blocks > 8 { // 4 KiB slack for the filesystem
			t.Errorf("%s: %d blocks allocated after round trip, want a hole", name, blocks)
		}
		sameContent(t, a, b)
	}
}

// procIO is a process's I/O accounting: bytes passed to read and write system calls (files,
// pipes and sockets alike, cached or not).
type procIO struct{ rchar, wchar int64 }

func (a procIO) sub(b procIO) procIO { return procIO{a.rchar - b.rchar, a.wchar - b.wchar} }

func readProcIO(t testing.TB) procIO {
	t.Helper()
	b, err := os.ReadFile("/proc/self/io")
	if err != nil {
		testreq.Skip(t, "proc", "no I/O accounting in /proc/self/io: %v", err)
	}
	var io procIO
	found := 0
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if !ok || err != nil {
			continue
		}
		switch k {
		case "rchar":
			io.rchar, found = n, found+1
		case "wchar":
			io.wchar, found = n, found+1
		}
	}
	if found != 2 {
		t.Fatalf("/proc/self/io without rchar and wchar: %q", b)
	}
	return io
}

func writeEmpty(t testing.TB, p string) string {
	t.Helper()
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func lstat(t testing.TB, p string) os.FileInfo {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi
}

// sameContent compares two files of equal size in 1 MiB blocks, holding two blocks at a time;
// ranges that are holes in both files (SEEK_DATA) are skipped unread.
func sameContent(t testing.TB, a, b string) {
	t.Helper()
	fa, err := os.Open(a)
	if err != nil {
		t.Fatal(err)
	}
	defer fa.Close()
	fb, err := os.Open(b)
	if err != nil {
		t.Fatal(err)
	}
	defer fb.Close()
	size := lstat(t, a).Size()
	if sb := lstat(t, b).Size(); sb != size {
		t.Errorf("%s: %d bytes, want %d", b, sb, size)
		return
	}
	// nextData is the offset of the first data at or after off (size when only a hole follows).
	nextData := func(f *os.File, off int64) int64 {
		n, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
		if err != nil {
			return size // ENXIO: a hole up to the end (or SEEK_DATA unsupported: compare anyway below)
		}
		return n
	}
	const block = 1 << 20
	ba, bb := make([]byte, block), make([]byte, block)
	for off := int64(0); off < size; {
		if next := min(nextData(fa, off), nextData(fb, off)); next > off {
			off = next // a hole in both files
			continue
		}
		n := int(min(block, size-off))
		if _, err := fa.ReadAt(ba[:n], off); err != nil {
			t.Fatal(err)
		}
		if _, err := fb.ReadAt(bb[:n], off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(ba[:n], bb[:n]) {
			t.Errorf("%s differs from %s in the %d bytes at offset %d", b, a, n, off)
			return
		}
		off += int64(n)
	}
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
	putRandom(t, s, 1000, 5, PutOptions{Name: "m"})
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
	src := putRandom(t, s, 10, 6, PutOptions{Name: "x"})
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
	putRandom(t, s, 10, 6, PutOptions{Name: "x"})
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

// A target that another user owns is refused (its owner could move it and point its path at
// /etc while root writes or cleans up), and so is one swapped between its check and its open.
func TestMaterializeUnsafeTarget(t *testing.T) {
	s := openTestStore(t)
	ctx := context.Background()
	putRandom(t, s, 10, 6, PutOptions{Name: "x"})
	if os.Geteuid() == 0 {
		theirs := t.TempDir()
		if err := os.Chown(theirs, 65534, 65534); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Materialize(ctx, "x", theirs, GetOptions{}); !errors.Is(err, ErrUnsafeTarget) || !strings.Contains(err.Error(), "belongs to uid 65534") {
			t.Errorf("materialize into another user's directory: %v", err)
		}
	}
	base := t.TempDir()
	dst, victim := filepath.Join(base, "dst"), filepath.Join(base, "victim")
	for _, d := range []string{dst, victim} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	testHookTargetExamined = func() {
		// The path now leads elsewhere: dst moved away, a link to victim in its place.
		if err := os.Rename(dst, dst+".moved"); err != nil {
			t.Error(err)
		}
		if err := os.Symlink(victim, dst); err != nil {
			t.Error(err)
		}
	}
	defer func() { testHookTargetExamined = nil }()
	if _, err := s.Materialize(ctx, "x", dst, GetOptions{}); !errors.Is(err, ErrUnsafeTarget) {
		t.Errorf("materialize into a swapped target: %v", err)
	}
	if ents, _ := os.ReadDir(victim); len(ents) != 0 {
		t.Errorf("the swapped-in directory got %v", ents)
	}
}

func TestOpenPermissions(t *testing.T) {
	base := t.TempDir()
	if err := os.Mkdir(filepath.Join(base, "a"), 0o755); err != nil {
		t.Fatal(err)
	}
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
	// A symlink to a loose directory is refused like the directory itself (TestOpenSymlinked
	// covers the accepted case).
	link := filepath.Join(base, "link")
	os.Symlink(loose, link)
	if _, err := Open(link); !errors.Is(err, ErrInsecure) {
		t.Errorf("open symlink to a world-writable store: %v", err)
	}
	// Every file the store writes is 0600, every directory 0700.
	putRandom(t, s, 100000, 1, PutOptions{Name: "p", ChunkSize: MinChunkSize})
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
