package main

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/store"
)

const imagesDescription = "Columns: name, short id, creation time, source host and GPUs, logical size, stored size\n" +
	"(compressed, distinct chunks of the image; chunks shared with other images count in each).\n" +
	"-q prints only the full ids, one a line, for scripts; --json gives every field. A missing\n" +
	"store is an error (exit 6), never created; a read-only store is listed as any other.\n" +
	"A damaged image (its manifest is not a regular file, e.g. a symlink, which is never followed,\n" +
	"or cannot be read or authenticated) is listed as DAMAGED with the reason (--json: name, an\n" +
	"empty id and \"damaged\"; -q: the reason on stderr). `image verify` fails on it, gc removes\n" +
	"nothing while it exists, and `image rm NAME` removes it."

func imagesFlags() []cli.Flag {
	return []cli.Flag{&cli.BoolFlag{Name: "quiet", Aliases: []string{"q"}, Usage: "print only image ids, one a line"}}
}

func init() {
	register(&cli.Command{
		Name:  "images",
		Usage: "list the images in the store",
		Description: imagesDescription + "\n\n" +
			"Examples:\n" +
			"   ptxmig images\n" +
			"   ptxmig images -q                          # ids only\n" +
			"   ptxmig --store /mnt/shared/ptxmig images --json",
		Flags:  imagesFlags(),
		Action: imagesList,
	})
}

// imageRow is the --json form of one `ptxmig images` line.
type imageRow struct {
	Name         string          `json:"name"`
	ID           string          `json:"id"`
	Parent       string          `json:"parent,omitempty"`
	Created      time.Time       `json:"created"`
	Kind         string          `json:"kind,omitempty"`
	Host         string          `json:"host,omitempty"`
	GPUs         []imagedesc.GPU `json:"gpus,omitempty"`
	Files        int             `json:"files"`
	LogicalBytes int64           `json:"logical_bytes"`
	StoredBytes  int64           `json:"stored_bytes"`
}

// damagedRow is the --json form of a damaged image in `ptxmig images`: its manifest cannot be
// used, so only its name is known.
type damagedRow struct {
	Name    string `json:"name"`
	ID      string `json:"id"` // always ""
	Damaged string `json:"damaged"`
}

func imagesList(c *cli.Context) error {
	if err := argsExactly(c, 0); err != nil {
		return err
	}
	s, err := openStoreRead(c)
	if err != nil {
		return err
	}
	ms, damaged, err := s.ListDamaged()
	if err != nil {
		return err
	}
	rows := make([]imageRow, 0, len(ms))
	for _, m := range ms {
		d, _ := imagedesc.Read(m) // what could be read: image inspect names the rest
		rows = append(rows, imageRow{Name: m.Name, ID: m.ID, Parent: m.Parent, Created: m.Created, Kind: d.Kind,
			Host: d.Host, GPUs: d.GPUs, Files: len(m.Files), LogicalBytes: m.LogicalBytes(), StoredBytes: m.StoredBytes()})
	}
	switch {
	case env(c).JSON:
		all := make([]any, 0, len(rows)+len(damaged))
		for _, r := range rows {
			all = append(all, r)
		}
		for _, d := range damaged {
			all = append(all, damagedRow{Name: d.Name, Damaged: d.Err.Error()})
		}
		return printJSON(c, all)
	case c.Bool("quiet"):
		for _, r := range rows {
			fmt.Fprintln(env(c).Out, r.ID)
		}
		for _, d := range damaged { // no id to print: said on stderr, so scripts' stdout stays ids
			fmt.Fprintf(env(c).Err, "ptxmig: image %s is DAMAGED: %s\n", esc(d.Name), esc(d.Err.Error()))
		}
		return nil
	}
	writeImages(env(c).Out, rows, damaged)
	for _, d := range damaged {
		fmt.Fprintf(env(c).Out, "%s is DAMAGED: %s\n  remove it with: %s\n", esc(d.Name), esc(d.Err.Error()), hint(c, "image", "rm", d.Name))
	}
	return nil
}

func writeImages(w io.Writer, rows []imageRow, damaged []store.Damaged) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tID\tCREATED\tHOST\tGPU\tLOGICAL\tSTORED")
	for _, r := range rows {
		gpu := "-"
		if n := len(r.GPUs); n == 1 {
			gpu = fmt.Sprintf("%d:%s", r.GPUs[0].Index, esc(r.GPUs[0].Name))
		} else if n > 1 {
			gpu = fmt.Sprintf("%dx %s", n, esc(r.GPUs[0].Name))
		}
		host := esc(r.Host)
		if host == "" {
			host = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", esc(r.Name), shortID(r.ID), r.Created.Local().Format("2006-01-02 15:04:05"),
			host, gpu, bytesize.Format(r.LogicalBytes), bytesize.Format(r.StoredBytes))
	}
	for _, d := range damaged {
		fmt.Fprintf(tw, "%s\tDAMAGED\t-\t-\t-\t-\t-\n", esc(d.Name))
	}
	tw.Flush()
}
