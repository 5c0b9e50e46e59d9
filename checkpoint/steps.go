package checkpoint

import (
	"context"
	"encoding/json"
	"os"
	"slices"
	"time"

	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/store"
)

// Step names of a checkpoint, in order (the driver steps run only for CUDA processes).
const (
	StepLock       = driverstep.StepLock
	StepCheckpoint = driverstep.StepCheckpoint
	StepDump       = "dump"
	StepRestore    = driverstep.StepDriverRestore
	StepUnlock     = driverstep.StepUnlock
	StepStore      = "store"
	StepFinish     = "finish"
)

// Kinds of the checkpoint's own steps (see op.Kind). None needs data of its own: the journal's
// operation record has the tree, the store, the image and when the checkpoint began.
const (
	KindDump   = "checkpoint.dump"   // undo: resume the tree CRIU stopped
	KindStore  = "checkpoint.store"  // the commit: the image is in the store
	KindFinish = "checkpoint.finish" // after the commit: end the tree, as the checkpoint does
)

func init() {
	op.RegisterKind(op.Kind{ID: KindDump, Helper: "criu", Rebuild: func(r *op.Rec, _ json.RawMessage) (op.Recovery, error) {
		return op.Recovery{Undo: func(context.Context) error { return resumeTree(r.Tree(), r.Header.CUDA, r.Note) }}, nil
	}})
	op.RegisterKind(op.Kind{ID: KindStore, Rebuild: func(r *op.Rec, _ json.RawMessage) (op.Recovery, error) {
		h := r.Header
		return op.Recovery{
			Undo: func(context.Context) error {
				r.Note("the image was not stored (`%s` removes what the store step left)", op.Command(h.Store, "image", "gc"))
				return nil
			},
			Done: func() bool {
				if _, ok := storedImage(r, h.Store, h.Image, h.Root, h.Time); ok {
					r.Note("image %s was stored before ptxmig died", h.Image)
					return true
				}
				return false
			},
			Finish: func(context.Context) error {
				if h.LeaveRunning {
					r.Note("the checkpoint had committed (image %s); the tree runs on", h.Image)
				} else {
					r.Note("the checkpoint had committed (image %s)", h.Image)
				}
				return nil
			},
		}, nil
	}})
	op.RegisterKind(op.Kind{ID: KindFinish, Rebuild: func(r *op.Rec, _ json.RawMessage) (op.Recovery, error) {
		return op.Recovery{Finish: func(context.Context) error { return endTree(r.Tree(), r.Note) }}, nil
	}})
}

// resumeTree resumes the processes a dump stopped: the dump's undo, in-process and after a crash.
// The CUDA processes among them (cuda) are left stopped: the driver's checkpoint stopped them
// before the dump, and the checkpoint step's undo continues each once the driver has restored it
// (run before, a thread of it could touch a device mapping still gone). note (may be nil) is told
// what was done.
func resumeTree(pids, cuda []int, note func(string, ...any)) error {
	var held []int
	pids = slices.DeleteFunc(slices.Clone(pids), func(pid int) bool {
		if slices.Contains(cuda, pid) {
			held = append(held, pid)
			return true
		}
		return false
	})
	if len(held) > 0 && note != nil {
		note("CUDA pid %s stays stopped until the driver has restored it", op.PIDText(held))
	}
	if len(pids) == 0 {
		return nil
	}
	err := proc.Continue(pids, 5*time.Second)
	if note != nil {
		note("resumed the tree stopped by the dump (pid %s)", op.PIDText(pids))
	}
	return err
}

// endTree ends the checkpointed tree: the finish step, in-process and after a crash.
func endTree(pids []int, note func(string, ...any)) error {
	if len(pids) == 0 {
		if note != nil {
			note("the tree had already ended")
		}
		return nil
	}
	err := proc.Kill(pids, 10*time.Second)
	if note != nil {
		note("ended the checkpointed tree as the checkpoint does (pid %s)", op.PIDText(pids))
	}
	return err
}

// storedImage finds the checkpoint's image in the store (its manifest is written last: a stored
// image is complete): the image named name of pid, made since the checkpoint began. The store
// step asks when the store reported an error, a recovery when ptxmig died during the store step.
func storedImage(r *op.Rec, dir, name string, pid int, began time.Time) (*store.Manifest, bool) {
	if dir == "" || name == "" {
		return nil, false
	}
	if fi, err := os.Lstat(dir); err != nil || !fi.IsDir() {
		return nil, false
	}
	st, err := store.Open(dir)
	if err != nil {
		r.Log.Warn("cannot open the store to see whether the image was stored", "store", dir, "err", err)
		return nil, false
	}
	return imageIn(st, name, pid, began)
}

func imageIn(st interface {
	Get(ref string) (*store.Manifest, error)
}, name string, pid int, began time.Time) (*store.Manifest, bool) {
	m, err := st.Get(name)
	if err != nil || m.Name != name || imagedesc.RootPID(m) != pid || m.Created.Before(began.Add(-time.Second)) {
		return nil, false
	}
	return m, true
}
