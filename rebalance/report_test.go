package rebalance

import (
	"bytes"
	"path/filepath"
	"testing"

	"github.com/ptxmig/ptxmig/internal/golden"
)

// TestWriteTextGolden pins the human output of a dry run and of a run with a failed move.
func TestWriteTextGolden(t *testing.T) {
	obs := Observation{Time: t0, Window: 5e9,
		GPUs:  []GPU{h200(0, 1, 680, 8), h200(1, 0, 90, 1)},
		Procs: []Process{procOn(10, 0, 0.5, 2), procOn(11, 0, 0.5, 3)}}
	obs.Procs[1].UnderShim = true
	dry := &Report{Start: t0, DryRun: true, Observation: obs, Plan: MakePlan(obs, DefaultPolicy(), nil, t0)}
	failed := &Report{Start: t0, Observation: obs, Plan: dry.Plan, Failed: 1,
		Results:  []MoveResult{{Move: dry.Plan.Moves[0], Seconds: 2.5, Error: "move pid 11 from GPU 0 to GPU 1: migration failed: driver says no"}},
		Error:    "move pid 11 from GPU 0 to GPU 1: migration failed: driver says no",
		Warnings: []string{"state.json: corrupt rebalance state file: unexpected EOF; starting with an empty history"}}
	for name, rep := range map[string]*Report{"dry-run": dry, "failed": failed} {
		var b bytes.Buffer
		if err := WriteText(&b, rep); err != nil {
			t.Fatal(err)
		}
		golden.Check(t, filepath.Join("testdata", "report-"+name+".golden"), b.Bytes())
	}
}
