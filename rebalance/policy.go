package rebalance

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path"
	"strconv"
	"time"
)

// ErrBadPolicy marks an invalid policy file or value.
var ErrBadPolicy = errors.New("invalid rebalance policy")

// Duration is a time.Duration written as a Go duration string ("90s", "10m") in policy files.
type Duration time.Duration

func (d Duration) String() string { return time.Duration(d).String() }

// MarshalJSON writes the duration string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

// UnmarshalJSON accepts a duration string such as "60s" or "10m".
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("want a duration string such as \"60s\", got %s", b)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// Pins are processes the operator forbids moving. A process whose environment holds
// PTXMIG_PIN=1 is pinned as well, whatever the policy says.
type Pins struct {
	PIDs []int `json:"pids,omitempty"`
	// Names are shell patterns (path.Match) matched against the process name (comm) and the base
	// name of argv[0].
	Names []string `json:"names,omitempty"`
}

// Policy is everything the planner and the runner are told. Zero values are not defaults: start
// from DefaultPolicy (ParsePolicy does).
type Policy struct {
	// BusyThreshold, in percent: a GPU at or above it is a candidate source.
	BusyThreshold float64 `json:"busy_threshold"`
	// MemoryMarginMiB: a target needs the process's memory plus this much free.
	MemoryMarginMiB uint64 `json:"memory_margin_mib"`
	// WeightLoad and WeightPower weigh the predicted load and power improvements (normalised by
	// their sum); MinImprovement is the score a move must exceed (0..1).
	WeightLoad     float64 `json:"weight_load"`
	WeightPower    float64 `json:"weight_power"`
	MinImprovement float64 `json:"min_improvement"`
	// MinAge: younger processes are left alone. Cooldown: a process moved (or tried) within it is
	// left alone; it doubles with each further move of the same process inside ReturnWindow.
	MinAge   Duration `json:"min_age"`
	Cooldown Duration `json:"cooldown"`
	// ReturnWindow: a process is never moved back onto a GPU it left within this window (no
	// ping-pong); history older than it is forgotten.
	ReturnWindow Duration `json:"return_window"`
	// MaxMoves per run.
	MaxMoves int `json:"max_moves"`
	// Window is how long GPU load is sampled before planning.
	Window Duration `json:"window"`
	// LockTimeout bounds how long a migration may hold the process locked in the driver.
	LockTimeout Duration `json:"lock_timeout"`
	// RequireShim leaves processes that do not run under libptxmig.so alone.
	RequireShim bool `json:"require_shim"`
	Pin         Pins `json:"pin"`
}

// DefaultPolicy is the policy used when no file or flag says otherwise.
func DefaultPolicy() Policy {
	return Policy{
		BusyThreshold:   70,
		MemoryMarginMiB: 1024,
		WeightLoad:      0.6,
		WeightPower:     0.4,
		MinImprovement:  0.05,
		MinAge:          Duration(60 * time.Second),
		Cooldown:        Duration(10 * time.Minute),
		ReturnWindow:    Duration(24 * time.Hour),
		MaxMoves:        1,
		Window:          Duration(5 * time.Second),
		LockTimeout:     Duration(10 * time.Second),
	}
}

// maxPolicyBytes bounds what ParsePolicy reads.
const maxPolicyBytes = 1 << 20

// LoadPolicy reads a policy file (JSON, see docs/REBALANCE.md) over the defaults.
func LoadPolicy(file string) (Policy, error) {
	f, err := os.Open(file)
	if err != nil {
		return Policy{}, fmt.Errorf("policy file: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxPolicyBytes+1))
	if err != nil {
		return Policy{}, fmt.Errorf("policy file %s: %w", file, err)
	}
	if len(b) > maxPolicyBytes {
		return Policy{}, fmt.Errorf("policy file %s: larger than %d bytes: %w", file, maxPolicyBytes, ErrBadPolicy)
	}
	p, err := ParsePolicy(b)
	if err != nil {
		return Policy{}, fmt.Errorf("policy file %s: %w", file, err)
	}
	return p, nil
}

// ParsePolicy decodes a JSON policy over DefaultPolicy: absent keys keep their defaults, unknown
// keys are errors, and the result is validated.
func ParsePolicy(b []byte) (Policy, error) {
	p := DefaultPolicy()
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		return Policy{}, fmt.Errorf("%w: %v", ErrBadPolicy, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return Policy{}, fmt.Errorf("%w: data after the JSON object", ErrBadPolicy)
	}
	if err := p.Validate(); err != nil {
		return Policy{}, err
	}
	return p, nil
}

// Validate checks every field's range.
func (p Policy) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrBadPolicy, fmt.Sprintf(format, args...))
	}
	finite := func(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }
	switch {
	case !finite(p.BusyThreshold) || p.BusyThreshold <= 0 || p.BusyThreshold > 100:
		return bad("busy_threshold %v: want a percentage in (0, 100]", p.BusyThreshold)
	case p.MemoryMarginMiB > 1<<30:
		return bad("memory_margin_mib %d: too large", p.MemoryMarginMiB)
	case !finite(p.WeightLoad) || !finite(p.WeightPower) || p.WeightLoad < 0 || p.WeightPower < 0 || p.WeightLoad+p.WeightPower == 0:
		return bad("weight_load %v, weight_power %v: want non-negative weights, not both 0", p.WeightLoad, p.WeightPower)
	case !finite(p.MinImprovement) || p.MinImprovement < 0 || p.MinImprovement >= 1:
		return bad("min_improvement %v: want a score in [0, 1)", p.MinImprovement)
	case p.MinAge < 0 || p.Cooldown < 0 || p.ReturnWindow < 0 || p.LockTimeout < 0:
		return bad("durations must not be negative")
	case p.Window < 0 || time.Duration(p.Window) > 10*time.Minute:
		return bad("window %s: want 0 to 10m", p.Window)
	case p.MaxMoves < 1 || p.MaxMoves > 64:
		return bad("max_moves %d: want 1 to 64", p.MaxMoves)
	}
	for _, pid := range p.Pin.PIDs {
		if pid <= 0 {
			return bad("pin.pids: %d is not a PID", pid)
		}
	}
	for _, n := range p.Pin.Names {
		if n == "" {
			return bad("pin.names: empty pattern")
		}
		if _, err := path.Match(n, ""); err != nil {
			return bad("pin.names: pattern %q: %v", n, err)
		}
	}
	return nil
}

// pinReason says why p is pinned, or "" when it is not. unknown is set when the environment could
// not be read, so PTXMIG_PIN cannot be ruled out.
func (p Policy) pinReason(pr Process) string {
	for _, pid := range p.Pin.PIDs {
		if pid == pr.PID {
			return "pinned by PID (policy or --pin)"
		}
	}
	names := []string{pr.Comm}
	if len(pr.Cmdline) > 0 {
		names = append(names, path.Base(pr.Cmdline[0]))
	}
	for _, pat := range p.Pin.Names {
		for _, n := range names {
			if ok, _ := path.Match(pat, n); ok && n != "" {
				return "pinned by name pattern " + strconv.Quote(pat)
			}
		}
	}
	if pr.EnvPin {
		return "pinned by PTXMIG_PIN=1 in its environment"
	}
	return ""
}
