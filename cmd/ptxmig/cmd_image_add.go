package main

import (
	"fmt"
	"os"
	"strings"

	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/store"
)

// imageAddCommand is `ptxmig image add`.
func imageAddCommand(workers, memory cli.Flag) *cli.Command {
	return &cli.Command{
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
	}
}

func hostMetadata(kind string, labels []string) (store.Metadata, error) {
	d, err := hostDescription(kind, labels)
	if err != nil {
		return nil, err
	}
	return d.Encode()
}

func hostDescription(kind string, labels []string) (*imagedesc.Description, error) {
	md := &imagedesc.Description{Kind: kind}
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
		if md.Labels == nil {
			md.Labels = map[string]string{}
		}
		md.Labels[k] = v
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
