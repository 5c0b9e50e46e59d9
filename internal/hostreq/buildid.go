package hostreq

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
)

// CRIU validates an ELF file it reopens by its GNU build-ID as well as its size (criu/files-reg.c,
// the default --file-validation buildid): the note's descriptor, found through the PT_NOTE program
// headers within the file's first MiB, copied into RegFileEntry.build_id as 32-bit words (the
// bytes, zero-padded to a multiple of 4). Two builds of the same source often differ only there
// (nvcc embeds names of temporary files), and CRIU then fails with "has bad build-ID" after the
// restore has begun; preflight compares them first.

const (
	buildIDWindow = 1 << 20 // CRIU maps at most the first MiB of the file
	maxBuildID    = 512     // CRIU refuses larger descriptors
	ntGNUBuildID  = 3
	ptNote        = 4
)

// buildIDWords turns CRIU's recorded words back into the padded bytes (little-endian: CRIU copies
// the bytes into the words on the dumping host, x86-64 or arm64).
func buildIDWords(words []uint32) ([]byte, error) {
	if len(words) == 0 {
		return nil, nil
	}
	if len(words)*4 > maxBuildID+3 {
		return nil, fmt.Errorf("build-ID of %d words", len(words))
	}
	b := make([]byte, 0, 4*len(words))
	for _, w := range words {
		b = binary.LittleEndian.AppendUint32(b, w)
	}
	return b, nil
}

// sameBuildID reports whether a file's build-ID (as read) matches a recorded, padded one the way
// CRIU compares them: equal padded lengths, equal bytes.
func sameBuildID(have, recorded []byte) bool {
	return (len(have)+3)/4*4 == len(recorded) && bytes.Equal(have, recorded[:len(have)])
}

// errNoBuildID: the file is not an ELF file with a GNU build-ID note in its first MiB.
var errNoBuildID = errors.New("no build-ID")

// readBuildID reads the GNU build-ID of the ELF file at path as CRIU does (PT_NOTE program
// headers in the first MiB; following symlinks, as CRIU's open does).
func readBuildID(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	// The note sits right after the program headers in practice: a small read first, the whole
	// window CRIU looks at only when the note is not in it (a process maps hundreds of libraries).
	b := make([]byte, 0, buildIDWindow)
	for _, size := range []int{64 << 10, buildIDWindow} {
		n, err := io.ReadFull(f, b[len(b):size])
		b = b[:len(b)+n]
		if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
			return nil, err
		}
		id, err := buildIDOf(b)
		if err == nil || len(b) < size { // found, or the file ends here
			return id, err
		}
	}
	return nil, errNoBuildID
}

// buildIDOf finds the build-ID note in an ELF prefix; every offset is bounds-checked.
func buildIDOf(b []byte) ([]byte, error) {
	if len(b) < 16 || !bytes.Equal(b[:4], []byte("\x7fELF")) {
		return nil, errNoBuildID
	}
	var le binary.ByteOrder = binary.LittleEndian
	if b[5] == 2 {
		le = binary.BigEndian
	}
	var phoff, phentsize, phnum uint64
	switch b[4] {
	case 2: // ELFCLASS64
		if len(b) < 64 {
			return nil, errNoBuildID
		}
		phoff, phentsize, phnum = le.Uint64(b[32:]), uint64(le.Uint16(b[54:])), uint64(le.Uint16(b[56:]))
	case 1: // ELFCLASS32
		if len(b) < 52 {
			return nil, errNoBuildID
		}
		phoff, phentsize, phnum = uint64(le.Uint32(b[28:])), uint64(le.Uint16(b[42:])), uint64(le.Uint16(b[44:]))
	default:
		return nil, errNoBuildID
	}
	for i := uint64(0); i < phnum; i++ {
		off := phoff + i*phentsize
		var typ uint32
		var noff, nsize uint64
		if b[4] == 2 {
			if off+56 > uint64(len(b)) || off < phoff {
				break
			}
			typ, noff, nsize = le.Uint32(b[off:]), le.Uint64(b[off+8:]), le.Uint64(b[off+32:])
		} else {
			if off+32 > uint64(len(b)) || off < phoff {
				break
			}
			typ, noff, nsize = le.Uint32(b[off:]), uint64(le.Uint32(b[off+4:])), uint64(le.Uint32(b[off+16:]))
		}
		if typ != ptNote || noff >= uint64(len(b)) {
			continue
		}
		end := min(noff+nsize, uint64(len(b)))
		for p := noff; p+12 <= end; {
			namesz, descsz, ntype := uint64(le.Uint32(b[p:])), uint64(le.Uint32(b[p+4:])), le.Uint32(b[p+8:])
			desc := p + 12 + (namesz+3)/4*4
			next := desc + (descsz+3)/4*4
			if desc < p || next < desc || desc+descsz > uint64(len(b)) {
				break
			}
			if ntype == ntGNUBuildID && descsz > 0 {
				if descsz > maxBuildID {
					return nil, errNoBuildID
				}
				return append([]byte(nil), b[desc:desc+descsz]...), nil
			}
			p = next
		}
	}
	return nil, errNoBuildID
}

func validBuildIDHex(s string) error {
	if s == "" {
		return nil
	}
	b, err := hex.DecodeString(s)
	if err != nil || len(b)%4 != 0 || len(b) > maxBuildID+3 {
		return fmt.Errorf("build-ID %.40q is not hex of whole 32-bit words", s)
	}
	return nil
}
