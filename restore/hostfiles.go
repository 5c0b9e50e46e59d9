package restore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/hostreq"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/store"
)

// Placement is a carried file restore puts in place before CRIU runs.
type Placement struct {
	hostreq.Carried
	Replace bool `json:"replace,omitempty"` // a different file is there (--overwrite-files): it is moved aside
}

// planHost checks the files the image needs against this host: those it lacks, or has with
// another size or mode, are placed from the image's carried copies where it has them (replacing
// a different file only with OverwriteFiles), else refused, each named with its fix.
func (p *Plan) planHost(ctx context.Context, env *op.Env, m *store.Manifest) error {
	// Versions: not refused (restores across them were not measured either way), but said.
	for _, v := range []struct{ what, img, here string }{
		{"NVIDIA driver", p.meta.Driver, env.Host.Driver},
		{"CUDA driver API", p.meta.CUDA, env.Host.CUDA},
		{"CRIU", p.meta.CRIU, env.CRIUVersion},
	} {
		if v.img != "" && v.here != "" && v.img != v.here && (p.meta.Kind == op.KindCUDA || v.what == "CRIU") {
			p.Warnings = append(p.Warnings, fmt.Sprintf("the image was made with %s %s, this host has %s: restores across versions "+
				"were not measured", v.what, v.img, v.here))
		}
	}
	files, err := imageHostFiles(ctx, env, m, p.meta)
	if errors.Is(err, errNoRecord) {
		p.Warnings = append(p.Warnings, fmt.Sprintf("image %s holds no record of the files it needs (no %s): they are not checked "+
			"before CRIU runs", m.Name, hostreq.FilesImage))
	} else if err != nil {
		return op.Refusef("image %s: the files it needs on this host: %w", m.Name, err)
	}
	p.HostFiles = len(files)
	if err := p.meta.Problem(imagedesc.FieldCarried); err != nil {
		return op.Refusef("image %s: %w", m.Name, err)
	}
	carried := p.meta.Carried
	byPath := map[string]hostreq.Carried{}
	for _, c := range carried {
		byPath[c.Path] = c
	}
	var unresolved []string
	for _, pr := range hostreq.Check(files, nil) {
		c, ok := byPath[pr.Path]
		switch {
		case ok && c.Mode&(unix.S_ISUID|unix.S_ISGID) != 0:
			pr.Fix = "the image carries a set-user-ID or set-group-ID copy, which ptxmig does not put in place: install it yourself"
			unresolved = append(unresolved, pr.String())
		case ok && pr.Have == "no such file":
			p.Place = append(p.Place, Placement{Carried: c})
		case ok && p.opts.OverwriteFiles:
			p.Place = append(p.Place, Placement{Carried: c, Replace: true})
		case ok:
			pr.Fix = "the image carries a copy: --overwrite-files puts it in place (the file here is moved aside to " +
				filepath.Base(pr.Path) + ".ptxmig-replaced-TIME)"
			unresolved = append(unresolved, pr.String())
		default:
			unresolved = append(unresolved, pr.String())
		}
	}
	if len(unresolved) > 0 {
		const show = 10
		more := ""
		if len(unresolved) > show {
			more = fmt.Sprintf("\n  … and %d more", len(unresolved)-show)
			unresolved = unresolved[:show]
		}
		return op.Refusef("image %s needs files this host lacks or has in another state (CRIU would fail on each; nothing was touched):\n  %s%s",
			m.Name, strings.Join(unresolved, "\n  "), more)
	}
	return nil
}

// errNoRecord: the image has neither a recorded list nor CRIU's files.img (not a CRIU image).
var errNoRecord = errors.New("no record of the files the image needs")

// imageHostFiles is the image's list of needed files: recorded in the manifest, else (older
// images, long lists) read from CRIU's files.img in the image.
func imageHostFiles(ctx context.Context, env *op.Env, m *store.Manifest, d *imagedesc.Description) ([]hostreq.File, error) {
	if err := d.Problem(imagedesc.FieldHostFiles); err != nil {
		return nil, err
	}
	if d.HostFilesRecorded {
		return d.HostFiles, nil
	}
	got, err := readImageFiles(ctx, env, m, hostreq.FilesImage, hostreq.RemapImage)
	if err != nil {
		return nil, err
	}
	if got[0] == nil {
		return nil, errNoRecord
	}
	return hostreq.Decode(got[0], got[1])
}

// readImageFiles reads CRIU image files of m by name (each bounded by hostreq.MaxImageBytes);
// nil for one the image lacks.
func readImageFiles(ctx context.Context, env *op.Env, m *store.Manifest, names ...string) ([][]byte, error) {
	rd, err := env.Store.OpenImage(ctx, m.ID, store.GetOptions{})
	if err != nil {
		return nil, err
	}
	defer rd.Close()
	out := make([][]byte, len(names))
	for i, name := range names {
		if _, ok := rd.Lookup(name); !ok {
			continue
		}
		if out[i], err = store.ReadFileLimit(ctx, rd, name, hostreq.MaxImageBytes); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// placeFiles puts the planned carried files in place, reading each from the image (src). It
// returns how to undo it: placed files removed, replaced ones moved back, directories it created
// removed.
func placeFiles(ctx context.Context, log *slog.Logger, src imageSource, place []Placement) (func(), error) {
	var undo []func()
	undoAll := func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}
	for _, pl := range place {
		u, err := placeOne(ctx, src, pl)
		if u != nil {
			undo = append(undo, u...)
		}
		if err != nil {
			undoAll()
			return func() {}, fmt.Errorf("put %s in place: %w", pl.Path, err)
		}
		log.Info("put a carried file in place", "path", pl.Path, "bytes", pl.Size, "replaced", pl.Replace)
	}
	return undoAll, nil
}

func placeOne(ctx context.Context, src imageSource, pl Placement) ([]func(), error) {
	var undo []func()
	dir, base := filepath.Dir(pl.Path), filepath.Base(pl.Path)
	if len(base) > 200 {
		return undo, fmt.Errorf("file name of %d bytes leaves no room for the temporary and moved-aside names", len(base))
	}
	// The directory is reached from / without following a symbolic link (a user who owns a
	// component of the path must not redirect root's writes), creating what is missing, owned by
	// the carried file's owner; every later step works relative to it.
	dfd, created, err := openDirNoFollow(dir, true, int(pl.UID), int(pl.GID))
	for i := len(created) - 1; i >= 0; i-- {
		d := created[i]
		undo = append(undo, func() { removeNoFollow(d, true) })
	}
	if err != nil {
		return undo, err
	}
	defer unix.Close(dfd)
	tmpName := fmt.Sprintf(".%s.ptxmig-%d", base, time.Now().UnixNano())
	fd, err := unix.Openat(dfd, tmpName, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return undo, err
	}
	tmp := os.NewFile(uintptr(fd), tmpName)
	defer unix.Unlinkat(dfd, tmpName, 0) // gone once linked into place, or on failure
	n, err := src.WriteFile(ctx, pl.File, tmp)
	if err == nil && n != pl.Size {
		err = fmt.Errorf("the image's copy has %d bytes, its record %d", n, pl.Size)
	}
	if err == nil {
		err = unix.Fchown(fd, int(pl.UID), int(pl.GID)) // before the mode: a chown clears set-id bits
	}
	if err == nil {
		err = unix.Fchmod(fd, pl.Mode&0o1777) // set-id bits are refused when planning
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return undo, err
	}
	if pl.Replace {
		aside := fmt.Sprintf("%s.ptxmig-replaced-%s", base, time.Now().UTC().Format("20060102T150405"))
		if err := unix.Renameat2(dfd, base, dfd, aside, unix.RENAME_NOREPLACE); err != nil {
			return undo, fmt.Errorf("move the file there aside: %w", err)
		}
		undo = append(undo, func() {
			if d, _, err := openDirNoFollow(dir, false, 0, 0); err == nil {
				_ = unix.Renameat(d, aside, d, base)
				unix.Close(d)
			}
		})
	}
	// Never over a file that appeared meanwhile: link (fails if the name exists).
	if err := unix.Linkat(dfd, tmpName, dfd, base, 0); err != nil {
		return undo, err
	}
	undo = append(undo, func() { removeNoFollow(pl.Path, false) })
	return undo, nil
}

// openDirNoFollow opens directory path (absolute, clean) as an O_PATH descriptor without
// following any symbolic link on the way; with create, missing components are made (mode 0755,
// owned by uid:gid) and returned in order.
func openDirNoFollow(path string, create bool, uid, gid int) (int, []string, error) {
	var created []string
	fd, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, nil, err
	}
	cur := "/"
	for _, comp := range strings.Split(strings.TrimPrefix(path, "/"), "/") {
		if comp == "" {
			continue
		}
		next := filepath.Join(cur, comp)
		how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: unix.RESOLVE_NO_SYMLINKS}
		nfd, err := unix.Openat2(fd, comp, how)
		if errors.Is(err, unix.ENOENT) && create {
			if err = unix.Mkdirat(fd, comp, 0o755); err == nil {
				created = append(created, next)
				if err = unix.Fchownat(fd, comp, uid, gid, unix.AT_SYMLINK_NOFOLLOW); err == nil {
					nfd, err = unix.Openat2(fd, comp, how)
				}
			}
		}
		unix.Close(fd)
		switch {
		case errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR):
			return -1, created, fmt.Errorf("%s is not a plain directory on this host (a symbolic link or a file): put the file in place yourself", next)
		case errors.Is(err, unix.ENOSYS):
			return -1, created, fmt.Errorf("putting files in place needs openat2 (Linux 5.6)")
		case err != nil:
			return -1, created, fmt.Errorf("%s: %w", next, err)
		}
		fd, cur = nfd, next
	}
	return fd, created, nil
}

// removeNoFollow removes a file (or an empty directory) whose parent is reached without
// following symbolic links.
func removeNoFollow(path string, dir bool) {
	d, _, err := openDirNoFollow(filepath.Dir(path), false, 0, 0)
	if err != nil {
		return
	}
	defer unix.Close(d)
	flags := 0
	if dir {
		flags = unix.AT_REMOVEDIR
	}
	_ = unix.Unlinkat(d, filepath.Base(path), flags)
}
