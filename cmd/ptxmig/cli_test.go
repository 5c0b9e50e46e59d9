package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/store"
)

// TestNormalizeArgs: flags move to the command that defines them (or to the app), values stay
// with their flags, `--` and ptxmig run's command line are left alone, help becomes --help.
func TestNormalizeArgs(t *testing.T) {
	app := newApp(io.Discard, io.Discard)
	tests := []struct {
		in   string
		want string
		path string
		json bool
	}{
		{"checkpoint 4242 --name x", "checkpoint --name x -- 4242", "checkpoint", false},
		{"checkpoint --name x 4242", "checkpoint --name x -- 4242", "checkpoint", false},
		{"images --json", "--json images", "images", true},
		{"images --json=false", "--json=false images", "images", false},
		{"image rm c1b --json", "--json image rm -- c1b", "image rm", true},
		{"image verify c1 --workers 2", "image verify --workers 2 -- c1", "image verify", false},
		{"image export NAME -o FILE --store /s", "--store /s image export -o FILE -- NAME", "image export", false},
		{"image export --output=F NAME", "image export --output=F -- NAME", "image export", false},
		{"image --workers 2 verify x", "image verify --workers 2 -- x", "image verify", false},
		{"checkpoint --prestage-workers -1 4242", "checkpoint --prestage-workers -1 -- 4242", "checkpoint", false},
		{"image rm -- --json", "image rm -- --json", "image rm", false},
		{"image rm x --bogus", "image rm --bogus -- x", "image rm", false},
		{"--bogus images", "--bogus images", "images", false},
		{"run --json -- sh -c x --json", "--json run -- sh -c x --json", "run", true},
		{"run --shim /s sh -c x --help", "run --shim /s -- sh -c x --help", "run", false},
		{"help image export", "image export --help", "image export", false},
		{"image help export", "image export --help", "image export", false},
		{"image export x --help", "image export --help -- x", "image export", false},
		{"help", "--help", "", false},
		{"image list -q", "image list -q", "image ls", false},
		{"ptx instrument --report --json -o - -", "--json ptx instrument --report -o - -- -", "ptx instrument", true},
	}
	for _, tt := range tests {
		p, err := normalizeArgs(app, append([]string{"ptxmig"}, strings.Fields(tt.in)...))
		if err != nil {
			t.Errorf("%q: %v", tt.in, err)
			continue
		}
		got := strings.Join(p.args[1:], " ")
		want := tt.want
		if tt.in == "image list -q" {
			want = "image ls -q" // the path is the command's name, whatever alias was typed
		}
		if got != want || strings.Join(p.path, " ") != tt.path || p.json != tt.json {
			t.Errorf("%q: args %q path %q json %v; want %q %q %v", tt.in, got, p.path, p.json, want, tt.path, tt.json)
		}
	}
	for _, bad := range []string{"chekpoint 1", "image lss", "help nosuch", "image help nosuch"} {
		if _, err := normalizeArgs(app, append([]string{"ptxmig"}, strings.Fields(bad)...)); exitStatus(err) != 2 {
			t.Errorf("%q: %v, want a usage error", bad, err)
		}
	}
	_, err := normalizeArgs(app, []string{"ptxmig", "chekpoint"})
	if err == nil || !strings.Contains(err.Error(), "did you mean checkpoint") {
		t.Errorf("typo'd command: %v", err)
	}
}

// newTestStore makes a store with one image called name, through the CLI.
func newTestStore(t *testing.T, names ...string) (storeDir, src string) {
	t.Helper()
	dir := t.TempDir()
	storeDir, src = filepath.Join(dir, "store"), filepath.Join(dir, "src")
	os.MkdirAll(filepath.Join(src, "sub"), 0o755)
	os.WriteFile(filepath.Join(src, "sub", "pages-1.img"), bytes.Repeat([]byte("page"), 30000), 0o600)
	for _, n := range names {
		if out, errOut, code := runCLI(t, "--store", storeDir, "image", "add", n, src); code != 0 {
			t.Fatalf("image add %s: exit %d %s %s", n, code, out, errOut)
		}
	}
	return storeDir, src
}

// oneJSON parses s as exactly one JSON document (an object) and returns it.
func oneJSON(t *testing.T, what, s string) map[string]any {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(s))
	var v any
	if err := dec.Decode(&v); err != nil {
		t.Errorf("%s: stdout is not JSON: %v\n%s", what, err, s)
		return nil
	}
	if dec.More() {
		t.Errorf("%s: stdout holds more than one JSON document:\n%s", what, s)
	}
	m, _ := v.(map[string]any)
	return m
}

// TestFlagsAnywhere drives commands with flags after their arguments and global flags after the
// command, against a real store: the issue's `image rm c1b --json` removes c1b and prints one
// document; an unknown flag anywhere removes nothing.
func TestFlagsAnywhere(t *testing.T) {
	st, _ := newTestStore(t, "c1b", "c2", "c3")
	cli := func(args ...string) (string, string, int) { return runCLI(t, append(args, "--store", st)...) }

	_, errOut, code := cli("image", "rm", "c2", "--bogus")
	if code != 2 || !strings.Contains(errOut, "flag provided but not defined: -bogus") {
		t.Errorf("rm with an unknown flag after the name: exit %d %q", code, errOut)
	}
	out, _, code := cli("image", "rm", "c1b", "--json")
	if m := oneJSON(t, "rm --json", out); code != 0 || !reflect.DeepEqual(m["removed"], []any{"c1b"}) {
		t.Errorf("image rm c1b --json: exit %d %v", code, m)
	}
	if _, _, code := cli("image", "inspect", "c2"); code != 0 {
		t.Error("c2 was removed by the command with the unknown flag")
	}
	if _, _, code := cli("image", "verify", "c2", "--workers", "2"); code != 0 {
		t.Errorf("image verify c2 --workers 2: exit %d", code)
	}
	a, _, _ := cli("images", "--json")
	b, _, _ := runCLI(t, "--json", "--store", st, "images")
	if a != b || oneJSON(t, "images --json", "{\"x\":"+a+"}") == nil {
		t.Errorf("images --json differs from --json images:\n%s\n%s", a, b)
	}
	exp := filepath.Join(t.TempDir(), "c2.exp")
	if _, errOut, code := cli("image", "export", "c2", "-o", exp); code != 0 {
		t.Errorf("image export c2 -o FILE: exit %d %s", code, errOut)
	}
	// After --, a word that looks like a flag is an argument (here: no such image).
	if _, errOut, code := cli("image", "rm", "--", "--json"); code != exitcode.NotFound {
		t.Errorf("image rm -- --json: exit %d %s, want 6", code, errOut)
	}
	// Several names: every one is checked before any is removed.
	if _, errOut, code := cli("image", "rm", "c2", "nope", "c3"); code != exitcode.NotFound || !strings.Contains(errOut, "nothing was removed") {
		t.Errorf("rm c2 nope c3: exit %d %s", code, errOut)
	}
	for _, n := range []string{"c2", "c3"} {
		if _, _, code := cli("image", "inspect", n); code != 0 {
			t.Errorf("%s was removed although another name did not exist", n)
		}
	}
	out, _, code = cli("image", "rm", "c2", "c3")
	if code != 0 || !strings.Contains(out, "ptxmig --store "+st+" image gc") {
		t.Errorf("rm c2 c3: exit %d, hint without --store: %q", code, out)
	}
}

// TestImagesQuietAndAliases: images -q prints full ids only; image ls and image list are images.
func TestImagesQuietAndAliases(t *testing.T) {
	st, _ := newTestStore(t, "a1", "b2")
	full, _, _ := runCLI(t, "--store", st, "images")
	for _, args := range [][]string{{"image", "ls"}, {"image", "list"}} {
		if out, _, code := runCLI(t, append([]string{"--store", st}, args...)...); code != 0 || out != full {
			t.Errorf("%v: exit %d, differs from images:\n%s", args, code, out)
		}
	}
	out, _, code := runCLI(t, "--store", st, "images", "-q")
	ids := strings.Fields(out)
	if code != 0 || len(ids) != 2 || len(ids[0]) != 64 || strings.Contains(out, "NAME") {
		t.Fatalf("images -q: exit %d %q", code, out)
	}
	for _, id := range ids {
		if _, _, code := runCLI(t, "--store", st, "image", "inspect", id); code != 0 {
			t.Errorf("id %s from -q does not resolve", id)
		}
	}
}

// TestVersionFlag: --version anywhere prints the version alone.
func TestVersionFlag(t *testing.T) {
	defer func(v string) { version = v }(version)
	version = "v9.9.9-test"
	for _, args := range [][]string{{"--version"}, {"images", "--version"}} {
		out, _, code := runCLI(t, args...)
		if code != 0 || out != "ptxmig v9.9.9-test\n" {
			t.Errorf("%v: exit %d %q", args, code, out)
		}
	}
	out, _, _ := runCLI(t, "--version", "--json")
	if m := oneJSON(t, "--version --json", out); m["ptxmig"] != "v9.9.9-test" {
		t.Errorf("--version --json: %q", out)
	}
}

// TestExitCodeTable: the same condition gives the same status in every command: not found 6,
// invalid name 2, unknown command or flag 2, read-only and taken names 3.
func TestExitCodeTable(t *testing.T) {
	t.Setenv("PTXMIG_LOCK_DIR", t.TempDir())
	st, src := newTestStore(t, "img")
	missing := filepath.Join(t.TempDir(), "no-store")
	pid := strconv.Itoa(os.Getpid())
	tests := []struct {
		args []string
		code int
	}{
		// not found: images, processes, stores
		{[]string{"restore", "nope"}, 6},
		{[]string{"image", "inspect", "nope"}, 6},
		{[]string{"image", "extract", "nope", filepath.Join(t.TempDir(), "x")}, 6},
		{[]string{"image", "verify", "nope"}, 6},
		{[]string{"image", "rm", "nope"}, 6},
		{[]string{"image", "export", "-o", filepath.Join(t.TempDir(), "x"), "nope"}, 6},
		{[]string{"checkpoint", "4194304"}, 6},
		{[]string{"migrate", "--gpu", "1", "4194304"}, 6},
		{[]string{"kernels", "4194304"}, 6},
		{[]string{"modules", "4194304"}, 6},
		{[]string{"--store", missing, "images"}, 6},
		{[]string{"--store", missing, "image", "gc"}, 6},
		{[]string{"--store", missing, "restore", "img"}, 6},
		// invalid names and ambiguous references: usage
		{[]string{"image", "add", "../x", src}, 2},
		{[]string{"image", "add", "abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789", src}, 2},
		{[]string{"image", "import", "--name", "a/b", src}, 2},
		{[]string{"checkpoint", "--name", "a/b", pid}, 2},
		{[]string{"checkpoint", "--name", "cafe", pid}, 2},
		{[]string{"checkpoint", "--name", "", pid}, 2},
		// usage
		{[]string{"nosuch"}, 2},
		{[]string{"image", "nosuch"}, 2},
		{[]string{"images", "--nosuch"}, 2},
		{[]string{"images", "extra"}, 2},
		{[]string{"completion", "fish"}, 2},
		// refused: the name is taken
		{[]string{"image", "add", "img", src}, 3},
	}
	for _, tt := range tests {
		args := tt.args
		if args[0] != "--store" {
			args = append([]string{"--store", st}, args...)
		}
		_, errOut, code := runCLI(t, args...)
		if code != tt.code {
			t.Errorf("ptxmig %v: exit %d, want %d (%s)", tt.args, code, tt.code, strings.TrimSpace(errOut))
		}
		out, _, jcode := runCLI(t, append(args, "--json")...)
		m := oneJSON(t, strings.Join(tt.args, " ")+" --json", out)
		if jcode != tt.code || m["exit_code"] != float64(tt.code) || m["kind"] != exitcode.Name(tt.code) {
			t.Errorf("ptxmig %v --json: exit %d, document %v", tt.args, jcode, m)
		}
	}
	if _, err := os.Stat(missing); err == nil {
		t.Errorf("a command created the missing store %s", missing)
	}
}

// TestJSONOneDocument runs every command in failure modes (and some in success) with --json:
// stdout must hold exactly one JSON document, with error, exit_code and kind on failure. Every
// command of the tree gets at least its unknown-flag case.
func TestJSONOneDocument(t *testing.T) {
	t.Setenv("PTXMIG_LOCK_DIR", t.TempDir())
	st, src := newTestStore(t, "img", "img2")
	// A damaged copy: verify reports the damage and fails, in one document.
	bad, _ := newTestStore(t, "img")
	chunks, _ := filepath.Glob(filepath.Join(bad, "chunks", "*", "*"))
	for _, c := range chunks {
		b, _ := os.ReadFile(c)
		b[8] ^= 1
		os.WriteFile(c, b, 0o600)
	}
	garbage := filepath.Join(t.TempDir(), "garbage.exp")
	os.WriteFile(garbage, []byte("not an export stream"), 0o600)
	policy := filepath.Join(t.TempDir(), "policy.json")
	os.WriteFile(policy, []byte(`{"busy_threshold": 500}`), 0o600)
	nonEmpty := t.TempDir()
	os.WriteFile(filepath.Join(nonEmpty, "f"), nil, 0o600)
	tests := []struct {
		args []string
		fail bool
	}{
		{[]string{"version"}, false},
		{[]string{"images"}, false},
		{[]string{"image", "ls"}, false},
		{[]string{"image", "inspect", "img"}, false},
		{[]string{"image", "verify"}, false},
		{[]string{"--store", bad, "image", "verify"}, true},
		{[]string{"--store", bad, "image", "verify", "img"}, true},
		{[]string{"image", "verify", "img", "nope"}, true},
		{[]string{"image", "rm", "nope"}, true},
		{[]string{"image", "rm", "img2", "nope"}, true},
		{[]string{"image", "add", "img", src}, true},
		{[]string{"image", "add", "new", "/no/such/dir"}, true},
		{[]string{"image", "extract", "img", nonEmpty}, true},
		{[]string{"image", "import", garbage}, true},
		{[]string{"image", "export", "nope", "-o", filepath.Join(t.TempDir(), "x")}, true},
		{[]string{"--store", "/no/such/store", "image", "gc"}, true},
		{[]string{"checkpoint", "4194304"}, true},
		{[]string{"checkpoint", "abc"}, true},
		{[]string{"restore", "nope"}, true},
		{[]string{"migrate", "4194304"}, true},
		{[]string{"kernels", "4194304"}, true},
		{[]string{"modules", "abc"}, true},
		{[]string{"ps"}, false},
		{[]string{"ptx", "analyze", "/no/such.ptx"}, true},
		{[]string{"ptx", "instrument", "x.ptx"}, true},
		{[]string{"rebalance", "--policy", policy}, true},
		{[]string{"completion", "fish"}, true},
		{[]string{"nosuch"}, true},
		{[]string{"image"}, true}, // a group without its command: help is no JSON document
		{[]string{"--log-level", "loud", "images"}, true},
	}
	seen := map[string]bool{}
	forEachCommand(func(path []string, c *cli.Command) {
		tests = append(tests, struct {
			args []string
			fail bool
		}{append(append([]string(nil), path...), "--no-such-flag"), true})
	})
	for _, tt := range tests {
		args := tt.args
		if args[0] != "--store" {
			args = append([]string{"--store", st}, args...)
		}
		out, errOut, code := runCLI(t, append(args, "--json")...)
		what := strings.Join(tt.args, " ") + " --json"
		seen[strings.Join(tt.args, " ")] = true
		var v any
		dec := json.NewDecoder(strings.NewReader(out))
		if err := dec.Decode(&v); err != nil || dec.More() {
			t.Errorf("%s: exit %d, stdout is not one JSON document (%v):\n%s\nstderr: %s", what, code, err, out, errOut)
			continue
		}
		if !tt.fail {
			if code != 0 {
				t.Errorf("%s: exit %d: %s", what, code, errOut)
			}
			continue
		}
		m, _ := v.(map[string]any)
		if code == 0 || m["error"] == nil || m["exit_code"] != float64(code) || m["kind"] == nil {
			t.Errorf("%s: exit %d, document without the error: %s", what, code, out)
		}
	}
	// The partial results are in the failure document.
	out, _, _ := runCLI(t, "--store", bad, "--json", "image", "verify")
	if m := oneJSON(t, "damaged verify", out); m["damaged"] != float64(1) || m["images"] == nil {
		t.Errorf("damaged verify: %s", out)
	}
}

// TestStoreNotConjured: a mistyped --store is never created, by readers or writers; a writer
// creates a store only where its parent exists, and says so on stderr.
func TestStoreNotConjured(t *testing.T) {
	t.Setenv("PTXMIG_LOCK_DIR", t.TempDir())
	base := t.TempDir()
	typo := filepath.Join(base, "typo", "a", "b", "c")
	src := t.TempDir()
	os.WriteFile(filepath.Join(src, "f"), []byte("x"), 0o600)
	os.WriteFile(filepath.Join(base, "e"), []byte("an export stream would be here"), 0o600)
	for _, args := range [][]string{
		{"images"}, {"image", "ls"}, {"image", "inspect", "x"}, {"image", "verify"}, {"image", "rm", "x"},
		{"image", "gc"}, {"image", "extract", "x", filepath.Join(base, "out")}, {"image", "export", "-o", filepath.Join(base, "e"), "x"},
		{"restore", "x"}, {"restore", "--dry-run", "x"}, {"image", "add", "x", src}, {"image", "import", filepath.Join(base, "e")},
		{"checkpoint", "--dry-run", strconv.Itoa(os.Getpid())}, {"rebalance"},
	} {
		_, errOut, code := runCLI(t, append([]string{"--store", typo}, args...)...)
		if code == 0 || !strings.Contains(errOut, filepath.Join(base, "typo")) {
			t.Errorf("--store %s %v: exit %d %q; want a failure naming the path", typo, args, code, errOut)
		}
		if _, err := os.Lstat(filepath.Join(base, "typo")); err == nil {
			t.Fatalf("%v created %s", args, filepath.Join(base, "typo"))
		}
	}
	fresh := filepath.Join(base, "fresh")
	_, errOut, code := runCLI(t, "--store", fresh, "images")
	if code != exitcode.NotFound || !strings.Contains(errOut, fresh) || !strings.Contains(errOut, "does not exist") {
		t.Errorf("images on a missing store: exit %d %q", code, errOut)
	}
	out, errOut, code := runCLI(t, "--store", fresh, "image", "add", "x", src)
	if code != 0 || !strings.Contains(errOut, "created a new image store in "+fresh) || strings.Contains(out, "created") {
		t.Errorf("first image add: exit %d, stdout %q stderr %q", code, out, errOut)
	}
	_, errOut, _ = runCLI(t, "--store", fresh, "image", "add", "y", src)
	if strings.Contains(errOut, "created") {
		t.Errorf("second image add announced a new store: %q", errOut)
	}
	// A non-empty directory that is no store is not adopted.
	home := t.TempDir()
	os.WriteFile(filepath.Join(home, ".profile"), nil, 0o644)
	if _, errOut, code := runCLI(t, "--store", home, "image", "add", "x", src); code != exitcode.NotFound || !strings.Contains(errOut, "not empty") {
		t.Errorf("image add into a foreign directory: exit %d %q", code, errOut)
	}
}

// TestSymlinkedStoreCLI: /var/lib/ptxmig -> /data/ptxmig works; hints name the path as given.
func TestSymlinkedStoreCLI(t *testing.T) {
	st, src := newTestStore(t, "img")
	link := filepath.Join(t.TempDir(), "ptxmig")
	if err := os.Symlink(st, link); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"images"}, {"image", "inspect", "img"}, {"image", "verify", "img"}, {"image", "add", "img2", src}} {
		if _, errOut, code := runCLI(t, append([]string{"--store", link}, args...)...); code != 0 {
			t.Errorf("--store LINK %v: exit %d %s", args, code, errOut)
		}
	}
	out, _, _ := runCLI(t, "--store", link, "image", "rm", "img2")
	if !strings.Contains(out, "ptxmig --store "+link+" image gc") {
		t.Errorf("hint does not name the store as given: %q", out)
	}
	if _, err := store.OpenWith(link, store.OpenOptions{}); err != nil {
		t.Error(err)
	}
}

// TestHint quotes stores that need it and leaves the default store out.
func TestHint(t *testing.T) {
	app := newApp(io.Discard, io.Discard)
	g := app.Metadata["globals"].(*globals)
	ctx := cli.NewContext(app, nil, nil)
	for _, tt := range []struct{ store, want string }{
		{defaultStore, "ptxmig restore job-1"},
		{"/data/s", "ptxmig --store /data/s restore job-1"},
		{"/data/my store", "ptxmig --store '/data/my store' restore job-1"},
		{"/data/it's", `ptxmig --store '/data/it'\''s' restore job-1`},
	} {
		g.Store = tt.store
		if got := hint(ctx, "restore", "job-1"); got != tt.want {
			t.Errorf("hint with store %q = %q, want %q", tt.store, got, tt.want)
		}
	}
}
