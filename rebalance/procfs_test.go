package rebalance

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

func TestParseSmallFiles(t *testing.T) {
	if got := proc.ParseCmdline([]byte("python3\x00train.py\x00--steps\x0010\x00")); !reflect.DeepEqual(got, []string{"python3", "train.py", "--steps", "10"}) {
		t.Errorf("cmdline %q", got)
	}
	if got := proc.ParseCmdline(nil); got != nil {
		t.Errorf("empty cmdline %q", got)
	}
	for env, want := range map[string]bool{
		"HOME=/root\x00PTXMIG_PIN=1\x00": true,
		"PTXMIG_PIN=1":                   true,
		"PTXMIG_PIN=0\x00":               false,
		"XPTXMIG_PIN=1\x00":              false,
		"A=PTXMIG_PIN=1\x00":             false,
		"PTXMIG_PIN=10\x00PATH=/bin\x00": false,
	} {
		if got := EnvHasPin([]byte(env)); got != want {
			t.Errorf("EnvHasPin(%q) = %v", env, got)
		}
	}
	if bt, err := proc.ParseBootTime([]byte("cpu  1 2 3\nbtime 1772300000\nprocesses 5\n")); err != nil || bt.Unix() != 1772300000 {
		t.Errorf("btime %v %v", bt, err)
	}
	if _, err := proc.ParseBootTime([]byte("cpu 1\n")); err == nil {
		t.Error("missing btime accepted")
	}
}

// TestProcFSFake reads a fake /proc tree through the real reader.
func TestProcFSFake(t *testing.T) {
	root := t.TempDir()
	write := func(rel, content string) {
		p := filepath.Join(root, rel)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("stat", "cpu 1 2\nbtime 1772300000\n")
	write("77/stat", "77 (counter) R 1 77 77 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 6000 0 0")
	write("77/cmdline", "./counter\x00--busy\x00")
	write("77/environ", "PTXMIG_PIN=1\x00")
	// The shim rule is shimctl.IsShimLib's (its table test has the cases); any libptxmig*.so* counts.
	write("77/maps", "7f0-7f1 r--p 0 fd:01 2 /usr/lib/x86_64-linux-gnu/libc.so.6\n7f1-7f2 r-xp 0 fd:01 1 /opt/ptxmig lib/libptxmig-san.so\n")
	write("78/stat", "78 (zomb) Z 1 78 78 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 6000 0 0")
	write("79/stat", "79 (noenv) S 1 79 79 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0")
	fs := ProcFS{Root: root}
	info, err := fs.Read(77)
	if err != nil {
		t.Fatal(err)
	}
	want := ProcInfo{Comm: "counter", State: 'R', SID: 77, Cmdline: []string{"./counter", "--busy"}, StartTicks: 6000,
		StartTime: time.Unix(1772300060, 0), EnvPin: true, EnvKnown: true, UnderShim: true}
	if !reflect.DeepEqual(info, want) {
		t.Errorf("got %+v\nwant %+v", info, want)
	}
	if _, err := fs.Read(78); !errors.Is(err, ErrNoProcess) {
		t.Errorf("zombie: %v", err)
	}
	if _, err := fs.Read(80); !errors.Is(err, ErrNoProcess) {
		t.Errorf("missing: %v", err)
	}
	if info, err := fs.Read(79); err != nil || info.EnvKnown || info.UnderShim {
		t.Errorf("no environ: %+v %v", info, err)
	}
}

// TestProcFSSelf reads this test process from the real /proc.
func TestProcFSSelf(t *testing.T) {
	info, err := ProcFS{}.Read(os.Getpid())
	if err != nil {
		testreq.Skip(t, "proc", "no usable /proc: %v", err)
	}
	if !strings.HasPrefix(filepath.Base(os.Args[0]), info.Comm) || !info.EnvKnown || info.UnderShim {
		t.Errorf("self: %+v", info)
	}
	if age := time.Since(info.StartTime); age < 0 || age > 10*time.Minute {
		t.Errorf("self started %s ago", age)
	}
	if info.EnvPin != (os.Getenv("PTXMIG_PIN") == "1") {
		t.Errorf("EnvPin %v with PTXMIG_PIN=%q", info.EnvPin, os.Getenv("PTXMIG_PIN"))
	}
}
