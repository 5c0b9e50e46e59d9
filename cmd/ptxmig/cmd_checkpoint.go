package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/internal/shimctl"
)

func init() {
	register(&cli.Command{
		Name:      "checkpoint",
		Usage:     "save a running process tree (CUDA or CPU-only) into an image in the store",
		ArgsUsage: "PID",
		Description: "Saves PID and every process below it. Preflight refuses (exit status 3) before anything is\n" +
			"frozen or written: not root; the name is empty, taken, or could be read as an image id (4 to 64\n" +
			"hex digits); PID is ptxmig or one of its ancestors; a process is locked by another tool; CRIU is\n" +
			"missing; the store lacks room for the estimate (resident memory + GPU memory). A tree that\n" +
			"belongs to a shell's session or has a controlling terminal is dumped as a shell job (said in the\n" +
			"output) instead of failing in CRIU. --dry-run prints the plan and stops there.\n\n" +
			"Then, for the CUDA processes of the tree: those under the ptxmig shim (`ptxmig run`) are quiesced:\n" +
			"their preemptible kernels stop between blocks within --preempt-budget and new launches are held,\n" +
			"so the lock does not wait for long kernels; the output names any kernel left running. Then the\n" +
			"driver lock (waits for running kernels up to --lock-timeout) → driver checkpoint (GPU memory to\n" +
			"host memory, GPUs released); then CRIU dump of\n" +
			"the tree → store. The manifest records the tree, host, kernel, driver, CUDA, the source GPUs\n" +
			"(index, UUID, name, compute capability, memory used), every GPU of the host (a restore onto other\n" +
			"GPUs must pair each of them; MIG is not supported), the pid and the command line.\n\n" +
			"Without --leave-running every process of the tree is stopped by the dump and ended once the image\n" +
			"is stored. Any failure — or SIGINT/SIGTERM to ptxmig — after the first step rolls back: every\n" +
			"stopped process is resumed, the GPUs restored and unlocked, and the tree runs on as before (exit\n" +
			"status 4). The error names the real cause and the processes' state; CRIU's log is kept in\n" +
			"/var/log/ptxmig ($PTXMIG_LOG_DIR; the newest 20 failures, 14 days; `ptxmig image gc` prunes).\n\n" +
			"Examples:\n" +
			"   ptxmig checkpoint 4242\n" +
			"   ptxmig checkpoint --dry-run 4242\n" +
			"   ptxmig checkpoint --name trainer-step-900 --leave-running --lock-timeout 30s 4242",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "name", Usage: "image name (default COMM-PID-DATE-TIME)"},
			&cli.BoolFlag{Name: "leave-running", Usage: "keep the processes running after the checkpoint"},
			&cli.BoolFlag{Name: "dry-run", Usage: "print the plan after preflight; touch nothing"},
			&cli.DurationFlag{Name: "lock-timeout", Value: 10 * time.Second, Usage: "how long the driver lock may wait for running kernels (0: forever)"},
			preemptBudgetFlag(),
			&cli.BoolFlag{Name: "tcp-established", Usage: "checkpoint established TCP connections (CRIU --tcp-established)"},
			&cli.BoolFlag{Name: "shell-job", Usage: "dump as a shell job (CRIU --shell-job); on by itself when the tree needs it"},
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
	budget, err := preemptBudget(c)
	if err != nil {
		return err
	}
	g := env(c)
	e, closeEnv, err := op.NewEnv(c.Context, g.Store, g.Log)
	defer closeEnv()
	if err != nil {
		return opError(g.Err, err)
	}
	plan, err := checkpoint.PlanCheckpoint(e, checkpoint.Options{
		PID: pid, Name: c.String("name"), NameSet: c.IsSet("name"), LeaveRunning: c.Bool("leave-running"),
		LockTimeout: lockTimeout, PreemptBudget: budget, TCPEstablished: c.Bool("tcp-established"),
		ShellJob: c.Bool("shell-job"), KeepStaging: c.Bool("keep-staging"),
		PrestageWorkers: c.Int("prestage-workers"),
	})
	if err != nil {
		return opError(g.Err, err)
	}
	w := g.Out
	if c.Bool("dry-run") {
		return printPlan(c, plan, plan.Steps, func() {
			fmt.Fprintf(w, "plan for pid %d (dry run, nothing done): image %s, %s, estimated %s\n", plan.PID, plan.Image, plan.Kind, ms(plan.Estimate.Duration))
			printTree(w, plan.Tree)
		})
	}
	if plan.ShellJobReason != "" && !g.JSON {
		fmt.Fprintf(g.Err, "ptxmig: dumping as a shell job: %s\n", plan.ShellJobReason)
	}
	res, err := checkpoint.Execute(c.Context, e, plan)
	if err != nil {
		return opError(g.Err, err)
	}
	if g.JSON {
		return printJSON(c, res)
	}
	gpus := ""
	for _, gp := range res.GPUs {
		gpus += fmt.Sprintf(", GPU %d %s %s", gp.Index, gp.Name, gp.UUID)
	}
	fmt.Fprintf(w, "checkpointed pid %d (%s%s)\n", res.PID, res.Kind, gpus)
	if len(res.Tree) > 1 {
		printTree(w, res.Tree)
	}
	if len(res.Visible) > 0 {
		vis := make([]string, len(res.Visible))
		for i, v := range res.Visible {
			vis[i] = fmt.Sprintf("%d (%s)", v.Index, v.UUID)
		}
		fmt.Fprintf(w, "GPUs visible to it: %s\n", strings.Join(vis, ", "))
	}
	fmt.Fprintf(w, "image %s (id %s)\n", res.Image, shortID(res.ImageID))
	printPreemption(w, res.Preemption)
	labels := map[string]string{
		op.StepQuiesce: "quiesce", op.StepDetach: "detach", op.StepResume: "resume", checkpoint.StepLock: "lock", checkpoint.StepCheckpoint: "device->host", checkpoint.StepDump: "criu dump",
		checkpoint.StepRestore: "driver restore", checkpoint.StepUnlock: "unlock", checkpoint.StepStore: "store", checkpoint.StepFinish: "stop processes",
	}
	for _, t := range res.Timings {
		fmt.Fprintf(w, "  %-15s %s\n", labels[t.Step], ms(t.Duration))
	}
	fmt.Fprintf(w, "  %-15s %s\n", "total", ms(res.Total))
	s := res.Sizes
	fmt.Fprintf(w, "size: %s logical, %s stored (%s zero, %s deduplicated, %s written)\n",
		bytesize.Format(s.Logical), bytesize.Format(s.Stored), bytesize.Format(s.Zero),
		bytesize.Format(s.Dedup), bytesize.Format(s.Written))
	if res.LeftRunning {
		fmt.Fprintf(w, "pid %d keeps running\n", res.PID)
	} else {
		fmt.Fprintf(w, "pid %d was stopped; bring it back with: %s\n", res.PID, restoreHint(c, res.Image))
	}
	if res.StagingDir != "" {
		fmt.Fprintf(w, "staging kept in %s\n", res.StagingDir)
	}
	return nil
}

// restoreHint is the command that restores image, with the store named when it is not the
// default one.
func restoreHint(c *cli.Context, image string) string {
	if st := env(c).Store; c.IsSet("store") || os.Getenv("PTXMIG_STORE") != "" {
		return fmt.Sprintf("ptxmig --store %s restore %s", st, image)
	}
	return "ptxmig restore " + image
}

// printPlan prints a --dry-run plan: with --json one document {"dry_run": true, "plan": …};
// else head() then the numbered steps.
func printPlan(c *cli.Context, plan any, steps []op.PlanStep, head func()) error {
	if env(c).JSON {
		return printJSON(c, map[string]any{"dry_run": true, "plan": plan})
	}
	head()
	for i, s := range steps {
		fmt.Fprintf(env(c).Out, "  %d. %-14s %s\n", i+1, s.Step, s.Action)
	}
	return nil
}

// printTree lists a process tree, one process a line, indented by depth.
func printTree(w io.Writer, tree []op.TreeProc) {
	depth := map[int]int{}
	for _, p := range tree {
		d := 0
		if pd, ok := depth[p.PPID]; ok {
			d = pd + 1
		}
		depth[p.PID] = d
		cuda := ""
		if p.CUDA {
			cuda = " [cuda]"
		}
		fmt.Fprintf(w, "  %s%d %s%s\n", strings.Repeat("  ", d), p.PID, p.Comm, cuda)
	}
}

func parsePID(s string) (int, error) {
	pid, err := strconv.Atoi(s)
	if err != nil || pid <= 0 {
		return 0, exitcode.Usagef("PID %q: want a positive integer", s)
	}
	return pid, nil
}

// preemptBudgetFlag is --preempt-budget, shared by checkpoint and migrate.
func preemptBudgetFlag() cli.Flag {
	return &cli.DurationFlag{Name: "preempt-budget", Value: op.DefaultPreemptBudget,
		Usage: "processes under the shim: how long to wait for preemptible kernels to stop before the driver lock"}
}

// preemptBudget reads --preempt-budget (1 ms to 60 s).
func preemptBudget(c *cli.Context) (time.Duration, error) {
	d := c.Duration("preempt-budget")
	if d < time.Millisecond || d > time.Minute {
		return 0, exitcode.Usagef("--preempt-budget %s: want 1ms to 1m", d)
	}
	return d, nil
}

// printPreemption reports, per process under the shim, what the quiesce stopped and what it
// left to the driver lock, and the resume. Processes without the shim print nothing.
func printPreemption(w io.Writer, reports []*op.PreemptReport) {
	for _, r := range reports {
		if !r.Shim {
			continue
		}
		if r.Note != "" {
			fmt.Fprintf(w, "pid %d: %s\n", r.PID, r.Note)
		}
		if q := r.Quiesce; q != nil {
			fmt.Fprintf(w, "pid %d: quiesced in %s (%d preempted, %d drained, %d left to the lock)\n", r.PID,
				usText(q.ElapsedUS), len(q.Preempted), len(q.Drained), len(q.NotStopped)+len(q.Originals))
			for _, k := range q.Preempted {
				fmt.Fprintf(w, "  preempted %s: %d of %d blocks done\n", k.Kernel, k.BlocksDone, k.BlocksTotal)
			}
			for _, k := range append(append([]shimctl.LaunchNote(nil), q.NotStopped...), q.Originals...) {
				fmt.Fprintf(w, "  not preempted %s: %s\n", k.Kernel, k.Reason)
			}
		}
		if res := r.Resume; res != nil {
			fmt.Fprintf(w, "pid %d: resumed (%d relaunched) in %s\n", r.PID, res.Relaunched, usText(res.ElapsedUS))
		}
	}
}

func usText(us int64) string {
	if us < 10000 {
		return fmt.Sprintf("%.2f ms", float64(us)/1000)
	}
	return ms(time.Duration(us) * time.Microsecond)
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

// opError maps checkpoint/restore/migrate failures to exit statuses and prints CRIU's log tail
// and where the failure's logs were kept.
func opError(stderr io.Writer, err error) error {
	if err == nil {
		return nil
	}
	var f *op.Failure
	if errors.As(err, &f) {
		if len(f.CRIUTail) > 0 {
			fmt.Fprintf(stderr, "ptxmig: last lines of CRIU's log:\n  %s\n", strings.Join(f.CRIUTail, "\n  "))
		}
		if f.LogDir != "" {
			fmt.Fprintf(stderr, "ptxmig: logs kept in %s\n", f.LogDir)
		}
	}
	return withOpExitCode(err)
}

// withOpExitCode attaches the exit status of a checkpoint/restore/migrate failure: refused by
// preflight 3, busy 5, failed and rolled back 4, anything else 1.
func withOpExitCode(err error) error {
	var se *op.StepError
	switch {
	case errors.Is(err, op.ErrRefused):
		return exitcode.Wrap(exitcode.Refused, err)
	case errors.Is(err, oplock.ErrBusy):
		return exitcode.Wrap(exitcode.Busy, err)
	case errors.As(err, &se) && se.RolledBack():
		return exitcode.Wrap(exitcode.RolledBack, err)
	}
	return exitcode.Wrap(exitcode.Failed, err)
}
