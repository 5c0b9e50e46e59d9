package main

import (
	"errors"
	"testing"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/op"
)

// TestErrorDocOperation: an operation's failure after preflight fills the one --json error
// document with the failed step, rolled_back, committed and the undone steps, merged with the
// command's partial result; other errors carry none of them.
func TestErrorDocOperation(t *testing.T) {
	boom := errors.New("boom")
	committed := &op.Failure{StepError: &op.StepError{Step: "store", Err: boom, Touched: true, Committed: true}, State: "pid 42 is gone"}
	rolledBack := &op.Failure{StepError: &op.StepError{Step: "criu-dump", Err: boom, Touched: true, Undone: []string{"lock"}}, LogDir: "/var/log/ptxmig/x"}
	tests := []struct {
		name       string
		err        error
		code       int
		committed  any // nil: no such member
		rolledBack any
		extra      map[string]any
	}{
		{"committed", withOpExitCode(committed), 1, true, false, map[string]any{"failed_step": "store", "process_state": "pid 42 is gone"}},
		{"rolled back", withOpExitCode(rolledBack), 4, false, true, map[string]any{"failed_step": "criu-dump", "log_dir": "/var/log/ptxmig/x"}},
		{"bare step error", withOpExitCode(&op.StepError{Step: "unlock", Err: boom, Committed: true}), 1, true, false, nil},
		{"with a result", withResult(withOpExitCode(committed), map[string]any{"moves": 1}), 1, true, false, map[string]any{"moves": float64(1)}},
		{"refusal", withOpExitCode(op.Refusef("no")), 3, nil, nil, nil},
		{"plain", boom, 1, nil, nil, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fail := &cli.Command{Name: "zz-fail", Usage: "test", Action: func(*cli.Context) error { return tt.err }}
			commands = append(commands, fail)
			defer func() { commands = commands[:len(commands)-1] }()
			out, _, code := runCLI(t, "--json", "zz-fail")
			m := oneJSON(t, tt.name, out)
			if code != tt.code || m["exit_code"] != float64(tt.code) {
				t.Fatalf("exit %d, document %s; want exit %d", code, out, tt.code)
			}
			for key, want := range map[string]any{"committed": tt.committed, "rolled_back": tt.rolledBack} {
				if got, ok := m[key]; (want == nil && ok) || (want != nil && got != want) {
					t.Errorf("%s = %v (present %v), want %v:\n%s", key, got, ok, want, out)
				}
			}
			for key, want := range tt.extra {
				if m[key] != want {
					t.Errorf("%s = %v, want %v:\n%s", key, m[key], want, out)
				}
			}
		})
	}
}
