package main

import (
	"fmt"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/placement"
	"github.com/ptxmig/ptxmig/restore"
)

func init() {
	register(&cli.Command{
		Name:      "restore",
		Usage:     "bring an image back as a running process tree, on the same or other GPUs",
		ArgsUsage: "IMAGE",
		Description: "IMAGE is an image name or id. Preflight: each checkpointed GPU must map to a present GPU of the\n" +
			"same chip type with enough free memory, and every pid of the recorded process tree must be free\n" +
			"(CRIU restores each process under its pid). --dry-run prints the plan and stops there. Then the\n" +
			"image is materialized (every chunk verified; a corrupt image is refused) → CRIU restore of the\n" +
			"tree (detached: it outlives ptxmig; a shell job joins ptxmig's session) → driver restore of its\n" +
			"CUDA processes with GPU pairs → unlock. A failure after CRIU restored the tree kills it again;\n" +
			"the image stays intact (exit status 4) and CRIU's log is kept in /var/log/ptxmig.\n\n" +
			"By default each GPU maps to the GPU with the same UUID, else (another host) the same index.\n" +
			"When a GPU moves, the driver needs a pair for every GPU of the source host (recorded at\n" +
			"checkpoint, whatever CUDA_VISIBLE_DEVICES was): the ones it did not use keep their GPU or take\n" +
			"the ones left free, so the host needs at least that many GPUs of the same chip.\n\n" +
			"Examples:\n" +
			"   ptxmig restore counter-4242-20261122-101500\n" +
			"   ptxmig restore --dry-run --gpu 1 trainer-step-900\n" +
			"   ptxmig restore --gpu 1 trainer-step-900\n" +
			"   ptxmig restore --gpu-map GPU-5e3a1c2b-0f9d-4e2a-8b7c-1234567890ab=1 trainer-step-900",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "gpu", Usage: "target GPU index per checkpointed GPU, in order: N[,M...]"},
			&cli.StringFlag{Name: "gpu-map", Usage: "explicit mapping OLD=NEW[,...] (GPU UUIDs or indexes)"},
			&cli.BoolFlag{Name: "keep-staging", Usage: "keep the materialized image and CRIU's log"},
			&cli.BoolFlag{Name: "dry-run", Usage: "print the plan after preflight; touch nothing"},
		},
		Action: restoreAction,
	})
}

func restoreAction(c *cli.Context) error {
	if err := argsExactly(c, 1); err != nil {
		return err
	}
	gpus, gmap, err := gpuTargets(c)
	if err != nil {
		return err
	}
	g := env(c)
	e, closeEnv, err := op.NewEnv(c.Context, g.Store, g.Log)
	defer closeEnv()
	if err != nil {
		return opError(g.Err, err)
	}
	plan, err := restore.PlanRestore(c.Context, e, restore.Options{Image: c.Args().First(), GPUs: gpus, GPUMap: gmap, KeepStaging: c.Bool("keep-staging")})
	if err != nil {
		return opError(g.Err, err)
	}
	w := g.Out
	if c.Bool("dry-run") {
		return printPlan(c, plan, plan.Steps, func() {
			fmt.Fprintf(w, "plan for image %s (dry run, nothing done): pid %d, %s\n", plan.Image, plan.PID, plan.Kind)
			printTree(w, plan.Tree)
			printPairs(w, plan.Pairs, plan.Remapped)
		})
	}
	res, err := restore.Execute(c.Context, e, plan)
	if err != nil {
		return opError(g.Err, err)
	}
	if g.JSON {
		return printJSON(c, res)
	}
	fmt.Fprintf(w, "restored image %s as pid %d (%s)\n", res.Image, res.PID, res.Kind)
	if len(res.Tree) > 1 {
		printTree(w, res.Tree)
	}
	printPairs(w, res.Pairs, res.Remapped)
	printPreemption(w, res.Preemption)
	fmt.Fprintf(w, "  %-15s %s (%s)\n", "materialize", ms(res.Materialize), bytesize.Format(res.Bytes))
	labels := map[string]string{restore.StepCRIURestore: "criu restore", restore.StepDriverRestore: "host->device", restore.StepUnlock: "unlock", op.StepResume: "resume"}
	for _, t := range res.Timings {
		fmt.Fprintf(w, "  %-15s %s\n", labels[t.Step], ms(t.Duration))
	}
	fmt.Fprintf(w, "  %-15s %s\n", "total", ms(res.Total))
	if res.StagingDir != "" {
		fmt.Fprintf(w, "staging kept in %s\n", res.StagingDir)
	}
	return nil
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
