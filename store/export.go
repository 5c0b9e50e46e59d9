package store

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"
)

// An export stream (docs/FORMAT.md) is the magic "PTXMIGX1" followed by records, each a type
// byte, a little-endian uint64 payload length and the payload:
//
//	'M'  the manifest, exactly as stored (sealed: it ends with its id; see auth.go)
//	'C'  32-byte chunk id, then the chunk file (header and payload)
//	'E'  uint64 number of 'C' records, then the 32-byte manifest id; ends the stream
const (
	exportMagic  = "PTXMIGX1"
	recManifest  = 'M'
	recChunk     = 'C'
	recEnd       = 'E'
	recHeaderLen = 9
)

// ErrBadStream marks a malformed or truncated export stream.
var ErrBadStream = errors.New("bad export stream")

// ImportOptions configures ImportWith.
type ImportOptions struct {
	Name    string // store under this name instead of the exported one (the id changes)
	Workers int
	// MemoryLimit bounds the import's memory: the manifest plus every worker's buffers (default
	// DefaultMemoryLimit); fewer workers run when Workers would exceed it.
	MemoryLimit int64
	// ExpectID, when set, is the id (or a prefix of at least 8 hex digits) the exported image
	// must have: the stream is refused unless its manifest is sealed and matches it. With Name the
	// check applies to the exported image, before it is renamed.
	ExpectID string
	Progress Progress // bytes of the stream's chunk data processed; total is the image's stored size
}

// Export writes image ref and every chunk it needs to w as one self-contained stream. Each chunk
// is verified before it is written.
func (s *Store) Export(ctx context.Context, ref string, w io.Writer) error {
	_, err := s.ExportWith(ctx, ref, w, GetOptions{})
	return err
}

// ExportWith is Export with options; the Stats count the bytes written to w as WrittenBytes.
func (s *Store) ExportWith(ctx context.Context, ref string, w io.Writer, o GetOptions) (*Stats, error) {
	start := time.Now()
	m, lk, err := s.getLocked(ctx, ref)
	if err != nil {
		return nil, fmt.Errorf("export %s: %w", ref, err)
	}
	defer lk.unlock()
	st, err := s.export(ctx, m, w, o, start)
	if err != nil {
		return nil, fmt.Errorf("export %s: %w", m.Name, err)
	}
	return st, nil
}

func (s *Store) export(ctx context.Context, m *Manifest, w io.Writer, o GetOptions, start time.Time) (*Stats, error) {
	raw, err := os.ReadFile(s.manifestPath(m.Name))
	if err != nil {
		return nil, err
	}
	if id, err := manifestIDOf(raw); err != nil || id != m.ID {
		return nil, fmt.Errorf("manifest changed while exporting")
	}
	workers, err := readWorkers(o.Workers, o.MemoryLimit, m, len(raw))
	if err != nil {
		return nil, err
	}
	var c counters
	c.logical.Add(m.LogicalBytes())
	bw := &countWriter{w: bufio.NewWriterSize(w, 1<<20)}
	bw.Write([]byte(exportMagic))
	writeRecord(bw, recManifest, raw)

	ids := m.ChunkIDs()
	uses, _ := sortedUses(m)
	var total int64
	for _, id := range ids {
		total += int64(uses[id][0].ch.Size)
	}
	stop := reportProgress(ctx, o.Progress, &c.done, total)
	defer stop()
	dec, err := newChunkDecoder(workers, maxChunkOf(m))
	if err != nil {
		return nil, err
	}
	defer dec.close()
	// Verify a batch of chunks in parallel, then write it in order.
	bufs := make([]chunkBufs, workers)
	for b := 0; b < len(ids); b += workers {
		batch := ids[b:min(b+workers, len(ids))]
		err := parallel(ctx, workers, len(batch), func() func(int) error {
			return func(i int) error {
				if i < 0 {
					return nil
				}
				u := uses[batch[i]][0]
				var err error
				bufs[i].file, err = s.readChunkFile(batch[i], u.ch.Size, dec.fileBuf(&bufs[i]))
				if err == nil {
					_, err = dec.decode(bufs[i].file, batch[i], u.ch.Size, &bufs[i])
				}
				if err != nil {
					return fmt.Errorf("file %s at offset %d: %w", u.file.Path, u.ch.Offset, err)
				}
				return nil
			}
		})
		if err != nil {
			return nil, err
		}
		for i, id := range batch {
			rec := make([]byte, 0, 32)
			rec = append(rec, id[:]...)
			writeRecordParts(bw, recChunk, rec, bufs[i].file)
			c.stored.Add(int64(len(bufs[i].file)))
			c.chunks.Add(1)
			c.done.Add(int64(uses[id][0].ch.Size))
		}
		if bw.err != nil {
			return nil, bw.err
		}
	}
	end := make([]byte, 8, 40)
	binary.LittleEndian.PutUint64(end, uint64(len(ids)))
	idb, _ := ParseChunkID(m.ID)
	writeRecord(bw, recEnd, append(end, idb[:]...))
	if err := bw.w.(*bufio.Writer).Flush(); err != nil && bw.err == nil {
		bw.err = err
	}
	if bw.err != nil {
		return nil, bw.err
	}
	c.written.Store(bw.n)
	return c.stats(time.Since(start)), nil
}

type countWriter struct {
	w   io.Writer
	n   int64
	err error
}

func (c *countWriter) Write(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.w.Write(p)
	c.n += int64(n)
	c.err = err
	return n, err
}

func writeRecord(w io.Writer, typ byte, payload []byte) { writeRecordParts(w, typ, payload, nil) }

func writeRecordParts(w io.Writer, typ byte, a, b []byte) {
	var h [recHeaderLen]byte
	h[0] = typ
	binary.LittleEndian.PutUint64(h[1:], uint64(len(a)+len(b)))
	w.Write(h[:])
	w.Write(a)
	w.Write(b)
}

// Import reads an export stream and stores the image, verifying every chunk and skipping chunks
// already present. The image's name must not exist (ErrExists). A truncated or corrupt stream
// leaves no image behind (at most unreferenced chunks, which GC removes).
func (s *Store) Import(ctx context.Context, r io.Reader) (*Manifest, error) {
	m, _, err := s.ImportWith(ctx, r, ImportOptions{})
	return m, err
}

// ImportWith is Import with options; Stats.WrittenBytes counts chunk bytes written to the store.
func (s *Store) ImportWith(ctx context.Context, r io.Reader, o ImportOptions) (*Manifest, *Stats, error) {
	start := time.Now()
	m, st, err := s.importStream(ctx, bufio.NewReaderSize(r, 1<<20), o, start)
	if err != nil {
		return nil, nil, fmt.Errorf("import: %w", err)
	}
	return m, st, nil
}

func readRecordHeader(r io.Reader) (byte, uint64, error) {
	var h [recHeaderLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return 0, 0, fmt.Errorf("%w: truncated (no end record)", ErrBadStream)
		}
		return 0, 0, err
	}
	return h[0], binary.LittleEndian.Uint64(h[1:]), nil
}

func readFull(r io.Reader, buf []byte) error {
	if _, err := io.ReadFull(r, buf); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return fmt.Errorf("%w: truncated record", ErrBadStream)
		}
		return err
	}
	return nil
}

func (s *Store) importStream(ctx context.Context, r io.Reader, o ImportOptions, start time.Time) (*Manifest, *Stats, error) {
	magic := make([]byte, len(exportMagic))
	if err := readFull(r, magic); err != nil {
		return nil, nil, err
	}
	if string(magic[:7]) != exportMagic[:7] {
		return nil, nil, fmt.Errorf("%w: not a ptxmig export (magic %q)", ErrBadStream, magic)
	}
	if magic[7] != exportMagic[7] {
		return nil, nil, fmt.Errorf("%w: export stream version %q, this ptxmig reads %q", ErrUnsupportedVersion, magic[7], exportMagic[7])
	}
	typ, n, err := readRecordHeader(r)
	if err != nil {
		return nil, nil, err
	}
	if typ != recManifest {
		return nil, nil, fmt.Errorf("%w: first record %q, want a manifest", ErrBadStream, typ)
	}
	if n > maxManifestBytes {
		return nil, nil, fmt.Errorf("%w: manifest record of %d bytes exceeds the limit of %d: refused before reading it", ErrBadStream, n, maxManifestBytes)
	}
	raw := make([]byte, n)
	if err := readFull(r, raw); err != nil {
		return nil, nil, err
	}
	m, err := DecodeManifest(raw)
	if err != nil {
		return nil, nil, err
	}
	exportedID := m.ID
	if err := checkExpectedID(m, o.ExpectID); err != nil {
		return nil, nil, err
	}
	if !m.Authenticated() {
		slog.Warn("importing an image that is not authenticated", "image", m.Name, "id", m.ID, "why", errNotAuthenticated)
	}
	if o.Name != "" {
		if err := ValidateName(o.Name); err != nil {
			return nil, nil, err
		}
		m.Name = o.Name
		if raw, m.ID, err = EncodeManifest(m); err != nil {
			return nil, nil, err
		}
		m.FormatVersion = FormatVersion
	}
	if _, err := os.Lstat(s.manifestPath(m.Name)); err == nil {
		return nil, nil, fmt.Errorf("%s: %w", m.Name, ErrExists)
	}
	// Every stored chunk the manifest references, with the one size it must have.
	needed := map[ChunkID]int{}
	var total int64
	for i := range m.Files {
		for _, ch := range m.Files[i].Chunks {
			if ch.Zero {
				continue
			}
			if sz, ok := needed[ch.Hash]; ok {
				if sz != ch.Size {
					return nil, nil, fmt.Errorf("%w: manifest lists chunk %s with sizes %d and %d", ErrCorrupt, ch.Hash, sz, ch.Size)
				}
				continue
			}
			needed[ch.Hash] = ch.Size
			total += int64(ch.Size)
		}
	}
	workers, err := readWorkers(o.Workers, o.MemoryLimit, m, len(raw))
	if err != nil {
		return nil, nil, err
	}
	lk, err := s.lockShared(ctx)
	if err != nil {
		return nil, nil, err
	}
	defer lk.unlock()
	stage, err := s.newChunkStage()
	if err != nil {
		return nil, nil, err
	}
	defer stage.close() // removes the temp files of a failed Import

	var c counters
	c.logical.Add(m.LogicalBytes())
	stop := reportProgress(ctx, o.Progress, &c.done, total)
	defer stop()
	dec, err := newChunkDecoder(workers, maxChunkOf(m))
	if err != nil {
		return nil, nil, err
	}
	defer dec.close()

	// The reader hands chunk records to workers, which verify and store them; chunk file buffers
	// circulate through free, so at most `workers` of them exist, each allocated once at the
	// size of the image's largest chunk file.
	type rec struct {
		id  ChunkID
		buf []byte
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	free := make(chan []byte, workers)
	for range workers {
		free <- nil
	}
	jobs := make(chan rec)
	got := map[ChunkID]bool{}
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var bufs chunkBufs
			for j := range jobs {
				size := needed[j.id]
				_, err := dec.decode(j.buf, j.id, size, &bufs)
				if err == nil {
					if fi, serr := os.Lstat(s.chunkPath(j.id)); serr == nil && fi.Mode().IsRegular() {
						c.dedup.Add(int64(size))
						c.dedupChunks.Add(1)
						stage.markFound()
					} else if err = stage.add(j.id, j.buf); err == nil {
						c.written.Add(int64(len(j.buf)))
					}
				}
				if err != nil {
					cancel(err)
				}
				c.chunks.Add(1)
				c.stored.Add(int64(len(j.buf)))
				c.done.Add(int64(size))
				free <- j.buf
			}
		}()
	}
	readErr := func() error {
		defer close(jobs)
		var count uint64
		for {
			if ctx.Err() != nil {
				return nil
			}
			typ, n, err := readRecordHeader(r)
			if err != nil {
				return err
			}
			switch typ {
			case recChunk:
				if n < 32+chunkHeaderLen || n > 32+chunkHeaderLen+MaxChunkSize {
					return fmt.Errorf("%w: chunk record of %d bytes", ErrBadStream, n)
				}
				var id ChunkID
				if err := readFull(r, id[:]); err != nil {
					return err
				}
				size, ok := needed[id]
				if !ok {
					return fmt.Errorf("%w: chunk %s is not part of image %s", ErrBadStream, id, m.Name)
				}
				if got[id] {
					return fmt.Errorf("%w: chunk %s sent twice", ErrBadStream, id)
				}
				if fileLen := n - 32; fileLen > uint64(chunkHeaderLen+maxEncodedLen(size)) {
					return fmt.Errorf("%w: chunk %s: record of %d bytes for a chunk of %d bytes: refused before reading it", ErrCorrupt, id, fileLen, size)
				}
				got[id] = true
				var buf []byte
				select {
				case buf = <-free:
				case <-ctx.Done():
					return nil
				}
				if cap(buf) == 0 {
					buf = dec.fileBuf(&chunkBufs{})
				}
				buf = buf[:n-32]
				if err := readFull(r, buf); err != nil {
					return err
				}
				count++
				select {
				case jobs <- rec{id, buf}:
				case <-ctx.Done():
					return nil
				}
			case recEnd:
				if n != 40 {
					return fmt.Errorf("%w: end record of %d bytes", ErrBadStream, n)
				}
				end := make([]byte, 40)
				if err := readFull(r, end); err != nil {
					return err
				}
				if k := binary.LittleEndian.Uint64(end); k != count {
					return fmt.Errorf("%w: end record counts %d chunks, stream had %d", ErrBadStream, k, count)
				}
				if id := ChunkID(end[8:]); id.String() != exportedID {
					return fmt.Errorf("%w: end record names image %s, manifest is %s", ErrBadStream, id, exportedID)
				}
				if k, _ := r.Read(make([]byte, 1)); k != 0 {
					return fmt.Errorf("%w: data after the end record", ErrBadStream)
				}
				return nil
			default:
				return fmt.Errorf("%w: unknown record type %q", ErrBadStream, typ)
			}
		}
	}()
	wg.Wait()
	if readErr != nil {
		return nil, nil, readErr
	}
	if err := context.Cause(ctx); err != nil {
		return nil, nil, err
	}
	// Chunks the exporter left out must already be here.
	for id := range needed {
		if got[id] {
			continue
		}
		if fi, err := os.Lstat(s.chunkPath(id)); err != nil || !fi.Mode().IsRegular() {
			return nil, nil, fmt.Errorf("%w: chunk %s neither in the stream nor in the store", ErrBadStream, id)
		}
		stage.markFound()
	}
	if err := stage.commit(); err != nil {
		return nil, nil, err
	}
	if err := s.writeNew(s.manifestPath(m.Name), raw); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil, nil, fmt.Errorf("%s: %w", m.Name, ErrExists)
		}
		return nil, nil, fmt.Errorf("write manifest: %w", err)
	}
	return m, c.stats(time.Since(start)), nil
}

// checkExpectedID refuses an imported manifest whose id is not the one expected.
func checkExpectedID(m *Manifest, want string) error {
	if want == "" {
		return nil
	}
	if len(want) < 8 || len(want) > 64 || strings.Trim(want, "0123456789abcdef") != "" {
		return fmt.Errorf("expected id %.80q: want 8 to 64 lower-case hex digits", want)
	}
	if !m.Authenticated() {
		return fmt.Errorf("%w: image %s (id %s) is not authenticated (manifest format %s), so its id proves nothing", ErrCorrupt, m.Name, m.ID, m.FormatVersion)
	}
	if !strings.HasPrefix(m.ID, want) {
		return fmt.Errorf("%w: the stream holds image %s with id %s, not the expected %s", ErrCorrupt, m.Name, m.ID, want)
	}
	return nil
}
