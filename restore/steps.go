package restore

import (
	"context"
	"encoding/json"
	"slices"
	"time"

	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
)

// Step names of a restore.
const (
	StepMaterialize   = "materialize"
	StepCRIURestore   = "criu-restore"
	StepPlaceFiles    = "place-files" // carried files put in place before CRIU (checkpoint --carry-files)
	StepDriverRestore = driverstep.StepDriverRestore
	StepUnlock        = driverstep.StepUnlock
)

// Kinds of the restore's own steps (see op.Kind). Neither needs data of its own: the journal's
// operation record has the tree, and the step's record when it began.
const (
	KindPlaceFiles  = "restore.place-files"  // carried files put in place
	KindCRIURestore = "restore.criu-restore" // undo: kill what CRIU restored
)

func init() {
	op.RegisterKind(op.Kind{ID: KindPlaceFiles, Rebuild: func(r *op.Rec, _ json.RawMessage) (op.Recovery, error) {
		return op.Recovery{Undo: func(context.Context) error {
			r.Note("carried files put in place before ptxmig died stay (the processes need them); a file they replaced " +
				"is next to it as NAME.ptxmig-replaced-TIME")
			return nil
		}}, nil
	}})
	op.RegisterKind(op.Kind{ID: KindCRIURestore, Helper: "criu", Rebuild: func(r *op.Rec, _ json.RawMessage) (op.Recovery, error) {
		var tree []int
		for _, p := range r.Header.Tree {
			tree = append(tree, p.PID)
		}
		return op.Recovery{Undo: func(context.Context) error { return killRestored(tree, r.BeganAt(), r.Note) }}, nil
	}})
}

// killRestored kills what a CRIU restore begun at began (CLOCK_BOOTTIME) restored: the image's
// pids taken by processes started since, with their trees; never an older process that took one
// of the pids. It is the CRIU restore's undo, in-process and after a crash; note (may be nil) is
// told what was done.
func killRestored(recorded []int, began time.Duration, note func(string, ...any)) error {
	var victims []int
	for _, pid := range recorded {
		ps, err := proc.ReadStat(pid)
		if err != nil || ps.Zombie() || !ps.StartedSince(began) {
			continue
		}
		if !slices.Contains(victims, pid) {
			victims = append(victims, pid)
		}
		if sub, err := proc.Tree(pid); err == nil {
			for _, c := range sub[1:] {
				if !slices.Contains(victims, c.PID) {
					victims = append(victims, c.PID)
				}
			}
		}
	}
	if len(victims) == 0 {
		if note != nil {
			note("no half-restored process was left")
		}
		return nil
	}
	err := proc.Kill(victims, 10*time.Second)
	if note != nil {
		note("killed the half-restored processes (pid %s); the image is intact", op.PIDText(victims))
	}
	return err
}
