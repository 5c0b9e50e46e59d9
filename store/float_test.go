package store

import (
	"bytes"
	"math"
	"testing"
)

func mathFloat32bits(f float32) uint32 { return math.Float32bits(f) }

// TestShuffleLayout pins the on-disk filter layout (docs/FORMAT.md): byte k of element i goes to
// k*n + i, a tail shorter than one element is copied unchanged.
func TestShuffleLayout(t *testing.T) {
	for _, w := range []int{2, 4} {
		for _, size := range []int{0, 1, 3, 4, 7, 8, 15, 16, 31, 32, 33, 64, 1001, 4096, 4099} {
			src := make([]byte, size)
			for i := range src {
				src[i] = byte(i*7 + i>>8)
			}
			n := size / w
			want := make([]byte, size)
			for i := range n {
				for k := range w {
					want[k*n+i] = src[i*w+k]
				}
			}
			copy(want[n*w:], src[n*w:])
			got := shuffle([]byte("prefix"), src, w)
			if !bytes.Equal(got[:6], []byte("prefix")) || !bytes.Equal(got[6:], want) {
				t.Errorf("shuffle width %d of %d bytes: wrong layout", w, size)
			}
			back := make([]byte, size)
			unshuffle(back, want, w)
			if !bytes.Equal(back, src) {
				t.Errorf("unshuffle width %d of %d bytes does not invert", w, size)
			}
		}
	}
}

func BenchmarkShuffle4(b *testing.B) {
	src := floatData(4<<20, 9)
	dst := make([]byte, 0, len(src))
	b.SetBytes(int64(len(src)))
	for b.Loop() {
		dst = shuffle(dst[:0], src, 4)
	}
}

func BenchmarkUnshuffle4(b *testing.B) {
	src := floatData(4<<20, 9)
	dst := make([]byte, len(src))
	b.SetBytes(int64(len(src)))
	for b.Loop() {
		unshuffle(dst, src, 4)
	}
}
