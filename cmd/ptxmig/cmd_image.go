package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"
	"golang.org/x/term"

	"github.com/ptxmig/ptxmig/internal/atomicfile"
	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/progress"
	"github.com/ptxmig/ptxmig/store"
)

func init() {
	workers := &cli.IntFlag{Name: "workers", Usage: "parallel workers (0: one per CPU)"}
	memory := &cli.StringFlag{Name: "memory", Value: "512MiB", Usage: "bound on buffer memory, e.g. 256MiB or 2GiB"}
	register(&cli.Command{
		Name:  "image",
		Usage: "manage images in the store: add, extract, inspect, verify, rm, gc, export, import",
		Description: "Images are immutable, named directory trees (a CRIU dump plus ptxmig metadata) kept as\n" +
			"BLAKE3-addressed, zstd-compressed, deduplicated chunks. Every read re-verifies chunk hashes.\n" +
			"An image is named by its NAME, its full ID or a unique ID prefix (4+ hex digits).\n" +
			"List images with `ptxmig images`. Format: docs/FORMAT.md.",
		Subcommands: []*cli.Command{
			{
				Name:      "add",
				Usage:     "store a directory (e.g. a CRIU dump made by another tool) as a new image",
				ArgsUsage: "NAME DIR",
				Description: "Symlinks are stored as links and never followed; sparse files stay sparse. NAME may use\n" +
					"letters, digits and . _ + @ - and must not exist yet.\n" +
					"Example: ptxmig image add --kind cpu --label job=42 job42 /tmp/dump",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "parent", Usage: "name or id of the image this one derives from"},
					&cli.StringFlag{Name: "kind", Usage: "what the directory holds: cuda, cpu, or empty for any directory"},
					&cli.StringSliceFlag{Name: "label", Usage: "extra metadata as KEY=VALUE (repeatable)"},
					&cli.StringFlag{Name: "chunk-size", Value: "4MiB", Usage: "chunk size, 4KiB to 64MiB"},
					workers, memory,
				},
				Action: imageAdd,
			},
			{
				Name:        "extract",
				Usage:       "materialize an image into a directory (missing or empty)",
				ArgsUsage:   "NAME|ID DIR",
				Description: "Every chunk is verified; on any error nothing is left in DIR.",
				Flags:       []cli.Flag{workers, memory},
				Action:      imageExtract,
			},
			{
				Name:      "inspect",
				Usage:     "show an image's manifest: provenance, GPUs, files and sizes",
				ArgsUsage: "NAME|ID",
				Action:    imageInspect,
			},
			{
				Name:        "verify",
				Usage:       "re-read images and check every chunk; names each bad file and offset",
				ArgsUsage:   "[NAME|ID...]",
				Description: "Without arguments every image is verified. Exits 1 if any image is damaged.",
				Flags:       []cli.Flag{workers, memory},
				Action:      imageVerify,
			},
			{
				Name:        "rm",
				Usage:       "remove images (their chunks are freed by gc)",
				ArgsUsage:   "NAME|ID...",
				Action:      imageRm,
				Description: "Removes the manifests; run `ptxmig image gc` to free chunks no image uses.",
			},
			{
				Name:  "gc",
				Usage: "delete chunks no image references, leftovers of interrupted writers, and old failure logs",
				Description: "Takes the store lock exclusively: waits for running puts and reads, which wait for it.\n" +
					"Refuses to run while a manifest is unreadable (remove or repair that image first).\n" +
					"Also prunes the logs that failed operations keep in /var/log/ptxmig ($PTXMIG_LOG_DIR) to the\n" +
					"newest 20 and none older than 14 days; --logs removes them all.\n\n" +
					"Examples:\n" +
					"   ptxmig image gc\n" +
					"   ptxmig image gc --logs",
				Flags:  []cli.Flag{&cli.BoolFlag{Name: "logs", Usage: "remove every kept failure log"}},
				Action: imageGC,
			},
			{
				Name:      "export",
				Usage:     "write an image and all its chunks as one stream, to a file or stdout",
				ArgsUsage: "NAME|ID",
				Description: "Move an image between hosts: ptxmig image export job42 | ssh host2 ptxmig image import\n" +
					"With stdout as the stream, --json statistics go to stderr.",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "output", Aliases: []string{"o"}, Usage: "write to FILE (atomically) instead of stdout"},
					workers, memory,
				},
				Action: imageExport,
			},
			{
				Name:        "import",
				Usage:       "read an export stream from FILE or stdin, verifying every chunk",
				ArgsUsage:   "[FILE]",
				Description: "Chunks already in the store are skipped. A truncated or corrupt stream leaves no image.",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "name", Usage: "store under this name instead of the exported one"},
					workers,
				},
				Action: imageImport,
			},
		},
	})
}

// openStore opens the store named by --store.
func openStore(c *cli.Context) (*store.Store, error) {
	s, err := store.Open(env(c).Store)
	if err != nil {
		return nil, err
	}
	return s, nil
}

// storeErr attaches exit statuses to store errors.
func storeErr(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, store.ErrInvalidName):
		return exitcode.Wrap(exitcode.Usage, err)
	case errors.Is(err, store.ErrExists), errors.Is(err, store.ErrNotEmpty):
		return exitcode.Wrap(exitcode.Refused, err)
	}
	return err
}

// parseSize parses a byte count with an optional unit: 4096, 64k, 4MiB, 2G (binary units).
func parseSize(s string) (int64, error) {
	t := strings.TrimSpace(strings.ToLower(s))
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		m      int64
	}{{"tib", 1 << 40}, {"gib", 1 << 30}, {"mib", 1 << 20}, {"kib", 1 << 10}, {"t", 1 << 40}, {"g", 1 << 30}, {"m", 1 << 20}, {"k", 1 << 10}, {"b", 1}} {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSuffix(t, u.suffix), u.m
			break
		}
	}
	n, err := strconv.ParseInt(strings.TrimSpace(t), 10, 64)
	if err != nil || n < 0 || n > (1<<62)/mult {
		return 0, exitcode.Usagef("size %q: want a number with an optional unit (KiB, MiB, GiB)", s)
	}
	return n * mult, nil
}

func getOptions(c *cli.Context, label string) (store.GetOptions, *progress.Bar, error) {
	o := store.GetOptions{Workers: c.Int("workers")}
	if c.IsSet("memory") || c.String("memory") != "" {
		m, err := parseSize(c.String("memory"))
		if err != nil {
			return o, nil, err
		}
		o.MemoryLimit = m
	}
	bar := progress.New(env(c).Err, label)
	o.Progress = bar.Func()
	return o, bar, nil
}

// statsJSON is the --json form of store.Stats with derived figures.
type statsJSON struct {
	*store.Stats
	Seconds          float64 `json:"seconds"`
	MBPerSecond      float64 `json:"mb_per_s"` // logical MB (1e6 bytes) per second
	Ratio            float64 `json:"ratio"`
	CompressionRatio float64 `json:"compression_ratio"`
}

func newStatsJSON(st *store.Stats) statsJSON {
	return statsJSON{Stats: st, Seconds: st.Duration.Seconds(), MBPerSecond: st.Throughput() / 1e6,
		Ratio: st.Ratio(), CompressionRatio: st.CompressionRatio()}
}

func printStats(w io.Writer, st *store.Stats) {
	fmt.Fprintf(w, "  logical %s in %d chunks; zero %s (%d chunks); dedup %s (%d chunks)\n",
		bytesize.Format(st.LogicalBytes), st.Chunks, bytesize.Format(st.ZeroBytes), st.ZeroChunks, bytesize.Format(st.DedupBytes), st.DedupChunks)
	fmt.Fprintf(w, "  written %s; stored %s (ratio %.2f); %.2f s, %.0f MB/s\n",
		bytesize.Format(st.WrittenBytes), bytesize.Format(st.StoredBytes), st.Ratio(), st.Duration.Seconds(), st.Throughput()/1e6)
}

func hostMetadata(kind string, labels []string) (store.Metadata, error) {
	md := store.Metadata{Kind: kind}
	switch kind {
	case "", "cuda", "cpu":
	default:
		return md, exitcode.Usagef("--kind %q: want cuda, cpu or nothing", kind)
	}
	md.Host, _ = os.Hostname()
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		md.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	for _, l := range labels {
		k, v, ok := strings.Cut(l, "=")
		if !ok || k == "" {
			return md, exitcode.Usagef("--label %q: want KEY=VALUE", l)
		}
		if md.Extra == nil {
			md.Extra = map[string]string{}
		}
		md.Extra[k] = v
	}
	return md, nil
}

func imageAdd(c *cli.Context) error {
	if err := argsExactly(c, 2); err != nil {
		return err
	}
	name, dir := c.Args().Get(0), c.Args().Get(1)
	if err := store.ValidateName(name); err != nil {
		return exitcode.Wrap(exitcode.Usage, err)
	}
	cs, err := parseSize(c.String("chunk-size"))
	if err != nil {
		return err
	}
	if cs < store.MinChunkSize || cs > store.MaxChunkSize {
		return exitcode.Usagef("--chunk-size %s: want 4KiB to 64MiB", c.String("chunk-size"))
	}
	md, err := hostMetadata(c.String("kind"), c.StringSlice("label"))
	if err != nil {
		return err
	}
	g, bar, err := getOptions(c, "add")
	if err != nil {
		return err
	}
	s, err := openStore(c)
	if err != nil {
		return err
	}
	m, st, err := s.Put(c.Context, dir, store.PutOptions{Name: name, Parent: c.String("parent"), Meta: md,
		ChunkSize: int(cs), Workers: g.Workers, MemoryLimit: g.MemoryLimit, Progress: g.Progress})
	bar.Done()
	if err != nil {
		return storeErr(err)
	}
	if env(c).JSON {
		return printJSON(c, map[string]any{"name": m.Name, "id": m.ID, "stats": newStatsJSON(st)})
	}
	fmt.Fprintf(env(c).Out, "added %s (id %s)\n", m.Name, m.ID)
	printStats(env(c).Out, st)
	return nil
}

func imageExtract(c *cli.Context) error {
	if err := argsExactly(c, 2); err != nil {
		return err
	}
	g, bar, err := getOptions(c, "extract")
	if err != nil {
		return err
	}
	s, err := openStore(c)
	if err != nil {
		return err
	}
	st, err := s.Materialize(c.Context, c.Args().Get(0), c.Args().Get(1), g)
	bar.Done()
	if err != nil {
		return storeErr(err)
	}
	if env(c).JSON {
		return printJSON(c, map[string]any{"image": c.Args().Get(0), "dir": c.Args().Get(1), "stats": newStatsJSON(st)})
	}
	fmt.Fprintf(env(c).Out, "extracted %s into %s\n", c.Args().Get(0), c.Args().Get(1))
	printStats(env(c).Out, st)
	return nil
}

// inspectJSON is the --json form of `image inspect`.
type inspectJSON struct {
	*store.Manifest
	LogicalBytes int64 `json:"logical_bytes"`
	StoredBytes  int64 `json:"stored_bytes"`
}

func imageInspect(c *cli.Context) error {
	if err := argsExactly(c, 1); err != nil {
		return err
	}
	s, err := openStore(c)
	if err != nil {
		return err
	}
	m, err := s.Get(c.Args().First())
	if err != nil {
		return err
	}
	if env(c).JSON {
		return printJSON(c, inspectJSON{Manifest: m, LogicalBytes: m.LogicalBytes(), StoredBytes: m.StoredBytes()})
	}
	writeInspect(env(c).Out, m)
	return nil
}

func writeInspect(w io.Writer, m *store.Manifest) {
	kv := func(k, v string) {
		if v != "" {
			fmt.Fprintf(w, "%-10s %s\n", k+":", v)
		}
	}
	kv("name", m.Name)
	kv("id", m.ID)
	kv("parent", m.Parent)
	kv("created", m.Created.Format(time.RFC3339))
	kv("format", m.FormatVersion+", "+m.Hash+", chunks of "+bytesize.Format(int64(m.ChunkSize)))
	kv("kind", m.Meta.Kind)
	kv("host", m.Meta.Host)
	kv("kernel", m.Meta.Kernel)
	kv("driver", m.Meta.Driver)
	kv("cuda", m.Meta.CUDA)
	kv("criu", m.Meta.CRIU)
	if m.Meta.PID != 0 {
		kv("pid", strconv.Itoa(m.Meta.PID))
	}
	kv("cmdline", strings.Join(m.Meta.Cmdline, " "))
	for _, g := range m.Meta.GPUs {
		kv("gpu", fmt.Sprintf("%d %s %s (sm %s, %s)", g.Index, g.Name, g.UUID, g.ComputeCap, bytesize.FormatU(g.MemoryBytes)))
	}
	if _, ok := m.Meta.Extra[op.ExtraTree]; ok {
		tree, err := op.ImageTree(m.Meta)
		if err != nil {
			kv("tree", "unreadable: "+err.Error())
		}
		for _, p := range tree {
			cuda := ""
			if p.CUDA {
				cuda = " cuda"
			}
			kv("process", fmt.Sprintf("%d (parent %d) %q%s", p.PID, p.PPID, p.Comm, cuda))
		}
	}
	for _, k := range sortedKeys(m.Meta.Extra) {
		if k != op.ExtraTree {
			kv(k, m.Meta.Extra[k])
		}
	}
	kv("size", fmt.Sprintf("%s logical, %s stored, %d files", bytesize.Format(m.LogicalBytes()), bytesize.Format(m.StoredBytes()), len(m.Files)))
	fmt.Fprintf(w, "\n%-7s %4s %10s %6s %5s  %s\n", "TYPE", "MODE", "SIZE", "CHUNKS", "ZERO", "PATH")
	for _, f := range m.Files {
		zero := 0
		for _, ch := range f.Chunks {
			if ch.Zero {
				zero++
			}
		}
		p := f.Path
		if f.Type == store.TypeSymlink {
			p += " -> " + f.Target
		}
		fmt.Fprintf(w, "%-7s %04o %10s %6d %5d  %s\n", f.Type, f.Mode, bytesize.Format(f.Size), len(f.Chunks), zero, p)
	}
}

func sortedKeys(m map[string]string) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	for i := 1; i < len(ks); i++ {
		for j := i; j > 0 && ks[j] < ks[j-1]; j-- {
			ks[j], ks[j-1] = ks[j-1], ks[j]
		}
	}
	return ks
}

func imageVerify(c *cli.Context) error {
	s, err := openStore(c)
	if err != nil {
		return err
	}
	refs := c.Args().Slice()
	if len(refs) == 0 {
		if refs, err = s.Names(); err != nil {
			return err
		}
	}
	g, _, err := getOptions(c, "")
	if err != nil {
		return err
	}
	var reports []*store.VerifyReport
	bad := 0
	var firstErr error
	for _, ref := range refs {
		bar := progress.New(env(c).Err, "verify "+ref)
		g.Progress = bar.Func()
		r, err := s.VerifyWith(c.Context, ref, g)
		bar.Done()
		if r == nil { // not found, cancelled, I/O error: no report
			return storeErr(err)
		}
		reports = append(reports, r)
		if err != nil {
			bad++
			if firstErr == nil {
				firstErr = err
			}
		}
		if !env(c).JSON {
			if r.OK() {
				fmt.Fprintf(env(c).Out, "ok   %s (%d chunks, %s, %.1f s)\n", r.Name, r.Chunks, bytesize.Format(r.Bytes), r.Duration.Seconds())
			} else {
				fmt.Fprintf(env(c).Out, "BAD  %s: %d problem(s)\n", r.Name, len(r.Problems))
				for _, p := range r.Problems {
					fmt.Fprintf(env(c).Out, "     %s at offset %d: %s\n", p.Path, p.Offset, p.Err)
				}
			}
		}
	}
	if env(c).JSON {
		if err := printJSON(c, map[string]any{"images": reports, "damaged": bad}); err != nil {
			return err
		}
	}
	if bad > 0 {
		return fmt.Errorf("%d of %d image(s) damaged; first: %w", bad, len(reports), firstErr)
	}
	return nil
}

func imageRm(c *cli.Context) error {
	if c.NArg() == 0 {
		return exitcode.Usagef("rm: want at least one NAME|ID")
	}
	s, err := openStore(c)
	if err != nil {
		return err
	}
	var removed []string
	var errs []error
	for _, ref := range c.Args().Slice() {
		if err := s.Remove(ref); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, ref)
		if !env(c).JSON {
			fmt.Fprintf(env(c).Out, "removed %s\n", ref)
		}
	}
	if env(c).JSON {
		if err := printJSON(c, map[string]any{"removed": removed}); err != nil {
			return err
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	if !env(c).JSON {
		fmt.Fprintln(env(c).Out, "run `ptxmig image gc` to free unreferenced chunks")
	}
	return nil
}

func imageGC(c *cli.Context) error {
	if err := argsExactly(c, 0); err != nil {
		return err
	}
	s, err := openStore(c)
	if err != nil {
		return err
	}
	st, err := s.GC(c.Context)
	if err != nil {
		return err
	}
	keep, age := op.LogKeep, op.LogMaxAge
	if c.Bool("logs") {
		keep = 0
	}
	logs, err := op.PruneLogs(op.LogDir(), keep, age, time.Now())
	if err != nil {
		return fmt.Errorf("gc: failure logs in %s: %w", op.LogDir(), err)
	}
	if env(c).JSON {
		return printJSON(c, struct {
			*store.GCStats
			LogsRemoved []string `json:"logs_removed"`
		}{st, logs})
	}
	fmt.Fprintf(env(c).Out, "gc: %d images, %d chunks kept, %d removed (%s), %d temp files removed, %d failure logs removed, %.2f s\n",
		st.Images, st.ChunksKept, st.ChunksRemoved, bytesize.Format(st.BytesRemoved), st.TempRemoved, len(logs), st.Duration.Seconds())
	return nil
}

func imageExport(c *cli.Context) error {
	if err := argsExactly(c, 1); err != nil {
		return err
	}
	out := c.String("output")
	var w io.Writer = env(c).Out
	info := env(c).Out
	if out == "" || out == "-" {
		if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
			return exitcode.Usagef("export: refusing to write a binary stream to a terminal; use -o FILE or a pipe")
		}
		info = env(c).Err
		out = ""
	}
	g, bar, err := getOptions(c, "export")
	if err != nil {
		return err
	}
	s, err := openStore(c)
	if err != nil {
		return err
	}
	var tmp *atomicfile.File
	if out != "" {
		// Write next to the target and rename on success: a failed export leaves no partial file.
		tmp, err = atomicfile.Create(out, 0o600)
		if err != nil {
			return fmt.Errorf("export: %w", err)
		}
		defer tmp.Abort()
		w = tmp
	}
	st, err := s.ExportWith(c.Context, c.Args().First(), w, g)
	bar.Done()
	if err != nil {
		return storeErr(err)
	}
	if tmp != nil {
		if err := tmp.Commit(); err != nil {
			return fmt.Errorf("export: %w", err)
		}
	}
	if env(c).JSON {
		return writeJSON(info, map[string]any{"image": c.Args().First(), "output": out, "stream_bytes": st.WrittenBytes, "stats": newStatsJSON(st)})
	}
	dest := out
	if dest == "" {
		dest = "stdout"
	}
	fmt.Fprintf(info, "exported %s to %s: %s stream for %s logical, %.2f s\n", c.Args().First(), dest,
		bytesize.Format(st.WrittenBytes), bytesize.Format(st.LogicalBytes), st.Duration.Seconds())
	return nil
}

func imageImport(c *cli.Context) error {
	if c.NArg() > 1 {
		return argsExactly(c, 1)
	}
	var r io.Reader = os.Stdin
	if p := c.Args().First(); p != "" && p != "-" {
		f, err := os.Open(p)
		if err != nil {
			return fmt.Errorf("import: %w", err)
		}
		defer f.Close()
		r = f
	} else if term.IsTerminal(int(os.Stdin.Fd())) {
		return exitcode.Usagef("import: stdin is a terminal; give FILE or pipe an export stream in")
	}
	if n := c.String("name"); n != "" {
		if err := store.ValidateName(n); err != nil {
			return exitcode.Wrap(exitcode.Usage, err)
		}
	}
	bar := progress.New(env(c).Err, "import")
	s, err := openStore(c)
	if err != nil {
		return err
	}
	m, st, err := s.ImportWith(c.Context, r, store.ImportOptions{Name: c.String("name"), Workers: c.Int("workers"), Progress: bar.Func()})
	bar.Done()
	if err != nil {
		return storeErr(err)
	}
	if env(c).JSON {
		return printJSON(c, map[string]any{"name": m.Name, "id": m.ID, "stats": newStatsJSON(st)})
	}
	fmt.Fprintf(env(c).Out, "imported %s (id %s): %d chunks, %d already present, %s written\n",
		m.Name, m.ID, st.Chunks, st.DedupChunks, bytesize.Format(st.WrittenBytes))
	return nil
}
