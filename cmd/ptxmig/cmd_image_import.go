package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/store"
)

// imageImportCommand is `ptxmig image import`.
func imageImportCommand(workers, memory cli.Flag) *cli.Command {
	return &cli.Command{
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
	}
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
