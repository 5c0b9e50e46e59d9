package store

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sync"
	"time"
)

// An export stream (docs/FORMAT.md) is the magic "PTXMIGX1" followed by records, each a type
// byte, a little-endian uint64 payload length and the payload:
//
//	'M'  the manifest, exactly as stored (its id is the hash of these bytes)
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
	Name     string // store under this name instead of the exported one (the id changes)
	Workers  int
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
	workers, err := workerCount(o.Workers, o.MemoryLimit, getWorkerMem(m.ChunkSize))
	if err != nil {
		return nil, err
	}
	raw, err := os.ReadFile(s.manifestPath(m.Name))
	if err != nil {
		return nil, err
	}
	if manifestID(raw) != m.ID {
		return nil, fmt.Errorf("manifest changed while exporting")
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
	dec, err := newDecoder(workers)
	if err != nil {
		return nil, err
	}
	defer dec.close()
	// Verify a batch of chunks in parallel, then write it in order.
	files := make([][]byte, workers)
	raws := make([][]byte, workers)
	scratch := make([][]byte, workers)
	for b := 0; b < len(ids); b += workers {
		batch := ids[b:min(b+workers, len(ids))]
		err := parallel(ctx, workers, len(batch), func() func(int) error {
			return func(i int) error {
				if i < 0 {
					return nil
				}
				var err error
				files[i], err = s.readChunkFile(batch[i], files[i])
				if err == nil {
					raws[i], scratch[i], err = dec.decode(files[i], batch[i], raws[i], scratch[i])
				}
				if err != nil {
					u := uses[batch[i]][0]
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
			writeRecordParts(bw, recChunk, rec, files[i])
			c.stored.Add(int64(len(files[i])))
			c.chunks.Add(1)
			c.done.Add(int64(len(raws[i])))
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
	if typ != recManifest || n > maxManifestBytes {
		return nil, nil, fmt.Errorf("%w: first record %q of %d bytes, want a manifest", ErrBadStream, typ, n)
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
	if o.Name != "" {
		if err := ValidateName(o.Name); err != nil {
			return nil, nil, err
		}
		m.Name = o.Name
		if raw, m.ID, err = EncodeManifest(m); err != nil {
			return nil, nil, err
		}
	}
	if _, err := os.Lstat(s.manifestPath(m.Name)); err == nil {
		return nil, nil, fmt.Errorf("%s: %w", m.Name, ErrExists)
	}
	workers, err := workerCount(o.Workers, 0, getWorkerMem(m.ChunkSize))
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

	needed := map[ChunkID]int{} // id → raw size
	var total int64
	for i := range m.Files {
		for _, ch := range m.Files[i].Chunks {
			if !ch.Zero {
				if _, ok := needed[ch.Hash]; !ok {
					total += int64(ch.Size)
				}
				needed[ch.Hash] = ch.Size
			}
		}
	}
	var c counters
	c.logical.Add(m.LogicalBytes())
	stop := reportProgress(ctx, o.Progress, &c.done, total)
	defer stop()
	dec, err := newDecoder(workers)
	if err != nil {
		return nil, nil, err
	}
	defer dec.close()

	// The reader hands chunk records to workers, which verify and store them; buffers circulate
	// through free, bounding memory to `workers` chunk files.
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
			var out, scratch []byte
			for j := range jobs {
				var err error
				out, scratch, err = dec.decode(j.buf, j.id, out, scratch)
				if err == nil && len(out) != needed[j.id] {
					err = fmt.Errorf("%w: chunk %s holds %d bytes, manifest says %d", ErrCorrupt, j.id, len(out), needed[j.id])
				}
				if err == nil {
					if fi, serr := os.Lstat(s.chunkPath(j.id)); serr == nil && fi.Mode().IsRegular() {
						c.dedup.Add(int64(len(out)))
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
				c.done.Add(int64(len(out)))
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
				if _, ok := needed[id]; !ok {
					return fmt.Errorf("%w: chunk %s is not part of image %s", ErrBadStream, id, m.Name)
				}
				if got[id] {
					return fmt.Errorf("%w: chunk %s sent twice", ErrBadStream, id)
				}
				got[id] = true
				var buf []byte
				select {
				case buf = <-free:
				case <-ctx.Done():
					return nil
				}
				if uint64(cap(buf)) < n-32 {
					buf = make([]byte, n-32)
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
