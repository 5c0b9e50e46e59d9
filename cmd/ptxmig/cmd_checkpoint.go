package main

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/restore"
)

func init() {
	register(&cli.Command{
		Name:      "checkpoint",
		Usage:     "save a running process (CUDA or CPU-only) into an image in the store",
		ArgsUsage: "PID",
		Description: "Preflight (root, the process is alive and running, CRIU >= 4.0, the store is writable with room\n" +
			"for the estimated size, no other ptxmig operation on PID), then: driver lock (waits for running\n" +
			"kernels up to --lock-timeout) → driver checkpoint (GPU memory to host memory, GPUs released) →\n" +
			"CRIU dump → store. The manifest records host, kernel, driver, CUDA, the source GPUs (index, UUID,\n" +
			"name, compute capability, memory used), every GPU of the host (a restore onto other GPUs must\n" +
			"pair each of them, whatever CUDA_VISIBLE_DEVICES the process has; MIG is not\n" +
			"supported), the pid and the command line. A process that does not use CUDA is checkpointed with\n" +
			"CRIU alone.\n\n" +
			"Without --leave-running the process is stopped by the dump and killed once the image is stored.\n" +
			"Any failure — or SIGINT/SIGTERM to ptxmig — after the lock rolls back: the process is resumed,\n" +
			"restored onto its GPUs and unlocked, and runs on as before (exit status 4). CRIU's full log stays\n" +
			"in the staging directory, and its tail is printed.\n\n" +
			"Examples:\n" +
			"   ptxmig checkpoint 4242\n" +
			"   ptxmig checkpoint --name trainer-step-900 --leave-running --lock-timeout 30s 4242",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "name", Usage: "image name (default COMM-PID-DATE-TIME)"},
			&cli.BoolFlag{Name: "leave-running", Usage: "keep the process running after the checkpoint"},
			&cli.DurationFlag{Name: "lock-timeout", Value: 10 * time.Second, Usage: "how long the driver lock may wait for running kernels (0: forever)"},
			&cli.BoolFlag{Name: "tcp-established", Usage: "checkpoint established TCP connections (CRIU --tcp-established)"},
			&cli.BoolFlag{Name: "shell-job", Usage: "the process is a job of an interactive shell (CRIU --shell-job)"},
			&cli.BoolFlag{Name: "keep-staging", Usage: "keep CRIU's image directory after storing it"},
			&cli.IntFlag{Name: "prestage-workers", Usage: "workers that store the dump while CRIU writes it (0: half the CPUs; -1: store only after the dump)"},
		},
		Action: checkpointAction,
	})
}

func checkpointAction(c *cli.Context) error {
	if err := argsExactly(c, 1); err != nil {
		return err
	}
	pid, err := parsePID(c.Args().First())
	if err != nil {
		return err
	}
	lockTimeout, err := lockTimeoutFlag(c)
	if err != nil {
		return err
	}
	g := env(c)
	e, closeEnv, err := checkpoint.NewEnv(c.Context, g.Store, g.Log)
	defer closeEnv()
	if err != nil {
		return opError(g.Err, err)
	}
	res, err := checkpoint.Run(c.Context, e, checkpoint.Options{
		PID: pid, Name: c.String("name"), LeaveRunning: c.Bool("leave-running"),
		LockTimeout: lockTimeout, TCPEstablished: c.Bool("tcp-established"),
		ShellJob: c.Bool("shell-job"), KeepStaging: c.Bool("keep-staging"),
		PrestageWorkers: c.Int("prestage-workers"),
	})
	if err != nil {
		return opError(g.Err, err)
	}
	if g.JSON {
		return printJSON(c, res)
	}
	w := g.Out
	gpus := ""
	for _, gp := range res.GPUs {
		gpus += fmt.Sprintf(", GPU %d %s %s", gp.Index, gp.Name, gp.UUID)
	}
	fmt.Fprintf(w, "checkpointed pid %d (%s%s)\n", res.PID, res.Kind, gpus)
	if len(res.Visible) > 0 {
		vis := make([]string, len(res.Visible))
		for i, v := range res.Visible {
			vis[i] = fmt.Sprintf("%d (%s)", v.Index, v.UUID)
		}
		fmt.Fprintf(w, "GPUs visible to it: %s\n", strings.Join(vis, ", "))
	}
	fmt.Fprintf(w, "image %s (id %s)\n", res.Image, shortID(res.ImageID))
	labels := map[string]string{
		checkpoint.StepLock: "lock", checkpoint.StepCheckpoint: "device->host", checkpoint.StepDump: "criu dump",
		checkpoint.StepRestore: "driver restore", checkpoint.StepUnlock: "unlock", checkpoint.StepStore: "store", checkpoint.StepFinish: "stop process",
	}
	for _, t := range res.Timings {
		fmt.Fprintf(w, "  %-15s %s\n", labels[t.Step], ms(t.Duration))
	}
	fmt.Fprintf(w, "  %-15s %s\n", "total", ms(res.Total))
	s := res.Sizes
	fmt.Fprintf(w, "size: %s logical, %s stored (%s zero, %s deduplicated, %s written)\n",
		checkpoint.HumanBytes(s.Logical), checkpoint.HumanBytes(s.Stored), checkpoint.HumanBytes(s.Zero),
		checkpoint.HumanBytes(s.Dedup), checkpoint.HumanBytes(s.Written))
	if res.LeftRunning {
		fmt.Fprintf(w, "pid %d keeps running\n", res.PID)
	} else {
		fmt.Fprintf(w, "pid %d was stopped; bring it back with: ptxmig restore %s\n", res.PID, res.Image)
	}
	if res.StagingDir != "" {
		fmt.Fprintf(w, "staging kept in %s\n", res.StagingDir)
	}
	return nil
}

func parsePID(s string) (int, error) {
	pid, err := strconv.Atoi(s)
	if err != nil || pid <= 0 {
		return 0, exitcode.Usagef("PID %q: want a positive integer", s)
	}
	return pid, nil
}

// lockTimeoutFlag reads --lock-timeout, shared by checkpoint and migrate; 0 means no limit.
func lockTimeoutFlag(c *cli.Context) (time.Duration, error) {
	d := c.Duration("lock-timeout")
	if d < 0 {
		return 0, exitcode.Usagef("--lock-timeout %s: want 0 (no limit) or a positive duration", d)
	}
	return d, nil
}

func shortID(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

func ms(d time.Duration) string {
	if d < 10*time.Second {
		return fmt.Sprintf("%d ms", d.Milliseconds())
	}
	return fmt.Sprintf("%.1f s", d.Seconds())
}

// opError maps checkpoint/restore/migrate failures to exit statuses and prints CRIU's log tail.
func opError(stderr io.Writer, err error) error {
	if err == nil {
		return nil
	}
	var tail []string
	var staging string
	var cf *checkpoint.Failure
	var rf *restore.Failure
	switch {
	case errors.As(err, &cf):
		tail, staging = cf.CRIUTail, cf.StagingDir
	case errors.As(err, &rf):
		tail, staging = rf.CRIUTail, rf.StagingDir
	}
	if len(tail) > 0 {
		fmt.Fprintf(stderr, "ptxmig: last lines of CRIU's log:\n  %s\n", strings.Join(tail, "\n  "))
	}
	if staging != "" {
		fmt.Fprintf(stderr, "ptxmig: logs kept in %s\n", staging)
	}
	return withOpExitCode(err)
}

// withOpExitCode attaches the exit status of a checkpoint/restore/migrate failure: refused by
// preflight 3, busy 5, failed and rolled back 4, anything else 1.
func withOpExitCode(err error) error {
	var se *checkpoint.StepError
	switch {
	case errors.Is(err, checkpoint.ErrRefused):
		return exitcode.Wrap(exitcode.Refused, err)
	case errors.Is(err, oplock.ErrBusy):
		return exitcode.Wrap(exitcode.Busy, err)
	case errors.As(err, &se) && se.RolledBack():
		return exitcode.Wrap(exitcode.RolledBack, err)
	}
	return exitcode.Wrap(exitcode.Failed, err)
}
