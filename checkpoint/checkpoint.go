package checkpoint

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/store"
)

// Kinds of images.
const (
	KindCUDA = "cuda"
	KindCPU  = "cpu"
)

// Extra keys recorded in a manifest's Meta.Extra. Restore reads the CRIU ones back.
const (
	ExtraShellJob       = "criu.shell_job"
	ExtraTCPEstablished = "criu.tcp_established"
	ExtraComm           = "comm"
	ExtraLeftRunning    = "left_running"
)

// Step names of a checkpoint, in order.
const (
	StepLock       = "lock"
	StepCheckpoint = "checkpoint"
	StepDump       = "dump"
	StepRestore    = "restore"
	StepUnlock     = "unlock"
	StepStore      = "store"
	StepFinish     = "finish"
)

// Options of one checkpoint.
type Options struct {
	PID            int
	Name           string        // image name; default COMM-PID-YYYYMMDD-HHMMSS
	LeaveRunning   bool          // the process continues after the checkpoint
	LockTimeout    time.Duration // driver lock timeout (0: wait forever)
	TCPEstablished bool
	ShellJob       bool
	KeepStaging    bool   // keep the CRIU image directory after a successful store
	StagingRoot    string // where the staging directory goes; default: tmpfs when memory allows
	// PrestageWorkers store the dump's chunks while CRIU writes them (store.Prestage): 0 means
	// half the CPUs, a negative value stores only after the dump.
	PrestageWorkers int
	Progress        func(done, total int64)
}

// Sizes of a stored image, in bytes.
type Sizes struct {
	Logical int64 `json:"logical_bytes"` // CRIU's images as written
	Written int64 `json:"written_bytes"` // new bytes written to the store
	Zero    int64 `json:"zero_bytes"`
	Dedup   int64 `json:"dedup_bytes"`
	Stored  int64 `json:"stored_bytes"`
}

// Result of a checkpoint.
type Result struct {
	Image       string        `json:"image"`
	ImageID     string        `json:"image_id"`
	PID         int           `json:"pid"`
	Kind        string        `json:"kind"`
	GPUs        []store.GPU   `json:"gpus,omitempty"`
	Visible     []store.GPU   `json:"visible_gpus,omitempty"` // every GPU the process's CUDA driver enumerated
	LeftRunning bool          `json:"left_running"`
	Timings     Timings       `json:"timings"`
	Total       time.Duration `json:"total_ns"`
	Sizes       Sizes         `json:"sizes"`
	StagingDir  string        `json:"staging_dir,omitempty"` // kept (--keep-staging, or after a failure)
}

// Failure is a checkpoint that failed after preflight. StagingDir holds CRIU's log.
type Failure struct {
	*StepError
	StagingDir string
	CRIUTail   []string
}

func (f *Failure) Unwrap() error { return f.StepError }

// Run checkpoints o.PID: preflight, then the transaction lock → checkpoint → dump → store →
// finish (kill, or restore + unlock with LeaveRunning). Preflight failures wrap ErrRefused.
func Run(ctx context.Context, env *Env, o Options) (*Result, error) {
	t0 := time.Now()
	pf, err := preflight(env, o)
	if err != nil {
		return nil, err
	}
	lk, err := oplock.Acquire(o.PID, "checkpoint", 0)
	if err != nil {
		return nil, err
	}
	defer lk.Release()

	staging, err := os.MkdirTemp(pf.stagingRoot, fmt.Sprintf("ckpt-%d-", o.PID))
	if err != nil {
		return nil, refusef("staging directory in %s: %w", pf.stagingRoot, err)
	}
	images := filepath.Join(staging, "images")
	if err := os.Mkdir(images, 0o700); err != nil {
		_ = os.RemoveAll(staging)
		return nil, fmt.Errorf("staging: %w", err)
	}
	res := &Result{PID: o.PID, Kind: pf.meta.Kind, GPUs: pf.meta.GPUs, Visible: pf.meta.Visible, LeftRunning: o.LeaveRunning}
	var manifest *store.Manifest
	var stats *store.Stats
	steps, cleanup := buildSteps(env, o, pf, images, func(m *store.Manifest, s *store.Stats) { manifest, stats = m, s })
	defer cleanup()
	timings, err := Execute(ctx, steps, env.Hook, 0, env.Log)
	res.Timings = timings
	if err != nil {
		f := &Failure{StagingDir: staging}
		var ce *criu.Error
		if errors.As(err, &ce) {
			f.CRIUTail = ce.Tail
		}
		errors.As(err, &f.StepError)
		// Keep the log, drop the (possibly huge, possibly in RAM) image files.
		if !o.KeepStaging {
			removeImageFiles(images)
		}
		if f.StepError == nil {
			return nil, err
		}
		return nil, f
	}
	if manifest != nil {
		res.Image, res.ImageID = manifest.Name, manifest.ID
	}
	if stats != nil {
		res.Sizes = Sizes{Logical: stats.LogicalBytes, Written: stats.WrittenBytes, Zero: stats.ZeroBytes, Dedup: stats.DedupBytes, Stored: stats.StoredBytes}
	}
	if o.KeepStaging {
		res.StagingDir = staging
	} else if err := os.RemoveAll(staging); err != nil {
		env.Log.Warn("cannot remove staging directory", "dir", staging, "err", err)
	}
	res.Total = time.Since(t0)
	return res, nil
}

// plan is what preflight learned.
type plan struct {
	cuda        bool
	meta        store.Metadata
	stagingRoot string
	estimate    uint64
}

func preflight(env *Env, o Options) (*plan, error) {
	if env.Euid != 0 {
		return nil, refusef("ptxmig checkpoint must run as root (it reads and freezes another process)")
	}
	if o.PID <= 1 || o.PID == os.Getpid() {
		return nil, refusef("pid %d cannot be checkpointed", o.PID)
	}
	if !ProcessAlive(o.PID) {
		return nil, refusef("no running process with pid %d", o.PID)
	}
	if env.CRIU == nil {
		return nil, refusef("CRIU is not usable: %v", env.CRIUErr)
	}
	if env.Store == nil {
		return nil, refusef("no image store")
	}
	if o.Name != "" {
		if err := store.ValidateName(o.Name); err != nil {
			return nil, refusef("--name %q: %w", o.Name, err)
		}
	}
	p := &plan{}
	cuda, _, err := gpu.MapsCUDA(o.PID)
	if err != nil {
		return nil, refusef("read /proc/%d/maps: %w", o.PID, err)
	}
	if cuda {
		if env.Driver == nil {
			return nil, refusef("pid %d uses CUDA but the NVIDIA driver cannot be used: %v", o.PID, env.DriverErr)
		}
		st, err := env.Driver.State(o.PID)
		switch {
		case errors.Is(err, cudackpt.ErrNotCUDA):
			env.Log.Info("libcuda is loaded but the driver knows no CUDA state; checkpointing with CRIU alone", "pid", o.PID)
			cuda = false
		case err != nil:
			return nil, refusef("pid %d: checkpoint state: %w", o.PID, err)
		case st != cudackpt.Running:
			return nil, refusef("pid %d is %s, not running: another tool (or a failed checkpoint) holds it; "+
				"ptxmig only starts from a running process", o.PID, st)
		}
	}
	p.cuda = cuda
	comm := Comm(o.PID)
	p.meta = store.Metadata{
		Kind: KindCPU, Host: env.Host.Host, Kernel: env.Host.Kernel, CRIU: env.CRIUVersion,
		PID: o.PID, Cmdline: gpu.ReadCmdline("/proc", o.PID),
		Extra: map[string]string{ExtraComm: comm},
	}
	if o.ShellJob {
		p.meta.Extra[ExtraShellJob] = "true"
	}
	if o.TCPEstablished {
		p.meta.Extra[ExtraTCPEstablished] = "true"
	}
	if o.LeaveRunning {
		p.meta.Extra[ExtraLeftRunning] = "true"
	}
	var gpuBytes uint64
	if cuda {
		p.meta.Kind = KindCUDA
		p.meta.Driver, p.meta.CUDA = env.Host.Driver, env.Host.CUDA
		gpus, visible, err := sourceGPUs(env, o.PID)
		if err != nil {
			return nil, refusef("pid %d: find its GPUs: %w", o.PID, err)
		}
		p.meta.GPUs, p.meta.Visible = gpus, visible
		for _, g := range gpus {
			gpuBytes += g.MemoryBytes
		}
	}
	rss := rssBytes(o.PID)
	p.estimate = rss + gpuBytes
	if err := checkWritable(env.Store.Dir(), p.estimate); err != nil {
		return nil, err
	}
	p.stagingRoot, err = ChooseStaging(o.StagingRoot, p.estimate, gpuBytes)
	if err != nil {
		return nil, err
	}
	return p, nil
}

// sourceGPUs lists the GPUs pid uses (NVML's compute processes; else its open /dev/nvidiaN),
// with the memory it uses on each (MemoryBytes: what a restore needs free), and the GPUs its
// CUDA driver enumerates (visible), which a restore onto other GPUs must all pair. MIG
// (CUDA_VISIBLE_DEVICES naming MIG instances) is refused. When the visible set cannot be
// determined, or does not contain the used GPUs (the process changed CUDA_VISIBLE_DEVICES after it
// started), it is left out with a warning: the image then restores onto its own GPUs, and a move
// is refused or assumes every GPU of the host was visible (see restore.AssumeVisible).
func sourceGPUs(env *Env, pid int) (used, visible []store.GPU, err error) {
	if env.GPUs == nil {
		return nil, nil, nil
	}
	devs, err := env.GPUs.Devices()
	if err != nil {
		return nil, nil, err
	}
	for _, u := range gpu.UsedBy(devs, pid) {
		used = append(used, store.GPU{Index: u.Device.Index, UUID: u.Device.UUID, Name: u.Device.Name, ComputeCap: u.Device.ComputeCap, MemoryBytes: u.Memory})
	}
	if len(used) == 0 {
		if pi, ok := gpu.Inspect(pid); ok {
			for _, m := range pi.Minors {
				for _, d := range devs {
					if d.Minor == m {
						used = append(used, store.GPU{Index: d.Index, UUID: d.UUID, Name: d.Name, ComputeCap: d.ComputeCap})
					}
				}
			}
		}
	}
	sort.Slice(used, func(i, j int) bool { return used[i].Index < used[j].Index })

	// The driver's restore needs a GPU pair for every GPU of the host, whatever the process's
	// CUDA_VISIBLE_DEVICES says (measured on driver 580: a process that saw only GPU 0 moved to
	// GPU 1 with {0→1, 1→0} and was refused with {0→1}), so the image records them all. The
	// environment still matters for one thing: MIG instances cannot be paired.
	if _, err := gpu.VisibleTo(pid, devs); errors.Is(err, gpu.ErrMIG) {
		return nil, nil, err
	}
	vis := gpu.DriverSet(devs)
	mem := map[string]uint64{}
	for _, u := range used {
		mem[strings.ToLower(u.UUID)] = u.MemoryBytes
	}
	for _, d := range vis {
		visible = append(visible, store.GPU{Index: d.Index, UUID: d.UUID, Name: d.Name, ComputeCap: d.ComputeCap, MemoryBytes: mem[strings.ToLower(d.UUID)]})
	}
	return used, visible, nil
}

// notIn lists the used GPUs that are not in vis ("" when all are).
func notIn(used []store.GPU, vis []gpu.Device) string {
	var missing []string
	for _, u := range used {
		found := false
		for _, d := range vis {
			if strings.EqualFold(d.UUID, u.UUID) {
				found = true
			}
		}
		if !found {
			missing = append(missing, fmt.Sprintf("%d (%s)", u.Index, u.UUID))
		}
	}
	return strings.Join(missing, ", ")
}

func rssBytes(pid int) uint64 { return procKB(fmt.Sprintf("/proc/%d/status", pid), "VmRSS:") }

// procKB reads a "Key:   123 kB" line of a /proc file (status, meminfo) in bytes; 0 when the
// file or the key is missing or the value does not parse.
func procKB(path, key string) uint64 {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), key); ok {
			kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil || kb > math.MaxUint64>>10 {
				return 0
			}
			return kb << 10
		}
	}
	return 0
}

func freeBytes(dir string) (uint64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return st.Bavail * uint64(st.Bsize), nil
}

func checkWritable(dir string, estimate uint64) error {
	if err := unix.Access(dir, unix.W_OK); err != nil {
		return refusef("store %s is not writable: %w", dir, err)
	}
	free, err := freeBytes(dir)
	if err != nil {
		return refusef("store %s: %w", dir, err)
	}
	if free < estimate {
		return refusef("store %s has %s free, the image may need up to %s (process memory + GPU memory)",
			dir, HumanBytes(int64(free)), HumanBytes(int64(estimate)))
	}
	return nil
}

// StagingTmpfs and StagingDisk are the default staging roots.
const (
	StagingTmpfs = "/dev/shm/ptxmig"
	StagingDisk  = "/var/tmp/ptxmig"
)

// ChooseStaging picks where CRIU's images go: an explicit root, else tmpfs when they fit in
// memory with extraMem to spare (a checkpointed process's host memory grows by its GPU memory; a
// restore holds the image twice), else disk. The root must have need bytes free, and must be a
// directory private to ptxmig (see oplock.PrivateDir): the defaults lie in world-writable
// /dev/shm and /var/tmp. Failures wrap ErrRefused.
func ChooseStaging(explicit string, need, extraMem uint64) (string, error) {
	if explicit != "" {
		return ensureStagingRoot(explicit, need)
	}
	if avail := MemAvailable(); avail > 0 && avail > need+extraMem+1<<30 {
		if root, err := ensureStagingRoot(StagingTmpfs, need); err == nil {
			return root, nil
		}
	}
	return ensureStagingRoot(StagingDisk, need)
}

func ensureStagingRoot(root string, need uint64) (string, error) {
	if err := oplock.PrivateDir(root); err != nil {
		return "", refusef("staging %s: %w", root, err)
	}
	free, err := freeBytes(root)
	if err != nil {
		return "", refusef("staging %s: %w", root, err)
	}
	if free < need {
		return "", refusef("staging %s has %s free, CRIU's images may need %s", root, HumanBytes(int64(free)), HumanBytes(int64(need)))
	}
	return root, nil
}

// MemAvailable is /proc/meminfo's MemAvailable in bytes (0 when unknown).
func MemAvailable() uint64 { return procKB("/proc/meminfo", "MemAvailable:") }

// buildSteps assembles the transaction. Without LeaveRunning the process is dumped and left
// stopped, stored, then killed: a store failure rolls back to a running process. With
// LeaveRunning, CRIU resumes it after the dump and the driver restores and unlocks it before the
// (slow) store, so it runs while the image is written.
// buildSteps returns the checkpoint's steps and a cleanup to run after them whatever happened
// (it drops the store's prestaged work if the store step did not take it).
func buildSteps(env *Env, o Options, p *plan, images string, stored func(*store.Manifest, *store.Stats)) ([]Step, func()) {
	pid := o.PID
	// The store starts on the dump's files while CRIU still writes them (store.Prestage), so the
	// store step after the dump only re-reads, re-hashes and commits what is already encoded.
	var pre *store.Prestage
	dropPre := func() {
		if pre != nil {
			pre.Close()
			pre = nil
		}
	}
	d := env.Driver
	var steps []Step
	if p.cuda {
		steps = append(steps,
			Step{Name: StepLock,
				Do: func(context.Context) error { return d.Lock(pid, o.LockTimeout) },
				Undo: func(context.Context) error {
					if st, err := d.State(pid); err == nil && st != cudackpt.Locked {
						return nil // already running again (or gone)
					}
					return d.Unlock(pid)
				}},
			Step{Name: StepCheckpoint,
				Do: func(context.Context) error { return d.Checkpoint(pid) },
				Undo: func(context.Context) error {
					if st, err := d.State(pid); err == nil && st != cudackpt.Checkpointed {
						return nil
					}
					return d.Restore(pid, nil) // back onto its own GPUs
				}},
		)
	}
	dump := criu.DumpOptions{PID: pid, ImagesDir: images, LeaveRunning: o.LeaveRunning, LeaveStopped: !o.LeaveRunning,
		ShellJob: o.ShellJob, TCPEstablished: o.TCPEstablished}
	steps = append(steps, Step{Name: StepDump,
		Do: func(ctx context.Context) error {
			var err error
			if o.PrestageWorkers >= 0 {
				w := o.PrestageWorkers
				if w == 0 {
					w = max(1, runtime.NumCPU()/2) // leave half the CPUs to CRIU
				}
				if pre, err = env.Store.Prestage(ctx, images, store.PutOptions{Workers: w}); err != nil {
					env.logger().Debug("no prestage; the store runs after the dump", "err", err)
					pre = nil
				}
			}
			_, err = env.CRIU.Dump(ctx, dump)
			if pre != nil {
				if perr := pre.Stop(); perr != nil {
					env.logger().Debug("prestage stopped early", "err", perr)
				}
			}
			if err != nil {
				dropPre()
			}
			return err
		},
		Undo: func(context.Context) error {
			if o.LeaveRunning {
				return nil
			}
			return continueProcess(pid)
		}})
	if o.LeaveRunning && p.cuda {
		steps = append(steps,
			Step{Name: StepRestore, Do: func(context.Context) error { return d.Restore(pid, nil) }},
			Step{Name: StepUnlock, Do: func(context.Context) error { return d.Unlock(pid) }},
		)
	}
	name := o.Name
	if name == "" {
		name = DefaultName(p.meta.Extra[ExtraComm], pid, time.Now())
	}
	steps = append(steps, Step{Name: StepStore, Do: func(ctx context.Context) error {
		m, s, err := env.Store.Put(ctx, images, store.PutOptions{Name: name, Meta: p.meta, Progress: o.Progress, Prestaged: pre})
		dropPre()
		if err != nil {
			return fmt.Errorf("store image %q: %w", name, err)
		}
		stored(m, s)
		return nil
	}})
	if !o.LeaveRunning {
		steps = append(steps, Step{Name: StepFinish, Do: func(context.Context) error {
			return KillAndWait(pid, 10*time.Second)
		}})
	}
	return steps, dropPre
}

// continueProcess resumes a process CRIU left stopped, and checks it left the stopped state.
func continueProcess(pid int) error {
	if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
		return fmt.Errorf("SIGCONT pid %d: %w", pid, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for processState(pid) == 'T' {
		if time.Now().After(deadline) {
			return fmt.Errorf("pid %d still stopped 5 s after SIGCONT", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return nil
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

func removeImageFiles(dir string) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".log") {
			_ = os.RemoveAll(filepath.Join(dir, e.Name()))
		}
	}
}

// HumanBytes formats n as "1.5 GiB".
func HumanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
