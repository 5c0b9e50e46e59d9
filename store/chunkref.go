package store

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Files whose chunks arrive ready-made: a GPU process's device memory, copied at checkpoint by
// the shim into a ring of chunk-sized slots, is added slot by slot (no copy: a slot is reused
// once its chunk is stored), and its chunks unchanged since the previous image are recorded by
// reference to that image's chunks (no data at all).

// ErrChunkMissing: a chunk that AddChunks was to reference is not in the store as recorded.
var ErrChunkMissing = errors.New("referenced chunk not in the store")

// ChunkPiece is one chunk of a file added by AddChunks, in file order.
type ChunkPiece struct {
	// Data holds the chunk's bytes, owned by the caller until Release is called. The ingest
	// neither copies nor modifies them: a worker stores the chunk as AddFile's are stored
	// (hashed, zero chunks as holes, deduplicated, compressed), then releases it.
	Data []byte
	// Release (may be nil) is called exactly once for every piece next returned with ok, from
	// any goroutine: for a piece with Data once a worker stored or dropped it (also when the
	// ingest fails, at the latest before Close returns), for any other piece (a reference, or a
	// piece refused) by AddChunks before it calls next again.
	Release func()
	// Ref, when Data is nil: the chunk is an existing chunk of the store, as a manifest records it
	// (a previous image's entry: Size, and Hash unless Zero; its Offset and Stored are ignored).
	// It is checked without reading its payload (a zero chunk needs nothing; any other must have
	// a chunk file in the store holding a chunk of that size) and recorded by reference. A chunk
	// that is not there fails the ingest with ErrChunkMissing wrapped: check with HasChunk first.
	Ref *Chunk
}

// AddChunks records the regular file path (as AddFile: a clean, relative path of the image's
// top directory, permission bits mode&0o777) whose chunks next returns in order, and returns
// the bytes added. next returns the next piece and ok, or ok false at the end of the file; an
// error of next fails the ingest (a piece returned with ok false or an error is ignored, and so
// is its Release). Every piece but the last must be exactly a chunk (the ingest's chunk size)
// long, and the last one at most a chunk; a piece has Data or Ref, not both. The file's offsets
// are the ingest's own (a Ref's offset is ignored).
//
// Data pieces are handed to the workers as AddFile's chunks are, waiting while they are behind,
// so at most about twice the worker count of pieces are held at once. A Ref piece is checked and
// recorded at once: its chunk counts as deduplicated (LogicalBytes, DedupBytes and DedupChunks
// of the ingest's Stats, and progress), or as a zero chunk (ZeroBytes, ZeroChunks) when Zero.
//
// A path that is invalid or was added already is refused before next is called, without
// affecting the ingest. A bad piece (its size, both or neither of Data and Ref, a Ref that is
// inconsistent or not in the store), an error of next, or a failure of the ingest meanwhile
// fails the whole ingest and is returned, as by AddFile: a referenced chunk that HasChunk
// reported present and that is missing now was deleted behind the store's back (gc cannot remove
// it, see HasChunk), and such an image must not be written.
func (in *Ingest) AddChunks(path string, mode uint32, next func() (ChunkPiece, bool, error)) (int64, error) {
	return in.add(path, mode, func(f *ingestFile) (int64, error) { return in.addChunks(path, f, next) })
}

// HasChunk reports whether chunk c, as a manifest of this store records it (zero, or hash and
// size), can be referenced by AddChunks now: it is a valid chunk for the ingest's chunk size and,
// unless zero, its chunk file is in the store (a chunk only this ingest stored is not, before
// Commit). The ingest holds the store lock shared until Close, so gc cannot remove the chunk in
// between (only a deletion behind the store's back could).
func (in *Ingest) HasChunk(c Chunk) bool {
	if in.checkRef(&c) != nil {
		return false
	}
	if c.Zero {
		return true
	}
	_, err := in.s.checkChunk(c.Hash, c.Size)
	return err == nil
}

// addChunks adds f's pieces, returning the bytes added.
func (in *Ingest) addChunks(path string, f *ingestFile, next func() (ChunkPiece, bool, error)) (int64, error) {
	var off int64 // of the next piece
	short := -1   // size of the previous piece when it was shorter than a chunk: it had to be the last
	for {
		if err := in.failure(); err != nil {
			return off, err
		}
		p, ok, err := next()
		if err != nil {
			return off, fmt.Errorf("add %s: next piece at offset %d: %w", path, off, err)
		}
		if !ok {
			return off, nil
		}
		if short >= 0 {
			callRelease(p.Release)
			return off, fmt.Errorf("add %s: piece at offset %d: %d bytes, less than the chunk size %d, and not the last piece",
				path, off-int64(short), short, in.chunkSize)
		}
		size, err := in.checkPiece(&p)
		if err != nil {
			callRelease(p.Release)
			return off, fmt.Errorf("add %s: piece at offset %d: %w", path, off, err)
		}
		if p.Data != nil {
			err = in.hand(path, f, off, p.Data, p.Release)
		} else {
			callRelease(p.Release)
			err = in.addRef(path, f, off, p.Ref)
		}
		if err != nil {
			return off, err
		}
		if size < in.chunkSize {
			short = size
		}
		off += int64(size)
	}
}

// checkPiece checks a piece's form, not the store, and returns its size.
func (in *Ingest) checkPiece(p *ChunkPiece) (int, error) {
	switch {
	case p.Data != nil && p.Ref != nil:
		return 0, errors.New("both Data and Ref set")
	case p.Data != nil:
		if len(p.Data) == 0 || len(p.Data) > in.chunkSize {
			return 0, fmt.Errorf("%d bytes of data outside [1, %d] (the chunk size)", len(p.Data), in.chunkSize)
		}
		return len(p.Data), nil
	case p.Ref != nil:
		return p.Ref.Size, in.checkRef(p.Ref)
	default:
		return 0, errors.New("neither Data nor Ref set")
	}
}

// checkRef checks that c is a chunk entry a manifest of this ingest could hold.
func (in *Ingest) checkRef(c *Chunk) error {
	switch {
	case c.Size <= 0 || c.Size > in.chunkSize:
		return fmt.Errorf("referenced chunk of size %d outside [1, %d] (the chunk size)", c.Size, in.chunkSize)
	case c.Zero && c.Hash != ChunkID{}:
		return fmt.Errorf("referenced zero chunk has a hash (%s)", c.Hash)
	case !c.Zero && c.Hash == ChunkID{}:
		return errors.New("referenced chunk has no hash")
	}
	return nil
}

// addRef records the chunk of f at off as the existing chunk r (checked by checkRef).
//
// Bookkeeping, as putWork.store keeps it for a chunk it finds stored: the chunk is claimed, so a
// Data piece of the same content later is deduplicated against it, and its chunk file's size goes
// into sizes (unless already claimed: then whoever claimed it sets the size), so Commit records
// Stored as for any chunk. The chunk is marked found: Commit's second syncfs makes it durable
// should a concurrent writer have renamed it into place just now. It is not staged, so nothing is
// published for it; gc, verify, export and restore see an ordinary entry of the manifest. The
// ingest holds the store lock shared from NewIngest to Close, so gc cannot remove the chunk
// between this check and Commit.
func (in *Ingest) addRef(path string, f *ingestFile, off int64, r *Chunk) error {
	ch := &Chunk{Offset: off, Size: r.Size}
	if r.Zero {
		in.pw.zero(ch)
	} else {
		n, err := in.s.checkChunk(r.Hash, r.Size)
		if err != nil {
			return fmt.Errorf("add %s: piece at offset %d: %w", path, off, err)
		}
		ch.Hash = r.Hash
		pw := in.pw
		pw.mu.Lock()
		if !pw.claimed[ch.Hash] {
			pw.claimed[ch.Hash] = true
			pw.sizes[ch.Hash] = n
		}
		pw.mu.Unlock()
		pw.stage.markFound()
		in.c.chunks.Add(1)
		in.c.dedup.Add(int64(ch.Size))
		in.c.dedupChunks.Add(1)
	}
	f.chunks = append(f.chunks, ch)
	in.c.logical.Add(int64(ch.Size))
	in.c.done.Add(int64(ch.Size))
	return nil
}

// checkChunk checks, reading its header only, that the chunk file of id holds a chunk of size
// bytes: a regular file (not a symbolic link) of a size that fits, whose header records that
// length. It returns the file's size. A file that is missing or does not match is
// ErrChunkMissing; an I/O error is returned as such. The payload is checked when it is read.
func (s *Store) checkChunk(id ChunkID, size int) (int, error) {
	f, n, err := s.openChunkFile(id, size)
	if errors.Is(err, ErrCorrupt) {
		return 0, fmt.Errorf("%w: %v", ErrChunkMissing, err)
	}
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var h [chunkHeaderLen]byte
	if _, err := f.ReadAt(h[:], 0); err != nil {
		return 0, fmt.Errorf("read chunk %s: %w", id, err)
	}
	if string(h[:4]) != chunkMagic || binary.LittleEndian.Uint32(h[8:]) != uint32(size) {
		return 0, fmt.Errorf("%w: chunk %s: its header does not record a chunk of %d bytes", ErrChunkMissing, id, size)
	}
	return int(n), nil
}

// callRelease calls release unless it is nil.
func callRelease(release func()) {
	if release != nil {
		release()
	}
}
