package store

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
)

func TestExportImportRoundTrip(t *testing.T) {
	ctx := context.Background()
	a, b := openTestStore(t), openTestStore(t)
	src := filepath.Join(t.TempDir(), "src")
	makeTree(t, src, treeSpec{seed: 11, files: 20, maxSize: 200 << 10, sparse: true, symlinks: true})
	defer chmodTree(src)
	m, _, err := a.Put(ctx, src, PutOptions{Name: "moved", ChunkSize: testChunk, Meta: Metadata(`{"kind":"cuda","host":"host1"}`)})
	if err != nil {
		t.Fatal(err)
	}
	var stream bytes.Buffer
	if err := a.Export(ctx, "moved", &stream); err != nil {
		t.Fatal(err)
	}
	exported := stream.Bytes()
	got, st, err := b.ImportWith(ctx, bytes.NewReader(exported), ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != m.ID || got.Name != "moved" || string(got.Meta) != `{"kind":"cuda","host":"host1"}` {
		t.Errorf("imported %s %s, want %s", got.ID, got.Name, m.ID)
	}
	if st.DedupChunks != 0 || st.Chunks != len(m.ChunkIDs()) {
		t.Errorf("first import stats %+v", st)
	}
	dst := filepath.Join(t.TempDir(), "dst")
	if _, err := b.Materialize(ctx, m.ID, dst, GetOptions{}); err != nil {
		t.Fatal(err)
	}
	defer chmodTree(dst)
	sameTree(t, src, dst)

	// The same image again: refused by name; under a new name all chunks are skipped.
	if _, err := b.Import(ctx, bytes.NewReader(exported)); !errors.Is(err, ErrExists) {
		t.Errorf("second import: %v", err)
	}
	got2, st2, err := b.ImportWith(ctx, bytes.NewReader(exported), ImportOptions{Name: "copy"})
	if err != nil {
		t.Fatal(err)
	}
	if st2.WrittenBytes != 0 || st2.DedupChunks != len(m.ChunkIDs()) || got2.ID == m.ID {
		t.Errorf("re-import stats %+v, id %s", st2, got2.ID)
	}
	if r, err := b.Verify(ctx, "copy"); err != nil || !r.OK() {
		t.Fatal(err)
	}
	if _, err := b.GC(ctx); err != nil {
		t.Fatal(err)
	}
	assertNoGarbage(t, b)
}

func TestImportRejectsBadStreams(t *testing.T) {
	ctx := context.Background()
	a := openTestStore(t)
	src := t.TempDir()
	writeRandom(t, filepath.Join(src, "pages-1.img"), 6*testChunk, 21)
	os.WriteFile(filepath.Join(src, "text"), bytes.Repeat([]byte("abc"), 100000), 0o644)
	if _, _, err := a.Put(ctx, src, PutOptions{Name: "x", ChunkSize: testChunk}); err != nil {
		t.Fatal(err)
	}
	var stream bytes.Buffer
	if err := a.Export(ctx, "x", &stream); err != nil {
		t.Fatal(err)
	}
	good := stream.Bytes()
	flip := func(off int) []byte { b := bytes.Clone(good); b[off] ^= 0x40; return b }
	tests := []struct {
		name string
		data []byte
		want error
	}{
		{"empty", nil, ErrBadStream},
		{"not-ptxmig", []byte("GARBAGE-STREAM-HEADER..."), ErrBadStream},
		{"future-version", append([]byte("PTXMIGX2"), good[8:]...), ErrUnsupportedVersion},
		{"truncated-middle", good[:len(good)/2], ErrBadStream},
		{"no-end", good[:len(good)-49], ErrBadStream},
		{"flipped-chunk-byte", flip(len(good) - 49 - 1000), ErrCorrupt},
		{"flipped-manifest-byte", flip(40), ErrCorrupt},
		{"flipped-end-id", flip(len(good) - 1), ErrBadStream},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := openTestStore(t)
			_, err := b.Import(ctx, bytes.NewReader(tt.data))
			if !errors.Is(err, tt.want) {
				t.Fatalf("import: %v, want %v", err, tt.want)
			}
			if ms, _ := b.List(); len(ms) != 0 {
				t.Fatalf("bad stream left an image")
			}
			if _, err := b.GC(ctx); err != nil {
				t.Fatal(err)
			}
			assertNoGarbage(t, b)
		})
	}
}

// failingWriter fails after n bytes, like a broken pipe.
type failingWriter struct{ n int }

func (w *failingWriter) Write(p []byte) (int, error) {
	if len(p) > w.n {
		return w.n, io.ErrClosedPipe
	}
	w.n -= len(p)
	return len(p), nil
}

func TestExportWriteError(t *testing.T) {
	a := openTestStore(t)
	putRandom(t, a, 40*testChunk, 1, PutOptions{Name: "x", ChunkSize: testChunk})
	if err := a.Export(context.Background(), "x", &failingWriter{n: 1 << 20}); !errors.Is(err, io.ErrClosedPipe) {
		t.Fatalf("export to a broken pipe: %v", err)
	}
}
