package atomicfile

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/ptxmig/ptxmig/internal/testreq"
)

// entries lists the names in dir.
func entries(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

// wantFile checks path's content and that dir holds nothing but the names in only.
func wantFile(t *testing.T, path, content string, only ...string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != content {
		t.Errorf("%s = %q, want %q", path, b, content)
	}
	if got := entries(t, filepath.Dir(path)); len(got) != len(only) {
		t.Errorf("directory holds %q, want %q (a temp file left behind?)", got, only)
	}
}

func TestWriteFile(t *testing.T) {
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	dir := t.TempDir()
	p := filepath.Join(dir, "state.json")
	for _, tt := range []struct {
		data string
		mode fs.FileMode
	}{{"first\n", 0o644}, {"second, longer\n", 0o600}, {"", 0o640}} {
		if err := WriteFile(p, []byte(tt.data), tt.mode); err != nil {
			t.Fatal(err)
		}
		wantFile(t, p, tt.data, "state.json")
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != tt.mode {
			t.Errorf("mode %v, want %v (the umask must not apply)", fi.Mode().Perm(), tt.mode)
		}
	}
}

func TestNoReplace(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "m.json")
	if err := WriteFile(p, []byte("one"), 0o600, NoReplace()); err != nil {
		t.Fatal(err)
	}
	err := WriteFile(p, []byte("two"), 0o600, NoReplace())
	if !errors.Is(err, fs.ErrExist) {
		t.Fatalf("second write: %v, want fs.ErrExist", err)
	}
	wantFile(t, p, "one", "m.json")

	// Of concurrent writers exactly one wins.
	q := filepath.Join(dir, "race")
	var wg sync.WaitGroup
	errs := make([]error, 16)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = WriteFile(q, []byte{byte('a' + i)}, 0o600, NoReplace())
		}()
	}
	wg.Wait()
	won := 0
	for _, err := range errs {
		switch {
		case err == nil:
			won++
		case !errors.Is(err, fs.ErrExist):
			t.Errorf("racing writer: %v", err)
		}
	}
	if won != 1 {
		t.Errorf("%d writers succeeded, want 1", won)
	}
	if got := entries(t, dir); len(got) != 2 {
		t.Errorf("directory holds %q", got)
	}
}

func TestTempDir(t *testing.T) {
	dir, tmp := t.TempDir(), t.TempDir()
	p := filepath.Join(dir, "f")
	f, err := Create(p, 0o600, TempDir(tmp))
	if err != nil {
		t.Fatal(err)
	}
	if got := entries(t, tmp); len(got) != 1 {
		t.Fatalf("temp dir holds %q, want the temp file", got)
	}
	if got := entries(t, dir); len(got) != 0 {
		t.Fatalf("target visible before Commit: %q", got)
	}
	f.Write([]byte("data"))
	if err := f.Commit(); err != nil {
		t.Fatal(err)
	}
	f.Abort() // a no-op after Commit
	wantFile(t, p, "data", "f")
	if got := entries(t, tmp); len(got) != 0 {
		t.Errorf("temp dir holds %q after Commit", got)
	}
	if err := f.Commit(); err == nil {
		t.Error("second Commit succeeded")
	}
}

// TestFailure: every way a write can fail leaves the old content and no temp file.
func TestFailure(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "out")
	if err := os.WriteFile(p, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}

	// The producer fails half-way and the caller aborts.
	f, err := Create(p, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	f.Write([]byte("half of the new"))
	f.Abort()
	wantFile(t, p, "old", "out")

	// The rename fails: the target is a non-empty directory.
	d := filepath.Join(dir, "d")
	os.Mkdir(d, 0o755)
	os.WriteFile(filepath.Join(d, "x"), nil, 0o644)
	if err := WriteFile(d, []byte("new"), 0o644); err == nil {
		t.Fatal("write over a directory succeeded")
	}
	os.RemoveAll(d)
	wantFile(t, p, "old", "out")

	// The directory does not exist: nothing is created.
	if err := WriteFile(filepath.Join(dir, "no", "such"), []byte("new"), 0o644); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("write into a missing directory: %v", err)
	}
}

// TestENOSPC writes more than a small tmpfs holds: the write fails, the old content stays and the
// temp file is gone.
func TestENOSPC(t *testing.T) {
	mnt := t.TempDir()
	if err := syscall.Mount("tmpfs", mnt, "tmpfs", 0, "size=64k"); err != nil {
		need := "tmpfs"
		if os.Geteuid() != 0 {
			need = "root"
		}
		testreq.Skip(t, need, "cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(mnt, syscall.MNT_DETACH) })
	p := filepath.Join(mnt, "out")
	if err := WriteFile(p, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	err := WriteFile(p, bytes.Repeat([]byte("x"), 1<<20), 0o644)
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("write into a full tmpfs: %v, want ENOSPC", err)
	}
	wantFile(t, p, "old", "out")
}

// TestDeviceAndFIFO: a target that is a device or a FIFO is written in place and stays what it
// is (`ptxmig ptx instrument -o /dev/null` once replaced /dev/null with a regular file).
func TestDeviceAndFIFO(t *testing.T) {
	if err := WriteFile(os.DevNull, []byte("discarded"), 0o644); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(os.DevNull); err != nil || st.Mode()&fs.ModeCharDevice == 0 {
		t.Fatalf("%s after a write: %v %v, want a character device", os.DevNull, st.Mode(), err)
	}
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	got := make(chan []byte, 1)
	go func() {
		b, _ := os.ReadFile(fifo)
		got <- b
	}()
	if err := WriteFile(fifo, []byte("through the pipe"), 0o644); err != nil {
		t.Fatal(err)
	}
	if b := <-got; string(b) != "through the pipe" {
		t.Errorf("the reader got %q", b)
	}
	if st, err := os.Lstat(fifo); err != nil || st.Mode()&fs.ModeNamedPipe == 0 {
		t.Errorf("the FIFO after a write: %v %v", st.Mode(), err)
	}
	if err := WriteFile(fifo, []byte("x"), 0o644, NoReplace()); !errors.Is(err, fs.ErrExist) {
		t.Errorf("NoReplace on an existing FIFO: %v, want ErrExist", err)
	}
	if left := entries(t, filepath.Dir(fifo)); len(left) != 1 {
		t.Errorf("files left beside the FIFO: %v", left)
	}
}

// TestUnnamed: with Unnamed nothing is visible in the directory before Commit (O_TMPFILE), Commit
// creates or replaces the target with exactly mode, NoReplace refuses an existing target, and
// Abort leaves nothing. Where the file system has no O_TMPFILE the named temp file is used.
func TestUnnamed(t *testing.T) {
	for _, fallback := range []bool{false, true} {
		name := "tmpfile"
		if fallback {
			name = "fallback"
		}
		t.Run(name, func(t *testing.T) {
			noTmpfile = fallback
			defer func() { noTmpfile = false }()
			old := syscall.Umask(0o077)
			defer syscall.Umask(old)
			dir := t.TempDir()
			p := filepath.Join(dir, "out")
			f, err := Create(p, 0o640, Unnamed())
			if err != nil {
				t.Fatal(err)
			}
			if got := entries(t, dir); !fallback && len(got) != 0 {
				t.Errorf("directory holds %q before Commit, want nothing (O_TMPFILE)", got)
			} else if fallback && (len(got) != 1 || !strings.HasPrefix(got[0], ".out.tmp-"+strconv.Itoa(os.Getpid())+"-")) {
				t.Errorf("directory holds %q before Commit, want one .out.tmp-PID-* file", got)
			}
			f.Write([]byte("first"))
			if err := f.Commit(); err != nil {
				t.Fatal(err)
			}
			wantFile(t, p, "first", "out")
			if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != 0o640 {
				t.Errorf("mode %v (%v), want 0640", fi.Mode().Perm(), err)
			}
			if err := WriteFile(p, []byte("second"), 0o600, Unnamed()); err != nil {
				t.Fatal(err)
			}
			wantFile(t, p, "second", "out")
			if err := WriteFile(p, []byte("third"), 0o600, Unnamed(), NoReplace()); !errors.Is(err, fs.ErrExist) {
				t.Errorf("NoReplace over an existing target: %v, want ErrExist", err)
			}
			wantFile(t, p, "second", "out")
			f, err = Create(p, 0o600, Unnamed())
			if err != nil {
				t.Fatal(err)
			}
			f.Write([]byte("aborted"))
			f.Abort()
			wantFile(t, p, "second", "out")
			if err := WriteFile(filepath.Join(dir, "no", "such"), []byte("x"), 0o600, Unnamed()); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("write into a missing directory: %v", err)
			}
		})
	}
}

// deadPID returns the pid of a process that has exited.
func deadPID(t *testing.T) int {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	if err := cmd.Run(); err != nil {
		t.Fatalf("run a short-lived process: %v", err)
	}
	return cmd.Process.Pid
}

// TestRemoveStale: the temp files of dead writers are removed, by RemoveStale and by Create with
// Unnamed for its own target; those of live writers (a live pid, or a held flock), of other
// targets, of unknown form, and anything not a regular file stay.
func TestRemoveStale(t *testing.T) {
	dir := t.TempDir()
	dead, live := strconv.Itoa(deadPID(t)), strconv.Itoa(os.Getppid())
	write := func(name string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte("partial"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	staleOut := write(".out.tmp-" + dead + "-123")
	write(".out.tmp-" + live + "-123")                      // its writer runs
	write(".out.tmp-" + strconv.Itoa(os.Getpid()) + "-123") // this process's own
	write(".out.tmp-123456")                                // an older version's: no pid
	write("out.tmp-" + dead + "-1")                         // not hidden: not a temp file
	staleOther := write(".other.tmp-" + dead + "-7")
	locked := write(".out.tmp-" + dead + "-456") // a writer in another pid namespace holds it
	lf, err := os.Open(locked)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_EX); err != nil {
		testreq.Skip(t, "flock", "flock: %v", err)
	}
	os.Mkdir(filepath.Join(dir, ".out.tmp-"+dead+"-789"), 0o700)
	before := entries(t, dir)

	f, err := Create(filepath.Join(dir, "out"), 0o600, Unnamed())
	if err != nil {
		t.Fatal(err)
	}
	if got := f.StaleRemoved(); len(got) != 1 || got[0] != staleOut {
		t.Errorf("StaleRemoved = %q, want [%s]", got, staleOut)
	}
	f.Abort()
	if got := entries(t, dir); len(got) != len(before)-1 {
		t.Errorf("after Create: %q, want %q less %s", got, before, staleOut)
	}
	removed, err := RemoveStale(dir, "")
	if err != nil || len(removed) != 1 || removed[0] != staleOther {
		t.Errorf("RemoveStale(any) = %q, %v; want [%s]", removed, err, staleOther)
	}
	lf.Close() // the writer is gone now too
	if removed, err := RemoveStale(dir, "out"); err != nil || len(removed) != 1 || removed[0] != locked {
		t.Errorf("RemoveStale after the lock was released = %q, %v; want [%s]", removed, err, locked)
	}
	if got := entries(t, dir); len(got) != len(before)-3 {
		t.Errorf("left: %q", got)
	}
}
