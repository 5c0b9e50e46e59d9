package main

import (
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/exitcode"
)

func init() {
	register(&cli.Command{
		Name:      "completion",
		Usage:     "print a bash or zsh completion script (commands, flags, image names, pids, files)",
		ArgsUsage: "SHELL",
		Description: "Generated from ptxmig's own command definitions, so it always matches this binary. It\n" +
			"completes commands and subcommands, flags (global ones anywhere), flag values (log levels,\n" +
			"--preempt modes, files, directories), image names (read with `ptxmig images`, honouring a\n" +
			"--store on the line), pids and files. `make install` installs both scripts.\n\n" +
			"Examples:\n" +
			"   ptxmig completion bash > /etc/bash_completion.d/ptxmig\n" +
			"   source <(ptxmig completion bash)\n" +
			"   ptxmig completion zsh > \"${fpath[1]}/_ptxmig\"",
		Action: completionAction,
	})
}

func completionAction(c *cli.Context) error {
	if err := argsExactly(c, 1); err != nil {
		return err
	}
	switch sh := c.Args().First(); sh {
	case "bash":
		return writeCompletion(env(c).Out, c.App, false)
	case "zsh":
		return writeCompletion(env(c).Out, c.App, true)
	default:
		return exitcode.Usagef("completion: shell %q: want bash or zsh", esc(sh))
	}
}

// complNode is one command path as the completion scripts see it.
type complNode struct {
	patterns []string // "image ls", "image list": every spelling of the path
	subs     []*cli.Command
	flags    []string // every flag spelling, global ones included
	valued   []string // the flags that take a value
	args     []string // the kind of each argument; the last one repeats when it ends in "..."
}

// argKinds reads an ArgsUsage such as "NAME|ID DIR" or "[NAME|ID...]" into completion kinds.
func argKinds(usage string) []string {
	var kinds []string
	for _, tok := range strings.Fields(usage) {
		t := strings.Trim(tok, "[]")
		rep := strings.HasSuffix(t, "...")
		t = strings.TrimSuffix(t, "...")
		k := "none"
		switch t {
		case "PID":
			k = "pid"
		case "NAME|ID", "IMAGE":
			k = "image"
		case "DIR":
			k = "dir"
		case "FILE":
			k = "file"
		case "CMD":
			k = "command"
		case "SHELL":
			k = "shell"
		case "COMMAND":
			k = "topcommand"
		case "--", "ARGS":
			continue
		}
		if rep {
			k += "..."
		}
		kinds = append(kinds, k)
	}
	if len(kinds) > 0 && kinds[len(kinds)-1] == "command" {
		kinds[len(kinds)-1] = "command..." // ptxmig run -- CMD ARGS...: a command line
	}
	return kinds
}

// complValues: flag values to offer, by flag name; flags with a FILE, DIR or PATH placeholder
// complete paths.
var complValues = map[string]string{
	"log-level": "debug info warn error",
	"preempt":   "auto always off",
	"kind":      "cuda cpu",
}

func complNodes(app *cli.App) []complNode {
	var global, globalValued []string
	for _, f := range app.Flags {
		for _, n := range f.Names() {
			global = append(global, dashed(n))
			if flagTakesValue(f) {
				globalValued = append(globalValued, dashed(n))
			}
		}
	}
	global = append(global, "--help")
	var out []complNode
	var walk func(prefixes []string, cmds []*cli.Command, parentFlags []cli.Flag)
	add := func(patterns []string, subs []*cli.Command, fs []cli.Flag, argsUsage string) {
		n := complNode{patterns: patterns, subs: subs, args: argKinds(argsUsage)}
		for _, f := range fs {
			for _, name := range f.Names() {
				if name == "help" || name == "h" {
					continue
				}
				n.flags = append(n.flags, dashed(name))
				if flagTakesValue(f) {
					n.valued = append(n.valued, dashed(name))
				}
			}
		}
		n.flags = append(n.flags, global...)
		n.valued = append(n.valued, globalValued...)
		out = append(out, n)
	}
	walk = func(prefixes []string, cmds []*cli.Command, _ []cli.Flag) {
		for _, c := range cmds {
			if c.Hidden {
				continue
			}
			var pats []string
			for _, p := range prefixes {
				for _, n := range c.Names() {
					pats = append(pats, strings.TrimSpace(p+" "+n))
				}
			}
			add(pats, c.Subcommands, c.Flags, c.ArgsUsage)
			walk(pats, c.Subcommands, c.Flags)
		}
	}
	add([]string{""}, app.Commands, nil, "")
	walk([]string{""}, app.Commands, nil)
	return out
}

func dashed(n string) string {
	if len(n) == 1 {
		return "-" + n
	}
	return "--" + n
}

func visibleNames(cmds []*cli.Command) []string {
	var n []string
	for _, c := range cmds {
		if !c.Hidden {
			n = append(n, c.Names()...)
		}
	}
	sort.Strings(n)
	return n
}

// casePattern is a shell case pattern matching any spelling of a path.
func casePattern(patterns []string) string {
	q := make([]string, len(patterns))
	for i, p := range patterns {
		q[i] = `"` + p + `"`
	}
	return strings.Join(q, "|")
}

// writeCompletion prints the bash (zsh false) or zsh script. Both share the data functions
// (plain case statements), and differ in how they offer candidates.
func writeCompletion(w io.Writer, app *cli.App, zsh bool) error {
	nodes := complNodes(app)
	var b strings.Builder
	if zsh {
		b.WriteString("#compdef ptxmig\n# zsh completion for ptxmig, generated by `ptxmig completion zsh` from its command definitions.\n")
		b.WriteString("# Install: ptxmig completion zsh > \"${fpath[1]}/_ptxmig\" (make install puts it in share/zsh/site-functions).\n\n")
	} else {
		b.WriteString("# bash completion for ptxmig, generated by `ptxmig completion bash` from its command definitions.\n")
		b.WriteString("# Install: ptxmig completion bash > /etc/bash_completion.d/ptxmig (make install puts it in\n")
		b.WriteString("# share/bash-completion/completions), or: source <(ptxmig completion bash)\n\n")
	}
	fn := func(name, doc string, value func(n complNode) string) {
		fmt.Fprintf(&b, "# %s\n%s() {\n\tcase \"$1\" in\n", doc, name)
		for _, n := range nodes {
			if v := value(n); v != "" {
				fmt.Fprintf(&b, "\t%s) echo %q ;;\n", casePattern(n.patterns), v)
			}
		}
		b.WriteString("\tesac\n}\n\n")
	}
	fn("_ptxmig_subcommands", "the subcommands of a command path (\"\" is the top level)", func(n complNode) string {
		return strings.Join(visibleNames(n.subs), " ")
	})
	fn("_ptxmig_flags", "every flag of a command path, the global ones included", func(n complNode) string { return strings.Join(n.flags, " ") })
	fn("_ptxmig_valued", "the flags of a command path that take a value", func(n complNode) string { return strings.Join(n.valued, " ") })
	fn("_ptxmig_args", "the kind of each argument of a command path (a kind ending in ... repeats)", func(n complNode) string { return strings.Join(n.args, " ") })
	if zsh {
		b.WriteString("# \"name:description\" lines of a command path's subcommands\n_ptxmig_described() {\n\tcase \"$1\" in\n")
		for _, n := range nodes {
			var lines []string
			for _, c := range n.subs {
				if c.Hidden {
					continue
				}
				for _, name := range c.Names() {
					lines = append(lines, name+":"+strings.ReplaceAll(c.Usage, "'", "'\\''"))
				}
			}
			if len(lines) > 0 {
				fmt.Fprintf(&b, "\t%s) print -r -- '%s' ;;\n", casePattern(n.patterns), strings.Join(lines, "\n"))
			}
		}
		b.WriteString("\tesac\n}\n\n")
	}
	b.WriteString("# the values a flag takes: a word list, \"file\" or \"dir\"\n_ptxmig_flag_values() {\n\tcase \"$1\" in\n")
	var names []string
	for n := range complValues {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(&b, "\t--%s) echo %q ;;\n", n, complValues[n])
	}
	var files, dirs []string
	seen := map[string]bool{}
	collect := func(fs []cli.Flag) {
		for _, f := range fs {
			d := docFlag(f)
			for _, n := range d.Names {
				if seen[n] {
					continue
				}
				seen[n] = true
				switch d.Placeholder {
				case "DIR":
					dirs = append(dirs, dashed(n))
				case "FILE", "PATH":
					files = append(files, dashed(n))
				}
			}
		}
	}
	collect(app.Flags)
	var walk func(cmds []*cli.Command)
	walk = func(cmds []*cli.Command) {
		for _, c := range cmds {
			collect(c.Flags)
			walk(c.Subcommands)
		}
	}
	walk(app.Commands)
	if len(dirs) > 0 {
		fmt.Fprintf(&b, "\t%s) echo dir ;;\n", strings.Join(dirs, "|"))
	}
	if len(files) > 0 {
		fmt.Fprintf(&b, "\t%s) echo file ;;\n", strings.Join(files, "|"))
	}
	b.WriteString("\tesac\n}\n\n")
	b.WriteString(complCommon)
	if zsh {
		b.WriteString(complZsh)
	} else {
		b.WriteString(complBash)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// complCommon walks the words before the cursor, in either shell: the command path, the number
// of arguments so far, whether `--` was seen, and a --store to pass to `ptxmig images`.
const complCommon = `_ptxmig_has() { [[ " $1 " == *" $2 "* ]]; }

# _ptxmig_parse WORD...: sets _p_path, _p_nargs, _p_dashdash, _p_store from the words before the
# cursor (without the command name).
_ptxmig_parse() {
	_p_path="" _p_nargs=0 _p_dashdash=0 _p_store=()
	local w
	while [[ $# -gt 0 ]]; do
		w=$1
		shift
		if [[ $_p_dashdash == 1 || ( $_p_path == run && $_p_nargs -gt 0 ) ]]; then
			_p_nargs=$((_p_nargs + 1))
			continue
		fi
		case $w in
		--) _p_dashdash=1; continue ;;
		--store=*) _p_store=("$w"); continue ;;
		-*)
			if [[ $w != *=* ]] && _ptxmig_has "$(_ptxmig_valued "$_p_path")" "$w"; then
				[[ $w == --store ]] && _p_store=(--store "$1")
				[[ $# -gt 0 ]] && shift
			fi
			continue ;;
		esac
		if [[ $_p_nargs == 0 && ( $w == help || $w == h ) ]] && [[ -n "$(_ptxmig_subcommands "$_p_path")" ]]; then
			continue
		fi
		if [[ $_p_nargs == 0 ]] && _ptxmig_has "$(_ptxmig_subcommands "$_p_path")" "$w"; then
			_p_path=${_p_path:+$_p_path }$w
		else
			_p_nargs=$((_p_nargs + 1))
		fi
	done
}

# _ptxmig_kind PATH N: the kind of argument N (0-based) of PATH.
_ptxmig_kind() {
	local last i=0 k
	for k in $(_ptxmig_args "$1"); do # unquoted $(...) splits in bash and zsh alike
		last=$k
		if [[ $i == "$2" ]]; then echo "${k%...}"; return; fi
		i=$((i + 1))
	done
	if [[ $last == *... ]]; then echo "${last%...}"; else echo none; fi
}

_ptxmig_images() {
	"${_p_cmd:-ptxmig}" "${_p_store[@]}" images 2>/dev/null | awk 'NR > 1 { print $1 }'
}

`

const complBash = `_ptxmig() {
	local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
	local _p_path _p_nargs _p_dashdash _p_store _p_cmd=${COMP_WORDS[0]}
	_ptxmig_parse "${COMP_WORDS[@]:1:COMP_CWORD-1}"
	COMPREPLY=()
	local values
	if [[ $_p_dashdash == 0 && $prev == -* ]] && _ptxmig_has "$(_ptxmig_valued "$_p_path")" "$prev"; then
		values=$(_ptxmig_flag_values "$prev")
		case $values in
		"") ;;
		dir) compopt -o filenames 2>/dev/null; mapfile -t COMPREPLY < <(compgen -d -- "$cur") ;;
		file) compopt -o filenames 2>/dev/null; mapfile -t COMPREPLY < <(compgen -f -- "$cur") ;;
		*) mapfile -t COMPREPLY < <(compgen -W "$values" -- "$cur") ;;
		esac
		return 0
	fi
	if [[ $_p_dashdash == 0 && $cur == -* ]] && ! [[ $_p_path == run && $_p_nargs -gt 0 ]]; then
		mapfile -t COMPREPLY < <(compgen -W "$(_ptxmig_flags "$_p_path")" -- "$cur")
		return 0
	fi
	local subs
	subs=$(_ptxmig_subcommands "$_p_path")
	if [[ -n $subs && $_p_nargs == 0 ]]; then
		mapfile -t COMPREPLY < <(compgen -W "$subs" -- "$cur")
		return 0
	fi
	case $(_ptxmig_kind "$_p_path" "$_p_nargs") in
	image) mapfile -t COMPREPLY < <(compgen -W "$(_ptxmig_images)" -- "$cur") ;;
	pid) mapfile -t COMPREPLY < <(compgen -W "$(ps -e -o pid= 2>/dev/null)" -- "$cur") ;;
	dir) compopt -o filenames 2>/dev/null; mapfile -t COMPREPLY < <(compgen -d -- "$cur") ;;
	file) compopt -o filenames 2>/dev/null; mapfile -t COMPREPLY < <(compgen -f -- "$cur") ;;
	shell) mapfile -t COMPREPLY < <(compgen -W "bash zsh" -- "$cur") ;;
	topcommand) mapfile -t COMPREPLY < <(compgen -W "$(_ptxmig_subcommands "")" -- "$cur") ;;
	command)
		if [[ $_p_path == run && $_p_nargs -gt 0 ]]; then
			compopt -o filenames 2>/dev/null; mapfile -t COMPREPLY < <(compgen -f -- "$cur")
		else
			mapfile -t COMPREPLY < <(compgen -c -- "$cur")
		fi ;;
	esac
	return 0
}
complete -F _ptxmig ptxmig
`

const complZsh = `_ptxmig() {
	local cur=${words[CURRENT]} prev=${words[CURRENT-1]}
	local _p_path _p_nargs _p_dashdash _p_cmd=${words[1]}
	local -a _p_store
	_ptxmig_parse "${(@)words[2,CURRENT-1]}"
	local values
	if [[ $_p_dashdash == 0 && $prev == -* ]] && _ptxmig_has "$(_ptxmig_valued "$_p_path")" "$prev"; then
		values=$(_ptxmig_flag_values "$prev")
		case $values in
		"") _message 'value' ;;
		dir) _files -/ ;;
		file) _files ;;
		*) compadd -- ${=values} ;;
		esac
		return
	fi
	if [[ $_p_dashdash == 0 && $cur == -* ]] && ! [[ $_p_path == run && $_p_nargs -gt 0 ]]; then
		compadd -- ${=$(_ptxmig_flags "$_p_path")}
		return
	fi
	if [[ -n $(_ptxmig_subcommands "$_p_path") && $_p_nargs == 0 ]]; then
		local -a described
		described=("${(@f)$(_ptxmig_described "$_p_path")}")
		_describe -t commands 'ptxmig command' described
		return
	fi
	case $(_ptxmig_kind "$_p_path" "$_p_nargs") in
	image) compadd -- ${(f)"$(_ptxmig_images)"} ;;
	pid) _pids ;;
	dir) _files -/ ;;
	file) _files ;;
	shell) compadd bash zsh ;;
	topcommand) compadd -- ${=$(_ptxmig_subcommands "")} ;;
	command)
		if [[ $_p_path == run && $_p_nargs -gt 0 ]]; then _files; else _command_names -e; fi ;;
	esac
}

_ptxmig "$@"
`
