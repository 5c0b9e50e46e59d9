package store

import (
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
)

func TestKernelAtLeast(t *testing.T) {
	for _, tc := range []struct {
		release string
		want    bool
	}{
		{"6.18.44-fc-v769", true},
		{"5.8.0", true},
		{"5.8", true},
		{"5.10.0-28-amd64", true},
		{"5.7.19", false},
		{"4.18.0-513.el8.x86_64", false},
		{"5.15+", true},
		{"5.4rc1", false},
		{"", false},
		{"linux", false},
		{"x.9", false},
	} {
		if got := kernelAtLeast(tc.release, 5, 8); got != tc.want {
			t.Errorf("kernelAtLeast(%q, 5, 8) = %v, want %v", tc.release, got, tc.want)
		}
	}
}

// TestStageCrashWindows reproduces the store as a writer killed at each point of the chunk
// commit leaves it (temp files written; synced; some or all renamed; manifest not written) and
// checks that no chunk is visible before it is synced, that a new Put of the same data
// deduplicates against what is visible and verifies, and that gc returns the store to clean.
func TestStageCrashWindows(t *testing.T) {
	for _, tc := range []struct {
		name    string
		synced  bool
		renamed int // -1: all
	}{
		{"written", false, 0},
		{"synced", true, 0},
		{"half renamed", true, 3},
		{"all renamed", true, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			s := openTestStore(t)
			src := t.TempDir()
			data := writeRandom(t, filepath.Join(src, "pages-1.img"), 8*testChunk, 7)

			cs, err := s.newChunkStage()
			if err != nil {
				t.Fatal(err)
			}
			enc, err := newEncoder(testChunk)
			if err != nil {
				t.Fatal(err)
			}
			for off := 0; off < len(data); off += testChunk {
				raw := data[off : off+testChunk]
				if err := cs.add(HashChunk(raw), enc.encode(raw, nil)); err != nil {
					t.Fatal(err)
				}
			}
			if tc.synced {
				if err := cs.syncfs(); err != nil {
					t.Fatal(err)
				}
			}
			n := tc.renamed
			if n < 0 {
				n = len(cs.staged)
			}
			if err := cs.publishLocked(n); err != nil {
				t.Fatal(err)
			}
			// The crash: the writer vanishes without cleaning up.
			cs.fs.Close()

			if got := countChunkFiles(t, s); got != n {
				t.Fatalf("%d chunk files under final names, want %d", got, n)
			}
			if ents, _ := os.ReadDir(s.tmpDir()); len(ents) != 8-n {
				t.Fatalf("%d temp files, want %d", len(ents), 8-n)
			}
			_, st, err := s.Put(ctx, src, PutOptions{Name: "after", ChunkSize: testChunk})
			if err != nil {
				t.Fatal(err)
			}
			if st.DedupChunks != n {
				t.Errorf("put deduplicated %d chunks, want the %d renamed ones", st.DedupChunks, n)
			}
			if _, err := s.Verify(ctx, "after"); err != nil {
				t.Fatal(err)
			}
			gs, err := s.GC(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if gs.TempRemoved != 8-n {
				t.Errorf("gc removed %d temp files, want %d", gs.TempRemoved, 8-n)
			}
			assertNoGarbage(t, s)
			if _, err := s.Verify(ctx, "after"); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func countChunkFiles(t *testing.T, s *Store) int {
	t.Helper()
	n := 0
	err := filepath.WalkDir(filepath.Join(s.dir, "chunks"), func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			n++
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}
