package store

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// countChunks returns the number of chunk files in the store.
func countChunks(t testing.TB, s *Store) int {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(s.dir, "chunks", "*", "*"))
	if err != nil {
		t.Fatal(err)
	}
	return len(files)
}

// TestDamagedManifest (issue 36): a manifest entry that is not a regular file (a symlink, even one
// to the image's own manifest, a directory, a FIFO) is a damaged image everywhere it is read:
// never followed or opened, listed as damaged, reported by Verify, a reason for GC to remove
// nothing, and removable with Remove (the entry only, never what a symlink points to).
func TestDamagedManifest(t *testing.T) {
	outside := filepath.Join(t.TempDir(), "victim.json")
	tests := []struct {
		name   string
		make   func(t *testing.T, p string) error
		reason string
	}{
		// The worst case: following the link would read a valid manifest, and say nothing.
		{"symlink to its own manifest", func(t *testing.T, p string) error { return os.Symlink(outside, p) }, `a symbolic link (to "` + outside + `")`},
		{"symlink out of the store", func(t *testing.T, p string) error { return os.Symlink("/etc/passwd", p) }, `a symbolic link (to "/etc/passwd")`},
		{"dangling symlink", func(t *testing.T, p string) error { return os.Symlink("no-such-file", p) }, "a symbolic link"},
		{"directory", func(t *testing.T, p string) error { return os.Mkdir(p, 0o700) }, "a directory"},
		{"fifo", func(t *testing.T, p string) error { return syscall.Mkfifo(p, 0o600) }, "a named pipe"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // a FIFO must never be waited on
			defer cancel()
			s := openTestStore(t)
			putRandom(t, s, 300_000, 1, PutOptions{Name: "kept", ChunkSize: testChunk})
			putRandom(t, s, 300_000, 2, PutOptions{Name: "victim", ChunkSize: testChunk})
			before := countChunks(t, s)
			p := s.manifestPath("victim")
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(outside, b, 0o600); err != nil {
				t.Fatal(err)
			}
			os.Remove(p)
			if err := tt.make(t, p); err != nil {
				t.Fatal(err)
			}

			_, err = s.Get("victim")
			var de *DamagedError
			if !errors.Is(err, ErrCorrupt) || !errors.As(err, &de) || !strings.Contains(err.Error(), tt.reason) {
				t.Fatalf("Get: %v; want ErrCorrupt saying %s", err, tt.reason)
			}
			ms, bad, err := s.ListDamaged()
			if err != nil || len(ms) != 1 || ms[0].Name != "kept" || len(bad) != 1 || bad[0].Name != "victim" || !errors.Is(bad[0].Err, ErrCorrupt) {
				t.Errorf("ListDamaged: %d images, damaged %+v, %v; want kept and damaged victim", len(ms), bad, err)
			}
			if names, _ := s.Names(); len(names) != 2 {
				t.Errorf("Names = %q, want kept and victim", names)
			}
			r, err := s.Verify(ctx, "victim")
			if !errors.Is(err, ErrCorrupt) || r == nil || len(r.Problems) != 1 || r.Problems[0].Path != "(manifest)" || !strings.Contains(r.Problems[0].Err, tt.reason) {
				t.Errorf("Verify: %v %+v", err, r)
			}
			_, err = s.GC(ctx)
			var dm *DamagedImagesError
			if !errors.As(err, &dm) || !errors.Is(err, ErrCorrupt) || len(dm.Names()) != 1 || dm.Names()[0] != "victim" || !strings.Contains(err.Error(), "nothing was removed") {
				t.Errorf("GC with a damaged image: %v; want a refusal naming victim", err)
			}
			if n := countChunks(t, s); n != before {
				t.Errorf("GC refused but the store went from %d to %d chunk files", before, n)
			}
			if err := s.Remove("victim"); err != nil {
				t.Fatalf("Remove of the damaged image: %v", err)
			}
			if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("Remove left %s: %v", p, err)
			}
			if _, err := os.Stat(outside); err != nil {
				t.Errorf("Remove touched what the symlink pointed to: %v", err)
			}
			if _, err := s.GC(ctx); err != nil {
				t.Fatal(err)
			}
			if n := countChunks(t, s); n >= before {
				t.Errorf("GC after the removal kept %d of %d chunk files", n, before)
			}
			assertNoGarbage(t, s)
			if _, err := s.Verify(ctx, "kept"); err != nil {
				t.Error(err)
			}
		})
	}
}
