package store

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Prestage stores the chunks of a directory that another program is still writing (a CRIU dump
// in progress), so that the Put of that directory, once the writer is done, finds most chunks
// already hashed, encoded and written: storing overlaps the writer instead of following it.
//
// It polls the tree and hands every whole chunk that appeared since the last poll to a few
// workers that store it exactly as Put would, into Put's staging area (temp files, not published).
// Nothing it read is trusted later: Put (with PutOptions.Prestaged) re-reads and re-hashes every
// chunk of the finished tree and skips only the encode and write of a chunk whose hash the
// Prestage staged. A region the writer rewrote after it was read is therefore stored again, and a
// staged chunk the final image does not reference is deleted, never published.
//
// Use: Prestage, let the writer finish, Stop, then Put with Prestaged set; Close always, after
// the Put (then it only releases the lock). A Prestage holds the store lock shared from Prestage to
// Close, and that hold covers the Put; Prestage does not wait for a running gc (ErrBusy).
type Prestage struct {
	s         *Store
	dir       string // EvalSymlinks'd
	chunkSize int
	pw        *putWork
	lk        *lock
	cancel    context.CancelFunc
	done      chan struct{}

	mu     sync.Mutex
	staged map[ChunkID]int // chunks this Prestage encoded and staged: encoded size
	err    error           // first worker error; Put then stores what was not staged
	taken  bool            // a Put took over the staging area
	closed bool
	polls  int
}

// prestagePoll is how often the tree is rescanned for new whole chunks; prestageLockWait how
// long Prestage waits for the store lock (held exclusively only by gc).
const (
	prestagePoll     = 15 * time.Millisecond
	prestageLockWait = 100 * time.Millisecond
)

// ErrBusy: the store is locked exclusively (gc); Prestage does not wait for it.
var ErrBusy = errors.New("store busy (gc running)")

// Prestage starts storing dir's chunks while another program writes it. o.ChunkSize, o.Workers
// and o.MemoryLimit apply (give it fewer workers than the CPU count: the writer needs CPU too);
// the other options belong to the Put.
func (s *Store) Prestage(ctx context.Context, dir string, o PutOptions) (*Prestage, error) {
	if o.ChunkSize == 0 {
		o.ChunkSize = DefaultChunkSize
	}
	if o.ChunkSize < MinChunkSize || o.ChunkSize > MaxChunkSize {
		return nil, fmt.Errorf("prestage: chunk size %d outside [%d, %d]", o.ChunkSize, MinChunkSize, MaxChunkSize)
	}
	workers, err := workerCount(o.Workers, o.MemoryLimit, putWorkerMem(o.ChunkSize))
	if err != nil {
		return nil, fmt.Errorf("prestage: %w", err)
	}
	root, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return nil, fmt.Errorf("prestage: %w", err)
	}
	// Never wait for a gc: the caller's process may be frozen meanwhile. Without the lock the
	// caller simply stores after the dump, waiting for the lock then.
	lctx, cancel := context.WithTimeout(ctx, prestageLockWait)
	lk, err := s.lockShared(lctx)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("prestage: %w: %w", ErrBusy, err)
	}
	stage, err := s.newChunkStage()
	if err != nil {
		lk.unlock()
		return nil, fmt.Errorf("prestage: %w", err)
	}
	rctx, cancel := context.WithCancel(ctx)
	p := &Prestage{s: s, dir: root, chunkSize: o.ChunkSize, lk: lk, cancel: cancel, done: make(chan struct{}),
		staged: map[ChunkID]int{},
		pw:     &putWork{s: s, c: &counters{}, stage: stage, claimed: map[ChunkID]bool{}, sizes: map[ChunkID]int{}}}
	go p.run(rctx, workers)
	return p, nil
}

type preJob struct {
	path string
	off  int64
}

func (p *Prestage) run(ctx context.Context, workers int) {
	defer close(p.done)
	jobs := make(chan preJob, workers)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := p.worker(ctx, jobs); err != nil {
				p.fail(err)
			}
			for range jobs {
			}
		}()
	}
	next := map[string]int64{} // path → offset of the first chunk not queued yet
	t := time.NewTicker(prestagePoll)
	defer t.Stop()
	for {
		p.scan(ctx, next, jobs)
		select {
		case <-ctx.Done():
			close(jobs)
			wg.Wait()
			return
		case <-t.C:
		}
	}
}

// scan queues the whole chunks that appeared in regular files since the last scan. Errors (a file
// that vanished, a directory being created) only mean less is prestaged.
func (p *Prestage) scan(ctx context.Context, next map[string]int64, jobs chan<- preJob) {
	p.mu.Lock()
	p.polls++
	p.mu.Unlock()
	_ = filepath.WalkDir(p.dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return nil
		}
		off := next[path]
		for ; off+int64(p.chunkSize) <= fi.Size(); off += int64(p.chunkSize) {
			select {
			case jobs <- preJob{path, off}:
			case <-ctx.Done():
				return filepath.SkipAll
			}
		}
		next[path] = off
		return nil
	})
}

func (p *Prestage) worker(ctx context.Context, jobs <-chan preJob) error {
	enc, err := newEncoder(p.chunkSize)
	if err != nil {
		return err
	}
	defer enc.zw.Close()
	buf := make([]byte, p.chunkSize)
	var out []byte
	for j := range jobs {
		if ctx.Err() != nil {
			return nil
		}
		if out, err = p.chunk(j, buf, out, enc); err != nil {
			return err
		}
	}
	return nil
}

// chunk stores one whole chunk the way putWork.chunk does, recording what it staged.
func (p *Prestage) chunk(j preJob, data, out []byte, enc *encoder) ([]byte, error) {
	f, err := os.OpenFile(j.path, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return out, nil // gone or replaced: Put decides
	}
	n, _ := f.ReadAt(data, j.off)
	f.Close()
	if n != len(data) || isZero(data) {
		return out, nil
	}
	pw := p.pw
	h := HashChunk(data)
	pw.mu.Lock()
	dup := pw.claimed[h]
	pw.claimed[h] = true
	pw.mu.Unlock()
	if dup {
		return out, nil
	}
	if fi, err := os.Lstat(p.s.chunkPath(h)); err == nil && fi.Mode().IsRegular() {
		pw.setSize(h, int(fi.Size()))
		pw.stage.markFound()
		return out, nil
	}
	out = enc.encode(data, out)
	if err := pw.stage.add(h, out); err != nil {
		pw.mu.Lock()
		delete(pw.claimed, h) // not staged: Put stores it
		pw.mu.Unlock()
		return out, err
	}
	pw.setSize(h, len(out))
	p.mu.Lock()
	p.staged[h] = len(out)
	p.mu.Unlock()
	return out, nil
}

func (p *Prestage) fail(err error) {
	p.mu.Lock()
	if p.err == nil {
		p.err = err
	}
	p.mu.Unlock()
}

// Stop ends the polling and waits for the workers; what they staged stays for the Put. It
// returns the first worker error (informational: Put stores whatever was not staged).
func (p *Prestage) Stop() error {
	p.cancel()
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// PrestageStats describes what a Prestage did.
type PrestageStats struct {
	Chunks int   // chunks encoded and staged
	Bytes  int64 // their encoded size
	Polls  int   // scans of the tree
}

// Stats reports the Prestage's work so far.
func (p *Prestage) Stats() PrestageStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := PrestageStats{Chunks: len(p.staged), Polls: p.polls}
	for _, n := range p.staged {
		st.Bytes += int64(n)
	}
	return st
}

// Close stops the Prestage if needed, deletes its staged temp files unless a Put took them over,
// and releases its store lock. Safe to call more than once.
func (p *Prestage) Close() {
	_ = p.Stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	p.closed = true
	if !p.taken {
		p.pw.stage.close()
	}
	p.lk.unlock()
}

// errPrestageDir: PutOptions.Prestaged was started on another directory, store or chunk size.
var errPrestageDir = errors.New("prestage does not match the put")

// take hands the Prestage's staging state to the Put of root: the Put's putWork gets the stage
// and the claimed/size maps, and pre lists the staged chunks (encoded sizes).
func (p *Prestage) take(s *Store, root string, chunkSize int) (*putWork, map[ChunkID]int, error) {
	if err := p.Stop(); err != nil {
		slog.Debug("prestage stopped early; the put stores what was not staged", "err", err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || p.taken {
		return nil, nil, errors.New("prestage already closed or used")
	}
	if p.dir != root {
		return nil, nil, fmt.Errorf("%w: %s, not %s", errPrestageDir, p.dir, root)
	}
	if p.s.dir != s.dir || p.chunkSize != chunkSize {
		return nil, nil, fmt.Errorf("%w: store %s chunk size %d, not %s chunk size %d", errPrestageDir, p.s.dir, p.chunkSize, s.dir, chunkSize)
	}
	p.taken = true
	pre := make(map[ChunkID]int, len(p.staged))
	for h, n := range p.staged {
		pre[h] = n
	}
	return p.pw, pre, nil
}
