package main

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimctl"
)

func init() {
	register(&cli.Command{
		Name:      "kernels",
		Usage:     "list the kernels a process under the shim launched: counts, shapes, sampled GPU time",
		ArgsUsage: "PID",
		Description: "Reads the shim's control socket of PID (started with `ptxmig run`). Times are GPU times of\n" +
			"sampled launches (the first PTXMIG_SAMPLE_FIRST of each kernel, then 1 in PTXMIG_SAMPLE_EVERY),\n" +
			"measured with CUDA events. Kernels launched through several handles (modules, contexts) are\n" +
			"listed once per handle. When the app runs with PTXMIG_SELF_TIME=1, the last line gives the time\n" +
			"the shim's own bookkeeping added per launch. Kernel names and reasons come from the process\n" +
			"and print with control characters escaped. A process without a control socket is refused\n" +
			"(exit 3).\n\n" +
			"Examples:\n" +
			"   ptxmig kernels 4242\n" +
			"   ptxmig kernels 4242 --json\n" +
			"   ptxmig kernels --socket-dir /tmp/ptxmig 4242",
		Flags:  []cli.Flag{socketDirFlag()},
		Action: kernelsAction,
	})
}

// shimPID parses the PID argument of the shim commands.
func shimPID(c *cli.Context) (int, error) {
	if err := argsExactly(c, 1); err != nil {
		return 0, err
	}
	pid, err := strconv.Atoi(c.Args().First())
	if err != nil || pid <= 0 {
		return 0, exitcode.Usagef("%s: PID %q: want a positive number", c.Command.Name, c.Args().First())
	}
	return pid, nil
}

// dialShim connects to pid's control socket; a process without one is a refusal.
func dialShim(c *cli.Context, pid int) (*shimctl.Client, context.Context, context.CancelFunc, error) {
	if !proc.Alive(pid) {
		return nil, nil, nil, fmt.Errorf("%w: no running process with pid %d", errNoProcess, pid)
	}
	ctx, cancel := context.WithTimeout(c.Context, 2*time.Minute)
	cl, err := shimctl.DialPID(ctx, c.String("socket-dir"), pid)
	if err != nil {
		cancel()
		return nil, nil, nil, exitcode.Wrap(exitcode.Refused, fmt.Errorf("pid %d: %w (is it running under `ptxmig run` and using CUDA?)", pid, err))
	}
	return cl, ctx, cancel, nil
}

func kernelsAction(c *cli.Context) error {
	pid, err := shimPID(c)
	if err != nil {
		return err
	}
	cl, ctx, cancel, err := dialShim(c, pid)
	if err != nil {
		return err
	}
	defer cancel()
	defer cl.Close()
	k, err := cl.Kernels(ctx)
	if err != nil {
		return fmt.Errorf("pid %d: %w", pid, err)
	}
	sort.SliceStable(k.Kernels, func(i, j int) bool { return k.Kernels[i].Launches > k.Kernels[j].Launches })
	if env(c).JSON {
		return printJSON(c, k)
	}
	w := tabwriter.NewWriter(env(c).Out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "LAUNCHES\tTIMED\tP50_US\tP99_US\tSHAPE (GRID/BLOCK)\tMODULE\tTWIN\tNAME")
	for _, x := range k.Kernels {
		name := "?"
		if x.Name != nil {
			name = esc(*x.Name)
		}
		p50, p99 := "-", "-"
		if x.Time != nil {
			p50, p99 = fmt.Sprintf("%.1f", x.Time.P50), fmt.Sprintf("%.1f", x.Time.P99)
		}
		twin := "no"
		if x.Twin {
			twin = fmt.Sprintf("yes (%d)", x.TwinLaunches)
			switch {
			case x.MidTwin && x.MidBlock != nil:
				twin = fmt.Sprintf("yes (%d; %d mid-block)", x.TwinLaunches, x.MidBlock.Launches)
			case x.MidTwin:
				twin = fmt.Sprintf("yes (%d; + mid-block)", x.TwinLaunches)
			case x.MidBlock != nil:
				twin = fmt.Sprintf("mid-block (%d)", x.TwinLaunches)
			}
		}
		fmt.Fprintf(w, "%d\t%d\t%s\t%s\t%s\t%d\t%s\t%s\n", x.Launches, x.Timed, p50, p99, shapeSummary(x), x.Module, twin, name)
	}
	for _, g := range k.Graphs {
		fmt.Fprintf(w, "%d\t-\t-\t-\t-\t-\t-\tgraph exec %s\n", g.Launches, esc(fmt.Sprint(g.Exec)))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(env(c).Out, "%d kernels, %d launches\n", len(k.Kernels), k.TotalLaunches)
	for _, x := range k.Kernels {
		if !x.Twin && x.TwinReason != "" {
			name := "?"
			if x.Name != nil {
				name = esc(*x.Name)
			}
			fmt.Fprintf(env(c).Out, "no twin: %s: %s\n", name, esc(x.TwinReason))
		}
		if x.Twin && x.OriginalReason != "" && x.Launches > x.TwinLaunches {
			name := "?"
			if x.Name != nil {
				name = esc(*x.Name)
			}
			fmt.Fprintf(env(c).Out, "ran as the original: %s: %d of %d launches, the last because: %s\n", name,
				x.Launches-x.TwinLaunches, x.Launches, esc(x.OriginalReason))
		}
	}
	if st := k.SelfTime; st != nil && st.Enabled && st.Launches > 0 {
		fmt.Fprintf(env(c).Out, "shim bookkeeping: %.0f ns per launch (%d launches, %.3f ms in all; "+
			"includes 2 clock reads of %d ns each)\n", float64(st.Ns)/float64(st.Launches), st.Launches, float64(st.Ns)/1e6, st.ClockNs)
	}
	return nil
}

// shapeSummary shows the most frequent shape and how many others there were.
func shapeSummary(k shimctl.Kernel) string {
	if len(k.Shapes) == 0 {
		return "-"
	}
	best := k.Shapes[0]
	for _, s := range k.Shapes[1:] {
		if s.Launches > best.Launches {
			best = s
		}
	}
	dims := func(d [3]uint32) string {
		parts := []string{strconv.Itoa(int(d[0])), strconv.Itoa(int(d[1])), strconv.Itoa(int(d[2]))}
		return strings.Join(parts, "x")
	}
	s := dims(best.Grid) + "/" + dims(best.Block)
	if more := len(k.Shapes) - 1; more > 0 || k.OtherShapes > 0 {
		s += fmt.Sprintf(" (+%d)", more+int(min(k.OtherShapes, 1)))
	}
	return s
}
