package hostreq

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// realELF returns a copy (in a temporary directory) of a system binary that has a GNU build-ID.
func realELF(t *testing.T) (string, []byte) {
	t.Helper()
	for _, p := range []string{"/bin/sleep", "/usr/bin/sleep", "/bin/true", "/bin/sh"} {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		id, err := buildIDOf(b[:min(len(b), buildIDWindow)])
		if err != nil {
			continue
		}
		dst := filepath.Join(t.TempDir(), "app")
		if err := os.WriteFile(dst, b, 0o755); err != nil {
			t.Fatal(err)
		}
		return dst, id
	}
	t.Fatal("no system binary with a GNU build-ID (Debian builds all of them with one)")
	return "", nil
}

// padded is the build-ID as CRIU records it: zero-padded to whole 32-bit words.
func padded(id []byte) []byte {
	return append(append([]byte(nil), id...), make([]byte, (4-len(id)%4)%4)...)
}

// TestCheckBuildID: a file with the recorded size and mode but another build-ID (a rebuild of the
// same source, here the same binary with one byte of its build-ID note changed) is named before
// CRIU meets it; the same build passes; a file with no build-ID is named too.
func TestCheckBuildID(t *testing.T) {
	path, id := realELF(t)
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	f := File{Path: path, Mode: unix.S_IFREG | 0o755, Size: st.Size(), BuildID: hex.EncodeToString(padded(id))}
	if p := Check([]File{f}, nil); len(p) != 0 {
		t.Fatalf("the same build: %v", p)
	}
	b, _ := os.ReadFile(path)
	i := bytes.Index(b, id)
	if i < 0 {
		t.Fatal("build-ID bytes not found in the file")
	}
	b[i] ^= 0xff
	if err := os.WriteFile(path, b, 0o755); err != nil {
		t.Fatal(err)
	}
	p := Check([]File{f}, nil)
	if len(p) != 1 || !strings.HasPrefix(p[0].Have, "another build (build-ID ") || !strings.Contains(p[0].Want, "with build-ID "+f.BuildID) ||
		!strings.Contains(p[0].Fix, "copy it from the source host") {
		t.Fatalf("another build: %v", p)
	}
	if err := os.WriteFile(path, bytes.Repeat([]byte("x"), len(b)), 0o755); err != nil {
		t.Fatal(err)
	}
	if p := Check([]File{f}, nil); len(p) != 1 || p[0].Have != "a file without a build-ID" {
		t.Fatalf("not an ELF file: %v", p)
	}
	// Round trip through the manifest, and bad records refused.
	if back, err := Parse(Encode([]File{f})); err != nil || back[0] != f {
		t.Fatalf("round trip: %v %+v", err, back)
	}
	for _, bad := range []string{"xyz", "abc", strings.Repeat("00", 600)} {
		if _, err := Parse(Encode([]File{{Path: "/x", Size: 1, BuildID: bad}})); err == nil {
			t.Errorf("build-ID %.20q accepted", bad)
		}
	}
}

// TestBuildIDWordsLikeCRIU: CRIU's words back to bytes (little-endian), and its comparison.
func TestBuildIDWordsLikeCRIU(t *testing.T) {
	b, err := buildIDWords([]uint32{0x04030201, 0x00000605})
	if err != nil || !bytes.Equal(b, []byte{1, 2, 3, 4, 5, 6, 0, 0}) {
		t.Fatalf("%x %v", b, err)
	}
	if !sameBuildID([]byte{1, 2, 3, 4, 5, 6}, b) || sameBuildID([]byte{1, 2, 3, 4, 5, 7}, b) || sameBuildID([]byte{1, 2, 3, 4}, b) {
		t.Error("comparison differs from CRIU's")
	}
	if _, err := buildIDWords(make([]uint32, 200)); err == nil {
		t.Error("an oversized build-ID was accepted")
	}
}

// FuzzBuildIDOf: no ELF prefix, however malformed, makes the parser read out of bounds.
func FuzzBuildIDOf(f *testing.F) {
	if b, err := os.ReadFile("/bin/sh"); err == nil {
		f.Add(b[:min(len(b), 4096)])
	}
	f.Add([]byte("\x7fELF\x02\x01\x01"))
	f.Fuzz(func(t *testing.T, b []byte) {
		if id, err := buildIDOf(b); err == nil && (len(id) == 0 || len(id) > maxBuildID) {
			t.Fatalf("build-ID of %d bytes", len(id))
		}
	})
}

// TestReadBuildIDBeyondFirstRead: a note past the first small read (but within CRIU's first MiB)
// is still found, as CRIU finds it.
func TestReadBuildIDBeyondFirstRead(t *testing.T) {
	const noteOff = 100 << 10
	b := make([]byte, noteOff+64)
	copy(b, "\x7fELF\x02\x01\x01")
	binary.LittleEndian.PutUint64(b[32:], 64) // e_phoff
	binary.LittleEndian.PutUint16(b[54:], 56) // e_phentsize
	binary.LittleEndian.PutUint16(b[56:], 1)  // e_phnum
	ph := b[64:]
	binary.LittleEndian.PutUint32(ph, ptNote)
	binary.LittleEndian.PutUint64(ph[8:], noteOff)
	binary.LittleEndian.PutUint64(ph[32:], 36)
	n := b[noteOff:]
	binary.LittleEndian.PutUint32(n, 4)
	binary.LittleEndian.PutUint32(n[4:], 20)
	binary.LittleEndian.PutUint32(n[8:], ntGNUBuildID)
	copy(n[12:], "GNU\x00")
	want := []byte("0123456789abcdefghij")
	copy(n[16:], want)
	path := filepath.Join(t.TempDir(), "elf")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := readBuildID(path); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("build-ID %q, %v; want %q", got, err, want)
	}
}
