package oplock

import (
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"
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
		t.Skip("flock(1) not installed")
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
