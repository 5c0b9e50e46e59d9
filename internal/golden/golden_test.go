package golden

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// fakeT records failures; Fatalf ends the goroutine as testing.T's does.
type fakeT struct {
	testing.TB
	errs  []string
	fatal bool
}

func (f *fakeT) Helper()                   {}
func (f *fakeT) Name() string              { return "TestX/sub" }
func (f *fakeT) Logf(string, ...any)       {}
func (f *fakeT) Errorf(s string, a ...any) { f.errs = append(f.errs, fmt.Sprintf(s, a...)) }
func (f *fakeT) Fatal(a ...any)            { f.Fatalf("%s", fmt.Sprint(a...)) }
func (f *fakeT) Fatalf(s string, a ...any) {
	f.Errorf(s, a...)
	f.fatal = true
	runtime.Goexit()
}

func check(path string, got string) (*fakeT, bool) {
	ft := &fakeT{}
	ok := false
	done := make(chan struct{})
	go func() {
		defer close(done)
		ok = Check(ft, path, []byte(got))
	}()
	<-done
	return ft, ok
}

func read(t *testing.T, path string) (string, bool) {
	t.Helper()
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return "", false
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(b), true
}

func TestCheck(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "out.golden")
	actual := path + ".actual"

	// Missing golden file: a fatal failure, the output kept in .actual.
	ft, ok := check(path, "one\n")
	if ok || !ft.fatal || !strings.Contains(ft.errs[0], "-run '^TestX$' -update") {
		t.Fatalf("missing golden file: ok %v, fatal %v, %q", ok, ft.fatal, ft.errs)
	}
	if s, _ := read(t, actual); s != "one\n" {
		t.Errorf(".actual = %q", s)
	}

	// Mismatch: a failure with a diff, .actual written, the golden file untouched.
	os.WriteFile(path, []byte("one\ntwo\n"), 0o644)
	ft, ok = check(path, "one\nTWO\n")
	if ok || ft.fatal || len(ft.errs) != 1 || !strings.Contains(ft.errs[0], `+   2 "TWO\n"`) {
		t.Fatalf("mismatch: ok %v, fatal %v, %q", ok, ft.fatal, ft.errs)
	}
	if s, _ := read(t, actual); s != "one\nTWO\n" {
		t.Errorf(".actual = %q", s)
	}
	if s, _ := read(t, path); s != "one\ntwo\n" {
		t.Errorf("golden file changed to %q", s)
	}

	// Match: passes and removes the stale .actual.
	ft, ok = check(path, "one\ntwo\n")
	if !ok || len(ft.errs) != 0 {
		t.Fatalf("match: ok %v, %q", ok, ft.errs)
	}
	if _, ok := read(t, actual); ok {
		t.Error("stale .actual kept after a match")
	}

	// -update: rewrites (creating directories) and removes .actual.
	*update = true
	defer func() { *update = false }()
	os.WriteFile(actual, []byte("stale"), 0o644)
	nested := filepath.Join(dir, "sub", "new.golden.json")
	for _, p := range []string{path, nested} {
		if ft, ok := check(p, "new\n"); !ok || len(ft.errs) != 0 {
			t.Fatalf("update %s: ok %v, %q", p, ok, ft.errs)
		}
		if s, _ := read(t, p); s != "new\n" {
			t.Errorf("updated %s = %q", p, s)
		}
	}
	if _, ok := read(t, actual); ok {
		t.Error(".actual kept after -update")
	}
}

func TestDiff(t *testing.T) {
	tests := []struct{ want, got, diff string }{
		{"a\nb\n", "a\nc\n", "want 2 line(s), got 2; first difference at line 2:\n-   2 \"b\\n\"\n+   2 \"c\\n\"\n"},
		{"a\n", "a", "want 1 line(s), got 1; first difference at line 1:\n-   1 \"a\\n\"\n+   1 \"a\"\n"},
		{"a\n", "a\nb\nc\nd\ne\n", "want 1 line(s), got 5; first difference at line 2:\n" +
			"+   2 \"b\\n\"\n+   3 \"c\\n\"\n+   4 \"d\\n\"\n+     … 1 more changed line(s)\n"},
		// Only the changed block shows, not the equal lines around it.
		{"a\nb\nc\nd\n", "a\nB\nc\nd\n", "want 4 line(s), got 4; first difference at line 2:\n-   2 \"b\\n\"\n+   2 \"B\\n\"\n"},
		{"x\nx\n", "x\nx\nx\n", "want 2 line(s), got 3; first difference at line 3:\n+   3 \"x\\n\"\n"},
		{"", "\x00\xff", "want 0 line(s), got 1; first difference at line 1:\n+   1 \"\\x00\\xff\"\n"},
	}
	for _, tt := range tests {
		if got := Diff([]byte(tt.want), []byte(tt.got)); got != tt.diff {
			t.Errorf("Diff(%q, %q) =\n%s\nwant\n%s", tt.want, tt.got, got, tt.diff)
		}
	}
}
