package store

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// Problem is one integrity failure: a file of the image, the offset of the bad chunk in it, the
// chunk, and what is wrong. Path "(manifest)" means the manifest itself is unreadable or was
// edited; Field then names what changed ("created", `files["core.img"].mode` …), one problem
// per field.
type Problem struct {
	Path   string `json:"path"`
	Offset int64  `json:"offset"`
	Chunk  string `json:"chunk,omitempty"`
	Field  string `json:"field,omitempty"`
	Err    string `json:"error"`
}

// VerifyReport is the result of re-reading an image.
type VerifyReport struct {
	ID       string    `json:"id,omitempty"`
	Name     string    `json:"name"`
	Files    int       `json:"files"`
	Chunks   int       `json:"chunks"`        // distinct stored chunks checked
	Bytes    int64     `json:"logical_bytes"` // logical bytes covered
	Problems []Problem `json:"problems"`
	// Authenticated: the manifest is sealed and matched its id (format 1.1). When false, Warnings
	// says so: a 1.0 image's chunks are checked, but nothing can show its manifest unedited.
	Authenticated bool          `json:"authenticated"`
	Warnings      []string      `json:"warnings,omitempty"`
	Duration      time.Duration `json:"duration_ns"`
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
			r := &VerifyReport{Name: ref, Problems: manifestProblems(err)}
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

// manifestProblems turns a manifest read error into problems: one per edited field when the
// manifest does not match its id, else one.
func manifestProblems(err error) []Problem {
	var mm *ManifestMismatchError
	if !errors.As(err, &mm) {
		return []Problem{{Path: "(manifest)", Err: err.Error()}}
	}
	ps := make([]Problem, 0, len(mm.Changes))
	for _, c := range mm.Changes {
		ps = append(ps, Problem{Path: "(manifest)", Field: c, Err: fmt.Sprintf("%s: changed since the image was written (the manifest does not match its id %s)", c, mm.ID)})
	}
	return ps
}

func (s *Store) verify(ctx context.Context, m *Manifest, o GetOptions) (*VerifyReport, error) {
	workers, err := readWorkers(o.Workers, o.MemoryLimit, m, 0)
	if err != nil {
		return nil, err
	}
	uses, order := sortedUses(m)
	r := &VerifyReport{ID: m.ID, Name: m.Name, Files: len(m.Files), Chunks: len(order), Bytes: m.LogicalBytes(), Authenticated: m.Authenticated()}
	if !r.Authenticated {
		r.Warnings = append(r.Warnings, errNotAuthenticated.Error())
		slog.Warn("image not authenticated", "image", m.Name, "id", m.ID, "why", errNotAuthenticated)
	}
	var total int64
	for _, id := range order {
		total += int64(uses[id][0].ch.Size)
	}
	var done = new(counters)
	stop := reportProgress(ctx, o.Progress, &done.done, total)
	dec, err := newChunkDecoder(workers, maxChunkOf(m))
	if err != nil {
		stop()
		return nil, err
	}
	defer dec.close()
	var mu sync.Mutex
	bad := map[ChunkID]string{}
	err = parallel(ctx, workers, len(order), func() func(int) error {
		var bufs chunkBufs
		return func(i int) error {
			if i < 0 {
				return nil
			}
			id := order[i]
			size := uses[id][0].ch.Size
			var err error
			bufs.file, err = s.readChunkFile(id, size, dec.fileBuf(&bufs))
			if err == nil {
				_, err = dec.decode(bufs.file, id, size, &bufs)
			}
			if err == nil {
				for _, u := range uses[id][1:] {
					if u.ch.Size != size {
						err = fmt.Errorf("%w: chunk %s listed with sizes %d and %d", ErrCorrupt, id, size, u.ch.Size)
						break
					}
				}
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
