package main

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/progress"
	"github.com/ptxmig/ptxmig/store"
)

// The `image` command group: its registration and the helpers its subcommands share. Each
// subcommand is defined in cmd_image_<sub>.go (`image ls` lists with `ptxmig images`' code).
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
			imageLsCommand(),
			imageAddCommand(workers, memory),
			imageExtractCommand(workers, memory),
			imageInspectCommand(),
			imageVerifyCommand(workers, memory),
			imageRmCommand(),
			imageGCCommand(),
			imageExportCommand(workers, memory),
			imageImportCommand(workers, memory),
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
