package main

import (
	"errors"
	"fmt"
	"text/tabwriter"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/gpu"
)

func init() {
	register(&cli.Command{
		Name:  "gpus",
		Usage: "list this host's GPUs with memory, utilization, power and their CUDA processes (NVML)",
		Description: "Reads every GPU through NVML: index, UUID, name, compute capability, memory used/total,\n" +
			"utilization, power draw, and the compute processes with their memory. Utilization and power\n" +
			"print as - when the GPU does not report them. Fails with \"no NVIDIA driver\" (exit 1) on hosts\n" +
			"without one; `ptxmig doctor` says what else the host lacks.\n\n" +
			"Examples:\n" +
			"   ptxmig gpus\n" +
			"   ptxmig gpus --json",
		Action: gpusAction,
	})
}

// openInventory is replaceable in tests.
var openInventory = func() (gpuInventory, error) { return gpu.Open() }

type gpuInventory interface {
	gpu.Lister
	Close() error
}

func gpusAction(c *cli.Context) error {
	if err := argsExactly(c, 0); err != nil {
		return err
	}
	inv, err := openInventory()
	if err != nil {
		if errors.Is(err, gpu.ErrNoDriver) {
			return exitcode.Wrap(exitcode.Failed, err)
		}
		return err
	}
	defer inv.Close()
	devs, err := inv.Devices()
	if err != nil {
		return err
	}
	if env(c).JSON {
		if devs == nil {
			devs = []gpu.Device{}
		}
		return printJSON(c, devs)
	}
	tw := tabwriter.NewWriter(env(c).Out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "GPU\tNAME\tCC\tUUID\tMEMORY\tUTIL\tPOWER\tPROCESSES")
	for _, d := range devs {
		procs := "-"
		if len(d.Processes) > 0 {
			procs = ""
			for i, p := range d.Processes {
				if i > 0 {
					procs += " "
				}
				procs += fmt.Sprintf("%d(%s)", p.PID, bytesize.FormatU(p.UsedMemory))
			}
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s / %s\t%s\t%s\t%s\n", d.Index, esc(d.Name), esc(d.ComputeCap), esc(d.UUID),
			bytesize.FormatU(d.MemoryUsed), bytesize.FormatU(d.MemoryTotal),
			pct(d.Utilization), watts(d.PowerW), procs)
	}
	return tw.Flush()
}

func pct(v int) string {
	if v < 0 {
		return "-"
	}
	return fmt.Sprintf("%d%%", v)
}

func watts(v float64) string {
	if v < 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f W", v)
}
