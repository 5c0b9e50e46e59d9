package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/testreq"
)

// exampleLines returns the example command lines of a description: the lines indented by three
// spaces after "Examples:".
func exampleLines(desc string) []string {
	_, ex, ok := strings.Cut(desc, "Examples:\n")
	if !ok {
		return nil
	}
	var out []string
	for _, l := range strings.Split(ex, "\n") {
		if strings.HasPrefix(l, "   ") {
			out = append(out, strings.TrimSpace(l))
		}
	}
	return out
}

// TestHelpTeaches: every command has a usage, a description and at least one example that uses
// the command itself; the help of every command lists the global options.
func TestHelpTeaches(t *testing.T) {
	forEachCommand(func(path []string, c *cli.Command) {
		name := strings.Join(path, " ")
		if c.Usage == "" || c.Description == "" {
			t.Errorf("%s: no usage or description", name)
		}
		found := false
		for _, ex := range exampleLines(c.Description) {
			if strings.Contains(ex, "ptxmig "+name) || (len(path) > 1 && strings.Contains(ex, "ptxmig "+path[0]+" "+c.Name)) {
				found = true
			}
			for _, alias := range c.Aliases {
				if strings.Contains(ex, "ptxmig "+strings.Join(append(path[:len(path)-1:len(path)-1], alias), " ")) {
					found = true
				}
			}
		}
		if !found {
			t.Errorf("%s: no example of `ptxmig %s` under Examples:", name, name)
		}
		if name == "help" {
			return // `ptxmig help --help` is the app's help
		}
		out, _, _ := runCLI(t, append(path, "--help")...)
		if !strings.Contains(out, "GLOBAL OPTIONS") || !strings.Contains(out, "--store DIR") || !strings.Contains(out, "USAGE:\n   ptxmig "+name) {
			t.Errorf("%s --help lacks its usage line or the global options:\n%s", name, out)
		}
	})
}

// shellWords splits a line into the words of its ptxmig command lines: comments, redirections
// (with their targets) and the other commands of a pipeline or list are dropped, quotes removed,
// and each command keeps its words from "ptxmig" on (after sudo, ssh host...).
func shellWords(line string) [][]string {
	line = strings.NewReplacer("<(", " ", ")", " ").Replace(line)
	type token struct {
		s  string
		op bool // an operator: | & ; > < (possibly with a file descriptor)
	}
	var toks []token
	var word strings.Builder
	inWord, quote := false, rune(0)
	flush := func() {
		if inWord {
			toks = append(toks, token{s: word.String()})
			word.Reset()
			inWord = false
		}
	}
	rs := []rune(line)
	for i := 0; i < len(rs); i++ {
		r := rs[i]
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			} else {
				word.WriteRune(r)
			}
		case r == '\'' || r == '"':
			quote, inWord = r, true
		case r == '#' && !inWord:
			i = len(rs)
		case r == '|' || r == '&' || r == ';':
			flush()
			toks = append(toks, token{s: string(r), op: true})
		case r == '>' || r == '<':
			// "2>" and "2>&1": a descriptor before, a descriptor after
			if inWord && (word.String() == "1" || word.String() == "2") {
				word.Reset()
				inWord = false
			}
			flush()
			for i+1 < len(rs) && (rs[i+1] == '>' || rs[i+1] == '&' || (rs[i+1] >= '0' && rs[i+1] <= '9')) {
				i++
			}
			if rs[i] >= '0' && rs[i] <= '9' { // >&1: no target word follows
				continue
			}
			toks = append(toks, token{s: ">", op: true})
		case r == ' ' || r == '\t':
			flush()
		default:
			word.WriteRune(r)
			inWord = true
		}
	}
	flush()
	var cmds [][]string
	var cur []string
	skip := false
	for _, t := range toks {
		switch {
		case t.op && t.s == ">":
			skip = true
		case t.op:
			cmds, cur = append(cmds, cur), nil
		case skip:
			skip = false
		default:
			cur = append(cur, t.s)
		}
	}
	cmds = append(cmds, cur)
	var out [][]string
	for _, c := range cmds {
		for i, w := range c {
			if w == "ptxmig" {
				out = append(out, c[i+1:])
				break
			}
		}
	}
	return out
}

// argBounds reads an ArgsUsage into the least and most arguments it allows (-1: no limit).
func argBounds(usage string) (lo, hi int) {
	for _, tok := range strings.Fields(usage) {
		switch {
		case tok == "--":
		case strings.HasPrefix(tok, "["):
			if hi >= 0 {
				hi++
			}
			if strings.Contains(tok, "...") {
				hi = -1
			}
		default:
			lo++
			if hi >= 0 {
				hi++
			}
			if strings.Contains(tok, "...") {
				hi = -1
			}
		}
	}
	return lo, hi
}

// checkCommandLine runs words through the real flag parsing with every action replaced by an
// argument count check: it fails on an unknown command or flag, a missing flag value, a wrong
// number of arguments, or a placeholder (NAME, PID...) left in place of a value.
func checkCommandLine(words []string) error {
	for _, w := range words {
		if regexp.MustCompile(`^[A-Z][A-Z_|.]*[A-Z]$`).MatchString(w) && w != "PTXMIG" {
			return fmt.Errorf("placeholder %q: an example must run as written", w)
		}
	}
	app := newApp(io.Discard, io.Discard)
	var stub func(cmds []*cli.Command)
	stub = func(cmds []*cli.Command) {
		for _, c := range cmds {
			if len(c.Subcommands) > 0 {
				stub(c.Subcommands)
				continue
			}
			c := c
			c.Action = func(ctx *cli.Context) error {
				lo, hi := argBounds(c.ArgsUsage)
				if n := ctx.NArg(); n < lo || (hi >= 0 && n > hi) {
					return fmt.Errorf("%s: %d argument(s), usage %q", c.Name, n, c.ArgsUsage)
				}
				return nil
			}
		}
	}
	stub(app.Commands)
	p, err := normalizeArgs(app, append([]string{"ptxmig"}, words...))
	if err != nil {
		return err
	}
	if p.cmd == nil && !p.help && len(words) > 0 && !strings.HasPrefix(words[0], "-") {
		return fmt.Errorf("no command")
	}
	return app.RunContext(context.Background(), p.args)
}

// TestExamplesRun: every example in every command's help parses with the command definitions
// (commands, flags, values, argument counts) and holds no placeholder.
func TestExamplesRun(t *testing.T) {
	examples := exampleLines(newApp(io.Discard, io.Discard).Description)
	forEachCommand(func(path []string, c *cli.Command) { examples = append(examples, exampleLines(c.Description)...) })
	n := 0
	for _, ex := range examples {
		for _, words := range shellWords(ex) {
			n++
			if err := checkCommandLine(words); err != nil {
				t.Errorf("example %q: %v", ex, err)
			}
		}
	}
	if n < 40 {
		t.Errorf("only %d example command lines found", n)
	}
}

// TestREADMEExamples: the README's command lines (in code blocks) run as written.
func TestREADMEExamples(t *testing.T) {
	f, err := os.Open("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	inCode, n := false, 0
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "```") {
			inCode = !inCode
			continue
		}
		if !inCode {
			continue
		}
		for _, words := range shellWords(line) {
			n++
			if err := checkCommandLine(words); err != nil {
				t.Errorf("README: %q: %v", line, err)
			}
		}
	}
	if n < 20 {
		t.Errorf("only %d ptxmig command lines in the README's code blocks", n)
	}
}

func TestShellWords(t *testing.T) {
	got := fmt.Sprint(shellWords(`ptxmig image export job42 | ssh host2 ptxmig image import   # move`))
	if got != "[[image export job42] [image import]]" {
		t.Errorf("pipeline: %s", got)
	}
	got = fmt.Sprint(shellWords(`ptxmig run --socket-dir /tmp/ptxmig -- ./app > app.log 2>&1 &   # $! is`))
	if got != "[[run --socket-dir /tmp/ptxmig -- ./app]]" {
		t.Errorf("redirections: %s", got)
	}
	got = fmt.Sprint(shellWords(`source <(ptxmig completion bash)`))
	if got != "[[completion bash]]" {
		t.Errorf("process substitution: %s", got)
	}
	got = fmt.Sprint(shellWords(`ptxmig completion zsh > "${fpath[1]}/_ptxmig"`))
	if got != "[[completion zsh]]" {
		t.Errorf("quoted redirection target: %s", got)
	}
}

// TestCompletionBash sources the generated script in bash and completes a few lines.
func TestCompletionBash(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		testreq.Skip(t, "bash", "no bash: %v", err)
	}
	st, _ := newTestStore(t, "trainer-1", "trainer-2")
	script, _, code := runCLI(t, "completion", "bash")
	if code != 0 {
		t.Fatalf("completion bash: exit %d", code)
	}
	dir := t.TempDir()
	sp := filepath.Join(dir, "ptxmig.bash")
	os.WriteFile(sp, []byte(script), 0o644)
	// A ptxmig on PATH for the image names: this test binary cannot be it, so build one.
	bin := filepath.Join(dir, "ptxmig")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	tests := []struct {
		line string // the words; the last one is completed
		want string // COMPREPLY, sorted, space-separated
	}{
		{"ptxmig im", "image images"},
		{"ptxmig image ex", "export extract"},
		{"ptxmig image l", "list ls"},
		{"ptxmig checkpoint --lea", "--leave-running"},
		{"ptxmig checkpoint 4242 --dr", "--dry-run"},
		{"ptxmig --log-level w", "warn"},
		{"ptxmig run --preempt a", "always auto"},
		{"ptxmig completion z", "zsh"},
		{"ptxmig images --js", "--json"},
		{"ptxmig --store " + st + " restore trainer-", "trainer-1 trainer-2"},
		{"ptxmig image rm --store " + st + " trainer-1 trainer-", "trainer-1 trainer-2"},
		{"ptxmig help image ex", "export extract"},
	}
	for _, tt := range tests {
		words := strings.Fields(tt.line)
		if strings.HasSuffix(tt.line, " ") {
			words = append(words, "")
		}
		var arr strings.Builder
		for _, w := range words {
			fmt.Fprintf(&arr, "%q ", w)
		}
		cmd := exec.Command(bash, "--norc", "--noprofile", "-c", fmt.Sprintf(
			`source %q; COMP_WORDS=(%s); COMP_CWORD=%d; _ptxmig; printf '%%s\n' "${COMPREPLY[@]}" | sort | tr '\n' ' '`,
			sp, arr.String(), len(words)-1))
		cmd.Env = append(os.Environ(), "PATH="+dir+":"+os.Getenv("PATH"))
		out, err := cmd.CombinedOutput()
		if got := strings.TrimSpace(string(out)); err != nil || got != tt.want {
			t.Errorf("complete %q: %q (%v), want %q", tt.line, got, err, tt.want)
		}
	}
}

// TestCompletionZsh: the zsh script parses, and its data functions agree with bash's.
func TestCompletionZsh(t *testing.T) {
	zsh, err := exec.LookPath("zsh")
	if err != nil {
		testreq.Skip(t, "zsh", "no zsh to check the zsh completion script: %v", err)
	}
	script, _, code := runCLI(t, "completion", "zsh")
	if code != 0 || !strings.HasPrefix(script, "#compdef ptxmig\n") {
		t.Fatalf("completion zsh: exit %d", code)
	}
	sp := filepath.Join(t.TempDir(), "_ptxmig")
	// Without the last line (`_ptxmig "$@"`, which needs the completion system).
	os.WriteFile(sp, []byte(strings.TrimSuffix(script, "_ptxmig \"$@\"\n")), 0o644)
	if out, err := exec.Command(zsh, "-n", sp).CombinedOutput(); err != nil {
		t.Fatalf("zsh -n: %v\n%s", err, out)
	}
	out, err := exec.Command(zsh, "-f", "-c", fmt.Sprintf(
		`source %q; _ptxmig_parse --store /s image rm --json x; print -r -- "$_p_path|$_p_nargs|${_p_store[*]}"; _ptxmig_described image | head -n 1; _ptxmig_kind "image extract" 1`, sp)).CombinedOutput()
	want := "image rm|1|--store /s\nls:list the images in the store (same as `ptxmig images`)\ndir\n"
	if err != nil || string(out) != want {
		t.Errorf("zsh data functions: %v\n%q\nwant %q", err, out, want)
	}
}

// TestManPage: the page is valid roff (groff warns of nothing) and documents every command, the
// exit codes and the environment.
func TestManPage(t *testing.T) {
	page, _, code := runCLI(t, "man")
	if code != 0 {
		t.Fatalf("man: exit %d", code)
	}
	forEachCommand(func(path []string, c *cli.Command) {
		if !c.Hidden && !strings.Contains(page, `.SS "`+roff(usageLine("ptxmig "+strings.Join(path, " "), c))+`"`) {
			t.Errorf("the man page lacks %v", path)
		}
	})
	for _, want := range []string{".SH EXIT STATUS", ".B 125", ".B PTXMIG_STORE", "/etc/ptxmig/rebalance.json"} {
		if !strings.Contains(page, want) {
			t.Errorf("the man page lacks %q", want)
		}
	}
	groff, err := exec.LookPath("groff")
	if err != nil {
		testreq.Skip(t, "groff", "no groff to check the page: %v", err)
	}
	cmd := exec.Command(groff, "-man", "-Tutf8", "-ww", "-z")
	cmd.Stdin = strings.NewReader(page)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil || stderr.Len() > 0 {
		t.Errorf("groff: %v\n%s", err, stderr.String())
	}
}
