package store

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"
)

// Problem is one integrity failure: a file of the image, the offset of the bad chunk in it, the
// chunk, and what is wrong. Path "(manifest)" means the manifest itself is unreadable.
type Problem struct {
	Path   string `json:"path"`
	Offset int64  `json:"offset"`
	Chunk  string `json:"chunk,omitempty"`
	Err    string `json:"error"`
}

// VerifyReport is the result of re-reading an image.
type VerifyReport struct {
	ID       string        `json:"id,omitempty"`
	Name     string        `json:"name"`
	Files    int           `json:"files"`
	Chunks   int           `json:"chunks"`        // distinct stored chunks checked
	Bytes    int64         `json:"logical_bytes"` // logical bytes covered
	Problems []Problem     `json:"problems"`
	Duration time.Duration `json:"duration_ns"`
}

// OK reports whether no problem was found.
func (r *VerifyReport) OK() bool { return len(r.Problems) == 0 }

// Verify re-reads every chunk of the image ref and checks its hash. When problems are found it
// returns the report together with an error wrapping ErrCorrupt that names the first one.
func (s *Store) Verify(ctx context.Context, ref string) (*VerifyReport, error) {
	return s.VerifyWith(ctx, ref, GetOptions{})
}

// VerifyWith is Verify with worker, memory and progress options.
func (s *Store) VerifyWith(ctx context.Context, ref string, o GetOptions) (*VerifyReport, error) {
	start := time.Now()
	m, lk, err := s.getLocked(ctx, ref)
	if err != nil {
		if errors.Is(err, ErrCorrupt) || errors.Is(err, ErrUnsupportedVersion) {
			r := &VerifyReport{Name: ref, Problems: []Problem{{Path: "(manifest)", Err: err.Error()}}}
			return r, fmt.Errorf("verify %s: %w", ref, err)
		}
		return nil, fmt.Errorf("verify %s: %w", ref, err)
	}
	defer lk.unlock()
	r, err := s.verify(ctx, m, o)
	if r != nil {
		r.Duration = time.Since(start)
	}
	return r, err
}

func (s *Store) verify(ctx context.Context, m *Manifest, o GetOptions) (*VerifyReport, error) {
	workers, err := workerCount(o.Workers, o.MemoryLimit, getWorkerMem(m.ChunkSize))
	if err != nil {
		return nil, err
	}
	uses, order := sortedUses(m)
	r := &VerifyReport{ID: m.ID, Name: m.Name, Files: len(m.Files), Chunks: len(order), Bytes: m.LogicalBytes()}
	var total int64
	for _, id := range order {
		total += int64(uses[id][0].ch.Size)
	}
	var done = new(counters)
	stop := reportProgress(ctx, o.Progress, &done.done, total)
	dec, err := newDecoder(workers)
	if err != nil {
		stop()
		return nil, err
	}
	defer dec.close()
	var mu sync.Mutex
	bad := map[ChunkID]string{}
	err = parallel(ctx, workers, len(order), func() func(int) error {
		var fileBuf, raw, scratch []byte
		return func(i int) error {
			if i < 0 {
				return nil
			}
			id := order[i]
			var err error
			fileBuf, err = s.readChunkFile(id, fileBuf)
			if err == nil {
				raw, scratch, err = dec.decode(fileBuf, id, raw, scratch)
			}
			if err == nil && len(raw) != uses[id][0].ch.Size {
				err = fmt.Errorf("%w: chunk %s holds %d bytes, manifest says %d", ErrCorrupt, id, len(raw), uses[id][0].ch.Size)
			}
			if err != nil {
				if !errors.Is(err, ErrCorrupt) {
					err = fmt.Errorf("%w: %v", ErrCorrupt, err)
				}
				mu.Lock()
				bad[id] = err.Error()
				mu.Unlock()
			}
			done.done.Add(int64(uses[id][0].ch.Size))
			return nil
		}
	})
	stop()
	if err != nil {
		return nil, fmt.Errorf("verify %s: %w", m.Name, err)
	}
	// Report in file order, every place a bad chunk is used.
	for i := range m.Files {
		f := &m.Files[i]
		for _, ch := range f.Chunks {
			if msg, ok := bad[ch.Hash]; ok && !ch.Zero {
				r.Problems = append(r.Problems, Problem{Path: f.Path, Offset: ch.Offset, Chunk: ch.Hash.String(), Err: msg})
			}
		}
	}
	if len(r.Problems) > 0 {
		var b strings.Builder
		for i, p := range r.Problems {
			if i == 3 {
				fmt.Fprintf(&b, "; and %d more", len(r.Problems)-3)
				break
			}
			if i > 0 {
				b.WriteString("; ")
			}
			fmt.Fprintf(&b, "%s at offset %d", p.Path, p.Offset)
		}
		return r, fmt.Errorf("verify %s: %w: %s", m.Name, ErrCorrupt, b.String())
	}
	return r, nil
}
