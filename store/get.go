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
	"syscall"
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
	buf, err = readAll(f, n, buf)
	if err != nil {
		return buf, fmt.Errorf("read chunk %s: %w", id, err)
	}
	return buf, nil
}

// openChunkFile opens the chunk file of id (openChunkPath); it returns the file and its size.
func (s *Store) openChunkFile(id ChunkID, size int) (*os.File, int64, error) {
	f, n, err := openChunkPath(s.chunkPath(id), size)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil, 0, fmt.Errorf("%w: chunk %s missing", ErrCorrupt, id)
	case err != nil:
		return nil, 0, fmt.Errorf("read chunk %s: %w", id, err)
	}
	return f, n, nil
}

// openChunkPath opens a chunk file, in chunks/ or staged in tmp/ (openRegular), and checks that
// its size fits a chunk of size bytes; it returns the file and its size.
func openChunkPath(path string, size int) (*os.File, int64, error) {
	f, fi, err := openRegular(path)
	if err != nil {
		return nil, 0, err
	}
	if n := fi.Size(); n < chunkHeaderLen || n > chunkHeaderLen+int64(maxEncodedLen(size)) {
		f.Close()
		return nil, 0, fmt.Errorf("%w: file of %d bytes for a chunk of %d bytes", ErrCorrupt, n, size)
	}
	return f, fi.Size(), nil
}

// openRegular opens path for reading, never through a symbolic link and never waiting (a FIFO in
// a file's place is refused, not waited on for a writer), and checks that it is a regular file.
func openRegular(path string) (*os.File, fs.FileInfo, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, nil, fmt.Errorf("%w: %s is not a regular file (%s)", ErrCorrupt, path, fi.Mode().Type())
	}
	return f, fi, nil
}

// readAll reads the n bytes of f into buf (reusing its capacity).
func readAll(f *os.File, n int64, buf []byte) ([]byte, error) {
	if int64(cap(buf)) < n {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	_, err := io.ReadFull(f, buf)
	return buf, err
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
	root, created, err := openTarget(dstDir)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			cleanupTarget(root, dstDir, created)
		}
		root.Close()
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

// openTarget makes sure dir is an empty directory that this user owns, creating it (0700) when
// missing, and opens it as a Root; created reports whether it made it. The directory is opened
// once and checked to be the one examined, and everything after (filling, cleaning up) goes
// through the Root, never through the path again: a directory of another user could be renamed
// and its path pointed elsewhere (a symbolic link to /etc) while root writes or cleans up.
func openTarget(dir string) (root *os.Root, created bool, err error) {
	fi, err := os.Lstat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
			return nil, false, err
		}
		if err := os.Mkdir(dir, 0o700); err != nil {
			return nil, false, err
		}
		created = true
		if fi, err = os.Lstat(dir); err != nil {
			return nil, false, err
		}
	case err != nil:
		return nil, false, err
	}
	if !fi.IsDir() {
		return nil, false, fmt.Errorf("%w: %s exists and is not a directory", ErrNotEmpty, dir)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); !ok || int(st.Uid) != os.Geteuid() {
		owner := -1
		if ok {
			owner = int(st.Uid)
		}
		return nil, false, fmt.Errorf("%w: %s belongs to uid %d, not to this user (uid %d): its owner could move it "+
			"while the image is written; extract into a new path or a directory of your own", ErrUnsafeTarget, dir, owner, os.Geteuid())
	}
	if testHookTargetExamined != nil {
		testHookTargetExamined()
	}
	root, err = os.OpenRoot(dir)
	if err != nil {
		return nil, false, err
	}
	if now, err := root.Stat("."); err != nil || !os.SameFile(fi, now) {
		root.Close()
		return nil, false, fmt.Errorf("%w: %s changed while it was being opened", ErrUnsafeTarget, dir)
	}
	d, err := root.Open(".")
	if err != nil {
		root.Close()
		return nil, false, err
	}
	ents, err := d.ReadDir(1)
	d.Close()
	if err != nil && !errors.Is(err, io.EOF) {
		root.Close()
		return nil, false, err
	}
	if len(ents) > 0 {
		root.Close()
		return nil, false, fmt.Errorf("%w: %s is not empty", ErrNotEmpty, dir)
	}
	return root, created, nil
}

// testHookTargetExamined runs between openTarget's check of the path and its open (tests).
var testHookTargetExamined func()

// cleanupTarget removes what a failed materialize wrote, through root (RemoveAll does not follow
// links). Only real directories are made writable again: Chmod follows symlinks, and an image's
// symlink may point anywhere on the host. A directory it created is removed too (by its path:
// removing a name never touches what a link there points to).
func cleanupTarget(root *os.Root, dir string, created bool) {
	if d, err := root.Open("."); err == nil {
		ents, _ := d.ReadDir(-1)
		d.Close()
		for _, e := range ents {
			if e.Type().IsDir() {
				root.Chmod(e.Name(), 0o700) // a read-only directory would block RemoveAll
			}
			root.RemoveAll(e.Name())
		}
	}
	if created {
		os.Remove(dir)
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
