package restore

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/store"
)

// Step names of a restore.
const (
	StepCRIURestore   = "criu-restore"
	StepDriverRestore = "driver-restore"
	StepUnlock        = "unlock"
)

// Options of one restore.
type Options struct {
	Image       string            // name or id
	GPUs        []int             // target index per checkpointed GPU (or one, for one GPU)
	GPUMap      map[string]string // old UUID/index → new UUID/index
	KeepStaging bool
	StagingRoot string        // default: tmpfs when memory allows, else /var/tmp/ptxmig
	PIDWait     time.Duration // how long to wait for the original PID to be freed; default 10 s
	Progress    func(done, total int64)
}

// Result of a restore.
type Result struct {
	Image       string             `json:"image"`
	ImageID     string             `json:"image_id"`
	PID         int                `json:"pid"`
	Kind        string             `json:"kind"`
	Pairs       []Pair             `json:"gpu_pairs,omitempty"` // every visible GPU; the driver gets them only when one moves
	Remapped    bool               `json:"remapped"`            // the driver got the pairs (a GPU moved)
	Materialize time.Duration      `json:"materialize_ns"`
	Timings     checkpoint.Timings `json:"timings"`
	Total       time.Duration      `json:"total_ns"`
	Bytes       int64              `json:"bytes"`
	StagingDir  string             `json:"staging_dir,omitempty"`
}

// Failure is a restore that failed after the image was materialized.
type Failure struct {
	*checkpoint.StepError
	StagingDir string
	CRIUTail   []string
}

func (f *Failure) Unwrap() error { return f.StepError }

func refusef(format string, a ...any) error {
	return &checkpoint.Refusal{Err: fmt.Errorf(format, a...)}
}

// Restore verifies and materializes an image and brings its process back: CRIU restore
// (detached, under the original PID) → driver restore with GPU pairs → unlock. A failure after
// CRIU restored the process kills the half-restored process; the image stays intact.
func Restore(ctx context.Context, env *checkpoint.Env, o Options) (*Result, error) {
	t0 := time.Now()
	if env.Euid != 0 {
		return nil, refusef("ptxmig restore must run as root (CRIU recreates the process)")
	}
	if env.CRIU == nil {
		return nil, refusef("CRIU is not usable: %v", env.CRIUErr)
	}
	if env.Store == nil {
		return nil, refusef("no image store")
	}
	m, err := env.Store.Get(o.Image)
	if err != nil {
		return nil, refusef("image %q: %w", o.Image, err)
	}
	meta := m.Meta
	if meta.PID <= 1 {
		return nil, refusef("image %s records no valid pid (%d): not a process image", m.Name, meta.PID)
	}
	if meta.Kind != checkpoint.KindCUDA && meta.Kind != checkpoint.KindCPU {
		return nil, refusef("image %s is of kind %q, not a process checkpoint", m.Name, meta.Kind)
	}
	res := &Result{Image: m.Name, ImageID: m.ID, PID: meta.PID, Kind: meta.Kind}
	cuda := meta.Kind == checkpoint.KindCUDA
	var dpairs []cudackpt.Pair
	if cuda {
		if env.Driver == nil {
			return nil, refusef("image %s holds a CUDA process but the NVIDIA driver cannot be used: %v", m.Name, env.DriverErr)
		}
		if env.GPUs == nil && len(meta.GPUs) > 0 {
			return nil, refusef("image %s needs GPUs but NVML is not available to check them", m.Name)
		}
		if env.GPUs != nil {
			devs, err := env.GPUs.Devices()
			if err != nil {
				return nil, refusef("list GPUs: %w", err)
			}
			visible, assumed := recordedVisible(meta, devs)
			pairs, err := PlanPairs(meta.GPUs, visible, devs, o.GPUs, o.GPUMap, false)
			if err != nil {
				return nil, refusef("image %s: %w", m.Name, err)
			}
			res.Pairs = pairs
			if dpairs, err = DriverPairs(pairs); err != nil {
				return nil, refusef("image %s: %w", m.Name, err)
			}
			res.Remapped = dpairs != nil
			if assumed && dpairs != nil && env.Log != nil {
				env.Log.Warn("image records no visible-GPU set (made by an older ptxmig): assuming the process saw every GPU "+
					"of this host; if it ran with CUDA_VISIBLE_DEVICES the driver will refuse the pairs and the restore rolls back",
					"image", m.Name, "pairs", pairText(pairs))
			}
		}
	} else if len(o.GPUs) > 0 || len(o.GPUMap) > 0 {
		return nil, refusef("image %s is a CPU process: --gpu/--gpu-map do not apply", m.Name)
	}
	if err := waitPIDFree(ctx, meta.PID, o.PIDWait); err != nil {
		return nil, err
	}
	lk, err := oplock.Acquire(meta.PID, "restore of "+m.Name, 0)
	if err != nil {
		return nil, err
	}
	defer lk.Release()

	var logical uint64
	for _, f := range m.Files {
		logical += uint64(f.Size)
	}
	var gpuBytes uint64
	for _, g := range meta.GPUs {
		gpuBytes += g.MemoryBytes
	}
	// The image is materialized (logical bytes on the staging file system) and, on tmpfs, also
	// read back into the restored process's memory.
	root, err := checkpoint.ChooseStaging(o.StagingRoot, logical, logical+gpuBytes)
	if err != nil {
		return nil, err
	}
	staging, err := os.MkdirTemp(root, "rst-"+m.Name+"-")
	if err != nil {
		return nil, refusef("staging in %s: %w", root, err)
	}
	keep := o.KeepStaging
	defer func() {
		if !keep {
			_ = os.RemoveAll(staging)
		}
	}()
	images, work := filepath.Join(staging, "images"), filepath.Join(staging, "work")
	if err := os.Mkdir(work, 0o700); err != nil {
		return nil, fmt.Errorf("staging: %w", err)
	}
	tm := time.Now()
	st, err := env.Store.Materialize(ctx, m.ID, images, store.GetOptions{Progress: o.Progress})
	res.Materialize = time.Since(tm)
	if err != nil {
		if errors.Is(err, store.ErrCorrupt) {
			return nil, refusef("image %s is corrupt, nothing was restored: %w", m.Name, err)
		}
		return nil, fmt.Errorf("materialize image %s: %w", m.Name, err)
	}
	if st != nil {
		res.Bytes = st.LogicalBytes
	}

	var pid int
	ropts := criu.RestoreOptions{ImagesDir: images, WorkDir: work,
		ShellJob: meta.Extra[checkpoint.ExtraShellJob] == "true", TCPEstablished: meta.Extra[checkpoint.ExtraTCPEstablished] == "true"}
	steps := []checkpoint.Step{{
		Name: StepCRIURestore,
		Do: func(ctx context.Context) error {
			r, err := env.CRIU.Restore(ctx, ropts)
			if err != nil {
				return err
			}
			pid = r.PID
			if pid != meta.PID {
				return fmt.Errorf("criu restored pid %d, expected %d", pid, meta.PID)
			}
			return nil
		},
		Undo: func(context.Context) error {
			if pid <= 0 {
				return nil
			}
			return checkpoint.KillAndWait(pid, 10*time.Second)
		},
	}}
	if cuda {
		steps = append(steps,
			checkpoint.Step{Name: StepDriverRestore, Do: func(context.Context) error {
				st, err := env.Driver.State(pid)
				if err != nil {
					return err
				}
				if st != cudackpt.Checkpointed {
					return fmt.Errorf("restored pid %d is %s, expected checkpointed", pid, st)
				}
				return env.Driver.Restore(pid, dpairs)
			}},
			checkpoint.Step{Name: StepUnlock, Do: func(context.Context) error { return env.Driver.Unlock(pid) }},
		)
	}
	res.Timings, err = checkpoint.Execute(ctx, steps, env.Hook, 0, env.Log)
	if err != nil {
		keep = true // the logs explain the failure
		f := &Failure{StagingDir: staging}
		var ce *criu.Error
		if errors.As(err, &ce) {
			f.CRIUTail = ce.Tail
		}
		if !errors.As(err, &f.StepError) {
			return nil, err
		}
		if !o.KeepStaging {
			_ = os.RemoveAll(images) // keep work/ (CRIU's log), drop the image copy
		}
		return nil, f
	}
	if o.KeepStaging {
		res.StagingDir = staging
	}
	res.Total = time.Since(t0)
	return res, nil
}

// recordedVisible is the image's visible-GPU set; for images without one (older ptxmig), every
// GPU of this host when the image was made here (assumed is then true), else nil (a move is
// then refused: the other host's GPUs cannot be named).
func recordedVisible(meta store.Metadata, devs []gpu.Device) (visible []store.GPU, assumed bool) {
	if len(meta.Visible) > 0 {
		return meta.Visible, false
	}
	v, ok := AssumeVisible(meta.GPUs, devs)
	if !ok {
		return nil, false
	}
	return v, true
}

// waitPIDFree waits for a dying process with the image's PID to go away, then refuses if the
// PID is still taken.
func waitPIDFree(ctx context.Context, pid int, wait time.Duration) error {
	if wait <= 0 {
		wait = 10 * time.Second
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	alive := checkpoint.ProcessAlive(pid)
	comm := checkpoint.Comm(pid)
	if alive {
		// A live process will not go away by waiting: refuse at once.
		return &checkpoint.Refusal{Err: fmt.Errorf("%w: pid %d is taken by a running process (%s); CRIU restores a process "+
			"under its original pid: stop that process, or restore in another pid namespace", ErrPIDInUse, pid, comm)}
	}
	if err := checkpoint.WaitGone(ctx, pid, wait); err != nil {
		return &checkpoint.Refusal{Err: fmt.Errorf("%w: pid %d is a zombie (%s) not reaped by its parent within %s", ErrPIDInUse, pid, comm, wait)}
	}
	return nil
}
