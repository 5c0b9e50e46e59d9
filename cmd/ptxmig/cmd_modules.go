package main

import (
	"fmt"
	"path/filepath"
	"text/tabwriter"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/exitcode"
)

func init() {
	register(&cli.Command{
		Name:      "modules",
		Usage:     "list the CUDA modules a process under the shim loaded; --dump writes their PTX and cubins",
		ArgsUsage: "PID",
		Description: "Reads the shim's control socket of PID (started with `ptxmig run`). Every module and library\n" +
			"load is captured with a private copy of its image. With --dump DIR the process writes each\n" +
			"loaded image, and every PTX and cubin inside it (decompressed), as DIR/<sha256>.<ext> (0600)\n" +
			"plus DIR/index.json; DIR is created 0700 if missing and written by the process's user. Text\n" +
			"from the process prints with control characters escaped.\n\n" +
			"Examples:\n" +
			"   ptxmig modules 4242\n" +
			"   ptxmig modules --dump /tmp/mods 4242\n" +
			"   ptxmig modules 4242 --json",
		Flags: []cli.Flag{
			socketDirFlag(),
			&cli.StringFlag{Name: "dump", Usage: "write captured images, PTX and cubins into `DIR`"},
		},
		Action: modulesAction,
	})
}

func modulesAction(c *cli.Context) error {
	pid, err := shimPID(c)
	if err != nil {
		return err
	}
	dump := c.String("dump")
	if dump != "" {
		if dump, err = filepath.Abs(dump); err != nil {
			return exitcode.Usagef("modules: --dump %q: %v", c.String("dump"), err)
		}
	}
	cl, ctx, cancel, err := dialShim(c, pid)
	if err != nil {
		return err
	}
	defer cancel()
	defer cl.Close()
	if dump != "" {
		d, err := cl.DumpModules(ctx, dump)
		if err != nil {
			return fmt.Errorf("pid %d: %w", pid, err)
		}
		if !env(c).JSON {
			fmt.Fprintf(env(c).Out, "dumped %d modules (%d ptx, %d cubin, %d new files) into %s; index %s\n",
				d.Modules, d.PTX, d.Cubin, d.FilesWritten, esc(d.Dir), esc(filepath.Join(d.Dir, d.Index)))
		}
		if d.Errors > 0 {
			return withResult(fmt.Errorf("pid %d: dump: %d entries could not be written or decoded (see %s)", pid, d.Errors, esc(filepath.Join(d.Dir, d.Index))), d)
		}
		if env(c).JSON {
			return printJSON(c, d)
		}
		return nil
	}
	s, err := cl.Status(ctx)
	if err != nil {
		return fmt.Errorf("pid %d: %w", pid, err)
	}
	if env(c).JSON {
		return printJSON(c, s.Modules)
	}
	w := tabwriter.NewWriter(env(c).Out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "ID\tSOURCE\tFORMAT\tBYTES\tPTX\tELF\tARCHS\tSHA256\tSTATE")
	for _, m := range s.Modules {
		state := "loaded"
		if !m.Loaded {
			state = "unloaded"
		} else if m.NotCaptured != "" {
			state = "not captured: " + esc(m.NotCaptured)
		} else if m.ParseError != "" {
			state = "parse error: " + esc(m.ParseError)
		}
		sha := m.SHA256
		if len(sha) > 12 {
			sha = sha[:12]
		}
		if sha == "" {
			sha = "-"
		}
		archs := m.Archs
		if archs == "" {
			archs = "-"
		}
		fmt.Fprintf(w, "%d\t%s\t%s\t%d\t%d\t%d\t%s\t%s\t%s\n", m.ID, esc(m.Source), esc(m.Format), m.Bytes, m.PTX, m.ELF, esc(archs), esc(sha), state)
	}
	return w.Flush()
}
