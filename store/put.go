package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"sync"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// PutOptions configures Put.
type PutOptions struct {
	Name        string   // required; see ValidateName
	Parent      string   // optional: name or id of the image this one derives from
	Meta        Metadata // what the image records about itself (a JSON object, opaque to the store; empty: {})
	ChunkSize   int      // bytes per chunk; default DefaultChunkSize
	Workers     int      // parallel readers/hashers/compressors; default the CPU count
	MemoryLimit int64    // bound on chunk buffers; default DefaultMemoryLimit
	Progress    Progress // may be nil
	// Prestaged: a Prestage of the same directory, store and chunk size whose staged chunks this
	// Put reuses (after re-reading and re-hashing every chunk). Its store lock covers the Put;
	// the caller Closes it after the Put returns.
	Prestaged *Prestage
}

// GetOptions configures Materialize, Verify and Export.
type GetOptions struct {
	Workers     int
	MemoryLimit int64
	Progress    Progress
}

// DefaultMemoryLimit bounds the buffers of one Put or Get when no limit is given.
const DefaultMemoryLimit = 512 << 20

// putWorkerMem estimates one Put worker's memory: read buffer, output, shuffle buffer and the
// zstd encoder's tables and history.
func putWorkerMem(chunkSize int) int64 {
	return 3*int64(chunkSize) + int64(windowFor(chunkSize)) + 1<<20
}

// getWorkerMem estimates one Get worker's memory: chunk file, output and unshuffle buffers.
func getWorkerMem(chunkSize int) int64 { return 3*int64(chunkSize) + 1<<20 }

func workerCount(want int, limit int64, per int64) (int, error) {
	if want <= 0 {
		want = runtime.NumCPU()
	}
	if limit <= 0 {
		limit = DefaultMemoryLimit
	}
	n := int(min(int64(want), limit/per))
	if n < 1 {
		return 0, fmt.Errorf("memory limit %d bytes is below one worker's %d bytes: raise it or lower the chunk size", limit, per)
	}
	return n, nil
}

// source is a scanned regular file of the tree being stored.
type source struct {
	idx   int // index in Files
	abs   string
	size  int64
	mtime time.Time
}

// scanTree lists dir without following symlinks and returns the manifest entries (sorted) and
// the regular files to read.
func scanTree(dir string, chunkSize int) ([]File, []source, error) {
	var files []File
	var absPaths []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == dir {
			return nil
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if !utf8.ValidString(rel) {
			return fmt.Errorf("%s: %w: name is not valid UTF-8", p, ErrUnsupportedFile)
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		f := File{Path: rel, Mode: uint32(fi.Mode().Perm())}
		switch {
		case fi.Mode().IsRegular():
			f.Type, f.Size = TypeFile, fi.Size()
		case fi.IsDir():
			f.Type = TypeDir
		case fi.Mode()&fs.ModeSymlink != 0:
			t, err := os.Readlink(p)
			if err != nil {
				return err
			}
			if !utf8.ValidString(t) {
				return fmt.Errorf("%s: %w: symlink target is not valid UTF-8", p, ErrUnsupportedFile)
			}
			f.Type, f.Target, f.Mode = TypeSymlink, t, 0o777
		default:
			return fmt.Errorf("%s: %w: %s (only regular files, directories and symlinks are stored)", p, ErrUnsupportedFile, fi.Mode().Type())
		}
		files = append(files, f)
		absPaths = append(absPaths, p)
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("scan %s: %w", dir, err)
	}
	order := make([]int, len(files))
	for i := range order {
		order[i] = i
	}
	sort.Slice(order, func(a, b int) bool { return files[order[a]].Path < files[order[b]].Path })
	sorted := make([]File, len(files))
	var srcs []source
	for i, j := range order {
		sorted[i] = files[j]
		f := &sorted[i]
		if f.Type != TypeFile {
			continue
		}
		fi, err := os.Lstat(absPaths[j])
		if err != nil {
			return nil, nil, fmt.Errorf("scan %s: %w", dir, err)
		}
		for off := int64(0); off < f.Size; off += int64(chunkSize) {
			f.Chunks = append(f.Chunks, Chunk{Offset: off, Size: int(min(int64(chunkSize), f.Size-off))})
		}
		srcs = append(srcs, source{idx: i, abs: absPaths[j], size: f.Size, mtime: fi.ModTime()})
	}
	return sorted, srcs, nil
}

// Put stores the directory tree srcDir as a new image named o.Name. Symlinks are stored as
// links, never followed. The name must not exist (ErrExists). Chunks are written first and the
// manifest last, so a failed or interrupted Put leaves no partial image.
func (s *Store) Put(ctx context.Context, srcDir string, o PutOptions) (*Manifest, *Stats, error) {
	start := time.Now()
	m, st, err := s.put(ctx, srcDir, o, start)
	if err != nil {
		return nil, nil, fmt.Errorf("put %s from %s: %w", o.Name, srcDir, err)
	}
	return m, st, nil
}

// newImage checks the options of a new image (Put's and Ingest's): its name (ErrExists when
// taken), the chunk size (defaulted in o), the metadata and the parent. It returns the image's
// manifest without files and the number of workers that storing it may run.
func (s *Store) newImage(o *PutOptions) (*Manifest, int, error) {
	if err := ValidateName(o.Name); err != nil {
		return nil, 0, err
	}
	if _, err := os.Lstat(s.manifestPath(o.Name)); err == nil {
		return nil, 0, ErrExists
	}
	if o.ChunkSize == 0 {
		o.ChunkSize = DefaultChunkSize
	}
	if o.ChunkSize < MinChunkSize || o.ChunkSize > MaxChunkSize {
		return nil, 0, fmt.Errorf("chunk size %d outside [%d, %d]", o.ChunkSize, MinChunkSize, MaxChunkSize)
	}
	workers, err := workerCount(o.Workers, o.MemoryLimit, putWorkerMem(o.ChunkSize))
	if err != nil {
		return nil, 0, err
	}
	m := &Manifest{FormatVersion: FormatVersion, Name: o.Name, Created: time.Now().UTC().Truncate(time.Microsecond),
		Meta: metaOrEmpty(o.Meta), Hash: HashAlgorithm, ChunkSize: o.ChunkSize}
	if err := validateMeta(m.Meta); err != nil {
		return nil, 0, fmt.Errorf("metadata: %w", err)
	}
	if o.Parent != "" {
		p, err := s.Get(o.Parent)
		if err != nil {
			return nil, 0, fmt.Errorf("parent: %w", err)
		}
		m.Parent = p.ID
	}
	return m, workers, nil
}

func (s *Store) put(ctx context.Context, srcDir string, o PutOptions, start time.Time) (*Manifest, *Stats, error) {
	m, workers, err := s.newImage(&o)
	if err != nil {
		return nil, nil, err
	}
	root, err := filepath.EvalSymlinks(srcDir)
	if err != nil {
		return nil, nil, err
	}
	if fi, err := os.Stat(root); err != nil {
		return nil, nil, err
	} else if !fi.IsDir() {
		return nil, nil, fmt.Errorf("%s is not a directory", srcDir)
	}
	files, srcs, err := scanTree(root, o.ChunkSize)
	if err != nil {
		return nil, nil, err
	}
	m.Files = files

	var c counters
	pw := &putWork{s: s, m: m, c: &c, claimed: map[ChunkID]bool{}, sizes: map[ChunkID]int{}}
	if o.Prestaged != nil {
		// The Prestage's shared lock covers this Put (it is released by Close, after the Put).
		// Taking the lock again here could deadlock with a gc waiting between the two holds.
		pre, staged, err := o.Prestaged.take(s, root, o.ChunkSize)
		if err != nil {
			return nil, nil, err
		}
		pw.stage, pw.claimed, pw.sizes, pw.pre = pre.stage, pre.claimed, pre.sizes, staged
	} else {
		lk, err := s.lockShared(ctx)
		if err != nil {
			return nil, nil, err
		}
		defer lk.unlock()
		if pw.stage, err = s.newChunkStage(); err != nil {
			return nil, nil, err
		}
	}
	stage := pw.stage
	defer stage.close() // removes the temp files of a failed Put

	for _, src := range srcs {
		c.logical.Add(src.size)
	}
	stop := reportProgress(ctx, o.Progress, &c.done, c.logical.Load())
	err = pw.run(ctx, srcs, workers, o.ChunkSize)
	stop()
	if err != nil {
		return nil, nil, err
	}
	// A file that changed while it was read would be stored inconsistently: refuse.
	for _, src := range srcs {
		fi, err := os.Lstat(src.abs)
		if err != nil {
			return nil, nil, fmt.Errorf("%s changed during put: %w", src.abs, err)
		}
		if fi.Size() != src.size || !fi.ModTime().Equal(src.mtime) {
			return nil, nil, fmt.Errorf("%s changed during put (size %d → %d); retry on a quiescent directory", src.abs, src.size, fi.Size())
		}
	}
	for i := range m.Files {
		for j := range m.Files[i].Chunks {
			ch := &m.Files[i].Chunks[j]
			if !ch.Zero {
				ch.Stored = pw.sizes[ch.Hash]
				c.stored.Add(int64(ch.Stored))
			}
		}
	}
	if o.Prestaged != nil {
		// Staged chunks of regions the writer rewrote after the Prestage read them.
		used := map[ChunkID]bool{}
		for i := range m.Files {
			for _, ch := range m.Files[i].Chunks {
				if !ch.Zero {
					used[ch.Hash] = true
				}
			}
		}
		stage.keepOnly(used)
	}
	if err := stage.commit(); err != nil {
		return nil, nil, err
	}
	if err := s.commitManifest(m); err != nil {
		return nil, nil, err
	}
	return m, c.stats(time.Since(start)), nil
}

// commitManifest encodes m, sets its ID and writes it without replacing an existing image.
func (s *Store) commitManifest(m *Manifest) error {
	b, id, err := EncodeManifest(m)
	if err != nil {
		return err
	}
	if err := s.writeNew(s.manifestPath(m.Name), b); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return ErrExists
		}
		return fmt.Errorf("write manifest: %w", err)
	}
	m.ID = id
	return nil
}

type putWork struct {
	s     *Store
	m     *Manifest
	c     *counters
	stage *chunkStage

	mu      sync.Mutex
	claimed map[ChunkID]bool // chunks this Put writes or found stored
	sizes   map[ChunkID]int  // chunk file sizes
	pre     map[ChunkID]int  // staged by a Prestage and not yet counted: encoded size
}

type putJob struct {
	src *source
	ch  *Chunk
}

func (pw *putWork) run(ctx context.Context, srcs []source, workers, chunkSize int) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	jobs := make(chan putJob, workers)
	go func() {
		defer close(jobs)
		for i := range srcs {
			f := &pw.m.Files[srcs[i].idx]
			for j := range f.Chunks {
				select {
				case jobs <- putJob{&srcs[i], &f.Chunks[j]}:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := pw.worker(ctx, jobs, chunkSize); err != nil {
				cancel(err)
			}
			for range jobs { // drain so the producer ends
			}
		}()
	}
	wg.Wait()
	if err := context.Cause(ctx); err != nil {
		return err
	}
	return nil
}

func (pw *putWork) worker(ctx context.Context, jobs <-chan putJob, chunkSize int) error {
	enc, err := newEncoder(chunkSize)
	if err != nil {
		return err
	}
	defer enc.zw.Close()
	buf := make([]byte, chunkSize)
	var out []byte
	var f *os.File
	var fsrc *source
	defer func() {
		if f != nil {
			f.Close()
		}
	}()
	for j := range jobs {
		if ctx.Err() != nil {
			return nil
		}
		if fsrc != j.src {
			if f != nil {
				f.Close()
			}
			f, err = os.OpenFile(j.src.abs, os.O_RDONLY|unix.O_NOFOLLOW, 0)
			if err != nil {
				return err
			}
			fsrc = j.src
		}
		if out, err = pw.chunk(f, j, buf, out, enc); err != nil {
			return err
		}
		pw.c.done.Add(int64(j.ch.Size))
	}
	return nil
}

// chunk reads and stores one chunk; out is the reusable encode buffer.
func (pw *putWork) chunk(f *os.File, j putJob, buf, out []byte, enc *encoder) ([]byte, error) {
	ch, n := j.ch, j.ch.Size
	// A range inside a hole of a sparse file is zero without reading it.
	if next, err := unix.Seek(int(f.Fd()), ch.Offset, unix.SEEK_DATA); errors.Is(err, unix.ENXIO) || (err == nil && next >= ch.Offset+int64(n)) {
		pw.zero(ch)
		return out, nil
	}
	data := buf[:n]
	if k, err := f.ReadAt(data, ch.Offset); k != n {
		if err == io.EOF {
			err = fmt.Errorf("file shrank during put (%d bytes at offset %d)", k, ch.Offset)
		}
		return out, fmt.Errorf("read %s at %d: %w", j.src.abs, ch.Offset, err)
	}
	return pw.store(ch, data, out, enc)
}

// store records the chunk ch, whose bytes (all ch.Size of them) are data: an all-zero chunk as
// Zero; any other is hashed and deduplicated against the chunks this writer claimed and those in
// the store, or else encoded and staged. It updates the counters (not done) and returns the
// reusable encode buffer out. Put (after reading) and Ingest (for each chunk streamed) call it.
func (pw *putWork) store(ch *Chunk, data, out []byte, enc *encoder) ([]byte, error) {
	n := len(data)
	if isZero(data) {
		pw.zero(ch)
		return out, nil
	}
	pw.c.chunks.Add(1)
	ch.Hash = HashChunk(data)
	pw.mu.Lock()
	dup := pw.claimed[ch.Hash]
	pw.claimed[ch.Hash] = true
	pw.mu.Unlock()
	if !dup {
		if fi, err := os.Lstat(pw.s.chunkPath(ch.Hash)); err == nil && fi.Mode().IsRegular() {
			dup = true
			pw.setSize(ch.Hash, int(fi.Size()))
			pw.stage.markFound()
		}
	}
	if dup && pw.takePrestaged(ch.Hash) {
		return out, nil
	}
	if dup {
		pw.c.dedup.Add(int64(n))
		pw.c.dedupChunks.Add(1)
		return out, nil
	}
	out = enc.encode(data, out)
	if err := pw.stage.add(ch.Hash, out); err != nil {
		return out, err
	}
	pw.setSize(ch.Hash, len(out))
	pw.c.written.Add(int64(len(out)))
	return out, nil
}

// takePrestaged counts a chunk a Prestage staged as written by this Put, the first time one of
// its occurrences is met (later ones are deduplicated, as without a Prestage).
func (pw *putWork) takePrestaged(id ChunkID) bool {
	pw.mu.Lock()
	n, ok := pw.pre[id]
	delete(pw.pre, id)
	pw.mu.Unlock()
	if ok {
		pw.c.written.Add(int64(n))
	}
	return ok
}

// zero records ch as an all-zero chunk.
func (pw *putWork) zero(ch *Chunk) {
	ch.Zero = true
	pw.c.chunks.Add(1)
	pw.c.zero.Add(int64(ch.Size))
	pw.c.zeroChunks.Add(1)
}

func (pw *putWork) setSize(id ChunkID, n int) {
	pw.mu.Lock()
	pw.sizes[id] = n
	pw.mu.Unlock()
}
