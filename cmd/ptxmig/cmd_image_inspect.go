package main

import (
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/hostreq"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/store"
)

// imageInspectCommand is `ptxmig image inspect`.
func imageInspectCommand() *cli.Command {
	return &cli.Command{
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
