package store

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestGCStaleTemp (issue 36): gc removes the temp files that killed writers left in the store
// directory and in images/ (an export written there), names them, and leaves a live writer's.
func TestGCStaleTemp(t *testing.T) {
	s := openTestStore(t)
	putRandom(t, s, 1000, 3, PutOptions{Name: "img"})
	child := exec.Command(os.Args[0], "-test.run=^$")
	if err := child.Run(); err != nil {
		t.Fatalf("run a short-lived process: %v", err)
	}
	dead := child.Process.Pid
	stale := []string{
		filepath.Join(s.dir, fmt.Sprintf(".img.ptxmig.tmp-%d-1", dead)),
		filepath.Join(s.imagesDir(), fmt.Sprintf(".x.json.tmp-%d-2", dead)),
	}
	live := filepath.Join(s.dir, fmt.Sprintf(".img.ptxmig.tmp-%d-3", os.Getppid()))
	for _, p := range append(stale, live) {
		if err := os.WriteFile(p, []byte("partial"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	st, err := s.GC(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.TempRemoved != 2 || len(st.StaleTemp) != 2 || st.StaleTemp[0] != stale[0] || st.StaleTemp[1] != stale[1] {
		t.Errorf("gc removed %d temp files, stale %q; want %q", st.TempRemoved, st.StaleTemp, stale)
	}
	for _, p := range stale {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s is still there", p)
		}
	}
	if _, err := os.Lstat(live); err != nil {
		t.Errorf("a live writer's temp file was removed: %v", err)
	}
	if names, _ := s.Names(); len(names) != 1 {
		t.Errorf("images: %q", names)
	}
}
