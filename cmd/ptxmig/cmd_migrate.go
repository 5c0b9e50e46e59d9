package main

import (
	"fmt"
	"io"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/placement"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/migrate"
)

func init() {
	register(&cli.Command{
		Name:      "migrate",
		Usage:     "move a live CUDA process, or a whole job, to other GPUs of this host, in place (no image)",
		ArgsUsage: "PID",
		Description: "Quiesce (a process under the ptxmig shim: preemptible kernels stop between blocks within\n" +
			"--preempt-budget) → driver lock → checkpoint (GPU memory to host memory) → restore with GPU pairs\n" +
			"onto the targets → unlock → resume (preempted kernels relaunched on the target). The process\n" +
			"keeps its pid, memory addresses and handles; CUDA device ordinals inside it stay the same while\n" +
			"the physical GPU changes. Preflight checks the targets (same chip family, enough\n" +
			"free memory) and refuses (exit 3) a process under the shim that shares GPU memory with\n" +
			"another process (CUDA IPC, VMM shareable handles, memory pools: NCCL's default transports;\n" +
			"driver 580 cannot restore it); peer access between its GPUs is turned off for the move and\n" +
			"on again after (refused when the targets have no peer path, or when it holds a cudaMalloc\n" +
			"allocation over 256 MiB, which driver 580 cannot give peer access back to); a warning names other\n" +
			"processes on the targets (a context the driver restored has been killed by Xid 109 beside\n" +
			"another process's long kernels).\n" +
			"The driver needs a pair for every GPU of the host, whatever CUDA_VISIBLE_DEVICES\n" +
			"the process has (driver 580): the GPUs it uses go where --gpu/--gpu-map say, the others keep\n" +
			"their GPU or take the ones left free (moving 0 to 1 on two GPUs pairs 0->1 and 1->0); --dry-run\n" +
			"lists the pairs. If anything fails after the lock, or ptxmig gets SIGINT/SIGTERM, the process is\n" +
			"restored onto its source GPUs, unlocked and resumed (exit status 4), also when it was on its\n" +
			"targets already. If ptxmig itself dies, its guardian does the same (the journal keeps the\n" +
			"GPU pairs, so it can move back what the driver had restored onto the targets).\n" +
			"Owned memory (a process started with `ptxmig run --owned-memory`): after the quiesce its shim\n" +
			"copies that memory into the process's own host memory and releases it, so the driver's\n" +
			"checkpoint and restore move only the rest; on the target the shim re-creates it at the same\n" +
			"addresses and copies it back. The bytes never leave the process: if ptxmig dies, the shim puts\n" +
			"them back before the process runs again. While the process still runs, that host memory is\n" +
			"made ready and the memory pre-copied in rounds (each copies the 4 MiB chunks whose GPU hash\n" +
			"changed since the round before, while that set shrinks), so the stop copies only what changed\n" +
			"since the last round (--precopy=false: the stop copies it all). By default ptxmig also\n" +
			"allocates memory of that size on the target GPU while the process runs; in the stop the\n" +
			"shim copies the memory there device to device (NVLink or PCIe peer path; its mapping is\n" +
			"dropped before the driver checkpoints) and on the target copies it back from there instead\n" +
			"of from host memory; ptxmig frees it after. Without room for it on the target (its size\n" +
			"beside the process, plus 1 GiB), for a process on several GPUs, or with\n" +
			"--device-copy=false, the memory goes through the host stash only; the stash is always made.\n" +
			"--rehearse goes through the whole move with the process's own GPUs as targets: it proves the\n" +
			"process can be moved and measures the downtime, on a host with one GPU too.\n" +
			"Prints the downtime (gate closed to gate open) and its parts; on a terminal, a status line on\n" +
			"stderr shows the step as it runs. No process PID: exit 6. Migrate uses no image store.\n" +
			"A job moves whole: PID may be the root of a tree with several CUDA processes (a launcher and\n" +
			"its ranks, e.g. mp.spawn), and then every CUDA process of the tree moves in one\n" +
			"transaction with the same GPU map (--gpu-map 0=1,1=0 swaps two ranks' GPUs; --gpu lists one\n" +
			"target per GPU the job uses). Ranks under the shim that launch NCCL collectives are first\n" +
			"stopped right after the same collective; if anything fails, every rank goes back to its\n" +
			"source GPU. Jobs on NCCL's default transports are refused: start them with `ptxmig run\n" +
			"--nccl-sockets`.\n\n" +
			"Examples:\n" +
			"   ptxmig migrate --gpu 1 4242\n" +
			"   ptxmig migrate --dry-run --gpu 1 4242\n" +
			"   ptxmig migrate --rehearse 4242              # there and back onto its own GPU\n" +
			"   ptxmig migrate 4242 --gpu-map 0=1 --lock-timeout 30s\n" +
			"   ptxmig migrate --gpu-map 0=1,1=0 4242    # a 2-rank job started by pid 4242: ranks swapped",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "gpu", Usage: "target GPU index per GPU the process uses, in order: `N[,M...]`"},
			&cli.StringFlag{Name: "gpu-map", Usage: "explicit mapping `OLD=NEW[,...]` (GPU UUIDs or indexes)"},
			allowModelChangeFlag(),
			&cli.BoolFlag{Name: "dry-run", Usage: "print the plan after preflight; touch nothing"},
			&cli.BoolFlag{Name: "precopy", Value: true, Usage: "pre-copy owned memory while the process runs (on by default; --precopy=false: all of it in the stop)"},
			&cli.BoolFlag{Name: "device-copy", Value: true, Usage: "copy owned memory to the target GPU device to device as well (on by default; --device-copy=false: through host memory only)"},
			&cli.BoolFlag{Name: "rehearse", Usage: "move the process onto its own GPUs (no target): proves it can move, measures the downtime"},
			&cli.DurationFlag{Name: "lock-timeout", Value: 10 * time.Second, Usage: "how long the driver lock may wait for running kernels (0: forever)"},
			preemptBudgetFlag(),
		},
		Action: migrateAction,
	})
}

// migrateLabels name the steps of a migration in its status line.
var migrateLabels = map[string]string{shimstep.StepPrepareStash: "pre-copy owned memory", shimstep.StepQuiesce: "quiesce",
	shimstep.StepStashMemory: "stash owned memory",
	migrate.StepLock:         "lock", migrate.StepCheckpoint: "device->host", migrate.StepRestore: "host->device", migrate.StepUnlock: "unlock",
	shimstep.StepUnstashMemory: "unstash owned memory", shimstep.StepResume: "resume"}

func migrateAction(c *cli.Context) error {
	if err := argsExactly(c, 1); err != nil {
		return err
	}
	pid, err := parsePID(c.Args().First())
	if err != nil {
		return err
	}
	gpus, gmap, err := gpuTargets(c)
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
	e, closeEnv, err := op.NewEnv(c.Context, "", g.Log)
	defer closeEnv()
	if err != nil {
		return opError(g.Err, err)
	}
	if !proc.Alive(pid) {
		return fmt.Errorf("migrate: %w: no running process with pid %d", errNoProcess, pid)
	}
	plan, err := migrate.PlanMigrate(c.Context, e, migrate.Options{PID: pid, GPUs: gpus, GPUMap: gmap, LockTimeout: lockTimeout, PreemptBudget: budget,
		AllowModelChange: c.Bool("allow-model-change"), Rehearse: c.Bool("rehearse"), NoPrecopy: !c.Bool("precopy"),
		NoDeviceCopy: !c.Bool("device-copy")})
	if err != nil {
		return opError(g.Err, err)
	}
	printWarnings(g, plan.Warnings)
	w := g.Out
	if c.Bool("dry-run") {
		return printPlan(c, plan, plan.Steps, func() {
			fmt.Fprintf(w, "plan for pid %d (dry run, nothing done):\n", plan.PID)
			printPairs(w, plan.Pairs, true)
		})
	}
	prog := newOpProgress(g.Err, fmt.Sprintf("migrate %d", pid), plan.Steps, migrateLabels, 0)
	defer prog.Done()
	e.Hook = prog.Hook(e.Hook)
	res, err := migrate.Execute(c.Context, e, plan)
	prog.Done()
	if err != nil {
		return opError(g.Err, err)
	}
	if g.JSON {
		return printJSON(c, res)
	}
	who := fmt.Sprintf("pid %d", res.PID)
	if len(res.PIDs) > 1 || len(res.PIDs) == 1 && res.PIDs[0] != res.PID {
		who = fmt.Sprintf("job %d (pid %s)", res.PID, op.PIDText(res.PIDs))
	}
	verb := "migrated"
	if res.Rehearsal {
		verb = "rehearsed the migrate of"
	}
	for i := range res.Source {
		fmt.Fprintf(w, "%s %s: GPU %d %s -> GPU %d %s\n", verb, who, res.Source[i].Index, res.Source[i].UUID, res.Target[i].Index, res.Target[i].UUID)
	}
	printPairs(w, res.Pairs, !res.Rehearsal)
	printPreemption(w, res.Preemption)
	if res.Stash > 0 {
		fmt.Fprintf(w, "  %-15s %s\n", "stash", ms(res.Stash))
	}
	fmt.Fprintf(w, "  %-15s %s\n", "lock", ms(res.Lock))
	fmt.Fprintf(w, "  %-15s %s\n", "device->host", ms(res.Checkpoint))
	fmt.Fprintf(w, "  %-15s %s\n", "host->device", ms(res.Restore))
	fmt.Fprintf(w, "  %-15s %s\n", "unlock", ms(res.Unlock))
	if res.Unstash > 0 {
		fmt.Fprintf(w, "  %-15s %s\n", "unstash", ms(res.Unstash))
	}
	fmt.Fprintf(w, "  %-15s %s\n", "downtime", ms(res.Downtime))
	return nil
}

// printPairs lists GPU pairs, one a line; remapped says whether the driver got them.
func printPairs(w io.Writer, pairs []placement.Pair, remapped bool) {
	if len(pairs) == 0 {
		return
	}
	if remapped {
		fmt.Fprintf(w, "GPU pairs given to the driver (one per GPU of the host):\n")
	} else {
		fmt.Fprintf(w, "GPUs (unmoved; the driver got no pairs):\n")
	}
	for _, p := range pairs {
		fmt.Fprintf(w, "  %s\n", esc(p.String()))
	}
}
