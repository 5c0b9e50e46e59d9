package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/testreq"
	"github.com/ptxmig/ptxmig/rebalance"
)

// TestMakeInstall: `make install DESTDIR=...` puts the binary, the shim, the man page, both
// completions, the units (with the paths of this install), the example policy and cron line, and
// the docs the units point to in place; a second install keeps an edited policy.
func TestMakeInstall(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ptxmig and the shim (-short)")
	}
	mk, err := exec.LookPath("make")
	if err != nil {
		testreq.Skip(t, "make", "no make: %v", err)
	}
	if _, err := exec.LookPath("cc"); err != nil {
		testreq.Skip(t, "cc", "the shim needs a C compiler: %v", err)
	}
	dest := t.TempDir()
	install := func() string {
		t.Helper()
		cmd := exec.Command(mk, "--no-print-directory", "install", "DESTDIR="+dest, "PREFIX=/opt/ptxmig")
		cmd.Dir = "../.."
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("make install: %v\n%s", err, out)
		}
		return string(out)
	}
	install()
	files := map[string]os.FileMode{
		"opt/ptxmig/bin/ptxmig":                                         0o755,
		"opt/ptxmig/lib/libptxmig.so":                                   0o755,
		"opt/ptxmig/share/man/man1/ptxmig.1":                            0o644,
		"opt/ptxmig/share/bash-completion/completions/ptxmig":           0o644,
		"opt/ptxmig/share/zsh/site-functions/_ptxmig":                   0o644,
		"opt/ptxmig/lib/systemd/system/ptxmig-rebalance.service":        0o644,
		"opt/ptxmig/lib/systemd/system/ptxmig-rebalance.timer":          0o644,
		"opt/ptxmig/lib/systemd/system/ptxmig-recover.service":          0o644,
		"opt/ptxmig/share/doc/ptxmig/examples/ptxmig-rebalance.cron":    0o644,
		"opt/ptxmig/share/doc/ptxmig/examples/ptxmig-rebalance.service": 0o644,
		"opt/ptxmig/share/doc/ptxmig/examples/rebalance.json":           0o644,
		"opt/ptxmig/share/doc/ptxmig/REBALANCE.md":                      0o644,
		"opt/ptxmig/share/doc/ptxmig/README.md":                         0o644,
		"opt/ptxmig/share/doc/ptxmig/FORMAT.md":                         0o644,
		"etc/ptxmig/rebalance.json":                                     0o644,
	}
	for f, mode := range files {
		fi, err := os.Stat(filepath.Join(dest, f))
		if err != nil {
			t.Errorf("not installed: %v", err)
			continue
		}
		if fi.Mode().Perm() != mode {
			t.Errorf("%s: mode %v, want %v", f, fi.Mode().Perm(), mode)
		}
	}
	// A rebalance killed with its cgroup (its guardian too) is recovered at once, by the installed binary.
	recov, _ := os.ReadFile(filepath.Join(dest, "opt/ptxmig/lib/systemd/system/ptxmig-recover.service"))
	rebal, _ := os.ReadFile(filepath.Join(dest, "opt/ptxmig/lib/systemd/system/ptxmig-rebalance.service"))
	if !strings.Contains(string(recov), "ExecStart=/opt/ptxmig/bin/ptxmig recover") || !strings.Contains(string(rebal), "OnFailure=ptxmig-recover.service") {
		t.Errorf("the recover unit does not run the installed ptxmig recover, or the rebalancer does not name it in OnFailure:\n%s\n%s", recov, rebal)
	}
	// The unit runs the installed binary with the installed policy, and its Documentation= exists.
	unit, _ := os.ReadFile(filepath.Join(dest, "opt/ptxmig/lib/systemd/system/ptxmig-rebalance.service"))
	for _, want := range []string{"ExecStart=/opt/ptxmig/bin/ptxmig ", "--policy /etc/ptxmig/rebalance.json",
		"Documentation=man:ptxmig(1) file:/opt/ptxmig/share/doc/ptxmig/REBALANCE.md"} {
		if !strings.Contains(string(unit), want) {
			t.Errorf("installed unit lacks %q:\n%s", want, unit)
		}
	}
	for _, line := range strings.Split(string(unit), "\n") {
		if doc, ok := strings.CutPrefix(line, "Documentation="); ok {
			for _, ref := range strings.Fields(doc) {
				if p, ok := strings.CutPrefix(ref, "file:"); ok {
					if _, err := os.Stat(filepath.Join(dest, p)); err != nil {
						t.Errorf("the unit's documentation %s is not installed", p)
					}
				}
			}
		}
	}
	// The installed policy is the one the units read, and it is valid.
	if _, err := rebalance.LoadPolicy(filepath.Join(dest, "etc/ptxmig/rebalance.json")); err != nil {
		t.Errorf("installed policy: %v", err)
	}
	// The installed binary's man page and completions are its own.
	bin := filepath.Join(dest, "opt/ptxmig/bin/ptxmig")
	if out, err := exec.Command(bin, "man").Output(); err != nil {
		t.Errorf("installed ptxmig man: %v", err)
	} else if page, _ := os.ReadFile(filepath.Join(dest, "opt/ptxmig/share/man/man1/ptxmig.1")); string(page) != string(out) {
		t.Error("the installed man page is not the installed binary's")
	}
	// An edited policy survives a reinstall.
	policy := filepath.Join(dest, "etc/ptxmig/rebalance.json")
	os.WriteFile(policy, []byte(`{"max_moves": 3}`), 0o644)
	if out := install(); !strings.Contains(out, "keeping") {
		t.Errorf("second install did not say it keeps the policy:\n%s", out)
	}
	if b, _ := os.ReadFile(policy); string(b) != `{"max_moves": 3}` {
		t.Errorf("reinstall replaced the edited policy: %s", b)
	}
	// uninstall removes what install put there, but the policy.
	cmd := exec.Command(mk, "--no-print-directory", "uninstall", "DESTDIR="+dest, "PREFIX=/opt/ptxmig")
	cmd.Dir = "../.."
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make uninstall: %v\n%s", err, out)
	}
	for f := range files {
		if _, err := os.Stat(filepath.Join(dest, f)); err == nil && f != "etc/ptxmig/rebalance.json" {
			t.Errorf("uninstall left %s", f)
		}
	}
}

// TestShippedPolicy: the example policy the units read is valid and holds the defaults.
func TestShippedPolicy(t *testing.T) {
	p, err := rebalance.LoadPolicy("../../scripts/ptxmig-rebalance.json")
	if err != nil {
		t.Fatal(err)
	}
	d := rebalance.DefaultPolicy()
	if p.BusyThreshold != d.BusyThreshold || p.MaxMoves != d.MaxMoves || p.Window != d.Window || p.Cooldown != d.Cooldown {
		t.Errorf("shipped policy %+v differs from the defaults %+v", p, d)
	}
}
