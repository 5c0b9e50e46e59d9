package shimctl

import (
	"strings"
	"testing"
)

func TestMemBeginValidate(t *testing.T) {
	good := func() *MemBegin {
		return &MemBegin{Dir: "save", Instance: "00112233aabbccdd", ChunkBytes: 4 << 20, Slots: 8, Chunks: 3, Hash: "ptxmig-gpuhash-1",
			Regions: []MemRegion{
				{VA: 1 << 40, Size: 8 << 20, Asked: 5 << 20, Bytes: 5 << 20, Hashes: strings.Repeat("0f", 32)},
				{VA: 1<<40 + 8<<20, Size: 2 << 20, Asked: 100, Bytes: 256, Hashes: strings.Repeat("a", 32)},
			}}
	}
	tests := []struct {
		name   string
		mutate func(b *MemBegin)
		want   string
	}{
		{"valid", func(*MemBegin) {}, ""},
		{"other dir", func(b *MemBegin) { b.Dir = "load" }, "dir"},
		{"other chunk", func(b *MemBegin) { b.ChunkBytes = 1 << 20 }, "chunk"},
		{"instance", func(b *MemBegin) { b.Instance = "xyz" }, "instance"},
		{"overlap", func(b *MemBegin) { b.Regions[1].VA = 1<<40 + 4<<20 }, "region 1: bad range"},
		{"bytes not asked rounded", func(b *MemBegin) { b.Regions[1].Bytes = 512 }, "region 1: bytes"},
		{"bytes past size", func(b *MemBegin) { b.Regions[0].Bytes, b.Regions[0].Asked = 9<<20, 9<<20 }, "region 0: bytes"},
		{"hash digits", func(b *MemBegin) { b.Regions[0].Hashes = "00" }, "hash digits"},
		{"hash not hex", func(b *MemBegin) { b.Regions[1].Hashes = strings.Repeat("g", 32) }, "hashes"},
		{"chunk count", func(b *MemBegin) { b.Chunks = 4 }, "4 chunks"},
		{"device", func(b *MemBegin) { b.Regions[0].Device = -1 }, "device"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := good()
			tt.mutate(b)
			err := b.validate("save", 4<<20, 8)
			if tt.want == "" {
				if err != nil {
					t.Fatalf("valid reply refused: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want one mentioning %q", err, tt.want)
			}
		})
	}
}

func TestSkipHex(t *testing.T) {
	got := skipHex([]bool{true, false, false, true, false, true})
	if got != "92" { // chunks 0 and 3: 1001b = 9; chunk 5: bit 1 of the second digit = 2
		t.Fatalf("skipHex = %q", got)
	}
}
