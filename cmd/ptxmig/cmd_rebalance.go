package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/migrate"
	"github.com/ptxmig/ptxmig/rebalance"
	"github.com/ptxmig/ptxmig/store"
)

func init() {
	d := rebalance.DefaultPolicy()
	register(&cli.Command{
		Name:  "rebalance",
		Usage: "one pass of the GPU rebalancer: sample load, plan moves, migrate (run it from cron)",
		Description: "Samples every GPU's utilization, memory and power for --window, plans which processes to move\n" +
			"from GPUs above --busy-threshold to less loaded GPUs of the same model, and migrates them\n" +
			"live, one at a time, checking each. Processes younger than --min-age, moved within --cooldown,\n" +
			"pinned (--pin, --pin-name, or PTXMIG_PIN=1 in their environment) or without room on a target\n" +
			"stay where they are; --dry-run prints the plan and the reason for every process.\n" +
			"History and counters live in <store>/rebalance/; an overlapping run exits 0 at once.\n" +
			"Policy file format, scoring and metrics: docs/REBALANCE.md (installed in\n" +
			"/usr/local/share/doc/ptxmig). Flags override the policy file. `make install` puts an example\n" +
			"policy in /etc/ptxmig/rebalance.json (when none is there) and a systemd timer and a cron line\n" +
			"in /usr/local/share/doc/ptxmig/examples; neither is enabled by installing.\n\n" +
			"Examples:\n" +
			"   ptxmig rebalance --dry-run\n" +
			"   ptxmig rebalance --dry-run --busy-threshold 70 --window 10s\n" +
			"   ptxmig rebalance --policy /etc/ptxmig/rebalance.json --metrics-file /var/lib/node_exporter/textfile_collector/ptxmig_rebalance.prom",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "policy", Usage: "policy `FILE` (JSON); flags given here override it"},
			&cli.BoolFlag{Name: "dry-run", Usage: "plan and explain, move nothing, write no state"},
			&cli.StringFlag{Name: "metrics-file", Usage: "write Prometheus text metrics to `PATH` (atomically) for node_exporter's textfile collector"},
			&cli.DurationFlag{Name: "window", Value: time.Duration(d.Window), Usage: "how long to sample GPU load"},
			&cli.Float64Flag{Name: "busy-threshold", Value: d.BusyThreshold, Usage: "`PERCENT` utilization at which a GPU's processes become candidates"},
			&cli.DurationFlag{Name: "min-age", Value: time.Duration(d.MinAge), Usage: "leave younger processes alone"},
			&cli.DurationFlag{Name: "cooldown", Value: time.Duration(d.Cooldown), Usage: "leave processes moved within this time alone (doubles per further move)"},
			&cli.DurationFlag{Name: "return-window", Value: time.Duration(d.ReturnWindow), Usage: "never move a process back onto a GPU it left within this time"},
			&cli.IntFlag{Name: "max-moves", Value: d.MaxMoves, Usage: "moves per run"},
			&cli.Uint64Flag{Name: "memory-margin", Value: d.MemoryMarginMiB, Usage: "`MiB` a target must have free beyond the process's memory"},
			&cli.Float64Flag{Name: "weight-load", Value: d.WeightLoad, Usage: "weight of the load/latency improvement in a move's score"},
			&cli.Float64Flag{Name: "weight-power", Value: d.WeightPower, Usage: "weight of the power improvement in a move's score"},
			&cli.Float64Flag{Name: "min-improvement", Value: d.MinImprovement, Usage: "score (0..1) a move must exceed"},
			&cli.DurationFlag{Name: "lock-timeout", Value: time.Duration(d.LockTimeout), Usage: "driver lock timeout for each migration"},
			&cli.BoolFlag{Name: "require-shim", Usage: "move only processes running under libptxmig.so"},
			&cli.IntSliceFlag{Name: "pin", Usage: "never move this `PID` (repeatable)"},
			&cli.StringSliceFlag{Name: "pin-name", Usage: "never move processes whose name matches this shell `PATTERN` (repeatable)"},
		},
		Action: rebalanceAction,
	})
}

// rebalancePolicy builds the policy: defaults, then the policy file, then flags that were set.
func rebalancePolicy(c *cli.Context) (rebalance.Policy, error) {
	p := rebalance.DefaultPolicy()
	if f := c.String("policy"); f != "" {
		var err error
		if p, err = rebalance.LoadPolicy(f); err != nil {
			return p, exitcode.Wrap(exitcode.Usage, err)
		}
	}
	dur := func(name string, dst *rebalance.Duration) {
		if c.IsSet(name) {
			*dst = rebalance.Duration(c.Duration(name))
		}
	}
	flt := func(name string, dst *float64) {
		if c.IsSet(name) {
			*dst = c.Float64(name)
		}
	}
	dur("window", &p.Window)
	dur("min-age", &p.MinAge)
	dur("cooldown", &p.Cooldown)
	dur("return-window", &p.ReturnWindow)
	dur("lock-timeout", &p.LockTimeout)
	flt("busy-threshold", &p.BusyThreshold)
	flt("weight-load", &p.WeightLoad)
	flt("weight-power", &p.WeightPower)
	flt("min-improvement", &p.MinImprovement)
	if c.IsSet("max-moves") {
		p.MaxMoves = c.Int("max-moves")
	}
	if c.IsSet("memory-margin") {
		p.MemoryMarginMiB = c.Uint64("memory-margin")
	}
	if c.IsSet("require-shim") {
		p.RequireShim = c.Bool("require-shim")
	}
	p.Pin.PIDs = append(p.Pin.PIDs, c.IntSlice("pin")...)
	p.Pin.Names = append(p.Pin.Names, c.StringSlice("pin-name")...)
	if err := p.Validate(); err != nil {
		return p, exitcode.Wrap(exitcode.Usage, err)
	}
	return p, nil
}

// newRebalanceObserver opens NVML; replaceable in tests.
var newRebalanceObserver = func() (rebalance.Observer, func(), error) {
	lib, closeFn, err := rebalance.OpenNVML(nil)
	if err != nil {
		return nil, nil, err
	}
	return &rebalance.NVMLObserver{Lib: lib, Proc: rebalance.ProcFS{}, Clock: rebalance.RealClock{}}, closeFn, nil
}

// liveMigrator is the rebalancer's migration: the same in-place migrate as `ptxmig migrate`,
// which rolls the process back onto its source GPU when a step fails.
type liveMigrator struct{}

func (liveMigrator) Migrate(ctx context.Context, m rebalance.Move, lockTimeout time.Duration) error {
	e, closeEnv, err := op.NewEnv(ctx, "", nil)
	defer closeEnv()
	if err != nil {
		return err
	}
	res, err := migrate.Run(ctx, e, migrate.Options{
		PID:         m.PID,
		GPUMap:      map[string]string{m.From.UUID: m.To.UUID},
		LockTimeout: lockTimeout,
	})
	if res != nil {
		for _, w := range res.Warnings {
			e.Logger().Warn("rebalance: moved next to other processes", "pid", m.PID, "warning", w)
		}
	}
	return err
}

// newRebalanceMigrator returns the migrator; replaceable in tests.
var newRebalanceMigrator = func() rebalance.Migrator { return liveMigrator{} }

func rebalanceAction(c *cli.Context) error {
	if err := argsExactly(c, 0); err != nil {
		return err
	}
	g := env(c)
	pol, err := rebalancePolicy(c)
	if err != nil {
		return err
	}
	if !c.Bool("dry-run") {
		// Its state goes under the store directory: a mistyped --store is refused, not created.
		if err := store.CheckCreate(g.Store); err != nil {
			return err
		}
	}
	obs, closeObs, err := newRebalanceObserver()
	if err != nil {
		return fmt.Errorf("rebalance: %w", err)
	}
	defer closeObs()
	r := &rebalance.Runner{
		Dir:      filepath.Join(g.Store, "rebalance"),
		Policy:   pol,
		DryRun:   c.Bool("dry-run"),
		Observer: obs,
		Clock:    rebalance.RealClock{},
		Log:      g.Log,
	}
	if !r.DryRun {
		r.Migrator = newRebalanceMigrator()
	}
	rep, err := r.Run(c.Context)
	if errors.Is(err, rebalance.ErrBusy) {
		msg := err.Error() + "; this run does nothing"
		if g.JSON {
			return printJSON(c, map[string]any{"busy": true, "message": msg})
		}
		fmt.Fprintln(g.Out, msg)
		return nil
	}
	if rep == nil {
		return rebalanceExit(err)
	}
	if f := c.String("metrics-file"); f != "" {
		if merr := rebalance.WriteMetricsFile(f, rep); merr != nil {
			err = errors.Join(err, merr)
		}
	}
	if g.JSON {
		if err != nil {
			return withResult(rebalanceExit(err), rep)
		}
		return printJSON(c, rep)
	}
	// The report names processes (their comm and command line come from /proc, set by whoever
	// runs them): escaped like every such string.
	var b bytes.Buffer
	if werr := rebalance.WriteText(&b, rep); werr != nil {
		return werr
	}
	if _, werr := io.WriteString(g.Out, escLines(b.String())); werr != nil {
		return werr
	}
	return rebalanceExit(err)
}

// rebalanceExit maps a run's error to an exit status; a failed move carries the migration's.
func rebalanceExit(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, rebalance.ErrBadPolicy):
		return exitcode.Wrap(exitcode.Usage, err)
	}
	return withOpExitCode(err)
}
