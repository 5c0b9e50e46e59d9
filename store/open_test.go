package store

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/testreq"
)

// TestOpenMissing: only Create makes a store, and only where the parent exists; a directory that
// is not a store is neither adopted by readers nor taken over by writers when it holds other files.
func TestOpenMissing(t *testing.T) {
	base := t.TempDir()
	missing := filepath.Join(base, "store")
	if _, err := OpenWith(missing, OpenOptions{}); !errors.Is(err, ErrNoStore) || !strings.Contains(err.Error(), missing) {
		t.Errorf("open a missing store without Create: %v; want ErrNoStore naming %s", err, missing)
	}
	if _, err := os.Lstat(missing); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a reader created %s (%v)", missing, err)
	}
	typo := filepath.Join(base, "typo", "a", "b", "c")
	if _, err := Open(typo); !errors.Is(err, ErrNoStore) || !strings.Contains(err.Error(), filepath.Join(base, "typo", "a", "b")) {
		t.Errorf("open a store under missing parents: %v; want ErrNoStore naming the parent", err)
	}
	if _, err := os.Lstat(filepath.Join(base, "typo")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a typo'd path was created (%v)", err)
	}
	s, err := Open(missing)
	if err != nil || !s.Created() {
		t.Fatalf("create: %v (created %v)", err, s != nil && s.Created())
	}
	s, err = OpenWith(missing, OpenOptions{})
	if err != nil || s.Created() || s.ReadOnly() {
		t.Fatalf("reopen: %v (created %v, read-only %v)", err, s != nil && s.Created(), s != nil && s.ReadOnly())
	}

	// An empty directory: readers refuse, a writer initializes it.
	empty := filepath.Join(base, "empty")
	os.Mkdir(empty, 0o700)
	if _, err := OpenWith(empty, OpenOptions{}); !errors.Is(err, ErrNoStore) {
		t.Errorf("reader on an empty directory: %v", err)
	}
	if s, err := Open(empty); err != nil || !s.Created() {
		t.Errorf("writer on an empty directory: %v", err)
	}
	// The rebalancer's state directory may come first.
	reb := filepath.Join(base, "reb")
	os.MkdirAll(filepath.Join(reb, "rebalance"), 0o700)
	if _, err := Open(reb); err != nil {
		t.Errorf("directory holding only rebalance/: %v", err)
	}
	// Someone's home directory is never turned into a store (nor chmodded).
	home := filepath.Join(base, "home")
	os.Mkdir(home, 0o755)
	os.WriteFile(filepath.Join(home, ".profile"), nil, 0o644)
	if _, err := Open(home); !errors.Is(err, ErrNoStore) || !strings.Contains(err.Error(), ".profile") {
		t.Errorf("writer on a foreign non-empty directory: %v", err)
	}
	if fi, _ := os.Stat(home); fi.Mode().Perm() != 0o755 {
		t.Errorf("foreign directory's mode changed to %v", fi.Mode().Perm())
	}
	if _, err := os.Stat(filepath.Join(home, storeMarker)); err == nil {
		t.Error("foreign directory got a store marker")
	}
}

// TestOpenSymlinked: a symlinked store directory is accepted when its target passes the checks,
// and every path the store uses is the resolved one.
func TestOpenSymlinked(t *testing.T) {
	base := t.TempDir()
	real := filepath.Join(base, "data", "ptxmig")
	os.MkdirAll(filepath.Dir(real), 0o755)
	link := filepath.Join(base, "ptxmig")
	if err := os.Symlink(real, link); err != nil {
		t.Fatal(err)
	}
	// Dangling: a writer does not create the target behind the link.
	if _, err := Open(link); !errors.Is(err, ErrNoStore) {
		t.Errorf("dangling symlink: %v", err)
	}
	if _, err := os.Lstat(real); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("opening a dangling symlink created its target")
	}
	os.Mkdir(real, 0o700)
	s, err := Open(link)
	if err != nil {
		t.Fatalf("open symlinked store: %v", err)
	}
	want, _ := filepath.EvalSymlinks(real)
	if s.Dir() != want {
		t.Errorf("Dir() = %s, want the resolved %s", s.Dir(), want)
	}
	putRandom(t, s, 100000, 3, PutOptions{Name: "img", ChunkSize: MinChunkSize})
	if s2, err := OpenWith(link, OpenOptions{}); err != nil {
		t.Fatal(err)
	} else if _, err := s2.Get("img"); err != nil {
		t.Errorf("get through the link: %v", err)
	}
	// A link to a directory of another owner is refused like that directory.
	if os.Geteuid() == 0 {
		foreign := filepath.Join(base, "foreign")
		os.Mkdir(foreign, 0o700)
		os.Chown(foreign, 65534, 65534)
		flink := filepath.Join(base, "flink")
		os.Symlink(foreign, flink)
		if _, err := Open(flink); !errors.Is(err, ErrInsecure) || !strings.Contains(err.Error(), "-> "+foreign) {
			t.Errorf("symlink to another user's directory: %v", err)
		}
	}
}

// TestInspect reports without creating or changing anything.
func TestInspect(t *testing.T) {
	base := t.TempDir()
	missing := filepath.Join(base, "nope")
	info, err := Inspect(missing)
	if !errors.Is(err, ErrNoStore) || info.Exists || info.FreeBytes == 0 {
		t.Errorf("Inspect(missing) = %+v, %v", info, err)
	}
	if _, err := os.Lstat(missing); err == nil {
		t.Fatal("Inspect created the store")
	}
	s := openTestStore(t)
	os.Chmod(s.Dir(), 0o750)
	info, err = Inspect(s.Dir())
	if err != nil || !info.Exists || !info.IsStore || info.Mode != 0o750 || info.UID != os.Geteuid() {
		t.Errorf("Inspect(store) = %+v, %v", info, err)
	}
	if fi, _ := os.Stat(s.Dir()); fi.Mode().Perm() != 0o750 {
		t.Error("Inspect changed the mode")
	}
	os.Chmod(s.Dir(), 0o777)
	if _, err := Inspect(s.Dir()); !errors.Is(err, ErrInsecure) {
		t.Errorf("Inspect(world-writable) = %v", err)
	}
}

// TestReadOnlyStore: a store on a read-only mount opens read-only, and every read (get, list,
// materialize, verify, export) works, with or without lock files; gc and put fail cleanly. The
// read-only bind mount is made in a private mount namespace of a child test process.
func TestReadOnlyStore(t *testing.T) {
	if dir := os.Getenv("PTXMIG_TEST_RO_STORE"); dir != "" {
		readOnlyChild(t, dir)
		return
	}
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "a read-only bind mount needs root")
	}
	for _, locks := range []bool{true, false} {
		s := openTestStore(t)
		src := t.TempDir()
		makeTree(t, src, treeSpec{seed: 9, files: 12, maxSize: 300000, symlinks: true})
		if _, _, err := s.Put(context.Background(), src, PutOptions{Name: "img", ChunkSize: testChunk}); err != nil {
			t.Fatal(err)
		}
		if !locks {
			os.Remove(filepath.Join(s.Dir(), "lock"))
			os.Remove(filepath.Join(s.Dir(), "lock.gate"))
		}
		cmd := exec.Command(os.Args[0], "-test.run=^TestReadOnlyStore$", "-test.v")
		cmd.Env = append(os.Environ(), "PTXMIG_TEST_RO_STORE="+s.Dir())
		cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("lock files %v: read-only child: %v\n%s", locks, err, out)
		}
		if !bytes.Contains(out, []byte("read-only checks done")) {
			t.Fatalf("lock files %v: the child did not run its checks:\n%s", locks, out)
		}
	}
}

func readOnlyChild(t *testing.T, dir string) {
	if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind mount: %v", err)
	}
	if err := unix.Mount("", dir, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
		t.Fatalf("remount read-only: %v", err)
	}
	ctx := context.Background()
	s, err := OpenWith(dir, OpenOptions{})
	if err != nil {
		t.Fatalf("open read-only store: %v", err)
	}
	if !s.ReadOnly() {
		t.Fatal("store on a read-only mount not opened read-only")
	}
	if _, err := Open(dir); err != nil { // a writer's Open still opens it (its writes fail later)
		t.Errorf("Open (create allowed) of an existing read-only store: %v", err)
	}
	if ms, err := s.List(); err != nil || len(ms) != 1 {
		t.Errorf("list: %d images, %v", len(ms), err)
	}
	if _, err := s.Get("img"); err != nil {
		t.Errorf("get: %v", err)
	}
	if _, err := s.Materialize(ctx, "img", filepath.Join(t.TempDir(), "out"), GetOptions{}); err != nil {
		t.Errorf("materialize: %v", err)
	}
	if r, err := s.VerifyWith(ctx, "img", GetOptions{}); err != nil || !r.OK() {
		t.Errorf("verify: %v", err)
	}
	if _, err := s.ExportWith(ctx, "img", io.Discard, GetOptions{}); err != nil {
		t.Errorf("export: %v", err)
	}
	if _, err := s.GC(ctx); !errors.Is(err, ErrReadOnly) {
		t.Errorf("gc of a read-only store: %v, want ErrReadOnly", err)
	}
	if _, _, err := s.Put(ctx, t.TempDir(), PutOptions{Name: "new", ChunkSize: testChunk}); err == nil {
		t.Error("put into a read-only store succeeded")
	}
	t.Log("read-only checks done")
}
