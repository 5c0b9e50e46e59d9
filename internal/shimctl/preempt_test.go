package shimctl

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/shimctl/shimctltest"
)

// TestQuiesceReplies checks that quiesce replies are validated field by field.
func TestQuiesceReplies(t *testing.T) {
	pid := os.Getpid()
	status := fmt.Sprintf(`{"ok":true,"proto":2,"cmd":"status","result":{"pid":%d,"proto":2}}`+"\n", pid)
	tests := []struct {
		name, quiesce string
		wantErr       error
	}{
		{"good", `{"ok":true,"proto":2,"cmd":"quiesce","result":{"state":"quiesced","elapsed_us":9,"preempted":[{"launch":1,"kernel":"k","stream":"0x1","blocks_done":3,"blocks_total":8}]}}`, nil},
		{"mid-block stop", `{"ok":true,"proto":2,"cmd":"quiesce","result":{"state":"quiesced","preempted":[{"launch":1,"kernel":"k","blocks_done":3,"blocks_total":8,"mid_block":true,"stop":"mid-block","records":528}]}}`, nil},
		{"mid-block twin stopped between blocks", `{"ok":true,"proto":2,"cmd":"quiesce","result":{"state":"quiesced","preempted":[{"launch":1,"kernel":"k","blocks_done":3,"blocks_total":8,"mid_block":true,"stop":"block boundary","records":0}]}}`, nil},
		{"unknown stop", `{"ok":true,"proto":2,"cmd":"quiesce","result":{"state":"quiesced","preempted":[{"launch":1,"kernel":"k","blocks_done":3,"blocks_total":8,"mid_block":true,"stop":"somewhere","records":1}]}}`, ErrProtocol},
		{"mid-block stop without records", `{"ok":true,"proto":2,"cmd":"quiesce","result":{"state":"quiesced","preempted":[{"launch":1,"kernel":"k","blocks_done":3,"blocks_total":8,"mid_block":true,"stop":"mid-block","records":0}]}}`, ErrProtocol},
		{"records from a block-granular twin", `{"ok":true,"proto":2,"cmd":"quiesce","result":{"state":"quiesced","preempted":[{"launch":1,"kernel":"k","blocks_done":3,"blocks_total":8,"mid_block":false,"stop":"mid-block","records":4}]}}`, ErrProtocol},
		{"more blocks done than exist", `{"ok":true,"proto":2,"cmd":"quiesce","result":{"state":"quiesced","preempted":[{"launch":1,"kernel":"k","blocks_done":9,"blocks_total":8}]}}`, ErrProtocol},
		{"not quiesced", `{"ok":true,"proto":2,"cmd":"quiesce","result":{"state":"running"}}`, ErrProtocol},
		{"negative time", `{"ok":true,"proto":2,"cmd":"quiesce","result":{"state":"quiesced","elapsed_us":-1}}`, ErrProtocol},
		{"refused", `{"ok":false,"proto":2,"error":"already quiesced by another client"}`, ErrShim},
		{"future protocol", `{"ok":true,"proto":3,"cmd":"quiesce","result":{"state":"quiesced"}}`, ErrProtocol},
		// An untrusted process must not make ptxmig decode millions of values.
		{"too many objects", `{"ok":true,"proto":2,"cmd":"quiesce","result":{"state":"quiesced","preempted":[` +
			strings.TrimSuffix(strings.Repeat("{},", 300000), ",") + `]}}`, ErrProtocol},
		{"too long", `{"ok":true,"proto":2,"cmd":"quiesce","result":{"state":"quiesced","note":"` + strings.Repeat("x", 2<<20) + `"}}`, ErrProtocol},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			shimctltest.Serve(t, filepath.Join(dir, fmt.Sprintf("%d.sock", pid)), map[string]string{"status": status, "quiesce": tt.quiesce + "\n"})
			c, err := DialPID(context.Background(), dir, pid)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			q, err := c.Quiesce(context.Background(), 10*time.Millisecond)
			if tt.wantErr == nil && (err != nil || q.Preempted[0].BlocksDone != 3) {
				t.Fatalf("quiesce = %+v, %v", q, err)
			}
			if tt.wantErr != nil && !errors.Is(err, tt.wantErr) {
				t.Fatalf("err = %v, want %v", err, tt.wantErr)
			}
		})
	}
	if _, err := (&Client{}).Quiesce(context.Background(), 2*time.Minute); err == nil {
		t.Error("a budget over a minute was accepted")
	}
}

// TestProtocol1HasNoPreemption: a version-1 shim answers a preemption request as an unknown
// command, with its version; that is ErrNoPreemption, and nothing more is sent to it. No status is
// asked for first (a PyTorch rank's took 1.8 s).
func TestProtocol1HasNoPreemption(t *testing.T) {
	pid := os.Getpid()
	dir := t.TempDir()
	unknown := `{"ok":false,"proto":1,"error":"unknown cmd (want status, kernels or dump-modules)"}` + "\n"
	shimctltest.Serve(t, filepath.Join(dir, fmt.Sprintf("%d.sock", pid)), map[string]string{"quiesce": unknown})
	c, err := DialPID(context.Background(), dir, pid)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Quiesce(context.Background(), 10*time.Millisecond); !errors.Is(err, ErrNoPreemption) {
		t.Fatalf("quiesce on protocol 1: %v", err)
	}
	if _, err := c.Resume(context.Background()); !errors.Is(err, ErrNoPreemption) {
		t.Fatalf("resume on protocol 1: %v", err)
	}
}

// TestStatusPreemptFields: the shim's status.preempt (as a real shim sends it, floats included)
// decodes.
func TestStatusPreemptFields(t *testing.T) {
	pid := os.Getpid()
	dir := t.TempDir()
	shimctltest.Serve(t, filepath.Join(dir, fmt.Sprintf("%d.sock", pid)), map[string]string{
		"status": fmt.Sprintf(`{"ok":true,"proto":2,"cmd":"status","result":{"pid":%d,"proto":2,"preempt":{"mode":"always","min_us":1000,"state":"running","gate":"open","twins_in_flight":1,"preempted_pending":0,"instrumented_modules":1,"twin_launches":5,"relaunches":0,"quiesces":0,"preempted":0,"cache":{"hits":0,"misses":1,"helper_failures":0,"helper_runs":1,"helper_ms":9.577},"helper":"/x/ptxmig","cache_dir":"/c"}}}`+"\n", pid)})
	c, err := DialPID(context.Background(), dir, pid)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	st, err := c.Status(context.Background())
	if err != nil || st.Preempt == nil || st.Preempt.Cache["helper_ms"] != 9.577 || st.Preempt.TwinsInFlight != 1 {
		t.Fatalf("status = %+v, %v", st, err)
	}
}
