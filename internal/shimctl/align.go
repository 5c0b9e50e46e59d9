package shimctl

import (
	"context"
	"encoding/json"
	"fmt"
)

// Collectives is the shim's count of collective launches (NCCL's kernels: ncclDevKernel_*,
// ncclKernel_*) and its alignment hold (status "collectives").
type Collectives struct {
	Count  uint64 `json:"count"`   // collective kernels launched since the process started
	HoldAt uint64 `json:"hold_at"` // armed: the gate closes right after launch number HoldAt (0: not armed)
	Held   bool   `json:"held"`    // the gate is closed by the alignment
}

// Align states of an "align" reply.
const (
	AlignArmed   = "armed"   // the gate will close right after collective At is launched
	AlignPassed  = "passed"  // the process had launched At collectives already: not armed
	AlignHeld    = "held"    // the process launched collective At: its gate is closed
	AlignRunning = "running" // disarmed (At 0): the gate the alignment closed is open again
)

// AlignReply is the result of an "align" request.
type AlignReply struct {
	State       string `json:"state"`
	Collectives uint64 `json:"collectives"`
	At          uint64 `json:"at"`
}

// Align arms the process's gate to close right after its collective launch number at (at 0:
// disarm, reopening a gate the alignment closed). Every rank of a job armed with the same at
// stops right after the same collective, whose kernels then all run to their end: none waits
// for a rank that is held. The arming is a lease of this connection: closing it disarms, unless
// a quiesce on the same connection took over.
func (c *Client) Align(ctx context.Context, at uint64) (*AlignReply, error) {
	raw, err := c.preemptRaw(ctx, "align", map[string]any{"at": at})
	if err != nil {
		return nil, err
	}
	var r AlignReply
	if err := json.Unmarshal(raw, &r); err != nil {
		return nil, fmt.Errorf("align: %w: %v", ErrProtocol, err)
	}
	switch {
	case r.At != at:
		return nil, fmt.Errorf("align: %w: answered for %d, asked %d", ErrProtocol, r.At, at)
	case at == 0 && r.State != AlignRunning,
		at > 0 && r.State != AlignArmed && r.State != AlignPassed && r.State != AlignHeld:
		return nil, fmt.Errorf("align: %w: state %q for at %d", ErrProtocol, r.State, at)
	}
	return &r, nil
}
