package shimstep

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/shimctl"
	"github.com/ptxmig/ptxmig/internal/shimctl/shimctltest"
)

func reply(cmd, result string, proto int) string {
	return fmt.Sprintf(`{"ok":true,"proto":%d,"cmd":%q,"result":%s}`+"\n", proto, cmd, result)
}

// TestPreemptionSteps drives quiesce → detach → resume against a served control socket standing
// in for the shim of this process, and the fallbacks: no shim, a protocol-1 shim, a garbled reply.
func TestPreemptionSteps(t *testing.T) {
	pid := os.Getpid()
	status := func(proto int) string {
		return reply("status", fmt.Sprintf(`{"pid":%d,"proto":%d}`, pid, proto), proto)
	}
	quiesce := reply("quiesce", `{"state":"quiesced","elapsed_us":812,"gate":"closed",`+
		`"preempted":[{"launch":7,"kernel":"longgrid","stream":"0x0","blocks_done":1200,"blocks_total":65536}],`+
		`"originals":[{"kernel":"cublasGemm","reason":"no PTX (SASS only)"}]}`, 2)
	tests := []struct {
		name        string
		replies     map[string]string // nil: no socket at all
		wantShim    bool
		wantQuiesce bool
		wantResume  bool
		wantNote    string
		wantHint    string
	}{
		{name: "no shim", wantNote: "not running under the ptxmig shim"},
		{name: "protocol 1", replies: map[string]string{"status": status(1),
			"quiesce": `{"ok":false,"proto":1,"error":"unknown cmd (want status, kernels or dump-modules)"}` + "\n"},
			wantShim: true, wantNote: "protocol 1", wantHint: "protocol 1"},
		{name: "garbled quiesce", replies: map[string]string{"status": status(2), "quiesce": "{nope\n"}, wantShim: true, wantNote: "quiesce failed", wantHint: "quiesce failed"},
		{name: "quiesce, detach, resume", wantShim: true, wantQuiesce: true, wantResume: true, wantHint: "cublasGemm (no PTX (SASS only))",
			replies: map[string]string{"status": status(2), "quiesce": quiesce, "detach": reply("detach", `{"state":"detached","detached":true}`, 2) + "\n",
				"resume": reply("resume", `{"state":"running","was":"quiesced","relaunched":1,"elapsed_us":90}`, 2)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			t.Setenv("PTXMIG_SOCKET_DIR", dir)
			if tt.replies != nil {
				shimctltest.Serve(t, filepath.Join(dir, fmt.Sprintf("%d.sock", pid)), tt.replies)
			}
			env := &op.Env{Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
			p := NewPreemption(env, 0)
			defer p.Close()
			steps := []op.Step{p.QuiesceStep([]int{pid}), p.DetachStep(), p.ResumeStep(op.Fixed([]int{pid}), false)}
			if _, err := op.Execute(context.Background(), steps, nil, 0, env.Log); err != nil {
				t.Fatalf("steps: %v", err)
			}
			if len(p.Reports) != 1 {
				t.Fatalf("reports %+v", p.Reports)
			}
			r := p.Reports[0]
			if r.Shim != tt.wantShim || (r.Quiesce != nil) != tt.wantQuiesce || (r.Resume != nil) != tt.wantResume ||
				!strings.Contains(r.Note, tt.wantNote) {
				t.Errorf("report %+v", r)
			}
			if tt.wantQuiesce && (r.Quiesce.Preempted[0].BlocksDone != 1200 || r.Resume.Relaunched != 1) {
				t.Errorf("quiesce %+v resume %+v", r.Quiesce, r.Resume)
			}
			if h := p.LockHint(); !strings.Contains(h, tt.wantHint) || (tt.wantHint == "") != (h == "") {
				t.Errorf("lock hint %q, want %q", h, tt.wantHint)
			}
		})
	}
}

// TestPreemptionRollback: a failure after the quiesce resumes through the open lease.
func TestPreemptionRollback(t *testing.T) {
	pid := os.Getpid()
	dir := t.TempDir()
	t.Setenv("PTXMIG_SOCKET_DIR", dir)
	shimctltest.Serve(t, filepath.Join(dir, fmt.Sprintf("%d.sock", pid)), map[string]string{
		"status":  reply("status", fmt.Sprintf(`{"pid":%d,"proto":2}`, pid), 2),
		"quiesce": reply("quiesce", `{"state":"quiesced","elapsed_us":5,"gate":"closed"}`, 2),
		"resume":  reply("resume", `{"state":"running","was":"quiesced","relaunched":0,"elapsed_us":3}`, 2),
	})
	env := &op.Env{Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	p := NewPreemption(env, 0)
	defer p.Close()
	boom := errors.New("lock timed out")
	lock := p.ExplainLock(op.Step{Name: driverstep.StepLock, Do: func(context.Context) error { return boom }})
	_, err := op.Execute(context.Background(), []op.Step{p.QuiesceStep([]int{pid}), lock}, nil, 0, env.Log)
	var se *op.StepError
	if !errors.As(err, &se) || !se.RolledBack() || se.Undone[0] != StepQuiesce {
		t.Fatalf("err = %v, want the quiesce undone", err)
	}
	if r := p.Reports[0]; r.Resume == nil || r.Resume.Was != "quiesced" {
		t.Errorf("no resume after the rollback: %+v", r)
	}
	if len(p.leases) != 0 {
		t.Errorf("lease left open")
	}
	_ = shimctl.ErrNoShim
}

// TestPreemptionWaitsForStopping: twins still stopping when the quiesce replied are waited for
// (through status) before the step ends, so the driver lock does not block the shim's raises.
func TestPreemptionWaitsForStopping(t *testing.T) {
	pid := os.Getpid()
	dir := t.TempDir()
	t.Setenv("PTXMIG_SOCKET_DIR", dir)
	shimctltest.Serve(t, filepath.Join(dir, fmt.Sprintf("%d.sock", pid)), map[string]string{
		"status":  reply("status", fmt.Sprintf(`{"pid":%d,"proto":2,"preempt":{"stopping":0}}`, pid), 2),
		"quiesce": reply("quiesce", `{"state":"quiesced","elapsed_us":10000,"gate":"closed","stopping":[7],"not_stopped":[{"launch":7,"kernel":"k","reason":"still running after the budget"}]}`, 2),
	})
	env := &op.Env{Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	p := NewPreemption(env, 0)
	defer p.Close()
	if _, err := op.Execute(context.Background(), []op.Step{p.QuiesceStep([]int{pid})}, nil, 0, env.Log); err != nil {
		t.Fatal(err)
	}
	if r := p.Reports[0]; r.StopWait <= 0 || r.Note != "" || len(r.Quiesce.Stopping) != 1 {
		t.Fatalf("report %+v", r)
	}
}

// TestPreemptionPeerOff: a quiesced process that reports peer links has them turned off before
// the step ends (the resume turns them on in the shim); a peer-off that fails, or that finds a
// cudaMalloc allocation over 256 MiB beside the links, fails the step, and the processes quiesced
// are resumed. Without links nothing is asked.
func TestPreemptionPeerOff(t *testing.T) {
	pid := os.Getpid()
	tests := []struct {
		name    string
		links   int
		peerOff string // the reply to peer-off
		wantErr string
		wantOff bool
	}{
		{name: "no links"},
		{name: "links", links: 2, peerOff: reply("peer-off", `{"links":2,"changed":true,"sync_us":40,"elapsed_us":55}`, 2), wantOff: true},
		{name: "links beside 256 MiB", links: 2, wantOff: true,
			peerOff: reply("peer-off", `{"links":2,"changed":true,"sync_us":40,"elapsed_us":55,"largest_device_alloc":268435456}`, 2)},
		// A 512 MiB allocation made since the preflight: the driver would not give the links back
		// after its restore, so the step fails and the rollback resumes the process.
		{name: "links beside 512 MiB", links: 2,
			peerOff: reply("peer-off", `{"links":2,"changed":true,"sync_us":40,"elapsed_us":55,"largest_device_alloc":536870912}`, 2),
			wantErr: "since the preflight, a cudaMalloc allocation of 512 MiB"},
		{name: "refused", links: 1, peerOff: `{"ok":false,"proto":2,"error":"peer-off: disabling peer access of link 1 of 1 failed (999)"}` + "\n",
			wantErr: "turn its peer access off for the checkpoint"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			t.Setenv("PTXMIG_SOCKET_DIR", dir)
			var mu sync.Mutex
			var asked []string
			shimctltest.ServeFunc(t, filepath.Join(dir, fmt.Sprintf("%d.sock", pid)), func(line string) string {
				var req struct{ Cmd string }
				_ = json.Unmarshal([]byte(line), &req)
				mu.Lock()
				asked = append(asked, req.Cmd)
				mu.Unlock()
				switch req.Cmd {
				case "quiesce":
					return reply("quiesce", fmt.Sprintf(`{"state":"quiesced","elapsed_us":5,"gate":"closed","peer_links":%d}`, tt.links), 2)
				case "peer-off":
					return tt.peerOff
				case "resume":
					return reply("resume", `{"state":"running","was":"quiesced","relaunched":0,"elapsed_us":3}`, 2)
				}
				return ""
			})
			env := &op.Env{Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
			p := NewPreemption(env, 0)
			defer p.Close()
			_, err := op.Execute(context.Background(), []op.Step{p.QuiesceStep([]int{pid})}, nil, 0, env.Log)
			mu.Lock()
			defer mu.Unlock()
			if tt.wantErr != "" {
				var se *op.StepError
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) || !errors.As(err, &se) || !se.RolledBack() {
					t.Fatalf("err = %v, want %q, rolled back", err, tt.wantErr)
				}
				if want := []string{"quiesce", "peer-off", "resume"}; !slices.Equal(asked, want) {
					t.Errorf("asked %v, want %v", asked, want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want := []string{"quiesce"}
			if tt.links > 0 {
				want = append(want, "peer-off")
			}
			if !slices.Equal(asked, want) {
				t.Errorf("asked %v, want %v", asked, want)
			}
			if r := p.Reports[0]; (r.PeerOff != nil) != tt.wantOff || (tt.wantOff && r.PeerOff.Links != tt.links) {
				t.Errorf("report peer_off %+v", r.PeerOff)
			}
		})
	}
}
