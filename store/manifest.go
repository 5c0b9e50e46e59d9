package store

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"path"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/zeebo/blake3"
)

// FormatVersion is the manifest format this package writes. Readers accept any minor version of
// the same major version (unknown fields are ignored) and reject other majors.
const FormatVersion = "1.0"

const formatMajor = 1

// HashAlgorithm names the chunk and manifest hash.
const HashAlgorithm = "blake3-256"

// Chunk size limits and default.
const (
	DefaultChunkSize = 4 << 20
	MinChunkSize     = 4 << 10
	MaxChunkSize     = 64 << 20
)

// Limits on decoded manifests, against hostile input.
const (
	maxManifestBytes = 256 << 20
	maxNameLen       = 128
	maxPathLen       = 4096
	maxMetaString    = 64 << 10
)

// File types in a manifest.
const (
	TypeFile    = "file"
	TypeDir     = "dir"
	TypeSymlink = "symlink"
)

// GPU describes one source GPU of a checkpointed process.
type GPU struct {
	Index       int    `json:"index"`
	UUID        string `json:"uuid,omitempty"`
	Name        string `json:"name,omitempty"`
	ComputeCap  string `json:"compute_cap,omitempty"`
	MemoryBytes uint64 `json:"memory_bytes,omitempty"`
}

// Metadata is free-form provenance recorded with an image. GPUs are the GPUs the process used;
// Visible, a superset, are the GPUs its CUDA driver enumerated (CUDA_VISIBLE_DEVICES, else every
// GPU of the host): a restore onto other GPUs must pair each of them.
type Metadata struct {
	Kind    string            `json:"kind,omitempty"` // "cuda", "cpu", or empty for a plain directory
	Host    string            `json:"host,omitempty"`
	Kernel  string            `json:"kernel,omitempty"`
	Driver  string            `json:"driver,omitempty"`
	CUDA    string            `json:"cuda,omitempty"`
	CRIU    string            `json:"criu,omitempty"`
	GPUs    []GPU             `json:"gpus,omitempty"`         // the GPUs the process used
	Visible []GPU             `json:"visible_gpus,omitempty"` // every GPU its CUDA driver enumerated (absent in older images)
	PID     int               `json:"pid,omitempty"`
	Cmdline []string          `json:"cmdline,omitempty"`
	Extra   map[string]string `json:"extra,omitempty"`
}

// ChunkID is the BLAKE3-256 hash of a chunk's uncompressed bytes.
type ChunkID [32]byte

func (c ChunkID) String() string { return hex.EncodeToString(c[:]) }

// MarshalText encodes the id as 64 lower-case hex digits.
func (c ChunkID) MarshalText() ([]byte, error) { return []byte(c.String()), nil }

// UnmarshalText parses 64 lower-case hex digits.
func (c *ChunkID) UnmarshalText(b []byte) error {
	id, err := ParseChunkID(string(b))
	if err != nil {
		return err
	}
	*c = id
	return nil
}

// ParseChunkID parses 64 lower-case hex digits.
func ParseChunkID(s string) (ChunkID, error) {
	var c ChunkID
	if len(s) != 64 || strings.ToLower(s) != s {
		return c, fmt.Errorf("chunk id %.80q: want 64 lower-case hex digits", s)
	}
	if _, err := hex.Decode(c[:], []byte(s)); err != nil {
		return c, fmt.Errorf("chunk id %.80q: %v", s, err)
	}
	return c, nil
}

// HashChunk returns the id of raw chunk data.
func HashChunk(data []byte) ChunkID { return blake3.Sum256(data) }

// Chunk is one piece of a file. A chunk with Zero set is a hole: all zero bytes, nothing stored.
type Chunk struct {
	Offset int64   `json:"offset"`
	Size   int     `json:"size"`
	Hash   ChunkID `json:"hash,omitzero"`
	Zero   bool    `json:"zero,omitempty"`
	Stored int     `json:"stored,omitempty"` // bytes of the chunk file when written (header included)
}

// File is one entry of an image: a regular file, a directory or a symbolic link.
type File struct {
	Path   string  `json:"path"` // slash-separated, relative, clean
	Type   string  `json:"type"`
	Mode   uint32  `json:"mode"`             // permission bits (0777); special bits are not stored
	Size   int64   `json:"size,omitempty"`   // regular files
	Target string  `json:"target,omitempty"` // symlinks, stored verbatim, never followed
	Chunks []Chunk `json:"chunks,omitempty"` // regular files, contiguous from offset 0
}

// Manifest describes one image. ID is not part of the encoding: it is the BLAKE3-256 hash of
// the encoded manifest bytes, so a manifest cannot change without changing its id.
type Manifest struct {
	FormatVersion string    `json:"format_version"`
	ID            string    `json:"id,omitempty"`
	Name          string    `json:"name"`
	Parent        string    `json:"parent,omitempty"` // id of the parent image
	Created       time.Time `json:"created"`
	Meta          Metadata  `json:"meta"`
	Hash          string    `json:"hash"`
	ChunkSize     int       `json:"chunk_size"`
	Files         []File    `json:"files"`
}

// LogicalBytes is the sum of the sizes of the image's regular files.
func (m *Manifest) LogicalBytes() int64 {
	var n int64
	for i := range m.Files {
		n += m.Files[i].Size
	}
	return n
}

// StoredBytes is the size of the image's distinct chunk files as recorded when they were written.
func (m *Manifest) StoredBytes() int64 {
	seen := map[ChunkID]bool{}
	var n int64
	for i := range m.Files {
		for _, c := range m.Files[i].Chunks {
			if c.Zero || seen[c.Hash] {
				continue
			}
			seen[c.Hash] = true
			n += int64(c.Stored)
		}
	}
	return n
}

// ChunkIDs returns the distinct stored chunks of the image.
func (m *Manifest) ChunkIDs() []ChunkID {
	seen := map[ChunkID]bool{}
	var ids []ChunkID
	for i := range m.Files {
		for _, c := range m.Files[i].Chunks {
			if !c.Zero && !seen[c.Hash] {
				seen[c.Hash] = true
				ids = append(ids, c.Hash)
			}
		}
	}
	return ids
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._+@-]*$`)

// ValidateName checks an image name: 1–128 characters from [A-Za-z0-9._+@-], starting with a
// letter or digit (so no path separators, no "." or ".."), and not 64 hex digits (an id).
func ValidateName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: empty", ErrInvalidName)
	case len(name) > maxNameLen:
		return fmt.Errorf("%w: %.40q… longer than %d characters", ErrInvalidName, name, maxNameLen)
	case !nameRE.MatchString(name):
		return fmt.Errorf("%w: %q: use letters, digits and . _ + @ - (starting with a letter or digit)", ErrInvalidName, name)
	case isID(name):
		return fmt.Errorf("%w: %q looks like an image id", ErrInvalidName, name)
	}
	return nil
}

func isID(s string) bool {
	_, err := ParseChunkID(s)
	return err == nil
}

// validPath reports whether p is a clean, relative, slash-separated path inside the image root.
func validPath(p string) error {
	switch {
	case p == "" || p == ".":
		return fmt.Errorf("empty path")
	case len(p) > maxPathLen:
		return fmt.Errorf("path longer than %d bytes", maxPathLen)
	case !utf8.ValidString(p):
		return fmt.Errorf("path %q is not valid UTF-8", p)
	case strings.ContainsRune(p, 0):
		return fmt.Errorf("path %q contains NUL", p)
	case strings.HasPrefix(p, "/"):
		return fmt.Errorf("path %q is absolute", p)
	case path.Clean(p) != p:
		return fmt.Errorf("path %q is not clean", p)
	case p == ".." || strings.HasPrefix(p, "../"):
		return fmt.Errorf("path %q leaves the image root", p)
	}
	return nil
}

// EncodeManifest returns the canonical encoding of m (without its ID) and the ID it hashes to.
func EncodeManifest(m *Manifest) ([]byte, string, error) {
	c := *m
	c.ID = ""
	c.Created = c.Created.UTC()
	if err := c.validate(); err != nil {
		return nil, "", err
	}
	b, err := json.Marshal(&c)
	if err != nil {
		return nil, "", fmt.Errorf("encode manifest: %w", err)
	}
	b = append(b, '\n')
	return b, manifestID(b), nil
}

func manifestID(b []byte) string {
	sum := blake3.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// DecodeManifest parses and validates an encoded manifest and sets its ID from the bytes.
// It rejects other major format versions with ErrUnsupportedVersion and anything malformed with
// ErrCorrupt.
func DecodeManifest(b []byte) (*Manifest, error) {
	if len(b) > maxManifestBytes {
		return nil, fmt.Errorf("%w: manifest of %d bytes exceeds %d", ErrCorrupt, len(b), maxManifestBytes)
	}
	// Read the version first so a future major version gets a clear error, not a parse error.
	var v struct {
		FormatVersion string `json:"format_version"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return nil, fmt.Errorf("%w: manifest: %v", ErrCorrupt, err)
	}
	if err := checkVersion(v.FormatVersion); err != nil {
		return nil, err
	}
	var m Manifest
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("%w: manifest: %v", ErrCorrupt, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("%w: manifest: trailing data", ErrCorrupt)
	}
	if m.ID != "" {
		return nil, fmt.Errorf("%w: manifest: stored manifests carry no id field", ErrCorrupt)
	}
	if err := m.validate(); err != nil {
		return nil, err
	}
	m.ID = manifestID(b)
	return &m, nil
}

func checkVersion(v string) error {
	major, _, ok := strings.Cut(v, ".")
	n, err := strconv.Atoi(major)
	if !ok || err != nil || n < 0 || strings.HasPrefix(major, "+") {
		return fmt.Errorf("%w: manifest format version %q is malformed", ErrCorrupt, v)
	}
	if n != formatMajor {
		return fmt.Errorf("%w: manifest format version %s; this ptxmig reads %d.x (upgrade ptxmig)", ErrUnsupportedVersion, v, formatMajor)
	}
	return nil
}

// validate checks every field a reader relies on; errors wrap ErrCorrupt or ErrInvalidName.
func (m *Manifest) validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: manifest %q: %s", ErrCorrupt, m.Name, fmt.Sprintf(format, a...))
	}
	if err := checkVersion(m.FormatVersion); err != nil {
		return err
	}
	if err := ValidateName(m.Name); err != nil {
		return fmt.Errorf("%w: manifest: %w", ErrCorrupt, err)
	}
	if m.Parent != "" && !isID(m.Parent) {
		return bad("parent %.80q is not an image id", m.Parent)
	}
	if m.Hash != HashAlgorithm {
		return bad("hash %q, want %q", m.Hash, HashAlgorithm)
	}
	if m.ChunkSize < MinChunkSize || m.ChunkSize > MaxChunkSize {
		return bad("chunk size %d outside [%d, %d]", m.ChunkSize, MinChunkSize, MaxChunkSize)
	}
	if err := m.Meta.validate(); err != nil {
		return bad("%v", err)
	}
	dirs := map[string]bool{}
	prev := ""
	for i := range m.Files {
		f := &m.Files[i]
		if err := validPath(f.Path); err != nil {
			return bad("file %d: %v", i, err)
		}
		if i > 0 && f.Path <= prev {
			return bad("file %q: paths not strictly sorted", f.Path)
		}
		prev = f.Path
		// Every parent must be a directory listed earlier: no path passes through a symlink.
		if d := path.Dir(f.Path); d != "." && !dirs[d] {
			return bad("file %q: parent %q is not a directory of the image", f.Path, d)
		}
		if f.Mode&^0o777 != 0 {
			return bad("file %q: mode %o has bits outside 0777", f.Path, f.Mode)
		}
		switch f.Type {
		case TypeDir:
			dirs[f.Path] = true
			if f.Size != 0 || f.Target != "" || len(f.Chunks) != 0 {
				return bad("directory %q has size, target or chunks", f.Path)
			}
		case TypeSymlink:
			if f.Target == "" || len(f.Target) > maxPathLen || strings.ContainsRune(f.Target, 0) || !utf8.ValidString(f.Target) {
				return bad("symlink %q: bad target", f.Path)
			}
			if f.Size != 0 || len(f.Chunks) != 0 {
				return bad("symlink %q has size or chunks", f.Path)
			}
		case TypeFile:
			if f.Target != "" {
				return bad("file %q has a target", f.Path)
			}
			if f.Size < 0 {
				return bad("file %q: negative size", f.Path)
			}
			var off int64
			for j, c := range f.Chunks {
				if c.Offset != off {
					return bad("file %q chunk %d: offset %d, want %d", f.Path, j, c.Offset, off)
				}
				if c.Size <= 0 || c.Size > m.ChunkSize {
					return bad("file %q chunk %d: size %d outside (0, %d]", f.Path, j, c.Size, m.ChunkSize)
				}
				if c.Zero && (c.Hash != ChunkID{} || c.Stored != 0) {
					return bad("file %q chunk %d: zero chunk with hash or stored size", f.Path, j)
				}
				if !c.Zero && (c.Hash == ChunkID{}) {
					return bad("file %q chunk %d: no hash", f.Path, j)
				}
				if c.Stored < 0 || c.Stored > chunkHeaderLen+maxEncodedLen(c.Size) {
					return bad("file %q chunk %d: stored size %d out of range", f.Path, j, c.Stored)
				}
				off += int64(c.Size)
			}
			if off != f.Size {
				return bad("file %q: chunks cover %d bytes, size is %d", f.Path, off, f.Size)
			}
		default:
			return bad("file %q: unknown type %.20q", f.Path, f.Type)
		}
	}
	return nil
}

func (md *Metadata) validate() error {
	strs := []string{md.Kind, md.Host, md.Kernel, md.Driver, md.CUDA, md.CRIU}
	strs = append(strs, md.Cmdline...)
	for k, v := range md.Extra {
		strs = append(strs, k, v)
	}
	for _, g := range append(append([]GPU(nil), md.GPUs...), md.Visible...) {
		strs = append(strs, g.UUID, g.Name, g.ComputeCap)
		if g.Index < 0 {
			return fmt.Errorf("gpu index %d", g.Index)
		}
	}
	for _, s := range strs {
		if len(s) > maxMetaString {
			return fmt.Errorf("metadata string longer than %d bytes", maxMetaString)
		}
	}
	if md.PID < 0 {
		return fmt.Errorf("pid %d", md.PID)
	}
	return nil
}
