package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"

	"github.com/klauspost/compress/zstd"

	"github.com/ptxmig/ptxmig/internal/bytesize"
)

// Reading an image (import, materialize, verify, export) treats its manifest and chunk files as
// untrusted: an export stream comes from elsewhere, and a store's files can be edited. What that
// costs is bounded before it is spent (docs/FORMAT.md "Limits"):
//
//   - a manifest is at most maxManifestBytes, and its decoded form is charged to the memory
//     limit (manifestMem);
//   - a chunk file must not be longer than its header plus the size the manifest gives the chunk
//     (checked before it is read), and its header must state that size;
//   - a zstd frame must state the chunk's size as its content size (frames of chunks up to
//     maxUnsizedFrame may state none) and is decompressed into a buffer of that size plus one
//     block, with the decoder limited to the buffer's capacity, so a bomb stops within a block;
//   - every worker owns fixed buffers sized for the image's largest chunk, allocated once;
//   - the memory limit (default DefaultMemoryLimit) caps the manifest plus workers × one worker's
//     buffers (readWorkerMem), whatever worker count is asked for.
const (
	// decodeSlack is the room after a chunk's size in decode buffers: one zstd block plus the
	// decoder's over-allocation, so a frame that overruns its stated size is stopped (the decoder
	// checks after each block) before the buffer would have to grow.
	decodeSlack = 128<<10 + 64
	// maxUnsizedFrame: zstd frames that state no content size are accepted only for chunks this
	// small. Writers state it for every chunk of 256 bytes or more.
	maxUnsizedFrame = 128 << 10
	// readFixedMem covers a reader's fixed costs: stream buffer, decoder tables, runtime slack.
	readFixedMem = 8 << 20
)

// readWorkerMem is one reading worker's memory for chunks of up to maxChunk bytes: the chunk
// file, the decoded bytes and the unshuffle buffer, room for one growth of a buffer that a
// hostile frame without a content size overruns, and the zstd block decoder's own buffers.
func readWorkerMem(maxChunk int) int64 {
	return getWorkerMem(maxChunk) + int64(maxChunk) + chunkHeaderLen + 3*decodeSlack
}

// manifestMem estimates the memory a decoded manifest occupies (rawLen: its encoded size when
// the bytes are held too, as import does, else 0), including the per-chunk maps readers build.
func manifestMem(m *Manifest, rawLen int) int64 {
	n := int64(rawLen) + 4<<10
	for i := range m.Files {
		f := &m.Files[i]
		n += int64(unsafe.Sizeof(File{})) + int64(len(f.Path)+len(f.Target))
		// The chunk entries, and up to two map entries per chunk (needed/got, uses).
		n += int64(len(f.Chunks)) * (int64(unsafe.Sizeof(Chunk{})) + 2*96)
	}
	// The metadata is held as its encoding; a reader decoding it (internal/imagedesc) holds it
	// decoded for a while too.
	n += 3 * int64(len(m.Meta))
	return n
}

// maxChunkOf returns the size of the image's largest stored chunk (at least 1).
func maxChunkOf(m *Manifest) int {
	mx := 1
	for i := range m.Files {
		for _, c := range m.Files[i].Chunks {
			if !c.Zero && c.Size > mx {
				mx = c.Size
			}
		}
	}
	return mx
}

// readWorkers returns how many workers reading m may run: want (default the CPU count), but no
// more than limit (default DefaultMemoryLimit) allows once the manifest (manifestMem with rawLen)
// and the fixed costs are taken out.
func readWorkers(want int, limit int64, m *Manifest, rawLen int) (int, error) {
	return readWorkersOf(want, limit, m, rawLen, readWorkerMem(maxChunkOf(m)))
}

// readWorkersOf is readWorkers for workers that need per bytes each.
func readWorkersOf(want int, limit int64, m *Manifest, rawLen int, per int64) (int, error) {
	if limit <= 0 {
		limit = DefaultMemoryLimit
	}
	fixed := manifestMem(m, rawLen) + readFixedMem
	maxChunk := maxChunkOf(m)
	if limit-fixed < per {
		return 0, fmt.Errorf("%w: memory limit %s is below what reading image %s needs: %s for its manifest and %s for one worker (chunks of up to %s); raise the limit",
			ErrMemoryLimit, bytesize.Format(limit), m.Name, bytesize.Format(fixed), bytesize.Format(per), bytesize.Format(int64(maxChunk)))
	}
	return workerCount(want, limit-fixed, per)
}

// ErrMemoryLimit marks an operation refused because its memory limit is too low for the image.
var ErrMemoryLimit = errors.New("memory limit too low")

// chunkDecoder decodes chunk files of untrusted origin into fixed buffers. One is shared by all
// workers of an operation (DecodeAll is safe for concurrent use); each worker has its chunkBufs.
type chunkDecoder struct {
	zr       *zstd.Decoder
	maxChunk int
}

func newChunkDecoder(workers, maxChunk int) (*chunkDecoder, error) {
	zr, err := zstd.NewReader(nil,
		zstd.WithDecoderConcurrency(workers),
		zstd.WithDecoderMaxMemory(uint64(maxChunk+decodeSlack)),
		zstd.WithDecoderMaxWindow(MaxChunkSize),
		// DecodeAll never writes past the capacity of the buffer it is given.
		zstd.WithDecodeAllCapLimit(true),
	)
	if err != nil {
		return nil, fmt.Errorf("zstd decoder: %w", err)
	}
	return &chunkDecoder{zr: zr, maxChunk: maxChunk}, nil
}

func (d *chunkDecoder) close() { d.zr.Close() }

// chunkBufs are one worker's buffers. Each is allocated once, at full size for the largest chunk,
// so reading never grows them and leaves no garbage behind.
type chunkBufs struct{ file, raw, scratch []byte }

// fileBuf returns the worker's chunk file buffer (empty, with room for any chunk file).
func (d *chunkDecoder) fileBuf(b *chunkBufs) []byte {
	if cap(b.file) < chunkHeaderLen+d.maxChunk {
		b.file = make([]byte, 0, chunkHeaderLen+d.maxChunk)
	}
	return b.file[:0]
}

func grownTo(buf []byte, n int) []byte {
	if cap(buf) < n {
		return make([]byte, 0, n)
	}
	return buf
}

// decode checks a chunk file against the size its manifest gives the chunk (before decoding
// anything), decompresses it within b's buffers and checks its hash. The result aliases file or
// b. Errors wrap ErrCorrupt and say what is wrong.
func (d *chunkDecoder) decode(file []byte, want ChunkID, size int, b *chunkBufs) ([]byte, error) {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: chunk %s: %s", ErrCorrupt, want, fmt.Sprintf(format, a...))
	}
	if len(file) < chunkHeaderLen || string(file[:4]) != chunkMagic || file[6] != 0 || file[7] != 0 {
		return nil, bad("bad header")
	}
	codec, filter := file[4], int(file[5])
	n := int(binary.LittleEndian.Uint32(file[8:]))
	if n != size || size > d.maxChunk {
		return nil, bad("header says %d bytes, the manifest %d", n, size)
	}
	payload := file[chunkHeaderLen:]
	switch codec {
	case codecRaw:
		if filter != 0 || len(payload) != n {
			return nil, bad("raw payload of %d bytes, header says %d", len(payload), n)
		}
		return checkHash(payload, want)
	case codecZstd:
	default:
		return nil, bad("unknown codec %d", codec)
	}
	if filter != 0 && filter != 2 && filter != 4 {
		return nil, bad("unknown filter %d", filter)
	}
	if len(payload) > maxEncodedLen(n) {
		return nil, bad("compressed payload of %d bytes for %d bytes of data", len(payload), n)
	}
	var h zstd.Header
	if err := h.Decode(payload); err != nil || h.Skippable || h.DictionaryID != 0 {
		return nil, bad("payload is not a plain zstd frame (%v)", err)
	}
	if h.HasFCS && h.FrameContentSize != uint64(n) {
		return nil, bad("zstd frame declares %d bytes, the chunk %d: refused before decompressing", h.FrameContentSize, n)
	}
	if !h.HasFCS && n > maxUnsizedFrame {
		return nil, bad("zstd frame without a content size for %d bytes (more than %d): refused before decompressing", n, maxUnsizedFrame)
	}
	target := &b.raw
	if filter != 0 {
		target = &b.scratch
	}
	*target = grownTo(*target, d.maxChunk+decodeSlack)
	out, err := d.zr.DecodeAll(payload, (*target)[:0:n+decodeSlack])
	switch {
	case errors.Is(err, zstd.ErrDecoderSizeExceeded) || errors.Is(err, zstd.ErrFrameSizeExceeded):
		return nil, bad("decompresses to more than the %d bytes it declares (stopped there)", n)
	case errors.Is(err, zstd.ErrWindowSizeExceeded):
		return nil, bad("zstd frame asks for a window of %d bytes, more than chunks of this image may use", h.WindowSize)
	case err != nil:
		return nil, bad("zstd: %v", err)
	case len(out) != n:
		return nil, bad("decompresses to %d bytes, header says %d", len(out), n)
	}
	if filter == 0 {
		return checkHash(out, want)
	}
	b.raw = grownTo(b.raw, d.maxChunk+decodeSlack)
	raw := b.raw[:n]
	unshuffle(raw, out, filter)
	return checkHash(raw, want)
}

func checkHash(raw []byte, want ChunkID) ([]byte, error) {
	if got := HashChunk(raw); got != want {
		return nil, fmt.Errorf("%w: chunk %s: content hashes to %s", ErrCorrupt, want, got)
	}
	return raw, nil
}
