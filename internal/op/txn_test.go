package op

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"reflect"
	"strings"
	"testing"
)

// TestExecute drives the transaction executor through every failure point with a recording fake.
func TestExecute(t *testing.T) {
	errBoom := errors.New("boom")
	tests := []struct {
		name       string
		failDo     string // step whose Do fails
		failUndo   string // step whose Undo fails
		hookFail   string // step failed by the hook
		cancelAt   string // cancel the context inside this step's Do (it still succeeds)
		wantLog    []string
		wantErr    bool
		wantRolled bool
		wantUndone []string
	}{
		{name: "all succeed", wantLog: []string{"do lock", "do checkpoint", "do dump", "do store"}},
		{name: "first step fails: nothing to undo", failDo: "lock", wantErr: true,
			wantLog: []string{"do lock"}},
		{name: "dump fails: checkpoint and lock undone in reverse", failDo: "dump", wantErr: true, wantRolled: true,
			wantLog:    []string{"do lock", "do checkpoint", "do dump", "undo checkpoint", "undo lock"},
			wantUndone: []string{"checkpoint", "lock"}},
		{name: "store fails: steps without undo skipped", failDo: "store", wantErr: true, wantRolled: true,
			wantLog:    []string{"do lock", "do checkpoint", "do dump", "do store", "undo dump", "undo checkpoint", "undo lock"},
			wantUndone: []string{"dump", "checkpoint", "lock"}},
		{name: "injected failure before dump", hookFail: "dump", wantErr: true, wantRolled: true,
			wantLog:    []string{"do lock", "do checkpoint", "undo checkpoint", "undo lock"},
			wantUndone: []string{"checkpoint", "lock"}},
		{name: "undo fails: later undos still run", failDo: "store", failUndo: "checkpoint", wantErr: true,
			wantLog:    []string{"do lock", "do checkpoint", "do dump", "do store", "undo dump", "undo checkpoint", "undo lock"},
			wantUndone: []string{"dump", "lock"}},
		{name: "cancelled mid-step: rollback with a live context", cancelAt: "checkpoint", wantErr: true, wantRolled: true,
			wantLog:    []string{"do lock", "do checkpoint", "undo checkpoint", "undo lock"},
			wantUndone: []string{"checkpoint", "lock"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var log []string
			mk := func(name string, undo bool) Step {
				s := Step{Name: name, Do: func(context.Context) error {
					log = append(log, "do "+name)
					if name == tt.cancelAt {
						cancel()
					}
					if name == tt.failDo {
						return errBoom
					}
					return nil
				}}
				if undo {
					s.Undo = func(uctx context.Context) error {
						if uctx.Err() != nil {
							t.Errorf("undo %s ran with a dead context", name)
						}
						log = append(log, "undo "+name)
						if name == tt.failUndo {
							return errBoom
						}
						return nil
					}
				}
				return s
			}
			steps := []Step{mk("lock", true), mk("checkpoint", true), mk("dump", true), mk("store", false)}
			hook := func(_ context.Context, step string) error {
				if step == tt.hookFail {
					return errors.New("injected")
				}
				return nil
			}
			timings, err := Execute(ctx, steps, hook, 0, slog.New(slog.NewTextHandler(io.Discard, nil)))
			if !reflect.DeepEqual(log, tt.wantLog) {
				t.Errorf("log = %q\nwant %q", log, tt.wantLog)
			}
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v, wantErr %v", err, tt.wantErr)
			}
			if err == nil {
				if len(timings) != len(steps) || timings.Of("dump") <= 0 {
					t.Errorf("timings = %+v", timings)
				}
				return
			}
			var se *StepError
			if !errors.As(err, &se) {
				t.Fatalf("err %T is not a *StepError", err)
			}
			if se.RolledBack() != tt.wantRolled {
				t.Errorf("RolledBack = %v, want %v (%v)", se.RolledBack(), tt.wantRolled, err)
			}
			if !reflect.DeepEqual(se.Undone, tt.wantUndone) {
				t.Errorf("undone = %q, want %q", se.Undone, tt.wantUndone)
			}
			if tt.failUndo != "" && (se.UndoErr == nil || !strings.Contains(err.Error(), "ROLLBACK FAILED")) {
				t.Errorf("undo failure not reported: %v", err)
			}
			if tt.failDo != "" && !errors.Is(err, errBoom) {
				t.Errorf("err does not wrap the step's error: %v", err)
			}
		})
	}
}

// TestExecuteCommit: once a Commit step completed, the operation's result is final: a
// cancellation (SIGINT during the store) lets the remaining steps run, and a later failure rolls
// nothing back and does not report a rollback (exit status and --json say "committed").
func TestExecuteCommit(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, fail := range []bool{false, true} {
		ctx, cancel := context.WithCancel(context.Background())
		var ran []string
		mk := func(name string, commit bool) Step {
			return Step{Name: name, Commit: commit,
				Do: func(sctx context.Context) error {
					ran = append(ran, name)
					if name == "store" {
						cancel() // the signal arrives while the image is being committed
					}
					if name == "finish" {
						if sctx.Err() != nil {
							return errors.New("finish got a cancelled context")
						}
						if fail {
							return errors.New("boom")
						}
					}
					return nil
				},
				Undo: func(context.Context) error { ran = append(ran, "undo "+name); return nil }}
		}
		_, err := Execute(ctx, []Step{mk("dump", false), mk("store", true), mk("finish", false)}, nil, 0, log)
		want := []string{"dump", "store", "finish"}
		if !reflect.DeepEqual(ran, want) {
			t.Errorf("fail=%v: ran %v, want %v (nothing undone)", fail, ran, want)
		}
		if !fail {
			if err != nil {
				t.Errorf("a committed operation cancelled after its commit: %v, want success", err)
			}
			continue
		}
		var se *StepError
		if !errors.As(err, &se) || !se.Committed || se.RolledBack() || se.Step != "finish" || !strings.Contains(err.Error(), "committed") {
			t.Errorf("failure after the commit: %v (%+v), want a committed, not rolled back, StepError", err, se)
		}
	}
}
