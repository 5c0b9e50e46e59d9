package main

import (
	"fmt"
	"io"
	"os"

	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"github.com/ptxmig/ptxmig/internal/atomicfile"
	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/exitcode"
)

// imageExportCommand is `ptxmig image export`.
func imageExportCommand(workers, memory cli.Flag) *cli.Command {
	return &cli.Command{
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
	}
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
