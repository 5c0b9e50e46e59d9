package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/atomicfile"
	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/ptxas"
	"github.com/ptxmig/ptxmig/ptxstate"
)

func init() {
	register(&cli.Command{
		Name:  "ptx",
		Usage: "analyse PTX kernels and add preemptible persistent-thread twins",
		Description: "PTX is parsed as nvcc emits it (ISA up to 9.0). For every eligible .entry K, `instrument`\n" +
			"keeps K unchanged and adds K__ptxmig, which takes one more .param .u64: a control block\n" +
			"(docs/PTXSTATE.md). Launched on fewer CTAs than K's grid, its CTAs claim K's blocks one by\n" +
			"one and stop claiming when the block's preempt flag is set; relaunching with the same\n" +
			"control block runs every remaining block exactly once. Kernels that cannot be made safe\n" +
			"(grid sync, clusters, spin-waits, early exits before barriers…) keep only their original\n" +
			"and get a stated reason. FILE and OUT may be - for stdin and stdout.\n\n" +
			"Examples:\n" +
			"   ptxmig ptx analyze kernels.ptx\n" +
			"   ptxmig ptx instrument -o kernels.twins.ptx kernels.ptx",
		Subcommands: []*cli.Command{
			{
				Name:      "analyze",
				Usage:     "report, per kernel, eligibility, barrier sites, live registers and shared memory",
				ArgsUsage: "FILE",
				Description: "Reads FILE (- for stdin) and reports every .entry: eligible for a twin or the reasons it is\n" +
					"refused, barrier sites with the registers live across them, shared and local memory, calls\n" +
					"and warp collectives. Names from the PTX print with control characters escaped.\n\n" +
					"Examples:\n" +
					"   ptxmig ptx analyze kernels.ptx\n" +
					"   ptxmig ptx analyze kernels.ptx --json\n" +
					"   cuobjdump -ptx ./app | ptxmig ptx analyze -",
				Action: ptxAnalyzeAction,
			},
			{
				Name:      "instrument",
				Usage:     "write FILE plus a preemptible twin of every eligible kernel to OUT",
				ArgsUsage: "FILE",
				Description: "OUT (-o, required) is written atomically and may be FILE itself; - writes to stdout. Kernels\n" +
					"left without a twin are logged at --log-level info, or listed by --report (on stderr when OUT\n" +
					"is -). With --json the report is the command's JSON document (on stderr when OUT is -).\n\n" +
					"With --match-registers ARCH (e.g. sm_90), ptxas (found as for `ptxmig doctor`: $PTXAS, PATH,\n" +
					"$CUDA_HOME/bin, /usr/local/cuda/bin) assembles FILE for ARCH first, and each twin gets the\n" +
					"largest .maxnreg that fits as many CTAs per SM as its original does; without\n" +
					"a usable ptxas the twins are written without it and the report says why (the shim passes\n" +
					"the GPU's ARCH when it runs ptxmig as its helper).\n\n" +
					"With --cubin as well, ptxas assembles the instrumented module for that ARCH and OUT is the\n" +
					"cubin (the driver loads it without compiling PTX at every start); when that cannot be done\n" +
					"(no ptxas, a PTX ISA newer than it, a failure) OUT is the PTX and the report says why.\n\n" +
					"With --mid-block, a kernel with eligible mid-block sites (see `ptx analyze`) gets a twin that\n" +
					"can also stop inside a block at those sites, saving its registers and shared memory, and\n" +
					"resume there (control block version 3, docs/PTXSTATE.md); the report gives each such\n" +
					"kernel's record layout (the shim launches them with `ptxmig run --mid-block`; ptxstate/gputest\n" +
					"drives them itself). With --mid-block-twins instead, every twin stays block-granular and a\n" +
					"kernel with such sites gets a second, mid-block twin K_mid__ptxmig, so that the shim can\n" +
					"choose per launch (what `ptxmig run` asks for by default).\n\n" +
					"Examples:\n" +
					"   ptxmig ptx instrument -o kernels.twins.ptx kernels.ptx\n" +
					"   ptxmig ptx instrument --match-registers sm_90 -o kernels.twins.ptx kernels.ptx\n" +
					"   ptxmig ptx instrument --match-registers sm_90 --cubin -o kernels.twins.cubin kernels.ptx\n" +
					"   ptxmig ptx instrument --report -o - kernels.ptx > out.ptx\n" +
					"   ptxmig ptx instrument --mid-block --report -o kernels.mid.ptx kernels.ptx",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "output", Aliases: []string{"o"}, Usage: "output PTX `FILE`, or - for stdout (required)"},
					&cli.BoolFlag{Name: "report", Usage: "also print the per-kernel report (to stderr when OUT is -)"},
					&cli.StringFlag{Name: "match-registers", Usage: "cap each twin's registers so that it fits as many CTAs per SM as its original, as ptxas assembles FILE for `ARCH` (sm_XX)"},
					&cli.BoolFlag{Name: "cubin", Usage: "write the instrumented module assembled by ptxas for the --match-registers ARCH (a cubin) instead of PTX, where ptxas can"},
					&cli.BoolFlag{Name: "mid-block", Usage: "give kernels with eligible mid-block sites twins that can also stop and resume inside a block"},
					&cli.BoolFlag{Name: "mid-block-twins", Usage: "keep the twins block-granular and give kernels with eligible mid-block sites a second, mid-block twin (K_mid__ptxmig)"},
				},
				Action: ptxInstrumentAction,
			},
		},
	})
}

// readPTX reads FILE or stdin ("-") and parses it.
func readPTX(c *cli.Context, name string) (*ptxstate.Module, error) {
	var data []byte
	var err error
	if name == "-" {
		data, err = io.ReadAll(c.App.Reader)
	} else {
		data, err = os.ReadFile(name)
	}
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, exitcode.Usagef("read %s: %v", esc(name), err)
		}
		return nil, fmt.Errorf("read %s: %w", esc(name), err)
	}
	var m *ptxstate.Module
	if err := interruptible(c, func() (err error) { m, err = ptxstate.Parse(data); return err }); err != nil {
		return nil, fmt.Errorf("parse %s: %w", name, err)
	}
	return m, nil
}

// interruptible runs f (pure CPU work on untrusted input) and returns early when the command's
// context is cancelled (SIGINT/SIGTERM): the work is abandoned and ptxmig exits.
func interruptible(c *cli.Context, f func() error) error {
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		return err
	case <-c.Context.Done():
		return c.Context.Err()
	}
}

func ptxAnalyzeAction(c *cli.Context) error {
	if err := argsExactly(c, 1); err != nil {
		return err
	}
	m, err := readPTX(c, c.Args().First())
	if err != nil {
		return err
	}
	var r *ptxstate.Report
	err = interruptible(c, func() (err error) { r, err = ptxstate.Analyze(m); return err })
	if err != nil {
		return fmt.Errorf("analyze %s: %w", c.Args().First(), err)
	}
	if env(c).JSON {
		return printJSON(c, r)
	}
	return writeReport(env(c).Out, r, true)
}

func ptxInstrumentAction(c *cli.Context) error {
	if err := argsExactly(c, 1); err != nil {
		return err
	}
	in, outName := c.Args().First(), c.String("output")
	if outName == "" {
		return exitcode.Usagef("ptx instrument: -o OUT is required (a file, or - for stdout)")
	}
	if c.Bool("cubin") && c.String("match-registers") == "" {
		return exitcode.Usagef("ptx instrument: --cubin needs --match-registers ARCH (the architecture to assemble for)")
	}
	if c.Bool("mid-block") && c.Bool("mid-block-twins") {
		return exitcode.Usagef("ptx instrument: --mid-block and --mid-block-twins exclude each other")
	}
	if outName == "-" {
		// stdout carries the PTX: the --json document, the error's too, goes to stderr.
		env(c).jsonOut = env(c).Err
	}
	m, err := readPTX(c, in)
	if err != nil {
		return err
	}
	start := time.Now() // the shim's helper timeout counts from here: matchRegisters runs ptxas too
	opts, note := matchRegisters(c, m)
	opts.MidBlock = c.Bool("mid-block")
	opts.MidBlockTwins = c.Bool("mid-block-twins")
	var out *ptxstate.Module
	var r *ptxstate.Report
	err = interruptible(c, func() (err error) { out, r, err = ptxstate.InstrumentWith(m, opts); return err })
	if err != nil {
		return fmt.Errorf("instrument %s: %w", in, err)
	}
	data := out.Bytes()
	if c.Bool("cubin") {
		var cubinNote string
		data, cubinNote = assembleCubin(c, data, m)
		if cubinNote != "" && hasMidTwins(r) && ptxasUsable(c) && time.Since(start) < midTwinsRetryBefore {
			// Both kinds of twins doubled the module past what ptxas is run on (or ptxas failed
			// on it): the driver would JIT-compile it at every load (reduction, a cuda-sample,
			// 3.9 MB of PTX: 10 MB with both, +1.1 s a start). Block twins alone, assembled, beat
			// mid-block twins compiled at every start. If that fails too, the first output stands.
			opts.MidBlockTwins = false
			var out2 *ptxstate.Module
			var r2 *ptxstate.Report
			if err := interruptible(c, func() (err error) { out2, r2, err = ptxstate.InstrumentWith(m, opts); return err }); err != nil {
				cubinNote += fmt.Sprintf("; without mid-block twins: instrument: %v", err)
			} else if data2, note2 := assembleCubin(c, out2.Bytes(), m); note2 == "" {
				data, r = data2, r2
				cubinNote = "no mid-block twins: " + cubinNote + "; block twins only, assembled"
			} else {
				cubinNote += "; without mid-block twins: " + note2
			}
		}
		if cubinNote != "" {
			env(c).Log.Warn(cubinNote)
			r.Notes = append(r.Notes, cubinNote)
		}
	}
	if outName == "-" {
		if _, err := env(c).Out.Write(data); err != nil {
			return fmt.Errorf("write stdout: %w", err)
		}
	} else if err := atomicfile.WriteFile(outName, data, 0o644); err != nil {
		// Written next to OUT and renamed into place: a failed write never leaves a truncated
		// file (and OUT may be the input file).
		return err
	}
	w := env(c).Out
	if outName == "-" {
		w = env(c).Err
	}
	if note != "" {
		env(c).Log.Warn(note)
		r.Notes = append(r.Notes, note)
	}
	if env(c).JSON {
		return writeJSON(w, r)
	}
	if !c.Bool("report") {
		for _, k := range r.Kernels {
			if !k.Eligible {
				env(c).Log.Info("kernel left without a twin", "kernel", esc(k.Name), "reasons", escList(k.Refusals, "; "))
			}
		}
		return nil
	}
	return writeReport(w, r, false)
}

var archRE = regexp.MustCompile(`^sm_[0-9]{2,3}[af]?$`)

const maxMatchBytes = 8 << 20

// hasMidTwins: some kernel of the report got a second, mid-block twin.
func hasMidTwins(r *ptxstate.Report) bool {
	for _, k := range r.Kernels {
		if k.MidTwin != "" {
			return true
		}
	}
	return false
}

// ptxasUsable: ptxas is found and --match-registers names an architecture, so that a failure to
// assemble was ptxas's own (or the size limit's), which a smaller module may not meet.
func ptxasUsable(c *cli.Context) bool {
	_, err := ptxas.Find()
	return err == nil && archRE.MatchString(c.String("match-registers"))
}

// midTwinsRetryBefore bounds when, counted from the start of `ptx instrument` (ptxas -v included),
// the helper still tries a module without mid-block twins after ptxas could not assemble it with
// them: the shim waits for its helper 60 s, and the retry's ptxas may take up to 30 s.
const midTwinsRetryBefore = 25 * time.Second

// matchRegisters runs ptxas -v on the module for --match-registers ARCH and returns the twins'
// register caps, or a note saying why there are none (the instrumentation goes on without them).
func matchRegisters(c *cli.Context, m *ptxstate.Module) (ptxstate.Options, string) {
	if c.String("match-registers") == "" {
		return ptxstate.Options{}, ""
	}
	src := m.Bytes()
	var regs map[string]int
	arch, note := runPTXAS(c, m, src, "registers not matched", func(ctx context.Context, bin, arch string) (err error) {
		regs, err = ptxas.Registers(ctx, bin, src, arch)
		return err
	})
	if note != "" {
		return ptxstate.Options{}, note
	}
	caps := make(map[string]int, len(regs))
	for k, n := range regs {
		caps[k] = ptxas.SameOccupancyRegs(n, arch)
	}
	return ptxstate.Options{MaxNReg: caps}, ""
}

// assembleCubin assembles the instrumented PTX for the --match-registers architecture and returns
// the cubin, or the PTX unchanged and a note saying why not.
func assembleCubin(c *cli.Context, ptx []byte, m *ptxstate.Module) ([]byte, string) {
	var cubin []byte
	_, note := runPTXAS(c, m, ptx, "PTX written, not a cubin", func(ctx context.Context, bin, arch string) (err error) {
		cubin, err = ptxas.Assemble(ctx, bin, ptx, arch)
		if err == nil && (len(cubin) < 4 || string(cubin[:4]) != "\x7fELF") {
			err = errors.New("ptxas wrote no ELF file")
		}
		return err
	})
	if note != "" {
		return ptx, note
	}
	return cubin, ""
}

// runPTXAS runs f with ptxas (found as for `ptxmig doctor`) and the --match-registers
// architecture (its "a"/"f" variant where the module targets one: such PTX assembles only as
// that), bounded in input size and time; on any failure it returns a note starting with what.
func runPTXAS(c *cli.Context, m *ptxstate.Module, src []byte, what string, f func(ctx context.Context, bin, arch string) error) (string, string) {
	arch := c.String("match-registers")
	if !archRE.MatchString(arch) {
		return "", fmt.Sprintf("%s: --match-registers %s is not an sm_XX architecture", what, esc(arch))
	}
	for _, t := range m.Target {
		if strings.HasPrefix(t, arch) && archRE.MatchString(t) {
			arch = t
		}
	}
	bin, err := ptxas.Find()
	if err != nil {
		return "", fmt.Sprintf("%s: %v", what, err)
	}
	// The shim waits for its helper 60 s by default: ptxas on a very large module would outlast
	// that and cost the module all its twins, so such modules are left to the driver.
	if len(src) > maxMatchBytes {
		return "", fmt.Sprintf("%s: %d MiB of PTX is over the %d MiB ptxas is run on", what, len(src)>>20, maxMatchBytes>>20)
	}
	ctx, cancel := context.WithTimeout(c.Context, 30*time.Second)
	defer cancel()
	if err := f(ctx, bin, arch); err != nil {
		first, _, _ := strings.Cut(strings.TrimSpace(err.Error()), "\n")
		return "", fmt.Sprintf("%s: %s", what, esc(first))
	}
	return arch, ""
}

// writeReport prints the human form of a report; detail adds barrier sites and live registers.
func writeReport(w io.Writer, r *ptxstate.Report, detail bool) error {
	var b strings.Builder
	fmt.Fprintf(&b, "PTX %s, target %s: %d kernel(s)\n", esc(r.Version), escList(r.Target, ","), len(r.Kernels))
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "note: %s\n", esc(n))
	}
	for _, k := range r.Kernels {
		b.WriteString("\n")
		if k.Eligible && k.TwinMaxNReg > 0 {
			fmt.Fprintf(&b, "%s (line %d): eligible, twin %s (.maxnreg %d: as many CTAs per SM as its original)\n", esc(k.Name), k.Line, esc(k.Twin), k.TwinMaxNReg)
		} else if k.Eligible {
			fmt.Fprintf(&b, "%s (line %d): eligible, twin %s\n", esc(k.Name), k.Line, esc(k.Twin))
		} else {
			fmt.Fprintf(&b, "%s (line %d): refused\n", esc(k.Name), k.Line)
			for _, why := range k.Refusals {
				fmt.Fprintf(&b, "  - %s\n", esc(why))
			}
		}
		if l := k.MidBlock; l != nil {
			dyn := ""
			if l.DynamicShared {
				dyn = " + the dynamic shared memory"
			}
			which := "mid-block twin"
			if k.MidTwin != "" {
				which = "second twin " + esc(k.MidTwin) + ", mid-block"
			}
			thread := ""
			if l.ThreadStops {
				thread = "; each thread stops by itself (the last slot is its status)"
			}
			fmt.Fprintf(&b, "  %s (control block v3): %d site(s); record = 64 + (8 x %d + %d) x threads + %d%s bytes%s\n",
				which, l.Sites, l.Slots, l.LocalBytes, l.StaticSharedBytes, dyn, thread)
		}
		for _, n := range k.Notes {
			fmt.Fprintf(&b, "  note: %s\n", esc(n))
		}
		if !detail {
			continue
		}
		dyn := ""
		if k.DynamicShared {
			dyn = " + dynamic"
		}
		fmt.Fprintf(&b, "  shared memory: %d bytes static%s; local: %d bytes/thread\n", k.SharedStaticBytes, dyn, k.LocalBytes)
		sr := escList(k.SpecialRegs, " ")
		if sr == "" {
			sr = "none"
		}
		fmt.Fprintf(&b, "  special registers: %s\n", sr)
		if len(k.Calls) > 0 {
			fmt.Fprintf(&b, "  calls: %s\n", escList(k.Calls, " "))
		}
		fmt.Fprintf(&b, "  warp collectives: %d; basic blocks: %d; registers: %d\n", k.WarpCollectives, k.Blocks, k.Registers)
		fmt.Fprintf(&b, "  barrier sites: %d\n", len(k.Barriers))
		for _, s := range k.Barriers {
			u := "uniformly reached"
			if !s.Uniform {
				u = "divergently reached"
			}
			fmt.Fprintf(&b, "    line %d %s (%s): %d live register(s), %d bytes/thread: %s\n", s.Line, esc(s.Op), u, len(s.Live), s.LiveBytes, escList(s.Live, " "))
		}
		eligible := 0
		for _, m := range k.MidBlockSites {
			if m.Eligible {
				eligible++
			}
		}
		fmt.Fprintf(&b, "  mid-block safe points: %d of %d candidate site(s) usable (twins stop at them with ptx instrument --mid-block)\n", eligible, len(k.MidBlockSites))
		for _, m := range k.MidBlockSites {
			verdict := "usable"
			if !m.Eligible {
				verdict = "refused: " + escList(m.Refusals, "; ")
			}
			poll := ""
			switch {
			case m.PollEvery > 0 && m.Kind == "thread-loop":
				poll = fmt.Sprintf(", each thread polls every %d visits", m.PollEvery)
			case m.PollEvery > 0:
				poll = fmt.Sprintf(", a vote every %d visits", m.PollEvery)
			}
			if len(m.Rebased) > 0 {
				poll += ", rebased: " + escList(m.Rebased, " ")
			}
			fmt.Fprintf(&b, "    line %d %s %s, %d bytes/thread to save%s: %s\n", m.Line, m.Kind, esc(m.Op), m.LiveBytes, poll, verdict)
		}
		if k.SaveBytesPerCTA != nil {
			fmt.Fprintf(&b, "  save area estimate: %d bytes/thread, %d bytes/CTA\n", k.SaveBytesPerThread, *k.SaveBytesPerCTA)
		} else {
			fmt.Fprintf(&b, "  save area estimate: %d bytes/thread (+%d bytes shared per CTA; block size not declared)\n", k.SaveBytesPerThread, k.SharedStaticBytes)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}
