package devmem

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/store"
)

func goodIndex() *Index {
	return &Index{Version: 1, PID: 42, Instance: "00112233aabbccdd", ChunkBytes: 4 << 20, Hash: "ptxmig-gpuhash-1",
		Regions: []Region{
			{VA: 0x7f0000000000, Size: 8 << 20, Asked: 6<<20 + 1, Bytes: 6<<20 + 256, Device: 0, File: DataName(42, 0), Hashes: strings.Repeat("ab", 32)},
			{VA: 0x7f0000800000, Size: 2 << 20, Asked: 2 << 20, Bytes: 2 << 20, Device: 0, File: DataName(42, 1)},
		}}
}

func TestParseIndex(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(x *Index)
		want   string // "" valid, else part of the error
	}{
		{"valid", func(*Index) {}, ""},
		{"version", func(x *Index) { x.Version = 2 }, "version 2"},
		{"pid", func(x *Index) { x.PID = 0 }, "pid 0"},
		{"instance not hex", func(x *Index) { x.Instance = "00112233aabbccdz" }, "instance"},
		{"instance upper case", func(x *Index) { x.Instance = "00112233AABBCCDD" }, "instance"},
		{"chunk too small", func(x *Index) { x.ChunkBytes = 1024 }, "chunk size"},
		{"unknown hash", func(x *Index) { x.Hash = "md5" }, "unknown hash"},
		{"overlapping regions", func(x *Index) { x.Regions[1].VA = x.Regions[0].VA + 4<<20 }, "region 1: range"},
		{"bytes past size", func(x *Index) { x.Regions[1].Bytes = 4 << 20 }, "region 1: bytes"},
		{"asked zero", func(x *Index) { x.Regions[0].Asked = 0 }, "region 0: bytes"},
		{"file name", func(x *Index) { x.Regions[0].File = "../../etc/passwd" }, "region 0: file"},
		{"hash digits", func(x *Index) { x.Regions[0].Hashes = "ab" }, "region 0: 2 hash digits"},
		{"hashes without hash name", func(x *Index) { x.Hash = "" }, "region 0"},
		{"va wraps", func(x *Index) { x.Regions[1].VA = ^uint64(0) - 1<<20 }, "region 1: range"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := goodIndex()
			tt.mutate(x)
			b, _ := json.Marshal(x)
			_, err := ParseIndex(b)
			if tt.want == "" {
				if err != nil {
					t.Fatalf("valid index refused: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want one mentioning %q", err, tt.want)
			}
		})
	}
	if _, err := ParseIndex([]byte(`{"version":1,"surprise":1}`)); err == nil {
		t.Error("unknown field accepted")
	}
}

func TestExtra(t *testing.T) {
	m := map[int]string{42: "00112233aabbccdd", 7: "ffffffffffffffff"}
	s := EncodeExtra(m)
	if s != "42:00112233aabbccdd 7:ffffffffffffffff" {
		t.Fatalf("EncodeExtra = %q", s)
	}
	got := DecodeExtra(s + " bad 9:xyz -1:00112233aabbccdd 5:0011")
	if len(got) != 2 || got[42] != m[42] || got[7] != m[7] {
		t.Fatalf("DecodeExtra = %v", got)
	}
}

func TestFindPrev(t *testing.T) {
	x := goodIndex()
	idx, _ := json.Marshal(x)
	now := time.Now()
	// Images in the layout before typed descriptions (the extra string), and in version 2.
	mk := func(name, extra string, age time.Duration) *store.Manifest {
		meta, _ := json.Marshal(map[string]any{"extra": map[string]string{ExtraKey: extra}})
		if strings.HasPrefix(name, "new") {
			var err error
			if meta, err = (&imagedesc.Description{Devmem: DecodeExtra(extra)}).Encode(); err != nil {
				t.Fatal(err)
			}
		}
		return &store.Manifest{Name: name, Created: now.Add(-age), Meta: meta,
			Files: []store.File{{Path: DataName(42, 0), Type: store.TypeFile}, {Path: "pages-1.img", Type: store.TypeFile}}}
	}
	ms := []*store.Manifest{
		mk("old", "42:00112233aabbccdd", time.Hour),
		mk("new", "42:00112233aabbccdd 7:ffffffffffffffff", time.Minute),
		mk("other-instance", "42:0000000000000001", time.Second),
		mk("other-pid", "43:00112233aabbccdd", time.Second),
		mk("new-other-instance", "42:0000000000000002", time.Second),
	}
	read := func(m *store.Manifest, name string) ([]byte, error) {
		if name != IndexName(42) {
			t.Errorf("read %s of %s", name, m.Name)
		}
		return idx, nil
	}
	p := FindPrev(ms, 42, "00112233aabbccdd", read)
	if p == nil || p.Image != "new" || p.Files[DataName(42, 0)] == nil || p.Files["pages-1.img"] != nil {
		t.Fatalf("FindPrev = %+v", p)
	}
	if p := FindPrev(ms, 42, "0123456789abcdef", read); p != nil {
		t.Fatalf("FindPrev of an unknown instance = %+v", p)
	}
	bad := func(*store.Manifest, string) ([]byte, error) { return []byte(`{"version":1}`), nil }
	if p := FindPrev(ms, 42, "00112233aabbccdd", bad); p != nil {
		t.Fatalf("FindPrev with a bad index = %+v", p)
	}
}
