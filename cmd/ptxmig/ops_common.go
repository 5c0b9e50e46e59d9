package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/internal/shimctl"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/store"
)

// Helpers shared by checkpoint, restore, migrate and rebalance.

// printPlan prints a --dry-run plan: with --json one document {"dry_run": true, "plan": …};
// else head() then the numbered steps.
func printPlan(c *cli.Context, plan any, steps []op.PlanStep, head func()) error {
	if env(c).JSON {
		return printJSON(c, map[string]any{"dry_run": true, "plan": plan})
	}
	head()
	for i, s := range steps {
		fmt.Fprintf(env(c).Out, "  %d. %-14s %s\n", i+1, s.Step, escLines(s.Action))
	}
	return nil
}

// printTree lists a process tree, one process a line, indented by depth.
// printWarnings writes a plan's warnings to stderr (with --json they are in the document).
func printWarnings(g *globals, warnings []string) {
	if g.JSON {
		return
	}
	for _, wn := range warnings {
		fmt.Fprintf(g.Err, "ptxmig: warning: %s\n", esc(wn))
	}
}

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
		fmt.Fprintf(w, "  %s%d %s%s\n", strings.Repeat("  ", d), p.PID, esc(p.Comm), cuda)
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
	return &cli.DurationFlag{Name: "preempt-budget", Value: shimstep.DefaultPreemptBudget,
		Usage: "processes under the shim: how long (`DURATION`) to wait for preemptible kernels to stop before the driver lock"}
}

// preemptBudget reads --preempt-budget (1 ms to 60 s).
func preemptBudget(c *cli.Context) (time.Duration, error) {
	d := c.Duration("preempt-budget")
	if d < time.Millisecond || d > time.Minute {
		return 0, exitcode.Usagef("--preempt-budget %s: want 1ms to 1m", d)
	}
	return d, nil
}

// criuStallFlag is --criu-stall, shared by checkpoint and restore.
func criuStallFlag() cli.Flag {
	return &cli.DurationFlag{Name: "criu-stall", Value: criu.DefaultStall,
		Usage: "end CRIU and roll back when its dump or restore makes no progress (log, CPU time, bytes streamed) for `DURATION` (1s to 24h; 0: never)"}
}

// criuStall reads --criu-stall as op.Env's CRIUStall (where < 0 is no bound).
func criuStall(c *cli.Context) (time.Duration, error) {
	d := c.Duration("criu-stall")
	switch {
	case d == 0:
		return -1, nil
	case d < time.Second || d > journal.MaxCRIUStall:
		return 0, exitcode.Usagef("--criu-stall %s: want 1s to 24h, or 0 for no bound", d)
	}
	return d, nil
}

// printPreemption reports, per process under the shim, what the quiesce stopped and what it
// left to the driver lock, and the resume. Processes without the shim print nothing.
func printPreemption(w io.Writer, reports []*shimstep.PreemptReport) {
	for _, r := range reports {
		if !r.Shim {
			continue
		}
		if r.Note != "" {
			fmt.Fprintf(w, "pid %d: %s\n", r.PID, esc(r.Note))
		}
		if q := r.Quiesce; q != nil {
			fmt.Fprintf(w, "pid %d: quiesced in %s (%d preempted, %d drained, %d left to the lock)\n", r.PID,
				usText(q.ElapsedUS), len(q.Preempted), len(q.Drained), len(q.NotStopped)+len(q.Originals))
			for _, k := range q.Preempted {
				where := "between blocks"
				if k.MidBlockStop() {
					where = fmt.Sprintf("mid-block (%d CTAs saved)", k.Records)
				}
				fmt.Fprintf(w, "  preempted %s %s: %d of %d blocks done\n", esc(k.Kernel), where, k.BlocksDone, k.BlocksTotal)
			}
			for _, k := range append(append([]shimctl.LaunchNote(nil), q.NotStopped...), q.Originals...) {
				fmt.Fprintf(w, "  not preempted %s: %s\n", esc(k.Kernel), esc(k.Reason))
			}
		}
		if m := r.Owned; m != nil {
			printOwned(w, r.PID, m)
		}
		if res := r.Resume; res != nil {
			fmt.Fprintf(w, "pid %d: resumed (%d relaunched) in %s\n", r.PID, res.Relaunched, usText(res.ElapsedUS))
		}
	}
}

// printOwned prints what happened to the device memory a process's shim owns.
func printOwned(w io.Writer, pid int, m *shimstep.OwnedMemory) {
	if m.Note != "" {
		fmt.Fprintf(w, "pid %d: owned device memory %s\n", pid, esc(m.Note))
	}
	if s := m.Save; s != nil {
		prev := ""
		if s.Prev != "" {
			prev = fmt.Sprintf(", %s unchanged since image %s", bytesize.Format(int64(s.SkippedBytes)), esc(s.Prev))
		}
		fmt.Fprintf(w, "pid %d: owned device memory %s in %d regions: copied %s in %s (%s/s)%s; released %v\n", pid,
			bytesize.Format(int64(s.OwnedBytes)), s.Regions, bytesize.Format(int64(s.CopiedBytes)), ms(s.Copy),
			bytesize.Format(int64(s.Throughput())), prev, m.Released)
	}
	if l := m.Load; l != nil {
		rate := 0.0
		if l.Copy > 0 {
			rate = float64(l.Bytes) / l.Copy.Seconds()
		}
		fmt.Fprintf(w, "pid %d: owned device memory %s loaded in %s (%s/s)\n", pid, bytesize.Format(int64(l.Bytes)), ms(l.Copy), bytesize.Format(int64(rate)))
	}
	if x := m.Prepare; x != nil && x.Bytes > 0 {
		fmt.Fprintf(w, "pid %d: stash of %s prepared while it ran (populate %s, pin %s)\n", pid, bytesize.Format(int64(x.Bytes)), usText(x.PopulateUS), usText(x.PinUS))
	}
	for _, x := range m.Precopy {
		fmt.Fprintf(w, "pid %d: pre-copy round %d while it ran: %d of %d chunks changed, %s copied in %s (GPU hash %s, stash hash %s)\n",
			pid, x.Round, x.Copied, x.Chunks, bytesize.Format(int64(x.Bytes)), usText(x.CopyUS), usText(x.HashUS), usText(x.StashHashUS))
	}
	if x := m.Stash; x != nil {
		copied := x.Bytes
		if x.Precopied {
			copied = x.CopiedBytes
		}
		fmt.Fprintf(w, "pid %d: owned device memory %s in %d regions stashed in its host memory in %s (copied %s in %s, %s/s; GPU hash %s; map and pin %s; unpin %s; release %s)\n",
			pid, bytesize.Format(int64(x.Bytes)), x.Regions, usText(x.ElapsedUS), bytesize.Format(int64(copied)), usText(x.CopyUS), rateText(copied, x.CopyUS),
			usText(x.HashUS), usText(x.PopulateUS+x.PinUS), usText(x.UnpinUS), usText(x.ReleaseUS))
	}
	if t := m.Target; t != nil {
		fmt.Fprintf(w, "pid %d: %s kept on GPU %d for a device-to-device copy (allocated while it ran in %s)\n", pid,
			bytesize.Format(int64(t.Bytes)), t.GPU, usText(t.KeepUS))
	}
	if m.TargetNote != "" {
		fmt.Fprintf(w, "pid %d: %s\n", pid, esc(m.TargetNote))
	}
	if x := m.Stash; x != nil && x.Target != nil {
		if x.Target.Filled {
			fmt.Fprintf(w, "pid %d: owned device memory copied to the target GPU device to device: %s in %s (%s/s; import and map %s)\n", pid,
				bytesize.Format(int64(x.Target.Bytes)), usText(x.Target.CopyUS), rateText(x.Target.Bytes, x.Target.CopyUS), usText(x.Target.MapUS))
		} else {
			fmt.Fprintf(w, "pid %d: no device-to-device copy: %s\n", pid, esc(x.Target.Error))
		}
	}
	if x := m.Unstash; x != nil {
		from := "its host memory"
		if x.From == "target" {
			from = "the target GPU's copy, device to device"
		}
		fmt.Fprintf(w, "pid %d: owned device memory %s put back from %s in %s (re-create %s, copy %s, %s/s; pin %s)\n",
			pid, bytesize.Format(int64(x.Bytes)), from, usText(x.ElapsedUS), usText(x.RemapUS), usText(x.CopyUS), rateText(x.Bytes, x.CopyUS), usText(x.PinUS))
		if x.TargetError != "" {
			fmt.Fprintf(w, "pid %d: the target GPU's copy was not used: %s\n", pid, esc(x.TargetError))
		}
	}
}

// rateText is bytes per us microseconds, per second.
func rateText(bytes uint64, us int64) string {
	if us <= 0 {
		return "-"
	}
	return bytesize.Format(int64(float64(bytes) / (float64(us) / 1e6)))
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
			fmt.Fprintf(stderr, "ptxmig: last lines of CRIU's log:\n  %s\n", escList(f.CRIUTail, "\n  "))
		}
		if f.LogDir != "" {
			fmt.Fprintf(stderr, "ptxmig: logs kept in %s\n", f.LogDir)
		}
	}
	return withOpExitCode(err)
}

// withOpExitCode attaches the exit status of a checkpoint/restore/migrate failure: refused by
// preflight 3, busy 5, failed and rolled back 4, interrupted by a signal before touching
// anything 130, anything else 1.
func withOpExitCode(err error) error {
	var se *op.StepError
	switch {
	case errors.Is(err, op.ErrRefused):
		return exitcode.Wrap(exitcode.Refused, err)
	case errors.Is(err, oplock.ErrBusy):
		return exitcode.Wrap(exitcode.Busy, err)
	case errors.As(err, &se) && se.RolledBack():
		return exitcode.Wrap(exitcode.RolledBack, err)
	case errors.As(err, &se) && se.Cancelled && !se.Touched && !se.Committed:
		// A signal ended the operation before it touched anything (the step it stopped failed
		// for that reason: CRIU's pipes closed under it).
		return exitcode.Wrap(exitcode.Interrupted, err)
	}
	return exitcode.Wrap(exitcode.Failed, err)
}

// stepLabel is a step's label, or its name when it has none.
func stepLabel(labels map[string]string, step string) string {
	if l, ok := labels[step]; ok {
		return l
	}
	return step
}

// idLike matches names that would read as an image id prefix (checkpoint's own rule).
var idLike = regexp.MustCompile(`^[0-9a-f]{4,64}$`)

// checkImageName is the usage check (exit 2) of an image name given on the command line.
func checkImageName(flag, name string) error {
	if name == "" {
		return exitcode.Usagef("%s is empty: give a name, or leave %s out for the default", flag, flag)
	}
	if err := store.ValidateName(name); err != nil {
		return exitcode.Usagef("%s: %w", flag, err)
	}
	if idLike.MatchString(name) {
		return exitcode.Usagef("%s %q: a name of 4 to 64 hex digits could be read as an image id; add a letter outside a-f", flag, name)
	}
	return nil
}

// absentStore stands in, in a dry run, for a store that the checkpoint would create: it holds no
// image, and its Dir is the nearest existing directory (for the free-space check).
type absentStore struct{ dir string }

func (a absentStore) Put(context.Context, string, store.PutOptions) (*store.Manifest, *store.Stats, error) {
	return nil, nil, fmt.Errorf("store %s: %w", a.dir, store.ErrNoStore)
}

func (a absentStore) Prestage(context.Context, string, store.PutOptions) (*store.Prestage, error) {
	return nil, fmt.Errorf("store %s: %w", a.dir, store.ErrNoStore)
}

func (a absentStore) Get(ref string) (*store.Manifest, error) {
	return nil, fmt.Errorf("%w: %s", store.ErrNotFound, ref)
}

func (a absentStore) Materialize(context.Context, string, string, store.GetOptions) (*store.Stats, error) {
	return nil, fmt.Errorf("store %s: %w", a.dir, store.ErrNoStore)
}

func (a absentStore) NewIngest(context.Context, store.PutOptions) (*store.Ingest, error) {
	return nil, fmt.Errorf("store %s: %w", a.dir, store.ErrNoStore)
}

func (a absentStore) OpenImage(context.Context, string, store.GetOptions) (*store.ImageReader, error) {
	return nil, fmt.Errorf("store %s: %w", a.dir, store.ErrNoStore)
}

func (a absentStore) List() ([]*store.Manifest, error) {
	return nil, fmt.Errorf("store %s: %w", a.dir, store.ErrNoStore)
}

func (a absentStore) CheckChunkFiles(context.Context, *store.Manifest) error {
	return fmt.Errorf("store %s: %w", a.dir, store.ErrNoStore)
}

func (a absentStore) Dir() string {
	d := a.dir
	for {
		if fi, err := os.Stat(d); err == nil && fi.IsDir() {
			return d
		}
		p := filepath.Dir(d)
		if p == d {
			return d
		}
		d = p
	}
}
