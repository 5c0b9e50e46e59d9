package exitcode

import (
	"errors"
	"fmt"
	"testing"
)

func TestOf(t *testing.T) {
	base := errors.New("boom")
	tests := []struct {
		name string
		err  error
		want int
	}{
		{"nil", nil, OK},
		{"plain", base, Failed},
		{"usage", Usagef("bad %s", "flag"), Usage},
		{"refused wrapped by fmt", fmt.Errorf("checkpoint: %w", Refusedf("no root")), Refused},
		{"rolled back", Wrap(RolledBack, base), RolledBack},
		{"busy", Wrap(Busy, base), Busy},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Of(tt.err); got != tt.want {
				t.Fatalf("Of(%v) = %d, want %d", tt.err, got, tt.want)
			}
		})
	}
	if !errors.Is(Wrap(RolledBack, base), base) {
		t.Fatal("Wrap hides the cause from errors.Is")
	}
	if Wrap(Failed, nil) != nil {
		t.Fatal("Wrap(nil) must be nil")
	}
}

// TestCodes: the table holds every status once, in ascending order, each with a distinct kind
// and a meaning; Name gives the kind, "failed" for a code outside the table.
func TestCodes(t *testing.T) {
	want := []int{OK, Failed, Usage, Refused, RolledBack, Busy, NotFound, RunFailed, RunNoExec, RunNotFound, Interrupted}
	if len(Codes) != len(want) {
		t.Fatalf("%d codes in the table, want %d", len(Codes), len(want))
	}
	kinds := map[string]bool{}
	for i, c := range Codes {
		if c.Code != want[i] || c.Kind == "" || c.Meaning == "" || kinds[c.Kind] {
			t.Errorf("Codes[%d] = %+v, want code %d with a new kind and a meaning", i, c, want[i])
		}
		kinds[c.Kind] = true
		if Name(c.Code) != c.Kind {
			t.Errorf("Name(%d) = %q, want %q", c.Code, Name(c.Code), c.Kind)
		}
	}
	for code, name := range map[int]string{NotFound: "not-found", RunFailed: "run-failed", RunNoExec: "cannot-execute",
		RunNotFound: "command-not-found", Interrupted: "interrupted", RolledBack: "rolled-back", 7: "failed", -1: "failed"} {
		if Name(code) != name {
			t.Errorf("Name(%d) = %q, want %q", code, Name(code), name)
		}
	}
}
