package restore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/devmem"
	"github.com/ptxmig/ptxmig/internal/imgstream"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/store"
)

// imageSource is where a restore reads its image from: the one data path of Execute's steps.
// Streamed (streamSource), CRIU reads the files straight out of the store through the streamer
// socket; staged (stagedSource), the image is first materialized into the staging directory.
type imageSource interface {
	// Open gets the image ready before anything is touched (a corrupt image is store.ErrCorrupt)
	// and returns the bytes it wrote (0 when streamed).
	Open(ctx context.Context) (int64, error)
	// Restore runs CRIU's restore reading the image from the source.
	Restore(ctx context.Context, ropts criu.RestoreOptions) (*criu.RestoreResult, error)
	// Has and WriteFile read one of the image's files (owned memory, carried host files).
	Has(name string) bool
	WriteFile(ctx context.Context, name string, w io.Writer) (int64, error)
	Close()
}

// newSource is the plan's data path out of the store; images is the staging directory's image
// directory (CRIU's images, materialized, or its streamer socket).
func newSource(env *op.Env, p *Plan, images string) imageSource {
	if p.Stream {
		return &streamSource{env: env, p: p} // CRIU finds the streamer in images (RestoreOptions)
	}
	return &stagedSource{ImageDir: op.ImageDir(images), env: env, p: p}
}

// streamSource serves the image to CRIU out of the store.
type streamSource struct {
	env *op.Env
	p   *Plan
	rd  *store.ImageReader
}

// Open opens the image and verifies, before anything runs, every file but the memory pages: CRIU
// may not read all of them, and they are small. The pages are verified chunk by chunk as they are
// streamed, owned device memory as the load step reads it (before the resume), and whatever CRIU
// left unread after its restore.
func (s *streamSource) Open(ctx context.Context) (int64, error) {
	rd, err := s.env.Store.OpenImage(ctx, s.p.ImageID, store.GetOptions{Progress: s.env.Progress})
	if err != nil {
		return 0, openErr("open image %s in the store: %w", s.p.Image, err)
	}
	s.rd = rd
	rd.DeferVerify(devmem.IsData)
	for _, f := range rd.Manifest().Files {
		if f.Type != store.TypeFile || isPages(f.Path) || devmem.IsData(f.Path) {
			continue
		}
		if _, err := rd.WriteFile(ctx, f.Path, io.Discard); err != nil {
			return 0, openErr("open image %s in the store: %w", s.p.Image, err)
		}
	}
	return 0, nil
}

// openErr wraps an error of Open with what it was doing, except a corrupt image's: Execute turns
// that into a refusal which names the image already.
func openErr(format, image string, err error) error {
	if errors.Is(err, store.ErrCorrupt) {
		return err
	}
	return fmt.Errorf(format, image, err)
}

// isPages reports whether an image file holds memory pages (CRIU's pages-N.img).
func isPages(name string) bool {
	return strings.HasPrefix(name, "pages-") && strings.HasSuffix(name, ".img")
}

// Restore runs CRIU's restore reading its image files from the store through the streamer socket,
// then verifies every chunk CRIU did not read. A corrupt chunk CRIU asks for breaks its pipe:
// CRIU fails before the restored processes run, and the error names the file and offset.
func (s *streamSource) Restore(ctx context.Context, ropts criu.RestoreOptions) (*criu.RestoreResult, error) {
	srv, err := imgstream.Listen(ropts.ImagesDir, imgstream.Serve)
	if err != nil {
		return nil, err
	}
	var r *criu.RestoreResult
	cerr, serr := imgstream.With(ctx, srv, func(sctx context.Context) error {
		_, err := srv.Serve(sctx, s)
		return err
	}, func() error {
		var err error
		r, err = s.env.CRIU.Restore(ctx, ropts)
		return err
	})
	switch {
	case cerr != nil && errors.Is(serr, store.ErrCorrupt):
		return r, fmt.Errorf("%w; CRIU stopped before the restored processes ran (CRIU then failed: %w)", serr, cerr)
	case cerr != nil && serr != nil && !imgstream.Consequence(serr):
		return r, fmt.Errorf("stream the image to CRIU: %w (CRIU then failed: %w)", serr, cerr)
	case cerr != nil:
		return r, cerr
	case serr != nil:
		return r, fmt.Errorf("stream the image to CRIU: %w", serr)
	}
	if err := s.rd.VerifyRest(ctx); err != nil {
		return r, fmt.Errorf("image %s: a part CRIU did not read is corrupt: %w", s.p.Image, err)
	}
	return r, nil
}

func (s *streamSource) Has(name string) bool {
	if s.rd == nil {
		return false
	}
	_, ok := s.rd.Lookup(name)
	return ok
}

func (s *streamSource) WriteFile(ctx context.Context, name string, w io.Writer) (int64, error) {
	if s.rd == nil {
		return 0, fmt.Errorf("%s: the image is not open", name)
	}
	return s.rd.WriteFile(ctx, name, w)
}

func (s *streamSource) Close() {
	if s.rd != nil {
		s.rd.Close()
		s.rd = nil
	}
}

// stagedSource materializes the image into the staging directory, verified, for CRIU to read.
type stagedSource struct {
	op.ImageDir // where the image is materialized, read with Has and WriteFile
	env         *op.Env
	p           *Plan
}

func (s *stagedSource) Open(ctx context.Context) (int64, error) {
	st, err := s.env.Store.Materialize(ctx, s.p.ImageID, string(s.ImageDir), store.GetOptions{Progress: s.env.Progress})
	if err != nil {
		return 0, openErr("materialize image %s: %w", s.p.Image, err)
	}
	if st == nil {
		return 0, nil
	}
	return st.LogicalBytes, nil
}

func (s *stagedSource) Restore(ctx context.Context, ropts criu.RestoreOptions) (*criu.RestoreResult, error) {
	return s.env.CRIU.Restore(ctx, ropts)
}

func (s *stagedSource) Close() {}
