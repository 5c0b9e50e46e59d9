package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/store"
)

// imageInspectCommand is `ptxmig image inspect`.
func imageInspectCommand() *cli.Command {
	return &cli.Command{
		Name:      "inspect",
		Usage:     "show an image's manifest: provenance, GPUs, process tree, files and sizes",
		ArgsUsage: "NAME|ID",
		Description: "Names, paths, symlink targets, labels and command lines are printed with control\n" +
			"characters escaped (\\x1b); --json gives the manifest plus logical and stored sizes, and the\n" +
			"image's description as this ptxmig reads it (\"description\", in the current layout whatever\n" +
			"layout the image holds; \"description_problems\": the fields it cannot read). The manifest\n" +
			"line says whether the manifest is authenticated: sealed by its id (format 1.1 or later), or an\n" +
			"older format 1.0 image whose id is merely the hash of whatever bytes were read.\n\n" +
			"Examples:\n" +
			"   ptxmig image inspect trainer-1\n" +
			"   ptxmig image inspect --json trainer-1",
		Action: imageInspect,
	}
}

// inspectJSON is the --json form of `image inspect`.
type inspectJSON struct {
	*store.Manifest
	// Authenticated: the manifest is sealed by its id (format 1.1 or later); a format 1.0
	// manifest's id is merely the hash of its bytes.
	Authenticated bool  `json:"authenticated"`
	LogicalBytes  int64 `json:"logical_bytes"`
	StoredBytes   int64 `json:"stored_bytes"`
	// Description is meta as this ptxmig reads it, in the current layout (internal/imagedesc),
	// whichever layout the image holds; Problems are the fields it could not read.
	Description json.RawMessage      `json:"description,omitempty"`
	Problems    []inspectProblemJSON `json:"description_problems,omitempty"`
}

type inspectProblemJSON struct {
	Field string `json:"field"`
	Error string `json:"error"`
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
		doc := inspectJSON{Manifest: m, Authenticated: m.Authenticated(), LogicalBytes: m.LogicalBytes(), StoredBytes: m.StoredBytes()}
		d, derr := imagedesc.Read(m)
		var inv *imagedesc.InvalidError
		if errors.As(derr, &inv) {
			for _, p := range inv.Problems {
				doc.Problems = append(doc.Problems, inspectProblemJSON{Field: p.Field, Error: p.Err.Error()})
			}
		}
		if doc.Description, err = d.Encode(); err != nil {
			return err
		}
		return printJSON(c, doc)
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
	d, _ := imagedesc.Read(m) // what could be read; each field that could not says so below
	unreadable := func(k string, err error) {
		if err != nil {
			kv(k, "unreadable: "+err.Error())
		}
	}
	unreadable("metadata", d.Problem(imagedesc.FieldMeta))
	unreadable("metadata", d.Problem(imagedesc.FieldImage))
	unreadable("metadata", d.Problem(imagedesc.FieldBase))
	kv("kind", d.Kind)
	kv("host", d.Host)
	kv("kernel", d.Kernel)
	kv("driver", d.Driver)
	kv("cuda", d.CUDA)
	kv("criu", d.CRIU)
	if d.PID != 0 {
		kv("pid", strconv.Itoa(d.PID))
	}
	if len(d.Cmdline) > 0 {
		fmt.Fprintf(w, "%-10s %s\n", "cmdline:", escList(d.Cmdline, " "))
	}
	for _, g := range d.GPUs {
		kv("gpu", fmt.Sprintf("%d %s %s (sm %s, %s)", g.Index, g.Name, g.UUID, g.ComputeCap, bytesize.FormatU(g.MemoryBytes)))
	}
	unreadable("tree", d.Problem(imagedesc.FieldTree))
	for _, p := range d.Tree {
		cuda := ""
		if p.CUDA {
			cuda = " cuda"
		}
		kv("process", fmt.Sprintf("%d (parent %d) %s%s", p.PID, p.PPID, p.Comm, cuda))
	}
	unreadable("needs", d.Problem(imagedesc.FieldHostFiles))
	for _, f := range d.HostFiles {
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
	unreadable("carries", d.Problem(imagedesc.FieldCarried))
	for _, c := range d.Carried {
		kv("carries", fmt.Sprintf("%s (%s, as %s)", c.Path, bytesize.Format(c.Size), c.File))
	}
	// The other fields as key/value lines (the keys images made before typed descriptions
	// recorded), labels among them, sorted; a field that could not be read under its key.
	fields := d.Fields()
	for _, pr := range []struct{ key, field string }{
		{imagedesc.ExtraCgroup, imagedesc.FieldCgroups}, {"criu.options", imagedesc.FieldCRIU},
		{imagedesc.ExtraDevmem, imagedesc.FieldDevmem}, {"labels", imagedesc.FieldLabels},
	} {
		if err := d.Problem(pr.field); err != nil {
			fields = append(fields, [2]string{pr.key, "unreadable: " + err.Error()})
		}
	}
	sort.SliceStable(fields, func(i, j int) bool { return fields[i][0] < fields[j][0] })
	for _, f := range fields {
		kv(f[0], f[1])
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
