package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// releaseLog counts the Release calls of each piece of a list.
type releaseLog struct{ n []atomic.Int32 }

// track gives every piece a Release that counts its calls; with scribble it also overwrites the
// piece's Data, as a ring slot is reused once released (a worker that read it later would store
// garbage).
func track(ps []ChunkPiece, scribble bool) *releaseLog {
	l := &releaseLog{n: make([]atomic.Int32, len(ps))}
	for i := range ps {
		data := ps[i].Data
		ps[i].Release = func() {
			l.n[i].Add(1)
			if scribble {
				for j := range data {
					data[j] = 0xa5
				}
			}
		}
	}
	return l
}

// check fails unless each of the first n pieces was released exactly once and no other was.
func (l *releaseLog) check(t *testing.T, n int) {
	t.Helper()
	for i := range l.n {
		want := int32(0)
		if i < n {
			want = 1
		}
		if got := l.n[i].Load(); got != want {
			t.Errorf("piece %d released %d times, want %d", i, got, want)
		}
	}
}

// dataPieces splits b into pieces of chunk bytes, each in a buffer of its own.
func dataPieces(b []byte, chunk int) []ChunkPiece {
	var ps []ChunkPiece
	for off := 0; off < len(b); off += chunk {
		ps = append(ps, ChunkPiece{Data: bytes.Clone(b[off:min(off+chunk, len(b))])})
	}
	return ps
}

// refPieces references every chunk of f.
func refPieces(f *File) []ChunkPiece {
	ps := make([]ChunkPiece, len(f.Chunks))
	for i := range f.Chunks {
		c := f.Chunks[i]
		c.Offset = 12345 // ignored
		ps[i] = ChunkPiece{Ref: &c}
	}
	return ps
}

// pieceSource returns a next func for AddChunks that hands out ps in order, then fails with
// err (nil: ends the file). It counts the pieces handed out in *n.
func pieceSource(ps []ChunkPiece, err error, n *int) func() (ChunkPiece, bool, error) {
	return func() (ChunkPiece, bool, error) {
		if *n == len(ps) {
			return ChunkPiece{}, false, err
		}
		*n++
		return ps[*n-1], true, nil
	}
}

// addChunksImage stores ps as the file path of a new image name (chunk size testChunk) through
// AddChunks and returns the image and its stats; every piece must be released by Commit.
func addChunksImage(t *testing.T, s *Store, name, path string, ps []ChunkPiece, o PutOptions) (*Manifest, *Stats) {
	t.Helper()
	o.Name, o.ChunkSize = name, testChunk
	in, err := s.NewIngest(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	log := track(ps, true)
	var handed int
	var n int64
	within(t, 60*time.Second, "AddChunks", func() { n, err = in.AddChunks(path, 0o640, pieceSource(ps, nil, &handed)) })
	if err != nil {
		t.Fatal(err)
	}
	m, st, err := in.Commit(nil)
	if err != nil {
		t.Fatal(err)
	}
	log.check(t, len(ps))
	if f := m.Files[0]; len(m.Files) != 1 || f.Path != path || f.Size != n || f.Mode != 0o640 {
		t.Errorf("files %+v, want %s of %d bytes", m.Files, path, n)
	}
	return m, st
}

// refImages stores image "a", one file of chunks given as data (random, a zero chunk, a short
// last chunk), and image "b" whose file references every chunk of a's but one, which changed.
// It returns both and their files' contents.
func refImages(t *testing.T, s *Store) (a, b *Manifest, dataA, dataB []byte, stB *Stats) {
	t.Helper()
	dataA = randomBytes(6*testChunk+1000, 3)
	clear(dataA[2*testChunk : 3*testChunk])
	a, stA := addChunksImage(t, s, "a", "gpu-0.mem", dataPieces(dataA, testChunk), PutOptions{})
	if stA.LogicalBytes != int64(len(dataA)) || stA.ZeroChunks != 1 || stA.DedupChunks != 0 || stA.WrittenBytes == 0 {
		t.Errorf("stats of a: %+v", *stA)
	}
	// Chunks given as data are stored exactly as Put stores them.
	ref := openTestStore(t)
	pm, _, err := ref.Put(context.Background(), writeStreamFiles(t, []streamFile{{path: "gpu-0.mem", mode: 0o640, data: dataA}}),
		PutOptions{Name: "put", ChunkSize: testChunk})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(a.Files, pm.Files) {
		t.Errorf("AddChunks's file differs from Put's:\n%+v\n%+v", a.Files, pm.Files)
	}

	const changed = 4
	dataB = bytes.Clone(dataA)
	copy(dataB[changed*testChunk:], randomBytes(testChunk, 4))
	ps := refPieces(&a.Files[0])
	ps[changed] = ChunkPiece{Data: bytes.Clone(dataB[changed*testChunk : (changed+1)*testChunk])}
	b, stB = addChunksImage(t, s, "b", "gpu-0.mem", ps, PutOptions{Parent: "a"})
	if b.Parent != a.ID {
		t.Errorf("parent %q, want %s", b.Parent, a.ID)
	}
	for i, c := range b.Files[0].Chunks {
		if want := a.Files[0].Chunks[i]; i != changed && c != want {
			t.Errorf("chunk %d: %+v, want %+v", i, c, want)
		}
	}
	return a, b, dataA, dataB, stB
}

// A file whose chunks reference another image's is an image like any other: it reads back
// through every path, verifies, exports and imports, and its stats count the references as
// deduplicated.
func TestAddChunksReferences(t *testing.T) {
	ctx := context.Background()
	base := runtime.NumGoroutine()
	s := openTestStore(t)
	a, b, dataA, dataB, st := refImages(t, s)
	goroutinesSettle(t, base)

	var refBytes int64 // non-zero chunks referenced
	for i, c := range a.Files[0].Chunks {
		if !c.Zero && i != 4 {
			refBytes += int64(c.Size)
		}
	}
	want := Stats{LogicalBytes: int64(len(dataB)), ZeroBytes: testChunk, DedupBytes: refBytes, Chunks: 7, DedupChunks: 5, ZeroChunks: 1,
		WrittenBytes: st.WrittenBytes, StoredBytes: st.StoredBytes, Duration: st.Duration}
	if *st != want || st.WrittenBytes == 0 || st.WrittenBytes > testChunk+chunkHeaderLen {
		t.Errorf("stats of b\n%+v, want\n%+v (one chunk written)", *st, want)
	}
	if st.StoredBytes != b.StoredBytes() {
		t.Errorf("stored bytes %d, manifest says %d", st.StoredBytes, b.StoredBytes())
	}

	for _, tt := range []struct {
		name string
		data []byte
	}{{"a", dataA}, {"b", dataB}} {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := s.Verify(ctx, tt.name); err != nil {
				t.Fatal(err)
			}
			r, err := s.OpenImage(ctx, tt.name, GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			var buf bytes.Buffer
			_, err = r.WriteFile(ctx, "gpu-0.mem", &buf)
			r.Close()
			if err != nil || !bytes.Equal(buf.Bytes(), tt.data) {
				t.Fatalf("WriteFile: %v, %d bytes equal: %v", err, buf.Len(), bytes.Equal(buf.Bytes(), tt.data))
			}
			dst := filepath.Join(t.TempDir(), "out")
			if _, err := s.Materialize(ctx, tt.name, dst, GetOptions{}); err != nil {
				t.Fatal(err)
			}
			if got, err := os.ReadFile(filepath.Join(dst, "gpu-0.mem")); err != nil || !bytes.Equal(got, tt.data) {
				t.Fatalf("materialized file: %v, equal: %v", err, bytes.Equal(got, tt.data))
			}
			var stream bytes.Buffer
			if err := s.Export(ctx, tt.name, &stream); err != nil {
				t.Fatal(err)
			}
			other := openTestStore(t)
			m, err := other.Import(ctx, &stream)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := other.Verify(ctx, m.Name); err != nil {
				t.Fatal(err)
			}
		})
	}
	assertNoGarbage(t, s)
}

// gc after either image is removed keeps every chunk the other uses, and only those.
func TestAddChunksGC(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct{ remove, keep string }{{"b", "a"}, {"a", "b"}} {
		t.Run("remove-"+tt.remove, func(t *testing.T) {
			s := openTestStore(t)
			a, b, dataA, dataB, _ := refImages(t, s)
			kept, data := a, dataA
			if tt.keep == "b" {
				kept, data = b, dataB
			}
			if err := s.Remove(tt.remove); err != nil {
				t.Fatal(err)
			}
			gs, err := s.GC(ctx)
			if err != nil {
				t.Fatal(err)
			}
			// a and b have 6 distinct stored chunks each, 5 of them shared.
			if gs.ChunksKept != 5+1 || gs.ChunksRemoved != 1 {
				t.Errorf("gc kept %d chunks and removed %d, want 6 and 1", gs.ChunksKept, gs.ChunksRemoved)
			}
			if len(kept.ChunkIDs()) != gs.ChunksKept {
				t.Errorf("%s has %d chunks, gc kept %d", tt.keep, len(kept.ChunkIDs()), gs.ChunksKept)
			}
			assertNoGarbage(t, s)
			if _, err := s.Verify(ctx, tt.keep); err != nil {
				t.Fatal(err)
			}
			r, err := s.OpenImage(ctx, tt.keep, GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			var buf bytes.Buffer
			if _, err := r.WriteFile(ctx, "gpu-0.mem", &buf); err != nil || !bytes.Equal(buf.Bytes(), data) {
				t.Fatalf("WriteFile after gc: %v", err)
			}
		})
	}
}

// AddChunks's pieces, good and bad: a bad one fails the ingest, naming the file and offset, and
// every piece handed out is released either way.
func TestAddChunksPieces(t *testing.T) {
	ctx := context.Background()
	boom := errors.New("boom")
	tail := randomBytes(1000, 5)
	tests := []struct {
		name string
		// pieces builds the file's pieces from the chunks and content of an image "old" (3 random
		// chunks) and returns the file's content when AddChunks must succeed, else nil.
		pieces  func(old []Chunk, oldData []byte) ([]ChunkPiece, []byte)
		nextErr error  // next fails with it after the pieces
		wantErr error  // when AddChunks fails: an error that it wraps, or nil for any
		msg     string // when it fails: in the message
	}{
		{"zero-refs", func([]Chunk, []byte) ([]ChunkPiece, []byte) {
			zero := Chunk{Offset: 5, Size: testChunk, Zero: true}
			return []ChunkPiece{{Ref: &zero}, {Ref: &zero}, {Data: bytes.Clone(tail)}}, append(make([]byte, 2*testChunk), tail...)
		}, nil, nil, ""},
		{"zero-ref-short-last", func(old []Chunk, oldData []byte) ([]ChunkPiece, []byte) {
			return []ChunkPiece{{Ref: &old[0]}, {Ref: &Chunk{Size: 1000, Zero: true}}}, append(bytes.Clone(oldData[:testChunk]), make([]byte, 1000)...)
		}, nil, nil, ""},
		{"short-last-ref", func(old []Chunk, oldData []byte) ([]ChunkPiece, []byte) {
			b := randomBytes(testChunk, 6)
			return []ChunkPiece{{Data: bytes.Clone(b)}, {Ref: &old[3]}}, append(b, oldData[3*testChunk:]...)
		}, nil, nil, ""},
		{"refs-then-short-data", func(old []Chunk, oldData []byte) ([]ChunkPiece, []byte) {
			return []ChunkPiece{{Ref: &old[2]}, {Ref: &old[0]}, {Data: bytes.Clone(tail)}},
				append(append(bytes.Clone(oldData[2*testChunk:3*testChunk]), oldData[:testChunk]...), tail...)
		}, nil, nil, ""},
		{"data-short-last", func([]Chunk, []byte) ([]ChunkPiece, []byte) {
			b := append(randomBytes(2*testChunk, 6), tail...)
			return dataPieces(b, testChunk), b
		}, nil, nil, ""},
		{"data-all-zero", func([]Chunk, []byte) ([]ChunkPiece, []byte) {
			return dataPieces(make([]byte, 2*testChunk), testChunk), make([]byte, 2*testChunk)
		}, nil, nil, ""},
		{"data-same-as-ref", func(old []Chunk, oldData []byte) ([]ChunkPiece, []byte) {
			return []ChunkPiece{{Ref: &old[0]}, {Data: bytes.Clone(oldData[:testChunk])}}, append(bytes.Clone(oldData[:testChunk]), oldData[:testChunk]...)
		}, nil, nil, ""},
		{"empty-file", func([]Chunk, []byte) ([]ChunkPiece, []byte) { return nil, []byte{} }, nil, nil, ""},
		{"middle-data-short", func([]Chunk, []byte) ([]ChunkPiece, []byte) {
			return []ChunkPiece{{Data: randomBytes(testChunk, 7)}, {Data: randomBytes(testChunk-1, 8)}, {Data: randomBytes(testChunk, 9)}}, nil
		}, nil, nil, fmt.Sprintf("add f: piece at offset %d: %d bytes, less than the chunk size", testChunk, testChunk-1)},
		{"middle-ref-short", func(old []Chunk, _ []byte) ([]ChunkPiece, []byte) {
			return []ChunkPiece{{Ref: &Chunk{Size: 10, Zero: true}}, {Ref: &old[1]}}, nil
		}, nil, nil, "add f: piece at offset 0: 10 bytes"},
		{"data-too-long", func([]Chunk, []byte) ([]ChunkPiece, []byte) {
			return []ChunkPiece{{Data: randomBytes(testChunk, 7)}, {Data: randomBytes(testChunk+1, 8)}}, nil
		}, nil, nil, fmt.Sprintf("add f: piece at offset %d: %d bytes of data outside", testChunk, testChunk+1)},
		{"data-empty", func([]Chunk, []byte) ([]ChunkPiece, []byte) { return []ChunkPiece{{Data: []byte{}}}, nil }, nil, nil,
			"piece at offset 0: 0 bytes"},
		{"ref-too-large", func(old []Chunk, _ []byte) ([]ChunkPiece, []byte) {
			c := old[0]
			c.Size = testChunk + 1
			return []ChunkPiece{{Ref: &c}}, nil
		}, nil, nil, fmt.Sprintf("piece at offset 0: referenced chunk of size %d outside", testChunk+1)},
		{"ref-missing", func(old []Chunk, _ []byte) ([]ChunkPiece, []byte) {
			c := old[1]
			c.Hash[0] ^= 1
			return []ChunkPiece{{Ref: &old[0]}, {Ref: &c}}, nil
		}, nil, ErrChunkMissing, fmt.Sprintf("add f: piece at offset %d", testChunk)},
		{"ref-wrong-size", func(old []Chunk, _ []byte) ([]ChunkPiece, []byte) {
			c := old[0]
			c.Size--
			return []ChunkPiece{{Ref: &c}}, nil
		}, nil, ErrChunkMissing, "piece at offset 0"},
		{"ref-zero-with-hash", func(old []Chunk, _ []byte) ([]ChunkPiece, []byte) {
			c := old[0]
			c.Zero = true
			return []ChunkPiece{{Ref: &c}}, nil
		}, nil, nil, "zero chunk has a hash"},
		{"ref-no-hash", func([]Chunk, []byte) ([]ChunkPiece, []byte) { return []ChunkPiece{{Ref: &Chunk{Size: testChunk}}}, nil }, nil, nil,
			"no hash"},
		{"data-and-ref", func(old []Chunk, _ []byte) ([]ChunkPiece, []byte) {
			return []ChunkPiece{{Data: randomBytes(testChunk, 7), Ref: &old[0]}}, nil
		}, nil, nil, "both Data and Ref"},
		{"neither", func([]Chunk, []byte) ([]ChunkPiece, []byte) { return []ChunkPiece{{}}, nil }, nil, nil, "neither Data nor Ref"},
		{"next-error", func(old []Chunk, _ []byte) ([]ChunkPiece, []byte) {
			return append(dataPieces(randomBytes(3*testChunk, 10), testChunk), ChunkPiece{Ref: &old[2]}), nil
		}, boom, boom, fmt.Sprintf("add f: next piece at offset %d: boom", 4*testChunk)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			base := runtime.NumGoroutine()
			s := openTestStore(t)
			src := putRandom(t, s, 3*testChunk+500, 11, PutOptions{Name: "old", ChunkSize: testChunk})
			old, err := s.Get("old")
			if err != nil {
				t.Fatal(err)
			}
			oldData, err := os.ReadFile(filepath.Join(src, "f"))
			if err != nil {
				t.Fatal(err)
			}
			ps, want := tt.pieces(old.Files[0].Chunks, oldData)
			log := track(ps, false)
			in, err := s.NewIngest(ctx, PutOptions{Name: "new", ChunkSize: testChunk, Workers: 2})
			if err != nil {
				t.Fatal(err)
			}
			defer in.Close()
			var handed int
			var n int64
			within(t, 30*time.Second, "AddChunks", func() { n, err = in.AddChunks("f", 0o600, pieceSource(ps, tt.nextErr, &handed)) })
			if want != nil {
				if err != nil || n != int64(len(want)) {
					t.Fatalf("AddChunks: %d, %v; want %d bytes", n, err, len(want))
				}
				m, _, err := in.Commit(nil)
				if err != nil {
					t.Fatal(err)
				}
				log.check(t, len(ps))
				r, err := s.OpenImage(ctx, m.Name, GetOptions{})
				if err != nil {
					t.Fatal(err)
				}
				defer r.Close()
				var buf bytes.Buffer
				if _, err := r.WriteFile(ctx, "f", &buf); err != nil || !bytes.Equal(buf.Bytes(), want) {
					t.Fatalf("WriteFile: %v; content equal: %v", err, bytes.Equal(buf.Bytes(), want))
				}
				if _, err := s.Verify(ctx, "new"); err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || (tt.wantErr != nil && !errors.Is(err, tt.wantErr)) || !strings.Contains(err.Error(), tt.msg) ||
				!strings.HasPrefix(err.Error(), "ingest new: ") {
				t.Fatalf("AddChunks: %v; want an error wrapping %v, saying %q", err, tt.wantErr, tt.msg)
			}
			if _, _, cerr := in.Commit(nil); !errors.Is(cerr, errors.Unwrap(err)) {
				t.Errorf("Commit after a failed AddChunks: %v, want the failure", cerr)
			}
			in.Close()
			log.check(t, handed)
			goroutinesSettle(t, base)
			if _, err := s.Get("new"); !errors.Is(err, ErrNotFound) {
				t.Errorf("failed ingest left an image: %v", err)
			}
			assertNoGarbage(t, s)
		})
	}
}

// Close without Commit releases the pieces handed over before it returns, whether the workers
// stored them already, are busy or left them queued; a piece that AddChunks gets later is
// released by AddChunks.
func TestAddChunksCloseReleases(t *testing.T) {
	tests := []struct {
		name   string
		before int  // pieces AddChunks hands over before Close, while next waits
		busy   bool // the worker is stuck releasing the first piece until Close stops it: the second stays queued
		runs   int  // the worker picks the queued job or the order to quit at random: try both
	}{
		{"stored", 8, false, 1},
		{"queued", 2, true, 20},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for range tt.runs {
				s := openTestStore(t)
				in, err := s.NewIngest(context.Background(), PutOptions{Name: "new", ChunkSize: testChunk, Workers: 1})
				if err != nil {
					t.Fatal(err)
				}
				defer in.Close()
				ps := dataPieces(randomBytes((tt.before+2)*testChunk, 12), testChunk)
				log := track(ps, true)
				if tt.busy {
					counted := ps[0].Release
					ps[0].Release = func() { <-in.quit; counted() }
				}
				asked := make(chan struct{}, len(ps))
				gate := make(chan struct{})
				var handed int
				src := pieceSource(ps, nil, &handed)
				next := func() (ChunkPiece, bool, error) {
					asked <- struct{}{}
					if handed == tt.before {
						<-gate
					}
					return src()
				}
				done := make(chan error, 1)
				go func() {
					_, err := in.AddChunks("f", 0o600, next)
					done <- err
				}()
				for range tt.before + 1 { // AddChunks handed over the first pieces and waits for the next
					<-asked
				}
				within(t, 10*time.Second, "Close", in.Close)
				log.check(t, tt.before)
				close(gate)
				if err := <-done; !errors.Is(err, errIngestClosed) {
					t.Errorf("AddChunks: %v, want %v", err, errIngestClosed)
				}
				log.check(t, tt.before+1)
				assertNoGarbage(t, s)
			}
		})
	}
}

func TestIngestHasChunk(t *testing.T) {
	s := openTestStore(t)
	putRandom(t, s, 2*testChunk+100, 13, PutOptions{Name: "old", ChunkSize: testChunk})
	old, err := s.Get("old")
	if err != nil {
		t.Fatal(err)
	}
	in, err := s.NewIngest(context.Background(), PutOptions{Name: "new", ChunkSize: testChunk})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	// A chunk this ingest stored is not in the store before Commit.
	fresh := randomBytes(testChunk, 14)
	if _, err := in.AddChunks("f", 0o600, pieceSource(dataPieces(fresh, testChunk), nil, new(int))); err != nil {
		t.Fatal(err)
	}
	c0, short := old.Files[0].Chunks[0], old.Files[0].Chunks[2]
	edit := func(c Chunk, f func(*Chunk)) Chunk { f(&c); return c }
	for _, tt := range []struct {
		name string
		c    Chunk
		want bool
	}{
		{"stored", c0, true},
		{"stored-short", short, true},
		{"other-offset", edit(c0, func(c *Chunk) { c.Offset = 99 * testChunk }), true},
		{"zero", Chunk{Size: testChunk, Zero: true}, true},
		{"zero-short", Chunk{Size: 1, Zero: true}, true},
		{"unknown-hash", edit(c0, func(c *Chunk) { c.Hash[31] ^= 0xff }), false},
		{"wrong-size", edit(short, func(c *Chunk) { c.Size++ }), false},
		{"larger-than-chunk", Chunk{Size: testChunk + 1, Zero: true}, false},
		{"empty", Chunk{Zero: true}, false},
		{"no-hash", Chunk{Size: testChunk}, false},
		{"zero-with-hash", edit(c0, func(c *Chunk) { c.Zero = true }), false},
		{"staged-by-this-ingest", Chunk{Size: testChunk, Hash: HashChunk(fresh)}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := in.HasChunk(tt.c); got != tt.want {
				t.Errorf("HasChunk(%+v) = %v, want %v", tt.c, got, tt.want)
			}
		})
	}
	if _, _, err := in.Commit(nil); err != nil {
		t.Fatal(err)
	}
}
