package main

import (
	"fmt"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/placement"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/restore"
)

func init() {
	register(&cli.Command{
		Name:      "restore",
		Usage:     "bring an image back as a running process tree, on the same or other GPUs",
		ArgsUsage: "IMAGE",
		Description: "IMAGE is an image name, id or unique id prefix (none: exit 6; ambiguous: exit 2). The store is\n" +
			"only read: a missing store is an error (never created) and a read-only store works. Preflight:\n" +
			"each checkpointed GPU must map to a present GPU of the same compute capability (another model\n" +
			"only where that change was measured, H100 <-> H200, or with --allow-model-change; the output\n" +
			"says when the model changes) with enough free memory,\n" +
			"and every pid of the recorded process tree must be free (CRIU restores each process under its\n" +
			"pid). --dry-run prints the plan and stops there. Then CRIU restores the tree (detached: it\n" +
			"outlives ptxmig; a shell job joins ptxmig's session), reading the image straight out of the\n" +
			"store through its image-streamer socket: the image's metadata files are verified first (a\n" +
			"corrupt one is refused, exit 3), its memory pages chunk by chunk as CRIU reads them (a corrupt\n" +
			"chunk stops CRIU before the processes run; the error names the file and offset), and whatever\n" +
			"CRIU did not read after it. --no-stream (or --keep-staging) materializes the whole image into\n" +
			"the staging directory first instead. Then the driver restores its CUDA processes with GPU\n" +
			"pairs and unlocks them. On a terminal, a status line on stderr shows the step, bytes read\n" +
			"with throughput, and an ETA. A failure after CRIU restored the tree kills it again; the image\n" +
			"stays intact (exit status 4) and CRIU's log is kept in /var/log/ptxmig.\n\n" +
			"Preflight also checks every file the processes had open or mapped (executable, libraries,\n" +
			"logs) as CRIU will: present, with the size, mode and ELF build-ID CRIU recorded (a rebuild\n" +
			"of the same program has another build-ID). What is missing or\n" +
			"different is named with its fix and refused (exit 3) before anything is touched, unless the\n" +
			"image carries a copy (checkpoint --carry-files): a missing one is then put in place (its\n" +
			"directory created), a different one only with --overwrite-files (moved aside, not deleted);\n" +
			"a failed restore removes what it put in place. Another driver, CUDA or CRIU version than the\n" +
			"image's is a warning. A TCP port the processes listened on must be free: one another socket\n" +
			"listens on is refused (exit 3); connections still closing on it (TIME_WAIT: up to 60 s after\n" +
			"they closed), which would make CRIU's bind fail, are ended first. On another host: checkpoint → image export\n" +
			"→ image import → restore.\n\n" +
			"By default each GPU maps to the GPU with the same UUID, else (another host) the same index.\n" +
			"When a GPU moves, the driver needs a pair for every GPU of the source host (recorded at\n" +
			"checkpoint, whatever CUDA_VISIBLE_DEVICES was): the ones it did not use keep their GPU or take\n" +
			"the ones left free, so the host needs at least that many GPUs of the same chip family.\n\n" +
			"Each process goes back to the cgroup (v2) it had at checkpoint when that exists here, else\n" +
			"where the tree's root goes: its own recorded cgroup, else /ptxmig (created when missing),\n" +
			"never ptxmig's own. --cgroup puts the whole tree into one cgroup instead, named as\n" +
			"/proc/PID/cgroup shows it; it must exist, else the restore is refused (exit 3).\n\n" +
			"Examples:\n" +
			"   ptxmig restore counter-4242-20261122-101500\n" +
			"   ptxmig restore --dry-run --gpu 1 trainer-step-900\n" +
			"   ptxmig restore trainer-step-900 --gpu 1\n" +
			"   ptxmig restore --gpu-map GPU-5e3a1c2b-0f9d-4e2a-8b7c-1234567890ab=1 trainer-step-900\n" +
			"   ptxmig restore --cgroup /system.slice/trainer.service trainer-step-900\n" +
			"   ptxmig --store /mnt/shared/ptxmig restore trainer-step-900\n" +
			"   ptxmig image export job-7 | ssh gpu2 ptxmig image import && ssh gpu2 ptxmig restore job-7",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "gpu", Usage: "target GPU index per checkpointed GPU, in order: `N[,M...]`"},
			&cli.StringFlag{Name: "gpu-map", Usage: "explicit mapping `OLD=NEW[,...]` (GPU UUIDs or indexes)"},
			allowModelChangeFlag(),
			&cli.StringFlag{Name: "cgroup", Usage: "put the whole tree into the existing cgroup v2 `PATH` (default: where each process was)"},
			&cli.BoolFlag{Name: "keep-staging", Usage: "keep the materialized image and CRIU's log (implies --no-stream)"},
			&cli.BoolFlag{Name: "overwrite-files", Usage: "let a file the image carries (checkpoint --carry-files) replace a different one at its path; the one there is moved aside, not deleted"},
			criuStallFlag(),
			&cli.BoolFlag{Name: "no-stream", Usage: "materialize the image into the staging directory before CRIU reads it, instead of streaming it"},
			&cli.BoolFlag{Name: "dry-run", Usage: "print the plan after preflight; touch nothing"},
		},
		Action: restoreAction,
	})
}

// restoreLabels name the steps of a restore in its output and status line.
var restoreLabels = map[string]string{restore.StepMaterialize: "materialize", restore.StepCRIURestore: "criu restore",
	restore.StepPlaceFiles:    "place files",
	restore.StepDriverRestore: "host->device", restore.StepUnlock: "unlock", shimstep.StepResume: "resume"}

func restoreAction(c *cli.Context) error {
	if err := argsExactly(c, 1); err != nil {
		return err
	}
	gpus, gmap, err := gpuTargets(c)
	if err != nil {
		return err
	}
	if cg := c.String("cgroup"); cg != "" {
		if err := proc.ValidCgroupPath(cg); err != nil {
			return exitcode.Usagef("--cgroup: %v", err)
		}
	}
	stall, err := criuStall(c)
	if err != nil {
		return err
	}
	g := env(c)
	e, closeEnv, err := op.NewEnvWith(c.Context, "", g.Log, op.EnvOptions{DeferGPU: true}) // opened for CUDA only
	defer closeEnv()
	if err != nil {
		return opError(g.Err, err)
	}
	e.CRIUStall = stall
	st, err := openStoreRead(c) // restore only reads the store: never created, read-only is fine
	if err != nil {
		return err
	}
	e.Store = st
	ref := c.Args().First()
	opts := restore.Options{Image: ref, GPUs: gpus, GPUMap: gmap, KeepStaging: c.Bool("keep-staging"), Cgroup: c.String("cgroup"),
		NoStream: c.Bool("no-stream"), OverwriteFiles: c.Bool("overwrite-files"), AllowModelChange: c.Bool("allow-model-change")}
	plan, err := restore.PlanRestore(c.Context, e, opts)
	if err != nil {
		return opError(g.Err, err)
	}
	printWarnings(g, plan.Warnings)
	w := g.Out
	if c.Bool("dry-run") {
		return printPlan(c, plan, plan.Steps, func() {
			fmt.Fprintf(w, "plan for image %s (dry run, nothing done): pid %d, %s\n", esc(plan.Image), plan.PID, plan.Kind)
			printTree(w, plan.Tree)
			printPairs(w, plan.Pairs, plan.Remapped)
		})
	}
	// The status line follows the run (the Env's hook and byte progress), not the plan.
	prog := newOpProgress(g.Err, "restore "+esc(plan.Image), plan.Steps, restoreLabels, 0)
	defer prog.Done()
	if prog != nil {
		e.Progress = prog.Bytes()
		e.Hook = prog.Hook(e.Hook)
		prog.Phase(restore.StepMaterialize) // Execute materializes before its first hooked step
	}
	res, err := restore.Execute(c.Context, e, plan)
	prog.Done()
	if err != nil {
		return opError(g.Err, err)
	}
	if g.JSON {
		return printJSON(c, res)
	}
	fmt.Fprintf(w, "restored image %s as pid %d (%s)\n", esc(res.Image), res.PID, res.Kind)
	if len(res.Tree) > 1 {
		printTree(w, res.Tree)
	}
	printPairs(w, res.Pairs, res.Remapped)
	for _, pl := range res.Placed {
		how := "it was missing"
		if pl.Replace {
			how = "the different file there was moved aside to " + esc(pl.Path) + ".ptxmig-replaced-*"
		}
		fmt.Fprintf(w, "put the carried %s (%s) in place: %s\n", esc(pl.Path), bytesize.Format(pl.Size), how)
	}
	if res.ClosingEnded > 0 {
		fmt.Fprintf(w, "ended %d closing connection(s) on the image's listening ports, so that CRIU could bind them\n", res.ClosingEnded)
	}
	printPreemption(w, res.Preemption)
	if res.Stream {
		fmt.Fprintf(w, "image streamed to CRIU out of the store (%s; metadata verified in %s)\n", bytesize.Format(res.Bytes), ms(res.Materialize))
	} else {
		fmt.Fprintf(w, "  %-15s %s (%s; not streamed: %s)\n", "materialize", ms(res.Materialize), bytesize.Format(res.Bytes), esc(res.StreamOff))
	}
	for _, t := range res.Timings {
		fmt.Fprintf(w, "  %-15s %s\n", stepLabel(restoreLabels, t.Step), ms(t.Duration))
	}
	fmt.Fprintf(w, "  %-15s %s\n", "total", ms(res.Total))
	if res.StagingDir != "" {
		fmt.Fprintf(w, "staging kept in %s\n", esc(res.StagingDir))
	}
	return nil
}

// allowModelChangeFlag is restore's and migrate's --allow-model-change.
func allowModelChangeFlag() cli.Flag {
	return &cli.BoolFlag{Name: "allow-model-change", Usage: "try a GPU of another model with the same compute capability although that change was not measured (the driver may refuse: then the operation rolls back)"}
}

// gpuTargets parses --gpu and --gpu-map, shared by restore and migrate.
func gpuTargets(c *cli.Context) ([]int, map[string]string, error) {
	gpus, err := placement.ParseGPUList(c.String("gpu"))
	if err != nil {
		return nil, nil, exitcode.Usagef("--gpu: %v", err)
	}
	gmap, err := placement.ParseGPUMap(c.String("gpu-map"))
	if err != nil {
		return nil, nil, exitcode.Usagef("--gpu-map: %v", err)
	}
	return gpus, gmap, nil
}
