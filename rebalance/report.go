package rebalance

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ptxmig/ptxmig/internal/bytesize"
)

// WriteText writes the human form of a report.
func WriteText(w io.Writer, rep *Report) error {
	var b strings.Builder
	obs := rep.Observation
	mode := ""
	if rep.DryRun {
		mode = " (dry run)"
	}
	fmt.Fprintf(&b, "rebalance%s at %s: %d GPU(s), %d CUDA process(es), sampled over %s\n",
		mode, rep.Start.UTC().Format(time.RFC3339), len(obs.GPUs), len(obs.Procs), obs.Window)
	for _, wmsg := range rep.Warnings {
		fmt.Fprintf(&b, "warning: %s\n", wmsg)
	}
	if len(obs.GPUs) > 0 {
		tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "GPU\tCHIP\tUTIL\tMEMORY USED/TOTAL\tPOWER\tPROCS")
		procs := map[string]int{}
		for _, p := range obs.Procs {
			for _, u := range p.GPUs {
				procs[u]++
			}
		}
		for _, g := range obs.GPUs {
			power := fmt.Sprintf("%.0f W", g.PowerW)
			if g.PowerLimitW > 0 {
				power = fmt.Sprintf("%.0f/%.0f W", g.PowerW, g.PowerLimitW)
			}
			fmt.Fprintf(tw, "%d\t%s\t%.0f%%\t%s/%s\t%s\t%d\n", g.Index, g.Chip(), g.Util*100,
				bytesize.FormatU(g.MemUsed), bytesize.FormatU(g.MemTotal), power, procs[g.UUID])
		}
		tw.Flush()
	}
	if len(rep.Plan.Decisions) > 0 {
		b.WriteString("processes:\n")
		byPID := map[int]Process{}
		for _, p := range obs.Procs {
			byPID[p.PID] = p
		}
		for _, d := range sortedDecisions(rep.Plan.Decisions) {
			verb := "stays"
			if d.Move {
				verb = "moves"
			}
			gpuStr := "GPU ?"
			if d.GPU >= 0 {
				gpuStr = fmt.Sprintf("GPU %d", d.GPU)
			}
			shim := ""
			if byPID[d.PID].UnderShim {
				shim = ", shim"
			}
			fmt.Fprintf(&b, "  pid %d (%s) on %s, %.0f%% of it, %d MiB%s: %s: %s\n",
				d.PID, d.Comm, gpuStr, d.Util*100, d.MemMiB, shim, verb, d.Reason)
		}
	}
	for _, r := range rep.Results {
		if r.OK {
			fmt.Fprintf(&b, "moved pid %d from GPU %d to GPU %d in %.1fs (verified on GPU %d)\n",
				r.Move.PID, r.Move.From.Index, r.Move.To.Index, r.Seconds, r.Move.To.Index)
		} else {
			fmt.Fprintf(&b, "FAILED to move pid %d from GPU %d to GPU %d after %.1fs: %s\n",
				r.Move.PID, r.Move.From.Index, r.Move.To.Index, r.Seconds, r.Error)
		}
	}
	switch {
	case rep.DryRun && len(rep.Plan.Moves) > 0:
		fmt.Fprintf(&b, "dry run: %d move(s) planned, nothing moved\n", len(rep.Plan.Moves))
	case rep.DryRun:
		b.WriteString("dry run: no move planned, nothing moved\n")
	case len(rep.Plan.Moves) == 0 && rep.Error == "":
		b.WriteString("no move needed\n")
	default:
		fmt.Fprintf(&b, "%d move(s) planned, %d done, %d failed\n", len(rep.Plan.Moves), rep.Moved, rep.Failed)
	}
	if rep.Error != "" {
		fmt.Fprintf(&b, "error: %s\n", rep.Error)
	}
	_, err := io.WriteString(w, b.String())
	return err
}
