package main

import (
	"fmt"

	"github.com/urfave/cli/v2"
)

// imageExtractCommand is `ptxmig image extract`.
func imageExtractCommand(workers, memory cli.Flag) *cli.Command {
	return &cli.Command{
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
	}
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
