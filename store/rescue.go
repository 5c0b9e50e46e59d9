package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"github.com/ptxmig/ptxmig/internal/atomicfile"
)

// Rescue records let a later process read back files of an ingest whose writer died before it
// committed or closed it: a checkpoint that stored a process's owned device memory and released
// it, then was killed, leaves the memory's only copy in its ingest's staged chunks. The record
// lists those files' chunks (staged temp files by name, or the store's chunk files) and the
// caller's own data (Meta); it lives in the store's tmp/ directory with the staged chunks it
// names: Close of the ingest removes both; gc keeps a record that reads, with the staged files
// and the chunks it needs, until the recovery that used it removes it (Rescued.Remove).

// rescueVersion is the format version of a rescue record.
const rescueVersion = 1

// maxRescueBytes bounds a rescue record read back (its chunk lists: ~150 bytes a chunk).
const maxRescueBytes = 64 << 20

// rescueKeyRE is what a rescue record's key may be: it becomes part of a file name.
var rescueKeyRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

// stagedNameRE is a staged chunk's temp file name (chunkStage.add: CreateTemp "c-*").
var stagedNameRE = regexp.MustCompile(`^c-[0-9]{1,20}$`)

type rescueRecord struct {
	Version int             `json:"version"`
	Image   string          `json:"image"`
	Key     string          `json:"key"`
	Meta    json.RawMessage `json:"meta,omitempty"`
	Files   []rescueFile    `json:"files"`
}

type rescueFile struct {
	Path   string        `json:"path"`
	Chunks []rescueChunk `json:"chunks"`
}

type rescueChunk struct {
	Size   int     `json:"size"`
	Hash   ChunkID `json:"hash,omitzero"`
	Zero   bool    `json:"zero,omitempty"`
	Staged string  `json:"staged,omitempty"` // temp file in tmp/; "" for the chunk file in chunks/
}

func (s *Store) rescuePath(image, key string) string {
	return filepath.Join(s.tmpDir(), "rescue-"+image+"."+key+".json")
}

func checkRescueName(image, key string) error {
	if err := ValidateName(image); err != nil {
		return err
	}
	if !rescueKeyRE.MatchString(key) {
		return fmt.Errorf("rescue key %q: want 1-64 of [A-Za-z0-9._-], not starting with . _ or -", key)
	}
	return nil
}

// WriteRescue writes, durably, a rescue record of the ingest's files paths (each added
// completely) under key, with the caller's meta: after it returns, a process that finds the
// ingest's writer dead can read those files with ReadRescue, until gc. It waits for the chunks
// handed to the workers to be stored. A second record under the same key replaces the first.
func (in *Ingest) WriteRescue(key string, meta []byte, paths []string) error {
	if err := checkRescueName(in.m.Name, key); err != nil {
		return fmt.Errorf("ingest %s: rescue: %w", in.m.Name, err)
	}
	in.mu.Lock()
	closed := in.closed
	files := make([]*ingestFile, len(paths))
	for i, p := range paths {
		files[i] = in.files[p]
	}
	in.mu.Unlock()
	if closed {
		return fmt.Errorf("ingest %s: rescue: closed", in.m.Name)
	}
	for i, f := range files {
		if f == nil || !f.done {
			return fmt.Errorf("ingest %s: rescue %s: not added", in.m.Name, paths[i])
		}
	}
	in.inflight.Wait()
	if err := in.failure(); err != nil {
		return fmt.Errorf("ingest %s: rescue: %w", in.m.Name, err)
	}
	staged := in.pw.stage.lookup()
	rec := rescueRecord{Version: rescueVersion, Image: in.m.Name, Key: key, Meta: meta}
	for i, f := range files {
		rf := rescueFile{Path: paths[i]}
		for _, ch := range f.chunks {
			c := rescueChunk{Size: ch.Size, Hash: ch.Hash, Zero: ch.Zero}
			if tmp, ok := staged[ch.Hash]; ok && !ch.Zero {
				c.Staged = filepath.Base(tmp)
			}
			rf.Chunks = append(rf.Chunks, c)
		}
		rec.Files = append(rec.Files, rf)
	}
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	path := in.s.rescuePath(in.m.Name, key)
	if err := atomicfile.WriteFile(path, b, 0o600); err != nil {
		return fmt.Errorf("ingest %s: write rescue record: %w", in.m.Name, err)
	}
	in.mu.Lock()
	in.rescues = append(in.rescues, path)
	in.mu.Unlock()
	return nil
}

// Rescued serves the files of a rescue record: Meta is the writer's data; WriteFile writes one of
// the record's files. It holds the store lock shared until Close, so gc cannot remove the staged
// chunks meanwhile.
type Rescued struct {
	s     *Store
	lk    *lock
	Meta  []byte
	image string // the ingest's image name
	name  string
	path  string
	files map[string][]*Chunk
	stage map[ChunkID]string
}

// ReadRescue opens the rescue record that an ingest of image wrote under key (os.ErrNotExist
// when there is none: the writer wrote none, or its ingest was closed, or gc ran). Every field is
// checked: the record is read from disk, and a staged name can only name a file in tmp/.
func (s *Store) ReadRescue(ctx context.Context, image, key string) (*Rescued, error) {
	if err := checkRescueName(image, key); err != nil {
		return nil, fmt.Errorf("rescue: %w", err)
	}
	lk, err := s.lockShared(ctx)
	if err != nil {
		return nil, err
	}
	r, err := s.readRescue(image, key)
	if err != nil {
		lk.unlock()
		return nil, err
	}
	r.lk = lk
	return r, nil
}

func (s *Store) readRescue(image, key string) (*Rescued, error) {
	path := s.rescuePath(image, key)
	f, _, err := openRegular(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxRescueBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: rescue record %s: %s", ErrCorrupt, path, fmt.Sprintf(format, a...))
	}
	if len(b) > maxRescueBytes {
		return nil, bad("larger than %d bytes", maxRescueBytes)
	}
	var rec rescueRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		return nil, bad("%v", err)
	}
	if rec.Version != rescueVersion || rec.Image != image || rec.Key != key {
		return nil, bad("version %d of image %q, key %q; want version %d of %q, %q", rec.Version, rec.Image, rec.Key, rescueVersion, image, key)
	}
	r := &Rescued{s: s, Meta: rec.Meta, image: image, name: image + "." + key, path: path, files: map[string][]*Chunk{}, stage: map[ChunkID]string{}}
	for _, rf := range rec.Files {
		if rf.Path == "" || strings.ContainsRune(rf.Path, 0) || r.files[rf.Path] != nil {
			return nil, bad("file %q: empty, or listed twice", rf.Path)
		}
		chunks := make([]*Chunk, 0, len(rf.Chunks))
		var off int64
		for i, c := range rf.Chunks {
			if c.Size <= 0 || c.Size > MaxChunkSize {
				return nil, bad("%s: chunk %d of %d bytes", rf.Path, i, c.Size)
			}
			if c.Staged != "" {
				if c.Zero || !stagedNameRE.MatchString(c.Staged) {
					return nil, bad("%s: chunk %d staged as %q", rf.Path, i, c.Staged)
				}
				r.stage[c.Hash] = filepath.Join(s.tmpDir(), c.Staged)
			}
			chunks = append(chunks, &Chunk{Offset: off, Size: c.Size, Hash: c.Hash, Zero: c.Zero})
			off += int64(c.Size)
		}
		if len(chunks) == 0 {
			chunks = []*Chunk{} // an empty file
		}
		r.files[rf.Path] = chunks
	}
	return r, nil
}

// WriteFile writes the record's file path to w, every chunk checked against its hash.
func (r *Rescued) WriteFile(ctx context.Context, path string, w io.Writer) (int64, error) {
	chunks, ok := r.files[path]
	if !ok {
		return 0, fmt.Errorf("rescue %s: read %s: %w", r.name, path, os.ErrNotExist)
	}
	return r.s.writeChunks(ctx, "rescue "+r.name, path, chunks, r.stage, w)
}

// Remove deletes the record (its staged chunks are left to gc): the caller has what it rescued,
// or nothing is left to rescue it for.
func (r *Rescued) Remove() error {
	if err := os.Remove(r.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// RemoveRescue deletes the rescue record of image under key, if there is one.
func (s *Store) RemoveRescue(image, key string) error {
	if err := checkRescueName(image, key); err != nil {
		return fmt.Errorf("rescue: %w", err)
	}
	if err := os.Remove(s.rescuePath(image, key)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// rescuesInTmp reads every rescue record in tmp/ for gc: the staged files they name (base names)
// and the chunks they need, which gc keeps. A record that does not read is not kept (nor is
// anything it would name): it could not serve a recovery; nor is the record of an image in
// committed that holds every file the record names (a writer that died between its commit and
// removing its records: the image holds everything). Another ingest of the same name (started
// before the commit) has files of its own, which the image does not hold: its record stays.
func (s *Store) rescuesInTmp(committed map[string]*Manifest) (records, staged map[string]bool, chunks map[ChunkID]bool) {
	records, staged, chunks = map[string]bool{}, map[string]bool{}, map[ChunkID]bool{}
	ents, err := os.ReadDir(s.tmpDir())
	if err != nil {
		return
	}
	for _, e := range ents {
		rest, ok := strings.CutPrefix(e.Name(), "rescue-")
		if !ok || !e.Type().IsRegular() {
			continue
		}
		rest, ok = strings.CutSuffix(rest, ".json")
		if !ok {
			continue
		}
		// NAME.KEY: both may hold dots; the record itself says which split is its own.
		var r *Rescued
		for i := strings.IndexByte(rest, '.'); i > 0 && r == nil; i = nextDot(rest, i) {
			if checkRescueName(rest[:i], rest[i+1:]) == nil {
				r, _ = s.readRescue(rest[:i], rest[i+1:])
			}
		}
		if r == nil || r.heldBy(committed[r.image]) {
			continue
		}
		records[e.Name()] = true
		for _, chunks2 := range r.files {
			for _, c := range chunks2 {
				if !c.Zero {
					chunks[c.Hash] = true
				}
			}
		}
		for _, p := range r.stage {
			staged[filepath.Base(p)] = true
		}
	}
	return
}

// heldBy reports whether image m holds each file of the record, chunk for chunk.
func (r *Rescued) heldBy(m *Manifest) bool {
	if m == nil {
		return false
	}
	files := make(map[string][]Chunk, len(m.Files))
	for _, f := range m.Files {
		files[f.Path] = f.Chunks
	}
	for p, chunks := range r.files {
		have, ok := files[p]
		if !ok || len(have) != len(chunks) {
			return false
		}
		for i, c := range chunks {
			if h := have[i]; h.Size != c.Size || h.Zero != c.Zero || (!c.Zero && h.Hash != c.Hash) {
				return false
			}
		}
	}
	return true
}

// nextDot is the index of the next '.' in s after i, or -1.
func nextDot(s string, i int) int {
	j := strings.IndexByte(s[i+1:], '.')
	if j < 0 {
		return -1
	}
	return i + 1 + j
}

// Close releases the store lock.
func (r *Rescued) Close() {
	if r.lk != nil {
		r.lk.unlock()
		r.lk = nil
	}
}

// RescueKey is the conventional key of a process's rescue record: its pid.
func RescueKey(pid int) string { return "pid-" + strconv.Itoa(pid) }
