// Package atomicfile writes files so that readers, and a crash at any moment, see the old content
// or the new, never a part: the data goes to a temp file in the target's directory, which is
// given its mode, fsynced, renamed into place (or hard-linked, with NoReplace), and then the
// directory is fsynced so that the rename itself is durable.
//
// A crash can leave a temp file named ".NAME.tmp-*" beside the target (or in TempDir); nothing
// else is ever left behind: a failed write removes its temp file and keeps the old content.
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
	"os"
	"path/filepath"
)

// Option changes how a file is written.
type Option func(*options)

type options struct {
	noReplace bool
	tempDir   string
}

// NoReplace makes the write fail with an error wrapping fs.ErrExist, instead of replacing, when
// the target exists. The check and the creation are one atomic step (link(2)), so of several
// concurrent writers exactly one succeeds.
func NoReplace() Option { return func(o *options) { o.noReplace = true } }

// TempDir puts the temp file in dir instead of the target's directory; dir must be on the same
// file system as the target (the image store keeps its temp files in its tmp/, which gc empties).
func TempDir(dir string) Option { return func(o *options) { o.tempDir = dir } }

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
	inPlace bool // a device or FIFO: written directly
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
	if dir == "" {
		dir = filepath.Dir(path)
	}
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return nil, fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Chmod(mode); err != nil {
		f.Close()
		os.Remove(f.Name())
		return nil, fmt.Errorf("write %s: %w", path, err)
	}
	return &File{f: f, path: path, o: o}, nil
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
	if !f.inPlace {
		os.Remove(f.f.Name())
	}
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
