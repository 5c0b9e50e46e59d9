package main

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
)

func init() {
	register(&cli.Command{
		Name:  "ps",
		Usage: "list CUDA processes on this host: GPUs, memory, checkpoint state, shim",
		Description: "Finds every process that maps libcuda.so (so checkpointed processes, which hold no GPU, show\n" +
			"too), with the GPUs and memory NVML reports for it, its checkpoint state from the driver\n" +
			"(running, locked, checkpointed, failed; \"-\" when the driver does not track it) and whether it\n" +
			"runs under the ptxmig shim (libptxmig.so mapped, i.e. started with `ptxmig run`; \"owned N\":\n" +
			"started with --owned-memory, its shim serves N of the memory from its own mappings). PPID and\n" +
			"SESSION place it in its process tree: `ptxmig checkpoint` saves the tree below the pid it is\n" +
			"given, so checkpoint a job's session leader (or its wrapper's pid) to save the whole job.\n" +
			"CGROUP is its cgroup v2 path as /proc/PID/cgroup shows it (\"-\" on a host without cgroup v2):\n" +
			"`ptxmig restore` puts the process back there, or where --cgroup says.\n\n" +
			"Names, command lines and cgroups come from the processes and print with control characters\n" +
			"escaped.\n\n" +
			"Examples:\n" +
			"   ptxmig ps\n" +
			"   ptxmig ps --json",
		Action: psAction,
	})
}

// PSEntry is one row of `ptxmig ps`.
type PSEntry struct {
	PID     int      `json:"pid"`
	PPID    int      `json:"ppid"`
	Session int      `json:"sid"`
	Cgroup  string   `json:"cgroup"` // cgroup v2 path; "" without cgroup v2
	Comm    string   `json:"comm"`
	Cmdline []string `json:"cmdline"`
	GPUs    []psGPU  `json:"gpus"`
	State   string   `json:"state"`
	Shim    bool     `json:"shim"`
	// Owned: the device memory the shim serves from its own mappings (`ptxmig run
	// --owned-memory`), as its control socket says; absent without the shim or when it does not
	// answer.
	Owned *psOwned `json:"owned_memory,omitempty"`
}

type psOwned struct {
	Enabled  bool   `json:"enabled"`
	Bytes    uint64 `json:"bytes"`
	Regions  int    `json:"regions"`
	Released bool   `json:"released"`
	Stashed  bool   `json:"stashed"`
}

type psGPU struct {
	Index      int    `json:"index"`
	UUID       string `json:"uuid"`
	UsedMemory uint64 `json:"used_memory_bytes"`
}

// Probes, replaceable in tests.
var (
	scanProcs = func() ([]gpu.ProcInfo, error) { return gpu.ScanCUDAProcesses("/proc") }
	procState = func(pid int) (string, error) {
		d, err := cudackpt.Open()
		if err != nil {
			return "", err
		}
		st, err := d.State(pid)
		if err != nil {
			return "", err
		}
		return st.String(), nil
	}
	procCgroup = proc.Cgroup
	// shimOwned asks a process's shim for its owned memory (bounded: ps never waits on a shim).
	shimOwned = func(pid int) (*psOwned, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		c, err := op.DialShim(ctx, pid)
		if err != nil {
			return nil, err
		}
		defer c.Close()
		st, err := c.MemStatus(ctx)
		if err != nil {
			return nil, err
		}
		return &psOwned{Enabled: st.Enabled, Bytes: st.Bytes, Regions: st.Regions, Released: st.Released, Stashed: st.Stashed}, nil
	}
)

func psAction(c *cli.Context) error {
	if err := argsExactly(c, 0); err != nil {
		return err
	}
	procs, err := scanProcs()
	if err != nil {
		return err
	}
	var devs []gpu.Device
	if inv, err := openInventory(); err == nil {
		devs, err = inv.Devices()
		inv.Close()
		if err != nil {
			env(c).Log.Warn("NVML devices", "err", err)
		}
	} else {
		env(c).Log.Debug("no NVML", "err", err)
	}
	entries := buildPS(procs, devs, procState)
	if env(c).JSON {
		return printJSON(c, entries)
	}
	tw := tabwriter.NewWriter(env(c).Out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PID\tPPID\tSESSION\tSTATE\tSHIM\tGPU\tMEMORY\tCGROUP\tCOMMAND")
	for _, e := range entries {
		g, m := "-", "-"
		if len(e.GPUs) > 0 {
			var gs, ms []string
			for _, x := range e.GPUs {
				gs = append(gs, fmt.Sprint(x.Index))
				ms = append(ms, bytesize.FormatU(x.UsedMemory))
			}
			g, m = strings.Join(gs, ","), strings.Join(ms, ",")
		}
		shim := "no"
		if e.Shim {
			shim = "yes"
		}
		if o := e.Owned; o != nil && o.Enabled {
			shim = "owned " + bytesize.FormatU(o.Bytes)
		}
		cmd := escList(e.Cmdline, " ")
		if cmd == "" {
			cmd = "[" + esc(e.Comm) + "]"
		}
		if r := []rune(cmd); len(r) > 60 {
			cmd = string(r[:57]) + "..."
		}
		cg := "-"
		if e.Cgroup != "" {
			cg = esc(e.Cgroup)
		}
		fmt.Fprintf(tw, "%d\t%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\n", e.PID, e.PPID, e.Session, e.State, shim, g, m, cg, cmd)
	}
	return tw.Flush()
}

// buildPS joins the /proc scan with NVML's per-GPU processes (a process NVML sees that the scan
// missed, e.g. in another mount namespace, is listed too) and the driver's checkpoint state.
func buildPS(procs []gpu.ProcInfo, devs []gpu.Device, state func(int) (string, error)) []PSEntry {
	byPID := map[int]*PSEntry{}
	for _, p := range procs {
		byPID[p.PID] = &PSEntry{PID: p.PID, Comm: p.Comm, Cmdline: p.Cmdline, Shim: p.Shim}
	}
	for _, d := range devs {
		for _, p := range d.Processes {
			e := byPID[p.PID]
			if e == nil {
				e = &PSEntry{PID: p.PID, Comm: proc.Comm(p.PID), Cmdline: gpu.ReadCmdline("/proc", p.PID)}
				byPID[p.PID] = e
			}
			e.GPUs = append(e.GPUs, psGPU{Index: d.Index, UUID: d.UUID, UsedMemory: p.UsedMemory})
		}
	}
	out := make([]PSEntry, 0, len(byPID))
	for _, e := range byPID {
		if st, err := proc.ReadStat(e.PID); err == nil {
			e.PPID, e.Session = st.PPID, st.SID
		}
		e.Cgroup, _ = procCgroup(e.PID) // "" without cgroup v2, or once the process is gone
		e.State = "-"
		if s, err := state(e.PID); err == nil {
			e.State = s
		}
		if e.Cmdline == nil {
			e.Cmdline = []string{}
		}
		if e.GPUs == nil {
			e.GPUs = []psGPU{}
		}
		if e.Shim {
			e.Owned, _ = shimOwned(e.PID)
		}
		out = append(out, *e)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].PID < out[j].PID })
	return out
}
