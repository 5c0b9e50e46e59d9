// Package golden compares test output with golden files (expected output kept under testdata/).
//
// `go test -update` rewrites the golden files of the package under test instead of comparing.
// On a mismatch, or when the golden file is missing, the output is written beside the golden
// file as PATH.actual: the golden file's full name with ".actual" appended, whatever its own
// suffix (testdata/help.golden → testdata/help.golden.actual, testdata/m.golden.json →
// testdata/m.golden.json.actual), so `diff PATH PATH.actual` shows the whole change. The test
// then fails with a short diff. A match removes a stale .actual. .gitignore ignores *.actual.
package golden

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite golden files instead of comparing with them")

// Update reports whether the test runs with -update.
func Update() bool { return *update }

// ActualPath is where Check writes the output that did not match the golden file at path.
func ActualPath(path string) string { return path + ".actual" }

// Check compares got with the golden file at path and reports whether they match. With -update
// it writes got to path (creating its directory) instead and reports true. On a mismatch it
// writes ActualPath(path) and fails the test with a short diff (t.Errorf, so the test goes on);
// a missing golden file stops the test (t.Fatalf).
func Check(t testing.TB, path string, got []byte) bool {
	t.Helper()
	actual := ActualPath(path)
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		removeStale(t, actual)
		return true
	}
	want, err := os.ReadFile(path)
	if err != nil {
		writeActual(t, actual, got)
		t.Fatalf("golden file: %v; output in %s (%s)", err, actual, rerun(t))
		return false
	}
	if bytes.Equal(got, want) {
		removeStale(t, actual)
		return true
	}
	writeActual(t, actual, got)
	t.Errorf("%s differs from its golden file; output in %s (%s):\n%s", path, actual, rerun(t), Diff(want, got))
	return false
}

// rerun is the hint to accept a change.
func rerun(t testing.TB) string {
	name, _, _ := strings.Cut(t.Name(), "/")
	return fmt.Sprintf("if intended: go test -run '^%s$' -update", name)
}

func writeActual(t testing.TB, actual string, got []byte) {
	t.Helper()
	if err := os.WriteFile(actual, got, 0o644); err != nil {
		t.Logf("write %s: %v", actual, err)
	}
}

func removeStale(t testing.TB, actual string) {
	t.Helper()
	if err := os.Remove(actual); err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Logf("remove stale %s: %v", actual, err)
	}
}

// diffLines is how many changed lines of each side Diff shows.
const diffLines = 3

// Diff is a short line diff of want and got: the line counts, then the block of lines between
// their common beginning and common end, up to three lines of each side with their numbers,
// quoted (so whitespace and binary bytes show).
func Diff(want, got []byte) string {
	w, g := lines(want), lines(got)
	i := 0
	for i < len(w) && i < len(g) && w[i] == g[i] {
		i++
	}
	k := 0
	for k < len(w)-i && k < len(g)-i && w[len(w)-1-k] == g[len(g)-1-k] {
		k++
	}
	var b strings.Builder
	fmt.Fprintf(&b, "want %d line(s), got %d; first difference at line %d:\n", len(w), len(g), i+1)
	side := func(sign string, block []string) {
		for j, l := range block[:min(len(block), diffLines)] {
			fmt.Fprintf(&b, "%s%4d %q\n", sign, i+j+1, l)
		}
		if n := len(block) - diffLines; n > 0 {
			fmt.Fprintf(&b, "%s     … %d more changed line(s)\n", sign, n)
		}
	}
	side("-", w[i:len(w)-k])
	side("+", g[i:len(g)-k])
	return b.String()
}

// lines splits b after each newline; a final line without one is a line too.
func lines(b []byte) []string {
	var ls []string
	for len(b) > 0 {
		i := bytes.IndexByte(b, '\n') + 1
		if i == 0 {
			i = len(b)
		}
		ls = append(ls, string(b[:i]))
		b = b[i:]
	}
	return ls
}
