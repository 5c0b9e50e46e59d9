package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// pipeWithReader returns the write end of an OS pipe whose read end a goroutine drains in reads
// of piece bytes; wait returns what it read.
func pipeWithReader(t *testing.T, piece int) (w *os.File, wait func() []byte) {
	t.Helper()
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan []byte, 1)
	go func() {
		defer pr.Close()
		var b bytes.Buffer
		buf := make([]byte, piece)
		for {
			n, err := pr.Read(buf)
			b.Write(buf[:n])
			if err != nil {
				got <- b.Bytes()
				return
			}
		}
	}()
	return pw, func() []byte { pw.Close(); return <-got }
}

// Files written into OS pipes (as CRIU's restore reads them) arrive intact, with the zero
// chunks and the chunks stored raw spliced rather than copied, and the compressed ones copied.
func TestImageReaderPipeSplice(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	want := putStreamImage(t, s, "img", streamFiles())
	for _, workers := range []int{1, 3} {
		for _, piece := range []int{1000, 1 << 20} {
			t.Run(fmt.Sprintf("workers-%d-reads-%d", workers, piece), func(t *testing.T) {
				r, err := s.OpenImage(ctx, "img", GetOptions{Workers: workers})
				if err != nil {
					t.Fatal(err)
				}
				defer r.Close()
				for path, data := range want {
					w, wait := pipeWithReader(t, piece)
					n, err := r.WriteFile(ctx, path, w)
					got := wait()
					if err != nil || n != int64(len(data)) || !bytes.Equal(got, data) {
						t.Errorf("%s: %d bytes, %v; read %d bytes, equal %v", path, n, err, len(got), bytes.Equal(got, data))
					}
				}
				st := r.Stats()
				// pages-1.img: 16 zero chunks at least, one raw chunk; one-chunk and the dup files raw.
				if min := int64(16+1+1+2*3) * testChunk; st.SplicedBytes < min || st.SplicedBytes >= st.WrittenBytes {
					t.Errorf("spliced %d of %d bytes written, want at least %d and not all (text is compressed)", st.SplicedBytes, st.WrittenBytes, min)
				}
			})
		}
	}
	// Into anything but a pipe nothing is spliced.
	r, err := s.OpenImage(ctx, "img", GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	f, err := os.Create(t.TempDir() + "/pages")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := r.WriteFile(ctx, "pages-1.img", f); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(f.Name()); !bytes.Equal(b, want["pages-1.img"]) {
		t.Error("pages-1.img written to a regular file differs")
	}
	if st := r.Stats(); st.SplicedBytes != 0 {
		t.Errorf("spliced %d bytes into a regular file", st.SplicedBytes)
	}
}

// Spliced pages stay what they were once WriteFile has returned: the pipe holds them after the
// reader is closed, its mappings dropped and the whole store removed.
func TestImageReaderSplicedPagesOutliveReader(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	data := randomBytes(6*testChunk+100, 8)
	clear(data[2*testChunk : 3*testChunk]) // chunk 2 is zero
	want := putStreamImage(t, s, "img", []streamFile{{path: "pages-1.img", mode: 0o600, data: data}})
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
	if sz, err := unix.FcntlInt(pw.Fd(), unix.F_SETPIPE_SZ, 1<<20); err != nil || sz < len(data) {
		t.Skipf("cannot make a pipe of 1 MiB here (%d, %v)", sz, err)
	}
	r, err := s.OpenImage(ctx, "img", GetOptions{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := r.WriteFile(ctx, "pages-1.img", pw); err != nil || n != int64(len(data)) {
		t.Fatalf("WriteFile: %d, %v", n, err)
	}
	if st := r.Stats(); st.SplicedBytes != 6*testChunk {
		t.Errorf("spliced %d bytes, want %d (five raw chunks and a zero one)", st.SplicedBytes, 6*testChunk)
	}
	r.Close()
	pw.Close()
	if err := os.RemoveAll(s.Dir()); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(pr)
	if err != nil || !bytes.Equal(got, want["pages-1.img"]) {
		t.Errorf("read back %d bytes (%v), equal %v", len(got), err, bytes.Equal(got, want["pages-1.img"]))
	}
}

// A corrupt chunk stops a file written into a pipe exactly before it: nothing of it or after it
// enters the pipe, and the error names the file and offset.
func TestImageReaderPipeCorruptChunk(t *testing.T) {
	ctx := context.Background()
	data := randomBytes(6*testChunk, 10) // random, zero, random, BAD, random, zero
	clear(data[testChunk : 2*testChunk])
	clear(data[5*testChunk:])
	s := openTestStore(t)
	putStreamImage(t, s, "img", []streamFile{{path: "pages-1.img", mode: 0o600, data: data}})
	m, err := s.Get("img")
	if err != nil {
		t.Fatal(err)
	}
	p := s.chunkPath(m.Files[0].Chunks[3].Hash)
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)-1] ^= 0x80
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	r, err := s.OpenImage(ctx, "img", GetOptions{Workers: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	w, wait := pipeWithReader(t, 4096)
	n, err := r.WriteFile(ctx, "pages-1.img", w)
	got := wait()
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), fmt.Sprintf("file pages-1.img at offset %d", 3*testChunk)) {
		t.Errorf("WriteFile: %v", err)
	}
	if n != 3*testChunk || !bytes.Equal(got, data[:3*testChunk]) {
		t.Errorf("wrote %d bytes, the pipe got %d; want exactly the %d before the corrupt chunk", n, len(got), 3*testChunk)
	}
}

// A reader that stops early (CRIU has read what it needs) ends WriteFile with EPIPE, promptly.
func TestImageReaderPipeClosedEarly(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	data := randomBytes(64*testChunk, 2)
	putStreamImage(t, s, "img", []streamFile{{path: "pages-1.img", mode: 0o600, data: data}})
	r, err := s.OpenImage(ctx, "img", GetOptions{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pw.Close()
	go func() {
		buf := make([]byte, testChunk)
		_, _ = io.ReadFull(pr, buf)
		pr.Close()
	}()
	within(t, 30*time.Second, "WriteFile into a closed pipe", func() {
		n, err := r.WriteFile(ctx, "pages-1.img", pw)
		if !errors.Is(err, syscall.EPIPE) || n >= int64(len(data)) {
			t.Errorf("WriteFile: %d bytes, %v; want EPIPE", n, err)
		}
	})
}

// A chunk file that shrinks under its mapping (never done by the store; a tampering root or a
// failing disk) is a corrupt chunk, not a crash: the fault on the mapping is caught.
func TestVerifyMappedFault(t *testing.T) {
	s := openTestStore(t)
	data := randomBytes(2*testChunk, 3)
	putStreamImage(t, s, "img", []streamFile{{path: "pages-1.img", mode: 0o600, data: data}})
	m, err := s.Get("img")
	if err != nil {
		t.Fatal(err)
	}
	ch := m.Files[0].Chunks[0]
	mp, err := s.mapRawChunk(ch.Hash, ch.Size)
	if err != nil || mp == nil {
		t.Skipf("the chunk cannot be mapped and locked here (%v): the read path serves it", err)
	}
	if got, err := verifyMapped(mp, ch.Hash, ch.Size); err != nil || !bytes.Equal(got, data[:testChunk]) {
		t.Fatalf("intact mapping: %v", err)
	}
	_ = unix.Munmap(mp)
	// A mapping of a file that is then truncated: its pages are gone from under it.
	mp, err = s.mapRawChunk(ch.Hash, ch.Size)
	if err != nil || mp == nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mp)
	if err := os.Truncate(s.chunkPath(ch.Hash), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := verifyMapped(mp, ch.Hash, ch.Size); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "changed while it was read") {
		t.Fatalf("truncated under its mapping: %v", err)
	}
}

// Compressed chunks are never mapped (no decoder keeps a pointer into a mapping): mapRawChunk
// declines them and the read path serves them.
func TestMapRawChunkDeclinesCompressed(t *testing.T) {
	s := openTestStore(t)
	text := bytes.Repeat([]byte("ptxmig checkpoint "), 2*testChunk/18+1)[:testChunk]
	putStreamImage(t, s, "img", []streamFile{{path: "text", mode: 0o600, data: text}})
	m, err := s.Get("img")
	if err != nil {
		t.Fatal(err)
	}
	ch := m.Files[0].Chunks[0]
	if mp, err := s.mapRawChunk(ch.Hash, ch.Size); mp != nil || err != nil {
		t.Fatalf("a compressed chunk was mapped (%d bytes, %v)", len(mp), err)
	}
}

// verifyMapped accepts only an intact chunk stored raw of the expected size, and what it returns
// is the mapping's own payload.
func TestVerifyMappedHeader(t *testing.T) {
	payload := bytes.Repeat([]byte{7, 1, 3}, 1000)
	id := HashChunk(payload)
	file := func(codec byte, n int, p []byte) []byte {
		h := make([]byte, chunkHeaderLen, chunkHeaderLen+len(p))
		copy(h, chunkMagic)
		h[4] = codec
		h[8], h[9], h[10], h[11] = byte(n), byte(n>>8), byte(n>>16), byte(n>>24)
		return append(h, p...)
	}
	bad := bytes.Clone(payload)
	bad[10] ^= 1
	tests := []struct {
		name string
		m    []byte
		want string // "" = ok
	}{
		{"intact", file(codecRaw, len(payload), payload), ""},
		{"compressed", file(codecZstd, len(payload), payload), "not a chunk stored raw"},
		{"bad magic", append([]byte("XXXX"), file(codecRaw, len(payload), payload)[4:]...), "not a chunk stored raw"},
		{"short header", []byte("PXC1"), "bad header"},
		{"size", file(codecRaw, len(payload)-1, payload), "header says"},
		{"content", file(codecRaw, len(bad), bad), "content hashes to"},
	}
	for _, tt := range tests {
		got, err := verifyMapped(tt.m, id, len(payload))
		switch {
		case tt.want == "" && (err != nil || len(got) != len(payload) || &got[0] != &tt.m[chunkHeaderLen]):
			t.Errorf("%s: %v; want the mapping's payload", tt.name, err)
		case tt.want != "" && (!errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("%s: %v; want a corrupt chunk (%q)", tt.name, err, tt.want)
		}
	}
}
