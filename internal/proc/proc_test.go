package proc

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	tail := " 0 0 0 0 0 0 0 0 0 0 0 0 12345 0 0"
	tests := []struct {
		name, in string
		want     Stat
		wantErr  bool
	}{
		{name: "plain", in: "42 (sleep) S 1 42 42 34816 42 4194560" + tail,
			want: Stat{PID: 42, Comm: "sleep", State: 'S', PPID: 1, PGID: 42, SID: 42, TTY: 34816, StartTicks: 12345}},
		{name: "comm with spaces and parens", in: "7 (a) b (c)) T 3 4 5 0 7 0" + tail,
			want: Stat{PID: 7, Comm: "a) b (c)", State: 'T', PPID: 3, PGID: 4, SID: 5, StartTicks: 12345}},
		{name: "cpu time", in: "9 (criu) R 1 9 9 0 9 0 0 0 0 0 250 17 0 0 0 0 0 0 777 0 0",
			want: Stat{PID: 9, Comm: "criu", State: 'R', PPID: 1, PGID: 9, SID: 9, StartTicks: 777, CPUTicks: 267}},
		{name: "bad utime", in: "9 (criu) R 1 9 9 0 9 0 0 0 0 0 x 17 0 0 0 0 0 0 777 0 0", wantErr: true},
		{name: "no comm", in: "42 sleep S 1", wantErr: true},
		{name: "short", in: "42 (x) S 1 2 3", wantErr: true},
		{name: "bad pid", in: "x (x) S 1 2 3 4 5" + tail, wantErr: true},
		{name: "bad state", in: "42 (x) SS 1 2 3 4 5" + tail, wantErr: true},
		{name: "bad ppid", in: "42 (x) S y 2 3 4 5" + tail, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseStat([]byte(tt.in))
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v, wantErr %v", err, tt.wantErr)
			}
			if !tt.wantErr && got != tt.want {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestKB(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "status")
	content := "Name:\tcat\nVmRSS:\t    2048 kB\nMemAvailable:   bad kB\nHuge:\t18446744073709551615 kB\n"
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		path, key string
		want      uint64
	}{
		{path, "VmRSS:", 2 << 20},
		{path, "MemAvailable:", 0}, // does not parse
		{path, "Huge:", 0},         // would overflow in bytes
		{path, "VmSwap:", 0},       // missing
		{filepath.Join(dir, "none"), "VmRSS:", 0},
	}
	for _, tt := range tests {
		if got := KB(tt.path, tt.key); got != tt.want {
			t.Errorf("KB(%s, %q) = %d, want %d", filepath.Base(tt.path), tt.key, got, tt.want)
		}
	}
	if RSS(os.Getpid()) == 0 {
		t.Error("RSS(self) = 0")
	}
	if MemAvailable() == 0 {
		t.Error("MemAvailable() = 0")
	}
}

func TestCmdline(t *testing.T) {
	if got := ParseCmdline([]byte("a\x00b c\x00\x00")); !slices.Equal(got, []string{"a", "b c", ""}) {
		t.Errorf("ParseCmdline = %q", got)
	}
	if ParseCmdline(nil) != nil {
		t.Error("empty cmdline should be nil")
	}
	if got := Cmdline("", os.Getpid()); len(got) == 0 {
		t.Error("Cmdline(self) is empty")
	}
}

// TestTreeSignals starts a real shell with two children, stops the whole tree, and checks that
// Tree finds every process, Continue resumes every one, and Kill ends every one.
func TestTreeSignals(t *testing.T) {
	cmd := exec.Command("sh", "-c", "sleep 60 & sleep 60 & wait")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	root := cmd.Process.Pid
	t.Cleanup(func() { _ = Kill(treePIDs(root), 5*time.Second) })
	var tree []Stat
	deadline := time.Now().Add(10 * time.Second)
	for len(tree) < 3 && time.Now().Before(deadline) {
		tree, _ = Tree(root)
		time.Sleep(10 * time.Millisecond)
	}
	if len(tree) != 3 || tree[0].PID != root || tree[1].PPID != root || tree[2].PPID != root {
		t.Fatalf("Tree(%d) = %+v, want the shell and two children", root, tree)
	}
	pids := PIDs(tree)
	for _, p := range pids {
		if err := syscall.Kill(p, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
	}
	waitState(t, pids, true)
	if d := Describe(pids); !strings.HasPrefix(d, "stopped: pid ") {
		t.Errorf("Describe(stopped tree) = %q", d)
	}
	if err := Continue(pids, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	waitState(t, pids, false)
	if d := Describe(pids); !strings.HasPrefix(d, "running: pid ") {
		t.Errorf("Describe(running tree) = %q", d)
	}
	if err := Kill(pids, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	<-done
	for _, p := range pids {
		if Alive(p) {
			t.Errorf("pid %d alive after Kill", p)
		}
	}
	if _, err := Tree(root); err == nil {
		t.Error("Tree of a reaped root succeeded")
	}
}

func TestAncestors(t *testing.T) {
	a := Ancestors(os.Getpid())
	if len(a) == 0 || a[0] != os.Getppid() {
		t.Fatalf("Ancestors(self) = %v, want the parent %d first", a, os.Getppid())
	}
	if a[len(a)-1] != 1 && Exists(1) {
		// In a pid namespace whose init is not visible, the chain ends at 0's child.
		t.Logf("ancestor chain ends at %d", a[len(a)-1])
	}
}

func treePIDs(root int) []int {
	t, _ := Tree(root)
	return PIDs(t)
}

func waitState(t *testing.T, pids []int, stopped bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for _, p := range pids {
		for {
			s, err := ReadStat(p)
			if err != nil {
				t.Fatal(err)
			}
			if s.Stopped() == stopped {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("pid %d state %c, want stopped=%v", p, s.State, stopped)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}

// TestKillOrder: killOrder puts descendants come before their ancestors, so that a Kill interrupted halfway
// leaves the survivors under a living root (a checkpoint killed while it ends the tree left a
// stopped orphan that its recovery, which walks the root's tree, could not find).
func TestKillOrder(t *testing.T) {
	for _, tt := range []struct {
		name    string
		pids    []int
		parents map[int]int
		want    []int
	}{
		{"root and child", []int{10, 11}, map[int]int{10: 1, 11: 10}, []int{11, 10}},
		{"chain", []int{10, 11, 12}, map[int]int{10: 1, 11: 10, 12: 11}, []int{12, 11, 10}},
		{"siblings keep their order", []int{10, 12, 11}, map[int]int{10: 1, 11: 10, 12: 10}, []int{12, 11, 10}},
		{"forked since the plan, appended last", []int{10, 11, 20, 21}, map[int]int{10: 1, 11: 10, 20: 11, 21: 10},
			[]int{20, 11, 21, 10}},
		{"unrelated pids keep their order", []int{5, 7, 6}, map[int]int{5: 1, 6: 1, 7: 1}, []int{5, 7, 6}},
		{"gone pids (no parent known) stay at depth 0", []int{10, 99, 11}, map[int]int{10: 1, 11: 10}, []int{11, 10, 99}},
		{"a parent loop ends", []int{10, 11}, map[int]int{10: 11, 11: 10}, []int{10, 11}},
		{"empty", nil, nil, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := killOrder(tt.pids, tt.parents); !slices.Equal(got, tt.want) {
				t.Errorf("killOrder(%v) = %v, want %v", tt.pids, got, tt.want)
			}
		})
	}
}
