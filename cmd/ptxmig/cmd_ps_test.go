package main

import (
	"encoding/json"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/proc"
)

// TestPSCgroup: ps shows each process's cgroup v2 path, in --json as it is and in the table
// escaped ("-" when there is none).
func TestPSCgroup(t *testing.T) {
	defer func(s func() ([]gpu.ProcInfo, error), st func(int) (string, error), cg func(int) (string, error), inv func() (gpuInventory, error)) {
		scanProcs, procState, procCgroup, openInventory = s, st, cg, inv
	}(scanProcs, procState, procCgroup, openInventory)
	self := os.Getpid()
	parent := os.Getppid()
	scanProcs = func() ([]gpu.ProcInfo, error) {
		return []gpu.ProcInfo{{PID: self, Comm: "self", Cmdline: []string{"self"}}, {PID: parent, Comm: "parent", Cmdline: []string{"parent"}}}, nil
	}
	procState = func(int) (string, error) { return "running", nil }
	openInventory = func() (gpuInventory, error) { return nil, gpu.ErrNoDriver }
	const evil = "/job.slice/a\tb\x1b[31m\u202e.scope"
	procCgroup = func(pid int) (string, error) {
		if pid == self {
			return evil, nil
		}
		return "", proc.ErrNoCgroup
	}

	out, errOut, code := runCLI(t, "ps", "--json")
	if code != 0 {
		t.Fatalf("ps --json: exit %d: %s", code, errOut)
	}
	var entries []PSEntry
	if err := json.Unmarshal([]byte(out), &entries); err != nil || len(entries) != 2 {
		t.Fatalf("ps --json: %v\n%s", err, out)
	}
	got := map[int]string{}
	for _, e := range entries {
		got[e.PID] = e.Cgroup
	}
	if got[self] != evil || got[parent] != "" {
		t.Errorf("ps --json cgroups %v, want %q for %d and none for %d", got, evil, self, parent)
	}
	if !strings.Contains(out, `"cgroup": ""`) {
		t.Errorf("ps --json: a process without a cgroup lacks \"cgroup\": \"\":\n%s", out)
	}

	out, errOut, code = runCLI(t, "ps")
	if code != 0 {
		t.Fatalf("ps: exit %d: %s", code, errOut)
	}
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if len(lines) != 3 || !strings.Contains(lines[0], "MEMORY  CGROUP") || !strings.HasSuffix(lines[0], "  COMMAND") {
		t.Fatalf("ps: want a CGROUP column before COMMAND and two rows:\n%s", out)
	}
	want := `/job.slice/a\tb\x1b[31m\u202e.scope`
	for _, l := range lines[1:] {
		f := strings.Fields(l)
		switch f[0] {
		case itoa(self):
			if f[len(f)-2] != want {
				t.Errorf("ps: row %q: cgroup column %q, want %q", l, f[len(f)-2], want)
			}
		case itoa(parent):
			if f[len(f)-2] != "-" {
				t.Errorf("ps: row %q: cgroup column %q, want -", l, f[len(f)-2])
			}
		}
	}
	if strings.ContainsAny(out, "\t\x1b\u202e") {
		t.Errorf("ps: raw control characters in the table: %q", out)
	}

	// The real lookup: this process's own cgroup, as /proc shows it.
	procCgroup = proc.Cgroup
	if own, err := proc.Cgroup(self); err == nil {
		out, _, _ = runCLI(t, "ps", "--json")
		if err := json.Unmarshal([]byte(out), &entries); err != nil || len(entries) == 0 || entries[0].PID != min(self, parent) {
			t.Fatalf("ps --json: %v\n%s", err, out)
		}
		for _, e := range entries {
			if e.PID == self && e.Cgroup != own {
				t.Errorf("ps --json: cgroup %q, want %q", e.Cgroup, own)
			}
		}
	} else if !errors.Is(err, proc.ErrNoCgroup) {
		t.Fatal(err)
	}
}

// TestPSOwned: a process under the shim shows what its shim owns (--json: owned_memory; the
// table's SHIM column: "owned SIZE"); one without owned memory, or whose shim does not answer,
// shows "yes"; one without the shim is not asked.
func TestPSOwned(t *testing.T) {
	defer func(s func() ([]gpu.ProcInfo, error), st func(int) (string, error), inv func() (gpuInventory, error), so func(int) (*psOwned, error)) {
		scanProcs, procState, openInventory, shimOwned = s, st, inv, so
	}(scanProcs, procState, openInventory, shimOwned)
	self, parent := os.Getpid(), os.Getppid()
	scanProcs = func() ([]gpu.ProcInfo, error) {
		return []gpu.ProcInfo{{PID: self, Comm: "self", Shim: true}, {PID: parent, Comm: "parent", Shim: true}, {PID: 1, Comm: "init"}}, nil
	}
	procState = func(int) (string, error) { return "running", nil }
	openInventory = func() (gpuInventory, error) { return nil, gpu.ErrNoDriver }
	asked := map[int]bool{}
	shimOwned = func(pid int) (*psOwned, error) {
		asked[pid] = true
		if pid == self {
			return &psOwned{Enabled: true, Bytes: 3 << 30, Regions: 7}, nil
		}
		return nil, errors.New("no answer")
	}
	out, errOut, code := runCLI(t, "ps", "--json")
	if code != 0 {
		t.Fatalf("ps --json: exit %d: %s", code, errOut)
	}
	var entries []PSEntry
	if err := json.Unmarshal([]byte(out), &entries); err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		switch {
		case e.PID == self && (e.Owned == nil || e.Owned.Bytes != 3<<30 || e.Owned.Regions != 7):
			t.Errorf("pid %d: owned %+v, want 3 GiB in 7 regions", e.PID, e.Owned)
		case e.PID != self && e.Owned != nil:
			t.Errorf("pid %d: owned %+v, want none", e.PID, e.Owned)
		}
	}
	if asked[1] {
		t.Error("ps asked a process without the shim for its owned memory")
	}
	out, _, _ = runCLI(t, "ps")
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) < 6 {
			continue
		}
		switch f[0] {
		case itoa(self):
			if !strings.Contains(l, "owned 3.0 GiB") && !strings.Contains(l, "owned 3 GiB") {
				t.Errorf("ps: row %q lacks the owned memory", l)
			}
		case itoa(parent):
			if f[4] != "yes" {
				t.Errorf("ps: row %q: SHIM %q, want yes", l, f[4])
			}
		}
	}
}
