package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// readChunkFile reads the chunk file of id, which holds a chunk of size bytes, into buf (reusing
// its capacity). A file longer than a header plus size bytes is refused before it is read.
func (s *Store) readChunkFile(id ChunkID, size int, buf []byte) ([]byte, error) {
	f, n, err := s.openChunkFile(id, size)
	if err != nil {
		return buf, err
	}
	defer f.Close()
	if int64(cap(buf)) < n {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	if _, err := io.ReadFull(f, buf); err != nil {
		return buf, fmt.Errorf("read chunk %s: %w", id, err)
	}
	return buf, nil
}

// openChunkFile opens the chunk file of id (never through a symbolic link) and checks that it
// is a regular file whose size fits a chunk of size bytes; it returns the file and its size.
func (s *Store) openChunkFile(id ChunkID, size int) (*os.File, int64, error) {
	f, err := os.OpenFile(s.chunkPath(id), os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, 0, fmt.Errorf("%w: chunk %s missing", ErrCorrupt, id)
		}
		return nil, 0, fmt.Errorf("read chunk %s: %w", id, err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("read chunk %s: %w", id, err)
	}
	n := fi.Size()
	if !fi.Mode().IsRegular() || n < chunkHeaderLen || n > chunkHeaderLen+int64(maxEncodedLen(size)) {
		f.Close()
		return nil, 0, fmt.Errorf("%w: chunk %s: file of %d bytes for a chunk of %d bytes", ErrCorrupt, id, n, size)
	}
	return f, n, nil
}

// prefetchAhead is how many chunks a stream announces to the kernel before it reads them.
const prefetchAhead = 16

// prefetchChunk asks the kernel to read a chunk file into the page cache in the background
// (best effort: a missing or unreadable file is reported when it is read).
func (s *Store) prefetchChunk(id ChunkID) {
	fd, err := unix.Open(s.chunkPath(id), unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return
	}
	_ = unix.Fadvise(fd, 0, 0, unix.FADV_WILLNEED)
	unix.Close(fd)
}

// Materialize writes the image ref into dstDir, which must be missing or an empty directory.
// Every chunk is verified against its hash; on any error (ErrCorrupt names the file and offset)
// everything written is removed again. Zero chunks become holes, so sparse files stay sparse.
// Writes go through an os.Root on dstDir: nothing is written outside it and no symlink in it is
// followed.
func (s *Store) Materialize(ctx context.Context, ref, dstDir string, o GetOptions) (*Stats, error) {
	start := time.Now()
	m, lk, err := s.getLocked(ctx, ref)
	if err != nil {
		return nil, fmt.Errorf("materialize %s: %w", ref, err)
	}
	defer lk.unlock()
	if !m.Authenticated() {
		slog.Warn("image not authenticated", "image", m.Name, "id", m.ID, "why", errNotAuthenticated)
	}
	st, err := s.materialize(ctx, m, dstDir, o, start)
	if err != nil {
		return nil, fmt.Errorf("materialize %s into %s: %w", m.Name, dstDir, err)
	}
	return st, nil
}

// getLocked takes the store lock shared and reads the manifest of ref under it, so gc cannot
// remove the chunks of an image removed meanwhile. The caller unlocks; on error nothing is held.
func (s *Store) getLocked(ctx context.Context, ref string) (*Manifest, *lock, error) {
	lk, err := s.lockShared(ctx)
	if err != nil {
		return nil, nil, err
	}
	m, err := s.Get(ref)
	if err != nil {
		lk.unlock()
		return nil, nil, err
	}
	return m, lk, nil
}

func (s *Store) materialize(ctx context.Context, m *Manifest, dstDir string, o GetOptions, start time.Time) (st *Stats, err error) {
	workers, err := readWorkers(o.Workers, o.MemoryLimit, m, 0)
	if err != nil {
		return nil, err
	}
	created, err := prepareTarget(dstDir)
	if err != nil {
		return nil, err
	}
	root, err := os.OpenRoot(dstDir)
	if err != nil {
		return nil, err
	}
	defer func() {
		root.Close()
		if err != nil {
			cleanupTarget(dstDir, created)
		}
	}()
	var c counters
	// Skeleton: directories (0700 while writing), symlinks, empty files of the final size.
	for i := range m.Files {
		f := &m.Files[i]
		p := filepath.FromSlash(f.Path)
		switch f.Type {
		case TypeDir:
			err = root.Mkdir(p, 0o700)
		case TypeSymlink:
			err = root.Symlink(f.Target, p)
		case TypeFile:
			var fh *os.File
			fh, err = root.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
			if err == nil {
				err = fh.Truncate(f.Size)
				if cerr := fh.Close(); err == nil {
					err = cerr
				}
			}
			c.logical.Add(f.Size)
		}
		if err != nil {
			return nil, fmt.Errorf("create %s: %w", f.Path, err)
		}
	}
	stop := reportProgress(ctx, o.Progress, &c.done, c.logical.Load())
	err = s.fill(ctx, m, root, workers, &c)
	stop()
	if err != nil {
		return nil, err
	}
	// Final modes, deepest first so read-only directories do not block their children.
	for i := len(m.Files) - 1; i >= 0; i-- {
		f := &m.Files[i]
		if f.Type == TypeSymlink {
			continue
		}
		if err := root.Chmod(filepath.FromSlash(f.Path), fs.FileMode(f.Mode)); err != nil {
			return nil, fmt.Errorf("chmod %s: %w", f.Path, err)
		}
	}
	return c.stats(time.Since(start)), nil
}

// prepareTarget makes sure dir is an empty directory, creating it (0700) when missing; created
// reports whether it did.
func prepareTarget(dir string) (created bool, err error) {
	fi, err := os.Lstat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
			return false, err
		}
		if err := os.Mkdir(dir, 0o700); err != nil {
			return false, err
		}
		return true, nil
	case err != nil:
		return false, err
	case !fi.IsDir():
		return false, fmt.Errorf("%w: %s exists and is not a directory", ErrNotEmpty, dir)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return false, err
	}
	if len(ents) > 0 {
		return false, fmt.Errorf("%w: %s holds %d entries", ErrNotEmpty, dir, len(ents))
	}
	return false, nil
}

// cleanupTarget removes what a failed materialize wrote (os.RemoveAll does not follow links).
// Only real directories are made writable again: os.Chmod follows symlinks, and an image's
// symlink may point anywhere on the host.
func cleanupTarget(dir string, created bool) {
	if created {
		os.RemoveAll(dir)
		return
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		if e.Type().IsDir() {
			os.Chmod(p, 0o700) // a read-only directory would block RemoveAll
		}
		os.RemoveAll(p)
	}
}

// chunkUse is one place a chunk appears in an image.
type chunkUse struct {
	file *File
	ch   *Chunk
}

// fill writes every non-zero chunk of m into the skeleton under root.
func (s *Store) fill(ctx context.Context, m *Manifest, root *os.Root, workers int, c *counters) error {
	var jobs []chunkUse
	for i := range m.Files {
		f := &m.Files[i]
		for j := range f.Chunks {
			ch := &f.Chunks[j]
			c.chunks.Add(1)
			if ch.Zero {
				c.zero.Add(int64(ch.Size))
				c.zeroChunks.Add(1)
				c.done.Add(int64(ch.Size))
				continue
			}
			jobs = append(jobs, chunkUse{f, ch})
		}
	}
	dec, err := newChunkDecoder(workers, maxChunkOf(m))
	if err != nil {
		return err
	}
	defer dec.close()
	return parallel(ctx, workers, len(jobs), func() func(i int) error {
		var bufs chunkBufs
		var fh *os.File
		var cur *File
		return func(i int) (err error) {
			if i < 0 { // worker done
				if fh != nil {
					fh.Close()
				}
				return nil
			}
			u := jobs[i]
			var raw []byte
			bufs.file, err = s.readChunkFile(u.ch.Hash, u.ch.Size, dec.fileBuf(&bufs))
			if err == nil {
				raw, err = dec.decode(bufs.file, u.ch.Hash, u.ch.Size, &bufs)
			}
			if err != nil {
				return fmt.Errorf("file %s at offset %d: %w", u.file.Path, u.ch.Offset, err)
			}
			if cur != u.file {
				if fh != nil {
					fh.Close()
				}
				fh, err = root.OpenFile(filepath.FromSlash(u.file.Path), os.O_WRONLY|unix.O_NOFOLLOW, 0)
				if err != nil {
					return fmt.Errorf("open %s: %w", u.file.Path, err)
				}
				cur = u.file
			}
			n, err := writeSparse(fh, raw, u.ch.Offset)
			if err != nil {
				return fmt.Errorf("write %s at offset %d: %w", u.file.Path, u.ch.Offset, err)
			}
			c.written.Add(n)
			c.stored.Add(int64(len(bufs.file)))
			c.done.Add(int64(u.ch.Size))
			return nil
		}
	})
}

// sparseBlock is the granularity at which materialize leaves zero runs as holes.
const sparseBlock = 4096

// writeSparse writes data at off, skipping all-zero 4 KiB blocks (the file was truncated to size,
// so they read back as zeros and stay holes). It returns the bytes written.
func writeSparse(f *os.File, data []byte, off int64) (int64, error) {
	var written int64
	for i := 0; i < len(data); {
		end := min(i+sparseBlock, len(data))
		if isZero(data[i:end]) {
			i = end
			continue
		}
		j := end // extend the run over non-zero blocks
		for j < len(data) {
			e := min(j+sparseBlock, len(data))
			if isZero(data[j:e]) {
				break
			}
			j = e
		}
		if _, err := f.WriteAt(data[i:j], off+int64(i)); err != nil {
			return written, err
		}
		written += int64(j - i)
		i = j
	}
	return written, nil
}

// parallel runs n jobs on up to workers goroutines. newWorker is called once per goroutine and
// returns its job function, which is called with -1 when the goroutine ends. The first error
// cancels the rest and is returned.
func parallel(ctx context.Context, workers, n int, newWorker func() func(i int) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var next int
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range min(workers, max(n, 1)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn := newWorker()
			defer fn(-1)
			for ctx.Err() == nil {
				mu.Lock()
				i := next
				next++
				mu.Unlock()
				if i >= n {
					return
				}
				if err := fn(i); err != nil {
					cancel(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	return context.Cause(ctx)
}

// sortedUses groups the uses of each chunk, for reports in file order.
func sortedUses(m *Manifest) (map[ChunkID][]chunkUse, []ChunkID) {
	uses := map[ChunkID][]chunkUse{}
	var order []ChunkID
	for i := range m.Files {
		f := &m.Files[i]
		for j := range f.Chunks {
			ch := &f.Chunks[j]
			if ch.Zero {
				continue
			}
			if _, ok := uses[ch.Hash]; !ok {
				order = append(order, ch.Hash)
			}
			uses[ch.Hash] = append(uses[ch.Hash], chunkUse{f, ch})
		}
	}
	return uses, order
}
