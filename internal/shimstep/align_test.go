package shimstep

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/shimctl"
	"github.com/ptxmig/ptxmig/internal/shimctl/shimctltest"
)

// fakeRank is the shim of one rank: its collective count, the alignment it was armed with, and
// whether a launch reached it. Its launches advance by themselves (advance per status request)
// unless held.
type fakeRank struct {
	mu             sync.Mutex
	count, at      uint64
	held           bool
	advance        uint64 // collectives launched between two requests while not held
	passEveryAlign bool   // the rank has always just passed the collective asked for
	aligns         []uint64
}

var atRE = regexp.MustCompile(`"at":(\d+)`)

func (f *fakeRank) answer(line string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.held {
		f.count += f.advance
		if f.at > 0 && f.count >= f.at {
			f.count, f.held = f.at, true
		}
	}
	switch {
	case strings.Contains(line, `"cmd":"status"`):
		return reply("status", fmt.Sprintf(`{"pid":1,"proto":2,"collectives":{"count":%d,"hold_at":%d,"held":%v}}`, f.count, f.at, f.held), 2)
	case strings.Contains(line, `"cmd":"align"`):
		at, _ := strconv.ParseUint(atRE.FindStringSubmatch(line)[1], 10, 64)
		f.aligns = append(f.aligns, at)
		state := "armed"
		switch {
		case at == 0:
			f.at, f.held, state = 0, false, "running"
		case f.passEveryAlign:
			f.count = at
			state = "passed"
		case f.count >= at:
			state = "passed"
		default:
			f.at = at
		}
		return reply("align", fmt.Sprintf(`{"state":%q,"collectives":%d,"at":%d}`, state, f.count, at), 2)
	}
	return ""
}

// serveRanks serves a fake shim for each rank (nil: a process without the shim) and returns
// their pids and a dialer that reaches them.
func serveRanks(t *testing.T, ranks []*fakeRank) ([]int, func(context.Context, int) (*shimctl.Client, error)) {
	t.Helper()
	dir := t.TempDir()
	var pids []int
	for i, r := range ranks {
		pid := 1000 + i
		pids = append(pids, pid)
		if r != nil {
			shimctltest.ServeFunc(t, shimctl.SocketPath(dir, pid), r.answer)
		}
	}
	return pids, func(ctx context.Context, pid int) (*shimctl.Client, error) {
		if _, err := os.Stat(shimctl.SocketPath(dir, pid)); err != nil {
			return nil, shimctl.ErrNoShim
		}
		return shimctl.Dial(ctx, shimctl.SocketPath(dir, pid))
	}
}

// TestAlignStep: the ranks of a job are armed on the collective after the highest count and
// reported held; a rank that keeps passing it, or ranks that never get there, fail the step
// with everyone disarmed (rolled back); a single rank, or ranks without collectives, are left
// alone.
func TestAlignStep(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	run := func(t *testing.T, ranks []*fakeRank, wait time.Duration) (*Preemption, []int, error) {
		pids, dialer := serveRanks(t, ranks)
		p := NewPreemption(&op.Env{Log: log}, 0)
		p.dialer = dialer
		t.Cleanup(p.Close)
		_, err := op.Execute(context.Background(), []op.Step{p.AlignStep(pids, wait)}, nil, 0, log)
		return p, pids, err
	}
	t.Run("aligned", func(t *testing.T) {
		a, b := &fakeRank{count: 40, advance: 1}, &fakeRank{count: 37, advance: 1}
		p, pids, err := run(t, []*fakeRank{a, b}, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		for i, r := range []*fakeRank{a, b} {
			rep := p.report(pids[i]).Align
			if !r.held || r.count != r.at || rep == nil || rep.At != r.at || r.at < 41 {
				t.Errorf("rank %d: count %d at %d held %v, report %+v", i, r.count, r.at, r.held, rep)
			}
		}
		if a.at != b.at {
			t.Errorf("ranks armed on different collectives: %d and %d", a.at, b.at)
		}
		if len(p.aligned) != 2 {
			t.Errorf("the arming connections are not kept for the quiesce: %v", p.aligned)
		}
	})
	t.Run("one rank keeps passing", func(t *testing.T) {
		a, b := &fakeRank{count: 5}, &fakeRank{count: 5, passEveryAlign: true}
		_, _, err := run(t, []*fakeRank{a, b}, time.Second)
		var se *op.StepError
		if !errors.As(err, &se) || !se.RolledBack() || !strings.Contains(err.Error(), "kept passing") {
			t.Fatalf("err = %v, want a rolled-back failure", err)
		}
		if a.at != 0 || a.aligns[len(a.aligns)-1] != 0 {
			t.Errorf("rank left armed: at %d, aligns %v", a.at, a.aligns)
		}
	})
	t.Run("ranks do not get there", func(t *testing.T) {
		a, b := &fakeRank{count: 9}, &fakeRank{count: 3}
		_, pids, err := run(t, []*fakeRank{a, b}, 200*time.Millisecond)
		var se *op.StepError
		if !errors.As(err, &se) || !se.RolledBack() || !strings.Contains(err.Error(), fmt.Sprintf("pid %d at 3", pids[1])) {
			t.Fatalf("err = %v, want a rolled-back failure naming the rank behind", err)
		}
		if a.at != 0 || b.at != 0 {
			t.Errorf("ranks left armed: %d, %d", a.at, b.at)
		}
	})
	for _, tc := range []struct {
		name  string
		ranks []*fakeRank
	}{
		{"one rank", []*fakeRank{{count: 5}}},
		{"one rank under the shim", []*fakeRank{{count: 5}, nil}},
		{"no collectives yet", []*fakeRank{{}, {}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, _, err := run(t, tc.ranks, time.Second)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range tc.ranks {
				if r != nil && len(r.aligns) != 0 {
					t.Errorf("a rank was armed: %v", r.aligns)
				}
			}
			if len(p.aligned) != 0 {
				t.Errorf("connections kept: %v", p.aligned)
			}
		})
	}
}
