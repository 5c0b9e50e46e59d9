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
//
// Opening: OpenWith creates a store only with Create, only in a missing directory whose parent
// exists (or an empty one), so a mistyped path is never conjured into a store. The directory may be
// a symlink; what it resolves to must pass the ownership and mode checks, and the store works on
// the resolved path. A store the caller cannot write (a read-only mount) opens read-only: reads
// take their shared lock through read-only descriptors (flock needs no write access), and gc is
// refused with ErrReadOnly.
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
	ErrUnsafeTarget       = errors.New("unsafe target directory")
	ErrUnsupportedFile    = errors.New("unsupported file type")
	ErrNoStore            = errors.New("no image store")
	ErrReadOnly           = errors.New("read-only store")
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
	dir      string // the resolved directory (symlinks followed once, at Open)
	readOnly bool   // the directory cannot be written (read-only mount, or no write permission)
	created  bool   // Open made the store
}

type marker struct {
	Format  string `json:"format"`
	Version int    `json:"version"`
}

// OpenOptions says how OpenWith treats a directory that holds no store yet.
type OpenOptions struct {
	// Create makes the store when its directory is missing (its parent must exist: a mistyped
	// path is not conjured into being) or is an empty directory. Without Create, a missing store
	// is an error wrapping ErrNoStore: commands that only read never create one.
	Create bool
}

// Open opens the store in dir, creating it if missing (OpenWith with Create).
func Open(dir string) (*Store, error) { return OpenWith(dir, OpenOptions{Create: true}) }

// OpenWith opens the store in dir. dir may be a symlink: the directory it resolves to must pass
// the same checks as a real one (owned by the caller, not writable by group or others; read bits
// for group/others are removed with a warning). A store on a read-only file system (or one the
// caller may not write) opens read-only: reads work, with shared locks taken through read-only
// descriptors; writes fail with ErrReadOnly or the file system's error.
func OpenWith(dir string, o OpenOptions) (*Store, error) {
	d, err := examine(dir)
	if err != nil {
		return nil, err
	}
	s := &Store{dir: d.resolved, readOnly: d.readOnly}
	if d.missing || !d.marker {
		if !o.Create {
			return nil, d.noStore()
		}
		if err := d.creatable(); err != nil {
			return nil, err
		}
		s.created = true
	}
	if d.missing {
		if err := os.Mkdir(d.resolved, dirMode); err != nil && !errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("open store %s: %w", d.given, err)
		}
		if d, err = examine(dir); err != nil {
			return nil, err
		}
	}
	if d.perm&0o077 != 0 {
		if s.readOnly {
			slog.Warn("store directory readable by others (read-only: left as it is)", "dir", d.resolved, "mode", fmt.Sprintf("%04o", d.perm))
		} else {
			slog.Warn("store directory readable by others; setting mode 0700", "dir", d.resolved, "mode", fmt.Sprintf("%04o", d.perm))
			if err := os.Chmod(d.resolved, dirMode); err != nil {
				return nil, fmt.Errorf("open store %s: chmod 0700: %w", d.given, err)
			}
		}
	}
	if err := s.init(); err != nil {
		return nil, fmt.Errorf("open store %s: %w", d.given, err)
	}
	return s, nil
}

// CheckCreate tells, without creating or changing anything, whether OpenWith(dir, {Create:
// true}) would succeed: nil when dir holds a store or a new one can be made there, else the
// error Open would return. A dry run (`ptxmig checkpoint --dry-run`) uses it: it creates no store.
func CheckCreate(dir string) error {
	d, err := examine(dir)
	if err != nil {
		return err
	}
	if d.missing || !d.marker {
		return d.creatable()
	}
	return nil
}

// noStore is the error for a path that holds no store, for a caller that may not create one.
func (d *dirState) noStore() error {
	if d.missing {
		return fmt.Errorf("open store %s: %w: the directory does not exist (a command that writes, such as "+
			"`ptxmig checkpoint` or `ptxmig image add`, creates it; check --store or $PTXMIG_STORE)", d.given, ErrNoStore)
	}
	return fmt.Errorf("open store %s: %w: the directory holds no %s; check --store or $PTXMIG_STORE", d.given, ErrNoStore, storeMarker)
}

// creatable checks that a store can be made at a path that holds none: a missing directory whose
// parent exists and can be written, or an empty (or store-like) writable directory.
func (d *dirState) creatable() error {
	if d.missing {
		parent := filepath.Dir(d.resolved)
		if fi, err := os.Stat(parent); err != nil || !fi.IsDir() {
			return fmt.Errorf("open store %s: %w: its parent directory %s does not exist; create it first "+
				"(mkdir -p %s) or check --store", d.given, ErrNoStore, parent, parent)
		}
		if err := unix.Access(parent, unix.W_OK); err != nil {
			return fmt.Errorf("open store %s: cannot create it in %s: %w", d.given, parent, err)
		}
		return nil
	}
	if len(d.foreign) > 0 {
		return fmt.Errorf("open store %s: %w: the directory is not empty (%s…) and is not a ptxmig store; "+
			"choose a new or empty directory", d.given, ErrNoStore, d.foreign[0])
	}
	if d.readOnly {
		return fmt.Errorf("open store %s: %w: cannot create a store there", d.given, ErrReadOnly)
	}
	return nil
}

// dirState is what examine found at a store path, without changing anything.
type dirState struct {
	given, resolved string // absolute path as given; after symlinks
	symlink         bool   // given is (or passes through) a symlink
	missing         bool   // nothing at resolved (then the other fields are zero)
	marker          bool   // ptxmig-store.json exists
	foreign         []string
	perm            fs.FileMode
	uid             int
	readOnly        bool
}

// storeEntries may exist in a directory that is about to become a store: a store's own entries
// (an interrupted first Open), the rebalancer's state and a file system's lost+found.
var storeEntries = map[string]bool{"chunks": true, "images": true, "tmp": true, "lock": true, "lock.gate": true,
	"rebalance": true, "lost+found": true, storeMarker: true}

// examine resolves dir and runs the checks every store directory must pass: a directory (after
// symlinks), owned by the caller, not writable by group or others.
func examine(dir string) (*dirState, error) {
	if dir == "" {
		return nil, fmt.Errorf("open store: empty directory path")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", dir, err)
	}
	d := &dirState{given: abs, resolved: abs}
	lfi, err := os.Lstat(abs)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		d.missing = true
		return d, nil
	case err != nil:
		return nil, fmt.Errorf("open store %s: %w", abs, err)
	}
	if real, err := filepath.EvalSymlinks(abs); err == nil {
		d.resolved = real
	} else if lfi.Mode()&fs.ModeSymlink != 0 {
		target, _ := os.Readlink(abs)
		return nil, fmt.Errorf("open store %s: %w: a symlink to %s, which cannot be resolved: %v", abs, ErrNoStore, target, err)
	} else {
		return nil, fmt.Errorf("open store %s: %w", abs, err)
	}
	d.symlink = d.resolved != abs
	fi, err := os.Lstat(d.resolved)
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", abs, err)
	}
	where := abs
	if d.symlink {
		where = abs + " (-> " + d.resolved + ")"
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("open store %s: not a directory", where)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		d.uid = int(st.Uid)
		if d.uid != os.Geteuid() {
			return nil, fmt.Errorf("open store %s: %w: owned by uid %d, not %d", where, ErrInsecure, st.Uid, os.Geteuid())
		}
	}
	d.perm = fi.Mode().Perm()
	if d.perm&0o022 != 0 {
		return nil, fmt.Errorf("open store %s: %w: mode %04o is writable by group or others (chmod 700 it)", where, ErrInsecure, d.perm)
	}
	if err := unix.Access(d.resolved, unix.W_OK); err != nil {
		d.readOnly = true
	}
	if _, err := os.Lstat(filepath.Join(d.resolved, storeMarker)); err == nil {
		d.marker = true
	} else {
		ents, err := os.ReadDir(d.resolved)
		if err != nil {
			return nil, fmt.Errorf("open store %s: %w", where, err)
		}
		for _, e := range ents {
			if !storeEntries[e.Name()] {
				d.foreign = append(d.foreign, e.Name())
			}
		}
	}
	return d, nil
}

// DirInfo describes a store directory for diagnostics (`ptxmig doctor`).
type DirInfo struct {
	Dir      string      `json:"dir"`                // absolute, as given
	Resolved string      `json:"resolved,omitempty"` // where a symlinked Dir leads
	Exists   bool        `json:"exists"`
	IsStore  bool        `json:"is_store"` // holds a store marker
	UID      int         `json:"uid"`
	Mode     fs.FileMode `json:"mode"`
	ReadOnly bool        `json:"read_only"`
	// FreeBytes is free space for the store's writes: in Dir, or in its parent when Dir is missing.
	FreeBytes uint64 `json:"free_bytes"`
}

// Inspect runs Open's checks on dir without creating or changing anything. The error, when not
// nil, is the one Open would return (ErrInsecure, ErrNoStore…); the info is filled as far as the
// checks got.
func Inspect(dir string) (*DirInfo, error) {
	abs, _ := filepath.Abs(dir)
	info := &DirInfo{Dir: abs}
	d, err := examine(dir)
	if d != nil {
		info.Dir, info.Exists, info.IsStore, info.UID, info.Mode, info.ReadOnly = d.given, !d.missing, d.marker, d.uid, d.perm, d.readOnly
		if d.symlink {
			info.Resolved = d.resolved
		}
	}
	where := info.Dir
	if info.Resolved != "" {
		where = info.Resolved
	}
	if !info.Exists {
		where = filepath.Dir(where)
	}
	var sfs unix.Statfs_t
	if unix.Statfs(where, &sfs) == nil {
		info.FreeBytes = sfs.Bavail * uint64(sfs.Bsize)
	}
	switch {
	case err != nil:
	case d.missing:
		err = fmt.Errorf("store %s: %w: the directory does not exist", info.Dir, ErrNoStore)
	case !d.marker:
		err = fmt.Errorf("store %s: %w: the directory holds no %s", info.Dir, ErrNoStore, storeMarker)
	}
	return info, err
}

// ReadOnly reports whether the store was opened read-only (its directory cannot be written).
func (s *Store) ReadOnly() bool { return s.readOnly }

// Created reports whether Open made this store (a new directory, or an empty one initialized).
func (s *Store) Created() bool { return s.created }

func (s *Store) init() error {
	mpath := filepath.Join(s.dir, storeMarker)
	if s.readOnly { // nothing can be repaired or created; the marker must be right
		return checkMarker(mpath)
	}
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
	return parseMarker(mpath, b)
}

// checkMarker reads and checks the store marker at mpath.
func checkMarker(mpath string) error {
	b, err := os.ReadFile(mpath)
	if err != nil {
		return err
	}
	return parseMarker(mpath, b)
}

func parseMarker(mpath string, b []byte) error {
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
// Puts cannot starve gc. On a read-only store the locks are taken through read-only descriptors
// (flock needs no write access), so readers still exclude a gc run by whoever can write the
// store (e.g. through another, writable mount); when the lock files do not exist on a read-only
// file system nobody can write the store and no lock is needed.
type lock struct{ main, gate *os.File }

// lockShared lets any number of Puts, Imports and reads run together, but not with gc.
func (s *Store) lockShared(ctx context.Context) (*lock, error) {
	gate, err := s.flock(ctx, "lock.gate", unix.LOCK_EX)
	if err != nil {
		return nil, err
	}
	if gate != nil {
		defer gate.Close()
	}
	main, err := s.flock(ctx, "lock", unix.LOCK_SH)
	if err != nil {
		return nil, err
	}
	return &lock{main: main}, nil
}

// lockExclusive waits for every shared holder and keeps new ones out meanwhile. A read-only
// store cannot be locked exclusively: only gc does, and it deletes.
func (s *Store) lockExclusive(ctx context.Context) (*lock, error) {
	if s.readOnly {
		return nil, fmt.Errorf("store %s: %w", s.dir, ErrReadOnly)
	}
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

// openLockFile opens (creating when it may) the lock file name. On a read-only store it opens
// the file read-only; (nil, nil) means there is no lock file on a read-only file system.
func (s *Store) openLockFile(name string) (*os.File, error) {
	p := filepath.Join(s.dir, name)
	if !s.readOnly {
		f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, fileMode)
		if err == nil || !(errors.Is(err, unix.EROFS) || errors.Is(err, fs.ErrPermission)) {
			return f, err
		}
	}
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if errors.Is(err, fs.ErrNotExist) && readOnlyFS(s.dir) {
		return nil, nil
	}
	return f, err
}

// readOnlyFS reports whether dir is on a file system mounted read-only.
func readOnlyFS(dir string) bool {
	var st unix.Statfs_t
	return unix.Statfs(dir, &st) == nil && st.Flags&unix.ST_RDONLY != 0
}

func (s *Store) flock(ctx context.Context, name string, how int) (*os.File, error) {
	f, err := s.openLockFile(name)
	if err != nil {
		return nil, fmt.Errorf("store lock: %w", err)
	}
	if f == nil {
		return nil, nil
	}
	p := f.Name()
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
