package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Streaming: CRIU's image files go into the store as they arrive over pipes (Ingest), and come
// out of it into pipes (ImageReader), with no copy of the image in a directory on either side.

// ingestFirstBuf is the size of a streamed file's first buffer; it doubles up to the chunk size
// as the file grows, so small files stay small.
const ingestFirstBuf = 64 << 10

// Ingest stores files that arrive as streams as one new image, with no staging copy of their
// bytes: each file is read chunk by chunk and every chunk is stored as Put stores it (all-zero
// chunks as holes, the others hashed, deduplicated, compressed and staged) by a bounded pool of
// workers. Commit publishes the staged chunks and then writes the manifest, so a failed,
// abandoned or interrupted ingest leaves no image, partial or whole.
//
// Use: NewIngest; AddFile (or AddChunks, for a file that arrives as chunk-sized buffers or as
// references to stored chunks: chunkref.go) for each file, concurrently, one goroutine per file;
// Commit; Close always (deferred). AddFile, AddChunks, HasChunk, Fail and Close are safe for
// concurrent use; Commit is called once.
//
// An Ingest holds the store lock shared from NewIngest to Close, like a Put. Its memory is the
// workers' (as a Put's) plus, for every file AddFile is adding, a buffer of up to one chunk
// (AddChunks's buffers are its caller's).
type Ingest struct {
	ctx       context.Context // the operation's: a cancelled ingest does not commit
	s         *Store
	m         *Manifest // all but Files, set by NewIngest
	pw        *putWork
	c         *counters
	lk        *lock
	start     time.Time
	chunkSize int

	jobs     chan ingestJob
	sendMu   sync.RWMutex   // held shared by hand while it sends a job, by Close to end the sends
	inflight sync.WaitGroup // chunks handed to the workers and not yet stored (or dropped)
	workers  sync.WaitGroup
	quit     chan struct{} // closed by Close: the workers exit
	failed   chan struct{} // closed by the first failure
	bufs     sync.Pool     // *[]byte of capacity chunkSize

	stopProgress func()
	stopCtx      func() bool

	commitMu sync.Mutex // held by Commit and Close
	mu       sync.Mutex
	err      error // the first failure
	files    map[string]*ingestFile
	rescues  []string // rescue records written (WriteRescue), removed by Close
	active   int      // AddFile calls running
	state    ingestState
	closed   bool
}

type ingestState int

const (
	ingestOpen       ingestState = iota
	ingestCommitting             // Commit was called: no more files
	ingestCommitted
	ingestClosed // closed without a successful Commit
)

// ingestFile is a file being added or added. Its fields are written only by its AddFile call.
type ingestFile struct {
	mode   uint32
	size   int64
	chunks []*Chunk // each filled in by a worker
	done   bool     // added completely (in.mu)
}

type ingestJob struct {
	path    string
	ch      *Chunk
	data    []byte
	release func() // when set, called instead of recycling data (an AddChunks caller's buffer)
}

// NewIngest starts storing files that arrive as streams as the new image o.Name. It validates
// the options as Put does (an existing name is ErrExists), except that o.Prestaged must be nil,
// takes the store lock shared (waiting for a running gc) and starts the workers. ctx bounds
// the whole ingest: when it ends, the ingest fails. o.Progress gets the bytes stored so far with a
// total of 0 (unknown).
func (s *Store) NewIngest(ctx context.Context, o PutOptions) (*Ingest, error) {
	in, err := s.newIngest(ctx, o)
	if err != nil {
		return nil, fmt.Errorf("ingest %s: %w", o.Name, err)
	}
	return in, nil
}

func (s *Store) newIngest(ctx context.Context, o PutOptions) (*Ingest, error) {
	start := time.Now()
	if o.Prestaged != nil {
		return nil, errors.New("a Prestage applies to a Put of a directory, not to an ingest")
	}
	m, workers, err := s.newImage(&o)
	if err != nil {
		return nil, err
	}
	encs := make([]*encoder, 0, workers)
	closeEncs := func() {
		for _, e := range encs {
			e.zw.Close()
		}
	}
	for range workers {
		enc, err := newEncoder(o.ChunkSize)
		if err != nil {
			closeEncs()
			return nil, err
		}
		encs = append(encs, enc)
	}
	lk, err := s.lockShared(ctx)
	if err != nil {
		closeEncs()
		return nil, err
	}
	stage, err := s.newChunkStage()
	if err != nil {
		lk.unlock()
		closeEncs()
		return nil, err
	}
	return s.startIngest(ctx, o, m, lk, stage, encs, start), nil
}

func (s *Store) startIngest(ctx context.Context, o PutOptions, m *Manifest, lk *lock, stage *chunkStage, encs []*encoder, start time.Time) *Ingest {
	c := &counters{}
	in := &Ingest{
		s: s, m: m, c: c, lk: lk, start: start, chunkSize: o.ChunkSize,
		pw:     &putWork{s: s, m: m, c: c, stage: stage, claimed: map[ChunkID]bool{}, sizes: map[ChunkID]int{}},
		jobs:   make(chan ingestJob, len(encs)),
		quit:   make(chan struct{}),
		failed: make(chan struct{}),
		files:  map[string]*ingestFile{},
	}
	for _, enc := range encs {
		in.workers.Add(1)
		go in.worker(enc)
	}
	in.stopProgress = sync.OnceFunc(reportProgress(ctx, o.Progress, &c.done, 0))
	in.stopCtx = context.AfterFunc(ctx, func() { in.fail(context.Cause(ctx)) })
	in.ctx = ctx
	return in
}

// worker stores the chunks handed over until Close; once the ingest failed it drops them, so
// a reader never waits on a failed ingest.
func (in *Ingest) worker(enc *encoder) {
	defer in.workers.Done()
	defer enc.zw.Close()
	var out []byte
	for {
		select {
		case j := <-in.jobs:
			if in.failure() == nil {
				var err error
				if out, err = in.pw.store(j.ch, j.data, out, enc); err != nil {
					in.fail(fmt.Errorf("store %s at offset %d: %w", j.path, j.ch.Offset, err))
				} else {
					in.c.done.Add(int64(j.ch.Size))
				}
			}
			in.finish(j)
		case <-in.quit:
			return
		}
	}
}

// finish gives back a job's buffer (to its owner, or to the pool) once it is stored or dropped.
func (in *Ingest) finish(j ingestJob) {
	if j.release != nil {
		j.release()
	} else {
		in.putBuf(j.data)
	}
	in.inflight.Done()
}

// AddFile reads r to its end and records it as the regular file path (a clean, relative path
// of the image's top directory: an ingest stores a flat directory) with the permission bits
// mode&0o777. It returns the bytes read.
//
// Files are added concurrently, one goroutine per file: a call never waits for another file's
// reader, only (briefly) for the workers when they are behind. A path that is invalid or was
// added already is refused without affecting the ingest. A read error, or a failure of the
// ingest meanwhile (a worker's error, Fail, the end of NewIngest's ctx, Close), fails the whole
// ingest and is returned; from then on every AddFile returns the first failure at once.
func (in *Ingest) AddFile(path string, mode uint32, r io.Reader) (int64, error) {
	return in.add(path, mode, func(f *ingestFile) (int64, error) { return in.read(path, f, r) })
}

// add registers the file path, fills it with fill and records its size; a failure of fill fails
// the ingest (AddFile, AddChunks).
func (in *Ingest) add(path string, mode uint32, fill func(f *ingestFile) (int64, error)) (int64, error) {
	f, err := in.begin(path, mode)
	if err != nil {
		return 0, fmt.Errorf("ingest %s: add %s: %w", in.m.Name, path, err)
	}
	defer in.end()
	n, err := fill(f)
	if err != nil {
		in.fail(err)
	}
	if err := in.failure(); err != nil {
		return n, in.wrap(err)
	}
	in.mu.Lock()
	f.size, f.done = n, true
	in.mu.Unlock()
	return n, nil
}

// begin registers a new file; end unregisters the call.
func (in *Ingest) begin(path string, mode uint32) (*ingestFile, error) {
	if err := validPath(path); err != nil {
		return nil, err
	}
	if strings.Contains(path, "/") {
		return nil, fmt.Errorf("path %q is in a subdirectory: an ingest stores a flat directory", path)
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	switch {
	case in.err != nil:
		return nil, in.err
	case in.state != ingestOpen:
		return nil, errors.New("ingest already committed or closed")
	case in.files[path] != nil:
		return nil, fmt.Errorf("file %s added twice", path)
	}
	f := &ingestFile{mode: mode & 0o777}
	in.files[path] = f
	in.active++
	return f, nil
}

func (in *Ingest) end() {
	in.mu.Lock()
	in.active--
	in.mu.Unlock()
}

// read splits r into chunks and hands each to the workers, returning the bytes read.
func (in *Ingest) read(path string, f *ingestFile, r io.Reader) (int64, error) {
	buf := make([]byte, 0, min(ingestFirstBuf, in.chunkSize))
	var off int64 // of buf's first byte
	for {
		if err := in.failure(); err != nil {
			return off + int64(len(buf)), err
		}
		if len(buf) == cap(buf) {
			if len(buf) == in.chunkSize {
				if err := in.hand(path, f, off, buf, nil); err != nil {
					return off + int64(len(buf)), err
				}
				off += int64(len(buf))
				buf = in.getBuf()
			} else {
				buf = in.grow(buf)
			}
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if err == io.EOF {
			break
		}
		if err != nil {
			return off + int64(len(buf)), fmt.Errorf("read %s at offset %d: %w", path, off+int64(len(buf)), err)
		}
	}
	total := off + int64(len(buf))
	if len(buf) > 0 {
		if err := in.hand(path, f, off, buf, nil); err != nil {
			return total, err
		}
	} else {
		in.putBuf(buf)
	}
	return total, nil
}

// hand gives the chunk of f at off, whose bytes are data, to the workers, waiting while they
// are behind (never for another file) unless the ingest fails. release (may be nil) is called
// once data is no longer used: by a worker, by Close for a job still queued, or here when the
// chunk is not handed over.
func (in *Ingest) hand(path string, f *ingestFile, off int64, data []byte, release func()) error {
	// Close waits for the sends under way and fails the ingest first, so no job is sent after it
	// drained the queue: every job is finished.
	in.sendMu.RLock()
	defer in.sendMu.RUnlock()
	if err := in.failure(); err != nil {
		callRelease(release)
		return err
	}
	ch := &Chunk{Offset: off, Size: len(data)}
	in.inflight.Add(1)
	select {
	case in.jobs <- ingestJob{path: path, ch: ch, data: data, release: release}:
	case <-in.failed:
		in.inflight.Done()
		callRelease(release)
		return in.failure()
	}
	f.chunks = append(f.chunks, ch)
	in.c.logical.Add(int64(len(data)))
	return nil
}

// grow returns a buffer twice as large as buf (at most a chunk) holding buf's bytes.
func (in *Ingest) grow(buf []byte) []byte {
	var nb []byte
	if n := min(2*cap(buf), in.chunkSize); n == in.chunkSize {
		nb = in.getBuf()
	} else {
		nb = make([]byte, 0, n)
	}
	return append(nb, buf...)
}

func (in *Ingest) getBuf() []byte {
	if b, ok := in.bufs.Get().(*[]byte); ok {
		return (*b)[:0]
	}
	return make([]byte, 0, in.chunkSize)
}

// putBuf recycles a chunk-sized buffer; smaller ones (a small file's) are left to the GC.
func (in *Ingest) putBuf(b []byte) {
	if cap(b) == in.chunkSize {
		b = b[:0]
		in.bufs.Put(&b)
	}
}

// Fail makes the ingest fail with err (a streamer's error elsewhere): running AddFile calls stop
// at their next chunk, and Commit returns err. The first failure sticks.
func (in *Ingest) Fail(err error) {
	if err == nil {
		err = errors.New("failed by the caller")
	}
	in.fail(err)
}

func (in *Ingest) fail(err error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.err == nil {
		in.err = err
		close(in.failed)
	}
}

// failure returns the first failure, if any.
func (in *Ingest) failure() error {
	select {
	case <-in.failed:
		in.mu.Lock()
		defer in.mu.Unlock()
		return in.err
	default:
		return nil
	}
}

func (in *Ingest) wrap(err error) error { return fmt.Errorf("ingest %s: %w", in.m.Name, err) }

// Commit waits until every chunk handed over is stored, then publishes the image: its files
// sorted by path as Put lists them, meta (when not nil) replacing the options' metadata. The
// staged chunks are made durable and renamed into place first, the manifest is written last.
// Commit fails, and so does the ingest, when an AddFile call is still running, when the ingest
// failed before (with that failure), or when the name was taken meanwhile (ErrExists). It is
// called once; Close follows in any case.
func (in *Ingest) Commit(meta Metadata) (*Manifest, *Stats, error) {
	in.commitMu.Lock()
	defer in.commitMu.Unlock()
	m, st, err := in.commit(meta)
	if err != nil {
		in.fail(err)
		return nil, nil, in.wrap(in.failure())
	}
	return m, st, nil
}

func (in *Ingest) commit(meta Metadata) (*Manifest, *Stats, error) {
	in.mu.Lock()
	switch {
	case in.err != nil:
		err := in.err
		in.mu.Unlock()
		return nil, nil, err
	case in.state != ingestOpen:
		in.mu.Unlock()
		return nil, nil, errors.New("commit called twice, or after Close")
	case in.active > 0:
		n := in.active
		in.mu.Unlock()
		return nil, nil, fmt.Errorf("commit while %d file(s) are still being added", n)
	}
	in.state = ingestCommitting
	in.mu.Unlock()

	// No AddFile runs and none can start: every chunk is handed over, and the workers store
	// (or, after a failure, drop) each.
	in.inflight.Wait()
	in.stopProgress()
	if err := in.failure(); err != nil {
		return nil, nil, err
	}
	// The AfterFunc that fails the ingest on cancellation runs in a goroutine of its own and may
	// not have run yet: a cancelled ingest never commits.
	if in.ctx.Err() != nil {
		return nil, nil, context.Cause(in.ctx)
	}
	m := in.m
	if meta != nil {
		if err := validateMeta(meta); err != nil {
			return nil, nil, fmt.Errorf("metadata: %w", err)
		}
		m.Meta = metaOrEmpty(meta)
	}
	paths := make([]string, 0, len(in.files))
	for p := range in.files {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		f := in.files[p]
		file := File{Path: p, Type: TypeFile, Mode: f.mode, Size: f.size}
		for _, ch := range f.chunks {
			c := *ch
			if !c.Zero {
				c.Stored = in.pw.sizes[c.Hash]
				in.c.stored.Add(int64(c.Stored))
			}
			file.Chunks = append(file.Chunks, c)
		}
		m.Files = append(m.Files, file)
	}
	if err := in.pw.stage.commit(); err != nil {
		return nil, nil, err
	}
	if err := in.s.commitManifest(m); err != nil {
		return nil, nil, err
	}
	in.mu.Lock()
	in.state = ingestCommitted
	in.mu.Unlock()
	// The image holds everything now: the rescue records served a rollback, which can no longer
	// happen (a crash right here leaves records of a committed image: gc removes those).
	in.removeRescues()
	return m, in.c.stats(time.Since(in.start)), nil
}

// removeRescues removes the ingest's rescue records (WriteRescue).
func (in *Ingest) removeRescues() {
	in.mu.Lock()
	defer in.mu.Unlock()
	for _, p := range in.rescues {
		_ = os.Remove(p)
	}
	in.rescues = nil
}

// errIngestClosed fails an ingest closed before it was committed.
var errIngestClosed = errors.New("closed without commit")

// Close ends the ingest: it stops the workers, and unless Commit succeeded it fails the ingest
// and removes every chunk it staged (no image is written); then it releases the store lock. An
// AddFile or AddChunks still running stops at its next chunk. Every AddChunks buffer handed over
// is released before Close returns. Safe to call more than once.
func (in *Ingest) Close() {
	in.commitMu.Lock()
	defer in.commitMu.Unlock()
	in.mu.Lock()
	if in.closed {
		in.mu.Unlock()
		return
	}
	in.closed = true
	committed := in.state == ingestCommitted
	if !committed {
		in.state = ingestClosed
	}
	in.mu.Unlock()
	if !committed {
		in.fail(errIngestClosed)
	}
	in.stopCtx()
	in.stopProgress()
	// No job is sent after the workers are told to quit: a running hand returns, as the ingest
	// failed (or, committed, none runs), and a later one sees the failure first.
	in.sendMu.Lock()
	close(in.quit)
	in.sendMu.Unlock()
	in.workers.Wait()
	for drained := false; !drained; { // jobs the workers left queued: their buffers go back
		select {
		case j := <-in.jobs:
			in.finish(j)
		default:
			drained = true
		}
	}
	// The records first, then what they name: a crash in between leaves staged files no record
	// names (gc removes them), never a record naming files that are gone.
	in.removeRescues()  // the writer is alive to the end: nothing to rescue
	in.pw.stage.close() // removes what was staged unless Commit published it
	in.lk.unlock()
}

// streamReadAhead is the number of decoded chunks per worker that WriteFile calls may keep ready
// ahead of their writers, all calls together (each call also has one of its own).
const streamReadAhead = 2

// readSlotMem is the memory of one read-ahead slot: a chunk file and its decoded bytes.
func readSlotMem(maxChunk int) int64 { return chunkHeaderLen + 2*int64(maxChunk) + decodeSlack }

// streamWorkerMem is one ImageReader worker's memory: a reading worker's buffers (VerifyRest,
// and the decode scratch buffer) and its share of the read-ahead.
func streamWorkerMem(maxChunk int) int64 {
	return readWorkerMem(maxChunk) + streamReadAhead*readSlotMem(maxChunk)
}

// streamZeros is written for zero chunks. It is not zeroBuf, which isZero relies on: a writer
// that broke io.Writer's contract and wrote into it would corrupt only the output.
var streamZeros = make([]byte, 256<<10)

// minMappedChunk: smaller chunks are read, not mapped (a mapping costs more than copying them).
const minMappedChunk = 64 << 10

// ImageReader serves an image's regular files as streams. Every chunk is read, decompressed and
// checked against its hash before any of its bytes are written; chunks verified so are
// remembered, and VerifyRest checks the rest. An ImageReader holds the store lock shared from
// OpenImage until Close, so gc cannot remove the image's chunks meanwhile. Its methods are safe
// for concurrent use.
type ImageReader struct {
	s       *Store
	m       *Manifest
	files   map[string]*File
	lk      *lock
	dec     *chunkDecoder
	workers int
	start   time.Time
	c       counters

	tokens chan *[]byte    // workers decoding: each token carries a decode scratch buffer
	slots  chan *readSlot  // the shared read-ahead
	spare  sync.Pool       // *readSlot: each WriteFile's own slot
	ctx    context.Context // canceled by Close
	cancel context.CancelFunc

	stopProgress func()

	mu       sync.Mutex
	verified map[ChunkID]bool
	deferred func(path string) bool // files VerifyRest leaves to a later WriteFile (DeferVerify)
	active   int                    // WriteFile and VerifyRest calls running
	closed   bool
}

// readSlot holds one chunk read ahead: its file and decoded bytes.
type readSlot struct {
	file, raw []byte
	shared    bool // from ImageReader.slots, else the call's own
}

// OpenImage opens the image ref for reading its files as streams: it takes the store lock
// shared and reads the manifest under it, as Materialize does, and warns when the image is not
// authenticated. o.Workers and o.MemoryLimit bound the workers, whose memory covers the manifest,
// the decode buffers and a read-ahead of a few chunks per worker shared by all WriteFile calls
// (each running call also keeps one chunk of its own). o.Progress gets the bytes written out of
// the image's logical size until Close.
func (s *Store) OpenImage(ctx context.Context, ref string, o GetOptions) (*ImageReader, error) {
	start := time.Now()
	m, lk, err := s.getLocked(ctx, ref)
	if err != nil {
		return nil, fmt.Errorf("open image %s: %w", ref, err)
	}
	if !m.Authenticated() {
		slog.Warn("image not authenticated", "image", m.Name, "id", m.ID, "why", errNotAuthenticated)
	}
	maxChunk := maxChunkOf(m)
	workers, err := readWorkersOf(o.Workers, o.MemoryLimit, m, 0, streamWorkerMem(maxChunk))
	if err != nil {
		lk.unlock()
		return nil, fmt.Errorf("open image %s: %w", m.Name, err)
	}
	dec, err := newChunkDecoder(workers, maxChunk)
	if err != nil {
		lk.unlock()
		return nil, fmt.Errorf("open image %s: %w", m.Name, err)
	}
	r := &ImageReader{s: s, m: m, files: map[string]*File{}, lk: lk, dec: dec, workers: workers, start: start,
		tokens: make(chan *[]byte, workers), slots: make(chan *readSlot, streamReadAhead*workers),
		verified: map[ChunkID]bool{}}
	for i := range m.Files {
		if f := &m.Files[i]; f.Type == TypeFile {
			r.files[f.Path] = f
		}
	}
	for range workers {
		r.tokens <- new([]byte)
	}
	for range cap(r.slots) {
		r.slots <- &readSlot{shared: true}
	}
	r.spare.New = func() any { return &readSlot{} }
	r.ctx, r.cancel = context.WithCancel(context.WithoutCancel(ctx))
	r.stopProgress = reportProgress(r.ctx, o.Progress, &r.c.done, m.LogicalBytes())
	return r, nil
}

// Manifest returns the image's manifest (shared: do not modify it).
func (r *ImageReader) Manifest() *Manifest { return r.m }

// Lookup returns the regular file path of the image.
func (r *ImageReader) Lookup(path string) (*File, bool) {
	f, ok := r.files[path]
	return f, ok
}

// Stats reports what the reader did so far: the bytes written out (LogicalBytes and
// WrittenBytes), the chunk-file bytes read for them (StoredBytes), the bytes of zero chunks
// written, the chunks written and the time since OpenImage.
func (r *ImageReader) Stats() *Stats { return r.c.stats(time.Since(r.start)) }

// acquire registers a call; release unregisters it and frees the reader after Close.
func (r *ImageReader) acquire() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return fmt.Errorf("image %s: reader closed", r.m.Name)
	}
	r.active++
	return nil
}

func (r *ImageReader) release() {
	r.mu.Lock()
	r.active--
	last := r.closed && r.active == 0
	r.mu.Unlock()
	if last {
		r.free()
	}
}

// Close cancels the running calls (each stops at its next chunk) and releases the store lock,
// at once or, when calls are still running, as the last one returns. Safe to call more than
// once.
func (r *ImageReader) Close() {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	r.closed = true
	last := r.active == 0
	r.mu.Unlock()
	r.cancel()
	if last {
		r.free()
	}
}

func (r *ImageReader) free() {
	r.stopProgress()
	r.dec.close()
	r.lk.unlock()
}

func (r *ImageReader) markVerified(id ChunkID) {
	r.mu.Lock()
	r.verified[id] = true
	r.mu.Unlock()
}

// pendingChunk is a chunk being read ahead; done is closed when data or err is set.
type pendingChunk struct {
	ch     *Chunk
	slot   *readSlot
	data   []byte // the decoded, verified chunk (in slot, or in mapped)
	mapped []byte // the chunk file's mapping when data lies in it (to be spliced, then unmapped)
	stored int    // chunk file bytes read
	err    error
	done   chan struct{}
}

// WriteFile writes the regular file path of the image to w, in order, and returns the bytes
// written. Chunks are read, decompressed and checked against their hashes ahead of the writer by
// up to the reader's worker count; zero chunks are written as zeros (w may be a pipe). A chunk
// that is missing or corrupt fails the call with an error wrapping ErrCorrupt that names the file
// and the chunk's offset, and nothing of that chunk or after it is written. An error of w is
// returned wrapped, naming the offset. Either way the read-ahead stops before WriteFile returns.
// Calls may run concurrently, for different files or the same one.
func (r *ImageReader) WriteFile(ctx context.Context, path string, w io.Writer) (int64, error) {
	f, ok := r.Lookup(path)
	if !ok {
		return 0, fmt.Errorf("image %s: file %s: %w", r.m.Name, path, fs.ErrNotExist)
	}
	if err := r.acquire(); err != nil {
		return 0, err
	}
	defer r.release()
	n, err := r.writeFile(ctx, f, w)
	if err != nil {
		return n, fmt.Errorf("image %s: %w", r.m.Name, err)
	}
	return n, nil
}

func (r *ImageReader) writeFile(ctx context.Context, f *File, w io.Writer) (int64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(r.ctx, cancel)
	defer stop()

	// The call holds at most every shared slot and its own, each in at most one queued chunk,
	// so sending to queue never blocks.
	queue := make(chan *pendingChunk, cap(r.slots)+1)
	own := make(chan *readSlot, 1)
	own <- r.spare.Get().(*readSlot)
	var decoders sync.WaitGroup
	sp := newSplicer(w)
	go r.readAhead(ctx, f, queue, own, &decoders, sp != nil)

	written, err := r.writeChunks(ctx, f, w, sp, queue, own)

	// Stop the read-ahead and wait for it: the dispatcher closes queue when it returns, and every
	// chunk it queued completes (decoded, or abandoned when ctx ended).
	cancel()
	for p := range queue {
		<-p.done
		r.releaseChunk(p, own)
	}
	decoders.Wait()
	r.spare.Put(<-own)
	return written, err
}

// writeChunks writes f's chunks to w in order, taking the non-zero ones from queue. With sp (w
// is a pipe), zeros and chunks stored raw are spliced instead of copied (splice.go).
func (r *ImageReader) writeChunks(ctx context.Context, f *File, w io.Writer, sp *splicer, queue <-chan *pendingChunk, own chan *readSlot) (int64, error) {
	var written int64
	for i := range f.Chunks {
		ch := &f.Chunks[i]
		if err := ctx.Err(); err != nil {
			return written, fmt.Errorf("file %s at offset %d: %w", f.Path, ch.Offset, err)
		}
		if ch.Zero {
			n, err := writeZeros(w, sp, ch.Size, func(k int, spliced bool) {
				r.wrote(int64(k))
				if spliced {
					r.c.spliced.Add(int64(k))
				}
			})
			written += int64(n)
			if err != nil {
				return written, fmt.Errorf("write %s at offset %d: %w", f.Path, ch.Offset+int64(n), err)
			}
			r.c.zero.Add(int64(ch.Size))
			r.c.zeroChunks.Add(1)
			r.c.chunks.Add(1)
			continue
		}
		p, ok := <-queue
		if !ok { // the read-ahead stopped: ctx ended
			return written, fmt.Errorf("file %s at offset %d: %w", f.Path, ch.Offset, context.Cause(ctx))
		}
		<-p.done
		if p.err != nil {
			r.releaseChunk(p, own)
			return written, fmt.Errorf("file %s at offset %d: %w", f.Path, ch.Offset, p.err)
		}
		var n int
		var err error
		if p.mapped != nil {
			n, err = sp.write(p.data)
			r.c.spliced.Add(int64(n))
		} else if n, err = w.Write(p.data); err == nil && n != len(p.data) {
			err = io.ErrShortWrite
		}
		r.releaseChunk(p, own)
		written += int64(n)
		r.wrote(int64(n))
		if err != nil {
			return written, fmt.Errorf("write %s at offset %d: %w", f.Path, ch.Offset+int64(n), err)
		}
		r.c.stored.Add(int64(p.stored))
		r.c.chunks.Add(1)
	}
	return written, nil
}

func (r *ImageReader) wrote(n int64) {
	r.c.logical.Add(n)
	r.c.written.Add(n)
	r.c.done.Add(n)
}

// readAhead queues f's non-zero chunks in order, each with a slot and a goroutine decoding into
// it; it waits for a slot when the call holds its own and no shared one is free (that is, only
// for this call's writer). With mapped, chunks stored raw are mapped instead of read (the writer
// splices them). It closes queue when done or when ctx ends.
func (r *ImageReader) readAhead(ctx context.Context, f *File, queue chan<- *pendingChunk, own chan *readSlot, decoders *sync.WaitGroup, mapped bool) {
	defer close(queue)
	next := 0 // first chunk not yet announced to the kernel
	for i := range f.Chunks {
		// Ask the kernel to start reading the chunk files ahead of the decoders: their reads are
		// otherwise only as parallel as the workers, and a cold store waits on each in turn.
		for ; next < len(f.Chunks) && next <= i+prefetchAhead; next++ {
			if c := &f.Chunks[next]; !c.Zero {
				r.s.prefetchChunk(c.Hash)
			}
		}
		ch := &f.Chunks[i]
		if ch.Zero {
			continue
		}
		var slot *readSlot
		select {
		case slot = <-own:
		default:
			select {
			case slot = <-own:
			case slot = <-r.slots:
			case <-ctx.Done():
				return
			}
		}
		if ctx.Err() != nil {
			r.releaseSlot(slot, own)
			return
		}
		p := &pendingChunk{ch: ch, slot: slot, done: make(chan struct{})}
		queue <- p
		decoders.Add(1)
		go func() {
			defer decoders.Done()
			defer close(p.done)
			if !mapped || ch.Size < minMappedChunk || !r.decodeMapped(ctx, p) {
				r.decodeInto(ctx, p)
			}
		}()
	}
}

// decodeInto reads, decodes and verifies p's chunk into its slot, as one of the reader's workers.
func (r *ImageReader) decodeInto(ctx context.Context, p *pendingChunk) {
	var tok *[]byte
	select {
	case tok = <-r.tokens:
	case <-ctx.Done():
		p.err = context.Cause(ctx)
		return
	}
	defer func() { r.tokens <- tok }()
	id, size := p.ch.Hash, p.ch.Size
	b := chunkBufs{file: p.slot.file, raw: p.slot.raw, scratch: *tok}
	var err error
	b.file, err = r.s.readChunkFile(id, size, r.dec.fileBuf(&b))
	if err == nil {
		p.data, err = r.dec.decode(b.file, id, size, &b)
	}
	// The decoded bytes alias b.file or b.raw (never the scratch buffer): the slot keeps both.
	p.slot.file, p.slot.raw, *tok = b.file, b.raw, b.scratch
	if err != nil {
		p.err = err
		return
	}
	p.stored = len(b.file)
	r.markVerified(id)
}

// decodeMapped is decodeInto through a locked mapping of the chunk file, for a chunk stored raw
// (no copy of it is read): its verified payload is left in the mapping for the writer to splice.
// It returns false, having done nothing, for a chunk that must be read instead (decodeInto).
func (r *ImageReader) decodeMapped(ctx context.Context, p *pendingChunk) bool {
	var tok *[]byte
	select {
	case tok = <-r.tokens:
	case <-ctx.Done():
		p.err = context.Cause(ctx)
		return true
	}
	defer func() { r.tokens <- tok }()
	id, size := p.ch.Hash, p.ch.Size
	m, err := r.s.mapRawChunk(id, size)
	if err != nil {
		p.err = err
		return true
	}
	if m == nil {
		return false
	}
	data, err := verifyMapped(m, id, size)
	if err != nil {
		_ = unix.Munmap(m)
		p.err = err
		return true
	}
	p.mapped, p.data, p.stored = m, data, len(m)
	r.markVerified(id)
	return true
}

// releaseChunk gives back what a queued chunk holds: its mapping and its slot.
func (r *ImageReader) releaseChunk(p *pendingChunk, own chan<- *readSlot) {
	if p.mapped != nil {
		_ = unix.Munmap(p.mapped)
		p.mapped, p.data = nil, nil
	}
	r.releaseSlot(p.slot, own)
}

func (r *ImageReader) releaseSlot(s *readSlot, own chan<- *readSlot) {
	if s.shared {
		r.slots <- s
	} else {
		own <- s
	}
}

// DeferVerify excludes the files for which skip is true from VerifyRest: their caller reads them
// all through WriteFile later (which verifies what it reads), after VerifyRest (a restore loads
// owned device memory after CRIU). A chunk also used by another file is still verified.
func (r *ImageReader) DeferVerify(skip func(path string) bool) {
	r.mu.Lock()
	r.deferred = skip
	r.mu.Unlock()
}

// deferredOnly: every use of a chunk is in a deferred file (r.mu held).
func (r *ImageReader) deferredOnly(uses []chunkUse) bool {
	if r.deferred == nil {
		return false
	}
	for _, u := range uses {
		if !r.deferred(u.file.Path) {
			return false
		}
	}
	return true
}

// VerifyRest reads, decodes and checks against its hash every stored chunk of the image that no
// WriteFile has verified yet, in parallel. The first bad chunk fails it with an error wrapping
// ErrCorrupt that names a file and offset where the chunk is used.
func (r *ImageReader) VerifyRest(ctx context.Context) error {
	if err := r.acquire(); err != nil {
		return err
	}
	defer r.release()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(r.ctx, cancel)
	defer stop()
	uses, order := sortedUses(r.m)
	r.mu.Lock()
	var todo []ChunkID
	for _, id := range order {
		if !r.verified[id] && !r.deferredOnly(uses[id]) {
			todo = append(todo, id)
		}
	}
	r.mu.Unlock()
	err := parallel(ctx, r.workers, len(todo), func() func(int) error {
		var bufs chunkBufs
		return func(i int) error {
			if i < 0 {
				return nil
			}
			id := todo[i]
			u := uses[id][0]
			var err error
			bufs.file, err = r.s.readChunkFile(id, u.ch.Size, r.dec.fileBuf(&bufs))
			if err == nil {
				_, err = r.dec.decode(bufs.file, id, u.ch.Size, &bufs)
			}
			for _, v := range uses[id][1:] {
				if err == nil && v.ch.Size != u.ch.Size {
					err = fmt.Errorf("%w: chunk %s listed with sizes %d and %d", ErrCorrupt, id, u.ch.Size, v.ch.Size)
				}
			}
			if err != nil {
				return fmt.Errorf("file %s at offset %d: %w", u.file.Path, u.ch.Offset, err)
			}
			r.markVerified(id)
			return nil
		}
	})
	if err != nil {
		return fmt.Errorf("verify %s: %w", r.m.Name, err)
	}
	return nil
}
