package store

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ptxmig/ptxmig/internal/atomicfile"
)

// GCStats reports what GC did.
type GCStats struct {
	Images        int   `json:"images"`
	ChunksKept    int   `json:"chunks_kept"`
	ChunksRemoved int   `json:"chunks_removed"`
	BytesRemoved  int64 `json:"bytes_removed"`
	TempRemoved   int   `json:"temp_removed"`
	// StaleTemp lists the temp files of dead writers removed beside the store's own files (in the
	// store directory and images/: an export written there, say), also counted in TempRemoved.
	StaleTemp []string      `json:"stale_temp,omitempty"`
	Duration  time.Duration `json:"duration_ns"`
}

// DamagedImagesError is GC's refusal while damaged images exist: it cannot tell which chunks
// they need, so it removes nothing until each is removed (Remove) or repaired. It wraps the
// first image's error (ErrCorrupt, ErrUnsupportedVersion, …).
type DamagedImagesError struct{ Images []Damaged }

func (e *DamagedImagesError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "gc: refusing to run with %d unreadable image(s), whose chunks cannot be known (nothing was removed): ", len(e.Images))
	for i, d := range e.Images {
		if i == 3 {
			fmt.Fprintf(&b, "; and %d more", len(e.Images)-3)
			break
		}
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(d.Err.Error())
	}
	b.WriteString("; remove each (image rm NAME, which also removes a manifest that is not a regular file) or repair it first")
	return b.String()
}

func (e *DamagedImagesError) Unwrap() error { return e.Images[0].Err }

// Names returns the names of the damaged images.
func (e *DamagedImagesError) Names() []string {
	ns := make([]string, len(e.Images))
	for i, d := range e.Images {
		ns[i] = d.Name
	}
	return ns
}

// GC removes chunks no image references and temp files left by interrupted writers. It holds
// the store lock exclusively, so it waits for running Puts, Imports and reads, and they wait for
// it. It refuses to run while any manifest is unreadable, since it could not tell which chunks
// that image needs: remove or repair it first (the error is a *DamagedImagesError). Any manifest
// entry of images/ that is not a regular file (a symlink above all, never followed) counts as
// such an image. It also removes the temp files that dead writers (atomicfile's, e.g. an export
// written into the store directory) left in the store directory and in images/.
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
		return nil, &DamagedImagesError{Images: bad}
	}
	live := map[ChunkID]bool{}
	for _, m := range ms {
		for _, id := range m.ChunkIDs() {
			live[id] = true
		}
	}
	st := &GCStats{Images: len(ms)}
	// Rescue records of writers that died (docs/FORMAT.md) stay until a recovery has used them,
	// with the staged files and the chunks they name: they may hold a process's only copy.
	committed := map[string]*Manifest{}
	for _, m := range ms {
		committed[m.Name] = m
	}
	records, staged, rescued := s.rescuesInTmp(committed)
	for id := range rescued {
		live[id] = true
	}
	// Under the exclusive lock nobody is writing: every other temp file is left over.
	tmps, err := os.ReadDir(s.tmpDir())
	if err != nil {
		return nil, fmt.Errorf("gc: %w", err)
	}
	for _, e := range tmps {
		if records[e.Name()] || staged[e.Name()] {
			continue
		}
		if err := os.RemoveAll(filepath.Join(s.tmpDir(), e.Name())); err != nil {
			return nil, fmt.Errorf("gc: %w", err)
		}
		st.TempRemoved++
	}
	for _, dir := range []string{s.dir, s.imagesDir()} {
		removed, err := atomicfile.RemoveStale(dir, "")
		st.StaleTemp = append(st.StaleTemp, removed...)
		st.TempRemoved += len(removed)
		if err != nil {
			return nil, fmt.Errorf("gc: %w", err)
		}
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
