package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/op"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

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
}

func env(c *cli.Context) *globals { return c.App.Metadata["globals"].(*globals) }

const exitCodesHelp = `EXIT CODES:
   0  success
   1  the operation failed
   2  usage error (bad flags or arguments)
   3  refused by preflight: nothing was touched
   4  failed after touching the process, rolled back: it runs as before
   5  busy: another ptxmig operation holds the same target`

func newApp(stdout, stderr io.Writer) *cli.App {
	g := &globals{Out: stdout, Err: stderr}
	// Fresh copies: urfave/cli mutates commands (HelpName) on every run, and tests run the app
	// many times in one process.
	cmds := make([]*cli.Command, len(commands))
	for i, c := range commands {
		cc := *c
		cmds[i] = &cc
	}
	sort.Slice(cmds, func(i, j int) bool { return cmds[i].Name < cmds[j].Name })
	for _, c := range cmds {
		markUsageErrors(c)
	}
	app := &cli.App{
		Name:  "ptxmig",
		Usage: "checkpoint, restore and migrate running CUDA processes",
		Description: "ptxmig saves a running CUDA process into a verified, deduplicated image store, restores it\n" +
			"onto any GPU of the same chip type, and moves live processes between GPUs.\n" +
			"Flags go before positional arguments: ptxmig checkpoint --leave-running 4242.",
		Version:               version,
		HideVersion:           true,
		Writer:                stdout,
		ErrWriter:             stderr,
		Commands:              cmds,
		Metadata:              map[string]any{"globals": g},
		ExitErrHandler:        func(*cli.Context, error) {}, // exit codes are mapped in run, after cleanup
		CustomAppHelpTemplate: cli.AppHelpTemplate + "\n" + exitCodesHelp + "\n",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "store", Value: "/var/lib/ptxmig", EnvVars: []string{"PTXMIG_STORE"},
				Usage: "image store directory"},
			&cli.StringFlag{Name: "log-level", Value: "warn", EnvVars: []string{"PTXMIG_LOG_LEVEL"},
				Usage: "diagnostics on stderr: debug, info, warn or error"},
			&cli.BoolFlag{Name: "json", Usage: "machine-readable output on stdout"},
		},
		Before: func(c *cli.Context) error {
			var lvl slog.Level
			if err := lvl.UnmarshalText([]byte(c.String("log-level"))); err != nil {
				return exitcode.Usagef("--log-level %q: want debug, info, warn or error", c.String("log-level"))
			}
			g.Store = c.String("store")
			g.JSON = c.Bool("json")
			g.Log = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: lvl}))
			slog.SetDefault(g.Log)
			return nil
		},
		OnUsageError: usageError,
	}
	return app
}

func usageError(_ *cli.Context, err error, _ bool) error { return exitcode.Wrap(exitcode.Usage, err) }

func markUsageErrors(c *cli.Command) {
	if c.OnUsageError == nil {
		c.OnUsageError = usageError
	}
	for _, s := range c.Subcommands {
		markUsageErrors(s)
	}
}

// run executes the CLI and returns the exit status; errors are reported here, once.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	app := newApp(stdout, stderr)
	err := app.RunContext(ctx, args)
	if err == nil {
		return exitcode.OK
	}
	code := exitcode.Of(err)
	if strings.Contains(err.Error(), "flag provided but not defined") || strings.HasPrefix(err.Error(), "No help topic") {
		code = exitcode.Usage
	}
	if errors.Is(err, context.Canceled) && code == exitcode.Failed {
		code = 130
	}
	if wantJSON(args) {
		doc := map[string]any{"error": err.Error(), "exit_code": code, "kind": exitcode.Name(code)}
		var f *op.Failure
		if errors.As(err, &f) {
			doc["failed_step"], doc["rolled_back"], doc["undone"] = f.Step, f.RolledBack(), f.Undone
			if f.State != "" {
				doc["process_state"] = f.State
			}
			if f.LogDir != "" {
				doc["log_dir"] = f.LogDir
			}
		}
		_ = writeJSON(stdout, doc)
	} else {
		fmt.Fprintf(stderr, "ptxmig: error: %v\n", err)
	}
	return code
}

// wantJSON reports whether --json was given among the global flags (the app may have failed
// before its Before hook ran).
func wantJSON(args []string) bool {
	for _, a := range args[1:] {
		if a == "--json" || a == "-json" || a == "--json=true" {
			return true
		}
	}
	return false
}

// printJSON writes v as indented JSON to stdout.
func printJSON(c *cli.Context, v any) error { return writeJSON(env(c).Out, v) }

// writeJSON writes v to w as one JSON document, indented by two spaces and ended by a newline,
// in a single Write (nothing is written when v fails to encode). All user-facing JSON, on
// stdout or elsewhere, goes through it.
func writeJSON(w io.Writer, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("encode JSON: %w", err)
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// argsExactly enforces the number of positional arguments; v2 stops flag parsing at the first
// positional argument, so a trailing flag shows up here as a surplus argument.
func argsExactly(c *cli.Context, n int) error {
	if c.NArg() == n {
		return nil
	}
	for _, a := range c.Args().Slice() {
		if strings.HasPrefix(a, "-") {
			return exitcode.Usagef("%s: flag %s after an argument; put flags first: ptxmig %s %s", c.Command.Name, a, c.Command.Name, c.Command.ArgsUsage)
		}
	}
	return exitcode.Usagef("%s: want %d argument(s) (%s), got %d", c.Command.Name, n, c.Command.ArgsUsage, c.NArg())
}
