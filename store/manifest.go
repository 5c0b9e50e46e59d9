package store

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"path"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/zeebo/blake3"
)

// FormatVersion is the manifest format this package writes. Readers accept any minor version of
// majors 1 and 2 (unknown fields are ignored) and reject other majors. Minor 1.1 added
// authentication (auth.go): from 1.1 on a manifest carries its id, which hashes every byte of it.
// Major 2 holds the same members; its meta holds a typed image description that readers of
// major 1 would misread (docs/FORMAT.md "Versions"). 1.0 manifests are still read;
// Manifest.Authenticated reports which kind a manifest is.
const FormatVersion = "2.0"

const (
	formatMajor = 2 // the newest major this package reads, the one it writes
	oldestMajor = 1 // the oldest major it reads
	authMinor   = 1 // in major 1, the first minor version whose manifests are sealed; later majors all are
)

// sealedVersion reports whether manifests of this version end with their id.
func sealedVersion(major, minor int) bool { return major > 1 || minor >= authMinor }

// HashAlgorithm names the chunk and manifest hash.
const HashAlgorithm = "blake3-256"

// Chunk size limits and default.
const (
	DefaultChunkSize = 4 << 20
	MinChunkSize     = 4 << 10
	MaxChunkSize     = 64 << 20
)

// MaxMetaString bounds each string of an image's metadata (an Extra value included).
const MaxMetaString = 64 << 10

// Limits on decoded manifests, against hostile input.
const (
	maxManifestBytes = 64 << 20 // ≈ 450,000 chunk entries: 1.7 TiB in 4 MiB chunks
	// maxManifestObjects bounds the JSON objects of a manifest (one per file and chunk entry):
	// more than the entries maxManifestBytes holds, zero chunks' short ones included, and about
	// 120 MiB of heap once decoded, within the default memory limit of import and materialize.
	maxManifestObjects = 1 << 20
	maxNameLen         = 128
	maxPathLen         = 4096
	maxMetaString      = MaxMetaString
)

// File types in a manifest.
const (
	TypeFile    = "file"
	TypeDir     = "dir"
	TypeSymlink = "symlink"
)

// Metadata is what an image records about itself beyond its files: one JSON object, opaque to
// the store, which bounds it (every string at most MaxMetaString bytes) and authenticates it with
// the rest of the manifest. Process images keep their description there (internal/imagedesc,
// docs/FORMAT.md "Image description"). Empty means {}.
type Metadata = json.RawMessage

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

// Manifest describes one image. Its ID is the BLAKE3-256 hash of the encoded manifest: in format
// 1.1 the encoding ends with the id itself, hashed as 64 ASCII zeros, and every reader checks it
// (a manifest edited after it was written is refused, naming the field); in format 1.0 the id is
// the hash of the bytes and is not stored.
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

// Authenticated reports whether the manifest is sealed (format 1.1 or later): its id was
// checked against every byte of it when it was read. A 1.0 manifest's id is merely the hash of
// whatever bytes were read.
func (m *Manifest) Authenticated() bool {
	major, minor, err := parseVersion(m.FormatVersion)
	return err == nil && sealedVersion(major, minor)
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

// EncodeManifest returns the sealed encoding of m in the current format version (whatever
// m.FormatVersion says) and the id it carries.
func EncodeManifest(m *Manifest) ([]byte, string, error) {
	c := *m
	c.ID = ""
	c.FormatVersion = FormatVersion
	c.Created = c.Created.UTC()
	c.Meta = metaOrEmpty(c.Meta)
	if err := c.validate(); err != nil {
		return nil, "", err
	}
	b, err := json.Marshal(&c)
	if err != nil {
		return nil, "", fmt.Errorf("encode manifest: %w", err)
	}
	return sealManifest(b)
}

func manifestID(b []byte) string {
	sum := blake3.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// manifestWire is a manifest as stored: the content and, from format 1.1, the auth member.
type manifestWire struct {
	Manifest
	Auth json.RawMessage `json:"auth"`
}

// DecodeManifest parses, authenticates and validates an encoded manifest and sets its ID. A
// sealed manifest (format 1.1) must hash to the id it ends with, else the error is a
// *ManifestMismatchError naming what was edited; a 1.0 manifest's id is the hash of b. It rejects
// other major format versions with ErrUnsupportedVersion and anything malformed with ErrCorrupt.
func DecodeManifest(b []byte) (*Manifest, error) {
	if len(b) > maxManifestBytes {
		return nil, fmt.Errorf("%w: manifest of %d bytes exceeds %d", ErrCorrupt, len(b), maxManifestBytes)
	}
	// Decoding costs far more than the text (4 MiB of `{}` chunk entries took 233 MiB of heap):
	// the objects are counted before anything decodes them (braces in strings count too).
	if n := bytes.Count(b, []byte("{")); n > maxManifestObjects {
		return nil, fmt.Errorf("%w: manifest with more than %d objects (%d)", ErrCorrupt, maxManifestObjects, n)
	}
	// A manifest that ends with an id is authenticated before anything in it is believed, the
	// format version included, so an edit is reported as one.
	sealed := hasSealedTail(b)
	var id string
	if sealed {
		var err error
		if id, err = sealedID(b); err != nil {
			return nil, err
		}
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
	major, minor, _ := parseVersion(v.FormatVersion)
	switch {
	case sealedVersion(major, minor) && !sealed:
		return nil, fmt.Errorf("%w: manifest: format %s manifests end with their id (`,\"id\":\"…\"}`); this one does not", ErrCorrupt, v.FormatVersion)
	case !sealedVersion(major, minor) && sealed:
		return nil, fmt.Errorf("%w: manifest: format %s manifests carry no id", ErrCorrupt, v.FormatVersion)
	}
	var w manifestWire
	if err := json.Unmarshal(b, &w); err != nil {
		return nil, fmt.Errorf("%w: manifest: %v", ErrCorrupt, err)
	}
	m := &w.Manifest
	if sealed {
		if m.ID != id || len(w.Auth) == 0 {
			return nil, fmt.Errorf("%w: manifest: the id member and the auth member must appear once each, id last", ErrCorrupt)
		}
	} else {
		if m.ID != "" {
			return nil, fmt.Errorf("%w: manifest: format 1.0 manifests carry no id field", ErrCorrupt)
		}
		id = manifestID(b)
	}
	if err := m.validate(); err != nil {
		return nil, err
	}
	// The metadata as an encoder writes it (compact), so a decoded manifest re-encodes to the
	// same content.
	if len(m.Meta) > 0 {
		var err error
		if m.Meta, err = json.Marshal(m.Meta); err != nil {
			return nil, fmt.Errorf("%w: manifest: metadata: %v", ErrCorrupt, err)
		}
	}
	m.ID = id
	return m, nil
}

// hasSealedTail reports whether b ends like a sealed manifest.
func hasSealedTail(b []byte) bool {
	n := len(b)
	return n >= idTailLen && string(b[n-idTailLen:n-idTailLen+len(idTail)]) == idTail && string(b[n-3:]) == "\"}\n"
}

// manifestIDOf returns the id of an encoded manifest without decoding it: the id it carries
// (checked) when sealed, else the hash of its bytes.
func manifestIDOf(b []byte) (string, error) {
	if hasSealedTail(b) {
		return sealedID(b)
	}
	return manifestID(b), nil
}

// parseVersion splits MAJOR.MINOR.
func parseVersion(v string) (major, minor int, err error) {
	ma, mi, ok := strings.Cut(v, ".")
	major, err1 := strconv.Atoi(ma)
	minor, err2 := strconv.Atoi(mi)
	if !ok || err1 != nil || err2 != nil || major < 0 || minor < 0 || strings.HasPrefix(ma, "+") || strings.HasPrefix(mi, "+") {
		return 0, 0, fmt.Errorf("%w: manifest format version %.40q is malformed", ErrCorrupt, v)
	}
	return major, minor, nil
}

func checkVersion(v string) error {
	major, _, err := parseVersion(v)
	if err != nil {
		return err
	}
	if major < oldestMajor || major > formatMajor {
		return fmt.Errorf("%w: manifest format version %s; this ptxmig reads %d.x to %d.x (upgrade ptxmig)", ErrUnsupportedVersion, v, oldestMajor, formatMajor)
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
	if err := validateMeta(m.Meta); err != nil {
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

// validateMeta checks what the store requires of an image's metadata: empty, null or one JSON
// object, with no string (key or value, at any depth) longer than maxMetaString. What the members
// mean is checked by whoever reads them (internal/imagedesc).
func validateMeta(raw Metadata) error {
	t := bytes.TrimSpace(raw)
	if len(t) == 0 || string(t) == "null" {
		return nil
	}
	if t[0] != '{' || !json.Valid(t) {
		return fmt.Errorf("metadata is not one JSON object")
	}
	dec := json.NewDecoder(bytes.NewReader(t))
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("metadata: %v", err)
		}
		if s, ok := tok.(string); ok && len(s) > maxMetaString {
			return fmt.Errorf("metadata string longer than %d bytes", maxMetaString)
		}
	}
}

// emptyMeta is the metadata of an image that records none.
var emptyMeta = Metadata("{}")

// metaOrEmpty returns md, or {} when md is empty.
func metaOrEmpty(md Metadata) Metadata {
	if len(bytes.TrimSpace(md)) == 0 {
		return emptyMeta
	}
	return md
}
