package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/probe"
	"github.com/ptxmig/ptxmig/internal/ptxas"
	"github.com/ptxmig/ptxmig/store"
)

// fakeHost is a doctor's view of a host, for golden output that does not depend on this one.
func fakeHost(good bool) doctorProbes {
	on, off := true, false
	p := doctorProbes{
		euid:        func() int { return 0 },
		missingCaps: func() ([]probe.Capability, error) { return nil, nil },
		criu: func(context.Context) (probe.CRIUInfo, error) {
			return probe.CRIUInfo{Path: "/usr/local/sbin/criu", Version: "4.2.1"}, nil
		},
		criuCheck: func(context.Context, string) error { return nil },
		criuSelfTest: func(context.Context, string) (*criu.SelfTest, error) {
			return &criu.SelfTest{Dump: 120 * time.Millisecond, Restore: 130 * time.Millisecond, Breakpoints: criu.BreakpointsWork}, nil
		},
		kernel:        func() string { return "6.18.44" },
		driver:        func() (string, error) { return "580.95.05", nil },
		checkpointAPI: func() (string, error) { return "13.0", nil },
		gpus: func() ([]probe.GPUState, error) {
			return []probe.GPUState{{Index: 0, Name: "NVIDIA H100 80GB HBM3", ComputeCap: "9.0", Persistence: &on},
				{Index: 1, Name: "NVIDIA H100 80GB HBM3", ComputeCap: "9.0", Persistence: &on}}, nil
		},
		storeInfo: func(dir string) (*store.DirInfo, error) {
			return &store.DirInfo{Dir: dir, Resolved: "/data/ptxmig", Exists: true, IsStore: true, Mode: 0o700, FreeBytes: 1 << 40}, nil
		},
		storeCreate: func(string) error { return nil },
		dirFree:     func(dir string) (uint64, bool, error) { return 64 << 30, dir != op.StagingDisk, nil },
		shim:        func() (string, error) { return "/usr/local/lib/libptxmig.so", nil },
		ptxas:       func() (string, error) { return "/usr/local/cuda/bin/ptxas", nil },
		socketDir:   func(string) error { return nil },
		pending:     func() ([]op.Recovered, error) { return nil, nil },
		session:     func() (int, error) { return 4242, nil },
		keep: func() (string, bool) {
			return "ptxmig runs in cgroup /system.slice/ptxmig-rebalance.service; guardians and holders start in /ptxmig.keep (cgroup v2 at /sys/fs/cgroup), out of reach of a kill of ptxmig's cgroup", true
		},
	}
	if good {
		return p
	}
	p.session = func() (int, error) { return 0, nil } // docker exec
	p.keep = func() (string, bool) {
		return "no cgroup hierarchy mounted: guardians and holders start where ptxmig is", false
	}
	// A container on an old driver, with no CRIU, a loose store and no shim.
	p.euid = func() int { return 1000 }
	p.missingCaps = func() ([]probe.Capability, error) {
		return []probe.Capability{{Name: "CAP_SYS_ADMIN", Required: true}, {Name: "CAP_SYS_PTRACE", Required: true}, {Name: "CAP_NET_ADMIN"}}, nil
	}
	p.criu = func(context.Context) (probe.CRIUInfo, error) {
		return probe.CRIUInfo{Path: "/usr/sbin/criu", Version: "3.17.1"},
			&probe.UnsupportedFeatureError{Feature: probe.CRIU.Name, Component: "CRIU", MinimumVersion: "4.0", Found: "3.17.1"}
	}
	p.driver = func() (string, error) { return "575.51.03", nil }
	p.checkpointAPI = func() (string, error) { return "12.9", nil }
	p.gpus = func() ([]probe.GPUState, error) {
		return []probe.GPUState{{Index: 0, Name: "NVIDIA A100-SXM4-80GB", ComputeCap: "8.0", Persistence: &off, MIG: true}}, nil
	}
	p.storeInfo = func(dir string) (*store.DirInfo, error) {
		return &store.DirInfo{Dir: dir, Exists: true, IsStore: true, UID: 1000, Mode: 0o777},
			fmt.Errorf("open store %s: %w: mode 0777 is writable by group or others (chmod 700 it)", dir, store.ErrInsecure)
	}
	p.shim = func() (string, error) {
		return "", fmt.Errorf("%w (tried /usr/local/lib/libptxmig.so)", errShimNotFound)
	}
	p.ptxas = func() (string, error) { return "", ptxas.ErrNotFound }
	p.socketDir = func(d string) error {
		return fmt.Errorf("run: --socket-dir %s does not exist, nor does its parent directory", d)
	}
	return p
}

// TestGoldenDoctor pins doctor's report on a ready host and on a bare one, in text and JSON, and
// its exit status (1 when a check fails).
func TestGoldenDoctor(t *testing.T) {
	defer func(p doctorProbes) { doctorHost = p }(doctorHost)
	t.Setenv("PTXMIG_LOG_DIR", "/var/log/ptxmig")
	t.Setenv("PTXMIG_STAGING_DIR", "")
	t.Setenv("PTXMIG_JOURNAL_DIR", "")
	for _, tt := range []struct {
		name string
		good bool
		code int
	}{{"ready", true, 0}, {"bare", false, 1}} {
		doctorHost = fakeHost(tt.good)
		out, _, code := runCLI(t, "--store", "/var/lib/ptxmig", "doctor")
		if code != tt.code {
			t.Errorf("%s: exit %d, want %d", tt.name, code, tt.code)
		}
		checkGolden(t, "doctor-"+tt.name+"-text.golden", out)
		out, _, code = runCLI(t, "--store", "/var/lib/ptxmig", "doctor", "--json")
		if code != tt.code {
			t.Errorf("%s --json: exit %d", tt.name, code)
		}
		oneJSON(t, "doctor --json", out)
		checkGolden(t, "doctor-"+tt.name+"-json.golden", out)
	}
}

// TestDoctorStates: the store, driver and GPU cases not in the golden reports.
func TestDoctorStates(t *testing.T) {
	p := fakeHost(true)
	find := func(r doctorReport, name string) check {
		for _, c := range r.Checks {
			if c.Name == name {
				return c
			}
		}
		t.Fatalf("no %s check in %+v", name, r.Checks)
		return check{}
	}
	// No driver: CPU processes only, a warning; no GPU lines.
	p.driver = func() (string, error) { return "", gpu.ErrNoDriver }
	r := runDoctor(context.Background(), p, "/s", "")
	if c := find(r, "nvidia driver"); c.Status != "warn" || r.Fail != 0 {
		t.Errorf("no driver: %+v, %d failures", c, r.Fail)
	}
	for _, c := range r.Checks {
		if c.Name == "gpus" || c.Name == "checkpoint api" {
			t.Errorf("no driver, yet a %s line", c.Name)
		}
	}
	// A driver without the checkpoint API, one too old for anything.
	p = fakeHost(true)
	p.driver = func() (string, error) { return "550.54.14", nil }
	p.checkpointAPI = func() (string, error) { return "", cudackpt.ErrNotSupported }
	r = runDoctor(context.Background(), p, "/s", "")
	if find(r, "nvidia driver").Status != "fail" || find(r, "checkpoint api").Status != "fail" {
		t.Errorf("driver 550: %+v", r.Checks)
	}
	// Missing store: fine when it can be created, a failure when its parent is missing.
	base := t.TempDir()
	p = fakeHost(true)
	p.storeInfo, p.storeCreate = store.Inspect, store.CheckCreate
	if c := find(runDoctor(context.Background(), p, filepath.Join(base, "new"), ""), "store"); c.Status != "ok" || !strings.Contains(c.Message, "first checkpoint creates it") {
		t.Errorf("missing store: %+v", c)
	}
	if c := find(runDoctor(context.Background(), p, filepath.Join(base, "a", "b"), ""), "store"); c.Status != "fail" || !strings.Contains(c.Fix, "mkdir -p") {
		t.Errorf("missing parent: %+v", c)
	}
	st, _ := newTestStore(t, "x")
	link := filepath.Join(base, "link")
	os.Symlink(st, link)
	if c := find(runDoctor(context.Background(), p, link, ""), "store"); c.Status == "fail" || !strings.Contains(c.Message, link+" -> ") {
		t.Errorf("symlinked store: %+v", c)
	}
	// CRIU missing and criu check failing.
	p = fakeHost(true)
	p.criu = func(context.Context) (probe.CRIUInfo, error) { return probe.CRIUInfo{}, criu.ErrNotFound }
	r = runDoctor(context.Background(), p, "/s", "")
	if find(r, "criu").Status != "fail" || find(r, "criu check").Status != "warn" {
		t.Errorf("no criu: %+v", r.Checks)
	}
	p = fakeHost(true)
	p.criuCheck = func(context.Context, string) error { return errors.New("criu check: exit status 1: Looks bad") }
	if c := find(runDoctor(context.Background(), p, "/s", ""), "criu check"); c.Status != "fail" {
		t.Errorf("criu check failing: %+v", c)
	}
	// `criu check` passes but a real dump hangs (CRIU 4.1.1 where hardware breakpoints never fire):
	// the self-test fails, says so and names the fix.
	p = fakeHost(true)
	p.criuSelfTest = func(context.Context, string) (*criu.SelfTest, error) {
		return &criu.SelfTest{Breakpoints: criu.BreakpointsBroken},
			fmt.Errorf("dump of a sleeping process: %w", &criu.StallError{PID: 77, Bound: 10 * time.Second})
	}
	r = runDoctor(context.Background(), p, "/s", "")
	if c := find(r, "criu self-test"); c.Status != "fail" || !strings.Contains(c.Message, "made no progress for 10s") ||
		!strings.Contains(c.Message, "hardware breakpoints do not fire") || !strings.Contains(c.Fix, "4.2.1") || find(r, "criu check").Status != "ok" {
		t.Errorf("hanging dump: %+v", r.Checks)
	}
	// CRIU 4.1.1 on Linux >= 6.16 cannot dump TCP/UDP sockets: a warning with the fix; not on 6.15.
	p = fakeHost(true)
	p.criu = func(context.Context) (probe.CRIUInfo, error) {
		return probe.CRIUInfo{Path: "/usr/local/sbin/criu", Version: "4.1.1"}, nil
	}
	if c := find(runDoctor(context.Background(), p, "/s", ""), "criu"); c.Status != "warn" || !strings.Contains(c.Message, "TCP or UDP sockets") {
		t.Errorf("CRIU 4.1.1 on 6.18: %+v", c)
	}
	p.kernel = func() string { return "6.15.2" }
	if c := find(runDoctor(context.Background(), p, "/s", ""), "criu"); c.Status != "ok" {
		t.Errorf("CRIU 4.1.1 on 6.15: %+v", c)
	}
	// Interrupted operations: a warning whose fix is ptxmig recover; each one named.
	p = fakeHost(true)
	started := time.Date(2026, 11, 24, 10, 15, 0, 0, time.Local)
	p.pending = func() ([]op.Recovered, error) {
		return []op.Recovered{
			{Journal: "checkpoint-4242-0123456789abcdef", Op: "checkpoint", PID: 4242, Started: started, Outcome: op.PendingInterrupted},
			{Journal: "migrate-77-0123456789abcdef", Op: "migrate", PID: 77, Started: started, Outcome: op.RecoveredBusy},
			{Journal: "restore-9-0123456789abcdef", Outcome: op.RecoveredRefused, Error: "bad boot id"},
		}, nil
	}
	r = runDoctor(context.Background(), p, "/s", "")
	c := find(r, "interrupted ops")
	for _, want := range []string{"3 operation(s)", "checkpoint of pid 4242 (journal checkpoint-4242-0123456789abcdef, started 2026-11-24 10:15:00)",
		"migrate of pid 77", "its guardian is rolling it back", "journal restore-9-0123456789abcdef: invalid (bad boot id)"} {
		if !strings.Contains(c.Message, want) {
			t.Errorf("interrupted ops: %q lacks %q", c.Message, want)
		}
	}
	if c.Status != "warn" || c.Fix != "ptxmig recover" || r.Fail != 0 {
		t.Errorf("interrupted ops: %+v, %d failures", c, r.Fail)
	}
	p.pending = func() ([]op.Recovered, error) {
		return nil, errors.New("journal directory /run/ptxmig/journal: unsafe")
	}
	if c := find(runDoctor(context.Background(), p, "/s", ""), "interrupted ops"); c.Status != "warn" || !strings.Contains(c.Message, "unsafe") {
		t.Errorf("unreadable journals: %+v", c)
	}
	p = fakeHost(true)
	p.euid = func() int { return 1000 }
	p.pending = func() ([]op.Recovered, error) { t.Error("journals read as non-root"); return nil, nil }
	if c := find(runDoctor(context.Background(), p, "/s", ""), "interrupted ops"); c.Status != "warn" || !strings.Contains(c.Message, "skipped") {
		t.Errorf("non-root: %+v", c)
	}
}

// TestDoctorThisHost runs the real probes: whatever this host is, the report is complete and
// nothing is created.
func TestDoctorThisHost(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "store")
	out, errOut, code := runCLI(t, "--store", missing, "doctor", "--json")
	m := oneJSON(t, "doctor --json", out)
	if code != 0 && code != 1 {
		t.Errorf("doctor: exit %d %s", code, errOut)
	}
	if checks, _ := m["checks"].([]any); len(checks) < 10 {
		t.Errorf("doctor: %d checks: %s", len(checks), out)
	}
	if _, err := os.Stat(missing); err == nil {
		t.Error("doctor created the store")
	}
}

// TestOpProgress: the status line shows the step among the plan's, the bytes with throughput and
// an ETA, and clears itself; the hook still runs the inner hook.
func TestOpProgress(t *testing.T) {
	var buf bytes.Buffer
	steps := []op.PlanStep{{Step: "lock"}, {Step: "checkpoint"}, {Step: "dump"}, {Step: "store"}, {Step: "on failure"}}
	p := startOpProgress(&buf, "checkpoint 4242", steps, checkpointLabels, 20*time.Second, 0)
	inner := 0
	hook := p.Hook(func(context.Context, string) error { inner++; return nil })
	if err := hook(context.Background(), "dump"); err != nil || inner != 1 {
		t.Fatalf("hook: %v, inner ran %d times", err, inner)
	}
	now := p.start.Add(3 * time.Second)
	if got := p.line(now); got != "checkpoint 4242 [3/4] criu dump  ETA 17.0 s  (3.0 s)" {
		t.Errorf("dump line: %q", got)
	}
	_ = hook(context.Background(), "store")
	p.Bytes()(0, 4<<30)
	p.bytesAt = now
	p.Bytes()(1<<30, 4<<30)
	if got := p.line(now.Add(2 * time.Second)); got != "checkpoint 4242 [4/4] store  1.0 GiB/4.0 GiB   25%  512.0 MiB/s  ETA 6.0 s  (5.0 s)" {
		t.Errorf("store line: %q", got)
	}
	p.Done()
	p.Done() // twice is fine
	if !strings.HasSuffix(buf.String(), "\r\x1b[K") {
		t.Errorf("not cleared: %q", buf.String())
	}
	var nilP *opProgress // not a terminal: everything is a no-op
	nilP.Phase("x")
	nilP.Done()
	if nilP.Bytes() != nil || nilP.Hook(nil) != nil {
		t.Error("nil progress returned callbacks")
	}
	if newOpProgress(&buf, "x", nil, nil, 0) != nil {
		t.Error("progress on a buffer, which is no terminal")
	}
}

func TestRoughDuration(t *testing.T) {
	for d, want := range map[time.Duration]string{850 * time.Millisecond: "850 ms", 12300 * time.Millisecond: "12.3 s", 245 * time.Second: "4m05s"} {
		if got := roughDuration(d); got != want {
			t.Errorf("%v: %q, want %q", d, got, want)
		}
	}
}
