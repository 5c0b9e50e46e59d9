package store

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// readManifest reads and decodes the manifest of the image called name. A manifest that is not a
// regular file (a symlink, a directory, a FIFO, a device) is never followed or opened: the image
// is damaged, an error wrapping ErrCorrupt (*DamagedError).
func (s *Store) readManifest(name string) (*Manifest, error) {
	p := s.manifestPath(name)
	fi, err := os.Lstat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, name)
	}
	if err != nil {
		return nil, fmt.Errorf("read manifest %s: %w", p, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, notRegular(name, p, fi.Mode())
	}
	// O_NONBLOCK: should it have become a FIFO since the Lstat, the open must not wait for a writer.
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil, fmt.Errorf("%w: %s", ErrNotFound, name)
	case errors.Is(err, unix.ELOOP):
		return nil, notRegular(name, p, fs.ModeSymlink) // replaced by a symlink since the Lstat
	case err != nil:
		return nil, fmt.Errorf("read manifest %s: %w", p, err)
	}
	defer f.Close()
	if fi, err = f.Stat(); err != nil {
		return nil, fmt.Errorf("read manifest %s: %w", p, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, notRegular(name, p, fi.Mode())
	}
	b, err := io.ReadAll(io.LimitReader(f, maxManifestBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read manifest %s: %w", p, err)
	}
	m, err := DecodeManifest(b)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", name, err)
	}
	if m.Name != name {
		return nil, fmt.Errorf("image %s: %w: manifest names %q", name, ErrCorrupt, m.Name)
	}
	return m, nil
}

// DamagedError is the error of an image whose manifest (images/NAME.json) is not a regular
// file: a symbolic link, a directory, a FIFO, a socket or a device. Such a manifest is never
// followed, opened or read; the image is damaged (errors.Is ErrCorrupt) until the entry is
// removed (Remove removes it, whatever it is, without following it).
type DamagedError struct {
	Name   string // the image name
	Path   string // its manifest's path
	Reason string // what the entry is instead of a manifest
}

func (e *DamagedError) Error() string {
	return fmt.Sprintf("image %s: %v: its manifest %s is %s, not a regular file (never followed or read)", e.Name, ErrCorrupt, e.Path, e.Reason)
}

func (e *DamagedError) Unwrap() error { return ErrCorrupt }

// notRegular describes a manifest entry of type mode as a *DamagedError.
func notRegular(name, p string, mode fs.FileMode) error {
	var what string
	switch t := mode.Type(); {
	case t&fs.ModeSymlink != 0:
		what = "a symbolic link"
		if target, err := os.Readlink(p); err == nil { // the link's text: nothing is followed
			what = fmt.Sprintf("a symbolic link (to %q)", target)
		}
	case t&fs.ModeDir != 0:
		what = "a directory"
	case t&fs.ModeNamedPipe != 0:
		what = "a named pipe"
	case t&fs.ModeSocket != 0:
		what = "a socket"
	case t&fs.ModeDevice != 0:
		what = "a device"
	default:
		what = "not a regular file"
	}
	return &DamagedError{Name: name, Path: p, Reason: what}
}

// names lists the image names in the store, sorted: every entry of images/ named NAME.json for a
// valid NAME, whatever its type (one that is not a regular file is a damaged image).
func (s *Store) names() ([]string, error) {
	ents, err := os.ReadDir(s.imagesDir())
	if err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	var names []string
	for _, e := range ents {
		n, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || ValidateName(n) != nil {
			continue
		}
		names = append(names, n)
	}
	sort.Strings(names)
	return names, nil
}

// Get returns the manifest of an image by name, full id, or unique id prefix (at least 4 hex
// digits). Errors wrap ErrNotFound, ErrAmbiguous or ErrCorrupt.
func (s *Store) Get(ref string) (*Manifest, error) {
	if ref == "" {
		return nil, fmt.Errorf("%w: empty reference", ErrNotFound)
	}
	if ValidateName(ref) == nil {
		m, err := s.readManifest(ref)
		if err == nil || !errors.Is(err, ErrNotFound) {
			return m, err
		}
	}
	if len(ref) < 4 || len(ref) > 64 || strings.Trim(ref, "0123456789abcdef") != "" {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, ref)
	}
	all, err := s.List()
	if err != nil {
		return nil, err
	}
	var hits []*Manifest
	for _, m := range all {
		if strings.HasPrefix(m.ID, ref) {
			hits = append(hits, m)
		}
	}
	switch len(hits) {
	case 0:
		return nil, fmt.Errorf("%w: %s", ErrNotFound, ref)
	case 1:
		return hits[0], nil
	default:
		return nil, fmt.Errorf("%w: %s matches %d images", ErrAmbiguous, ref, len(hits))
	}
}

// List returns every readable image, sorted by creation time then name. Manifests that cannot
// be read (damaged images) are logged and skipped; ListDamaged returns them, Verify reports them.
func (s *Store) List() ([]*Manifest, error) {
	ms, bad, err := s.listAll()
	for _, b := range bad {
		slog.Warn("skipping damaged image", "image", b.Name, "err", b.Err)
	}
	return ms, err
}

// Damaged is an image whose manifest cannot be used: not a regular file (*DamagedError), or it
// cannot be read, decoded or authenticated. Err says why (it wraps ErrCorrupt,
// ErrUnsupportedVersion or an I/O error).
type Damaged struct {
	Name string
	Err  error
}

// ListDamaged is List that also returns the damaged images, sorted by name, instead of logging
// them.
func (s *Store) ListDamaged() ([]*Manifest, []Damaged, error) { return s.listAll() }

func (s *Store) listAll() ([]*Manifest, []Damaged, error) {
	names, err := s.names()
	if err != nil {
		return nil, nil, err
	}
	var ms []*Manifest
	var bad []Damaged
	for _, n := range names {
		m, err := s.readManifest(n)
		if errors.Is(err, ErrNotFound) {
			continue // removed meanwhile
		}
		if err != nil {
			bad = append(bad, Damaged{Name: n, Err: err})
			continue
		}
		ms = append(ms, m)
	}
	sort.SliceStable(ms, func(i, j int) bool {
		if !ms[i].Created.Equal(ms[j].Created) {
			return ms[i].Created.Before(ms[j].Created)
		}
		return ms[i].Name < ms[j].Name
	})
	return ms, bad, nil
}

// Remove deletes an image's manifest; its chunks stay until GC. A name whose manifest cannot be
// decoded is still removed, and so is a manifest entry that is not a regular file (a symlink is
// removed itself, never what it points to; a directory only when empty).
func (s *Store) Remove(ref string) error {
	name := ref
	if m, err := s.Get(ref); err == nil {
		name = m.Name
	} else if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrUnsupportedVersion) {
		return fmt.Errorf("remove %s: %w", ref, err)
	}
	if err := ValidateName(name); err != nil {
		return fmt.Errorf("remove %s: %w", ref, err)
	}
	if err := os.Remove(s.manifestPath(name)); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("remove %s: %w", ref, ErrNotFound)
		}
		return fmt.Errorf("remove %s: %w", ref, err)
	}
	return syncDir(s.imagesDir())
}

// Names returns the names of all images, including ones whose manifest cannot be read (so
// verify can report them).
func (s *Store) Names() ([]string, error) { return s.names() }
