// Package atomicfile writes files so that readers, and a crash at any moment, see the old content
// or the new, never a part: the data goes to a temp file in the target's directory, which is
// given its mode, fsynced, renamed into place (or hard-linked, with NoReplace), and then the
// directory is fsynced so that the rename itself is durable.
//
// A crash can leave a temp file named ".NAME.tmp-PID-*" beside the target (or in TempDir); nothing
// else is ever left behind: a failed write removes its temp file and keeps the old content. PID is
// the writer's, which holds flock(2) on the file while it writes: RemoveStale removes the ones
// whose writer is dead. With Unnamed the temp file has no name at all (O_TMPFILE), so even a
// killed writer leaves nothing.
//
// A target that exists and is not a regular file or a directory (a device such as /dev/null, a
// FIFO, a terminal; after symlinks) has no content to replace: it is written in place, never
// renamed over (renaming over /dev/null replaced the device with a file), except with NoReplace,
// which refuses any existing target.
package atomicfile

import (
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Option changes how a file is written.
type Option func(*options)

type options struct {
	noReplace bool
	tempDir   string
	unnamed   bool
}

// NoReplace makes the write fail with an error wrapping fs.ErrExist, instead of replacing, when
// the target exists. The check and the creation are one atomic step (link(2)), so of several
// concurrent writers exactly one succeeds.
func NoReplace() Option { return func(o *options) { o.noReplace = true } }

// TempDir puts the temp file in dir instead of the target's directory; dir must be on the same
// file system as the target (the image store keeps its temp files in its tmp/, which gc empties).
func TempDir(dir string) Option { return func(o *options) { o.tempDir = dir } }

// Unnamed writes through a temp file that has no name (open(2) with O_TMPFILE in the target's
// directory): a writer killed before Commit leaves nothing behind, since the kernel frees a file
// without a name when its last descriptor closes. Commit links it into place (linkat(2)). Where
// the file system cannot make such a file, a named temp file is used as without this option. In
// both cases Create first removes the temp files of the same target that dead writers left
// (RemoveStale; File.StaleRemoved lists them). TempDir is ignored: the file must be created in
// the target's directory to be linked there.
func Unnamed() Option { return func(o *options) { o.unnamed = true } }

// noTmpfile makes Unnamed fall back to a named temp file, as on a file system without O_TMPFILE
// (tests).
var noTmpfile bool

// WriteFile writes data to path atomically. The file gets exactly mode (fchmod, not subject to
// the umask). Errors name path.
func WriteFile(path string, data []byte, mode fs.FileMode, opts ...Option) error {
	f, err := Create(path, mode, opts...)
	if err != nil {
		return err
	}
	defer f.Abort()
	if _, err := f.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Commit()
}

// File is an atomic write in progress, for data that is streamed rather than held in memory:
// write to it, then Commit. Abort (safe to defer; a no-op after Commit) discards it.
type File struct {
	f       *os.File
	path    string
	o       options
	done    bool
	inPlace bool     // a device or FIFO: written directly
	unnamed bool     // f is an O_TMPFILE file: it has no name until Commit links it
	stale   []string // temp files of dead writers that Create removed
}

// Create starts an atomic write of path with mode (fchmod, not subject to the umask). Nothing
// appears at path before Commit.
func Create(path string, mode fs.FileMode, opts ...Option) (*File, error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	if st, err := os.Stat(path); err == nil && !o.noReplace && !st.Mode().IsRegular() && !st.IsDir() {
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			return nil, fmt.Errorf("write %s: %w", path, err)
		}
		return &File{f: f, path: path, o: o, inPlace: true}, nil
	}
	dir := o.tempDir
	if dir == "" || o.unnamed {
		dir = filepath.Dir(path)
	}
	var stale []string
	if o.unnamed {
		// Best effort: a leftover that cannot be removed does not stop this write.
		stale, _ = RemoveStale(dir, filepath.Base(path))
		f, err := createUnnamed(dir, mode)
		if err == nil {
			return &File{f: f, path: path, o: o, unnamed: true, stale: stale}, nil
		}
		if !errors.Is(err, errNoTmpfile) {
			return nil, fmt.Errorf("write %s: %w", path, err)
		}
	}
	f, err := createNamed(dir, filepath.Base(path))
	if err != nil {
		return nil, fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Chmod(mode); err != nil {
		f.Close()
		os.Remove(f.Name())
		return nil, fmt.Errorf("write %s: %w", path, err)
	}
	return &File{f: f, path: path, o: o, stale: stale}, nil
}

// StaleRemoved lists the temp files of dead writers (of the same target) that Create removed
// (Unnamed only).
func (f *File) StaleRemoved() []string { return f.stale }

// errNoTmpfile: the file system (or kernel) cannot make an O_TMPFILE file.
var errNoTmpfile = errors.New("O_TMPFILE not supported")

// createUnnamed makes a file without a name in dir, with exactly mode. The writer holds flock on
// it, as on a named temp file, for the moment Commit may give it a temp name (the lock is the
// inode's, so it holds through that name).
func createUnnamed(dir string, mode fs.FileMode) (*os.File, error) {
	if noTmpfile {
		return nil, errNoTmpfile
	}
	fd, err := unix.Open(dir, unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, uint32(mode.Perm()))
	switch {
	case errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.EISDIR), errors.Is(err, unix.EINVAL):
		// EISDIR: a kernel older than 3.11 reads O_TMPFILE as O_DIRECTORY.
		return nil, fmt.Errorf("%w: %v", errNoTmpfile, err)
	case err != nil:
		return nil, &fs.PathError{Op: "open", Path: dir, Err: err}
	}
	f := os.NewFile(uintptr(fd), filepath.Join(dir, "(unnamed)"))
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return nil, err
	}
	lockTemp(f)
	return f, nil
}

// lockTemp takes flock on a new temp file, held until the file is closed, to tell RemoveStale
// that its writer lives. Best effort: where flock is not available (some network file systems)
// the writer's pid alone says so.
func lockTemp(f *os.File) { _ = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) }

// tempPrefix is the start of the name of a temp file for the target base.
func tempPrefix(base string) string { return "." + base + ".tmp-" }

// createNamed creates the temp file ".BASE.tmp-PID-RANDOM" in dir and takes flock on it, which
// it holds until it is closed: RemoveStale leaves alone a file whose writer lives (lockTemp).
func createNamed(dir, base string) (*os.File, error) {
	f, err := os.CreateTemp(dir, tempPrefix(base)+strconv.Itoa(os.Getpid())+"-*")
	if err != nil {
		return nil, err
	}
	lockTemp(f)
	return f, nil
}

// tempWriter parses the name of a temp file: the target's base name and the writer's pid. ok is
// false for anything else (including temp files of older versions, whose names carry no pid).
func tempWriter(name string) (base string, pid int, ok bool) {
	i := strings.LastIndex(name, ".tmp-")
	if !strings.HasPrefix(name, ".") || i < 1 {
		return "", 0, false
	}
	p, r, ok := strings.Cut(name[i+len(".tmp-"):], "-")
	if !ok || !allDigits(p) || !allDigits(r) {
		return "", 0, false
	}
	pid, err := strconv.Atoi(p)
	if err != nil || pid <= 0 {
		return "", 0, false
	}
	return name[1:i], pid, true
}

func allDigits(s string) bool {
	return s != "" && strings.Trim(s, "0123456789") == ""
}

// RemoveStale removes the temp files in dir that writers of the target base ("" for any target)
// left behind when they died: files named ".BASE.tmp-PID-RANDOM" whose writer PID no longer runs
// and on which nobody holds flock (a writer in another pid namespace, whose pid means nothing
// here, still holds it). Anything else is left alone: other names, files that are not regular,
// the temp files of live writers (of this process too). It returns the paths removed and the
// first error met (it goes on past errors).
func RemoveStale(dir, base string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var removed []string
	var first error
	for _, e := range ents {
		name := e.Name()
		b, pid, ok := tempWriter(name)
		if !ok || (base != "" && b != base) || !e.Type().IsRegular() || pid == os.Getpid() {
			continue
		}
		if err := unix.Kill(pid, 0); err == nil || errors.Is(err, unix.EPERM) {
			continue // the writer (or whoever has its pid now) runs
		}
		p := filepath.Join(dir, name)
		gone, err := removeUnlocked(p)
		if gone {
			removed = append(removed, p)
		}
		if err != nil && first == nil {
			first = err
		}
	}
	return removed, first
}

// removeUnlocked removes the regular file p unless someone holds flock on it. It checks, under
// the lock, that p still names the file it locked.
func removeUnlocked(p string) (bool, error) {
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, &fs.PathError{Op: "open", Path: p, Err: err}
	}
	defer unix.Close(fd)
	var st, again unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return false, err
	}
	if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return false, nil // its writer lives
		}
		return false, &fs.PathError{Op: "flock", Path: p, Err: err}
	}
	if err := unix.Lstat(p, &again); err != nil || again.Dev != st.Dev || again.Ino != st.Ino {
		return false, nil // replaced meanwhile
	}
	if err := unix.Unlink(p); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		return false, &fs.PathError{Op: "remove", Path: p, Err: err}
	}
	return true, nil
}

// Write writes to the temp file.
func (f *File) Write(p []byte) (int, error) { return f.f.Write(p) }

// Commit fsyncs the temp file, moves it to the target and fsyncs the target's directory. On
// failure the temp file is removed and the target keeps its old content (or stays absent).
func (f *File) Commit() error {
	if f.done {
		return fmt.Errorf("write %s: %w", f.path, errDone)
	}
	f.done = true
	if f.inPlace {
		if err := f.f.Close(); err != nil {
			return fmt.Errorf("write %s: %w", f.path, err)
		}
		return nil
	}
	if f.unnamed {
		err := f.commitUnnamed()
		if cerr := f.f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("write %s: %w", f.path, err)
		}
		if err := syncDir(filepath.Dir(f.path)); err != nil {
			return fmt.Errorf("write %s: fsync directory: %w", f.path, err)
		}
		return nil
	}
	tmp := f.f.Name()
	err := f.f.Sync()
	if cerr := f.f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write %s: %w", f.path, err)
	}
	if f.o.noReplace {
		// link(2) fails with EEXIST instead of replacing: an atomic create-if-absent.
		err = os.Link(tmp, f.path)
		os.Remove(tmp)
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("write %s: %w", f.path, fs.ErrExist)
		}
	} else if err = os.Rename(tmp, f.path); err != nil {
		os.Remove(tmp)
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", f.path, err)
	}
	if err := syncDir(filepath.Dir(f.path)); err != nil {
		return fmt.Errorf("write %s: fsync directory: %w", f.path, err)
	}
	return nil
}

// Abort discards the write: the temp file is closed and removed, the target left as it was.
func (f *File) Abort() {
	if f.done {
		return
	}
	f.done = true
	f.f.Close()
	if !f.inPlace && !f.unnamed { // an unnamed file is gone with its last descriptor
		os.Remove(f.f.Name())
	}
}

// commitUnnamed fsyncs the unnamed temp file and links it to the target: directly when the target
// does not exist (or must not be replaced), else under a temp name that is then renamed over the
// target. The file stays open (and flock'd) throughout.
func (f *File) commitUnnamed() error {
	if err := f.f.Sync(); err != nil {
		return err
	}
	err := linkFD(f.f, f.path)
	if err == nil {
		return nil
	}
	if !errors.Is(err, fs.ErrExist) {
		return err
	}
	if f.o.noReplace {
		return fs.ErrExist
	}
	dir, base := filepath.Split(f.path)
	for range 100 {
		tmp := filepath.Join(dir, tempPrefix(base)+strconv.Itoa(os.Getpid())+"-"+strconv.FormatUint(uint64(rand.Uint32()), 10))
		err := linkFD(f.f, tmp)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return err
		}
		if err := os.Rename(tmp, f.path); err != nil {
			os.Remove(tmp)
			return err
		}
		return nil
	}
	return fmt.Errorf("no free temp name for %s", f.path)
}

// linkFD gives the open file f the name path (which must not exist): linkat(2) with
// AT_EMPTY_PATH, which needs CAP_DAC_READ_SEARCH, else through /proc/self/fd.
func linkFD(f *os.File, path string) error {
	fd := int(f.Fd())
	err := unix.Linkat(fd, "", unix.AT_FDCWD, path, unix.AT_EMPTY_PATH)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EPERM) {
		if _, serr := os.Stat(filepath.Dir(path)); serr == nil { // not a missing directory
			err = unix.Linkat(unix.AT_FDCWD, "/proc/self/fd/"+strconv.Itoa(fd), unix.AT_FDCWD, path, unix.AT_SYMLINK_FOLLOW)
		}
	}
	if err != nil {
		return &os.LinkError{Op: "link", Old: f.Name(), New: path, Err: err}
	}
	return nil
}

var errDone = errors.New("atomic write already committed or aborted")

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
