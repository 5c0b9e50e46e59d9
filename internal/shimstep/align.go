package shimstep

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/shimctl"
)

// StepAlign is the step that brings a job's processes to the same collective.
const StepAlign = "align"

// alignAttempts bounds how often the alignment is tried again when a process had already passed
// the collective it was asked to stop after.
const alignAttempts = 5

// AlignReport is what the alignment did to one process.
type AlignReport struct {
	At     uint64        `json:"at"`      // the collective it stopped after
	From   uint64        `json:"from"`    // its collective count when asked
	Waited time.Duration `json:"wait_ns"` // from the arming until every process was held
}

// AlignStep brings the processes of a job (several CUDA processes under the shim that launch
// collectives: NCCL ranks) to a stop right after the same collective, before they are quiesced
// and locked. Locked one by one as they run, a rank's collective kernel would wait for ever for
// a rank already locked, and the lock would time out (measured: a 2-rank DDP job over NCCL
// sockets). Each process's gate is armed to close right after its collective number N = the
// highest count + 1: every rank launches collective N, whose kernels then all run to their end,
// and submits nothing after it (a rank that raced past N before it was armed makes the alignment
// start again, further ahead). wait bounds how long the ranks may take to get there (0: no bound). Fewer than
// two such processes: nothing to do. A failure disarms every process (StepUndid): the job runs
// on as before. The undo disarms too; the arming connections become the quiesce leases.
func (p *Preemption) AlignStep(pids []int, wait time.Duration) op.Step {
	return op.Step{Name: StepAlign,
		Do: func(ctx context.Context) error {
			err := p.align(ctx, pids, wait)
			if err != nil {
				if p.aligned == nil {
					return err // nothing was armed
				}
				return op.StepUndid(err, p.disarm(context.WithoutCancel(ctx)))
			}
			return nil
		},
		Undo: p.disarm}
}

func (p *Preemption) align(ctx context.Context, pids []int, wait time.Duration) error {
	clients := map[int]*shimctl.Client{}
	counts := map[int]uint64{}
	for _, pid := range pids {
		dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		c, err := p.dial(dctx, pid)
		cancel()
		if err != nil {
			continue // no shim: the driver lock decides, as for any process without one
		}
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		st, err := c.StatusBrief(sctx)
		cancel()
		if err != nil || st.Collectives == nil || st.Collectives.Count == 0 {
			c.Close()
			continue
		}
		clients[pid], counts[pid] = c, st.Collectives.Count
	}
	if len(clients) < 2 {
		for _, c := range clients {
			c.Close()
		}
		return nil
	}
	p.aligned = clients
	order := make([]int, 0, len(clients))
	for pid := range clients {
		order = append(order, pid)
	}
	for attempt := 1; attempt <= alignAttempts; attempt++ {
		// The next collective, then further ahead each time a rank raced past it.
		var at uint64
		for _, n := range counts {
			at = max(at, n+1<<(attempt-1))
		}
		// The ranks furthest on are armed first: they are the nearest to passing at.
		slices.SortFunc(order, func(a, b int) int { return int(counts[b]) - int(counts[a]) })
		from := map[int]uint64{}
		passed := false
		t0 := time.Now()
		for _, pid := range order {
			r, err := clients[pid].Align(ctx, at)
			if err != nil {
				return fmt.Errorf("align pid %d on collective %d: %w", pid, at, err)
			}
			from[pid], counts[pid] = r.Collectives, r.Collectives
			passed = passed || r.State == shimctl.AlignPassed
		}
		if passed {
			if err := p.disarmAll(ctx); err != nil {
				return err
			}
			continue
		}
		held, err := p.waitHeld(ctx, order, counts, wait)
		if err != nil {
			return err
		}
		if held {
			for _, pid := range order {
				p.report(pid).Align = &AlignReport{At: at, From: from[pid], Waited: time.Since(t0)}
			}
			return nil
		}
		var behind []string
		for _, pid := range order {
			if counts[pid] < at {
				behind = append(behind, fmt.Sprintf("pid %d at %d", pid, counts[pid]))
			}
		}
		return fmt.Errorf("the job's processes did not all reach collective %d within %s (%s): one may wait for something "+
			"other than a collective (a host-side barrier, input), or the job runs collectives rarely; --lock-timeout gives them longer",
			at, wait, strings.Join(behind, ", "))
	}
	return fmt.Errorf("the job's processes kept passing the collective they were asked to stop after (%d tries)", alignAttempts)
}

// waitHeld polls the armed processes until every one is held (true) or wait has passed (false);
// counts is updated with what they report.
func (p *Preemption) waitHeld(ctx context.Context, pids []int, counts map[int]uint64, wait time.Duration) (bool, error) {
	deadline := time.Now().Add(wait)
	nap := 500 * time.Microsecond
	for {
		all := true
		for _, pid := range pids {
			sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			st, err := p.aligned[pid].StatusBrief(sctx)
			cancel()
			if err != nil {
				return false, fmt.Errorf("status of pid %d while aligning: %w", pid, err)
			}
			if st.Collectives == nil {
				return false, fmt.Errorf("status of pid %d while aligning: %w: no collectives", pid, shimctl.ErrProtocol)
			}
			counts[pid] = st.Collectives.Count
			all = all && st.Collectives.Held
		}
		if all {
			return true, nil
		}
		if wait > 0 && time.Now().After(deadline) {
			return false, nil
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-time.After(nap):
		}
		nap = min(2*nap, 50*time.Millisecond)
	}
}

// disarmAll disarms every armed process, keeping the connections.
func (p *Preemption) disarmAll(ctx context.Context) error {
	var errs []error
	for pid, c := range p.aligned {
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		if _, err := c.Align(actx, 0); err != nil {
			errs = append(errs, fmt.Errorf("disarm pid %d: %w", pid, err))
		}
		cancel()
	}
	return errors.Join(errs...)
}

// disarm disarms the processes still armed (those not quiesced since) and closes their
// connections (closing alone disarms too: the arming is a lease).
func (p *Preemption) disarm(ctx context.Context) error {
	err := p.disarmAll(ctx)
	for pid, c := range p.aligned {
		c.Close()
		delete(p.aligned, pid)
	}
	return err
}
