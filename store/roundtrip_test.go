package store

import (
	"context"
	"path/filepath"
	"testing"
)

func TestRoundTrip(t *testing.T) {
	tests := []struct {
		name string
		spec treeSpec
		opts PutOptions
	}{
		{"small-files", treeSpec{seed: 1, files: 40, maxSize: 3000, symlinks: true}, PutOptions{ChunkSize: MinChunkSize}},
		{"mixed", treeSpec{seed: 2, files: 25, maxSize: 300 << 10, sparse: true, symlinks: true}, PutOptions{ChunkSize: testChunk}},
		{"one-worker", treeSpec{seed: 3, files: 12, maxSize: 200 << 10, sparse: true}, PutOptions{ChunkSize: testChunk, Workers: 1}},
		{"large-chunks", treeSpec{seed: 4, files: 6, maxSize: 3 << 20, sparse: true}, PutOptions{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := openTestStore(t)
			src := filepath.Join(t.TempDir(), "src")
			makeTree(t, src, tt.spec)
			defer chmodTree(src)
			o := tt.opts
			o.Name = "img-" + tt.name
			o.Meta = Metadata(`{"kind":"cpu","host":"h1","pid":42,"cmdline":["a","b"]}`)
			m, st, err := s.Put(context.Background(), src, o)
			if err != nil {
				t.Fatal(err)
			}
			if st.LogicalBytes != m.LogicalBytes() || st.Chunks == 0 && st.LogicalBytes > 0 {
				t.Errorf("stats %+v disagree with manifest (%d logical bytes)", st, m.LogicalBytes())
			}
			if got := st.ZeroBytes + st.DedupBytes; got > st.LogicalBytes {
				t.Errorf("zero+dedup %d > logical %d", got, st.LogicalBytes)
			}
			for _, ref := range []string{m.Name, m.ID, m.ID[:12]} {
				g, err := s.Get(ref)
				if err != nil || g.ID != m.ID {
					t.Fatalf("Get(%q) = %v, %v", ref, g, err)
				}
			}
			if r, err := s.Verify(context.Background(), m.Name); err != nil || !r.OK() {
				t.Fatalf("verify: %v %+v", err, r)
			}
			dst := filepath.Join(t.TempDir(), "out", "dst")
			gst, err := s.Materialize(context.Background(), m.ID, dst, GetOptions{Workers: 3})
			defer chmodTree(dst)
			if err != nil {
				t.Fatal(err)
			}
			if gst.LogicalBytes != st.LogicalBytes || gst.ZeroBytes != st.ZeroBytes {
				t.Errorf("materialize stats %+v vs put %+v", gst, st)
			}
			sameTree(t, src, dst)
		})
	}
}
