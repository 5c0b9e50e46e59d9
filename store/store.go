// Package store keeps ptxmig images: named, immutable directory trees (a CRIU image directory
// plus ptxmig's metadata) stored as content-addressed, compressed, deduplicated chunks and a
// manifest. The on-disk format is specified in docs/FORMAT.md.
//
// Layout of a store directory (0700; every file 0600):
//
//	ptxmig-store.json   store format marker
//	lock                flock(2) target: shared for writers and readers, exclusive for gc
//	chunks/XX/HASH      one file per chunk, XX = first two hex digits of its BLAKE3-256 hash
//	images/NAME.json    one manifest per image; the image id is the hash of these bytes
//	tmp/                temp files, renamed into place once complete and fsynced
//
// Chunks are written before the manifest that references them, so a crash at any moment leaves
// every image intact and at worst unreferenced chunks or temp files, which GC removes. A writer's
// chunk temp files are fsynced together by one syncfs(2) before any is renamed (see chunkStage).
package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/atomicfile"
)

// Sentinel errors; every error the store returns for these conditions wraps one of them.
var (
	ErrNotFound           = errors.New("image not found")
	ErrExists             = errors.New("image already exists")
	ErrCorrupt            = errors.New("store data corrupt")
	ErrUnsupportedVersion = errors.New("unsupported format version")
	ErrInvalidName        = errors.New("invalid image name")
	ErrAmbiguous          = errors.New("ambiguous image id prefix")
	ErrInsecure           = errors.New("insecure store directory")
	ErrNotEmpty           = errors.New("target directory not empty")
	ErrUnsupportedFile    = errors.New("unsupported file type")
)

const (
	storeMarker  = "ptxmig-store.json"
	storeFormat  = "ptxmig-store"
	storeVersion = 1
	dirMode      = 0o700
	fileMode     = 0o600
)

// Store is an open image store. Its methods are safe for concurrent use, also by several
// processes on the same directory.
type Store struct {
	dir string
}

type marker struct {
	Format  string `json:"format"`
	Version int    `json:"version"`
}

// Open opens the store in dir, creating it (mode 0700) if missing. An existing directory must be
// owned by the caller and not writable by group or others; read bits for group/others are
// removed with a warning.
func Open(dir string) (*Store, error) {
	if dir == "" {
		return nil, fmt.Errorf("open store: empty directory path")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", dir, err)
	}
	if err := os.MkdirAll(filepath.Dir(abs), 0o755); err != nil {
		return nil, fmt.Errorf("open store %s: %w", abs, err)
	}
	if err := os.Mkdir(abs, dirMode); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("open store %s: %w", abs, err)
	}
	if err := checkDirPerms(abs); err != nil {
		return nil, err
	}
	s := &Store{dir: abs}
	if err := s.init(); err != nil {
		return nil, fmt.Errorf("open store %s: %w", abs, err)
	}
	return s, nil
}

func checkDirPerms(dir string) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("open store %s: %w", dir, err)
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		return fmt.Errorf("open store %s: %w: is a symlink; point --store at the real directory", dir, ErrInsecure)
	}
	if !fi.IsDir() {
		return fmt.Errorf("open store %s: not a directory", dir)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if ok && int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("open store %s: %w: owned by uid %d, not %d", dir, ErrInsecure, st.Uid, os.Geteuid())
	}
	perm := fi.Mode().Perm()
	if perm&0o022 != 0 {
		return fmt.Errorf("open store %s: %w: mode %04o is writable by group or others (chmod 700 it)", dir, ErrInsecure, perm)
	}
	if perm&0o077 != 0 {
		slog.Warn("store directory readable by others; setting mode 0700", "dir", dir, "mode", fmt.Sprintf("%04o", perm))
		if err := os.Chmod(dir, dirMode); err != nil {
			return fmt.Errorf("open store %s: chmod 0700: %w", dir, err)
		}
	}
	return nil
}

func (s *Store) init() error {
	for _, d := range []string{"chunks", "images", "tmp"} {
		if err := mkdirPrivate(filepath.Join(s.dir, d)); err != nil {
			return err
		}
	}
	for i := range 256 {
		if err := mkdirPrivate(filepath.Join(s.dir, "chunks", fmt.Sprintf("%02x", i))); err != nil {
			return err
		}
	}
	mpath := filepath.Join(s.dir, storeMarker)
	b, err := os.ReadFile(mpath)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		data, _ := json.Marshal(marker{Format: storeFormat, Version: storeVersion})
		if err := s.writeNew(mpath, append(data, '\n')); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		return syncDir(s.dir)
	case err != nil:
		return err
	}
	var m marker
	if err := json.Unmarshal(b, &m); err != nil || m.Format != storeFormat {
		return fmt.Errorf("%s: %w: not a ptxmig store marker", mpath, ErrCorrupt)
	}
	if m.Version != storeVersion {
		return fmt.Errorf("%s: %w: store version %d, this ptxmig reads %d", mpath, ErrUnsupportedVersion, m.Version, storeVersion)
	}
	return nil
}

func mkdirPrivate(p string) error {
	err := os.Mkdir(p, dirMode)
	if err == nil || !errors.Is(err, fs.ErrExist) {
		return err
	}
	fi, err := os.Lstat(p)
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return fmt.Errorf("%s: %w: not a directory", p, ErrInsecure)
	}
	return nil
}

// Dir returns the store's absolute directory.
func (s *Store) Dir() string { return s.dir }

func (s *Store) tmpDir() string    { return filepath.Join(s.dir, "tmp") }
func (s *Store) imagesDir() string { return filepath.Join(s.dir, "images") }
func (s *Store) chunkPath(id ChunkID) string {
	h := id.String()
	return filepath.Join(s.dir, "chunks", h[:2], h)
}
func (s *Store) manifestPath(name string) string {
	return filepath.Join(s.imagesDir(), name+".json")
}

// writeNew writes data to path atomically (internal/atomicfile: a temp file in tmp/, fsynced,
// linked into place, the directory fsynced) and never replaces an existing path (fs.ErrExist).
func (s *Store) writeNew(path string, data []byte) error {
	return atomicfile.WriteFile(path, data, fileMode, atomicfile.NoReplace(), atomicfile.TempDir(s.tmpDir()))
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", dir, err)
	}
	return nil
}

// lock is the store lock: flock(2) on "lock", shared by writers and readers, exclusive for gc.
// A second file, "lock.gate", makes it fair: every taker holds the gate exclusively while it
// acquires "lock", and gc keeps holding the gate while it waits, so a stream of overlapping
// Puts cannot starve gc.
type lock struct{ main, gate *os.File }

// lockShared lets any number of Puts, Imports and reads run together, but not with gc.
func (s *Store) lockShared(ctx context.Context) (*lock, error) {
	gate, err := s.flock(ctx, "lock.gate", unix.LOCK_EX)
	if err != nil {
		return nil, err
	}
	defer gate.Close()
	main, err := s.flock(ctx, "lock", unix.LOCK_SH)
	if err != nil {
		return nil, err
	}
	return &lock{main: main}, nil
}

// lockExclusive waits for every shared holder and keeps new ones out meanwhile.
func (s *Store) lockExclusive(ctx context.Context) (*lock, error) {
	gate, err := s.flock(ctx, "lock.gate", unix.LOCK_EX)
	if err != nil {
		return nil, err
	}
	main, err := s.flock(ctx, "lock", unix.LOCK_EX)
	if err != nil {
		gate.Close()
		return nil, err
	}
	return &lock{main: main, gate: gate}, nil
}

func (s *Store) flock(ctx context.Context, name string, how int) (*os.File, error) {
	p := filepath.Join(s.dir, name)
	f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, fileMode)
	if err != nil {
		return nil, fmt.Errorf("store lock: %w", err)
	}
	delay := time.Millisecond
	for {
		err := unix.Flock(int(f.Fd()), how|unix.LOCK_NB)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			f.Close()
			return nil, fmt.Errorf("store lock %s: %w", p, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("waiting for store lock %s: %w", p, ctx.Err())
		case <-time.After(delay):
		}
		if delay < 20*time.Millisecond {
			delay *= 2
		}
	}
}

// unlock releases the lock (closing the last fd of an flock releases it).
func (l *lock) unlock() {
	if l == nil {
		return
	}
	if l.main != nil {
		l.main.Close()
	}
	if l.gate != nil {
		l.gate.Close()
	}
}
