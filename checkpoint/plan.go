// Package checkpoint saves a running process tree — the GPU state of its CUDA processes through
// the NVIDIA driver's checkpoint API, the processes themselves through CRIU — into the image
// store. Plan checks everything that can be checked without touching the processes and returns
// what would be done; Execute runs it as one transaction of the operation core (internal/op)
// that rolls back on any failure.
package checkpoint

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/placement"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/store"
)

// Options of one checkpoint.
type Options struct {
	PID            int
	Name           string        // image name; "" picks COMM-PID-YYYYMMDD-HHMMSS
	NameSet        bool          // Name was given explicitly (so "" is an error, not "pick one")
	LeaveRunning   bool          // the processes continue after the checkpoint
	LockTimeout    time.Duration // driver lock timeout (0: wait forever)
	PreemptBudget  time.Duration // how long a quiesce waits for preemptible kernels (0: shimstep.DefaultPreemptBudget)
	TCPEstablished bool
	ShellJob       bool   // force CRIU's shell-job mode (it is turned on by itself when needed)
	KeepStaging    bool   // keep the CRIU image directory after a successful store
	StagingRoot    string // where the staging directory goes; default: tmpfs when memory allows
	// PrestageWorkers store the dump's chunks while CRIU writes them (store.Prestage): 0 means
	// half the CPUs, a negative value stores only after the dump.
	PrestageWorkers int
	// NoStream makes CRIU write its images into the staging directory, stored after the dump,
	// instead of streaming them straight into the store.
	NoStream bool
	// CarryFiles takes the regular files the tree has open for writing (logs, state files) into
	// the image, up to CarryLimit bytes (default DefaultCarryLimit), for a restore on a host that
	// lacks them.
	CarryFiles bool
	CarryLimit int64
}

// Estimate is what a checkpoint is expected to move and how long it may take. The time assumes
// the driver's measured device-to-host rate and CRIU's dump rate (docs/BENCHMARKS.md); it is a
// guide for operators, not a promise.
type Estimate struct {
	HostBytes uint64        `json:"host_bytes"` // resident memory of the tree
	GPUBytes  uint64        `json:"gpu_bytes"`  // device memory of its CUDA processes
	Duration  time.Duration `json:"duration_ns"`
}

// Assumed rates of the estimate: driver 580 copies device memory out at ~1.7 GB/s; CRIU dumps
// ~1.1 GB/s into tmpfs (bench-cr.sh, H100 and H200, 2026-11).
const (
	rateDeviceToHost = 1.7e9
	rateDump         = 1.1e9
)

// Plan is a checked checkpoint: everything Execute will do, decided before anything is touched.
type Plan struct {
	PID            int             `json:"pid"`
	Image          string          `json:"image"`
	Kind           string          `json:"kind"`
	Tree           []op.TreeProc   `json:"tree"`
	CUDAPIDs       []int           `json:"cuda_pids,omitempty"`
	GPUs           []imagedesc.GPU `json:"gpus,omitempty"`
	Visible        []imagedesc.GPU `json:"visible_gpus,omitempty"`
	ShellJob       bool            `json:"shell_job"`
	ShellJobReason string          `json:"shell_job_reason,omitempty"` // why it was turned on by itself
	LeaveRunning   bool            `json:"left_running"`
	StagingRoot    string          `json:"staging_root"`
	// Stream: CRIU's image files go straight into the store as CRIU writes them (no staging
	// copy); otherwise StreamOff says why not.
	Stream    bool          `json:"stream"`
	StreamOff string        `json:"stream_off,omitempty"`
	Estimate  Estimate      `json:"estimate"`
	Steps     []op.PlanStep `json:"steps"`
	Warnings  []string      `json:"warnings,omitempty"` // what the operator should know; nothing refused

	opts Options
	meta imagedesc.Description // what the image records (the tree, host files and owned memory are added as the dump goes)
}

// PlanCheckpoint checks o against the world without touching any process or writing anything,
// and returns the plan. Every failure is a refusal (op.ErrRefused).
func PlanCheckpoint(ctx context.Context, env *op.Env, o Options) (*Plan, error) {
	if err := env.RequireRoot("ptxmig checkpoint"); err != nil {
		return nil, err
	}
	t0 := time.Now()
	self := os.Getpid()
	if o.PID <= 1 || o.PID == self {
		return nil, op.Refusef("pid %d cannot be checkpointed", o.PID)
	}
	if slices.Contains(proc.Ancestors(self), o.PID) {
		return nil, op.Refusef("pid %d is an ancestor of ptxmig itself (%s): checkpointing it would freeze ptxmig; "+
			"run ptxmig from outside that process tree", o.PID, proc.Comm(o.PID))
	}
	if !proc.Alive(o.PID) {
		return nil, op.Refusef("no running process with pid %d", o.PID)
	}
	if env.CRIU == nil {
		return nil, op.Refusef("CRIU is not usable: %v", env.CRIUErr)
	}
	if env.Store == nil {
		return nil, op.Refusef("no image store")
	}
	stats, err := proc.Tree(o.PID)
	if err != nil {
		return nil, op.Refusef("read the process tree of pid %d: %w", o.PID, err)
	}
	if i := slices.IndexFunc(stats, func(s proc.Stat) bool { return s.PID == self }); i >= 0 {
		return nil, op.Refusef("ptxmig itself runs inside the tree of pid %d", o.PID)
	}
	if i := slices.IndexFunc(stats, func(s proc.Stat) bool { return s.TTY != 0 }); i >= 0 {
		return nil, op.Refusef("pid %d (%s) has a controlling terminal: CRIU restores such a process only by handing it "+
			"the restoring process's own terminal, which ptxmig does not do, so its image could not be restored; "+
			"run the job without a terminal (setsid, nohup, a service manager or a batch system)", stats[i].PID, stats[i].Comm)
	}
	if i := slices.IndexFunc(stats, func(s proc.Stat) bool { return s.SID == 0 }); i >= 0 {
		// /proc shows session 0 when the session's leader lives outside this PID namespace (a
		// process started by `docker exec` or a CI runner without a terminal): CRIU refuses to
		// dump it ("A session leader … is outside of its pid namespace"), after the freeze.
		return nil, op.Refusef("pid %d (%s) belongs to a session whose leader is outside this PID namespace (session 0 here, "+
			"as for a process started by `docker exec`): CRIU cannot dump it; start the job as its own session "+
			"leader (setsid, a service manager or a batch system)", stats[i].PID, stats[i].Comm)
	}
	p := &Plan{PID: o.PID, LeaveRunning: o.LeaveRunning, opts: o}
	if p.Image, err = imageName(env.Store, o, stats[0].Comm, time.Now()); err != nil {
		return nil, err
	}
	cuda := map[int]bool{}
	kept := stats[:0]
	for _, s := range stats {
		is, err := env.DriverProcess(s.PID)
		if err != nil {
			if s.PID != o.PID && !proc.Alive(s.PID) {
				// A child that ended since the tree was read (a shell's short-lived command):
				// nothing of it is left to dump, and CRIU dumps the tree as it is when frozen.
				env.Logger().Debug("child ended during preflight", "pid", s.PID, "comm", s.Comm)
				continue
			}
			return nil, err
		}
		kept = append(kept, s)
		if is {
			cuda[s.PID] = true
			p.CUDAPIDs = append(p.CUDAPIDs, s.PID)
		}
	}
	stats = kept
	if err := refuseIOURing(stats); err != nil {
		return nil, err
	}
	if err := op.RefuseUnrestorable(ctx, p.CUDAPIDs); err != nil {
		return nil, err
	}
	p.Tree = op.TreeOf(stats, cuda)
	for i := range p.Tree {
		// Where each process belongs: a restore puts it back there (see restore's Plan.Cgroup).
		p.Tree[i].Cgroup, _ = proc.Cgroup(p.Tree[i].PID)
	}
	p.ShellJob = o.ShellJob
	if reason := ShellJobReason(stats); reason != "" && !o.ShellJob {
		p.ShellJob, p.ShellJobReason = true, reason
	}
	comm := stats[0].Comm
	p.Kind = op.KindCPU
	p.meta = imagedesc.Description{
		Kind: op.KindCPU, Host: env.Host.Host, Kernel: env.Host.Kernel, CRIU: env.CRIUVersion,
		PID: o.PID, Cmdline: proc.Cmdline("", o.PID), Comm: comm, Tree: p.Tree,
		ShellJob: p.ShellJob, Cgroup: p.Tree[0].Cgroup,
	}
	if es, err := proc.Cgroups(o.PID); err == nil {
		p.meta.CgroupV1 = imagedesc.CgroupsV1(es)
	}

	if o.TCPEstablished {
		p.meta.TCPEstablished = true
		p.meta.NetworkLock = env.CRIU.NetworkLock()
	}
	p.meta.LeftRunning = o.LeaveRunning
	if len(p.CUDAPIDs) > 0 {
		p.Kind, p.meta.Kind = op.KindCUDA, op.KindCUDA
		p.meta.Driver, p.meta.CUDA = env.Host.Driver, env.Host.CUDA
		if p.GPUs, p.Visible, err = env.TreeGPUs(p.CUDAPIDs); err != nil {
			return nil, op.Refusef("pid %d: find its GPUs: %w", o.PID, err)
		}
		p.meta.GPUs, p.meta.Visible = p.GPUs, p.Visible
		p.Warnings = append(p.Warnings, op.Unchecked(p.CUDAPIDs, len(p.GPUs) > 1)...)
		if o.LeaveRunning {
			p.Warnings = append(p.Warnings, sharedWarning(env, p.GPUs, p.Tree)...)
		}
		for _, g := range p.GPUs {
			p.Estimate.GPUBytes += g.MemoryBytes
		}
		if err := op.CheckHostMemory(p.Estimate.GPUBytes); err != nil {
			return nil, fmt.Errorf("pid %d: %w", o.PID, err)
		}
	}
	for _, s := range stats {
		p.Estimate.HostBytes += proc.RSS(s.PID)
	}
	total := p.Estimate.HostBytes + p.Estimate.GPUBytes
	p.Estimate.Duration = time.Duration((float64(p.Estimate.GPUBytes)/rateDeviceToHost + float64(total)/rateDump) * float64(time.Second))
	if err := checkWritable(env.Store.Dir(), total); err != nil {
		return nil, err
	}
	// Streamed, the staging directory holds only CRIU's log and statistics.
	need := total
	if p.StreamOff = streamOff(o); p.StreamOff == "" {
		need = op.StreamStagingBytes
	}
	if p.StagingRoot, err = op.ChooseStaging(o.StagingRoot, need, p.Estimate.GPUBytes); err != nil {
		return nil, err
	}
	p.Stream = p.StreamOff == ""
	p.Steps = p.describe()
	env.Logger().Debug("planned the checkpoint", "took", time.Since(t0), "cuda", len(p.CUDAPIDs), "processes", len(p.Tree))
	return p, nil
}

// streamOff says why options rule out streaming the dump ("" when they do not).
func streamOff(o Options) string {
	switch {
	case o.NoStream:
		return "--no-stream"
	case o.KeepStaging:
		return "--keep-staging keeps CRIU's image files, so they are written to the staging directory"
	case o.LeaveRunning && o.TCPEstablished:
		// A streamed dump must leave the tree stopped until its pages are read (see buildSteps),
		// and CRIU keeps the connections locked (in repair mode, behind the network lock) unless
		// it resumes the tree itself: they would never carry data again.
		return "--leave-running with --tcp-established: CRIU lets the connections go only when it resumes the tree itself, which a streamed dump cannot let it do"
	}
	return ""
}

// ShellJobReason says why CRIU must treat the tree as a shell job ("" when it need not): a
// process belongs to a session or process group whose leader is outside the tree (a job started
// from a shell, or by `ptxmig run` from one), or has a controlling terminal. CRIU refuses to dump
// such a tree unless told, and then restores it into the restorer's session.
func ShellJobReason(tree []proc.Stat) string {
	in := map[int]bool{}
	for _, s := range tree {
		in[s.PID] = true
	}
	for _, s := range tree {
		switch {
		case s.TTY != 0:
			return fmt.Sprintf("pid %d has a controlling terminal", s.PID)
		case !in[s.SID]:
			return fmt.Sprintf("pid %d belongs to session %d, whose leader is outside the tree (not a session leader: started from a shell)", s.PID, s.SID)
		case !in[s.PGID]:
			return fmt.Sprintf("pid %d belongs to process group %d, whose leader is outside the tree", s.PID, s.PGID)
		}
	}
	return ""
}

// idLike matches names that store.Get would also read as an image id prefix.
var idLike = regexp.MustCompile(`^[0-9a-f]{4,64}$`)

// imageName picks and checks the image name: an explicit name must be valid, not look like an
// image id (4 to 64 lower-case hex digits: `restore NAME` must never be ambiguous with an id
// prefix), and be free; a default name gets a suffix when taken.
func imageName(st op.ImageStore, o Options, comm string, now time.Time) (string, error) {
	if o.NameSet || o.Name != "" {
		name := o.Name
		if name == "" {
			return "", op.Refusef("--name is empty: give a name, or leave --name out for COMM-PID-DATE-TIME")
		}
		if err := store.ValidateName(name); err != nil {
			return "", op.Refusef("--name %q: %w", name, err)
		}
		if idLike.MatchString(name) {
			return "", op.Refusef("--name %q: a name of 4 to 64 hex digits could be read as an image id; add a letter outside a-f", name)
		}
		if m, err := st.Get(name); err == nil && m.Name == name {
			return "", op.Refusef("--name %q: an image of that name exists (id %.12s, made %s); pick another name or remove it with `%s`",
				name, m.ID, m.Created.Format(time.RFC3339), op.Command(st.Dir(), "image", "rm", name))
		}
		return name, nil
	}
	base := DefaultName(comm, o.PID, now)
	name := base
	for n := 2; ; n++ {
		if m, err := st.Get(name); err != nil || m.Name != name {
			return name, nil
		}
		if n > 99 {
			return "", op.Refusef("default image names %s…-%d are all taken", base, n-1)
		}
		name = fmt.Sprintf("%s-%d", base, n)
	}
}

var nameBad = regexp.MustCompile(`[^A-Za-z0-9._+@-]+`)

// DefaultName is COMM-PID-YYYYMMDD-HHMMSS with characters the store refuses replaced.
func DefaultName(comm string, pid int, t time.Time) string {
	c := strings.Trim(nameBad.ReplaceAllString(comm, "_"), "._+@-")
	if c == "" {
		c = "proc"
	}
	return fmt.Sprintf("%s-%d-%s", c, pid, t.UTC().Format("20060102-150405"))
}

// sharedWarning warns when the GPUs of a process left running after its driver restore also run
// other processes (placement.SharedGPUWarning says why).
func sharedWarning(env *op.Env, used []imagedesc.GPU, tree []op.TreeProc) []string {
	if env.GPUs == nil {
		return nil
	}
	devs, err := env.GPUs.Devices()
	if err != nil {
		return nil
	}
	var targets []gpu.Device
	for _, d := range devs {
		for _, g := range used {
			if strings.EqualFold(d.UUID, g.UUID) {
				targets = append(targets, d)
			}
		}
	}
	own := map[int]bool{}
	for _, t := range tree {
		own[t.PID] = true
	}
	if w := placement.SharedGPUWarning(targets, func(pid int) bool { return own[pid] }); w != "" {
		return []string{w}
	}
	return nil
}

func checkWritable(dir string, estimate uint64) error {
	if err := unix.Access(dir, unix.W_OK); err != nil {
		return op.Refusef("store %s is not writable: %w", dir, err)
	}
	free, err := op.FreeBytes(dir)
	if err != nil {
		return op.Refusef("store %s: %w", dir, err)
	}
	if free < estimate {
		return op.Refusef("store %s has %s free, the image may need up to %s (process memory + GPU memory)",
			dir, bytesize.FormatU(free), bytesize.FormatU(estimate))
	}
	return nil
}

// describe lists the plan's steps for --dry-run.
func (p *Plan) describe() []op.PlanStep {
	tree := pidList(op.TreePIDs(p.Tree, false))
	var s []op.PlanStep
	add := func(step, format string, a ...any) {
		s = append(s, op.PlanStep{Step: step, Action: fmt.Sprintf(format, a...)})
	}
	if len(p.CUDAPIDs) > 0 {
		if len(p.CUDAPIDs) > 1 {
			add(shimstep.StepAlign, "processes under the shim that launch collectives (NCCL ranks): stop each right after the same collective (waits up to %s)", timeoutText(p.opts.LockTimeout))
		}
		add(shimstep.StepQuiesce, "processes under the ptxmig shim: stop preemptible kernels between blocks (budget %s), hold new launches", budgetText(p.opts.PreemptBudget))
		add(StepLock, "driver lock of pid %s (waits up to %s for running kernels)", pidList(p.CUDAPIDs), timeoutText(p.opts.LockTimeout))
		add(StepCheckpoint, "driver checkpoint: copy %s of GPU memory to host memory, release the GPUs", bytesize.FormatU(p.Estimate.GPUBytes))
	}
	mode := "leave the tree stopped"
	switch {
	case p.LeaveRunning && p.Stream:
		mode = "then resume the tree once the store has read every page (not before: the stream holds references to the live pages)"
	case p.LeaveRunning:
		mode = "then resume the tree"
	}
	sj := ""
	if p.ShellJob {
		sj = ", as a shell job"
		if p.ShellJobReason != "" {
			sj += " (" + p.ShellJobReason + ")"
		}
	}
	if p.Stream {
		add(StepDump, "CRIU dump of pid %s (%s resident)%s, its image files streamed into the store as written "+
			"(chunked, deduplicated, compressed; log in %s); %s", tree, bytesize.FormatU(p.Estimate.HostBytes), sj, p.StagingRoot, mode)
	} else {
		add(StepDump, "CRIU dump of pid %s (%s resident)%s into %s (not streamed: %s); %s", tree, bytesize.FormatU(p.Estimate.HostBytes), sj,
			p.StagingRoot, p.StreamOff, mode)
	}
	if p.LeaveRunning && len(p.CUDAPIDs) > 0 {
		add(StepRestore, "driver restore of pid %s onto the same GPUs", pidList(p.CUDAPIDs))
		add(StepUnlock, "driver unlock of pid %s", pidList(p.CUDAPIDs))
		add(shimstep.StepResume, "processes under the shim: relaunch preempted kernels, release held launches")
	}
	if p.Stream {
		add(StepStore, "store CRIU's log with the image and commit it as %q", p.Image)
	} else {
		add(StepStore, "store the image as %q (chunked, deduplicated, compressed)", p.Image)
	}
	if !p.LeaveRunning {
		add(StepFinish, "end every process of the tree (pid %s)", tree)
	}
	add("on failure", "roll back: resume every stopped process, restore and unlock the GPUs; the tree runs on")
	return s
}

func pidList(pids []int) string {
	parts := make([]string, len(pids))
	for i, p := range pids {
		parts[i] = fmt.Sprint(p)
	}
	return strings.Join(parts, ", ")
}

func budgetText(d time.Duration) string {
	if d <= 0 {
		d = shimstep.DefaultPreemptBudget
	}
	return d.String()
}

func timeoutText(d time.Duration) string {
	if d <= 0 {
		return "no limit"
	}
	return d.String()
}

// refuseIOURing refuses a tree in which a process holds an io_uring instance (mapped, or only
// open): CRIU (4.2.1) cannot dump one ("Unknown shit 600 (anon_inode:[io_uring])"), and on 2x
// H200 (2026-11-28) a 2-rank PyTorch DDP job whose dump failed there stopped making progress after
// the rollback. Maps and file descriptors are read before anything is touched.
func refuseIOURing(tree []proc.Stat) error {
	for _, s := range tree {
		if !holdsIOURing(s.PID) {
			continue
		}
		return op.Refusef("pid %d (%s) has an io_uring instance, which CRIU cannot checkpoint; nothing was touched. "+
			"Start the job with `ptxmig run --no-io-uring` (io_uring_setup then fails with ENOSYS and libuv, in PyTorch's "+
			"TCPStore and torchrun's agent, falls back to epoll; `--nccl-sockets` implies it), or turn io_uring off "+
			"in the program itself", s.PID, s.Comm)
	}
	return nil
}

// ioURingTarget is what /proc/PID/maps and /proc/PID/fd/N name an io_uring instance.
const ioURingTarget = "anon_inode:[io_uring]"

// holdsIOURing: pid maps an io_uring instance or has one open. Unreadable (gone, or no access):
// false, CRIU will say.
func holdsIOURing(pid int) bool {
	if b, err := proc.ReadFile("", pid, "maps", 64<<20); err == nil && bytes.Contains(b, []byte(ioURingTarget)) {
		return true
	}
	targets, _ := proc.FDTargets("", pid)
	return slices.Contains(targets, ioURingTarget)
}
