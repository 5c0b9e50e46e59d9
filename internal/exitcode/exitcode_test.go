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
