package oplock

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/testreq"
)

func TestAcquireBusyRelease(t *testing.T) {
	t.Setenv("PTXMIG_LOCK_DIR", t.TempDir())
	l, err := Acquire(4242, "checkpoint", 0)
	if err != nil {
		t.Fatal(err)
	}
	// flock is per open file description: a second Acquire in this process conflicts too.
	_, err = Acquire(4242, "migrate", 100*time.Millisecond)
	if !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "checkpoint by ptxmig pid") {
		t.Fatalf("second acquire: %v, want ErrBusy naming the holder", err)
	}
	if other, err := Acquire(4243, "migrate", 0); err != nil {
		t.Fatalf("another pid: %v", err)
	} else {
		other.Release()
	}
	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
	l2, err := Acquire(4242, "migrate", 0)
	if err != nil {
		t.Fatalf("after release: %v", err)
	}
	l2.Release()
	if _, err := Acquire(0, "x", 0); err == nil {
		t.Fatal("pid 0 accepted")
	}
}

// TestLockDiesWithHolder checks that a killed holder never leaves a stale lock.
func TestLockDiesWithHolder(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("PTXMIG_LOCK_DIR", dir)
	if _, err := exec.LookPath("flock"); err != nil {
		testreq.Skip(t, "flock", "flock(1) not installed")
	}
	// -o: the lock is held by flock(1) itself, not by the sleep it runs.
	cmd := exec.Command("flock", "-o", dir+"/pid-77.lock", "sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		l, err := Acquire(77, "x", 0)
		if errors.Is(err, ErrBusy) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		l.Release()
		if time.Now().After(deadline) {
			t.Fatal("flock(1) never took the lock")
		}
		time.Sleep(20 * time.Millisecond)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	l, err := Acquire(77, "x", time.Second)
	if err != nil {
		t.Fatalf("lock stayed taken after its holder died: %v", err)
	}
	l.Release()
}

// TestPrivateDir checks the directories ptxmig writes into as root: created 0700, a loose mode
// tightened, and a symlink, a file or another user's directory refused (the attack: another user
// pre-creates /dev/shm/ptxmig to read or redirect process images).
func TestPrivateDir(t *testing.T) {
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "creating a directory owned by another user needs root")
	}
	tests := []struct {
		name    string
		setup   func(t *testing.T, path string)
		wantErr bool
	}{
		{"missing", func(*testing.T, string) {}, false},
		{"missing parent", func(t *testing.T, path string) {}, false},
		{"loose mode", func(t *testing.T, path string) { mkdir(t, path, 0o777) }, false},
		{"symlink to a private dir", func(t *testing.T, path string) {
			target := t.TempDir()
			if err := os.Symlink(target, path); err != nil {
				t.Fatal(err)
			}
		}, true},
		{"file", func(t *testing.T, path string) {
			if err := os.WriteFile(path, nil, 0o600); err != nil {
				t.Fatal(err)
			}
		}, true},
		{"other owner", func(t *testing.T, path string) {
			mkdir(t, path, 0o700)
			if err := os.Chown(path, 65534, 65534); err != nil {
				t.Fatal(err)
			}
		}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "ptxmig")
			if tt.name == "missing parent" {
				path = filepath.Join(path, "locks")
			}
			tt.setup(t, path)
			err := PrivateDir(path)
			if tt.wantErr {
				if !errors.Is(err, ErrUnsafeDir) {
					t.Fatalf("PrivateDir: %v, want ErrUnsafeDir", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			st, err := os.Lstat(path)
			if err != nil {
				t.Fatal(err)
			}
			if !st.IsDir() || st.Mode().Perm() != 0o700 {
				t.Fatalf("%s: mode %v, want a 0700 directory", path, st.Mode())
			}
		})
	}
}

func mkdir(t *testing.T, path string, mode os.FileMode) {
	t.Helper()
	if err := os.Mkdir(path, mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil { // past the umask
		t.Fatal(err)
	}
}

// TestAcquireRefusesSymlinkedDir checks that a lock directory that is a symlink is refused.
func TestAcquireRefusesSymlinkedDir(t *testing.T) {
	link := filepath.Join(t.TempDir(), "locks")
	if err := os.Symlink(t.TempDir(), link); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PTXMIG_LOCK_DIR", link)
	if l, err := Acquire(4242, "checkpoint", 0); !errors.Is(err, ErrUnsafeDir) {
		l.Release()
		t.Fatalf("Acquire in a symlinked dir: %v, want ErrUnsafeDir", err)
	}
}
