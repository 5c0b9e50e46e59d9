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

// readManifest reads and decodes the manifest of the image called name.
func (s *Store) readManifest(name string) (*Manifest, error) {
	p := s.manifestPath(name)
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, name)
	}
	if err != nil {
		return nil, fmt.Errorf("read manifest %s: %w", p, err)
	}
	defer f.Close()
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

// names lists the image names in the store, sorted.
func (s *Store) names() ([]string, error) {
	ents, err := os.ReadDir(s.imagesDir())
	if err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	var names []string
	for _, e := range ents {
		n, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || ValidateName(n) != nil || !e.Type().IsRegular() {
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
// be read are logged and skipped; Check reports them.
func (s *Store) List() ([]*Manifest, error) {
	ms, bad, err := s.listAll()
	for _, b := range bad {
		slog.Warn("skipping unreadable image", "err", b)
	}
	return ms, err
}

func (s *Store) listAll() ([]*Manifest, []error, error) {
	names, err := s.names()
	if err != nil {
		return nil, nil, err
	}
	var ms []*Manifest
	var bad []error
	for _, n := range names {
		m, err := s.readManifest(n)
		if errors.Is(err, ErrNotFound) {
			continue // removed meanwhile
		}
		if err != nil {
			bad = append(bad, err)
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
// decoded is still removed.
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
