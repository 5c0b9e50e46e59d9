package store

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"
)

const preChunk = 64 << 10

// growFile appends n chunks of seeded random bytes to path in pieces, pausing so that a Prestage
// polls between them (the way CRIU writes pages-*.img while it dumps).
func growFile(t *testing.T, path string, n int, seed uint64) []byte {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, 1))
	all := make([]byte, n*preChunk+1234) // a partial last chunk too
	for i := range all {
		all[i] = byte(r.Uint32())
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for off := 0; off < len(all); off += preChunk / 2 {
		if _, err := f.Write(all[off:min(off+preChunk/2, len(all))]); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond)
	}
	return all
}

// waitStaged polls until the Prestage staged at least n chunks.
func waitStaged(t *testing.T, p *Prestage, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for p.Stats().Chunks < n {
		if time.Now().After(deadline) {
			t.Fatalf("prestage staged %d chunks, want >= %d", p.Stats().Chunks, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func countFiles(t *testing.T, dir string) int {
	t.Helper()
	n := 0
	err := filepath.WalkDir(dir, func(_ string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			n++
		}
		return err
	})
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return n
}

func distinctChunks(m *Manifest) int {
	seen := map[ChunkID]bool{}
	for _, f := range m.Files {
		for _, c := range f.Chunks {
			if !c.Zero {
				seen[c.Hash] = true
			}
		}
	}
	return len(seen)
}

func TestPrestage(t *testing.T) {
	tests := []struct {
		name    string
		rewrite bool // overwrite an already-staged region before the Put
	}{
		{"writer appends", false},
		{"writer rewrites a staged region", true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			s := openTestStore(t)
			src := t.TempDir()
			if err := os.WriteFile(filepath.Join(src, "core.img"), []byte("small file"), 0o600); err != nil {
				t.Fatal(err)
			}
			p, err := s.Prestage(ctx, src, PutOptions{ChunkSize: preChunk, Workers: 2})
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			data := growFile(t, filepath.Join(src, "pages-1.img"), 12, 7)
			waitStaged(t, p, 12)
			if tc.rewrite {
				f, err := os.OpenFile(filepath.Join(src, "pages-1.img"), os.O_WRONLY, 0)
				if err != nil {
					t.Fatal(err)
				}
				other := make([]byte, preChunk)
				for i := range other {
					other[i] = byte(i*7 + 3)
				}
				if _, err := f.WriteAt(other, 3*preChunk); err != nil {
					t.Fatal(err)
				}
				f.Close()
				copy(data[3*preChunk:], other)
			}
			if err := p.Stop(); err != nil {
				t.Fatal(err)
			}
			m, st, err := s.Put(ctx, src, PutOptions{Name: "pre", ChunkSize: preChunk, Prestaged: p})
			if err != nil {
				t.Fatal(err)
			}
			p.Close()

			// Same stats as a Put without a Prestage, into a fresh store.
			plain := openTestStore(t)
			_, want, err := plain.Put(ctx, src, PutOptions{Name: "plain", ChunkSize: preChunk})
			if err != nil {
				t.Fatal(err)
			}
			if st.WrittenBytes != want.WrittenBytes || st.DedupBytes != want.DedupBytes || st.ZeroBytes != want.ZeroBytes ||
				st.StoredBytes != want.StoredBytes || st.Chunks != want.Chunks {
				t.Errorf("stats with prestage %+v, without %+v", st, want)
			}
			// Exactly the referenced chunks are published; no temp file is left.
			if got, want := countFiles(t, filepath.Join(s.Dir(), "chunks")), distinctChunks(m); got != want {
				t.Errorf("%d chunk files published, manifest references %d", got, want)
			}
			if n := countFiles(t, s.tmpDir()); n != 0 {
				t.Errorf("%d temp files left", n)
			}
			out := t.TempDir()
			if _, err := s.Materialize(ctx, "pre", out, GetOptions{}); err != nil {
				t.Fatal(err)
			}
			sameTree(t, src, out)
			got, err := os.ReadFile(filepath.Join(out, "pages-1.img"))
			if err != nil || string(got) != string(data) {
				t.Fatalf("pages-1.img restored wrong (err %v)", err)
			}
		})
	}
}

// A Prestage abandoned (the writer failed) leaves no temp files and releases the store lock.
func TestPrestageClose(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	src := t.TempDir()
	p, err := s.Prestage(ctx, src, PutOptions{ChunkSize: preChunk, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	growFile(t, filepath.Join(src, "pages-1.img"), 6, 9)
	waitStaged(t, p, 6)
	p.Close()
	p.Close() // idempotent
	if n := countFiles(t, s.tmpDir()); n != 0 {
		t.Errorf("%d temp files left after Close", n)
	}
	if n := countFiles(t, filepath.Join(s.Dir(), "chunks")); n != 0 {
		t.Errorf("%d chunk files published without a Put", n)
	}
	gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := s.GC(gctx); err != nil {
		t.Fatalf("gc after Close (lock not released?): %v", err)
	}
	if _, _, err := s.Put(ctx, src, PutOptions{Name: "late", Prestaged: p}); err == nil {
		t.Fatal("Put with a closed Prestage succeeded")
	}
}

// A Put of another directory refuses the Prestage and stores nothing.
func TestPrestageOtherDir(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	a, b := t.TempDir(), t.TempDir()
	p, err := s.Prestage(ctx, a, PutOptions{ChunkSize: preChunk})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if _, _, err := s.Put(ctx, b, PutOptions{Name: "x", Prestaged: p}); !errors.Is(err, errPrestageDir) {
		t.Fatalf("Put of another dir: %v, want %v", err, errPrestageDir)
	}
	if _, err := s.Get("x"); err == nil {
		t.Fatal("image x exists after a refused Put")
	}
}

// A gc that starts between the Prestage and its Put waits for both; it must not deadlock them
// (the Put does not take the store lock a second time).
func TestPrestageGCBetween(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	src := t.TempDir()
	p, err := s.Prestage(ctx, src, PutOptions{ChunkSize: preChunk, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	growFile(t, filepath.Join(src, "pages-1.img"), 4, 3)
	waitStaged(t, p, 4)
	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	gcDone := make(chan error, 1)
	go func() {
		_, err := s.GC(ctx)
		gcDone <- err
	}()
	time.Sleep(50 * time.Millisecond) // gc now holds the gate and waits for the lock
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, _, err := s.Put(pctx, src, PutOptions{Name: "during-gc", ChunkSize: preChunk, Prestaged: p}); err != nil {
		t.Fatalf("Put with a Prestage while gc waits: %v", err)
	}
	select {
	case err := <-gcDone:
		t.Fatalf("gc finished while the Prestage still held the lock: %v", err)
	default:
	}
	p.Close()
	select {
	case err := <-gcDone:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("gc still waiting after Close")
	}
	out := t.TempDir()
	if _, err := s.Materialize(ctx, "during-gc", out, GetOptions{}); err != nil {
		t.Fatalf("image after gc: %v", err)
	}
	sameTree(t, src, out)
}

// Prestage does not wait for a running gc: it reports ErrBusy at once.
func TestPrestageBusy(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	lk, err := s.lockExclusive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lk.unlock()
	start := time.Now()
	if _, err := s.Prestage(ctx, t.TempDir(), PutOptions{}); !errors.Is(err, ErrBusy) {
		t.Fatalf("Prestage during gc: %v, want ErrBusy", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("Prestage waited %v for the lock", d)
	}
}

// A Prestage belongs to one store and chunk size.
func TestPrestageOtherStoreOrChunkSize(t *testing.T) {
	ctx := context.Background()
	s, other := openTestStore(t), openTestStore(t)
	src := t.TempDir()
	for _, tc := range []struct {
		name  string
		put   *Store
		chunk int
	}{{"other store", other, preChunk}, {"other chunk size", s, 2 * preChunk}} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := s.Prestage(ctx, src, PutOptions{ChunkSize: preChunk})
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			if _, _, err := tc.put.Put(ctx, src, PutOptions{Name: "x", ChunkSize: tc.chunk, Prestaged: p}); !errors.Is(err, errPrestageDir) {
				t.Fatalf("Put: %v, want %v", err, errPrestageDir)
			}
		})
	}
}
