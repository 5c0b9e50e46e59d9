package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"
)

// Reading back what an ingest holds before it commits: a checkpoint that released a process's
// owned device memory after storing it loads the memory back from its own ingest when it rolls
// back, or when it leaves the process running.

// ChunkSize is the ingest's chunk size.
func (in *Ingest) ChunkSize() int { return in.chunkSize }

// HasFile reports whether path was added to the ingest completely.
func (in *Ingest) HasFile(path string) bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	f := in.files[path]
	return f != nil && f.done
}

// WriteFile writes the file path, added to the ingest, to w: it waits until the chunks handed to
// the workers are stored, then reads each of the file's chunks back from the ingest's staged
// chunk files or the store's, decodes it and checks its hash, several chunks at once (in order
// to w). It works on a failed ingest too (what was stored stays staged until Close), not after
// Close.
func (in *Ingest) WriteFile(ctx context.Context, path string, w io.Writer) (int64, error) {
	in.mu.Lock()
	f := in.files[path]
	closed := in.closed
	in.mu.Unlock()
	if closed {
		return 0, fmt.Errorf("ingest %s: read %s: closed", in.m.Name, path)
	}
	if f == nil || !f.done {
		return 0, fmt.Errorf("ingest %s: read %s: not added", in.m.Name, path)
	}
	in.inflight.Wait()
	return in.s.writeChunks(ctx, "ingest "+in.m.Name, path, f.chunks, in.pw.stage.lookup(), w)
}

// writeChunks writes a file's chunks, in order, to w: each chunk is read from its staged temp
// file (staged, by hash) or from the store's chunk files, decoded and checked against its hash,
// several chunks at once. what names the source in errors.
func (s *Store) writeChunks(ctx context.Context, what, path string, chunks []*Chunk, staged map[ChunkID]string, w io.Writer) (int64, error) {
	workers := min(runtime.NumCPU(), 8)
	dec, err := newDecoder(workers)
	if err != nil {
		return 0, err
	}
	defer dec.close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		data []byte
		err  error
	}
	// Chunk i is decoded by a worker into results[i%window], which the writer waits for in order.
	window := 2 * workers
	slots := make([]chan result, window)
	for i := range slots {
		slots[i] = make(chan result, 1)
	}
	free := make(chan []byte, window)
	for range window {
		free <- nil
	}
	next := make(chan int)
	go func() {
		defer close(next)
		for i := range chunks {
			select {
			case next <- i:
			case <-ctx.Done():
				return
			}
		}
	}()
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var file, scratch []byte
			for i := range next {
				var buf []byte
				select {
				case buf = <-free:
				case <-ctx.Done():
					return
				}
				ch := chunks[i]
				var err error
				if ch.Zero {
					buf = append(buf[:0], make([]byte, ch.Size)...)
				} else {
					if tmp, ok := staged[ch.Hash]; ok {
						file, err = readFileInto(tmp, ch.Size, file)
						if errors.Is(err, os.ErrNotExist) {
							// Renamed into chunks/ by a commit that did not finish (a rescue
							// record's writer killed in Commit): read it there.
							file, err = s.readChunkFile(ch.Hash, ch.Size, file)
						}
					} else {
						file, err = s.readChunkFile(ch.Hash, ch.Size, file)
					}
					if err == nil {
						buf, scratch, err = dec.decode(file, ch.Hash, buf, scratch)
					}
					if err == nil && len(buf) != ch.Size {
						err = fmt.Errorf("%w: chunk %s holds %d bytes, listed with %d", ErrCorrupt, ch.Hash, len(buf), ch.Size)
					}
					if err != nil {
						err = fmt.Errorf("%s: read %s at offset %d: %w", what, path, ch.Offset, err)
					}
				}
				slots[i%window] <- result{buf, err}
			}
		}()
	}
	defer wg.Wait()
	defer cancel()
	var n int64
	for i := range chunks {
		var r result
		select {
		case r = <-slots[i%window]:
		case <-ctx.Done():
			return n, ctx.Err()
		}
		if r.err != nil {
			return n, r.err
		}
		m, err := w.Write(r.data)
		n += int64(m)
		free <- r.data
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// readFileInto reads a staged chunk file (openChunkPath) into buf; a missing one is
// fs.ErrNotExist.
func readFileInto(path string, size int, buf []byte) ([]byte, error) {
	f, n, err := openChunkPath(path, size)
	if err != nil {
		return buf, err
	}
	defer f.Close()
	return readAll(f, n, buf)
}

// lookup returns the temp file of every chunk staged so far.
func (cs *chunkStage) lookup() map[ChunkID]string {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	m := make(map[ChunkID]string, len(cs.staged))
	for _, t := range cs.staged {
		m[t.id] = t.tmp
	}
	return m
}

// FileWriter is what serves an image's files as streams: an ImageReader, or an Ingest before
// its commit.
type FileWriter interface {
	WriteFile(ctx context.Context, path string, w io.Writer) (int64, error)
}

// ReadFileLimit reads the file path of src into memory, failing once it holds more than max
// bytes (a small file read from an image: an index, a record).
func ReadFileLimit(ctx context.Context, src FileWriter, path string, max int64) ([]byte, error) {
	var b bytes.Buffer
	if _, err := src.WriteFile(ctx, path, &limitWriter{w: &b, n: max}); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// limitWriter fails once more than n bytes are written.
type limitWriter struct {
	w io.Writer
	n int64
}

func (l *limitWriter) Write(p []byte) (int, error) {
	if int64(len(p)) > l.n {
		return 0, fmt.Errorf("larger than the %d bytes expected", l.n)
	}
	l.n -= int64(len(p))
	return l.w.Write(p)
}
