package rebalance

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/atomicfile"
)

// State file layout inside the state directory (<store>/rebalance).
const (
	StateFile    = "state.json"
	LockFile     = "lock"
	stateVersion = 1
	// maxStateBytes bounds what LoadState reads; maxRecords bounds the history kept.
	maxStateBytes = 8 << 20
	maxRecords    = 4096
)

// ErrCorruptState marks a state file that could not be used; LoadState resets it.
var ErrCorruptState = errors.New("corrupt rebalance state file")

// MoveRecord is one attempted move, successful or not.
type MoveRecord struct {
	PID        int       `json:"pid"`
	StartTicks uint64    `json:"start_ticks"`
	Comm       string    `json:"comm,omitempty"`
	From       string    `json:"from_uuid"`
	To         string    `json:"to_uuid"`
	FromIndex  int       `json:"from_index"`
	ToIndex    int       `json:"to_index"`
	At         time.Time `json:"at"`
	OK         bool      `json:"ok"`
	Error      string    `json:"error,omitempty"`
	Seconds    float64   `json:"seconds"`
}

// Key identifies the moved process (see Process.Key).
func (m MoveRecord) Key() string { return procKey(m.PID, m.StartTicks) }

// Totals are counters kept across runs (exported as Prometheus counters).
type Totals struct {
	Runs        uint64    `json:"runs"`
	Moves       uint64    `json:"moves"`
	Failures    uint64    `json:"failures"`
	LastRun     time.Time `json:"last_run,omitzero"`
	LastSuccess time.Time `json:"last_success,omitzero"`
}

// State is what one run leaves for the next.
type State struct {
	Version int          `json:"version"`
	History []MoveRecord `json:"history"`
	Totals  Totals       `json:"totals"`
}

// Validate checks every field read from disk.
func (s *State) Validate() error {
	if s.Version != stateVersion {
		return fmt.Errorf("version %d, want %d", s.Version, stateVersion)
	}
	if len(s.History) > maxRecords {
		return fmt.Errorf("%d history records, at most %d", len(s.History), maxRecords)
	}
	for i, m := range s.History {
		switch {
		case m.PID <= 0 || m.PID > 1<<22:
			return fmt.Errorf("history[%d]: pid %d", i, m.PID)
		case !validUUID(m.From) || !validUUID(m.To):
			return fmt.Errorf("history[%d]: bad GPU UUID %q -> %q", i, m.From, m.To)
		case m.At.IsZero():
			return fmt.Errorf("history[%d]: no time", i)
		case m.Seconds < 0 || m.FromIndex < 0 || m.ToIndex < 0:
			return fmt.Errorf("history[%d]: negative value", i)
		}
	}
	return nil
}

// validUUID accepts NVML UUIDs ("GPU-…", "MIG-…") of sane length and plain characters.
func validUUID(s string) bool {
	if len(s) < 4 || len(s) > 96 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '/' || c == '_') {
			return false
		}
	}
	return true
}

// Prune drops history older than keep and all but the newest maxRecords records.
func (s *State) Prune(now time.Time, keep time.Duration) {
	out := s.History[:0]
	for _, m := range s.History {
		if now.Sub(m.At) <= keep {
			out = append(out, m)
		}
	}
	if len(out) > maxRecords {
		out = out[len(out)-maxRecords:]
	}
	s.History = out
}

// EnsureDir creates the state directory (0700) and refuses a symlink or non-directory there.
func EnsureDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("state directory: %w", err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("state directory: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("state directory %s: not a directory (symlinks are refused)", dir)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		if err := os.Chmod(dir, 0o700); err != nil {
			return fmt.Errorf("state directory: %w", err)
		}
	}
	return nil
}

// LoadState reads dir/state.json. A missing file gives an empty state. A corrupt, invalid or
// unreadable-as-state file (a symlink included) is logged as a warning and an empty state is
// returned with the reason in warning: a broken file never stops rebalancing. With moveAside the
// file is renamed to state.json.corrupt-<unix time> (kept, never deleted) so the next save does
// not overwrite it.
func LoadState(dir string, now time.Time, moveAside bool, log *slog.Logger) (st *State, warning string, err error) {
	file := filepath.Join(dir, StateFile)
	fresh := &State{Version: stateVersion}
	f, err := os.OpenFile(file, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, os.ErrNotExist) {
		return fresh, "", nil
	}
	var b []byte
	if err == nil {
		var fi os.FileInfo
		if fi, err = f.Stat(); err == nil && !fi.Mode().IsRegular() {
			err = errors.New("not a regular file")
		}
		if err == nil {
			b, err = io.ReadAll(io.LimitReader(f, maxStateBytes+1))
		}
		f.Close()
		if err == nil && len(b) > maxStateBytes {
			err = fmt.Errorf("larger than %d bytes", maxStateBytes)
		}
	} else if !errors.Is(err, unix.ELOOP) {
		return nil, "", fmt.Errorf("read state %s: %w", file, err)
	}
	if err == nil {
		err = decodeState(b, fresh)
	}
	if err == nil {
		return fresh, "", nil
	}
	warning = fmt.Sprintf("%s: %v; starting with an empty history", file, fmt.Errorf("%w: %v", ErrCorruptState, err))
	if moveAside {
		aside := fmt.Sprintf("%s.corrupt-%d", file, now.Unix())
		if rerr := os.Rename(file, aside); rerr != nil {
			warning += fmt.Sprintf(" (could not move it aside: %v)", rerr)
		} else {
			warning += " (old file kept as " + filepath.Base(aside) + ")"
		}
	}
	log.Warn("rebalance state reset", "file", file, "err", err)
	return &State{Version: stateVersion}, warning, nil
}

func decodeState(b []byte, st *State) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(st); err != nil {
		return err
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("data after the JSON object")
	}
	return st.Validate()
}

// SaveState writes dir/state.json atomically (temp file, fsync, rename, fsync dir), mode 0600.
func SaveState(dir string, st *State) error {
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return fmt.Errorf("encode state: %w", err)
	}
	return atomicfile.WriteFile(filepath.Join(dir, StateFile), append(b, '\n'), 0o600)
}
