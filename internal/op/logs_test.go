package op

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestKeepAndPruneLogs: a failure's logs land in a new private directory; retention keeps the
// newest LogKeep and drops those older than LogMaxAge.
func TestKeepAndPruneLogs(t *testing.T) {
	root := filepath.Join(t.TempDir(), "logs")
	t.Setenv("PTXMIG_LOG_DIR", root)
	src := filepath.Join(t.TempDir(), "dump.log")
	if err := os.WriteFile(src, []byte("(00.1) Error (x.c:1): boom\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	dir, err := KeepLogs("checkpoint", 42, src, filepath.Join(t.TempDir(), "missing.log"))
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(filepath.Join(dir, "dump.log"))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("kept log: %v, mode %v; want 0600", err, st)
	}
	if st, err := os.Stat(root); err != nil || st.Mode().Perm() != 0o700 {
		t.Fatalf("log root: %v %v; want 0700", err, st)
	}
	// A second failure in the same second gets its own directory.
	dir2, err := KeepLogs("checkpoint", 42, src)
	if err != nil || dir2 == dir {
		t.Fatalf("second failure: %s (%v), first %s", dir2, err, dir)
	}
	now := time.Now()
	for i := 0; i < 5; i++ {
		d := filepath.Join(root, "restore-"+string(rune('a'+i)))
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		mt := now.Add(-time.Duration(i) * time.Hour)
		if i == 4 {
			mt = now.Add(-LogMaxAge - time.Hour)
		}
		if err := os.Chtimes(d, mt, mt); err != nil {
			t.Fatal(err)
		}
	}
	removed, err := PruneLogs(root, 4, LogMaxAge, now)
	if err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(root)
	if len(ents) != 4 || len(removed) != 3 {
		t.Fatalf("after pruning to 4: %d left, removed %v", len(ents), removed)
	}
	if removed, _ := PruneLogs(filepath.Join(root, "none"), 0, 0, now); removed != nil {
		t.Errorf("missing root: removed %v", removed)
	}
}
