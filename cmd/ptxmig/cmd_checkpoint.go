package main

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/store"
)

func init() {
	register(&cli.Command{
		Name:      "checkpoint",
		Usage:     "save a running process tree (CUDA or CPU-only) into an image in the store",
		ArgsUsage: "PID",
		Description: "Saves PID and every process below it. Usage errors (exit 2): PID is not a number; --name is\n" +
			"not a valid image name (letters, digits and . _ + @ -) or is 4 to 64 hex digits (it would read\n" +
			"as an image id). No process PID: exit 6. Preflight refuses (exit 3) before anything is frozen\n" +
			"or written: not root; the name is taken; PID is ptxmig or one of its ancestors; a process is\n" +
			"locked by another tool, has a controlling terminal, or belongs to a session whose leader is\n" +
			"outside this PID namespace (docker exec: CRIU cannot dump it); CRIU is missing; the store is\n" +
			"read-only or lacks room for the estimate (resident memory + GPU memory); a CUDA process under\n" +
			"the shim shares GPU memory with another process (CUDA IPC, VMM shareable handles, memory\n" +
			"pools: NCCL's default transports; the error names NCCL's socket transports as the way out),\n" +
			"which driver 580 checkpoints but cannot restore; a\n" +
			"tree with an io_uring instance (CRIU cannot dump it). Peer access a process under the shim\n" +
			"enabled between its GPUs is turned off after the quiesce and on again when it resumes (also\n" +
			"after a restore). From the driver's checkpoint until its\n" +
			"restore a CUDA process stays stopped, but for the driver's own thread while the driver works\n" +
			"(a thread touching device memory in between would kill it: JAX's do). A\n" +
			"tree of several CUDA processes under the shim that launch collectives (NCCL ranks) is first\n" +
			"stopped right after the same collective in every rank (within --lock-timeout), so that no\n" +
			"rank's collective waits for one already locked. With --leave-running, a warning names other\n" +
			"processes on its GPUs (a context the driver restored has been killed by Xid 109 beside another\n" +
			"process's long kernels).\n" +
			"A tree that belongs to a shell's session is dumped as a shell job (said in the output) instead\n" +
			"of failing in CRIU.\n" +
			"--dry-run prints the plan and stops there, creating nothing (not even the store). The first\n" +
			"checkpoint creates the store (stderr says so); its parent directory must exist.\n\n" +
			"Then, for the CUDA processes of the tree: those under the ptxmig shim (`ptxmig run`) are quiesced:\n" +
			"their preemptible kernels stop between blocks within --preempt-budget and new launches are held,\n" +
			"so the lock does not wait for long kernels; the output names any kernel left running. Then the\n" +
			"driver lock (waits for running kernels up to --lock-timeout) → driver checkpoint (GPU memory to\n" +
			"host memory, GPUs released); then CRIU dump of the tree, its image files streamed straight into\n" +
			"the store as CRIU writes them (chunked, hashed, compressed in parallel; no staging copy) → store\n" +
			"(CRIU's log added, the image committed). --no-stream (or --keep-staging) has CRIU write into the\n" +
			"staging directory and stores that after the dump instead; the output says which way it went and\n" +
			"why. On a terminal, a status line on stderr shows the step, the bytes stored with throughput,\n" +
			"and an ETA. The manifest records the tree, host, kernel, driver, CUDA, the source GPUs (index,\n" +
			"UUID, name, compute capability, memory used), every GPU of the host (a restore onto other GPUs\n" +
			"must pair each of them; MIG is not supported), the pid and the command line.\n\n" +
			"--carry-files takes the regular files the tree has open for writing (logs, state files; up to\n" +
			"--carry-limit) into the image, so that a restore on a host that lacks them puts them in place;\n" +
			"the size taken is the one CRIU recorded. The manifest always lists every file a restore needs on\n" +
			"its host (the executable and libraries included), as CRIU recorded them.\n\n" +
			"Without --leave-running every process of the tree is stopped by the dump and ended once the image\n" +
			"is stored. Any failure — or SIGINT/SIGTERM to ptxmig — after the first step rolls back: every\n" +
			"stopped process is resumed, the GPUs restored and unlocked, and the tree runs on as before (exit\n" +
			"status 4). The error names the real cause and the processes' state; CRIU's log is kept in\n" +
			"/var/log/ptxmig ($PTXMIG_LOG_DIR; the newest 20 failures, 14 days; `ptxmig image gc` prunes).\n\n" +
			"Examples:\n" +
			"   ptxmig checkpoint 4242\n" +
			"   ptxmig checkpoint --dry-run 4242\n" +
			"   ptxmig checkpoint --name trainer-step-900 --leave-running --lock-timeout 30s 4242\n" +
			"   ptxmig checkpoint 4242 --name nightly-4242 --json\n" +
			"   ptxmig checkpoint --carry-files --name move-4242 4242     # to restore on another host",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "name", Usage: "image `NAME` (default COMM-PID-DATE-TIME)"},
			&cli.BoolFlag{Name: "leave-running", Usage: "keep the processes running after the checkpoint"},
			&cli.BoolFlag{Name: "dry-run", Usage: "print the plan after preflight; touch nothing"},
			&cli.DurationFlag{Name: "lock-timeout", Value: 10 * time.Second, Usage: "how long the driver lock may wait for running kernels (0: forever)"},
			preemptBudgetFlag(),
			criuStallFlag(),
			&cli.BoolFlag{Name: "tcp-established", Usage: "checkpoint established TCP connections (CRIU --tcp-established)"},
			&cli.BoolFlag{Name: "shell-job", Usage: "dump as a shell job (CRIU --shell-job); on by itself when the tree needs it"},
			&cli.BoolFlag{Name: "keep-staging", Usage: "keep CRIU's image directory after storing it (implies --no-stream)"},
			&cli.BoolFlag{Name: "carry-files", Usage: "take the regular files the tree has open for writing (logs, state files) into the image, for a restore on a host that lacks them"},
			&cli.StringFlag{Name: "carry-limit", Value: "64MiB", Usage: "most bytes --carry-files takes along (`SIZE`); more is refused before the image is stored"},
			&cli.BoolFlag{Name: "no-stream", Usage: "have CRIU write its images into the staging directory, stored after the dump, instead of streaming them into the store"},
			&cli.IntFlag{Name: "prestage-workers", Usage: "without streaming: workers that store the dump while CRIU writes it (0: half the CPUs; -1: store only after the dump)"},
		},
		Action: checkpointAction,
	})
}

// checkpointLabels name the steps of a checkpoint in its output and status line.
var checkpointLabels = map[string]string{
	shimstep.StepAlign: "align", shimstep.StepQuiesce: "quiesce", shimstep.StepDetach: "detach", shimstep.StepResume: "resume", checkpoint.StepLock: "lock",
	checkpoint.StepCheckpoint: "device->host", checkpoint.StepDump: "criu dump", checkpoint.StepRestore: "driver restore",
	checkpoint.StepUnlock: "unlock", checkpoint.StepStore: "store", checkpoint.StepFinish: "stop processes",
}

func checkpointAction(c *cli.Context) error {
	if err := argsExactly(c, 1); err != nil {
		return err
	}
	pid, err := parsePID(c.Args().First())
	if err != nil {
		return err
	}
	if c.IsSet("name") {
		if err := checkImageName("--name", c.String("name")); err != nil {
			return err
		}
	}
	lockTimeout, err := lockTimeoutFlag(c)
	if err != nil {
		return err
	}
	budget, err := preemptBudget(c)
	if err != nil {
		return err
	}
	stall, err := criuStall(c)
	if err != nil {
		return err
	}
	g := env(c)
	dry := c.Bool("dry-run")
	// The store is opened here rather than by NewEnv: a dry run must not create it, and a new
	// store is announced. NewEnv still refuses a non-root caller before anything is opened.
	e, closeEnv, err := op.NewEnvWith(c.Context, "", g.Log, op.EnvOptions{DeferGPU: true}) // opened for CUDA only
	defer closeEnv()
	if err != nil {
		return opError(g.Err, err)
	}
	e.CRIUStall = stall
	if !proc.Alive(pid) {
		return fmt.Errorf("checkpoint: %w: no running process with pid %d", errNoProcess, pid)
	}
	t := time.Now()
	st, err := checkpointStore(c, dry)
	if err != nil {
		return err
	}
	g.Log.Debug("opened the store", "took", time.Since(t))
	e.Store = st
	if name := c.String("name"); c.IsSet("name") {
		if m, err := st.Get(name); err == nil && m.Name == name {
			return exitcode.Refusedf("--name %q: an image of that name exists (id %.12s, made %s); pick another name or remove it with: %s",
				name, m.ID, m.Created.Format(time.RFC3339), hint(c, "image", "rm", name))
		}
	}
	carryLimit, err := parseSize(c.String("carry-limit"))
	if err != nil {
		return exitcode.Usagef("--carry-limit: %v", err)
	}
	opts := checkpoint.Options{
		PID: pid, Name: c.String("name"), NameSet: c.IsSet("name"), LeaveRunning: c.Bool("leave-running"),
		LockTimeout: lockTimeout, PreemptBudget: budget, TCPEstablished: c.Bool("tcp-established"),
		ShellJob: c.Bool("shell-job"), KeepStaging: c.Bool("keep-staging"),
		PrestageWorkers: c.Int("prestage-workers"), NoStream: c.Bool("no-stream"),
		CarryFiles: c.Bool("carry-files"), CarryLimit: carryLimit,
	}
	w := g.Out
	if dry {
		plan, err := checkpoint.PlanCheckpoint(c.Context, e, opts)
		if err != nil {
			return opError(g.Err, err)
		}
		printWarnings(g, plan.Warnings)
		return printPlan(c, plan, plan.Steps, func() {
			fmt.Fprintf(w, "plan for pid %d (dry run, nothing done): image %s, %s, estimated %s\n", plan.PID, esc(plan.Image), plan.Kind, ms(plan.Estimate.Duration))
			if _, absent := st.(absentStore); absent {
				fmt.Fprintf(w, "the store %s does not exist yet: the checkpoint will create it\n", esc(g.Store))
			}
			printTree(w, plan.Tree)
		})
	}
	plan, err := checkpoint.PlanCheckpoint(c.Context, e, opts)
	if err != nil {
		return opError(g.Err, err)
	}
	// The status line follows the run (the Env's hook and byte progress), not the plan.
	prog := newOpProgress(g.Err, fmt.Sprintf("checkpoint %d", pid), plan.Steps, checkpointLabels, plan.Estimate.Duration)
	defer prog.Done()
	if prog != nil {
		e.Progress = prog.Bytes()
		e.Hook = prog.Hook(e.Hook)
	}
	if plan.ShellJobReason != "" && !g.JSON {
		fmt.Fprintf(g.Err, "ptxmig: dumping as a shell job: %s\n", esc(plan.ShellJobReason))
	}
	printWarnings(g, plan.Warnings)
	res, err := checkpoint.Execute(c.Context, e, plan)
	prog.Done()
	if err != nil {
		return opError(g.Err, err)
	}
	if g.JSON {
		return printJSON(c, res)
	}
	gpus := ""
	for _, gp := range res.GPUs {
		gpus += fmt.Sprintf(", GPU %d %s %s", gp.Index, esc(gp.Name), gp.UUID)
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
	fmt.Fprintf(w, "image %s (id %s)\n", esc(res.Image), shortID(res.ImageID))
	if res.Stream {
		fmt.Fprintln(w, "CRIU's images were streamed into the store (no staging copy)")
	} else {
		fmt.Fprintf(w, "CRIU's images were staged, then stored (not streamed: %s)\n", esc(res.StreamOff))
	}
	printPreemption(w, res.Preemption)
	for _, t := range res.Timings {
		fmt.Fprintf(w, "  %-15s %s\n", stepLabel(checkpointLabels, t.Step), ms(t.Duration))
	}
	fmt.Fprintf(w, "  %-15s %s\n", "total", ms(res.Total))
	s := res.Sizes
	fmt.Fprintf(w, "size: %s logical, %s stored (%s zero, %s deduplicated, %s written)\n",
		bytesize.Format(s.Logical), bytesize.Format(s.Stored), bytesize.Format(s.Zero),
		bytesize.Format(s.Dedup), bytesize.Format(s.Written))
	if res.LeftRunning {
		fmt.Fprintf(w, "pid %d keeps running\n", res.PID)
	} else {
		fmt.Fprintf(w, "pid %d was stopped; bring it back with: %s\n", res.PID, hint(c, "restore", res.Image))
	}
	if res.StagingDir != "" {
		fmt.Fprintf(w, "staging kept in %s\n", esc(res.StagingDir))
	}
	return nil
}

// checkpointStore opens the store a checkpoint writes: created when missing (and announced). A
// dry run creates nothing: a store that does not exist yet but could be made stands in as an
// empty one (absentStore); one that could not be made fails as the real run would.
func checkpointStore(c *cli.Context, dry bool) (op.ImageStore, error) {
	if !dry {
		return openStoreWrite(c)
	}
	dir := env(c).Store
	s, err := store.OpenWith(dir, store.OpenOptions{})
	switch {
	case err == nil && s.ReadOnly():
		return nil, exitcode.Refusedf("store %s is read-only: a checkpoint cannot write to it", esc(dir))
	case err == nil:
		return s, nil
	case !errors.Is(err, store.ErrNoStore):
		return nil, err
	}
	if err := store.CheckCreate(dir); err != nil {
		return nil, err
	}
	abs, _ := filepath.Abs(dir)
	return absentStore{dir: abs}, nil
}
