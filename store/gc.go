package store

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// GCStats reports what GC did.
type GCStats struct {
	Images        int           `json:"images"`
	ChunksKept    int           `json:"chunks_kept"`
	ChunksRemoved int           `json:"chunks_removed"`
	BytesRemoved  int64         `json:"bytes_removed"`
	TempRemoved   int           `json:"temp_removed"`
	Duration      time.Duration `json:"duration_ns"`
}

// GC removes chunks no image references and temp files left by interrupted writers. It holds
// the store lock exclusively, so it waits for running Puts, Imports and reads, and they wait for
// it. It refuses to run while any manifest is unreadable, since it could not tell which chunks
// that image needs: remove or repair it first.
func (s *Store) GC(ctx context.Context) (*GCStats, error) {
	start := time.Now()
	lk, err := s.lockExclusive(ctx)
	if err != nil {
		return nil, fmt.Errorf("gc: %w", err)
	}
	defer lk.unlock()
	ms, bad, err := s.listAll()
	if err != nil {
		return nil, fmt.Errorf("gc: %w", err)
	}
	if len(bad) > 0 {
		return nil, fmt.Errorf("gc: refusing to run with %d unreadable image(s), first: %w", len(bad), bad[0])
	}
	live := map[ChunkID]bool{}
	for _, m := range ms {
		for _, id := range m.ChunkIDs() {
			live[id] = true
		}
	}
	st := &GCStats{Images: len(ms)}
	// Under the exclusive lock nobody is writing: every temp file is left over.
	tmps, err := os.ReadDir(s.tmpDir())
	if err != nil {
		return nil, fmt.Errorf("gc: %w", err)
	}
	for _, e := range tmps {
		if err := os.RemoveAll(filepath.Join(s.tmpDir(), e.Name())); err != nil {
			return nil, fmt.Errorf("gc: %w", err)
		}
		st.TempRemoved++
	}
	for i := range 256 {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("gc: %w", err)
		}
		dir := filepath.Join(s.dir, "chunks", fmt.Sprintf("%02x", i))
		ents, err := os.ReadDir(dir)
		if err != nil {
			return nil, fmt.Errorf("gc: %w", err)
		}
		removed := false
		for _, e := range ents {
			id, perr := ParseChunkID(e.Name())
			if perr == nil && live[id] && e.Type().IsRegular() {
				st.ChunksKept++
				continue
			}
			// Unreferenced, or not a chunk at all: nothing in chunks/ may be anything else.
			var size int64
			if fi, err := e.Info(); err == nil {
				size = fi.Size()
			}
			if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil && !errors.Is(err, os.ErrNotExist) {
				return nil, fmt.Errorf("gc: %w", err)
			}
			st.ChunksRemoved++
			st.BytesRemoved += size
			removed = true
		}
		if removed {
			if err := syncDir(dir); err != nil {
				return nil, fmt.Errorf("gc: %w", err)
			}
		}
	}
	st.Duration = time.Since(start)
	return st, nil
}
