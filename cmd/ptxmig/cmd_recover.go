package main

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/guardian"
	"github.com/ptxmig/ptxmig/internal/op"
)

func init() {
	// `ptxmig __ptxmig-guardian JOURNAL` is an operation's guardian (internal/guardian), started
	// by ptxmig itself: it runs and exits here, before the CLI.
	guardian.Intercept(os.Args)
	register(&cli.Command{
		Name:  "recover",
		Usage: "finish or roll back operations an earlier ptxmig left interrupted (it died, or the host rebooted)",
		Description: "Every checkpoint, restore and migrate is journaled under /run/ptxmig/journal ($PTXMIG_JOURNAL_DIR)\n" +
			"step by step, and watched by a guardian process outside ptxmig's process group. If ptxmig dies\n" +
			"before the operation commits (kill -9, OOM, a crash), the guardian rolls back what the journal\n" +
			"says was done: it ends CRIU, resumes every process the dump stopped, restores and unlocks the\n" +
			"GPUs, resumes kernels the shim held, kills half-restored processes and removes the staging\n" +
			"directory; an operation that had committed (its image stored) is finished instead. It keeps a\n" +
			"report with the journal and CRIU's log in /var/log/ptxmig ($PTXMIG_LOG_DIR).\n\n" +
			"recover does the same for journals no guardian handled (it died too), and removes staging\n" +
			"directories left by ptxmig versions without journals. Every checkpoint, restore and migrate\n" +
			"runs it first, so running it by hand is needed only to clean up at once (at boot, say).\n" +
			"Operations still running are left alone; one a guardian is recovering is waited for (--wait).\n" +
			"A journal that fails validation is refused: kept in the log directory, no process touched.\n\n" +
			"Outcomes: rolled-back, finished (it had committed), cleaned (nothing was touched, or it had\n" +
			"ended), running (a live operation), recovering (its guardian is at work), refused, incomplete\n" +
			"(the rollback failed; retried by the next recover) and abandoned (failed three times). Exit\n" +
			"status 1 when any operation is refused, incomplete, abandoned or still recovering.\n\n" +
			"Examples:\n" +
			"   ptxmig recover\n" +
			"   ptxmig --json recover",
		Flags: []cli.Flag{
			&cli.DurationFlag{Name: "wait", Value: op.DefaultRecoverWait, Usage: "how long to wait for an operation its guardian is recovering"},
		},
		Action: recoverAction,
	})
}

func recoverAction(c *cli.Context) error {
	if err := argsExactly(c, 0); err != nil {
		return err
	}
	g := env(c)
	rep, err := op.Recover(c.Context, op.RecoverOptions{Log: g.Log, Wait: c.Duration("wait")})
	if err != nil {
		if errors.Is(err, op.ErrRefused) {
			return exitcode.Wrap(exitcode.Refused, err)
		}
		return exitcode.Wrap(exitcode.Failed, err)
	}
	var bad []string
	for _, r := range rep.Operations {
		switch r.Outcome {
		case op.RecoveredRefused, op.RecoveredIncomplete, op.RecoveredAbandoned, op.RecoveredBusy:
			bad = append(bad, r.Journal+" "+r.Outcome)
		}
	}
	if g.JSON {
		if err := printJSON(c, rep); err != nil {
			return err
		}
	} else {
		printRecovery(c, rep)
	}
	if len(bad) > 0 {
		return exitcode.Wrap(exitcode.Failed, fmt.Errorf("not recovered: %s", strings.Join(bad, ", ")))
	}
	return nil
}

func printRecovery(c *cli.Context, rep *op.Report) {
	w := env(c).Out
	if len(rep.Operations) == 0 && len(rep.Staging) == 0 {
		fmt.Fprintln(w, "nothing to recover")
		return
	}
	for _, r := range rep.Operations {
		what := r.Journal
		if r.Op != "" {
			what = fmt.Sprintf("%s of pid %d (journal %s, started %s)", r.Op, r.PID, r.Journal, r.Started.Local().Format("2006-01-02 15:04:05"))
		}
		fmt.Fprintf(w, "%s: %s\n", what, r.Outcome)
		for _, a := range r.Actions {
			fmt.Fprintf(w, "  - %s\n", a)
		}
		if r.Error != "" {
			fmt.Fprintf(w, "  error: %s\n", r.Error)
		}
		if r.LogDir != "" {
			fmt.Fprintf(w, "  report and logs: %s\n", r.LogDir)
		}
	}
	for _, s := range rep.Staging {
		fmt.Fprintf(w, "removed leftover staging %s\n", s)
	}
}
