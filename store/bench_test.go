package store

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// TestFloatChunksShuffled checks that float32 weights pick the 4-byte shuffle and beat plain
// zstd's ratio (1.08 on this data): the reason the store's output is smaller than zstd -1.
func TestFloatChunksShuffled(t *testing.T) {
	b := floatData(4<<20, 1)
	e, _ := newEncoder(4 << 20)
	f := e.encode(b, nil)
	ratio := float64(len(b)) / float64(len(f))
	if f[4] != codecZstd || f[5] != 4 || ratio < 1.15 {
		t.Errorf("float chunk: codec %d filter %d ratio %.3f, want zstd, shuffle 4, ≥ 1.15", f[4], f[5], ratio)
	}
}

func floatData(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 2))
	b := make([]byte, n)
	for i := 0; i+4 <= n; i += 4 {
		putF32(b[i:], float32(r.NormFloat64()*0.02))
	}
	return b
}

// benchData is n bytes of one kind: "zeros", "random", "floats" (float32 weights), "mixed"
// (mixedData) or "memhold" (memholdData).
func benchData(kind string, n int) []byte {
	switch kind {
	case "random":
		data := make([]byte, n)
		r := rand.New(rand.NewPCG(1, 1))
		for i := 0; i+8 <= n; i += 8 {
			binary.LittleEndian.PutUint64(data[i:], r.Uint64())
		}
		return data
	case "floats":
		return floatData(n, 3)
	case "mixed":
		return mixedData(n)
	case "memhold":
		return memholdData(n)
	}
	return make([]byte, n)
}

// benchInput writes 64 MiB of one kind (benchData) into a fresh directory.
func benchInput(b *testing.B, kind string) string {
	dir := b.TempDir()
	data := benchData(kind, 64<<20)
	p := filepath.Join(dir, "pages-1.img")
	if err := os.WriteFile(p, data, 0o600); err != nil {
		b.Fatal(err)
	}
	// Flush the input, so the Put's syncs do not also write it back (as in bench-store.sh, whose
	// cp+sync anchor leaves the inputs clean in the page cache).
	f, err := os.Open(p)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		b.Fatal(err)
	}
	return dir
}

// BenchmarkPut measures ingest (read, hash, compress, fsync'd write) of 64 MiB per kind.
// scripts/bench-store.sh measures 1 GiB through the binary, with cp and zstd anchors.
func BenchmarkPut(b *testing.B) {
	for _, kind := range []string{"zeros", "random", "floats"} {
		b.Run(kind, func(b *testing.B) {
			src := benchInput(b, kind)
			b.SetBytes(64 << 20)
			var st *Stats
			for i := 0; b.Loop(); i++ {
				s := openTestStore(b)
				var err error
				if _, st, err = s.Put(context.Background(), src, PutOptions{Name: "b"}); err != nil {
					b.Fatal(err)
				}
			}
			if st.StoredBytes > 0 {
				b.ReportMetric(st.Ratio(), "ratio")
			}
		})
	}
}

// BenchmarkMaterialize measures extraction of 64 MiB per kind.
func BenchmarkMaterialize(b *testing.B) {
	for _, kind := range []string{"zeros", "random", "floats"} {
		b.Run(kind, func(b *testing.B) {
			s := openTestStore(b)
			if _, _, err := s.Put(context.Background(), benchInput(b, kind), PutOptions{Name: "b"}); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(64 << 20)
			for b.Loop() {
				dst := filepath.Join(b.TempDir(), "out")
				if _, err := s.Materialize(context.Background(), "b", dst, GetOptions{}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// mixedData is n bytes alternating, chunk by chunk (DefaultChunkSize), between random and zero
// data: a CRIU pages file of a process with sparse memory.
func mixedData(n int) []byte {
	data := make([]byte, n)
	r := rand.New(rand.NewPCG(2, 2))
	for off := 0; off < n; off += 2 * DefaultChunkSize {
		for i := off; i < min(off+DefaultChunkSize, n); i += 8 {
			v := r.Uint64()
			for k := range 8 {
				data[i+k] = byte(v >> (8 * k))
			}
		}
	}
	return data
}

// BenchmarkIngest measures storing 64 MiB of mixed random and zero chunks streamed through a
// pipe in 64 KiB writes (as CRIU writes an image file), fsync'd commit included.
func BenchmarkIngest(b *testing.B) {
	const n = 64 << 20
	data := mixedData(n)
	b.SetBytes(n)
	var st *Stats
	for b.Loop() {
		s := openTestStore(b)
		in, err := s.NewIngest(context.Background(), PutOptions{Name: "b"})
		if err != nil {
			b.Fatal(err)
		}
		pr, pw := io.Pipe()
		go func() {
			for off := 0; off < n; off += 64 << 10 {
				if _, err := pw.Write(data[off : off+64<<10]); err != nil {
					return
				}
			}
			pw.Close()
		}()
		if _, err := in.AddFile("pages-1.img", 0o600, pr); err != nil {
			b.Fatal(err)
		}
		if _, st, err = in.Commit(nil); err != nil {
			b.Fatal(err)
		}
		in.Close()
	}
	b.ReportMetric(st.Ratio(), "ratio")
}

// BenchmarkWriteFile measures serving the same 64 MiB out of the store into a pipe.
func BenchmarkWriteFile(b *testing.B) {
	const n = 64 << 20
	r := mixedImage(b, n)
	b.SetBytes(n)
	for b.Loop() {
		pr, pw := io.Pipe()
		go func() {
			_, err := r.WriteFile(context.Background(), "pages-1.img", pw)
			pw.CloseWithError(err)
		}()
		if k, err := io.Copy(io.Discard, pr); err != nil || k != n {
			b.Fatalf("%d bytes, %v", k, err)
		}
	}
}

// mixedImage ingests n bytes of mixedData as pages-1.img of a new image and opens it.
func mixedImage(b *testing.B, n int) *ImageReader { return imageOf(b, mixedData(n)) }

// imageOf ingests data as pages-1.img of a new image and opens it.
func imageOf(b *testing.B, data []byte) *ImageReader {
	s := openTestStore(b)
	in, err := s.NewIngest(context.Background(), PutOptions{Name: "b"})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := in.AddFile("pages-1.img", 0o600, bytes.NewReader(data)); err != nil {
		b.Fatal(err)
	}
	if _, _, err := in.Commit(nil); err != nil {
		b.Fatal(err)
	}
	in.Close()
	r, err := s.OpenImage(context.Background(), "b", GetOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(r.Close)
	return r
}

// BenchmarkWriteFilePipe is BenchmarkWriteFile into an OS pipe of 1 MiB read in 1 MiB pieces, as
// CRIU's restore reads its images from ptxmig: zero chunks and chunks stored raw are spliced
// (splice.go), compressed ones copied. The chunk files are in the page cache. Kinds of data:
// "mixed" (random and zero chunks: stored raw and as holes), "floats" (every chunk compressed, with
// the 4-byte shuffle) and "memhold" (random, random, floats, zeros: the CPU process of bench-cr).
func BenchmarkWriteFilePipe(b *testing.B) {
	const n = 64 << 20
	for _, kind := range []string{"mixed", "floats", "memhold"} {
		b.Run(kind, func(b *testing.B) {
			r := imageOf(b, benchData(kind, n))
			buf := make([]byte, 1<<20)
			b.SetBytes(n)
			for b.Loop() {
				serveIntoPipe(b, r, buf, n)
			}
			st := r.Stats()
			b.ReportMetric(float64(st.SplicedBytes)/float64(st.WrittenBytes), "spliced/written")
		})
	}
}

// memholdData is what bench-cr's CPU process (memhold) holds: 4 MiB blocks of random bytes,
// random bytes, float32 weights and zeros, in turn.
func memholdData(n int) []byte {
	data := make([]byte, n)
	random := mixedData(DefaultChunkSize)
	for off := 0; off < n; off += DefaultChunkSize {
		blk := data[off:min(off+DefaultChunkSize, n)]
		switch (off / DefaultChunkSize) % 4 {
		case 0, 1:
			copy(blk, random)
			binary.LittleEndian.PutUint64(blk, uint64(off)) // distinct chunks, no dedup
		case 2:
			copy(blk, floatData(len(blk), uint64(off)))
		}
	}
	return data
}

// serveIntoPipe serves pages-1.img of r, n bytes, into an OS pipe of 1 MiB read in pieces of
// len(buf), as CRIU's restore reads its images from ptxmig.
func serveIntoPipe(b *testing.B, r *ImageReader, buf []byte, n int64) {
	pr, pw, err := os.Pipe()
	if err != nil {
		b.Fatal(err)
	}
	_, _ = unix.FcntlInt(pw.Fd(), unix.F_SETPIPE_SZ, 1<<20)
	werr := make(chan error, 1)
	go func() {
		_, err := r.WriteFile(context.Background(), "pages-1.img", pw)
		pw.Close()
		werr <- err
	}()
	var k int64
	for {
		m, err := pr.Read(buf)
		k += int64(m)
		if err != nil {
			break
		}
	}
	pr.Close()
	if err := <-werr; err != nil || k != n {
		b.Fatalf("%d bytes, %v", k, err)
	}
}

// BenchmarkChunkCost prices one 4 MiB chunk by kind of data, to show where compression pays:
// hashing alone (the floor: every chunk is hashed, a raw one is then written as is), the
// encoder's sampled choice (what the store does: raw when the sample does not compress, else
// zstd with the best shuffle), and zstd on everything. The "ratio" metric is raw/stored bytes.
func BenchmarkChunkCost(b *testing.B) {
	const n = 4 << 20
	random := make([]byte, n)
	r := rand.New(rand.NewPCG(7, 7))
	for i := range random {
		random[i] = byte(r.Uint32())
	}
	var text bytes.Buffer
	for i := 0; text.Len() < n; i++ {
		fmt.Fprintf(&text, "2026-11-25T07:%02d:%02d step %d loss %.6f lr %.2e\n", i/60%60, i%60, i, 2.5/float64(i+1), 3e-4)
	}
	kinds := []struct {
		name string
		data []byte
	}{{"random", random}, {"floats", floatData(n, 5)}, {"text", text.Bytes()[:n]}}
	for _, k := range kinds {
		b.Run(k.name+"/hash", func(b *testing.B) {
			b.SetBytes(n)
			for b.Loop() {
				HashChunk(k.data)
			}
		})
		b.Run(k.name+"/store-choice", func(b *testing.B) {
			e, _ := newEncoder(n)
			var out []byte
			b.SetBytes(n)
			for b.Loop() {
				HashChunk(k.data)
				out = e.encode(k.data, out)
			}
			b.ReportMetric(float64(n)/float64(len(out)), "ratio")
		})
		b.Run(k.name+"/zstd-always", func(b *testing.B) {
			e, _ := newEncoder(n)
			var out []byte
			b.SetBytes(n)
			for b.Loop() {
				HashChunk(k.data)
				out = e.zw.EncodeAll(k.data, out[:0])
			}
			b.ReportMetric(float64(n)/float64(len(out)), "ratio")
		})
	}
}

// diskBenchMiB is the size of the disk benchmarks' image (PTXMIG_BENCH_MIB, default 256): large
// enough to exceed what the disk absorbs in its cache when set to several GiB on a real host.
func diskBenchMiB(b *testing.B) int {
	n := 256
	if v := os.Getenv("PTXMIG_BENCH_MIB"); v != "" {
		if _, err := fmt.Sscan(v, &n); err != nil || n <= 0 {
			b.Fatalf("PTXMIG_BENCH_MIB=%q: want a positive number of MiB", v)
		}
	}
	return n
}

// uniqueRandomReader serves n bytes of incompressible data whose every chunk is distinct (a
// 64 MiB random block reused, each chunk's first 8 bytes replaced by its number), as CRIU streams
// the pages of device memory the driver copied out: nothing to compress, nothing to deduplicate.
type uniqueRandomReader struct {
	src      []byte
	off, n   int64
	chunkLen int64
}

func newUniqueRandomReader(n int64) *uniqueRandomReader {
	src := make([]byte, 64<<20)
	r := rand.New(rand.NewPCG(9, 9))
	for i := 0; i < len(src); i += 8 {
		v := r.Uint64()
		for k := range 8 {
			src[i+k] = byte(v >> (8 * k))
		}
	}
	return &uniqueRandomReader{src: src, n: n, chunkLen: DefaultChunkSize}
}

func (u *uniqueRandomReader) Read(p []byte) (int, error) {
	if u.off >= u.n {
		return 0, io.EOF
	}
	p = p[:min(int64(len(p)), u.n-u.off, 1<<20)]
	k := copy(p, u.src[u.off%int64(len(u.src)):])
	for c := (u.off + u.chunkLen - 1) / u.chunkLen * u.chunkLen; c < u.off+int64(k); c += u.chunkLen {
		if at := c - u.off; at+8 <= int64(k) {
			for i := range 8 {
				p[at+int64(i)] = byte(c >> (8 * i))
			}
		}
	}
	u.off += int64(k)
	return k, nil
}

// diskBenchOptions are the store's options for the disk benchmarks: PTXMIG_BENCH_WORKERS and
// PTXMIG_BENCH_CHUNK_MIB override the defaults (one worker per CPU, 4 MiB chunks).
func diskBenchOptions(b *testing.B) PutOptions {
	o := PutOptions{Name: "b"}
	for _, v := range []struct {
		env string
		to  *int
		mul int
	}{{"PTXMIG_BENCH_WORKERS", &o.Workers, 1}, {"PTXMIG_BENCH_CHUNK_MIB", &o.ChunkSize, 1 << 20}} {
		if s := os.Getenv(v.env); s != "" {
			var n int
			if _, err := fmt.Sscan(s, &n); err != nil || n <= 0 {
				b.Fatalf("%s=%q: want a positive number", v.env, s)
			}
			*v.to = n * v.mul
		}
	}
	if o.ChunkSize > 0 {
		o.MemoryLimit = int64(o.ChunkSize) * 8 * int64(max(o.Workers, runtime.NumCPU()))
	}
	return o
}

// BenchmarkIngestDisk streams PTXMIG_BENCH_MIB of incompressible, distinct chunks into a new
// image on the disk holding $TMPDIR, through an OS pipe written in 1 MiB pieces (as CRIU's
// streamed dump does), durable commit included. It measures what the store's write path gets out
// of the disk, to set against `dd oflag=direct` and plain CRIU writing into the page cache.
func BenchmarkIngestDisk(b *testing.B) {
	n := int64(diskBenchMiB(b)) << 20
	b.SetBytes(n)
	for b.Loop() {
		b.StopTimer()
		s := openTestStore(b)
		src := newUniqueRandomReader(n)
		o := diskBenchOptions(b)
		if o.ChunkSize > 0 {
			src.chunkLen = int64(o.ChunkSize)
		}
		b.StartTimer()
		in, err := s.NewIngest(context.Background(), o)
		if err != nil {
			b.Fatal(err)
		}
		pr, pw, err := os.Pipe()
		if err != nil {
			b.Fatal(err)
		}
		_, _ = unix.FcntlInt(pw.Fd(), unix.F_SETPIPE_SZ, 1<<20)
		go func() {
			_, _ = io.CopyBuffer(pw, src, make([]byte, 1<<20))
			pw.Close()
		}()
		if _, err := in.AddFile("pages-1.img", 0o600, pr); err != nil {
			b.Fatal(err)
		}
		pr.Close()
		_, st, err := in.Commit(nil)
		if err != nil {
			b.Fatal(err)
		}
		in.Close()
		b.StopTimer()
		b.ReportMetric(st.Ratio(), "ratio")
		os.RemoveAll(s.Dir())
		b.StartTimer()
	}
}

// BenchmarkWriteFileDisk serves the image of BenchmarkIngestDisk into an OS pipe read in 1 MiB
// pieces, as CRIU's streamed restore reads it. With PTXMIG_BENCH_DROP_CACHES=1 (root) the page
// cache is dropped before each run, so the chunks come from the disk, as in bench-cr's restores.
func BenchmarkWriteFileDisk(b *testing.B) {
	n := int64(diskBenchMiB(b)) << 20
	s := openTestStore(b)
	in, err := s.NewIngest(context.Background(), PutOptions{Name: "b"})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := in.AddFile("pages-1.img", 0o600, newUniqueRandomReader(n)); err != nil {
		b.Fatal(err)
	}
	if _, _, err := in.Commit(nil); err != nil {
		b.Fatal(err)
	}
	in.Close()
	drop := os.Getenv("PTXMIG_BENCH_DROP_CACHES") == "1"
	if !drop {
		b.Log("page cache kept (PTXMIG_BENCH_DROP_CACHES=1 drops it before each run)")
	}
	buf := make([]byte, 1<<20)
	b.SetBytes(n)
	for b.Loop() {
		if drop {
			b.StopTimer()
			unix.Sync()
			if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0); err != nil {
				b.Fatalf("drop caches: %v", err)
			}
			b.StartTimer()
		}
		r, err := s.OpenImage(context.Background(), "b", GetOptions{})
		if err != nil {
			b.Fatal(err)
		}
		serveIntoPipe(b, r, buf, n)
		r.Close()
	}
}
