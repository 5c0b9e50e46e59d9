package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/op"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

// defaultStore is --store's default.
const defaultStore = op.DefaultStoreDir

// commands holds every subcommand; each cmd_<verb>.go registers its own in init.
var commands []*cli.Command

func register(c *cli.Command) { commands = append(commands, c) }

// globals are the app-wide settings every command reads through env(c).
type globals struct {
	Store string
	JSON  bool
	Out   io.Writer
	Err   io.Writer
	Log   *slog.Logger
	// jsonOut receives --json documents, the error document included: stdout, or stderr when a
	// command's stdout carries data (image export to a pipe).
	jsonOut io.Writer
}

func env(c *cli.Context) *globals { return c.App.Metadata["globals"].(*globals) }

// globalFlags are the app's flags; they work before or after the command.
func globalFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "store", Value: defaultStore, EnvVars: []string{"PTXMIG_STORE"},
			Usage: "`DIR` of the image store (commands that only read never create it)"},
		&cli.StringFlag{Name: "log-level", Value: "warn", EnvVars: []string{"PTXMIG_LOG_LEVEL"},
			Usage: "diagnostics on stderr at `LEVEL` and above: debug, info, warn or error"},
		&cli.BoolFlag{Name: "json", Usage: "machine-readable output: one JSON document on stdout, also on failure"},
		&cli.BoolFlag{Name: "version", Usage: "print ptxmig's version and exit (the version command says more)"},
	}
}

// errVersionShown ends a run after --version printed the version.
var errVersionShown = errors.New("version shown")

func newApp(stdout, stderr io.Writer) *cli.App {
	g := &globals{Out: stdout, Err: stderr, jsonOut: stdout, Store: defaultStore, Log: slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	// Fresh copies: urfave/cli mutates commands (HelpName, flags) on every run, and tests run the
	// app many times in one process.
	cmds := make([]*cli.Command, len(commands))
	for i, c := range commands {
		cmds[i] = copyCommand(c)
	}
	sort.Slice(cmds, func(i, j int) bool { return cmds[i].Name < cmds[j].Name })
	for _, c := range cmds {
		setupCommand(c)
	}
	app := &cli.App{
		Name:  "ptxmig",
		Usage: "checkpoint, restore and migrate running CUDA processes",
		Description: "ptxmig saves a running CUDA process tree into a verified, deduplicated image store, restores\n" +
			"it onto any GPU of the same chip family (even another model: H100 <-> H200), and moves live\n" +
			"processes between GPUs. Flags go anywhere on the line; `--` ends them. Start with\n" +
			"`ptxmig doctor`, then:\n\n" +
			"   ptxmig ps                              # CUDA processes on this host\n" +
			"   ptxmig checkpoint --name job-1 4242    # save pid 4242's process tree (it ends)\n" +
			"   ptxmig restore job-1                   # bring it back\n" +
			"   ptxmig help checkpoint                 # any command's help, with examples",
		Version:         version,
		HideVersion:     true,
		HideHelpCommand: true,
		Writer:          stdout,
		ErrWriter:       stderr,
		Commands:        cmds,
		Metadata:        map[string]any{"globals": g},
		ExitErrHandler:  func(*cli.Context, error) {}, // exit codes are mapped in run, after cleanup
		// --help by hand: urfave adds it only when no command is called "help", and ours is.
		Flags: append(globalFlags(), cli.HelpFlag),
		Before: func(c *cli.Context) error {
			var lvl slog.Level
			if err := lvl.UnmarshalText([]byte(c.String("log-level"))); err != nil {
				return exitcode.Usagef("--log-level %q: want debug, info, warn or error", c.String("log-level"))
			}
			g.Store = c.String("store")
			g.JSON = c.Bool("json")
			g.Log = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: lvl}))
			slog.SetDefault(g.Log)
			if c.Bool("version") {
				if g.JSON {
					_ = writeJSON(stdout, map[string]string{"ptxmig": version})
				} else {
					fmt.Fprintf(stdout, "ptxmig %s\n", version)
				}
				return errVersionShown
			}
			return nil
		},
		Action: func(c *cli.Context) error {
			if g.JSON { // help is no JSON document
				return exitcode.Usagef("no command given (see `ptxmig --help`)")
			}
			return cli.ShowAppHelp(c)
		},
		OnUsageError: usageError,
	}
	return app
}

// copyCommand copies c and, recursively, its subcommands.
func copyCommand(c *cli.Command) *cli.Command {
	cc := *c
	if len(c.Subcommands) > 0 {
		cc.Subcommands = make([]*cli.Command, len(c.Subcommands))
		for i, s := range c.Subcommands {
			cc.Subcommands[i] = copyCommand(s)
		}
	}
	return &cc
}

// setupCommand gives every command the usage-error mapping and a group (a command with
// subcommands) its help as its action; normalizeArgs already refused unknown subcommands.
func setupCommand(c *cli.Command) {
	if c.OnUsageError == nil {
		c.OnUsageError = usageError
	}
	c.HideHelpCommand = true // `help` is normalizeArgs' business (urfave would add it to every command)
	if len(c.Subcommands) > 0 && c.Action == nil {
		c.Action = func(ctx *cli.Context) error {
			if env(ctx).JSON { // help is no JSON document
				return exitcode.Usagef("%s: which command? %s (see `ptxmig %s --help`)", commandPath(ctx), strings.Join(visibleNames(ctx.Command.Subcommands), ", "), commandPath(ctx))
			}
			return cli.ShowSubcommandHelp(ctx)
		}
	}
	for _, s := range c.Subcommands {
		setupCommand(s)
	}
}

func usageError(_ *cli.Context, err error, _ bool) error { return exitcode.Wrap(exitcode.Usage, err) }

// resultError carries a command's --json result along with its failure: run prints one document
// holding the result's members and the error's.
type resultError struct {
	err    error
	result any
}

func (e *resultError) Error() string { return e.err.Error() }
func (e *resultError) Unwrap() error { return e.err }

// withResult attaches v, the command's --json result, to err (nil stays nil).
func withResult(err error, v any) error {
	if err == nil {
		return nil
	}
	return &resultError{err: err, result: v}
}

// run executes the CLI and returns the exit status; errors are reported here, once: with --json
// as one document on stdout (the command's partial result merged in), else on stderr.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	app := newApp(stdout, stderr)
	g := app.Metadata["globals"].(*globals)
	p, err := normalizeArgs(app, args)
	if err == nil {
		t := time.Now()
		err = app.RunContext(ctx, p.args)
		g.Log.Debug("command finished", "took", time.Since(t))
	}
	if errors.Is(err, errVersionShown) || err == nil {
		return exitcode.OK
	}
	code := exitStatus(err)
	if len(p.path) > 0 && p.path[0] == "run" && code != exitcode.RunNoExec && code != exitcode.RunNotFound {
		code = exitcode.RunFailed // env(1)/timeout(1) style: ptxmig run's own failures never look like the command's
	}
	msg := err.Error()
	if code == exitcode.Usage && strings.Contains(msg, "flag provided but not defined") {
		msg += fmt.Sprintf(" (see `ptxmig %s --help`)", strings.TrimSpace(strings.Join(p.path, " ")))
		msg = strings.Replace(msg, "`ptxmig  --help`", "`ptxmig --help`", 1)
	}
	if p.json || g.JSON {
		var result any
		var re *resultError
		if errors.As(err, &re) {
			result = re.result
		}
		_ = writeErrorJSON(g.jsonOut, result, errorDoc(err, msg, code))
	} else {
		fmt.Fprintf(stderr, "ptxmig: error: %s\n", escLines(msg))
	}
	return code
}

// errorDoc is the error's part of a failed command's --json document: the message, the exit
// status and its kind; for an operation that failed after preflight (checkpoint, restore,
// migrate, a rebalance move) also the failed step, whether it rolled back or had committed
// (its result was final: nothing was rolled back), the steps undone, and from its Failure the
// processes' state and the kept logs.
func errorDoc(err error, msg string, code int) map[string]any {
	doc := map[string]any{"error": msg, "exit_code": code, "kind": exitcode.Name(code)}
	var se *op.StepError
	if errors.As(err, &se) {
		doc["failed_step"], doc["rolled_back"], doc["committed"], doc["undone"] = se.Step, se.RolledBack(), se.Committed, se.Undone
	}
	var f *op.Failure
	if errors.As(err, &f) {
		if f.State != "" {
			doc["process_state"] = f.State
		}
		if f.LogDir != "" {
			doc["log_dir"] = f.LogDir
		}
	}
	return doc
}

// writeErrorJSON writes the one document of a failed command: the members of its partial result
// (an object keeps its members in order; anything else becomes "result"), then the error's.
func writeErrorJSON(w io.Writer, result any, errDoc map[string]any) error {
	eb, err := marshalJSON(errDoc)
	if err != nil {
		return err
	}
	if result == nil {
		return writeJSON(w, json.RawMessage(eb))
	}
	rb, err := marshalJSON(result)
	if err != nil || len(rb) < 2 || rb[0] != '{' {
		errDoc["result"] = result
		return writeJSON(w, errDoc)
	}
	inner := bytes.TrimSpace(rb[1 : len(rb)-1])
	merged := append([]byte("{"), inner...)
	if len(inner) > 0 {
		merged = append(merged, ',')
	}
	merged = append(merged, eb[1:]...)
	return writeJSON(w, json.RawMessage(merged))
}

func marshalJSON(v any) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, fmt.Errorf("encode JSON: %w", err)
	}
	return bytes.TrimSpace(b.Bytes()), nil
}

// printJSON writes v as the command's one JSON document.
func printJSON(c *cli.Context, v any) error { return writeJSON(env(c).jsonOut, v) }

// writeJSON writes v to w as one JSON document, indented by two spaces and ended by a newline,
// in a single Write (nothing is written when v fails to encode). All user-facing JSON, on
// stdout or elsewhere, goes through it.
func writeJSON(w io.Writer, v any) error {
	b, err := marshalJSON(v)
	if err != nil {
		return err
	}
	var out bytes.Buffer
	if err := json.Indent(&out, b, "", "  "); err != nil {
		return fmt.Errorf("encode JSON: %w", err)
	}
	out.WriteByte('\n')
	_, err = w.Write(out.Bytes())
	return err
}

// commandPath is "image rm" for `ptxmig image rm`.
func commandPath(c *cli.Context) string {
	return strings.TrimPrefix(c.Command.HelpName, "ptxmig ")
}

// argsExactly enforces the number of positional arguments (flags are already parsed wherever
// they stood: normalizeArgs).
func argsExactly(c *cli.Context, n int) error {
	if c.NArg() == n {
		return nil
	}
	what := "no arguments"
	if c.Command.ArgsUsage != "" {
		what = c.Command.ArgsUsage
	}
	return exitcode.Usagef("%s: want %s, got %d argument(s) (see `ptxmig %s --help`)", commandPath(c), what, c.NArg(), commandPath(c))
}

// argsAtLeast enforces a minimum number of positional arguments.
func argsAtLeast(c *cli.Context, n int) error {
	if c.NArg() >= n {
		return nil
	}
	return exitcode.Usagef("%s: want %s (see `ptxmig %s --help`)", commandPath(c), c.Command.ArgsUsage, commandPath(c))
}
