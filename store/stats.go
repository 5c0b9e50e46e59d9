package store

import (
	"context"
	"sync/atomic"
	"time"
)

// Progress receives the bytes done so far and the total; the store calls it from one goroutine
// at most every 100 ms and once at the end. The total is 0 when it is not known in advance (an
// Ingest, whose files arrive as streams). It may be nil.
type Progress func(doneBytes, totalBytes int64)

// Stats reports what a Put, Ingest, Materialize, ImageReader, Export or Import did.
type Stats struct {
	LogicalBytes int64         `json:"logical_bytes"` // bytes of the files
	WrittenBytes int64         `json:"written_bytes"` // bytes written to disk (chunk files on put, file data on materialize)
	ZeroBytes    int64         `json:"zero_bytes"`    // bytes in all-zero chunks, recorded as holes
	DedupBytes   int64         `json:"dedup_bytes"`   // bytes of chunks already stored
	StoredBytes  int64         `json:"stored_bytes"`  // chunk-file bytes this image references, per chunk occurrence
	Chunks       int           `json:"chunks"`
	DedupChunks  int           `json:"dedup_chunks"`
	ZeroChunks   int           `json:"zero_chunks"`
	SplicedBytes int64         `json:"spliced_bytes,omitempty"` // of the bytes written into pipes, those handed over by reference (vmsplice), not copied
	Duration     time.Duration `json:"duration_ns"`
}

// Ratio is logical bytes per stored byte (zero elimination and compression together).
func (s *Stats) Ratio() float64 {
	if s.StoredBytes == 0 {
		return 0
	}
	return float64(s.LogicalBytes) / float64(s.StoredBytes)
}

// CompressionRatio is non-zero logical bytes per stored byte.
func (s *Stats) CompressionRatio() float64 {
	if s.StoredBytes == 0 {
		return 0
	}
	return float64(s.LogicalBytes-s.ZeroBytes) / float64(s.StoredBytes)
}

// Throughput is logical bytes per second (decimal MB/s = Throughput()/1e6).
func (s *Stats) Throughput() float64 {
	if s.Duration <= 0 {
		return 0
	}
	return float64(s.LogicalBytes) / s.Duration.Seconds()
}

// counters are the atomic form of Stats shared by workers.
type counters struct {
	logical, written, zero, dedup, stored atomic.Int64
	chunks, dedupChunks, zeroChunks       atomic.Int64
	done                                  atomic.Int64 // progress
	spliced                               atomic.Int64
}

func (c *counters) stats(d time.Duration) *Stats {
	return &Stats{
		LogicalBytes: c.logical.Load(), WrittenBytes: c.written.Load(), ZeroBytes: c.zero.Load(),
		DedupBytes: c.dedup.Load(), StoredBytes: c.stored.Load(),
		Chunks: int(c.chunks.Load()), DedupChunks: int(c.dedupChunks.Load()), ZeroChunks: int(c.zeroChunks.Load()),
		SplicedBytes: c.spliced.Load(), Duration: d,
	}
}

// reportProgress calls p every 100 ms until ctx ends, then once more; it returns a stop func
// that waits for the final call.
func reportProgress(ctx context.Context, p Progress, done *atomic.Int64, total int64) (stop func()) {
	if p == nil {
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	fin := make(chan struct{})
	go func() {
		defer close(fin)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		p(0, total)
		for {
			select {
			case <-ctx.Done():
				p(done.Load(), total)
				return
			case <-t.C:
				p(done.Load(), total)
			}
		}
	}()
	return func() { cancel(); <-fin }
}
