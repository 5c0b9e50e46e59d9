package testproc

import (
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/testreq"
)

func TestParseState(t *testing.T) {
	tests := []struct {
		in      string
		want    State
		wantErr bool
	}{
		{"pid 42 step 7 hash 00000000deadbeef done 0", State{PID: 42, Step: 7, Hash: 0xdeadbeef}, false},
		{"pid 42 step 9 hash ffffffffffffffff done 1   \n", State{PID: 42, Step: 9, Hash: ^uint64(0), Done: true}, false},
		{"pid x step 7 hash 00 done 0", State{}, true},
		{"", State{}, true},
		{"pid 1 step 2 hash zz done 0", State{}, true},
		{"pid 42 step 7 hash 00000000deadbeef done 0 crc 3044100d", State{PID: 42, Step: 7, Hash: 0xdeadbeef}, false},
		{"pid 42 step 8 hash 00000000deadbeef done 0 crc 3044100d", State{}, true}, // torn: step from another write
		{"pid 42 step 7 hash 00000000deadbeef done 0 crc", State{}, true},
	}
	for _, tt := range tests {
		got, err := ParseState([]byte(tt.in))
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("ParseState(%q) = %+v, %v; want %+v, err=%v", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

// TestProgramMatchesModel runs the real C program to completion and checks every step's hash
// against the Go model, which is what C/R tests rely on.
func TestProgramMatchesModel(t *testing.T) {
	dir := t.TempDir()
	bin, err := Build(dir)
	if errors.Is(err, ErrNoCompiler) {
		testreq.Skip(t, "cc", "cannot build the test program: %v", err)
	}
	if err != nil {
		t.Fatalf("cannot build the test program: %v", err)
	}
	state := filepath.Join(dir, "state")
	p, err := Start(bin, state, Options{MiB: 1, IntervalMs: 1, Steps: 200})
	if err != nil {
		t.Fatal(err)
	}
	s, err := WaitState(state, func(s State) bool { return s.Done }, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	<-p.Exited()
	if s.Step != 200 || s.PID != p.PID {
		t.Fatalf("final state %+v, want step 200 of pid %d", s, p.PID)
	}
	m := NewModel(1)
	if err := m.Check(s); err != nil {
		t.Fatal(err)
	}
	if err := NewModel(2).Check(s); err == nil {
		t.Fatal("a model with another heap size matched: the hash does not depend on the heap")
	}
	if _, err := m.HashAt(10); err == nil {
		t.Fatal("model went backwards")
	}
}
