// Command gotestsum runs `go test -json` and summarizes it for people: one line per package (ok,
// FAIL, or no test files), the output of each failing test and of each build that failed, every
// skipped test with its skip reason, and a last line
//
//	go: N passed, M skipped, K failed
//
// counting tests individually (subtests included; a test with subtests counts only through them).
// It exits non-zero when a test or a package failed, a build failed, or the command itself failed.
//
//	go run ./scripts/gotestsum [-summary FILE] -- go test -race -count=1 -json ./...
//
// -summary also writes the last line to FILE (make test prints it again at its very end).
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"sort"
	"strings"
	"time"
)

func main() {
	summary := flag.String("summary", "", "also write the final count line to this file")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: gotestsum [-summary FILE] -- go test -json [args...]")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	os.Exit(run(flag.Args(), os.Stdout, os.Stderr, *summary))
}

// run executes args (a `go test -json` command line), reporting to w.
func run(args []string, w, errw io.Writer, summaryFile string) int {
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stderr = errw
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		fmt.Fprintf(errw, "gotestsum: %v\n", err)
		return 1
	}
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(errw, "gotestsum: %v\n", err)
		return 1
	}
	r := newReport(w)
	if err := r.read(stdout); err != nil {
		fmt.Fprintf(errw, "gotestsum: reading %s: %v\n", args[0], err)
	}
	exit := 0
	if err := cmd.Wait(); err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) {
			fmt.Fprintf(errw, "gotestsum: %v\n", err)
		}
		exit = 1
		if ee != nil {
			exit = ee.ExitCode()
		}
	}
	line, ok := r.finish(exit, strings.Join(args, " "))
	if summaryFile != "" {
		if err := os.WriteFile(summaryFile, []byte(line+"\n"), 0o644); err != nil {
			fmt.Fprintf(errw, "gotestsum: %v\n", err)
			return 1
		}
	}
	if !ok {
		return 1
	}
	return 0
}

// event is one line of `go test -json` (cmd/test2json), build events included (Go >= 1.24).
type event struct {
	Time        time.Time
	Action      string
	Package     string
	Test        string
	Elapsed     float64
	Output      string
	ImportPath  string
	FailedBuild string
}

type test struct {
	name   string
	action string // pass, fail, skip; "" while running
	output []string
}

type pkg struct {
	tests  map[string]*test
	order  []string
	output []string // lines outside any test
}

// result of one test for the final lists.
type result struct{ pkg, test, detail string }

type report struct {
	w       io.Writer
	pkgs    map[string]*pkg
	builds  map[string][]string // build output by import path
	passed  int
	skipped []result
	failed  []result
	broken  []string // packages that failed outside any test (build failures included)
	unbuilt int      // packages that did not build
}

func newReport(w io.Writer) *report {
	return &report{w: w, pkgs: map[string]*pkg{}, builds: map[string][]string{}}
}

func (r *report) read(in io.Reader) error {
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var e event
		if len(line) == 0 || line[0] != '{' || json.Unmarshal(line, &e) != nil {
			fmt.Fprintf(r.w, "%s\n", line) // not JSON: pass it on
			continue
		}
		r.event(e)
	}
	return sc.Err()
}

func (r *report) pkg(name string) *pkg {
	p := r.pkgs[name]
	if p == nil {
		p = &pkg{tests: map[string]*test{}}
		r.pkgs[name] = p
	}
	return p
}

func (r *report) event(e event) {
	switch e.Action {
	case "build-output":
		r.builds[e.ImportPath] = append(r.builds[e.ImportPath], e.Output)
		return
	case "build-fail", "start":
		return
	}
	if e.Package == "" {
		return
	}
	p := r.pkg(e.Package)
	if e.Test == "" {
		switch e.Action {
		case "output":
			p.output = append(p.output, e.Output)
		case "pass", "fail", "skip":
			r.done(e, p)
		}
		return
	}
	t := p.tests[e.Test]
	if t == nil {
		t = &test{name: e.Test}
		p.tests[e.Test] = t
		p.order = append(p.order, e.Test)
	}
	switch e.Action {
	case "output":
		t.output = append(t.output, e.Output)
	case "pass", "fail", "skip":
		t.action = e.Action
	}
}

var (
	fileLine = regexp.MustCompile(`^\s+\S+\.go:\d+: `)
	framing  = regexp.MustCompile(`^\s*(=== (RUN|PAUSE|CONT|NAME)\s|--- (PASS|FAIL|SKIP): )`)
)

// skipReason is the last "file.go:N: message" line of a skipped test's output: with -json the
// test runs verbosely, so its t.Skip message is the last thing it logs.
func skipReason(out []string) string {
	for i := len(out) - 1; i >= 0; i-- {
		if fileLine.MatchString(out[i]) {
			return strings.TrimSpace(out[i])
		}
	}
	return "(no reason given)"
}

// done handles a package's end: counts, its status line, and the output of what failed.
func (r *report) done(e event, p *pkg) {
	delete(r.pkgs, e.Package)
	if e.Action == "skip" && len(p.order) == 0 {
		fmt.Fprintf(r.w, "?     %s  [no test files]\n", e.Package)
		return
	}
	var passed, skipped int
	var failed []*test
	for _, name := range p.order {
		t := p.tests[name]
		if hasSubtests(p, name) {
			if t.action == "fail" && !anyFailed(p, name) {
				failed = append(failed, t) // failed itself, not through a subtest
			}
			continue
		}
		switch t.action {
		case "pass":
			passed++
		case "skip":
			skipped++
			r.skipped = append(r.skipped, result{e.Package, name, skipReason(t.output)})
		case "fail":
			failed = append(failed, t)
		default: // never finished: the binary panicked, timed out or exited under it
			failed = append(failed, t)
		}
	}
	r.passed += passed
	status := "ok  "
	if e.Action == "fail" {
		status = "FAIL"
	}
	counts := fmt.Sprintf("%d passed", passed)
	if skipped > 0 {
		counts += fmt.Sprintf(", %d skipped", skipped)
	}
	if len(failed) > 0 {
		counts += fmt.Sprintf(", %d failed", len(failed))
	}
	fmt.Fprintf(r.w, "%s  %s  %.2fs  %s\n", status, e.Package, e.Elapsed, counts)
	for _, t := range failed {
		detail := "failed"
		if t.action == "" {
			detail = "did not finish"
		}
		r.failed = append(r.failed, result{e.Package, t.name, detail})
		fmt.Fprintf(r.w, "    --- %s (%s)\n", t.name, detail)
		for _, l := range t.output {
			if !framing.MatchString(l) {
				fmt.Fprintf(r.w, "    %s", ensureNewline(l))
			}
		}
	}
	if e.Action == "fail" && len(failed) == 0 {
		detail := "failed outside any test"
		if e.FailedBuild != "" {
			detail = "build failed: " + e.FailedBuild
			r.unbuilt++
			for _, l := range r.builds[e.FailedBuild] {
				fmt.Fprintf(r.w, "    %s", ensureNewline(l))
			}
		}
		r.broken = append(r.broken, e.Package+" ("+detail+")")
		for _, l := range p.output {
			if !strings.HasPrefix(l, "FAIL\t") && l != "FAIL\n" {
				fmt.Fprintf(r.w, "    %s", ensureNewline(l))
			}
		}
	}
}

func hasSubtests(p *pkg, name string) bool {
	for _, n := range p.order {
		if strings.HasPrefix(n, name+"/") {
			return true
		}
	}
	return false
}

func anyFailed(p *pkg, name string) bool {
	for _, n := range p.order {
		if strings.HasPrefix(n, name+"/") && p.tests[n].action != "pass" && p.tests[n].action != "skip" {
			return true
		}
	}
	return false
}

func ensureNewline(s string) string {
	if strings.HasSuffix(s, "\n") {
		return s
	}
	return s + "\n"
}

// finish reports packages that never ended, lists skips and failures, and prints the count line,
// which it returns with whether everything passed. exit is the command's exit status.
func (r *report) finish(exit int, cmdline string) (string, bool) {
	var unfinished []string
	for name := range r.pkgs {
		unfinished = append(unfinished, name)
	}
	sort.Strings(unfinished)
	for _, name := range unfinished {
		p := r.pkgs[name]
		if len(p.order) == 0 && len(p.output) == 0 {
			continue
		}
		r.done(event{Action: "fail", Package: name}, p)
	}
	if len(r.skipped) > 0 {
		fmt.Fprintf(r.w, "\nskipped (%d):\n", len(r.skipped))
		for _, s := range r.skipped {
			fmt.Fprintf(r.w, "    %s %s: %s\n", s.pkg, s.test, s.detail)
		}
	}
	nfailed := len(r.failed) + len(r.broken)
	if nfailed > 0 {
		fmt.Fprintf(r.w, "\nfailed (%d):\n", nfailed)
		for _, f := range r.failed {
			fmt.Fprintf(r.w, "    %s %s (%s)\n", f.pkg, f.test, f.detail)
		}
		for _, b := range r.broken {
			fmt.Fprintf(r.w, "    %s\n", b)
		}
	}
	ok := nfailed == 0 && exit == 0
	if exit != 0 && nfailed == 0 {
		fmt.Fprintf(r.w, "\n%s: exit status %d with no failed test or package reported\n", cmdline, exit)
		nfailed++
	}
	line := fmt.Sprintf("go: %d passed, %d skipped, %d failed", r.passed, len(r.skipped), nfailed)
	if r.unbuilt > 0 {
		line += fmt.Sprintf(" (%d %s did not build)", r.unbuilt, plural(r.unbuilt, "package", "packages"))
	}
	fmt.Fprintf(r.w, "\n%s\n", line)
	return line, ok
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
