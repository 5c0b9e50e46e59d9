package main

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/testreq"
	"github.com/ptxmig/ptxmig/store"
)

// TestImageCommands drives add, images, inspect, verify, extract, export, import, rm and gc
// through the CLI against a real store.
func TestImageCommands(t *testing.T) {
	dir := t.TempDir()
	st, st2 := filepath.Join(dir, "store"), filepath.Join(dir, "store2")
	src := filepath.Join(dir, "src")
	os.MkdirAll(filepath.Join(src, "sub"), 0o755)
	os.WriteFile(filepath.Join(src, "sub", "pages-1.img"), []byte(strings.Repeat("page", 100000)), 0o600)
	os.Symlink("sub/pages-1.img", filepath.Join(src, "link"))

	out, errOut, code := runCLI(t, "--store", st, "--json", "image", "add", "--kind", "cpu", "--label", "job=7", "img", src)
	if code != 0 {
		t.Fatalf("add: %d %s %s", code, out, errOut)
	}
	var add struct {
		ID    string `json:"id"`
		Stats struct {
			LogicalBytes int64   `json:"logical_bytes"`
			Ratio        float64 `json:"ratio"`
		} `json:"stats"`
	}
	if err := json.Unmarshal([]byte(out), &add); err != nil || add.Stats.LogicalBytes != 400000 || add.Stats.Ratio < 10 {
		t.Fatalf("add --json: %v %s", err, out)
	}
	tests := []struct {
		args     []string
		code     int
		contains string
	}{
		{[]string{"image", "add", "img", src}, 3, "already exists"},
		{[]string{"image", "add", "../x", src}, 2, "invalid image name"},
		{[]string{"image", "add", "--chunk-size", "1", "y", src}, 2, "chunk-size"},
		{[]string{"image", "add", "y", src, "--kind", "cpu"}, 0, "added y"},
		{[]string{"image", "add", "z", src, "--bogus"}, 2, "flag provided but not defined"},
		{[]string{"images"}, 0, "img"},
		{[]string{"image", "inspect", add.ID[:8]}, 0, "link -> sub/pages-1.img"},
		{[]string{"image", "inspect", "nope"}, 6, "not found"},
		{[]string{"image", "verify"}, 0, "ok   img"},
		{[]string{"image", "extract", "img", filepath.Join(dir, "out")}, 0, "extracted img"},
		{[]string{"image", "extract", "img", filepath.Join(dir, "out")}, 3, "not empty"},
		{[]string{"image", "export", "-o", filepath.Join(dir, "img.exp"), "img"}, 0, ""},
		{[]string{"--store", st2, "image", "import", filepath.Join(dir, "img.exp")}, 0, "imported img"},
		{[]string{"--store", st2, "image", "import", filepath.Join(dir, "img.exp")}, 3, "already exists"},
		{[]string{"image", "rm", "img"}, 0, "removed img"},
		{[]string{"image", "gc"}, 0, "removed"},
		{[]string{"image", "rm"}, 2, ""},
	}
	for _, tt := range tests {
		args := tt.args
		if args[0] != "--store" {
			args = append([]string{"--store", st}, args...)
		}
		out, errOut, code := runCLI(t, args...)
		if code != tt.code || !strings.Contains(out+errOut, tt.contains) {
			t.Errorf("ptxmig %v: exit %d (want %d), output %q %q (want %q)", tt.args, code, tt.code, out, errOut, tt.contains)
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, "out", "sub", "pages-1.img"))
	if err != nil || len(b) != 400000 {
		t.Errorf("extracted file: %v", err)
	}
	// Corrupt a chunk in store2: verify exits 1 naming the file.
	chunks, _ := filepath.Glob(filepath.Join(st2, "chunks", "*", "*"))
	for _, c := range chunks {
		b, _ := os.ReadFile(c)
		b[8] ^= 1 // the length field of the chunk header
		os.WriteFile(c, b, 0o600)
	}
	out, _, code = runCLI(t, "--store", st2, "image", "verify", "img")
	if code != 1 || !strings.Contains(out, "sub/pages-1.img at offset 0") {
		t.Errorf("verify of a corrupt image: exit %d, %q", code, out)
	}
}

// TestImageAuthentication: import pins the stream's id with --expect-id and passes --memory on;
// inspect says whether a manifest is authenticated; verify names an edited manifest field and
// warns about a format 1.0 image (its chunks are checked, its manifest cannot be).
func TestImageAuthentication(t *testing.T) {
	dir := t.TempDir()
	st, st2 := filepath.Join(dir, "store"), filepath.Join(dir, "store2")
	src := filepath.Join(dir, "src")
	os.MkdirAll(src, 0o755)
	os.WriteFile(filepath.Join(src, "pages-1.img"), []byte(strings.Repeat("page", 10000)), 0o600)
	out, errOut, code := runCLI(t, "--store", st, "--json", "image", "add", "--label", "job=7", "img", src)
	var add struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal([]byte(out), &add); code != 0 || err != nil || len(add.ID) != 64 {
		t.Fatalf("add: exit %d %v %s %s", code, err, out, errOut)
	}
	exp := filepath.Join(dir, "img.exp")
	if _, errOut, code := runCLI(t, "--store", st, "image", "export", "-o", exp, "img"); code != 0 {
		t.Fatalf("export: exit %d %s", code, errOut)
	}
	other := strings.Map(func(r rune) rune {
		if r == '0' {
			return '1'
		}
		return '0'
	}, add.ID[:8])
	for _, tt := range []struct {
		args     []string
		code     int
		contains string
	}{
		{[]string{"image", "import", "--expect-id", "xyz", exp}, 2, "--expect-id"},
		{[]string{"image", "import", "--expect-id", add.ID[:7], exp}, 2, "at least 8"},
		{[]string{"image", "import", "--expect-id", "", exp}, 2, "--expect-id"},
		{[]string{"image", "import", "--memory", "lots", exp}, 2, "size \"lots\""},
		{[]string{"image", "import", "--memory", "1KiB", exp}, 1, "memory limit too low"},
		{[]string{"image", "import", "--expect-id", other, exp}, 1, "not the expected " + other},
		{[]string{"image", "import", "--name", "copy", "--expect-id", strings.ToUpper(add.ID[:8]), exp}, 0, "imported copy"},
		{[]string{"image", "import", exp, "--expect-id", add.ID, "--memory", "64MiB"}, 0, "imported img"},
	} {
		out, errOut, code := runCLI(t, append([]string{"--store", st2}, tt.args...)...)
		if code != tt.code || !strings.Contains(out+errOut, tt.contains) {
			t.Errorf("ptxmig %q: exit %d (want %d), output %q %q (want %q)", tt.args, code, tt.code, out, errOut, tt.contains)
		}
	}

	inspect := func(ref string) (string, bool) {
		t.Helper()
		out, errOut, code := runCLI(t, "--store", st, "image", "inspect", ref)
		jout, _, jcode := runCLI(t, "--store", st, "--json", "image", "inspect", ref)
		var j struct {
			Authenticated *bool `json:"authenticated"`
		}
		if err := json.Unmarshal([]byte(jout), &j); code != 0 || jcode != 0 || err != nil || j.Authenticated == nil {
			t.Fatalf("inspect %s: exit %d/%d %v %s %s", ref, code, jcode, err, errOut, jout)
		}
		return out, *j.Authenticated
	}
	if out, auth := inspect("img"); !auth || !strings.Contains(out, "manifest:  authenticated") {
		t.Errorf("inspect of a sealed image: authenticated %v:\n%s", auth, out)
	}

	// A format 1.0 image: the manifest as ptxmig wrote it before sealing (no id in it).
	manifest := filepath.Join(st, "images", "img.json")
	raw, err := os.ReadFile(manifest)
	if err != nil {
		t.Fatal(err)
	}
	sealed := string(raw)
	old := strings.Replace(sealed, `"format_version":"`+store.FormatVersion+`"`, `"format_version":"1.0"`, 1)
	old = strings.Replace(old, `,"id":"`+add.ID+`"}`, `}`, 1)
	if old == sealed || strings.Contains(old, add.ID) {
		t.Fatalf("cannot make a format 1.0 manifest from %s", sealed)
	}
	os.WriteFile(manifest, []byte(old), 0o600)
	if out, auth := inspect("img"); auth || !strings.Contains(out, "manifest:  NOT authenticated: format 1.0") {
		t.Errorf("inspect of a format 1.0 image: authenticated %v:\n%s", auth, out)
	}
	out, errOut, code = runCLI(t, "--store", st, "image", "verify", "img")
	if code != 0 || !strings.Contains(out, "ok   img") || !strings.Contains(out, "     warning: manifest format 1.0 predates manifest authentication") {
		t.Errorf("verify of a format 1.0 image: exit %d\n%s%s", code, out, errOut)
	}
	exp10 := filepath.Join(dir, "img10.exp")
	if _, errOut, code := runCLI(t, "--store", st, "image", "export", "-o", exp10, "img"); code != 0 {
		t.Fatalf("export: exit %d %s", code, errOut)
	}
	if _, errOut, code := runCLI(t, "--store", t.TempDir(), "image", "import", "--expect-id", add.ID[:8], exp10); code != 1 || !strings.Contains(errOut, "not authenticated") {
		t.Errorf("import --expect-id of a format 1.0 image: exit %d %s", code, errOut)
	}

	// A sealed manifest edited in place: verify names the field.
	edited := strings.Replace(sealed, `"job":"7"`, `"job":"8"`, 1)
	if edited == sealed {
		t.Fatalf("no label in %s", sealed)
	}
	os.WriteFile(manifest, []byte(edited), 0o600)
	out, errOut, code = runCLI(t, "--store", st, "image", "verify", "img")
	if code != 1 || !strings.Contains(out, `(manifest) field meta.extra["job"]: changed since the image was written`) {
		t.Errorf("verify of an edited manifest: exit %d\n%s%s", code, out, errOut)
	}
}

// buildPtxmig builds the ptxmig binary into dir.
func buildPtxmig(t *testing.T, dir string) string {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		testreq.Skip(t, "go", "building ptxmig needs the go command: %v", err)
	}
	bin := filepath.Join(dir, "ptxmig")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("cannot build ptxmig: %v: %s", err, out)
	}
	return bin
}

// writingTo returns the size of the file under dir that process pid has open for writing, or -1
// (read from /proc/PID/fd: an O_TMPFILE file shows there as "DIR/#INODE (deleted)").
func writingTo(pid int, dir string) int64 {
	fdDir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, _ := os.ReadDir(fdDir)
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join(fdDir, e.Name())); err == nil && strings.HasPrefix(l, dir+"/") {
			if fi, err := os.Stat(filepath.Join(fdDir, e.Name())); err == nil && fi.Mode().IsRegular() {
				return fi.Size()
			}
		}
	}
	return -1
}

// TestExportKilled (issue 36): the real binary, exporting a large image with -o, is SIGKILLed
// mid-write. Nothing is left beside the output (the stream went into an O_TMPFILE file); where the
// file system cannot make one, the hidden temp file it left is removed by the next export to the
// same path, which says so. A temp file of a killed export is also removed when the store's
// file system has O_TMPFILE (one left by an older ptxmig, or made on another file system).
func TestExportKilled(t *testing.T) {
	dir := t.TempDir()
	st, src, outDir := filepath.Join(dir, "store"), filepath.Join(dir, "src"), filepath.Join(dir, "out")
	os.MkdirAll(src, 0o755)
	os.MkdirAll(outDir, 0o755)
	f, err := os.Create(filepath.Join(src, "pages-1.img"))
	if err != nil {
		t.Fatal(err)
	}
	rng, buf := rand.NewChaCha8([32]byte{36}), make([]byte, 1<<20)
	for range 256 { // incompressible: the stream is as large as the image
		rng.Read(buf)
		if _, err := f.Write(buf); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	if _, errOut, code := runCLI(t, "--store", st, "image", "add", "big", src); code != 0 {
		t.Fatalf("image add: exit %d %s", code, errOut)
	}
	os.RemoveAll(src)
	bin := buildPtxmig(t, dir)

	out := filepath.Join(outDir, "big.ptxmig")
	cmd := exec.Command(bin, "--store", st, "image", "export", "--workers", "1", "-o", out, "big")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	var written int64 = -1
	deadline := time.Now().Add(60 * time.Second)
	for written < 8<<20 {
		select {
		case err := <-exited:
			t.Fatalf("the export ended (%v) before it was seen writing 8 MiB (last seen: %d bytes)", err, written)
		default:
		}
		if time.Now().After(deadline) {
			cmd.Process.Kill()
			t.Fatalf("the export was not seen writing into %s", outDir)
		}
		written = writingTo(cmd.Process.Pid, outDir)
		time.Sleep(time.Millisecond)
	}
	cmd.Process.Signal(syscall.SIGKILL)
	if err := <-exited; err == nil {
		t.Fatal("the export completed: it was not killed mid-write")
	}
	t.Logf("killed the export after %d bytes", written)

	fd, terr := unix.Open(outDir, unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	tmpfile := terr == nil
	if tmpfile {
		unix.Close(fd)
	}
	left := dirNames(t, outDir)
	switch {
	case tmpfile && len(left) != 0:
		t.Fatalf("a killed export left %q in %s", left, outDir)
	case !tmpfile && (len(left) != 1 || !strings.HasPrefix(left[0], ".big.ptxmig.tmp-")):
		t.Fatalf("no O_TMPFILE here (%v): want the killed export's temp file, found %q", terr, left)
	case tmpfile:
		// Leave one as a killed export does where the file system has no O_TMPFILE.
		left = []string{fmt.Sprintf(".big.ptxmig.tmp-%d-12345", cmd.Process.Pid)}
		if err := os.WriteFile(filepath.Join(outDir, left[0]), buf, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// A live writer's temp file is left alone.
	live := fmt.Sprintf(".big.ptxmig.tmp-%d-1", os.Getppid())
	os.WriteFile(filepath.Join(outDir, live), nil, 0o600)

	stdout, errOut, code := runCLI(t, "--store", st, "--json", "image", "export", "-o", out, "big")
	var res struct {
		StaleRemoved []string `json:"stale_removed"`
	}
	if err := json.Unmarshal([]byte(stdout), &res); code != 0 || err != nil {
		t.Fatalf("the next export: exit %d %v %s %s", code, err, stdout, errOut)
	}
	stale := filepath.Join(outDir, left[0])
	if len(res.StaleRemoved) != 1 || res.StaleRemoved[0] != stale || !strings.Contains(errOut, "removed "+stale+", left by an export that was killed") {
		t.Errorf("the next export reported %q, stderr %q; want %s removed", res.StaleRemoved, errOut, stale)
	}
	if got := dirNames(t, outDir); len(got) != 2 || got[0] != live || got[1] != "big.ptxmig" {
		t.Errorf("after the next export %s holds %q, want [%s big.ptxmig]", outDir, got, live)
	}
	if _, errOut, code := runCLI(t, "--store", t.TempDir(), "image", "import", out); code != 0 {
		t.Errorf("import of the export: exit %d %s", code, errOut)
	}
}

// dirNames lists the names in dir, sorted.
func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	names := []string{}
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

// addImage stores a directory holding one file of content as the image name, through the CLI.
func addImage(t *testing.T, st, name, content string, args ...string) {
	t.Helper()
	src := t.TempDir()
	os.WriteFile(filepath.Join(src, "pages-1.img"), []byte(content), 0o600)
	if out, errOut, code := runCLI(t, append(append([]string{"--store", st, "image", "add"}, args...), name, src)...); code != 0 {
		t.Fatalf("image add %s: exit %d %s %s", name, code, out, errOut)
	}
}

// TestDamagedManifestCLI (issue 36): an image whose manifest was replaced by a symlink (to a copy
// of that very manifest: following it would find nothing wrong) is listed as damaged by `images`
// (table, --json, -q), fails `image verify`, makes gc refuse (exit 3) and remove nothing, naming
// it and the way out, and goes with `image rm`, which removes the link and not its target.
func TestDamagedManifestCLI(t *testing.T) {
	st := filepath.Join(t.TempDir(), "store")
	addImage(t, st, "kept", strings.Repeat("kept", 50000))
	addImage(t, st, "victim", strings.Repeat("victim", 50000))
	chunks := func() int {
		files, _ := filepath.Glob(filepath.Join(st, "chunks", "*", "*"))
		return len(files)
	}
	before := chunks()
	manifest := filepath.Join(st, "images", "victim.json")
	outside := filepath.Join(t.TempDir(), "victim.json")
	b, err := os.ReadFile(manifest)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(outside, b, 0o600)
	os.Remove(manifest)
	if err := os.Symlink(outside, manifest); err != nil {
		t.Fatal(err)
	}
	cli := func(args ...string) (string, string, int) {
		return runCLI(t, append([]string{"--store", st}, args...)...)
	}

	out, errOut, code := cli("images")
	if code != 0 || !regexp.MustCompile(`(?m)^victim +DAMAGED +-`).MatchString(out) ||
		!strings.Contains(out, "victim is DAMAGED: image victim: store data corrupt: its manifest "+manifest+" is a symbolic link") ||
		!strings.Contains(out, "remove it with: ptxmig --store "+st+" image rm victim") {
		t.Errorf("images: exit %d\n%s%s", code, out, errOut)
	}
	out, _, code = cli("--json", "images")
	var rows []map[string]any
	if err := json.Unmarshal([]byte(out), &rows); code != 0 || err != nil || len(rows) != 2 || rows[0]["name"] != "kept" ||
		rows[1]["name"] != "victim" || rows[1]["id"] != "" || !strings.Contains(fmt.Sprint(rows[1]["damaged"]), "is a symbolic link") {
		t.Errorf("images --json: exit %d %v\n%s", code, err, out)
	}
	out, errOut, code = cli("images", "-q")
	if code != 0 || len(strings.Fields(out)) != 1 || !strings.Contains(errOut, "image victim is DAMAGED") {
		t.Errorf("images -q: exit %d %q %q", code, out, errOut)
	}
	out, errOut, code = cli("image", "verify")
	if code != 1 || !strings.Contains(out, "ok   kept") || !strings.Contains(out, "BAD  victim") || !strings.Contains(out, "is a symbolic link") {
		t.Errorf("image verify: exit %d\n%s%s", code, out, errOut)
	}
	out, errOut, code = cli("image", "gc")
	if code != 3 || !strings.Contains(errOut, "refusing to run with 1 unreadable image(s)") || !strings.Contains(errOut, "its manifest "+manifest+" is a symbolic link") ||
		!strings.Contains(errOut, "to remove them: ptxmig --store "+st+" image rm victim") {
		t.Errorf("image gc with a damaged image: exit %d\n%s%s", code, out, errOut)
	}
	if n := chunks(); n != before {
		t.Errorf("a refused gc changed the chunk files from %d to %d", before, n)
	}
	if out, errOut, code := cli("image", "rm", "victim"); code != 0 {
		t.Fatalf("image rm victim: exit %d %s %s", code, out, errOut)
	}
	if _, err := os.Stat(outside); err != nil {
		t.Errorf("image rm touched the symlink's target: %v", err)
	}
	if out, errOut, code := cli("image", "gc"); code != 0 || chunks() >= before {
		t.Errorf("image gc after rm: exit %d, %d of %d chunk files left\n%s%s", code, chunks(), before, out, errOut)
	}
	if out, errOut, code := cli("image", "verify"); code != 0 {
		t.Errorf("image verify after rm: exit %d\n%s%s", code, out, errOut)
	}
}

// TestRestoreTruncatedChunk (issue 36): a chunk file shorter than the manifest records is refused
// by restore's preflight (exit 3, nothing started) naming the chunk's file, and the image is left
// as it was.
func TestRestoreTruncatedChunk(t *testing.T) {
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "ptxmig restore needs root")
	}
	t.Setenv("PTXMIG_LOCK_DIR", t.TempDir())
	st := filepath.Join(t.TempDir(), "store")
	addImage(t, st, "img", strings.Repeat("page", 100000), "--kind", "cpu")
	chunks, _ := filepath.Glob(filepath.Join(st, "chunks", "*", "*"))
	if len(chunks) == 0 {
		t.Fatal("the image has no chunk file")
	}
	fi, err := os.Stat(chunks[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(chunks[0], fi.Size()-1); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := runCLI(t, "--store", st, "restore", "img")
	if strings.Contains(errOut, "CRIU is not usable") {
		testreq.Skip(t, "criu", "restore's preflight needs CRIU: %s", errOut)
	}
	if code != 3 || !strings.Contains(errOut, "store data corrupt: chunk ") || !strings.Contains(errOut, chunks[0]) {
		t.Errorf("restore of an image with a truncated chunk: exit %d, want 3 naming %s\n%s%s", code, chunks[0], out, errOut)
	}
	if _, errOut, code := runCLI(t, "--store", st, "image", "inspect", "img"); code != 0 {
		t.Errorf("the image is gone after the refusal: exit %d %s", code, errOut)
	}
}
