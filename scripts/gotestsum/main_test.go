package main

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// testdata/sample.json is `go test -json ./...` over packages that pass, skip (whole tests,
// subtests, parallel subtests), fail (tests, subtests, a parent itself), panic, do not build and
// have no test files.
func TestSample(t *testing.T) {
	f, err := os.Open("testdata/sample.json")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out bytes.Buffer
	r := newReport(&out)
	if err := r.read(f); err != nil {
		t.Fatal(err)
	}
	line, ok := r.finish(1, "go test")
	if want := "go: 5 passed, 7 skipped, 5 failed (1 package did not build)"; line != want || ok {
		t.Errorf("count line %q, ok %v; want %q, false", line, ok, want)
	}
	got := regexp.MustCompile(`  \d+\.\d\ds  `).ReplaceAllString(out.String(), "  T  ")
	for _, want := range []string{
		"ok    skt/mixed  T  2 passed, 4 skipped\n",
		"FAIL  skt/fail  T  2 passed, 1 skipped, 3 failed\n",
		"?     skt/notests  [no test files]\n",
		// failing tests' output, without the framing lines
		"    --- TestParentSub/bad (failed)\n        sub_test.go:5: sub broke\n            second line\n",
		"    --- TestParentSelf (failed)\n        sub_test.go:9: parent broke\n",
		"panic: assignment to entry in nil map",
		// the build's own output
		"nobuild/n_test.go:3:28: undefined: undefined\n",
		// every skip with its reason
		"    skt/mixed TestGPUSkip: m_test.go:4: needs two GPUs | found 1\n",
		"    skt/mixed TestGPUPar/y: m_test.go:11: parallel skip y\n",
		"    skt/allskip TestGPUB/s: a_test.go:4: no GPU either\n",
		"    skt/nobuild (build failed: skt/nobuild [skt/nobuild.test])\n",
		"\ngo: 5 passed, 7 skipped, 5 failed (1 package did not build)\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("output lacks %q:\n%s", want, got)
		}
	}
	for _, unwanted := range []string{"=== RUN", "--- FAIL:", "TestGPUSub (", "TestParentSub (failed)"} {
		if strings.Contains(got, unwanted) {
			t.Errorf("output has %q:\n%s", unwanted, got)
		}
	}
	if !strings.HasSuffix(got, line+"\n") {
		t.Errorf("output does not end with the count line:\n%s", got)
	}
}

func TestRun(t *testing.T) {
	dir := t.TempDir()
	sum := filepath.Join(dir, "summary")
	tests := []struct {
		name, script, line string
		exit               int
	}{
		{"passing", `echo '{"Action":"pass","Package":"p","Test":"TestA"}'; echo '{"Action":"pass","Package":"p"}'`,
			"go: 1 passed, 0 skipped, 0 failed", 0},
		// A failing command that reports nothing still fails, and says so.
		{"silent failure", `echo not json; exit 3`, "go: 0 passed, 0 skipped, 1 failed", 1},
		// A package that never ended (the stream broke off) fails with its unfinished tests.
		{"cut off", `echo '{"Action":"run","Package":"p","Test":"TestA"}'`, "go: 0 passed, 0 skipped, 1 failed", 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			if got := run([]string{"sh", "-c", tt.script}, &out, &errb, sum); got != tt.exit {
				t.Errorf("exit %d, want %d; output:\n%s%s", got, tt.exit, out.String(), errb.String())
			}
			b, err := os.ReadFile(sum)
			if err != nil || string(b) != tt.line+"\n" {
				t.Errorf("summary file %q (%v), want %q", b, err, tt.line)
			}
		})
	}
}
