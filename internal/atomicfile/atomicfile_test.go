package atomicfile

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
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
