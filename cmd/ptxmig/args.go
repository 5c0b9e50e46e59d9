package main

import (
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/exitcode"
)

// Flags anywhere. urfave/cli v2 parses flags with Go's flag package, which stops at the first
// positional argument, and knows the app's global flags only before the command. People type
// `ptxmig checkpoint 4242 --name x`, `ptxmig image rm c1b --json`, `ptxmig images --json`.
// normalizeArgs reorders a command line, using the command definitions, into the form v2 parses:
//
//	ptxmig GLOBAL-FLAGS... COMMAND [SUBCOMMAND] COMMAND-FLAGS... -- ARGS...
//
// A flag belongs to the deepest command that defines it, else to the app (global); a flag that
// takes a value keeps the word after it. An unknown flag stays with the command, whose parser
// then refuses the whole line before any action runs. `--` ends the flags: every word after it
// is an argument. For `ptxmig run` (a command line of its own) flags end at the first argument,
// as with env(1) and timeout(1). `help` (`ptxmig help image export`, `ptxmig image help export`)
// becomes `--help` of the named command. An unknown command is a usage error here.
type parsedArgs struct {
	args []string     // for (*cli.App).Run
	path []string     // the command's path, e.g. ["image", "rm"]
	cmd  *cli.Command // the command named by path (nil: the app itself)
	json bool         // --json was given
	help bool         // help was asked for
}

// passThrough commands take a command line as their arguments: flags end at its first word.
var passThrough = map[string]bool{"run": true}

func normalizeArgs(app *cli.App, argv []string) (p parsedArgs, err error) {
	if len(argv) == 0 {
		return p, nil
	}
	defer func() {
		if err != nil { // an unknown command: still answer --json with a JSON document
			for _, a := range argv[1:] {
				if a == "--" {
					break
				}
				if a == "--json" || a == "-json" || a == "--json=true" {
					p.json = true
				}
			}
		}
	}()
	var globals, flags, positional []string
	cmds := app.Commands
	var cur *cli.Command
	rest := argv[1:]
	for i := 0; i < len(rest); i++ {
		a := rest[i]
		if a == "--" {
			positional = append(positional, rest[i+1:]...)
			break
		}
		if cur != nil && passThrough[cur.Name] && len(positional) > 0 {
			positional = append(positional, rest[i:]...)
			break
		}
		if len(a) > 1 && a[0] == '-' {
			name, hasValue := flagName(a)
			if (name == "help" || name == "h") && !hasValue {
				p.help = true // added once, after the command's path
				continue
			}
			f, global := findFlag(app, cur, name)
			takesValue := !hasValue && f != nil && flagTakesValue(f)
			dst := &flags
			if global || (cur == nil && f == nil) {
				dst = &globals
			}
			*dst = append(*dst, a)
			if takesValue && i+1 < len(rest) {
				i++
				*dst = append(*dst, rest[i])
			}
			if global && name == "json" {
				p.json = !strings.HasSuffix(a, "=false") && !strings.HasSuffix(a, "=0")
			}
			continue
		}
		// A word: a command, a subcommand, `help`, or an argument of the command.
		if cur == nil || (len(cur.Subcommands) > 0 && len(positional) == 0) {
			if a == "help" || a == "h" {
				if p.help && len(p.path) > 0 {
					return p, unknownCommand(p.path, a, cmds)
				}
				p.help = true
				continue
			}
			c := findCommand(cmds, a)
			if c == nil {
				return p, unknownCommand(p.path, a, cmds)
			}
			p.path = append(p.path, c.Name)
			cur, cmds = c, c.Subcommands
			continue
		}
		positional = append(positional, a)
	}
	p.cmd = cur
	out := append([]string{argv[0]}, globals...)
	out = append(out, p.path...)
	if p.help {
		flags = append(flags, "--help")
	}
	out = append(out, flags...)
	if len(positional) > 0 {
		out = append(out, "--")
		out = append(out, positional...)
	}
	p.args = out
	return p, nil
}

// flagName returns a flag word's name ("--gpu=1" → "gpu") and whether it carries its value.
func flagName(a string) (string, bool) {
	name := strings.TrimLeft(a, "-")
	if k, _, ok := strings.Cut(name, "="); ok {
		return k, true
	}
	return name, false
}

// findFlag looks name up in cur, then in the commands below cur (a flag given before its
// subcommand's name), then among the app's flags; global says it is the app's.
func findFlag(app *cli.App, cur *cli.Command, name string) (f cli.Flag, global bool) {
	if cur != nil {
		if f := flagIn(cur.Flags, name); f != nil {
			return f, false
		}
		if f := flagBelow(cur.Subcommands, name); f != nil {
			return f, false
		}
	}
	if f := flagIn(app.Flags, name); f != nil {
		return f, true
	}
	return nil, false
}

func flagIn(fs []cli.Flag, name string) cli.Flag {
	for _, f := range fs {
		for _, n := range f.Names() {
			if n == name {
				return f
			}
		}
	}
	return nil
}

func flagBelow(cmds []*cli.Command, name string) cli.Flag {
	for _, c := range cmds {
		if f := flagIn(c.Flags, name); f != nil {
			return f
		}
		if f := flagBelow(c.Subcommands, name); f != nil {
			return f
		}
	}
	return nil
}

func flagTakesValue(f cli.Flag) bool {
	if d, ok := f.(cli.DocGenerationFlag); ok {
		return d.TakesValue()
	}
	return false
}

func findCommand(cmds []*cli.Command, name string) *cli.Command {
	for _, c := range cmds {
		if c.HasName(name) {
			return c
		}
	}
	return nil
}

// unknownCommand is the usage error for a word that names no command, with the closest names.
func unknownCommand(path []string, word string, cmds []*cli.Command) error {
	where := "ptxmig"
	if len(path) > 0 {
		where = "ptxmig " + strings.Join(path, " ")
	}
	var names, close []string
	for _, c := range cmds {
		if c.Hidden {
			continue
		}
		names = append(names, c.Name)
		for _, n := range c.Names() {
			if strings.HasPrefix(n, word) || strings.HasPrefix(word, n) || editDistance(n, word) <= 2 {
				close = append(close, c.Name)
				break
			}
		}
	}
	msg := "%s: unknown command %q; commands: %s (see `%s --help`)"
	if len(close) > 0 {
		return exitcode.Usagef(msg+"; did you mean %s?", where, esc(word), strings.Join(names, ", "), where, strings.Join(close, " or "))
	}
	return exitcode.Usagef(msg, where, esc(word), strings.Join(names, ", "), where)
}

// editDistance is the Levenshtein distance of two short words.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}
