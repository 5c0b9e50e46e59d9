package rebalance

import (
	"bufio"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

func TestStateRoundTripAndPerms(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "rebalance")
	if err := EnsureDir(dir); err != nil {
		t.Fatal(err)
	}
	st, warn, err := LoadState(dir, t0, true, quiet())
	if err != nil || warn != "" || len(st.History) != 0 {
		t.Fatalf("missing file: %+v %q %v", st, warn, err)
	}
	st.History = append(st.History, MoveRecord{PID: 42, StartTicks: 7, From: uuidOf(0), To: uuidOf(1), ToIndex: 1, At: t0, OK: true, Seconds: 2.5})
	st.Totals = Totals{Runs: 3, Moves: 1, LastRun: t0}
	if err := SaveState(dir, st); err != nil {
		t.Fatal(err)
	}
	got, warn, err := LoadState(dir, t0, true, quiet())
	if err != nil || warn != "" {
		t.Fatalf("%q %v", warn, err)
	}
	if len(got.History) != 1 || got.History[0].PID != 42 || !got.History[0].At.Equal(t0) || got.Totals.Runs != 3 {
		t.Errorf("round trip: %+v", got)
	}
	for name, want := range map[string]os.FileMode{dir: 0o700, filepath.Join(dir, StateFile): 0o600} {
		fi, err := os.Stat(name)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != want {
			t.Errorf("%s mode %v, want %v", name, fi.Mode().Perm(), want)
		}
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if strings.Contains(e.Name(), ".tmp-") {
			t.Errorf("temp file left behind: %s", e.Name())
		}
	}
}

func TestStateCorruptionResets(t *testing.T) {
	valid := `{"version":1,"history":[],"totals":{"runs":1,"moves":0,"failures":0}}`
	tests := []struct{ name, content string }{
		{"garbage", "\x00\x01not json"},
		{"truncated", valid[:30]},
		{"wrong version", `{"version":2,"history":[],"totals":{}}`},
		{"negative pid", `{"version":1,"history":[{"pid":-1,"from_uuid":"GPU-a","to_uuid":"GPU-b","at":"2026-03-01T12:00:00Z"}],"totals":{}}`},
		{"bad uuid", `{"version":1,"history":[{"pid":5,"from_uuid":"../../x y","to_uuid":"GPU-b","at":"2026-03-01T12:00:00Z"}],"totals":{}}`},
		{"no time", `{"version":1,"history":[{"pid":5,"from_uuid":"GPU-a","to_uuid":"GPU-b"}],"totals":{}}`},
		{"unknown field", `{"version":1,"history":[],"totals":{},"extra":1}`},
		{"trailing data", valid + `{}`},
		{"empty", ``},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			file := filepath.Join(dir, StateFile)
			if err := os.WriteFile(file, []byte(tt.content), 0o600); err != nil {
				t.Fatal(err)
			}
			// Dry runs warn but leave the file where it is.
			st, warn, err := LoadState(dir, t0, false, quiet())
			if err != nil || st == nil || len(st.History) != 0 || !strings.Contains(warn, "corrupt rebalance state file") {
				t.Fatalf("dry: st %+v warn %q err %v", st, warn, err)
			}
			if b, _ := os.ReadFile(file); string(b) != tt.content {
				t.Fatalf("dry run changed the file")
			}
			st, warn, err = LoadState(dir, t0, true, quiet())
			if err != nil || st.Version != stateVersion || !strings.Contains(warn, "kept as state.json.corrupt-") {
				t.Fatalf("st %+v warn %q err %v", st, warn, err)
			}
			kept, err := os.ReadFile(file + ".corrupt-" + "1772366400")
			if err != nil || string(kept) != tt.content {
				t.Errorf("corrupt file not kept aside: %v", err)
			}
			if _, err := os.Stat(file); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("corrupt state still in place: %v", err)
			}
		})
	}
	t.Run("valid file is accepted", func(t *testing.T) {
		dir := t.TempDir()
		os.WriteFile(filepath.Join(dir, StateFile), []byte(valid), 0o600)
		if st, warn, err := LoadState(dir, t0, true, quiet()); err != nil || warn != "" || st.Totals.Runs != 1 {
			t.Errorf("%+v %q %v", st, warn, err)
		}
	})
}

func TestStateSymlinkNotFollowed(t *testing.T) {
	dir := t.TempDir()
	outside := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(outside, []byte(`{"version":1,"history":[],"totals":{"runs":9}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(dir, StateFile)); err != nil {
		t.Fatal(err)
	}
	st, warn, err := LoadState(dir, t0, true, quiet())
	if err != nil || st.Totals.Runs != 0 || !strings.Contains(warn, "corrupt") {
		t.Fatalf("symlinked state: %+v %q %v", st, warn, err)
	}
	if err := SaveState(dir, st); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(outside); !strings.Contains(string(b), `"runs":9`) {
		t.Errorf("the symlink target was written: %s", b)
	}
	// A symlinked state directory is refused.
	link := filepath.Join(t.TempDir(), "rebalance")
	os.Symlink(dir, link)
	if err := EnsureDir(link); err == nil {
		t.Error("EnsureDir accepted a symlink")
	}
}

func TestPrune(t *testing.T) {
	st := &State{Version: 1}
	for i := 0; i < maxRecords+10; i++ {
		st.History = append(st.History, MoveRecord{PID: 1, At: t0.Add(-time.Duration(maxRecords+10-i) * time.Second)})
	}
	st.History = append([]MoveRecord{{PID: 2, At: t0.Add(-48 * time.Hour)}}, st.History...)
	st.Prune(t0, 24*time.Hour)
	if len(st.History) != maxRecords || st.History[0].PID != 1 || !st.History[len(st.History)-1].At.Equal(t0.Add(-time.Second)) {
		t.Errorf("prune kept %d, first %+v", len(st.History), st.History[0])
	}
}

func TestLockContention(t *testing.T) {
	dir := t.TempDir()
	l1, err := TryLock(dir)
	if err != nil {
		t.Fatal(err)
	}
	_, err = TryLock(dir)
	if !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "pid ") {
		t.Fatalf("second lock: %v, want ErrBusy naming the holder", err)
	}
	if err := l1.Unlock(); err != nil {
		t.Fatal(err)
	}
	l2, err := TryLock(dir)
	if err != nil {
		t.Fatalf("after unlock: %v", err)
	}
	l2.Unlock()
}

// TestLockAcrossProcesses holds the lock in a child process (this test binary, re-executed) and
// checks that this process sees it busy, then free once the child exits.
func TestLockAcrossProcesses(t *testing.T) {
	if dir := os.Getenv("REBALANCE_LOCK_HELPER"); dir != "" {
		l, err := TryLock(dir)
		if err != nil {
			os.Exit(3)
		}
		os.Stdout.WriteString("locked\n")
		bufio.NewReader(os.Stdin).ReadString('\n') // hold until the parent closes stdin
		l.Unlock()
		os.Exit(0)
	}
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^TestLockAcrossProcesses$")
	cmd.Env = append(os.Environ(), "REBALANCE_LOCK_HELPER="+dir)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || line != "locked\n" {
		t.Fatalf("helper: %q %v", line, err)
	}
	_, err = TryLock(dir)
	if !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "pid ") {
		t.Errorf("lock held by pid %d: got %v", cmd.Process.Pid, err)
	}
	stdin.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	l, err := TryLock(dir)
	if err != nil {
		t.Fatalf("after the holder exited: %v", err)
	}
	l.Unlock()
}
