package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"runtime/debug"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Writing a restore's files into CRIU's pipes without copying them (ImageReader.WriteFile to a
// pipe). A plain write copies every byte into the pipe's own pages; vmsplice(2) puts references
// to the writer's pages into the pipe instead, and the pipe's reader (CRIU) copies them out from
// there. The pages stay referenced until they have been read, so only memory that never changes
// afterwards may be spliced:
//   - zero chunks come from zeroPages, a read-only mapping that nothing ever writes;
//   - a chunk stored raw is checked against its hash in a read-only mapping of its chunk file
//     (mapRawChunk), locked in memory so that the pages checked are the pages spliced (a clean
//     page reclaimed and read again from the disk in between could differ), and spliced from
//     there, then unmapped: the pipe keeps the page-cache pages it references, and a chunk file
//     is never rewritten (a new chunk gets a new file, renamed into place; the reader holds the
//     store lock, so nothing is removed meanwhile).
// Compressed chunks are read and decoded into the reader's buffers, which are reused, so they are
// written; no decoder ever sees a mapping (nothing may keep a pointer into it once unmapped).

// splicer vmsplices into a pipe; nil for any other writer.
type splicer struct{ rc syscall.RawConn }

func newSplicer(w io.Writer) *splicer {
	f, ok := w.(*os.File)
	if !ok {
		return nil
	}
	if fi, err := f.Stat(); err != nil || fi.Mode()&fs.ModeNamedPipe == 0 {
		return nil
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return nil
	}
	return &splicer{rc: rc}
}

// write splices all of b into the pipe, waiting while it is full (through Go's poller when the
// pipe is non-blocking), and returns the bytes spliced. b must not change afterwards.
func (s *splicer) write(b []byte) (int, error) {
	done := 0
	for done < len(b) {
		var n int
		var err error
		iov := unix.Iovec{Base: &b[done]}
		iov.SetLen(len(b) - done)
		werr := s.rc.Write(func(fd uintptr) bool {
			n, err = unix.Vmsplice(int(fd), []unix.Iovec{iov}, 0)
			return !errors.Is(err, unix.EAGAIN)
		})
		if werr != nil { // the pipe was closed (the restore failed elsewhere)
			return done, fmt.Errorf("vmsplice: %w", werr)
		}
		if err != nil {
			return done, os.NewSyscallError("vmsplice", err)
		}
		if n == 0 {
			return done, io.ErrShortWrite
		}
		done += n
	}
	return done, nil
}

// zeroPages is a read-only mapping that is never written: all zeros for as long as it exists.
var zeroPages = sync.OnceValues(func() ([]byte, error) {
	return unix.Mmap(-1, 0, len(streamZeros), unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
})

// writeZeros writes n zero bytes to w: spliced from zeroPages when sp is set (and the mapping
// exists), else copied from streamZeros. onWrite gets each part written and whether it was
// spliced.
func writeZeros(w io.Writer, sp *splicer, n int, onWrite func(k int, spliced bool)) (int, error) {
	zeros := streamZeros
	if sp != nil {
		if z, err := zeroPages(); err == nil {
			zeros = z
		} else {
			sp = nil
		}
	}
	written := 0
	for written < n {
		z := zeros[:min(n-written, len(zeros))]
		var k int
		var err error
		if sp != nil {
			k, err = sp.write(z)
		} else if k, err = w.Write(z); err == nil && k != len(z) {
			err = io.ErrShortWrite
		}
		written += k
		onWrite(k, sp != nil)
		if err != nil {
			return written, err
		}
	}
	return written, nil
}

// mapRawChunk maps the chunk file of id read-only and locks it in memory, when the file is a
// chunk stored raw (after the same checks as readChunkFile: a regular file, not a symbolic link,
// of a size that fits a chunk of size bytes). It returns nil and no error when the chunk should
// be read instead: compressed, or the mapping cannot be locked (no CAP_IPC_LOCK, a memlock limit,
// an I/O error populating it, which the read then reports). The caller unmaps it.
func (s *Store) mapRawChunk(id ChunkID, size int) ([]byte, error) {
	f, n, err := s.openChunkFile(id, size)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var h [chunkHeaderLen]byte
	if _, err := f.ReadAt(h[:], 0); err != nil || string(h[:4]) != chunkMagic || h[4] != codecRaw {
		return nil, nil // the read path reports what is wrong
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(n), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, nil
	}
	if err := unix.Mlock(m); err != nil {
		_ = unix.Munmap(m)
		return nil, nil
	}
	return m, nil
}

// verifyMapped checks a mapped chunk file stored raw against its hash and returns its payload,
// which lies in m. The header is copied out once and checked (as chunkDecoder.decode checks a
// raw chunk), so what is hashed and returned is always m's payload, whatever the file does. A
// fault on the mapping (the file shrank under it) is reported as a corrupt chunk, not a crash.
// The store is trusted not to be written in place while it is read (chunk files never are; a
// root that rewrites one could change the pages after the check, as with any page cache).
func verifyMapped(m []byte, id ChunkID, size int) (data []byte, err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			if _, fault := r.(interface{ Addr() uintptr }); !fault {
				panic(r)
			}
			data, err = nil, fmt.Errorf("%w: chunk %s: the chunk file changed while it was read (%v)", ErrCorrupt, id, r)
		}
	}()
	var h [chunkHeaderLen]byte
	if len(m) < chunkHeaderLen {
		return nil, fmt.Errorf("%w: chunk %s: bad header", ErrCorrupt, id)
	}
	copy(h[:], m)
	payload := m[chunkHeaderLen:]
	if string(h[:4]) != chunkMagic || h[4] != codecRaw || h[5] != 0 || h[6] != 0 || h[7] != 0 {
		return nil, fmt.Errorf("%w: chunk %s: not a chunk stored raw (the chunk file changed while it was read)", ErrCorrupt, id)
	}
	if n := int(binary.LittleEndian.Uint32(h[8:])); n != size || len(payload) != n {
		return nil, fmt.Errorf("%w: chunk %s: raw payload of %d bytes, header says %d, the manifest %d", ErrCorrupt, id, len(payload), n, size)
	}
	return checkHash(payload, id)
}
