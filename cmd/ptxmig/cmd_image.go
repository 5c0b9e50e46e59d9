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
	"github.com/ptxmig/ptxmig/internal/hostreq"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/progress"
	"github.com/ptxmig/ptxmig/store"
)

func init() {
	workers := &cli.IntFlag{Name: "workers", Usage: "parallel workers (0: one per CPU)"}
	memory := &cli.StringFlag{Name: "memory", Value: "512MiB", Usage: "bound on buffer memory (`SIZE`, e.g. 256MiB or 2GiB)"}
	register(&cli.Command{
		Name:  "image",
		Usage: "manage images in the store: ls, add, extract, inspect, verify, rm, gc, export, import",
		Description: "Images are immutable, named directory trees (a CRIU dump plus ptxmig metadata) kept as\n" +
			"BLAKE3-addressed, zstd-compressed, deduplicated chunks. Every read re-verifies chunk hashes.\n" +
			"An image is named by its NAME, its full ID or a unique ID prefix (4+ hex digits). Commands\n" +
			"that only read (ls, inspect, verify, extract, export) work on a read-only store and never\n" +
			"create one; add and import create the store when its directory is missing (its parent must\n" +
			"exist). Format: docs/FORMAT.md.\n\n" +
			"Examples:\n" +
			"   ptxmig image ls\n" +
			"   ptxmig image inspect trainer-1\n" +
			"   ptxmig image export trainer-1 | ssh host2 ptxmig image import",
		Subcommands: []*cli.Command{
			{
				Name:    "ls",
				Aliases: []string{"list"},
				Usage:   "list the images in the store (same as `ptxmig images`)",
				Description: imagesDescription + "\n\n" +
					"Examples:\n" +
					"   ptxmig image ls\n" +
					"   ptxmig image ls -q                        # ids only, one a line\n" +
					"   ptxmig --store /mnt/shared/ptxmig image list --json",
				Flags:  imagesFlags(),
				Action: imagesList,
			},
			{
				Name:      "add",
				Usage:     "store a directory (e.g. a CRIU dump made by another tool) as a new image",
				ArgsUsage: "NAME DIR",
				Description: "Symlinks are stored as links and never followed; sparse files stay sparse. NAME may use\n" +
					"letters, digits and . _ + @ - (not 4 to 64 hex digits, which read as an image id; else\n" +
					"exit 2) and must not exist yet (exit 3).\n\n" +
					"Examples:\n" +
					"   ptxmig image add --kind cpu --label job=42 job42 /tmp/dump\n" +
					"   ptxmig image add --parent job42 --chunk-size 1MiB job42-b /tmp/dump2",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "parent", Usage: "`NAME|ID` of the image this one derives from"},
					&cli.StringFlag{Name: "kind", Usage: "what the directory holds: `KIND` cuda, cpu, or empty for any directory"},
					&cli.StringSliceFlag{Name: "label", Usage: "extra metadata as `KEY=VALUE` (repeatable)"},
					&cli.StringFlag{Name: "chunk-size", Value: "4MiB", Usage: "chunk `SIZE`, 4KiB to 64MiB"},
					workers, memory,
				},
				Action: imageAdd,
			},
			{
				Name:      "extract",
				Usage:     "materialize an image into a directory (missing or empty)",
				ArgsUsage: "NAME|ID DIR",
				Description: "Every chunk is verified; on any error nothing is left in DIR. An existing DIR must be\n" +
					"empty and belong to the user running ptxmig (another user could move it while root writes).\n\n" +
					"Examples:\n" +
					"   ptxmig image extract trainer-1 /tmp/trainer-1\n" +
					"   ptxmig image extract --workers 4 --memory 1GiB trainer-1 /tmp/restore-me",
				Flags:  []cli.Flag{workers, memory},
				Action: imageExtract,
			},
			{
				Name:      "inspect",
				Usage:     "show an image's manifest: provenance, GPUs, process tree, files and sizes",
				ArgsUsage: "NAME|ID",
				Description: "Names, paths, symlink targets, labels and command lines are printed with control\n" +
					"characters escaped (\\x1b); --json gives the manifest plus logical and stored sizes. The\n" +
					"manifest line says whether the manifest is authenticated: sealed by its id (format 1.1), or\n" +
					"an older format 1.0 image whose id is merely the hash of whatever bytes were read.\n\n" +
					"Examples:\n" +
					"   ptxmig image inspect trainer-1\n" +
					"   ptxmig image inspect --json trainer-1",
				Action: imageInspect,
			},
			{
				Name:      "verify",
				Usage:     "re-read images and check every chunk; names each bad file and offset",
				ArgsUsage: "[NAME|ID...]",
				Description: "Without arguments every image is verified, damaged ones included: a manifest that is\n" +
					"not a regular file (a symlink is never followed) is a problem. Every NAME|ID must exist\n" +
					"before any is read (else exit 6). Each problem names the file and the offset, or the\n" +
					"manifest field that was edited. A format 1.0 image (its manifest predates sealing)\n" +
					"verifies with a warning: its chunks are checked, its manifest cannot be. Exits 1 if any\n" +
					"image is damaged; --json prints one document with every report (and the error).\n\n" +
					"Examples:\n" +
					"   ptxmig image verify\n" +
					"   ptxmig image verify --workers 2 trainer-1 trainer-2",
				Flags:  []cli.Flag{workers, memory},
				Action: imageVerify,
			},
			{
				Name:      "rm",
				Usage:     "remove images (their chunks are freed by gc)",
				ArgsUsage: "NAME|ID...",
				Description: "Removes the manifests; `ptxmig image gc` frees the chunks no image uses. Every NAME|ID is\n" +
					"checked first: when one does not exist (exit 6) or is ambiguous (exit 2), nothing is removed.\n" +
					"A damaged image (by NAME) is removed too, also when its manifest is not a regular file: a\n" +
					"symlink is removed itself, never what it points to.\n\n" +
					"Examples:\n" +
					"   ptxmig image rm trainer-1\n" +
					"   ptxmig image rm trainer-1 trainer-2 && ptxmig image gc",
				Action: imageRm,
			},
			{
				Name:  "gc",
				Usage: "delete chunks no image references, leftovers of interrupted writers, and old failure logs",
				Description: "Takes the store lock exclusively: waits for running puts and reads, which wait for it.\n" +
					"Refuses (exit 3, nothing removed) while an image is damaged, since the chunks it needs cannot\n" +
					"be known: a manifest that cannot be read, or that is not a regular file (a symlink is never\n" +
					"followed); the refusal names each one (remove it with `ptxmig image rm NAME`, or repair it).\n" +
					"Refuses on a read-only store too. Temp files of killed writers are removed: all of tmp/, and\n" +
					"hidden .NAME.tmp-PID-* files in the store directory and images/ whose writer is gone (each\n" +
					"named). Also prunes the logs that failed operations keep in /var/log/ptxmig\n" +
					"($PTXMIG_LOG_DIR) to the newest 20 and none older than 14 days; --logs removes them all.\n\n" +
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
				Description: "Moves an image between hosts. With stdout as the stream (a pipe, never a terminal) the\n" +
					"--json document goes to stderr. -o FILE is written atomically: a failed export leaves no file,\n" +
					"and neither does a killed one: the stream goes into a file without a name in FILE's directory\n" +
					"(O_TMPFILE), linked as FILE when complete. Where the file system cannot make one, a hidden\n" +
					".FILE.tmp-PID-* file is used instead; the next export to FILE removes those that exports\n" +
					"killed meanwhile left (their process gone), and says so.\n\n" +
					"Examples:\n" +
					"   ptxmig image export job42 | ssh host2 ptxmig image import\n" +
					"   ptxmig image export -o /tmp/job42.ptxmig job42",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "output", Aliases: []string{"o"}, Usage: "write to `FILE` (atomically) instead of stdout"},
					workers, memory,
				},
				Action: imageExport,
			},
			{
				Name:      "import",
				Usage:     "read an export stream from FILE or stdin, verifying every chunk",
				ArgsUsage: "[FILE]",
				Description: "Chunks already in the store are skipped. A truncated or corrupt stream leaves no image.\n" +
					"--expect-id pins what the stream must hold: the image's full id, or a prefix of at least 8\n" +
					"hex digits, as `ptxmig images` on the exporting host shows it. A manifest sealed under another\n" +
					"id, or one that predates sealing (format 1.0, whose id proves nothing), fails the import\n" +
					"(exit 1) before any chunk is stored. With --name the id checked is the exported one.\n\n" +
					"Examples:\n" +
					"   ssh host1 ptxmig image export job42 | ptxmig image import\n" +
					"   ptxmig image import --name job42-copy /tmp/job42.ptxmig\n" +
					"   ptxmig image import --expect-id 3f9a1c0e7b2d4a58 --memory 256MiB /tmp/job42.ptxmig",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "name", Usage: "store under `NAME` instead of the exported one"},
					&cli.StringFlag{Name: "expect-id", Usage: "refuse a stream unless its sealed manifest has this `ID` (full, or 8+ hex digits)"},
					workers, memory,
				},
				Action: imageImport,
			},
		},
	})
}

// storeErr attaches exit statuses to store errors.
func storeErr(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, store.ErrInvalidName):
		return exitcode.Wrap(exitcode.Usage, err)
	case errors.Is(err, store.ErrExists), errors.Is(err, store.ErrNotEmpty), errors.Is(err, store.ErrUnsafeTarget):
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
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return exitcode.Usagef("image add: DIR %s is not a directory", esc(dir))
	}
	s, err := openStoreWrite(c)
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
	fmt.Fprintf(env(c).Out, "added %s (id %s)\n", esc(m.Name), m.ID)
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
	s, err := openStoreRead(c)
	if err != nil {
		return err
	}
	ref, dir := c.Args().Get(0), c.Args().Get(1)
	st, err := s.Materialize(c.Context, ref, dir, g)
	bar.Done()
	if err != nil {
		return storeErr(err)
	}
	if env(c).JSON {
		return printJSON(c, map[string]any{"image": ref, "dir": dir, "stats": newStatsJSON(st)})
	}
	fmt.Fprintf(env(c).Out, "extracted %s into %s\n", esc(ref), esc(dir))
	printStats(env(c).Out, st)
	return nil
}

// inspectJSON is the --json form of `image inspect`.
type inspectJSON struct {
	*store.Manifest
	// Authenticated: the manifest is sealed by its id (format 1.1 or later); a format 1.0
	// manifest's id is merely the hash of its bytes.
	Authenticated bool  `json:"authenticated"`
	LogicalBytes  int64 `json:"logical_bytes"`
	StoredBytes   int64 `json:"stored_bytes"`
}

func imageInspect(c *cli.Context) error {
	if err := argsExactly(c, 1); err != nil {
		return err
	}
	s, err := openStoreRead(c)
	if err != nil {
		return err
	}
	m, err := s.Get(c.Args().First())
	if err != nil {
		return err
	}
	if env(c).JSON {
		return printJSON(c, inspectJSON{Manifest: m, Authenticated: m.Authenticated(), LogicalBytes: m.LogicalBytes(), StoredBytes: m.StoredBytes()})
	}
	writeInspect(env(c).Out, m)
	return nil
}

// writeInspect prints a manifest for people. Everything that came from the image (names, paths,
// targets, labels, command lines, host and GPU names) is escaped: an imported image is data
// from elsewhere.
func writeInspect(w io.Writer, m *store.Manifest) {
	kv := func(k, v string) {
		if v != "" {
			fmt.Fprintf(w, "%-10s %s\n", esc(k)+":", esc(v))
		}
	}
	kv("name", m.Name)
	kv("id", m.ID)
	kv("parent", m.Parent)
	kv("created", m.Created.Format(time.RFC3339))
	kv("format", m.FormatVersion+", "+m.Hash+", chunks of "+bytesize.Format(int64(m.ChunkSize)))
	if m.Authenticated() {
		kv("manifest", "authenticated (sealed by its id)")
	} else {
		kv("manifest", "NOT authenticated: format "+m.FormatVersion+" predates sealing, so its id proves nothing; "+
			"export it and import it with --name to seal a copy")
	}
	kv("kind", m.Meta.Kind)
	kv("host", m.Meta.Host)
	kv("kernel", m.Meta.Kernel)
	kv("driver", m.Meta.Driver)
	kv("cuda", m.Meta.CUDA)
	kv("criu", m.Meta.CRIU)
	if m.Meta.PID != 0 {
		kv("pid", strconv.Itoa(m.Meta.PID))
	}
	if len(m.Meta.Cmdline) > 0 {
		fmt.Fprintf(w, "%-10s %s\n", "cmdline:", escList(m.Meta.Cmdline, " "))
	}
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
			kv("process", fmt.Sprintf("%d (parent %d) %s%s", p.PID, p.PPID, p.Comm, cuda))
		}
	}
	if s, ok := m.Meta.Extra[op.ExtraHostFiles]; ok {
		files, err := hostreq.Parse(s)
		if err != nil {
			kv("needs", "unreadable: "+err.Error())
		}
		for _, f := range files {
			size := ""
			if f.Size >= 0 {
				size = fmt.Sprintf(", %d bytes", f.Size)
			}
			written := ""
			if f.Write {
				written = ", written"
			}
			kv("needs", fmt.Sprintf("%s (mode %o%s%s)", f.Path, f.Mode, size, written))
		}
	}
	if s, ok := m.Meta.Extra[op.ExtraCarried]; ok {
		cs, err := hostreq.ParseCarried(s)
		if err != nil {
			kv("carries", "unreadable: "+err.Error())
		}
		for _, c := range cs {
			kv("carries", fmt.Sprintf("%s (%s, as %s)", c.Path, bytesize.Format(c.Size), c.File))
		}
	}
	for _, k := range sortedKeys(m.Meta.Extra) {
		if k != op.ExtraTree && k != op.ExtraHostFiles && k != op.ExtraCarried {
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
		p := esc(f.Path)
		if f.Type == store.TypeSymlink {
			p += " -> " + esc(f.Target)
		}
		fmt.Fprintf(w, "%-7s %04o %10s %6d %5d  %s\n", esc(string(f.Type)), f.Mode, bytesize.Format(f.Size), len(f.Chunks), zero, p)
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

// verifyJSON is the --json form of `image verify`, on success and on failure.
type verifyJSON struct {
	Images  []*store.VerifyReport `json:"images"`
	Damaged int                   `json:"damaged"`
}

func imageVerify(c *cli.Context) error {
	g, _, err := getOptions(c, "")
	if err != nil {
		return err
	}
	s, err := openStoreRead(c)
	if err != nil {
		return err
	}
	refs := c.Args().Slice()
	if len(refs) == 0 {
		if refs, err = s.Names(); err != nil {
			return err
		}
	} else if err := checkRefs(s, refs, true); err != nil {
		return err
	}
	res := verifyJSON{Images: []*store.VerifyReport{}}
	var firstErr error
	w := env(c).Out
	for _, ref := range refs {
		bar := progress.New(env(c).Err, "verify "+esc(ref))
		g.Progress = bar.Func()
		r, err := s.VerifyWith(c.Context, ref, g)
		bar.Done()
		if r == nil { // cancelled, I/O error, removed meanwhile: no report
			return withResult(storeErr(err), res)
		}
		res.Images = append(res.Images, r)
		if err != nil {
			res.Damaged++
			if firstErr == nil {
				firstErr = err
			}
		}
		if env(c).JSON {
			continue
		}
		if r.OK() {
			fmt.Fprintf(w, "ok   %s (%d chunks, %s, %.1f s)\n", esc(r.Name), r.Chunks, bytesize.Format(r.Bytes), r.Duration.Seconds())
		} else {
			fmt.Fprintf(w, "BAD  %s: %d problem(s)\n", esc(r.Name), len(r.Problems))
			for _, p := range r.Problems {
				fmt.Fprintf(w, "     %s\n", problemText(p))
			}
		}
		for _, warn := range r.Warnings {
			fmt.Fprintf(w, "     warning: %s\n", esc(warn))
		}
	}
	if res.Damaged > 0 {
		return withResult(fmt.Errorf("%d of %d image(s) damaged; first: %w", res.Damaged, len(res.Images), firstErr), res)
	}
	if env(c).JSON {
		return printJSON(c, res)
	}
	return nil
}

// problemText is one problem of `image verify` for people: the file and offset of a bad chunk,
// or the manifest's edited field.
func problemText(p store.Problem) string {
	switch {
	case p.Field != "":
		return fmt.Sprintf("%s field %s: %s", esc(p.Path), esc(p.Field), esc(strings.TrimPrefix(p.Err, p.Field+": ")))
	case p.Path == "(manifest)":
		return fmt.Sprintf("%s: %s", esc(p.Path), esc(p.Err))
	}
	return fmt.Sprintf("%s at offset %d: %s", esc(p.Path), p.Offset, esc(p.Err))
}

// checkRefs resolves every image reference before a command acts on any: the first one that does
// not exist or is ambiguous fails the command. With unreadable, a manifest that exists but cannot
// be read (corrupt, unsupported) passes: verify reports it, rm removes it.
func checkRefs(s *store.Store, refs []string, unreadable bool) error {
	for _, ref := range refs {
		_, err := s.Get(ref)
		switch {
		case err == nil:
		case unreadable && (errors.Is(err, store.ErrCorrupt) || errors.Is(err, store.ErrUnsupportedVersion)):
		default:
			return err
		}
	}
	return nil
}

func imageRm(c *cli.Context) error {
	if err := argsAtLeast(c, 1); err != nil {
		return err
	}
	s, err := openStoreModify(c)
	if err != nil {
		return err
	}
	refs := c.Args().Slice()
	if err := checkRefs(s, refs, true); err != nil {
		return fmt.Errorf("%w; nothing was removed", err)
	}
	removed := []string{}
	for _, ref := range refs {
		if err := s.Remove(ref); err != nil {
			return withResult(err, map[string]any{"removed": removed})
		}
		removed = append(removed, ref)
		if !env(c).JSON {
			fmt.Fprintf(env(c).Out, "removed %s\n", esc(ref))
		}
	}
	if env(c).JSON {
		return printJSON(c, map[string]any{"removed": removed})
	}
	fmt.Fprintf(env(c).Out, "free their chunks with: %s\n", hint(c, "image", "gc"))
	return nil
}

func imageGC(c *cli.Context) error {
	if err := argsExactly(c, 0); err != nil {
		return err
	}
	s, err := openStoreModify(c)
	if err != nil {
		return err
	}
	st, err := s.GC(c.Context)
	var dm *store.DamagedImagesError
	if errors.As(err, &dm) {
		return exitcode.Wrap(exitcode.Refused, fmt.Errorf("%w; to remove them: %s", err, hint(c, append([]string{"image", "rm"}, dm.Names()...)...)))
	}
	if err != nil {
		return err
	}
	keep, age := op.LogKeep, op.LogMaxAge
	if c.Bool("logs") {
		keep = 0
	}
	logs, err := op.PruneLogs(op.LogDir(), keep, age, time.Now())
	if err != nil {
		return withResult(fmt.Errorf("gc: failure logs in %s: %w", op.LogDir(), err), st)
	}
	if logs == nil {
		logs = []string{}
	}
	if env(c).JSON {
		return printJSON(c, struct {
			*store.GCStats
			LogsRemoved []string `json:"logs_removed"`
		}{st, logs})
	}
	for _, p := range st.StaleTemp {
		fmt.Fprintf(env(c).Out, "gc: removed %s, left by a writer that was killed\n", esc(p))
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
		// stdout carries the stream: messages and --json documents (the error's too) go to stderr.
		info, env(c).jsonOut = env(c).Err, env(c).Err
		if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
			return exitcode.Usagef("image export: refusing to write a binary stream to a terminal; use -o FILE or a pipe")
		}
		out = ""
	}
	g, bar, err := getOptions(c, "export")
	if err != nil {
		return err
	}
	s, err := openStoreRead(c)
	if err != nil {
		return err
	}
	ref := c.Args().First()
	if _, err := s.Get(ref); err != nil { // before creating the output file
		return err
	}
	var tmp *atomicfile.File
	stale := []string{}
	if out != "" {
		// Write next to the target, in a file without a name, and link it on success: a failed or
		// killed export leaves no partial file. Temp files that killed exports left where that
		// cannot be done are removed first.
		tmp, err = atomicfile.Create(out, 0o600, atomicfile.Unnamed())
		if err != nil {
			return fmt.Errorf("image export: %w", err)
		}
		defer tmp.Abort()
		w = tmp
		stale = tmp.StaleRemoved()
		for _, p := range stale {
			fmt.Fprintf(env(c).Err, "ptxmig: removed %s, left by an export that was killed\n", esc(p))
		}
	}
	st, err := s.ExportWith(c.Context, ref, w, g)
	bar.Done()
	if err != nil {
		return storeErr(err)
	}
	if tmp != nil {
		if err := tmp.Commit(); err != nil {
			return fmt.Errorf("image export: %w", err)
		}
	}
	if env(c).JSON {
		return writeJSON(info, map[string]any{"image": ref, "output": out, "stream_bytes": st.WrittenBytes, "stale_removed": stale,
			"stats": newStatsJSON(st)})
	}
	dest := out
	if dest == "" {
		dest = "stdout"
	}
	fmt.Fprintf(info, "exported %s to %s: %s stream for %s logical, %.2f s\n", esc(ref), esc(dest),
		bytesize.Format(st.WrittenBytes), bytesize.Format(st.LogicalBytes), st.Duration.Seconds())
	return nil
}

func imageImport(c *cli.Context) error {
	if c.NArg() > 1 {
		return argsExactly(c, 1)
	}
	if n := c.String("name"); n != "" {
		if err := store.ValidateName(n); err != nil {
			return exitcode.Wrap(exitcode.Usage, err)
		}
	}
	expect := strings.ToLower(c.String("expect-id"))
	if c.IsSet("expect-id") && (len(expect) < 8 || len(expect) > 64 || strings.Trim(expect, "0123456789abcdef") != "") {
		return exitcode.Usagef("--expect-id %q: want an image id or a prefix of at least 8 of its hex digits", esc(c.String("expect-id")))
	}
	g, bar, err := getOptions(c, "import")
	if err != nil {
		return err
	}
	var r io.Reader = c.App.Reader
	if r == nil {
		r = os.Stdin
	}
	if p := c.Args().First(); p != "" && p != "-" {
		f, err := os.Open(p)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return exitcode.Usagef("image import: %v", err)
			}
			return fmt.Errorf("image import: %w", err)
		}
		defer f.Close()
		r = f
	} else if f, ok := r.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		return exitcode.Usagef("image import: stdin is a terminal; give FILE or pipe an export stream in")
	}
	s, err := openStoreWrite(c)
	if err != nil {
		return err
	}
	m, st, err := s.ImportWith(c.Context, r, store.ImportOptions{Name: c.String("name"), Workers: g.Workers,
		MemoryLimit: g.MemoryLimit, ExpectID: expect, Progress: g.Progress})
	bar.Done()
	if err != nil {
		return storeErr(err)
	}
	if env(c).JSON {
		return printJSON(c, map[string]any{"name": m.Name, "id": m.ID, "stats": newStatsJSON(st)})
	}
	fmt.Fprintf(env(c).Out, "imported %s (id %s): %d chunks, %d already present, %s written\n",
		esc(m.Name), m.ID, st.Chunks, st.DedupChunks, bytesize.Format(st.WrittenBytes))
	return nil
}
