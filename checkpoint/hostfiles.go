package checkpoint

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/hostreq"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
)

// DefaultCarryLimit bounds the bytes --carry-files takes along.
const DefaultCarryLimit = 64 << 20

// criuRecord keeps CRIU's record of the tree's files (files.img, remap-fpath.img) as the dump
// passes, for the image's host requirements.
type criuRecord struct {
	mu    sync.Mutex
	files map[string][]byte
}

// tee returns r, keeping a copy of the files the record needs (up to hostreq.MaxImageBytes).
func (c *criuRecord) tee(name string, r io.Reader) io.Reader {
	if name != hostreq.FilesImage && name != hostreq.RemapImage {
		return r
	}
	return &recordReader{r: r, c: c, name: name}
}

type recordReader struct {
	r    io.Reader
	c    *criuRecord
	name string
	buf  bytes.Buffer
	over bool
}

func (t *recordReader) Read(p []byte) (int, error) {
	n, err := t.r.Read(p)
	if !t.over {
		if t.buf.Len()+n > hostreq.MaxImageBytes {
			t.over, t.buf = true, bytes.Buffer{}
		} else {
			t.buf.Write(p[:n])
		}
	}
	if err == io.EOF && !t.over {
		t.c.mu.Lock()
		if t.c.files == nil {
			t.c.files = map[string][]byte{}
		}
		t.c.files[t.name] = t.buf.Bytes()
		t.c.mu.Unlock()
	}
	return n, err
}

// fromDir reads the record from a dump's images directory (a dump that was not streamed).
func (c *criuRecord) fromDir(images string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.files = map[string][]byte{}
	for _, name := range []string{hostreq.FilesImage, hostreq.RemapImage} {
		if b, err := readBounded(filepath.Join(images, name), hostreq.MaxImageBytes); err == nil {
			c.files[name] = b
		}
	}
}

func readBounded(path string, limit int64) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err == nil && int64(len(b)) > limit {
		err = fmt.Errorf("%s is larger than %d bytes", path, limit)
	}
	return b, err
}

// hostFiles decodes the record: the files a restore needs on its host.
func (c *criuRecord) hostFiles() ([]hostreq.File, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	files, ok := c.files[hostreq.FilesImage]
	if !ok {
		return nil, fmt.Errorf("CRIU's %s did not pass by", hostreq.FilesImage)
	}
	return hostreq.Decode(files, c.files[hostreq.RemapImage])
}

// recordHost puts the image's host requirements (and what it carries) into meta, and carries the
// files opened for writing when asked; add stores one carried file in the image. Failing to
// read CRIU's record is not fatal (restore reads files.img from the image instead), failing to
// carry a file asked for is.
func recordHost(env *op.Env, p *Plan, rec *criuRecord, meta *imagedesc.Description, add func(name string, r io.Reader, mode uint32) (int64, error)) error {
	files, err := rec.hostFiles()
	if err != nil {
		if p.opts.CarryFiles {
			return fmt.Errorf("--carry-files: cannot tell which files the tree has open: %w", err)
		}
		env.Logger().Warn("cannot list the files the image needs on the target host; restore will read them from the image", "err", err)
		return nil
	}
	if imagedesc.HostFilesFit(files) {
		meta.HostFiles, meta.HostFilesRecorded = files, true
	} else {
		env.Logger().Debug("host file list too long for the manifest; restore reads it from files.img", "files", len(files))
	}
	if !p.opts.CarryFiles {
		return nil
	}
	limit := p.opts.CarryLimit
	if limit <= 0 {
		limit = DefaultCarryLimit
	}
	var carried []hostreq.Carried
	var total int64
	for _, f := range files {
		if !f.Write || !f.Regular() {
			continue
		}
		c, r, err := openCarried(f, len(carried))
		if err != nil {
			return fmt.Errorf("carry %s: %w", f.Path, err)
		}
		if total += c.Size; total > limit || len(carried) == hostreq.MaxCarried {
			r.Close()
			return op.Refusef("--carry-files: the files open for writing exceed %s (or %d files); raise --carry-limit or copy them yourself",
				bytesize.Format(limit), hostreq.MaxCarried)
		}
		n, err := add(c.File, io.LimitReader(r, c.Size), 0o600)
		r.Close()
		if err == nil && n != c.Size {
			err = fmt.Errorf("read %d of its %d bytes: it shrank while being copied", n, c.Size)
		}
		if err != nil {
			return fmt.Errorf("carry %s: %w", f.Path, err)
		}
		carried = append(carried, c)
	}
	if len(carried) > 0 {
		meta.Carried = carried
	}
	return nil
}

// openCarried opens a file to carry. Its size is the one CRIU recorded when CRIU checks it (what
// the process wrote after the dump, with --leave-running, is left out); a file now shorter than
// that cannot be carried.
func openCarried(f hostreq.File, i int) (hostreq.Carried, *os.File, error) {
	fh, err := os.OpenFile(f.Path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return hostreq.Carried{}, nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(fh.Fd()), &st); err != nil {
		fh.Close()
		return hostreq.Carried{}, nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		fh.Close()
		return hostreq.Carried{}, nil, fmt.Errorf("no longer a regular file")
	}
	size := st.Size
	if f.Size >= 0 {
		if st.Size < f.Size {
			fh.Close()
			return hostreq.Carried{}, nil, fmt.Errorf("it shrank from %d to %d bytes since the dump", f.Size, st.Size)
		}
		size = f.Size
	}
	mode := st.Mode
	if f.Mode != 0 {
		mode = f.Mode // CRIU checks the mode it recorded
	}
	return hostreq.Carried{Path: f.Path, File: hostreq.CarriedName(i), Size: size, Mode: mode, UID: st.Uid, GID: st.Gid}, fh, nil
}
