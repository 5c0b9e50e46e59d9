package main

import (
	"bytes"
	"testing"

	"github.com/ptxmig/ptxmig/internal/shimctl"
	"github.com/ptxmig/ptxmig/internal/shimstep"
)

// TestPrintPreemption: per process under the shim, the quiesce's stops (between blocks or inside
// them), what it left to the driver lock, and the resume; processes without the shim print nothing.
func TestPrintPreemption(t *testing.T) {
	q := &shimctl.Quiesce{State: "quiesced", ElapsedUS: 243, Preempted: []shimctl.PreemptedLaunch{
		{Launch: 1, Kernel: "hashgrid", BlocksDone: 36, BlocksTotal: 500, Stop: shimctl.StopBlockBoundary},
		{Launch: 2, Kernel: "monte_carlo", BlocksDone: 0, BlocksTotal: 528, MidBlock: true, Stop: shimctl.StopMidBlock, Records: 528},
		{Launch: 3, Kernel: "old\x1bshim", BlocksDone: 1, BlocksTotal: 2},
	}, NotStopped: []shimctl.LaunchNote{{Launch: 4, Kernel: "k2", Reason: "not the tail of its stream"}}}
	var b bytes.Buffer
	printPreemption(&b, []*shimstep.PreemptReport{
		{PID: 7, Shim: true, Quiesce: q, Resume: &shimctl.Resume{State: "running", Relaunched: 3, ElapsedUS: 120}},
		{PID: 8, Shim: false, Note: "no shim"},
	})
	want := "pid 7: quiesced in 0.24 ms (3 preempted, 0 drained, 1 left to the lock)\n" +
		"  preempted hashgrid between blocks: 36 of 500 blocks done\n" +
		"  preempted monte_carlo mid-block (528 CTAs saved): 0 of 528 blocks done\n" +
		"  preempted old\\x1bshim between blocks: 1 of 2 blocks done\n" +
		"  not preempted k2: not the tail of its stream\n" +
		"pid 7: resumed (3 relaunched) in 0.12 ms\n"
	if b.String() != want {
		t.Errorf("got:\n%s\nwant:\n%s", b.String(), want)
	}
}
