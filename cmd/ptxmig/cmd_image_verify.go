package main

import (
	"fmt"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/progress"
	"github.com/ptxmig/ptxmig/store"
)

// imageVerifyCommand is `ptxmig image verify`.
func imageVerifyCommand(workers, memory cli.Flag) *cli.Command {
	return &cli.Command{
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
	}
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
