package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// streamFile is a file fed to an Ingest through a pipe. With failErr set, the pipe is closed
// with that error once failAt bytes were written.
type streamFile struct {
	path    string
	mode    uint32
	data    []byte
	failAt  int
	failErr error
}

// streamFiles is an image's worth of files: empty, exactly one chunk, a chunk and a byte, a
// large mostly-zero file (zero chunks), two files of identical content (deduplicated), small
// and compressible ones.
func streamFiles() []streamFile {
	r := rand.New(rand.NewPCG(11, 12))
	random := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		return b
	}
	pages := make([]byte, 20*testChunk+777)
	copy(pages[3*testChunk+100:], random(5000))
	copy(pages[15*testChunk:], random(testChunk))
	dup := random(3*testChunk + 10)
	text := bytes.Repeat([]byte("ptxmig checkpoint "), 2*testChunk/18+500)
	return []streamFile{
		{path: "empty", mode: 0o600},
		{path: "one-chunk", mode: 0o644, data: random(testChunk)},
		{path: "chunk-plus-one", mode: 0o640, data: random(testChunk + 1)},
		{path: "pages-1.img", mode: 0o600, data: pages},
		{path: "dup-a.img", mode: 0o600, data: dup},
		{path: "dup-b.img", mode: 0o755, data: bytes.Clone(dup)},
		{path: "core-1.img", mode: 0o600, data: random(1000)},
		{path: "text", mode: 0o400, data: text},
	}
}

// writeStreamFiles writes files into a new directory, for a Put to compare with.
func writeStreamFiles(t testing.TB, files []streamFile) string {
	t.Helper()
	dir := t.TempDir()
	for _, f := range files {
		p := filepath.Join(dir, f.path)
		if err := os.WriteFile(p, f.data, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, fs.FileMode(f.mode)); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { chmodTree(dir) })
	return dir
}

// feedInterleaved adds files to in through pipes, one AddFile goroutine per file, all written by
// one goroutine in round-robin pieces of piece bytes (as CRIU writes several image files at
// once: none finishes before the others have started). It returns the AddFile errors.
func feedInterleaved(in *Ingest, files []streamFile, piece int) error {
	var wg sync.WaitGroup
	pws := make([]*io.PipeWriter, len(files))
	errs := make([]error, len(files))
	for i, f := range files {
		pr, pw := io.Pipe()
		pws[i] = pw
		wg.Add(1)
		go func() {
			defer wg.Done()
			n, err := in.AddFile(f.path, f.mode, pr)
			pr.CloseWithError(errors.New("reader gone")) // unblock the writer if AddFile stopped early
			if err == nil && n != int64(len(f.data)) {
				err = fmt.Errorf("%s: AddFile read %d bytes, want %d", f.path, n, len(f.data))
			}
			errs[i] = err
		}()
	}
	offs := make([]int, len(files))
	closed := make([]bool, len(files))
	for open := len(files); open > 0; {
		for i, f := range files {
			if closed[i] {
				continue
			}
			end := min(offs[i]+piece, len(f.data))
			if f.failErr != nil {
				end = min(end, f.failAt)
			}
			if end > offs[i] {
				if _, err := pws[i].Write(f.data[offs[i]:end]); err != nil {
					end = len(f.data) // the reader is gone
				}
			}
			offs[i] = end
			switch {
			case f.failErr != nil && end >= f.failAt:
				pws[i].CloseWithError(f.failErr)
			case end >= len(f.data):
				pws[i].Close()
			default:
				continue
			}
			closed[i] = true
			open--
		}
	}
	wg.Wait()
	return errors.Join(errs...)
}

// within fails the test when fn does not return within d (a deadlock).
func within(t *testing.T, d time.Duration, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	select {
	case <-done:
	case <-time.After(d):
		buf := make([]byte, 1<<20)
		t.Fatalf("%s did not finish within %v (deadlock?)\n%s", what, d, buf[:runtime.Stack(buf, true)])
	}
}

// ingestStream ingests files as image name, fed interleaved in pieces.
func ingestStream(t *testing.T, s *Store, name string, files []streamFile, o PutOptions) (*Manifest, *Stats) {
	t.Helper()
	o.Name = name
	if o.ChunkSize == 0 {
		o.ChunkSize = testChunk
	}
	in, err := s.NewIngest(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	var ferr error
	within(t, 60*time.Second, "ingest", func() { ferr = feedInterleaved(in, files, 4097) })
	if ferr != nil {
		t.Fatal(ferr)
	}
	m, st, err := in.Commit(nil)
	if err != nil {
		t.Fatal(err)
	}
	return m, st
}

// goroutinesSettle fails unless the goroutine count returns to at most base.
func goroutinesSettle(t *testing.T, base int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > base {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines, %d before\n%s", runtime.NumGoroutine(), base, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestIngestMatchesPut(t *testing.T) {
	for _, workers := range []int{1, 4} {
		t.Run(fmt.Sprintf("workers-%d", workers), func(t *testing.T) {
			ctx := context.Background()
			files := streamFiles()
			base := runtime.NumGoroutine()
			s := openTestStore(t)
			var progress []int64
			var pmu sync.Mutex
			m, st := ingestStream(t, s, "streamed", files, PutOptions{Workers: workers, Meta: Metadata(`{"kind":"cuda","pid":42}`),
				Progress: func(done, total int64) {
					pmu.Lock()
					progress = append(progress, done)
					pmu.Unlock()
					if total != 0 {
						t.Errorf("progress total %d, want 0 (unknown)", total)
					}
				}})
			goroutinesSettle(t, base)

			ref := openTestStore(t)
			pm, pst, err := ref.Put(ctx, writeStreamFiles(t, files), PutOptions{Name: "put", ChunkSize: testChunk, Workers: workers})
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(m.Files, pm.Files) {
				for i := range max(len(m.Files), len(pm.Files)) {
					if i >= len(m.Files) || i >= len(pm.Files) || !reflect.DeepEqual(m.Files[i], pm.Files[i]) {
						t.Fatalf("file %d differs from Put's:\ningest %+v\nput    %+v", i, m.Files[min(i, len(m.Files)-1)], pm.Files[min(i, len(pm.Files)-1)])
					}
				}
			}
			if m.ChunkSize != testChunk || string(m.Meta) != `{"kind":"cuda","pid":42}` || m.ID == "" {
				t.Errorf("manifest header %+v", m)
			}
			st.Duration, pst.Duration = 0, 0
			if *st != *pst {
				t.Errorf("stats\ningest %+v\nput    %+v", *st, *pst)
			}
			if st.ZeroChunks < 15 || st.DedupChunks != 4 || st.LogicalBytes != pm.LogicalBytes() {
				t.Errorf("stats %+v: want ≥ 15 zero chunks, 4 dedup chunks, %d logical bytes", *st, pm.LogicalBytes())
			}
			pmu.Lock()
			if len(progress) == 0 || progress[len(progress)-1] != st.LogicalBytes {
				t.Errorf("progress %v, want to end at %d", progress, st.LogicalBytes)
			}
			pmu.Unlock()
			if _, err := s.Verify(ctx, "streamed"); err != nil {
				t.Fatal(err)
			}
			got, err := s.Get("streamed")
			if err != nil || got.ID != m.ID {
				t.Fatalf("Get: %v, id %s want %s", err, got.ID, m.ID)
			}
			dst := filepath.Join(t.TempDir(), "out")
			t.Cleanup(func() { chmodTree(dst) })
			if _, err := s.Materialize(ctx, "streamed", dst, GetOptions{}); err != nil {
				t.Fatal(err)
			}
			sameTree(t, writeStreamFiles(t, files), dst)
			assertNoGarbage(t, s)
		})
	}
}

// A second ingest of the same content deduplicates every chunk against the store.
func TestIngestDedupAgainstStore(t *testing.T) {
	s := openTestStore(t)
	files := streamFiles()
	m1, _ := ingestStream(t, s, "a", files, PutOptions{})
	m2, st := ingestStream(t, s, "b", files, PutOptions{Parent: "a"})
	if st.WrittenBytes != 0 || st.DedupChunks == 0 || m2.Parent != m1.ID {
		t.Errorf("second ingest: %+v, parent %q", *st, m2.Parent)
	}
	if !reflect.DeepEqual(m1.Files, m2.Files) {
		t.Error("same content, different files")
	}
	assertNoGarbage(t, s)
}

// Files in an ingest (and how it fails) are tested with one file read from a pipe that the test
// controls; the store must end up exactly as before.
func TestIngestErrors(t *testing.T) {
	ctx := context.Background()
	boom := errors.New("boom")
	tests := []struct {
		name string
		// run drives the ingest and returns Commit's error, which must wrap want.
		run  func(t *testing.T, in *Ingest, cancel func()) error
		want error
	}{
		{"read-error-mid-file", func(t *testing.T, in *Ingest, _ func()) error {
			files := streamFiles()
			files[3].failAt, files[3].failErr = 7*testChunk+5, boom // pages-1.img
			if err := feedInterleaved(in, files, 4097); !errors.Is(err, boom) {
				t.Errorf("AddFile: %v, want %v", err, boom)
			}
			if _, err := in.AddFile("late", 0o600, strings.NewReader("x")); !errors.Is(err, boom) {
				t.Errorf("AddFile after a failure: %v, want the failure", err)
			}
			_, _, err := in.Commit(nil)
			return err
		}, boom},
		{"fail", func(t *testing.T, in *Ingest, _ func()) error {
			if err := feedInterleaved(in, streamFiles(), 10000); err != nil {
				t.Fatal(err)
			}
			in.Fail(boom)
			_, _, err := in.Commit(nil)
			return err
		}, boom},
		{"fail-while-reading", func(t *testing.T, in *Ingest, _ func()) error {
			pr, pw := io.Pipe()
			defer pw.Close()
			done := make(chan error)
			go func() {
				_, err := in.AddFile("pages-1.img", 0o600, pr)
				done <- err
			}()
			if _, err := pw.Write(make([]byte, 3*testChunk)); err != nil {
				t.Fatal(err)
			}
			in.Fail(boom)
			go io.Copy(pw, endless{}) // keeps writing: AddFile must stop anyway
			if err := <-done; !errors.Is(err, boom) {
				t.Errorf("AddFile: %v", err)
			}
			pr.Close()
			_, _, err := in.Commit(nil)
			return err
		}, boom},
		{"commit-while-adding", func(t *testing.T, in *Ingest, _ func()) error {
			pr, pw := io.Pipe()
			done := make(chan error)
			go func() {
				_, err := in.AddFile("core-1.img", 0o600, pr)
				done <- err
			}()
			pw.Write([]byte("partial"))
			var err error
			within(t, 10*time.Second, "commit", func() { _, _, err = in.Commit(nil) })
			pw.Close()
			if aerr := <-done; aerr == nil {
				t.Error("AddFile of a failed ingest succeeded")
			}
			return err
		}, nil},
		{"bad-metadata", func(t *testing.T, in *Ingest, _ func()) error {
			if _, err := in.AddFile("core-1.img", 0o600, strings.NewReader("x")); err != nil {
				t.Fatal(err)
			}
			_, _, err := in.Commit(Metadata(`{"pid":-1,"extra":{"a":"` + strings.Repeat("x", MaxMetaString+1) + `"}}`))
			return err
		}, nil},
		{"commit-twice", func(t *testing.T, in *Ingest, _ func()) error {
			if _, _, err := in.Commit(nil); err != nil {
				t.Fatal(err)
			}
			if _, err := in.AddFile("late", 0o600, strings.NewReader("x")); err == nil {
				t.Error("AddFile after Commit succeeded")
			}
			_, _, err := in.Commit(nil)
			if err == nil {
				t.Error("second Commit succeeded")
			}
			return errSkipCommitCheck
		}, nil},
		{"name-taken-meanwhile", func(t *testing.T, in *Ingest, _ func()) error {
			if _, err := in.AddFile("f", 0o600, strings.NewReader("data")); err != nil {
				t.Fatal(err)
			}
			putRandom(t, in.s, 10, 1, PutOptions{Name: "new"})
			_, _, err := in.Commit(nil)
			return err
		}, ErrExists},
		{"ctx-canceled", func(t *testing.T, in *Ingest, cancel func()) error {
			if _, err := in.AddFile("a", 0o600, bytes.NewReader(make([]byte, testChunk))); err != nil {
				t.Fatal(err)
			}
			cancel()
			_, _, err := in.Commit(nil)
			return err
		}, context.Canceled},
		{"close-without-commit", func(t *testing.T, in *Ingest, _ func()) error {
			if err := feedInterleaved(in, streamFiles(), 10000); err != nil {
				t.Fatal(err)
			}
			in.Close()
			_, _, err := in.Commit(nil)
			return err
		}, errIngestClosed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			base := runtime.NumGoroutine()
			s := openTestStore(t)
			src := t.TempDir()
			writeRandom(t, filepath.Join(src, "old"), 3*testChunk, 9)
			if _, _, err := s.Put(ctx, src, PutOptions{Name: "old", ChunkSize: testChunk}); err != nil {
				t.Fatal(err)
			}
			ictx, cancel := context.WithCancel(ctx)
			defer cancel()
			in, err := s.NewIngest(ictx, PutOptions{Name: "new", ChunkSize: testChunk})
			if err != nil {
				t.Fatal(err)
			}
			err = tt.run(t, in, cancel)
			in.Close()
			in.Close() // idempotent
			if err == errSkipCommitCheck {
				return
			}
			if err == nil || (tt.want != nil && !errors.Is(err, tt.want)) {
				t.Fatalf("Commit: %v, want %v", err, tt.want)
			}
			if !strings.HasPrefix(err.Error(), "ingest new: ") {
				t.Errorf("error lacks context: %v", err)
			}
			goroutinesSettle(t, base)
			if tt.want != ErrExists {
				if _, err := s.Get("new"); !errors.Is(err, ErrNotFound) {
					t.Errorf("failed ingest left an image: %v", err)
				}
				// Nothing staged is left (the chunks of an ingest that lost its name to
				// another writer at the very end were published, as a Put's are: gc's).
				assertNoGarbage(t, s)
			}
			if _, err := s.Verify(ctx, "old"); err != nil {
				t.Error(err)
			}
			if _, err := s.GC(ctx); err != nil {
				t.Fatal(err)
			}
			assertNoGarbage(t, s)
		})
	}
}

var errSkipCommitCheck = errors.New("checked already")

// endless reads as an endless stream of bytes.
type endless struct{}

func (endless) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = byte(i)
	}
	return len(p), nil
}

// Invalid paths are refused without failing the ingest.
func TestIngestAddFileRefusals(t *testing.T) {
	s := openTestStore(t)
	in, err := s.NewIngest(context.Background(), PutOptions{Name: "x", ChunkSize: testChunk})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	if _, err := in.AddFile("a", 0o7644, strings.NewReader("first")); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"a", "", ".", "../x", "..", "/abs", "a/../b", "./a", "a//b", "sub/x", "bad\x00nul", "\xff"} {
		if n, err := in.AddFile(p, 0o600, strings.NewReader("data")); err == nil || n != 0 {
			t.Errorf("AddFile(%q): %d, %v; want a refusal", p, n, err)
		}
	}
	m, _, err := in.Commit(nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Files) != 1 || m.Files[0].Path != "a" || m.Files[0].Mode != 0o644 || m.Files[0].Size != 5 {
		t.Errorf("files %+v", m.Files)
	}
}

func TestNewIngestErrors(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	src := putRandom(t, s, 10, 6, PutOptions{Name: "x"})
	pre, err := s.Prestage(ctx, src, PutOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pre.Close()
	tests := []struct {
		name string
		o    PutOptions
		want error
	}{
		{"exists", PutOptions{Name: "x"}, ErrExists},
		{"empty-name", PutOptions{Name: ""}, ErrInvalidName},
		{"slash", PutOptions{Name: "a/b"}, ErrInvalidName},
		{"no-parent", PutOptions{Name: "y", Parent: "nope"}, ErrNotFound},
		{"tiny-chunks", PutOptions{Name: "y", ChunkSize: 100}, nil},
		{"huge-chunks", PutOptions{Name: "y", ChunkSize: MaxChunkSize + 1}, nil},
		{"tiny-memory", PutOptions{Name: "y", MemoryLimit: 1000}, nil},
		{"bad-metadata", PutOptions{Name: "y", Meta: Metadata(`[{"pid":-1}]`)}, nil},
		{"prestaged", PutOptions{Name: "y", Prestaged: pre}, nil},
	}
	// Gc holds the lock: the options are refused up front, without waiting for it.
	lk, err := s.lockExclusive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			in, err := s.NewIngest(tctx, tt.o)
			if err == nil {
				in.Close()
			}
			if err == nil || (tt.want != nil && !errors.Is(err, tt.want)) || tctx.Err() != nil {
				t.Fatalf("NewIngest: %v, want %v", err, tt.want)
			}
		})
	}
	// A valid ingest waits for the lock, and gives up with its ctx.
	tctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, err := s.NewIngest(tctx, PutOptions{Name: "y"}); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("NewIngest under gc's lock: %v", err)
	}
	lk.unlock()
	if ents, _ := os.ReadDir(s.tmpDir()); len(ents) != 0 {
		t.Errorf("tmp/ holds %d entries", len(ents))
	}
}

// putStreamImage puts files as image name (chunk size testChunk) and returns their contents.
func putStreamImage(t *testing.T, s *Store, name string, files []streamFile) map[string][]byte {
	t.Helper()
	if _, _, err := s.Put(context.Background(), writeStreamFiles(t, files), PutOptions{Name: name, ChunkSize: testChunk}); err != nil {
		t.Fatal(err)
	}
	want := map[string][]byte{}
	for _, f := range files {
		want[f.path] = f.data
	}
	return want
}

func TestImageReaderRoundTrip(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	want := putStreamImage(t, s, "img", streamFiles())
	for _, workers := range []int{1, 3} {
		t.Run(fmt.Sprintf("workers-%d", workers), func(t *testing.T) {
			base := runtime.NumGoroutine()
			r, err := s.OpenImage(ctx, "img", GetOptions{Workers: workers})
			if err != nil {
				t.Fatal(err)
			}
			if r.Manifest().Name != "img" {
				t.Errorf("manifest %q", r.Manifest().Name)
			}
			var wg sync.WaitGroup
			for path, data := range want {
				for range 2 { // the same file twice at once, too
					wg.Add(1)
					go func() {
						defer wg.Done()
						var b bytes.Buffer
						n, err := r.WriteFile(ctx, path, &b)
						if err != nil || n != int64(len(data)) || !bytes.Equal(b.Bytes(), data) {
							t.Errorf("%s: %d bytes, %v; content equal %v", path, n, err, bytes.Equal(b.Bytes(), data))
						}
					}()
				}
			}
			within(t, 60*time.Second, "WriteFile", wg.Wait)
			if err := r.VerifyRest(ctx); err != nil {
				t.Fatal(err)
			}
			st := r.Stats()
			var logical int64
			for _, d := range want {
				logical += 2 * int64(len(d))
			}
			if st.LogicalBytes != logical || st.WrittenBytes != logical || st.ZeroChunks < 30 || st.StoredBytes == 0 || st.Chunks == 0 {
				t.Errorf("stats %+v, want %d logical bytes", *st, logical)
			}
			if _, ok := r.Lookup("nope"); ok {
				t.Error("Lookup of a missing file succeeded")
			}
			if f, ok := r.Lookup("pages-1.img"); !ok || f.Size != int64(len(want["pages-1.img"])) {
				t.Errorf("Lookup: %+v %v", f, ok)
			}
			if _, err := r.WriteFile(ctx, "nope", io.Discard); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("WriteFile of a missing file: %v", err)
			}
			r.Close()
			r.Close()
			if _, err := r.WriteFile(ctx, "core-1.img", io.Discard); err == nil {
				t.Error("WriteFile after Close succeeded")
			}
			goroutinesSettle(t, base)
			// The lock is released: gc runs.
			gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			if _, err := s.GC(gctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// Two files served through pipes to one consumer that reads them alternately (as CRIU restore
// may): neither WriteFile may wait for the other, even with a single worker.
func TestImageReaderInterleavedPipes(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	r := rand.New(rand.NewPCG(3, 4))
	big := func() []byte {
		b := make([]byte, 12*testChunk+3)
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		return b
	}
	files := []streamFile{{path: "pages-1.img", mode: 0o600, data: big()}, {path: "pages-2.img", mode: 0o600, data: big()}}
	want := putStreamImage(t, s, "img", files)
	ir, err := s.OpenImage(ctx, "img", GetOptions{Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer ir.Close()
	var wg sync.WaitGroup
	prs := make([]*io.PipeReader, len(files))
	for i, f := range files {
		pr, pw := io.Pipe()
		prs[i] = pr
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := ir.WriteFile(ctx, f.path, pw)
			pw.CloseWithError(err)
		}()
	}
	got := make([][]byte, len(files))
	within(t, 60*time.Second, "interleaved reads", func() {
		buf := make([]byte, 1000)
		for open := len(prs); open > 0; {
			for i, pr := range prs {
				if pr == nil {
					continue
				}
				n, err := pr.Read(buf)
				got[i] = append(got[i], buf[:n]...)
				if err != nil {
					if err != io.EOF {
						t.Errorf("%s: %v", files[i].path, err)
					}
					prs[i] = nil
					open--
				}
			}
		}
		wg.Wait()
	})
	for i, f := range files {
		if !bytes.Equal(got[i], want[f.path]) {
			t.Errorf("%s: %d bytes, content differs", f.path, len(got[i]))
		}
	}
}

func TestImageReaderCorruptChunk(t *testing.T) {
	ctx := context.Background()
	rnd := rand.New(rand.NewPCG(5, 6))
	// Chunks: random, zero, random, BAD, random, zero.
	data := make([]byte, 6*testChunk)
	for _, c := range []int{0, 2, 3, 4} {
		for i := c * testChunk; i < (c+1)*testChunk; i++ {
			data[i] = byte(rnd.Uint32())
		}
	}
	other := bytes.Repeat([]byte("other file "), 20000)
	files := []streamFile{{path: "core-1.img", mode: 0o600, data: other}, {path: "pages-1.img", mode: 0o600, data: data}}
	tests := []struct {
		name   string
		damage func(p string) error
	}{
		{"flip-byte", func(p string) error {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			b[len(b)/2] ^= 0x01
			return os.WriteFile(p, b, 0o600)
		}},
		{"truncate", func(p string) error { return os.Truncate(p, 100) }},
		{"delete", os.Remove},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := openTestStore(t)
			putStreamImage(t, s, "img", files)
			m, err := s.Get("img")
			if err != nil {
				t.Fatal(err)
			}
			bad := m.Files[1].Chunks[3]
			if m.Files[1].Path != "pages-1.img" || bad.Zero || !m.Files[1].Chunks[1].Zero {
				t.Fatalf("unexpected layout %+v", m.Files[1])
			}
			if err := tt.damage(s.chunkPath(bad.Hash)); err != nil {
				t.Fatal(err)
			}
			for _, workers := range []int{1, 4} {
				r, err := s.OpenImage(ctx, "img", GetOptions{Workers: workers})
				if err != nil {
					t.Fatal(err)
				}
				// VerifyRest finds the bad chunk of a file never written.
				err = r.VerifyRest(ctx)
				if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), fmt.Sprintf("file pages-1.img at offset %d", 3*testChunk)) {
					t.Errorf("VerifyRest: %v", err)
				}
				var b bytes.Buffer
				n, err := r.WriteFile(ctx, "pages-1.img", &b)
				if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), fmt.Sprintf("file pages-1.img at offset %d", 3*testChunk)) {
					t.Errorf("WriteFile: %v", err)
				}
				if n != 3*testChunk || !bytes.Equal(b.Bytes(), data[:3*testChunk]) {
					t.Errorf("wrote %d bytes (%d buffered) before the corrupt chunk, want exactly the %d before it", n, b.Len(), 3*testChunk)
				}
				// The other file is intact.
				b.Reset()
				if _, err := r.WriteFile(ctx, "core-1.img", &b); err != nil || !bytes.Equal(b.Bytes(), other) {
					t.Errorf("intact file: %v", err)
				}
				r.Close()
			}
		})
	}
}

// Chunks a WriteFile verified are not read again by VerifyRest; the others are.
func TestImageReaderVerifyRestSkipsVerified(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	files := streamFiles()
	putStreamImage(t, s, "img", files)
	m, _ := s.Get("img")
	r, err := s.OpenImage(ctx, "img", GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := r.WriteFile(ctx, "chunk-plus-one", io.Discard); err != nil {
		t.Fatal(err)
	}
	// Damage a chunk already verified: VerifyRest does not read it again.
	f, _ := r.Lookup("chunk-plus-one")
	if err := os.Remove(s.chunkPath(f.Chunks[0].Hash)); err != nil {
		t.Fatal(err)
	}
	if err := r.VerifyRest(ctx); err != nil {
		t.Fatalf("VerifyRest re-read a verified chunk: %v", err)
	}
	// Every chunk is verified now: even a damaged one is not read again.
	if err := os.Remove(s.chunkPath(m.Files[len(m.Files)-1].Chunks[0].Hash)); err != nil {
		t.Fatal(err)
	}
	if err := r.VerifyRest(ctx); err != nil {
		t.Fatalf("second VerifyRest: %v", err)
	}
}

// failWriter accepts n bytes, then fails.
type failWriter struct {
	n   int
	err error
}

func (w *failWriter) Write(p []byte) (int, error) {
	if len(p) <= w.n {
		w.n -= len(p)
		return len(p), nil
	}
	k := w.n
	w.n = 0
	return k, w.err
}

func TestImageReaderWriterFails(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	want := putStreamImage(t, s, "img", streamFiles())
	errPipe := errors.New("broken pipe")
	for _, tt := range []struct {
		path  string
		after int
	}{
		{"pages-1.img", 0},
		{"pages-1.img", testChunk + 10},       // in a zero chunk
		{"pages-1.img", 15*testChunk + 12345}, // in a data chunk after zero chunks
		{"dup-a.img", 3 * testChunk},          // at a chunk boundary
		{"chunk-plus-one", testChunk},         // before the last byte
	} {
		t.Run(fmt.Sprintf("%s-%d", tt.path, tt.after), func(t *testing.T) {
			base := runtime.NumGoroutine()
			r, err := s.OpenImage(ctx, "img", GetOptions{Workers: 2})
			if err != nil {
				t.Fatal(err)
			}
			n, err := r.WriteFile(ctx, tt.path, &failWriter{n: tt.after, err: errPipe})
			if !errors.Is(err, errPipe) || n != int64(tt.after) {
				t.Errorf("WriteFile: %d, %v; want %d, %v", n, err, tt.after, errPipe)
			}
			if !strings.Contains(err.Error(), fmt.Sprintf("write %s at offset %d", tt.path, tt.after)) {
				t.Errorf("error does not name the offset: %v", err)
			}
			// The reader still works, and its goroutines are gone after Close.
			var b bytes.Buffer
			if _, err := r.WriteFile(ctx, tt.path, &b); err != nil || !bytes.Equal(b.Bytes(), want[tt.path]) {
				t.Errorf("WriteFile after a failed one: %v", err)
			}
			r.Close()
			goroutinesSettle(t, base)
		})
	}
}

// A canceled ctx stops a WriteFile; Close while one runs stops it and frees the reader after it.
func TestImageReaderCancel(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	putStreamImage(t, s, "img", streamFiles())
	base := runtime.NumGoroutine()
	r, err := s.OpenImage(ctx, "img", GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := r.WriteFile(cctx, "dup-a.img", io.Discard); !errors.Is(err, context.Canceled) {
		t.Errorf("WriteFile with a canceled ctx: %v", err)
	}
	if err := r.VerifyRest(cctx); !errors.Is(err, context.Canceled) {
		t.Errorf("VerifyRest with a canceled ctx: %v", err)
	}
	pr, pw := io.Pipe()
	done := make(chan error)
	go func() {
		_, err := r.WriteFile(ctx, "pages-1.img", pw)
		done <- err
	}()
	if _, err := pr.Read(make([]byte, 10)); err != nil {
		t.Fatal(err)
	}
	r.Close() // returns at once; the WriteFile stops after its current write
	go io.Copy(io.Discard, pr)
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("WriteFile during Close: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("WriteFile did not stop after Close")
	}
	pr.Close()
	goroutinesSettle(t, base)
	gctx, gcancel := context.WithTimeout(ctx, 5*time.Second)
	defer gcancel()
	if _, err := s.GC(gctx); err != nil {
		t.Fatalf("gc after Close: %v", err)
	}
}

func TestOpenImageErrors(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	putStreamImage(t, s, "img", streamFiles())
	if _, err := s.OpenImage(ctx, "nope", GetOptions{}); !errors.Is(err, ErrNotFound) {
		t.Errorf("OpenImage of a missing image: %v", err)
	}
	if _, err := s.OpenImage(ctx, "img", GetOptions{MemoryLimit: 1 << 20}); !errors.Is(err, ErrMemoryLimit) {
		t.Errorf("OpenImage under a tiny memory limit: %v", err)
	}
	// Nothing is left locked: gc runs.
	gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := s.GC(gctx); err != nil {
		t.Fatal(err)
	}
}
