// Package hostreq says what a host must provide to restore an image, and checks it: the files
// the checkpointed processes held open or mapped (their executables and libraries included),
// which CRIU reopens by path and refuses unless each has the size and mode it recorded.
//
// The list comes from CRIU's own record, files.img (every regular-file entry CRIU will reopen),
// minus the files CRIU restores from the image itself (deleted files it saved as ghosts, /proc
// paths), listed in remap-fpath.img. Everything read from an image is validated and bounded.
package hostreq

import (
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strings"
	"unicode/utf8"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	remap "github.com/checkpoint-restore/go-criu/v7/crit/images/remap-file-path"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// CRIU's image file names and magics (criu/include/magic.h).
const (
	FilesImage = "files.img"
	RemapImage = "remap-fpath.img"

	magicCommon = 0x54564319 // IMG_COMMON
	magicFiles  = 0x56303138 // FILES
	magicRemap  = 0x59133954 // REMAP_FPATH
)

// Limits on what is decoded.
const (
	MaxImageBytes = 64 << 20 // of files.img or remap-fpath.img
	MaxFiles      = 100_000
	maxEntry      = 1 << 20
	maxPath       = 4096
)

// ErrInvalid marks an image record that is malformed or out of bounds.
var ErrInvalid = errors.New("invalid host requirements")

// File is a file the restored processes need on the target host, as CRIU recorded it.
type File struct {
	Path  string `json:"path"`            // absolute, clean
	Mode  uint32 `json:"mode,omitempty"`  // st_mode (type and permission bits); 0: not checked
	Size  int64  `json:"size"`            // -1: not checked
	Write bool   `json:"write,omitempty"` // the process had it open for writing
	// BuildID is the GNU build-ID CRIU recorded for an ELF file (hex of its zero-padded words),
	// which its restore compares; empty when it recorded none.
	BuildID string `json:"build_id,omitempty"`
}

// Regular reports whether the file was a regular file (only those can be carried).
func (f File) Regular() bool { return f.Mode&unix.S_IFMT == unix.S_IFREG }

// Decode reads CRIU's files.img (and remap-fpath.img, nil when the image has none) into the
// files CRIU will reopen by path at restore, sorted by path, each once.
func Decode(files, remaps []byte) ([]File, error) {
	remapped := map[uint32]bool{}
	if remaps != nil {
		err := entries(remaps, magicRemap, func(b []byte) error {
			var e remap.RemapFilePathEntry
			if err := proto.Unmarshal(b, &e); err != nil {
				return err
			}
			remapped[e.GetOrigId()] = true
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %v", ErrInvalid, RemapImage, err)
		}
	}
	byPath := map[string]File{}
	err := entries(files, magicFiles, func(b []byte) error {
		var e fdinfo.FileEntry
		if err := proto.Unmarshal(b, &e); err != nil {
			return err
		}
		r := e.GetReg()
		if e.GetType() != fdinfo.FdTypes_REG || r == nil || r.GetExt() || remapped[e.GetId()] {
			return nil
		}
		p := r.GetName()
		if err := validPath(p); err != nil {
			return err
		}
		if strings.HasPrefix(p, "/proc/") || p == "/proc" {
			return nil // CRIU reopens procfs paths through the restored pids
		}
		f := File{Path: p, Size: -1}
		if r.Size != nil {
			if r.GetSize() > 1<<62 {
				return fmt.Errorf("file %s: size %d", p, r.GetSize())
			}
			f.Size = int64(r.GetSize())
		}
		if r.Mode != nil {
			f.Mode = r.GetMode()
		}
		bid, err := buildIDWords(r.GetBuildId())
		if err != nil {
			return fmt.Errorf("file %s: %v", p, err)
		}
		f.BuildID = hex.EncodeToString(bid)
		f.Write = r.GetFlags()&unix.O_ACCMODE != unix.O_RDONLY
		if old, ok := byPath[p]; ok {
			// One file, several descriptors: CRIU checks each entry that records a size or mode
			// (an appending writer records no size), so keep what any of them recorded.
			f.Write = f.Write || old.Write
			if f.Size < 0 {
				f.Size = old.Size
			} else if old.Size >= 0 && old.Size != f.Size {
				return fmt.Errorf("file %s recorded with sizes %d and %d", p, old.Size, f.Size)
			}
			if f.Mode == 0 {
				f.Mode = old.Mode
			}
			if f.BuildID == "" {
				f.BuildID = old.BuildID
			}
		}
		byPath[p] = f
		if len(byPath) > MaxFiles {
			return fmt.Errorf("more than %d files", MaxFiles)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrInvalid, FilesImage, err)
	}
	out := make([]File, 0, len(byPath))
	for _, f := range byPath {
		out = append(out, f)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, nil
}

// entries walks a CRIU image of the given magic: IMG_COMMON, the magic, then entries of a
// little-endian u32 size and a protobuf message.
func entries(b []byte, magic uint32, fn func([]byte) error) error {
	if len(b) > MaxImageBytes {
		return fmt.Errorf("%d bytes, more than %d", len(b), MaxImageBytes)
	}
	if len(b) < 8 || binary.LittleEndian.Uint32(b) != magicCommon || binary.LittleEndian.Uint32(b[4:]) != magic {
		return errors.New("not a CRIU image of the expected kind (bad magic)")
	}
	b = b[8:]
	for len(b) > 0 {
		if len(b) < 4 {
			return errors.New("truncated entry header")
		}
		n := binary.LittleEndian.Uint32(b)
		if n > maxEntry || int(n) > len(b)-4 {
			return fmt.Errorf("entry of %d bytes with %d left", n, len(b)-4)
		}
		if err := fn(b[4 : 4+n]); err != nil {
			return err
		}
		b = b[4+n:]
	}
	return nil
}

func validPath(p string) error {
	switch {
	case p == "" || p[0] != '/' || path.Clean(p) != p:
		return fmt.Errorf("path %.100q is not absolute and clean", p)
	case len(p) > maxPath:
		return fmt.Errorf("path of %d bytes", len(p))
	case !utf8.ValidString(p) || strings.ContainsRune(p, 0):
		return fmt.Errorf("path %.100q is not valid UTF-8 text", p)
	}
	return nil
}

// Encode renders files for a manifest's metadata.
func Encode(files []File) string {
	b, _ := json.Marshal(files) // plain structs: cannot fail
	return string(b)
}

// Parse reads files recorded by Encode, validating every field.
func Parse(s string) ([]File, error) {
	var files []File
	if err := json.Unmarshal([]byte(s), &files); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if err := ValidateFiles(files); err != nil {
		return nil, err
	}
	return files, nil
}

// ValidateFiles checks every field of files read from an image (Parse's checks).
func ValidateFiles(files []File) error {
	if len(files) > MaxFiles {
		return fmt.Errorf("%w: %d files", ErrInvalid, len(files))
	}
	for _, f := range files {
		if err := validPath(f.Path); err != nil {
			return fmt.Errorf("%w: %v", ErrInvalid, err)
		}
		if f.Size < -1 {
			return fmt.Errorf("%w: file %s: size %d", ErrInvalid, f.Path, f.Size)
		}
		if err := validBuildIDHex(f.BuildID); err != nil {
			return fmt.Errorf("%w: file %s: %v", ErrInvalid, f.Path, err)
		}
	}
	return nil
}

// Problem is a file the host lacks, or has in another state than the image needs.
type Problem struct {
	Path string `json:"path"`
	Want string `json:"want"`
	Have string `json:"have"`
	Fix  string `json:"fix"`
}

func (p Problem) String() string {
	return fmt.Sprintf("%s: the image needs %s, this host has %s; %s", p.Path, p.Want, p.Have, p.Fix)
}

// Stat reads a file's status the way CRIU will meet it (following symlinks, as its open does).
type Stat func(path string, st *unix.Stat_t) error

// Check compares each file with this host (stat: unix.Stat when nil), as CRIU's restore will:
// the file must exist, and where CRIU recorded them, have the same size, the same mode (file
// type and permission bits) and, for an ELF file, the same build-ID.
func Check(files []File, stat Stat) []Problem {
	if stat == nil {
		stat = unix.Stat
	}
	var out []Problem
	for _, f := range files {
		want := describe(f.Mode, f.Size)
		var st unix.Stat_t
		if err := stat(f.Path, &st); err != nil {
			have := "no such file"
			if !errors.Is(err, fs.ErrNotExist) {
				have = "a file it cannot read (" + err.Error() + ")"
			}
			out = append(out, Problem{Path: f.Path, Want: want, Have: have, Fix: fix(f, true)})
			continue
		}
		sizeOK := f.Size < 0 || st.Size == f.Size
		modeOK := f.Mode == 0 || st.Mode == f.Mode
		if !sizeOK || !modeOK {
			out = append(out, Problem{Path: f.Path, Want: want, Have: describe(st.Mode, st.Size), Fix: fix(f, false)})
			continue
		}
		if f.BuildID != "" && st.Mode&unix.S_IFMT == unix.S_IFREG {
			rec, _ := hex.DecodeString(f.BuildID) // validated by Parse/Decode
			have, err := readBuildID(f.Path)
			if err == nil && sameBuildID(have, rec) {
				continue
			}
			h := "another build (build-ID " + hex.EncodeToString(have) + ")"
			switch {
			case errors.Is(err, errNoBuildID):
				h = "a file without a build-ID"
			case err != nil:
				h = "a file it cannot read (" + err.Error() + ")"
			}
			out = append(out, Problem{Path: f.Path, Want: want + " with build-ID " + f.BuildID, Have: h,
				Fix: "install the very build the source host ran (CRIU compares ELF build-IDs, and a rebuild of the same source " +
					"differs), e.g. copy it from the source host"})
		}
	}
	return out
}

func describe(mode uint32, size int64) string {
	kind := "a file"
	switch mode & unix.S_IFMT {
	case unix.S_IFREG:
		kind = "a regular file"
	case unix.S_IFCHR:
		kind = "a character device"
	case unix.S_IFBLK:
		kind = "a block device"
	case unix.S_IFDIR:
		kind = "a directory"
	case unix.S_IFIFO:
		kind = "a FIFO"
	case unix.S_IFSOCK:
		kind = "a socket"
	}
	s := kind
	if mode != 0 {
		s += fmt.Sprintf(" with mode %04o", mode&0o7777)
	}
	if size >= 0 && (mode == 0 || mode&unix.S_IFMT == unix.S_IFREG) {
		s += fmt.Sprintf(" of %d bytes", size)
	}
	return s
}

func fix(f File, missing bool) string {
	switch {
	case f.Write && f.Regular():
		return "the process wrote to it: checkpoint with --carry-files to take it along (restore puts it in place; " +
			"--overwrite-files replaces a different one), or copy it here from the source host"
	case f.Mode&unix.S_IFMT == unix.S_IFDIR:
		return fmt.Sprintf("create the directory with mode %04o (it was the process's working or root directory)", f.Mode&0o7777)
	case missing:
		return "install it (the same version as on the source host: CRIU checks size and mode), or copy it here"
	default:
		return "install the same version as on the source host (CRIU checks size and mode)"
	}
}

// MaxCarried bounds the files one image carries.
const MaxCarried = 256

// Carried is a file the image carries: a copy of Path, stored in the image as File.
type Carried struct {
	Path string `json:"path"`
	File string `json:"file"` // carried-N
	Size int64  `json:"size"`
	Mode uint32 `json:"mode"` // st_mode (a regular file)
	UID  uint32 `json:"uid"`
	GID  uint32 `json:"gid"`
}

// CarriedName is the image file that holds the i-th carried file.
func CarriedName(i int) string { return fmt.Sprintf("carried-%d", i) }

// EncodeCarried renders carried files for a manifest's metadata.
func EncodeCarried(c []Carried) string {
	b, _ := json.Marshal(c) // plain structs: cannot fail
	return string(b)
}

// ParseCarried reads carried files recorded by EncodeCarried, validating every field.
func ParseCarried(s string) ([]Carried, error) {
	var cs []Carried
	if err := json.Unmarshal([]byte(s), &cs); err != nil {
		return nil, fmt.Errorf("%w: carried files: %v", ErrInvalid, err)
	}
	if err := ValidateCarried(cs); err != nil {
		return nil, err
	}
	return cs, nil
}

// ValidateCarried checks every field of carried files read from an image (ParseCarried's checks).
func ValidateCarried(cs []Carried) error {
	if len(cs) > MaxCarried {
		return fmt.Errorf("%w: %d carried files", ErrInvalid, len(cs))
	}
	seen := map[string]bool{}
	for i, c := range cs {
		switch err := validPath(c.Path); {
		case err != nil:
			return fmt.Errorf("%w: carried file: %v", ErrInvalid, err)
		case c.File != CarriedName(i):
			return fmt.Errorf("%w: carried file %s is stored as %q, want %q", ErrInvalid, c.Path, c.File, CarriedName(i))
		case c.Size < 0 || c.Mode&unix.S_IFMT != unix.S_IFREG || seen[c.Path]:
			return fmt.Errorf("%w: carried file %s: size %d, mode %o", ErrInvalid, c.Path, c.Size, c.Mode)
		}
		seen[c.Path] = true
	}
	return nil
}
