package store

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"slices"

	"github.com/klauspost/compress/zstd"
)

// A chunk file is a 12-byte header followed by the payload:
//
//	0  4  magic "PXC1"
//	4  1  codec: 0 raw, 1 zstd
//	5  1  filter applied before compression: 0 none, 2 or 4 byte shuffle (element width)
//	6  2  reserved, zero
//	8  4  uncompressed length, little endian
//
// The chunk's id is the BLAKE3-256 hash of the uncompressed, unfiltered bytes, so every read can
// verify it.
const (
	chunkMagic     = "PXC1"
	chunkHeaderLen = 12

	codecRaw  = 0
	codecZstd = 1

	// A compressed chunk must save at least 3 % or it is stored raw.
	minSavingNum, minSavingDen = 97, 100

	// Sampling decides whether and how to compress: sampleN slices of sampleLen bytes.
	sampleLen = 16 << 10
	sampleN   = 4
)

// maxEncodedLen bounds a chunk file's payload for a raw length n (raw is kept when larger).
func maxEncodedLen(n int) int { return n }

var zeroBuf = make([]byte, 64<<10)

// isZero reports whether b is all zero bytes.
func isZero(b []byte) bool {
	for len(b) > 0 {
		n := min(len(b), len(zeroBuf))
		if !bytes.Equal(b[:n], zeroBuf[:n]) {
			return false
		}
		b = b[n:]
	}
	return true
}

// encoder compresses chunks; one per worker (not safe for concurrent use).
type encoder struct {
	zw      *zstd.Encoder
	sample  []byte
	shuf    []byte
	scratch []byte
}

func newEncoder(chunkSize int) (*encoder, error) {
	zw, err := zstd.NewWriter(nil,
		zstd.WithEncoderLevel(zstd.SpeedFastest),
		// Without literal entropy coding, dense float data (no matches) is stored raw.
		zstd.WithAllLitEntropyCompression(true),
		zstd.WithEncoderCRC(false), // the chunk hash covers integrity
		zstd.WithEncoderConcurrency(1),
		zstd.WithWindowSize(windowFor(chunkSize)),
		zstd.WithZeroFrames(true),
	)
	if err != nil {
		return nil, fmt.Errorf("zstd encoder: %w", err)
	}
	return &encoder{zw: zw}, nil
}

func windowFor(chunkSize int) int {
	w := zstd.MinWindowSize
	for w < chunkSize && w < 8<<20 {
		w <<= 1
	}
	return w
}

// encode appends the chunk file (header and payload) for raw to dst and returns it.
func (e *encoder) encode(raw, dst []byte) []byte {
	hdr := [chunkHeaderLen]byte{}
	copy(hdr[:], chunkMagic)
	binary.LittleEndian.PutUint32(hdr[8:], uint32(len(raw)))
	dst = append(dst[:0], hdr[:]...)

	filter, ok := e.choose(raw)
	if ok {
		src := raw
		if filter != 0 {
			e.shuf = shuffle(e.shuf[:0], raw, filter)
			src = e.shuf
		}
		out := e.zw.EncodeAll(src, dst)
		if (len(out)-chunkHeaderLen)*minSavingDen <= len(raw)*minSavingNum {
			out[4], out[5] = codecZstd, byte(filter)
			return out
		}
	}
	return append(dst, raw...)
}

// choose decides, from a sample of raw, whether compressing the chunk is worth it and with which
// filter. The sample is compressed plainly (this measures matches and literal entropy); the
// shuffles are estimated from per-lane byte entropy, since zstd's literal tables are per block
// and a small shuffled sample would mix lanes within one block.
func (e *encoder) choose(raw []byte) (filter int, ok bool) {
	if len(raw) <= 2*sampleN*sampleLen {
		return 0, true // small: compress it all, plainly
	}
	e.sample = e.sample[:0]
	step := len(raw) / sampleN
	for i := range sampleN {
		off := (i * step) &^ 15
		e.sample = append(e.sample, raw[off:off+sampleLen]...)
	}
	e.scratch = e.zw.EncodeAll(e.sample, e.scratch[:0])
	best, bestN := 0, float64(len(e.scratch))
	for _, w := range []int{4, 2} {
		// Entropy-coded size of the shuffled sample, plus ~2 % for tables and block headers.
		est := laneEntropyBytes(e.sample, w) * 1.02
		if est < bestN*0.98 { // a shuffle must win clearly
			best, bestN = w, est
		}
	}
	// The sample is an estimate: compress the chunk if it promises at least 1.5 %.
	if bestN > float64(len(e.sample))*0.985 {
		return 0, false
	}
	return best, true
}

// laneEntropyBytes is the order-0 entropy, in bytes, of b split into w byte lanes (byte k of
// every w-byte element), each coded on its own.
func laneEntropyBytes(b []byte, w int) float64 {
	var hist [4][256]int
	n := len(b) / w * w
	for i := 0; i < n; i += w {
		for k := range w {
			hist[k][b[i+k]]++
		}
	}
	var bits float64
	per := float64(n / w)
	for k := range w {
		for _, c := range hist[k] {
			if c > 0 {
				p := float64(c) / per
				bits -= float64(c) * math.Log2(p)
			}
		}
	}
	return bits/8 + float64(len(b)-n)
}

// shuffle appends src transposed by element width w (byte k of every element together) to dst;
// a tail shorter than one element is copied unchanged.
func shuffle(dst, src []byte, w int) []byte {
	n := len(src) / w
	base := len(dst)
	dst = slices.Grow(dst, len(src))[:base+len(src)] // every byte is written below
	out := dst[base:]
	switch w {
	case 4:
		o0, o1, o2, o3 := out[:n:n], out[n:2*n:2*n], out[2*n:3*n:3*n], out[3*n:4*n:4*n]
		// Eight elements at a time: two 64-bit loads, then byte k of each 32-bit element packed
		// into one 64-bit store per lane.
		i := 0
		for ; i+8 <= n; i += 8 {
			s := src[4*i : 4*i+32 : 4*i+32]
			a, b := binary.LittleEndian.Uint64(s), binary.LittleEndian.Uint64(s[8:])
			c, d := binary.LittleEndian.Uint64(s[16:]), binary.LittleEndian.Uint64(s[24:])
			binary.LittleEndian.PutUint64(o0[i:], lane4(a, b, c, d, 0))
			binary.LittleEndian.PutUint64(o1[i:], lane4(a, b, c, d, 8))
			binary.LittleEndian.PutUint64(o2[i:], lane4(a, b, c, d, 16))
			binary.LittleEndian.PutUint64(o3[i:], lane4(a, b, c, d, 24))
		}
		for ; i < n; i++ {
			v := binary.LittleEndian.Uint32(src[4*i:])
			o0[i], o1[i], o2[i], o3[i] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
		}
	case 2:
		o0, o1 := out[:n], out[n:2*n]
		for i := range n {
			o0[i], o1[i] = src[2*i], src[2*i+1]
		}
	default:
		panic("shuffle: unsupported width")
	}
	copy(out[n*w:], src[n*w:])
	return dst
}

// lane4 gathers byte sh/8 of each of the eight little-endian 32-bit elements held in a, b, c, d
// (two per word) into one word, element order kept.
func lane4(a, b, c, d uint64, sh uint) uint64 {
	return (a>>sh)&0xff | (a>>(sh+32)&0xff)<<8 |
		(b>>sh&0xff)<<16 | (b>>(sh+32)&0xff)<<24 |
		(c>>sh&0xff)<<32 | (c>>(sh+32)&0xff)<<40 |
		(d>>sh&0xff)<<48 | (d>>(sh+32)&0xff)<<56
}

// unshuffle reverses shuffle into dst (len(dst) == len(src)).
func unshuffle(dst, src []byte, w int) {
	n := len(src) / w
	switch w {
	case 4:
		s0, s1, s2, s3 := src[:n], src[n:2*n], src[2*n:3*n], src[3*n:4*n]
		for i := range n {
			binary.LittleEndian.PutUint32(dst[4*i:], uint32(s0[i])|uint32(s1[i])<<8|uint32(s2[i])<<16|uint32(s3[i])<<24)
		}
	case 2:
		s0, s1 := src[:n], src[n:2*n]
		for i := range n {
			dst[2*i], dst[2*i+1] = s0[i], s1[i]
		}
	}
	copy(dst[n*w:], src[n*w:])
}

// decoder decodes chunk files; shared by all workers (DecodeAll is concurrency-safe).
type decoder struct{ zr *zstd.Decoder }

func newDecoder(workers int) (*decoder, error) {
	zr, err := zstd.NewReader(nil,
		zstd.WithDecoderConcurrency(workers),
		zstd.WithDecoderMaxMemory(MaxChunkSize),
		zstd.WithDecoderMaxWindow(MaxChunkSize),
	)
	if err != nil {
		return nil, fmt.Errorf("zstd decoder: %w", err)
	}
	return &decoder{zr: zr}, nil
}

func (d *decoder) close() { d.zr.Close() }

// decode parses a chunk file, decompresses it into dst (reusing its capacity), and checks that it
// hashes to want. scratch is reused for unshuffling. Errors wrap ErrCorrupt.
func (d *decoder) decode(file []byte, want ChunkID, dst, scratch []byte) (raw, scratchOut []byte, err error) {
	if len(file) < chunkHeaderLen || string(file[:4]) != chunkMagic {
		return dst, scratch, fmt.Errorf("%w: chunk %s: bad header", ErrCorrupt, want)
	}
	codec, filter := file[4], int(file[5])
	n := int(binary.LittleEndian.Uint32(file[8:]))
	if n <= 0 || n > MaxChunkSize || file[6] != 0 || file[7] != 0 {
		return dst, scratch, fmt.Errorf("%w: chunk %s: bad header", ErrCorrupt, want)
	}
	payload := file[chunkHeaderLen:]
	switch codec {
	case codecRaw:
		if filter != 0 || len(payload) != n {
			return dst, scratch, fmt.Errorf("%w: chunk %s: raw payload %d bytes, header says %d", ErrCorrupt, want, len(payload), n)
		}
		raw = append(dst[:0], payload...)
	case codecZstd:
		if filter != 0 && filter != 2 && filter != 4 {
			return dst, scratch, fmt.Errorf("%w: chunk %s: unknown filter %d", ErrCorrupt, want, filter)
		}
		out := dst[:0]
		if filter != 0 {
			out = scratch[:0]
		}
		out, err = d.zr.DecodeAll(payload, out)
		if err != nil {
			return dst, scratch, fmt.Errorf("%w: chunk %s: %v", ErrCorrupt, want, err)
		}
		if len(out) != n {
			return dst, scratch, fmt.Errorf("%w: chunk %s: decoded %d bytes, header says %d", ErrCorrupt, want, len(out), n)
		}
		if filter != 0 {
			scratch = out
			if cap(dst) < n {
				dst = make([]byte, n)
			}
			raw = dst[:n]
			unshuffle(raw, out, filter)
		} else {
			raw = out
		}
	default:
		return dst, scratch, fmt.Errorf("%w: chunk %s: unknown codec %d", ErrCorrupt, want, codec)
	}
	if got := HashChunk(raw); got != want {
		return raw, scratch, fmt.Errorf("%w: chunk %s: content hashes to %s", ErrCorrupt, want, got)
	}
	return raw, scratch, nil
}
