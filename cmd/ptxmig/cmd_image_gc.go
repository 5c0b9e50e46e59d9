package main

import (
	"errors"
	"fmt"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/store"
)

// imageGCCommand is `ptxmig image gc`.
func imageGCCommand() *cli.Command {
	return &cli.Command{
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
	}
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
