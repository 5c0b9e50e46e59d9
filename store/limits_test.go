package store

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
)

var bigZeros = make([]byte, 64<<20) // never written: the content of zstd bombs

// zstdFrame compresses data into one frame, stating its content size when sized (else the
// header is rewritten without it, with a window of the frame's content rounded up).
func zstdFrame(t testing.TB, data []byte, sized bool) []byte {
	t.Helper()
	zw, err := zstd.NewWriter(nil, zstd.WithEncoderCRC(false), zstd.WithWindowSize(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	f := zw.EncodeAll(data, nil)
	if sized {
		return f
	}
	var h zstd.Header
	if err := h.Decode(f); err != nil {
		t.Fatal(err)
	}
	log := 10
	for 1<<log < min(len(data), 1<<20) {
		log++
	}
	out := append([]byte{0x28, 0xb5, 0x2f, 0xfd, 0, byte(log-10) << 3}, f[h.HeaderSize:]...)
	if err := h.Decode(out); err != nil || h.HasFCS {
		t.Fatalf("unsized frame: %v", err)
	}
	return out
}

// rleFrame hand-makes a zstd bomb: a frame of blocks RLE blocks of blockSize bytes each (4
// bytes apiece), stating fcs as its content size (single segment) or, when fcs < 0, nothing,
// with a window of blockSize.
func rleFrame(fcs, blocks, blockSize int) []byte {
	f := []byte{0x28, 0xb5, 0x2f, 0xfd}
	if fcs >= 0 {
		f = binary.LittleEndian.AppendUint32(append(f, 0xa0), uint32(fcs))
	} else {
		log := 10
		for 1<<log < blockSize {
			log++
		}
		f = append(f, 0, byte(log-10)<<3)
	}
	for i := range blocks {
		h := uint32(1<<1 | blockSize<<3)
		if i == blocks-1 {
			h |= 1
		}
		f = append(f, byte(h), byte(h>>8), byte(h>>16), 0)
	}
	return f
}

// chunkFile builds a chunk file: header (codec, filter, stated length) and payload.
func chunkFile(codec, filter byte, n int, payload []byte) []byte {
	h := make([]byte, chunkHeaderLen, chunkHeaderLen+len(payload))
	copy(h, chunkMagic)
	h[4], h[5] = codec, filter
	binary.LittleEndian.PutUint32(h[8:], uint32(n))
	return append(h, payload...)
}

// TestChunkDecodeBombs feeds the bounded decoder chunk files that lie about their size or do not
// decode: each is refused with ErrCorrupt saying what is wrong, without allocating beyond the
// worker's fixed buffers.
func TestChunkDecodeBombs(t *testing.T) {
	const size = 4096
	data := bytes.Repeat([]byte("ptxmig "), size/7+1)[:size]
	id := HashChunk(data)
	good := zstdFrame(t, data, true)
	tests := []struct {
		name     string
		file     []byte
		size     int // the chunk's size in the manifest
		maxChunk int
		want     string
	}{
		{"ok-zstd", chunkFile(codecZstd, 0, size, good), size, size, ""},
		{"ok-raw", chunkFile(codecRaw, 0, size, data), size, size, ""},
		{"ok-unsized", chunkFile(codecZstd, 0, size, zstdFrame(t, data, false)), size, size, ""},
		{"header-claims-more", chunkFile(codecZstd, 0, 64<<20, zstdFrame(t, bigZeros, true)), size, 64 << 20, "header says 67108864 bytes, the manifest 4096"},
		{"frame-claims-more", chunkFile(codecZstd, 0, size, rleFrame(64<<20, 512, 128<<10)), size, size, "zstd frame declares 67108864 bytes, the chunk 4096: refused before decompressing"},
		{"unsized-bomb", chunkFile(codecZstd, 0, size, rleFrame(-1, 1000, 128<<10)), size, size, "decompresses to more than the 4096 bytes it declares"},
		{"unsized-bomb-shuffled", chunkFile(codecZstd, 4, size, rleFrame(-1, 1000, 128<<10)), size, size, "decompresses to more than the 4096 bytes it declares"},
		{"sized-frame-overruns", chunkFile(codecZstd, 0, size, rleFrame(size, 1000, size)), size, size, "decompresses to more than the 4096 bytes it declares"},
		{"window-too-large", chunkFile(codecZstd, 0, size, zstdFrame(t, bigZeros[:4<<20], false)), size, size, "asks for a window"},
		{"unsized-large", chunkFile(codecZstd, 0, 1<<20, zstdFrame(t, bigZeros[:1<<20], false)), 1 << 20, 1 << 20, "zstd frame without a content size for 1048576 bytes"},
		{"second-frame-bomb", chunkFile(codecZstd, 0, size, append(bytes.Clone(good), rleFrame(64<<20, 512, 128<<10)...)), size, size, "decompresses to more than the 4096 bytes it declares"},
		{"second-frame-unsized-bomb", chunkFile(codecZstd, 0, size, append(bytes.Clone(good), rleFrame(-1, 900, 128<<10)...)), size, size, "decompresses to more than the 4096 bytes it declares"},
		{"payload-larger-than-data", chunkFile(codecZstd, 0, 8, append(zstdFrame(t, data[:8], true), make([]byte, 16)...)), 8, size, "compressed payload of"},
		{"short-output", chunkFile(codecZstd, 0, size, zstdFrame(t, data[:100], false)), size, size, "decompresses to 100 bytes, header says 4096"},
		{"truncated-frame", chunkFile(codecZstd, 0, size, good[:len(good)/2]), size, size, "zstd:"},
		{"garbage-frame", chunkFile(codecZstd, 0, size, bytes.Repeat([]byte{0xa5}, 100)), size, size, "not a plain zstd frame"},
		{"skippable-frame", chunkFile(codecZstd, 0, size, []byte{0x50, 0x2a, 0x4d, 0x18, 4, 0, 0, 0, 1, 2, 3, 4}), size, size, "not a plain zstd frame"},
		{"other-content", chunkFile(codecZstd, 0, size, zstdFrame(t, bigZeros[:size], true)), size, size, "content hashes to"},
		{"raw-short", chunkFile(codecRaw, 0, size, data[:size-1]), size, size, "raw payload of 4095 bytes"},
		{"raw-filtered", chunkFile(codecRaw, 2, size, data), size, size, "raw payload"},
		{"unknown-codec", chunkFile(7, 0, size, good), size, size, "unknown codec 7"},
		{"unknown-filter", chunkFile(codecZstd, 3, size, good), size, size, "unknown filter 3"},
		{"bad-magic", append([]byte("PXC2"), chunkFile(codecZstd, 0, size, good)[4:]...), size, size, "bad header"},
		{"reserved-bits", func() []byte { f := chunkFile(codecZstd, 0, size, good); f[6] = 1; return f }(), size, size, "bad header"},
		{"short-header", []byte("PXC1"), size, size, "bad header"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d, err := newChunkDecoder(1, tt.maxChunk)
			if err != nil {
				t.Fatal(err)
			}
			defer d.close()
			var bufs chunkBufs
			// Warm up: the worker's buffers and the decoder's block buffers exist before measuring.
			d.decode(chunkFile(codecZstd, 4, size, zstdFrame(t, shuffle(nil, data, 4), true)), id, size, &bufs)
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			start := time.Now()
			raw, err := d.decode(tt.file, id, tt.size, &bufs)
			elapsed := time.Since(start)
			runtime.ReadMemStats(&after)
			if tt.want == "" {
				if err != nil || !bytes.Equal(raw, data) {
					t.Fatalf("decode: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("decode: %v\nwant ErrCorrupt saying %q", err, tt.want)
			}
			// At most one growth of a buffer by a frame that overruns it: bounded by the chunk's
			// size, whatever the bomb's.
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 4*uint64(tt.size+decodeSlack) {
				t.Errorf("refusing it allocated %d bytes", alloc)
			}
			if elapsed > 2*time.Second {
				t.Errorf("refusing it took %v", elapsed)
			}
		})
	}
}

// streamChunk is one chunk record of a hand-made export stream.
type streamChunk struct {
	id   ChunkID
	file []byte
}

// makeStream assembles an export stream: the manifest (sealed, so only the limits can refuse
// it), the chunk records and the end record.
func makeStream(t testing.TB, m *Manifest, chunks []streamChunk) []byte {
	t.Helper()
	raw, id, err := EncodeManifest(m)
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	b.WriteString(exportMagic)
	writeRecord(&b, recManifest, raw)
	for _, c := range chunks {
		writeRecordParts(&b, recChunk, c.id[:], c.file)
	}
	end := make([]byte, 8, 40)
	binary.LittleEndian.PutUint64(end, uint64(len(chunks)))
	idb, _ := ParseChunkID(id)
	writeRecord(&b, recEnd, append(end, idb[:]...))
	return b.Bytes()
}

// bombImage is an image of n one-chunk files of size bytes whose chunk files are made by file
// (the chunk's index, its id): chunk ids are distinct, contents arbitrary.
func bombImage(t testing.TB, n, size, chunkSize int, file func(i int) []byte) []byte {
	m := &Manifest{FormatVersion: FormatVersion, Name: "bomb", Hash: HashAlgorithm, ChunkSize: chunkSize, Created: time.Unix(1e9, 0)}
	var chunks []streamChunk
	for i := range n {
		id := HashChunk([]byte(strconv.Itoa(i)))
		m.Files = append(m.Files, File{Path: fmt.Sprintf("pages-%05d.img", i), Type: TypeFile, Mode: 0o600, Size: int64(size),
			Chunks: []Chunk{{Size: size, Hash: id}}})
		chunks = append(chunks, streamChunk{id, file(i)})
	}
	return makeStream(t, m, chunks)
}

// bigChunkImage is a valid image of n files of one chunk of size bytes each: zeros after an
// 8-byte index, so the stream is small and every chunk decompresses to its full size.
func bigChunkImage(t testing.TB, n, size int) []byte {
	m := &Manifest{FormatVersion: FormatVersion, Name: "big", Hash: HashAlgorithm, ChunkSize: size, Created: time.Unix(1e9, 0)}
	zw, err := zstd.NewWriter(nil, zstd.WithEncoderCRC(false), zstd.WithWindowSize(windowFor(size)))
	if err != nil {
		t.Fatal(err)
	}
	data := make([]byte, size)
	var chunks []streamChunk
	for i := range n {
		binary.LittleEndian.PutUint64(data, uint64(i)+1)
		id := HashChunk(data)
		m.Files = append(m.Files, File{Path: fmt.Sprintf("pages-%05d.img", i), Type: TypeFile, Mode: 0o600, Size: int64(size),
			Chunks: []Chunk{{Size: size, Hash: id}}})
		chunks = append(chunks, streamChunk{id, chunkFile(codecZstd, 0, size, zw.EncodeAll(data, nil))})
	}
	return makeStream(t, m, chunks)
}

// TestImportHostileStreams: crafted, truncated and garbled export streams are each refused with
// a clear message, leave nothing behind and do not hang.
func TestImportHostileStreams(t *testing.T) {
	const small, medium = MinChunkSize, 16 << 10
	sizedBomb := zstdFrame(t, bigZeros, true)  // 7 KiB
	unsizedBomb := rleFrame(-1, 4000, 128<<10) // 16 KiB → 500 MiB
	bombs := bombImage(t, 32, small, small, func(int) []byte { return chunkFile(codecZstd, 0, 64<<20, sizedBomb) })
	t.Logf("the issue's zstd bomb stream: %d bytes, 32 chunks each stating 64 MiB", len(bombs))

	// A real image and its stream, to damage.
	a := openTestStore(t)
	src := t.TempDir()
	writeRandom(t, filepath.Join(src, "pages-1.img"), 3*testChunk, 5)
	os.WriteFile(filepath.Join(src, "text"), bytes.Repeat([]byte("abc"), 30000), 0o644)
	m, _, err := a.Put(context.Background(), src, PutOptions{Name: "x", ChunkSize: testChunk})
	if err != nil {
		t.Fatal(err)
	}
	var exp bytes.Buffer
	if err := a.Export(context.Background(), "x", &exp); err != nil {
		t.Fatal(err)
	}
	good := exp.Bytes()
	mlen := int(binary.LittleEndian.Uint64(good[9:17]))
	firstChunk := len(exportMagic) + recHeaderLen + mlen // offset of the first chunk record
	clen := int(binary.LittleEndian.Uint64(good[firstChunk+1:]))
	secondChunk := firstChunk + recHeaderLen + clen
	endRec := len(good) - recHeaderLen - 40
	patch := func(off int, v uint64) []byte {
		b := bytes.Clone(good)
		binary.LittleEndian.PutUint64(b[off:], v)
		return b
	}
	splice := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	tamper := bytes.Replace(good, []byte(`"path":"text","type":"file","mode":420`), []byte(`"path":"text","type":"file","mode":493`), 1)

	tests := []struct {
		name string
		data []byte
		opts ImportOptions
		want error
		msg  string
	}{
		{"size-bombs", bombs, ImportOptions{Workers: 32}, ErrCorrupt, "record of 7180 bytes for a chunk of 4096 bytes: refused before reading it"},
		{"size-bombs-16KiB", bombImage(t, 32, medium, medium, func(int) []byte { return chunkFile(codecZstd, 0, 64<<20, sizedBomb) }), ImportOptions{Workers: 32}, ErrCorrupt, "header says 67108864 bytes, the manifest 16384"},
		{"frame-bombs", bombImage(t, 32, medium, medium, func(int) []byte { return chunkFile(codecZstd, 0, medium, sizedBomb) }), ImportOptions{Workers: 32}, ErrCorrupt, "zstd frame declares 67108864 bytes, the chunk 16384"},
		{"unsized-bombs", bombImage(t, 32, medium, medium, func(int) []byte { return chunkFile(codecZstd, 0, medium, unsizedBomb) }), ImportOptions{Workers: 32}, ErrCorrupt, "decompresses to more than the 16384 bytes"},
		{"record-longer-than-chunk", bombImage(t, 1, small, small, func(int) []byte { return chunkFile(codecRaw, 0, small, make([]byte, small+1)) }), ImportOptions{}, ErrCorrupt, "record of 4109 bytes for a chunk of 4096 bytes: refused before reading it"},
		{"record-states-64MiB-then-ends", splice(good[:firstChunk], []byte{recChunk}, binary.LittleEndian.AppendUint64(nil, 32+chunkHeaderLen+MaxChunkSize), good[firstChunk+recHeaderLen:firstChunk+recHeaderLen+32]), ImportOptions{}, ErrCorrupt, "refused before reading it"},
		{"record-longer-than-any-chunk", patch(firstChunk+1, 1<<40), ImportOptions{}, ErrBadStream, "chunk record of 1099511627776 bytes"},
		{"manifest-record-huge", patch(9, 1<<30), ImportOptions{}, ErrBadStream, "manifest record of 1073741824 bytes exceeds the limit"},
		{"manifest-truncated", good[:100], ImportOptions{}, ErrBadStream, "truncated record"},
		{"manifest-edited", tamper, ImportOptions{}, ErrCorrupt, `files["text"].mode`},
		{"first-record-not-manifest", splice(good[:8], []byte{recChunk}, good[9:]), ImportOptions{}, ErrBadStream, "want a manifest"},
		{"chunk-not-in-image", splice(good[:firstChunk+recHeaderLen], bytes.Repeat([]byte{7}, 32), good[firstChunk+recHeaderLen+32:]), ImportOptions{}, ErrBadStream, "is not part of image x"},
		{"chunk-twice", splice(good[:secondChunk], good[firstChunk:secondChunk], good[secondChunk:]), ImportOptions{}, ErrBadStream, "sent twice"},
		{"chunk-missing", splice(good[:firstChunk], good[secondChunk:endRec], func() []byte {
			e := bytes.Clone(good[endRec:])
			binary.LittleEndian.PutUint64(e[recHeaderLen:], binary.LittleEndian.Uint64(e[recHeaderLen:])-1)
			return e
		}()), ImportOptions{}, ErrBadStream, "neither in the stream nor in the store"},
		{"chunk-truncated", good[:secondChunk-10], ImportOptions{}, ErrBadStream, "truncated record"},
		{"chunk-garbled", func() []byte { b := bytes.Clone(good); b[secondChunk-100] ^= 0x10; return b }(), ImportOptions{}, ErrCorrupt, "chunk"},
		{"unknown-record", splice(good[:endRec], []byte{'Z'}, good[endRec+1:]), ImportOptions{}, ErrBadStream, "unknown record type 'Z'"},
		{"end-count", patch(endRec+recHeaderLen, 99), ImportOptions{}, ErrBadStream, "end record counts 99 chunks"},
		{"end-length", patch(endRec+1, 41), ImportOptions{}, ErrBadStream, "end record of 41 bytes"},
		{"no-end", good[:endRec], ImportOptions{}, ErrBadStream, "truncated (no end record)"},
		{"trailing-data", append(bytes.Clone(good), 0), ImportOptions{}, ErrBadStream, "data after the end record"},
		{"memory-limit", bigChunkImage(t, 1, 64<<20), ImportOptions{MemoryLimit: 64 << 20}, ErrMemoryLimit, "for one worker (chunks of up to 64.0 MiB)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := openTestStore(t)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			done := make(chan error, 1)
			go func() {
				_, _, err := b.ImportWith(ctx, bytes.NewReader(tt.data), tt.opts)
				done <- err
			}()
			var err error
			select {
			case err = <-done:
			case <-time.After(40 * time.Second):
				t.Fatal("import hangs")
			}
			if !errors.Is(err, tt.want) || !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("import: %v\nwant %v saying %q", err, tt.want, tt.msg)
			}
			if ms, _ := b.List(); len(ms) != 0 {
				t.Fatalf("a refused stream left an image")
			}
			if _, err := b.GC(context.Background()); err != nil {
				t.Fatal(err)
			}
			assertNoGarbage(t, b)
		})
	}
	if n := len(m.ChunkIDs()); n < 3 {
		t.Fatalf("test image has %d chunks", n)
	}
}

// TestImportGarbledStreams flips bytes all over a real export stream and cuts it at many
// lengths: every damaged stream is refused with a sentinel error (or, where a flip changes
// nothing the image depends on, imports the very same image), and none hangs.
func TestImportGarbledStreams(t *testing.T) {
	ctx := context.Background()
	a := openTestStore(t)
	src := t.TempDir()
	writeRandom(t, filepath.Join(src, "pages-1.img"), 2*testChunk+100, 9)
	os.WriteFile(filepath.Join(src, "text"), bytes.Repeat([]byte("ptxmig "), 20000), 0o644)
	m, _, err := a.Put(ctx, src, PutOptions{Name: "x", ChunkSize: testChunk})
	if err != nil {
		t.Fatal(err)
	}
	var exp bytes.Buffer
	if err := a.Export(ctx, "x", &exp); err != nil {
		t.Fatal(err)
	}
	good := exp.Bytes()
	r := rand.New(rand.NewPCG(3, 4))
	var cases [][]byte
	for range 150 {
		b := bytes.Clone(good)
		b[r.IntN(len(b))] ^= byte(1 << r.IntN(8))
		cases = append(cases, b)
	}
	for range 50 {
		cases = append(cases, good[:r.IntN(len(good))])
	}
	refused := 0
	for i, data := range cases {
		b := openTestStore(t)
		cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		got, err := b.Import(cctx, bytes.NewReader(data))
		cancel()
		switch {
		case err == nil:
			if got.ID != m.ID {
				t.Fatalf("case %d: a damaged stream imported as image %s", i, got.ID)
			}
			if r, err := b.Verify(ctx, "x"); err != nil || !r.OK() {
				t.Fatalf("case %d: imported image does not verify: %v", i, err)
			}
		case errors.Is(err, ErrBadStream) || errors.Is(err, ErrCorrupt) || errors.Is(err, ErrUnsupportedVersion):
			refused++
		default:
			t.Fatalf("case %d: import: %v (no sentinel)", i, err)
		}
	}
	t.Logf("%d of %d damaged streams refused, the rest imported the same image", refused, len(cases))
}

// Memory measurements run in a child process (this test binary, re-run with memChildEnv set)
// so that its peak resident set (VmHWM) is the import's alone.
const memChildEnv = "PTXMIG_STORE_MEM_CHILD"

// TestMemoryChild is the child's body; it does nothing unless memChildEnv is set. Arguments:
// "import|STREAM|WORKERS|LIMIT" or "materialize|STORE|WORKERS|LIMIT".
func TestMemoryChild(t *testing.T) {
	arg := os.Getenv(memChildEnv)
	if arg == "" {
		return
	}
	parts := strings.Split(arg, "|")
	workers, _ := strconv.Atoi(parts[2])
	limit, _ := strconv.ParseInt(parts[3], 10, 64)
	ctx := context.Background()
	var err error
	switch parts[0] {
	case "import":
		var f *os.File
		if f, err = os.Open(parts[1]); err == nil {
			var s *Store
			if s, err = Open(filepath.Join(t.TempDir(), "store")); err == nil {
				_, _, err = s.ImportWith(ctx, f, ImportOptions{Workers: workers, MemoryLimit: limit})
			}
		}
	case "materialize":
		var s *Store
		if s, err = Open(parts[1]); err == nil {
			_, err = s.Materialize(ctx, "big", filepath.Join(t.TempDir(), "dst"), GetOptions{Workers: workers, MemoryLimit: limit})
		}
	}
	fmt.Printf("\nMEMCHILD hwm_kib=%d err=%v\n", vmHWM(t), err)
}

// vmHWM is this process's peak resident set in KiB.
func vmHWM(t testing.TB) int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmHWM:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return n
		}
	}
	t.Fatal("no VmHWM in /proc/self/status")
	return 0
}

// runMemChild runs the child and returns its peak resident set (bytes) and error text.
func runMemChild(t *testing.T, arg string) (int64, string) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe, "-test.run=^TestMemoryChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), memChildEnv+"="+arg)
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("child %s hangs", arg)
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "MEMCHILD hwm_kib="); ok {
			kib, errText, _ := strings.Cut(rest, " err=")
			n, _ := strconv.ParseInt(kib, 10, 64)
			return n << 10, errText
		}
	}
	t.Fatalf("child %s: %v\n%s", arg, err, out)
	return 0, ""
}

// TestImportMemoryBound measures the peak resident set of imports of hostile streams in a child
// process, asking for 64 workers: it stays under the memory limit (default 512 MiB) whatever the
// worker count. Before the limits, the zstd bomb stream drove a 32-worker import to 2.0 GiB.
func TestImportMemoryBound(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: memory measurement skipped")
	}
	dir := t.TempDir()
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	sizedBomb := zstdFrame(t, bigZeros, true)
	streams := map[string]string{
		// The stream: 32 chunks of 4 KiB whose headers state 64 MiB.
		"size-bombs": write("size-bombs", bombImage(t, 32, MinChunkSize, MinChunkSize, func(int) []byte { return chunkFile(codecZstd, 0, 64<<20, sizedBomb) })),
		// Chunks the manifest says are 64 MiB, decompressing to 64 MiB of the wrong content.
		"hash-bombs": write("hash-bombs", bombImage(t, 64, 64<<20, 64<<20, func(int) []byte { return chunkFile(codecZstd, 0, 64<<20, sizedBomb) })),
		// A valid image of 24 chunks of 64 MiB (1.5 GiB), every one decompressing in full.
		"big-64MiB": write("big-64MiB", bigChunkImage(t, 24, 64<<20)),
		// A valid image of 64 chunks of 8 MiB, under a 160 MiB limit: several workers fit.
		"big-8MiB": write("big-8MiB", bigChunkImage(t, 64, 8<<20)),
	}
	for name, p := range streams {
		fi, _ := os.Stat(p)
		t.Logf("%s: stream of %d bytes", name, fi.Size())
	}
	tests := []struct {
		stream  string
		workers int
		limit   int64
		wantErr string
	}{
		{"size-bombs", 64, 0, "record of 7180 bytes for a chunk of 4096 bytes: refused before reading it"},
		{"hash-bombs", 64, 0, "content hashes to"},
		{"big-64MiB", 64, 0, ""},
		{"big-64MiB", 1, 0, ""},
		{"big-8MiB", 64, 160 << 20, ""},
	}
	for _, tt := range tests {
		limit := tt.limit
		if limit == 0 {
			limit = DefaultMemoryLimit
		}
		hwm, errText := runMemChild(t, fmt.Sprintf("import|%s|%d|%d", streams[tt.stream], tt.workers, tt.limit))
		t.Logf("import %s, %d workers asked, limit %d MiB: peak RSS %d MiB (%s)", tt.stream, tt.workers, limit>>20, hwm>>20, errText)
		if tt.wantErr == "" && errText != "<nil>" || tt.wantErr != "" && !strings.Contains(errText, tt.wantErr) {
			t.Errorf("import %s: %s, want %q", tt.stream, errText, tt.wantErr)
		}
		if hwm > limit {
			t.Errorf("import %s with %d workers: peak RSS %d MiB exceeds the %d MiB limit", tt.stream, tt.workers, hwm>>20, limit>>20)
		}
	}

	// Materialize (what restore does) of the 64 MiB-chunk image, same bound.
	store := filepath.Join(dir, "store")
	s, err := Open(store)
	if err != nil {
		t.Fatal(err)
	}
	f, _ := os.Open(streams["big-64MiB"])
	defer f.Close()
	if _, err := s.Import(context.Background(), f); err != nil {
		t.Fatal(err)
	}
	for _, workers := range []int{1, 64} {
		hwm, errText := runMemChild(t, fmt.Sprintf("materialize|%s|%d|0", store, workers))
		t.Logf("materialize big-64MiB, %d workers asked: peak RSS %d MiB (%s)", workers, hwm>>20, errText)
		if errText != "<nil>" || hwm > DefaultMemoryLimit {
			t.Errorf("materialize with %d workers: peak RSS %d MiB, err %s", workers, hwm>>20, errText)
		}
	}
}
