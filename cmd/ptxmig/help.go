package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/urfave/cli/v2"
)

// Help is rendered here rather than by urfave/cli's templates: every command's help shows its
// full usage line (subcommands included), its description with examples, its options and the
// global options (which work anywhere on the line); the app's help ends with the exit codes. The
// man page and the shell completions read the same definitions (docs.go).
func init() {
	cli.HelpPrinter = func(w io.Writer, _ string, data any) {
		switch d := data.(type) {
		case *cli.App:
			writeAppHelp(w, d)
		case *cli.Command:
			writeCommandHelp(w, d)
		}
	}
}

// flagDoc is a flag as help, the man page and completions present it.
type flagDoc struct {
	Names       []string // long name first: "output", "o"
	Placeholder string   // "FILE"; empty for a boolean flag
	Usage       string
	Default     string // empty when the zero value
	Env         []string
}

func docFlag(f cli.Flag) flagDoc {
	d := flagDoc{Names: f.Names()}
	df, ok := f.(cli.DocGenerationFlag)
	if !ok {
		return d
	}
	d.Usage = df.GetUsage()
	if i := strings.IndexByte(d.Usage, '`'); i >= 0 {
		if j := strings.IndexByte(d.Usage[i+1:], '`'); j >= 0 {
			if df.TakesValue() {
				d.Placeholder = d.Usage[i+1 : i+1+j]
			}
			d.Usage = d.Usage[:i] + d.Usage[i+1:i+1+j] + d.Usage[i+2+j:]
		}
	}
	if df.TakesValue() {
		if d.Placeholder == "" {
			d.Placeholder = placeholderFor(f)
		}
		switch def := strings.Trim(df.GetDefaultText(), `"`); def {
		case "", "0", "0s", "[]", "false":
		default:
			d.Default = def
		}
	}
	d.Env = df.GetEnvVars()
	return d
}

func placeholderFor(f cli.Flag) string {
	switch f.(type) {
	case *cli.DurationFlag:
		return "DURATION"
	case *cli.IntFlag, *cli.Uint64Flag, *cli.IntSliceFlag:
		return "N"
	case *cli.Float64Flag:
		return "NUMBER"
	}
	return "VALUE"
}

// Left is the flag's names with placeholders: "--output FILE, -o FILE".
func (d flagDoc) Left() string {
	parts := make([]string, len(d.Names))
	for i, n := range d.Names {
		dash := "--"
		if len(n) == 1 {
			dash = "-"
		}
		parts[i] = dash + n
		if d.Placeholder != "" {
			parts[i] += " " + d.Placeholder
		}
	}
	return strings.Join(parts, ", ")
}

// Right is the flag's usage with its default and environment variables.
func (d flagDoc) Right() string {
	s := d.Usage
	if d.Default != "" {
		s += " (default: " + d.Default + ")"
	}
	if len(d.Env) > 0 {
		s += " [$" + strings.Join(d.Env, ", $") + "]"
	}
	return s
}

// visibleFlags are the flags help lists; withHelp adds --help last.
func visibleFlags(fs []cli.Flag, withHelp bool) []flagDoc {
	var out []flagDoc
	for _, f := range fs {
		if v, ok := f.(cli.VisibleFlag); ok && !v.IsVisible() {
			continue
		}
		if f == cli.HelpFlag || flagIn([]cli.Flag{f}, "help") != nil {
			continue
		}
		out = append(out, docFlag(f))
	}
	if withHelp {
		out = append(out, flagDoc{Names: []string{"help", "h"}, Usage: "show help"})
	}
	return out
}

func writeFlags(w io.Writer, docs []flagDoc) {
	tw := tabwriter.NewWriter(w, 1, 8, 2, ' ', 0)
	for _, d := range docs {
		fmt.Fprintf(tw, "   %s\t%s\n", d.Left(), d.Right())
	}
	tw.Flush()
}

func writeCommands(w io.Writer, cmds []*cli.Command) {
	tw := tabwriter.NewWriter(w, 1, 8, 2, ' ', 0)
	for _, c := range cmds {
		if c.Hidden {
			continue
		}
		fmt.Fprintf(tw, "   %s\t%s\n", strings.Join(c.Names(), ", "), c.Usage)
	}
	tw.Flush()
}

// indentText indents every non-empty line of s.
func indentText(s, indent string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i, l := range lines {
		if l != "" {
			lines[i] = indent + l
		}
	}
	return strings.Join(lines, "\n") + "\n"
}

func writeAppHelp(w io.Writer, a *cli.App) {
	fmt.Fprintf(w, "NAME:\n   %s - %s\n\n", a.Name, a.Usage)
	fmt.Fprintf(w, "USAGE:\n   %s [global options] COMMAND [options] [arguments...]\n\n", a.Name)
	fmt.Fprintf(w, "DESCRIPTION:\n%s\n", indentText(a.Description, "   "))
	fmt.Fprintf(w, "COMMANDS:\n")
	writeCommands(w, a.Commands)
	fmt.Fprintf(w, "\nGLOBAL OPTIONS (before or after the command):\n")
	writeFlags(w, visibleFlags(a.Flags, true))
	fmt.Fprintf(w, "\nEXIT CODES:\n%s", exitCodesText("   "))
}

// usageLine is a command's synopsis: "ptxmig image export [options] NAME|ID".
func usageLine(path string, c *cli.Command) string {
	if len(c.Subcommands) > 0 {
		return path + " COMMAND [options] [arguments...]"
	}
	s := path + " [options]"
	if c.ArgsUsage != "" {
		s += " " + c.ArgsUsage
	}
	return s
}

func writeCommandHelp(w io.Writer, c *cli.Command) {
	path := c.HelpName
	if path == "" {
		path = "ptxmig " + c.Name
	}
	fmt.Fprintf(w, "NAME:\n   %s - %s\n\n", path, c.Usage)
	fmt.Fprintf(w, "USAGE:\n   %s\n", usageLine(path, c))
	if len(c.Aliases) > 0 {
		fmt.Fprintf(w, "   (also: %s)\n", strings.Join(c.Aliases, ", "))
	}
	if c.Description != "" {
		fmt.Fprintf(w, "\nDESCRIPTION:\n%s", indentText(c.Description, "   "))
	}
	if len(c.Subcommands) > 0 {
		fmt.Fprintf(w, "\nCOMMANDS:\n")
		writeCommands(w, c.Subcommands)
	}
	fmt.Fprintf(w, "\nOPTIONS:\n")
	writeFlags(w, visibleFlags(c.Flags, true))
	fmt.Fprintf(w, "\nGLOBAL OPTIONS (before or after the command):\n")
	writeFlags(w, visibleFlags(globalFlags(), false))
	fmt.Fprintf(w, "\nExit codes: ptxmig --help.\n")
}
