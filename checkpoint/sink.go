package checkpoint

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/devmem"
	"github.com/ptxmig/ptxmig/internal/imgstream"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/store"
)

// imageSink is where a checkpoint's image goes: the one data path of Execute's steps. Streamed
// (streamSink), CRIU writes its files into the store through the streamer socket as it dumps;
// staged (stagedSink), CRIU writes them into the staging directory and the store takes them
// after the dump. Nothing is visible in the store before Commit; Close drops what was not
// committed (safe to call more than once, and after Commit).
type imageSink interface {
	// Streamed reports whether CRIU streams the dump (criu.DumpOptions.Stream). A streamed dump
	// hands the store references to the tree's live pages, read after CRIU is done: the tree
	// must stay stopped until Dump returns.
	Streamed() bool
	// Memory is where owned device memory goes, before the dump (an error when the sink cannot
	// take it then); the source reads it back (a rollback, the load after --leave-running).
	Memory(ctx context.Context) (devmem.Sink, devmem.Source, error)
	// Dump runs CRIU's dump with its image files going into the sink; rec keeps CRIU's record of
	// the tree's files (the host files).
	Dump(ctx context.Context, dump criu.DumpOptions, rec *criuRecord) error
	// AddFile adds a file of ptxmig's own (a carried host file) to the image.
	AddFile(name string, r io.Reader, mode uint32) (int64, error)
	// Has and WriteFile read back a file already in the sink (owned memory).
	Has(name string) bool
	WriteFile(ctx context.Context, name string, w io.Writer) (int64, error)
	// Commit stores the image with its description.
	Commit(ctx context.Context, meta store.Metadata) (*store.Manifest, *store.Stats, error)
	Close()
}

// newSink is the plan's data path into images (the staging directory's image directory).
func newSink(env *op.Env, p *Plan, images string) imageSink {
	if p.Stream {
		return &streamSink{env: env, p: p, images: images}
	}
	return &stagedSink{ImageDir: op.ImageDir(images), env: env, p: p}
}

// streamSink streams the image into the store (store.Ingest). The ingest opens with the first
// use: owned device memory goes into it before the dump.
type streamSink struct {
	env    *op.Env
	p      *Plan
	images string // CRIU's log, statistics and streamer socket
	ing    *store.Ingest
}

func (s *streamSink) Streamed() bool { return true }

func (s *streamSink) open(ctx context.Context) (*store.Ingest, error) {
	if s.ing != nil {
		return s.ing, nil
	}
	var progress func(done, total int64)
	if report := s.env.Progress; report != nil {
		// The ingest cannot know its total: the estimate (resident + GPU memory) stands in.
		est := int64(s.p.Estimate.HostBytes + s.p.Estimate.GPUBytes)
		progress = func(done, _ int64) { report(done, max(est, done)) }
	}
	meta, err := s.p.meta.Encode() // checked now, replaced at the commit
	if err != nil {
		return nil, fmt.Errorf("store image %q: %w", s.p.Image, err)
	}
	ing, err := s.env.Store.NewIngest(ctx, store.PutOptions{Name: s.p.Image, Meta: meta, Progress: progress})
	if err != nil {
		return nil, fmt.Errorf("store image %q: %w", s.p.Image, err)
	}
	s.ing = ing
	return ing, nil
}

func (s *streamSink) Memory(ctx context.Context) (devmem.Sink, devmem.Source, error) {
	in, err := s.open(ctx)
	if err != nil {
		return nil, nil, err
	}
	return in, in, nil
}

// Dump streams CRIU's dump into the ingest: CRIU writes each file into a pipe, ptxmig chunks,
// hashes, compresses and stages it as it arrives. On failure the ingest is failed (never
// committed; what it staged stays readable until Close, for a rollback that loads owned memory
// back from it) and the error says which side failed first: a store failure breaks CRIU's pipes,
// so CRIU's own error is then only a consequence.
func (s *streamSink) Dump(ctx context.Context, dump criu.DumpOptions, rec *criuRecord) error {
	ing, err := s.open(ctx)
	if err != nil {
		return err
	}
	srv, err := imgstream.Listen(dump.ImagesDir, imgstream.Capture)
	if err != nil {
		ing.Fail(err)
		return err
	}
	derr, serr := imgstream.With(ctx, srv, func(sctx context.Context) error {
		_, err := srv.Capture(sctx, func(name string, r io.Reader) error {
			_, err := ing.AddFile(name, 0o600, rec.tee(name, r))
			return err
		})
		return err
	}, func() error {
		dump.Progress = srv.Moved // what CRIU streamed is progress too
		_, err := s.env.CRIU.Dump(ctx, dump)
		return err
	})
	switch {
	case derr != nil && serr != nil && !imgstream.Consequence(serr):
		err := fmt.Errorf("stream the dump into the store: %w (CRIU then failed: %w)", serr, derr)
		ing.Fail(err)
		return err
	case derr != nil:
		ing.Fail(derr)
		return derr
	case serr != nil:
		// CRIU succeeded: the tree is dumped (and stopped, unless left running), so the dump step
		// stands and its undo resumes the tree; the failure surfaces at the store step, which
		// cannot commit a failed ingest, and rolls everything back.
		ing.Fail(fmt.Errorf("stream the dump into the store: %w", serr))
	}
	return nil
}

func (s *streamSink) AddFile(name string, r io.Reader, mode uint32) (int64, error) {
	if s.ing == nil {
		return 0, fmt.Errorf("%s: no image being written", name)
	}
	return s.ing.AddFile(name, mode, r)
}

func (s *streamSink) Has(name string) bool { return s.ing != nil && s.ing.HasFile(name) }

func (s *streamSink) WriteFile(ctx context.Context, name string, w io.Writer) (int64, error) {
	if s.ing == nil {
		return 0, fmt.Errorf("%s: no image being written", name)
	}
	return s.ing.WriteFile(ctx, name, w)
}

// Commit adds what CRIU wrote locally (its log and statistics) and commits the image.
func (s *streamSink) Commit(_ context.Context, meta store.Metadata) (*store.Manifest, *store.Stats, error) {
	if s.ing == nil {
		return nil, nil, fmt.Errorf("store image %q: nothing was dumped", s.p.Image)
	}
	ents, err := os.ReadDir(s.images)
	if err != nil {
		return nil, nil, err
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue // the streamer's socket, gone already
		}
		if err := s.addLocal(e.Name()); err != nil {
			return nil, nil, err
		}
	}
	return s.ing.Commit(meta)
}

func (s *streamSink) addLocal(name string) error {
	f, err := os.OpenFile(filepath.Join(s.images, name), os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	_, err = s.ing.AddFile(name, uint32(fi.Mode().Perm()), f)
	return err
}

func (s *streamSink) Close() {
	if s.ing != nil {
		s.ing.Close()
		s.ing = nil
	}
}

// stagedSink has CRIU write its files into the staging directory; the store starts on them while
// CRIU still writes them (store.Prestage), so that the commit only re-reads, re-hashes and
// commits what is already encoded.
type stagedSink struct {
	op.ImageDir // CRIU's images, read back with Has and WriteFile
	env         *op.Env
	p           *Plan
	pre         *store.Prestage
}

func (s *stagedSink) Streamed() bool { return false }

func (s *stagedSink) Memory(context.Context) (devmem.Sink, devmem.Source, error) {
	return nil, nil, fmt.Errorf("the checkpoint is not streamed (%s)", s.p.StreamOff)
}

func (s *stagedSink) Dump(ctx context.Context, dump criu.DumpOptions, rec *criuRecord) error {
	s.prestage(ctx)
	_, err := s.env.CRIU.Dump(ctx, dump)
	if err == nil {
		rec.fromDir(string(s.ImageDir))
	}
	if s.pre != nil {
		if perr := s.pre.Stop(); perr != nil {
			s.env.Logger().Debug("prestage stopped early", "err", perr)
		}
	}
	return err
}

// prestage starts storing the dump's files while CRIU writes them (none when it cannot).
func (s *stagedSink) prestage(ctx context.Context) {
	w := s.p.opts.PrestageWorkers
	if w < 0 {
		return
	}
	if w == 0 {
		w = max(1, runtime.NumCPU()/2) // leave half the CPUs to CRIU
	}
	pre, err := s.env.Store.Prestage(ctx, string(s.ImageDir), store.PutOptions{Workers: w})
	if err != nil {
		s.env.Logger().Debug("no prestage; the store runs after the dump", "err", err)
		return
	}
	s.pre = pre
}

// AddFile writes a carried file next to CRIU's images.
func (s *stagedSink) AddFile(name string, r io.Reader, mode uint32) (int64, error) {
	f, err := os.OpenFile(filepath.Join(string(s.ImageDir), name), os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, os.FileMode(mode&0o777))
	if err != nil {
		return 0, err
	}
	n, err := io.Copy(f, r)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return n, err
}

func (s *stagedSink) Commit(ctx context.Context, meta store.Metadata) (*store.Manifest, *store.Stats, error) {
	return s.env.Store.Put(ctx, string(s.ImageDir), store.PutOptions{Name: s.p.Image, Meta: meta, Progress: s.env.Progress, Prestaged: s.pre})
}

func (s *stagedSink) Close() {
	if s.pre != nil {
		s.pre.Close()
		s.pre = nil
	}
}
