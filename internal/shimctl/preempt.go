package shimctl

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"
)

// Preemption requests (protocol version 2; docs/SHIM-PROTOCOL.md "Preemption").

// ErrNoPreemption: the shim speaks protocol 1 and cannot quiesce.
var ErrNoPreemption = fmt.Errorf("%w: the shim has no preemption (protocol 1)", ErrShim)

// Limits on what a quiesce or resume reply may list; a longer list is a protocol error.
const (
	maxListed    = 1 << 16
	maxBudget    = 60 * time.Second
	maxNameBytes = 4096
)

// PreemptedLaunch is a stopped twin; its remainder runs on resume.
type PreemptedLaunch struct {
	Launch      uint64 `json:"launch"`
	Kernel      string `json:"kernel"`
	Stream      string `json:"stream"`
	BlocksDone  uint64 `json:"blocks_done"`
	BlocksTotal uint64 `json:"blocks_total"`
	// MidBlock: the twin was launched able to stop inside a block. Stop is StopMidBlock when at
	// least one CTA did (Records of them saved their state), else StopBlockBoundary (also from
	// shims before mid-block twins, which send neither field).
	MidBlock bool   `json:"mid_block"`
	Stop     string `json:"stop,omitempty"`
	Records  uint64 `json:"records"`
}

// Where a preempted twin stopped.
const (
	StopBlockBoundary = "block boundary"
	StopMidBlock      = "mid-block"
)

// MidBlockStop reports whether the launch stopped inside a block.
func (p PreemptedLaunch) MidBlockStop() bool { return p.Stop == StopMidBlock }

// LaunchNote names a launch and, where it was not stopped, why.
type LaunchNote struct {
	Launch uint64 `json:"launch,omitempty"`
	Kernel string `json:"kernel"`
	Reason string `json:"reason,omitempty"`
}

// Quiesce is the reply to "quiesce".
type Quiesce struct {
	State      string            `json:"state"`
	ElapsedUS  int64             `json:"elapsed_us"`
	Preempted  []PreemptedLaunch `json:"preempted"`
	Drained    []LaunchNote      `json:"drained"`
	NotStopped []LaunchNote      `json:"not_stopped"`
	Originals  []LaunchNote      `json:"originals"`
	Gate       string            `json:"gate"`
	// PeerLinks: peer links the process has enabled (0 from shims that predate peer-off); ptxmig
	// turns them off (PeerOff) before the driver lock.
	PeerLinks int `json:"peer_links,omitempty"`
	// Stopping lists the launches still stopping when the reply was sent (preempt raised, not yet
	// ended): the shim keeps raising; status.preempt.stopping counts those left.
	Stopping []uint64 `json:"stopping,omitempty"`
}

// Resume is the reply to "resume".
type Resume struct {
	State      string        `json:"state"`
	Was        string        `json:"was"`
	Relaunched int           `json:"relaunched"`
	Errors     []ResumeError `json:"errors,omitempty"` // relaunches the driver refused
	ElapsedUS  int64         `json:"elapsed_us"`
}

// ResumeError is a relaunch that failed; Error is the driver's CUresult.
type ResumeError struct {
	Launch uint64 `json:"launch"`
	Kernel string `json:"kernel"`
	Error  int    `json:"error"`
}

// preemptRaw sends a request of protocol 2 (preemption). It does not ask for the shim's version
// first when no reply has told it yet: every reply carries it, and a status costs far more than
// the request itself (a PyTorch DDP rank's status: 136 KB, 1.8-1.9 s on an H200 host, all of it
// inside what a quiesce measured). A protocol-1 shim answers the unknown command with an error
// that says its version, reported as ErrNoPreemption.
func (c *Client) preemptRaw(ctx context.Context, cmd string, args map[string]any) (json.RawMessage, error) {
	if c.proto == 1 {
		return nil, ErrNoPreemption
	}
	raw, err := c.Raw(ctx, cmd, args)
	if c.proto == 1 {
		return nil, ErrNoPreemption
	}
	return raw, err
}

// Quiesce closes the shim's gate, stops the preemptible kernels in flight and waits up to budget
// for them. The quiesce is a lease held by this connection: closing the client without Detach
// makes the shim resume by itself.
func (c *Client) Quiesce(ctx context.Context, budget time.Duration) (*Quiesce, error) {
	if budget <= 0 || budget > maxBudget {
		return nil, fmt.Errorf("quiesce: budget %s out of range (0, %s]", budget, maxBudget)
	}
	ms := max(1, budget.Milliseconds())
	raw, err := c.preemptRaw(ctx, "quiesce", map[string]any{"budget_ms": ms})
	if err != nil {
		return nil, err
	}
	var q Quiesce
	if err := json.Unmarshal(raw, &q); err != nil {
		return nil, fmt.Errorf("quiesce: %w: %v", ErrProtocol, err)
	}
	if err := q.validate(); err != nil {
		return nil, fmt.Errorf("quiesce: %w: %v", ErrProtocol, err)
	}
	return &q, nil
}

func (q *Quiesce) validate() error {
	if q.State != "quiesced" {
		return fmt.Errorf("state %q, want quiesced", q.State)
	}
	if q.ElapsedUS < 0 || q.PeerLinks < 0 {
		return fmt.Errorf("elapsed_us %d, peer_links %d", q.ElapsedUS, q.PeerLinks)
	}
	if len(q.Preempted)+len(q.Drained)+len(q.NotStopped)+len(q.Originals) > maxListed {
		return fmt.Errorf("more than %d launches listed", maxListed)
	}
	for _, p := range q.Preempted {
		if p.BlocksDone > p.BlocksTotal || len(p.Kernel) > maxNameBytes || len(p.Stream) > 64 {
			return fmt.Errorf("preempted launch %d: %d of %d blocks", p.Launch, p.BlocksDone, p.BlocksTotal)
		}
		switch {
		case p.Stop != "" && p.Stop != StopBlockBoundary && p.Stop != StopMidBlock:
			return fmt.Errorf("preempted launch %d: stop %q", p.Launch, p.Stop)
		case (p.Stop == StopMidBlock) != (p.Records > 0), p.Records > 0 && !p.MidBlock:
			return fmt.Errorf("preempted launch %d: stop %q with %d records", p.Launch, p.Stop, p.Records)
		}
	}
	for _, l := range [][]LaunchNote{q.Drained, q.NotStopped, q.Originals} {
		for _, n := range l {
			if len(n.Kernel) > maxNameBytes || len(n.Reason) > maxNameBytes {
				return fmt.Errorf("launch %d: name or reason too long", n.Launch)
			}
		}
	}
	return nil
}

// Detach keeps the process quiesced after this connection closes (sent once the driver holds
// the process, before CRIU dumps it). The shim closes the connection after its reply; Detach
// waits for that, so no connection of the process is open when it returns.
func (c *Client) Detach(ctx context.Context) error {
	if _, err := c.preemptRaw(ctx, "detach", nil); err != nil {
		return err
	}
	deadline := time.Now().Add(5 * time.Second)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = c.conn.SetReadDeadline(deadline)
	if _, err := c.r.ReadByte(); err == nil {
		return fmt.Errorf("detach: %w: the shim kept the connection open", ErrProtocol)
	} else if !errors.Is(err, io.EOF) {
		return fmt.Errorf("detach: waiting for the shim to close the connection: %w", err)
	}
	return nil
}

// PeerSet is the reply to peer-off and peer-on: the peer links the process has, whether this
// request changed their state, and how long the wait for the contexts' queued work took.
type PeerSet struct {
	Links     int   `json:"links"`
	Changed   bool  `json:"changed"`
	SyncUS    int64 `json:"sync_us"`
	ElapsedUS int64 `json:"elapsed_us"`
	// LargestDeviceAlloc: the largest live cuMemAlloc allocation, read while quiesced (0 from
	// older shims).
	LargestDeviceAlloc uint64 `json:"largest_device_alloc,omitempty"`
}

// PeerOff (quiesced, the lease's connection) waits for the work queued in every context with a
// peer link, then disables every link, so that the driver can restore the process; PeerOn (or the
// resume) enables them again. ErrNoPeerToggle: an older shim, which cannot.
func (c *Client) PeerOff(ctx context.Context) (*PeerSet, error) { return c.peerSet(ctx, "peer-off") }

// PeerOn enables the links PeerOff disabled; a no-op when they are on.
func (c *Client) PeerOn(ctx context.Context) (*PeerSet, error) { return c.peerSet(ctx, "peer-on") }

// ErrNoPeerToggle: the shim predates peer-off and peer-on.
var ErrNoPeerToggle = fmt.Errorf("%w: the shim cannot turn peer access off (it predates peer-off)", ErrShim)

func (c *Client) peerSet(ctx context.Context, cmd string) (*PeerSet, error) {
	raw, err := c.preemptRaw(ctx, cmd, nil)
	if err != nil {
		if strings.Contains(err.Error(), "unknown cmd") {
			return nil, ErrNoPeerToggle
		}
		return nil, err
	}
	var r PeerSet
	if err := json.Unmarshal(raw, &r); err != nil || r.Links < 0 || r.SyncUS < 0 || r.ElapsedUS < 0 {
		return nil, fmt.Errorf("%s: %w: %v", cmd, ErrProtocol, err)
	}
	return &r, nil
}

// Resume relaunches the remainders of preempted kernels and opens the gate; idempotent.
func (c *Client) Resume(ctx context.Context) (*Resume, error) {
	raw, err := c.preemptRaw(ctx, "resume", nil)
	if err != nil {
		return nil, err
	}
	var r Resume
	if err := json.Unmarshal(raw, &r); err != nil {
		return nil, fmt.Errorf("resume: %w: %v", ErrProtocol, err)
	}
	if r.State != "running" || r.Relaunched < 0 || r.Relaunched > maxListed || len(r.Errors) > maxListed {
		return nil, fmt.Errorf("resume: %w: state %q, relaunched %d", ErrProtocol, r.State, r.Relaunched)
	}
	return &r, nil
}
