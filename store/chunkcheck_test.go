package store

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCheckChunkFiles (issue 36): the cheap check restore's preflight runs finds a truncated chunk
// file (raw or compressed), a missing one, and one replaced by a symlink, naming the chunk, its
// file and where the image uses it, without changing anything; an intact image passes, and so
// does a chunk whose size differs from the recorded one but that verifies (the same bytes encoded
// by another writer).
func TestCheckChunkFiles(t *testing.T) {
	ctx := context.Background()
	// pages: incompressible (raw chunks); core: repetitive (zstd chunks).
	src := t.TempDir()
	writeRandom(t, filepath.Join(src, "pages-1.img"), 3*testChunk, 7)
	os.WriteFile(filepath.Join(src, "core-1.img"), bytes.Repeat([]byte("core"), testChunk/2), 0o600)
	chunkOf := func(t *testing.T, m *Manifest, path string) (ChunkID, *Chunk) {
		for i := range m.Files {
			if m.Files[i].Path == path {
				ch := &m.Files[i].Chunks[len(m.Files[i].Chunks)-1]
				return ch.Hash, ch
			}
		}
		t.Fatalf("no %s in the image", path)
		return ChunkID{}, nil
	}
	tests := []struct {
		name   string
		file   string
		damage func(t *testing.T, p string, ch *Chunk)
		want   string // "" for no error
	}{
		{"intact", "pages-1.img", func(*testing.T, string, *Chunk) {}, ""},
		{"raw chunk truncated", "pages-1.img", func(t *testing.T, p string, ch *Chunk) { os.Truncate(p, int64(ch.Stored/2)) }, "when the image was written (truncated?), and it does not verify"},
		{"compressed chunk truncated", "core-1.img", func(t *testing.T, p string, ch *Chunk) { os.Truncate(p, int64(ch.Stored-1)) }, "when the image was written (truncated?), and it does not verify"},
		{"header only", "core-1.img", func(t *testing.T, p string, ch *Chunk) { os.Truncate(p, chunkHeaderLen) }, "truncated?"},
		{"empty", "pages-1.img", func(t *testing.T, p string, ch *Chunk) { os.Truncate(p, 0) }, "truncated?"},
		{"missing", "pages-1.img", func(t *testing.T, p string, ch *Chunk) { os.Remove(p) }, "missing"},
		{"symlink", "pages-1.img", func(t *testing.T, p string, ch *Chunk) {
			b, _ := os.ReadFile(p)
			q := filepath.Join(t.TempDir(), "chunk")
			os.WriteFile(q, b, 0o600)
			os.Remove(p)
			os.Symlink(q, p)
		}, "not a regular file"},
		{"recorded size differs, content verifies", "core-1.img", func(t *testing.T, p string, ch *Chunk) {
			// Another encoding of the same bytes: stored raw.
			raw := bytes.Repeat([]byte("core"), testChunk/2)[ch.Offset : ch.Offset+int64(ch.Size)]
			file := binary.LittleEndian.AppendUint32([]byte(chunkMagic+"\x00\x00\x00\x00"), uint32(len(raw)))
			os.WriteFile(p, append(file, raw...), 0o600)
		}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := openTestStore(t)
			m, _, err := s.Put(ctx, src, PutOptions{Name: "img", ChunkSize: testChunk})
			if err != nil {
				t.Fatal(err)
			}
			id, ch := chunkOf(t, m, tt.file)
			if ch.Stored == 0 {
				t.Fatalf("the manifest records no stored size for chunk %s", id)
			}
			p := s.chunkPath(id)
			tt.damage(t, p, ch)
			err = s.CheckChunkFiles(ctx, m)
			if tt.want == "" {
				if err != nil {
					t.Fatalf("CheckChunkFiles: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tt.want) || !strings.Contains(err.Error(), id.String()) ||
				!strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), tt.file+" at offset ") {
				t.Fatalf("CheckChunkFiles: %v; want ErrCorrupt naming chunk %s, %s and %s, saying %q", err, id, p, tt.file, tt.want)
			}
			if _, err := s.Get("img"); err != nil {
				t.Errorf("the image is no longer there after the check: %v", err)
			}
		})
	}
}
