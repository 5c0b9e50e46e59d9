package store

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/testreq"
)

const crashChildEnv = "PTXMIG_STORE_CRASH_CHILD"

func TestMain(m *testing.M) {
	if v := os.Getenv(crashChildEnv); v != "" {
		os.Exit(crashChild(v))
	}
	os.Exit(m.Run())
}

// crashChild loops forever over put, put, remove, gc on a store, with fresh data each round, until
// the parent kills it. Arguments: "STOREDIR|SRCDIR|SEED".
func crashChild(arg string) int {
	parts := strings.Split(arg, "|")
	seed, _ := strconv.ParseUint(parts[2], 10, 64)
	s, err := Open(parts[0])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ctx := context.Background()
	r := rand.New(rand.NewPCG(seed, 1))
	for i := 0; ; i++ {
		src := filepath.Join(parts[1], strconv.Itoa(i))
		os.MkdirAll(src, 0o755)
		for f := range 4 {
			b := make([]byte, r.IntN(6*testChunk))
			for j := 0; j < len(b); j += 8 {
				b[j] = byte(r.Uint32()) // compressible: 1 byte in 8 set
			}
			os.WriteFile(filepath.Join(src, fmt.Sprintf("pages-%d.img", f)), b, 0o600)
		}
		name := fmt.Sprintf("c%d-%d", seed, i)
		if _, _, err := s.Put(ctx, src, PutOptions{Name: name, ChunkSize: testChunk, Workers: 3}); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		os.RemoveAll(src)
		if i%3 == 2 {
			s.Remove(fmt.Sprintf("c%d-%d", seed, i-1))
			if _, err := s.GC(ctx); err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
		}
	}
}

// TestCrashSafety kills a process doing Put/Remove/GC with SIGKILL at random moments, many
// times, then checks that every image present verifies and gc leaves no garbage.
func TestCrashSafety(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: crash loop skipped")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "store")
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	srcRoot := t.TempDir()
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 3))
	const rounds = 20
	killedMidway := 0
	for i := range rounds {
		cmd := exec.Command(exe, "-test.run=^$")
		cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s|%s|%d", crashChildEnv, dir, filepath.Join(srcRoot, strconv.Itoa(i)), i))
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(20+r.IntN(250)) * time.Millisecond)
		cmd.Process.Signal(syscall.SIGKILL)
		err := cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("child %d did not die by SIGKILL: %v\n%s", i, err, stderr.String())
		}
		if ents, _ := os.ReadDir(s.tmpDir()); len(ents) > 0 {
			killedMidway++
		}
	}
	t.Logf("%d of %d kills left temp files behind", killedMidway, rounds)
	ctx := context.Background()
	ms, bad, err := s.listAll()
	if err != nil || len(bad) > 0 {
		t.Fatalf("after crashes: %v, unreadable manifests %v", err, bad)
	}
	if len(ms) == 0 {
		t.Fatal("no image completed: children were killed too early to test anything")
	}
	for _, m := range ms {
		if rep, err := s.Verify(ctx, m.Name); err != nil || !rep.OK() {
			t.Errorf("image %s damaged by a crash: %v", m.Name, err)
		}
	}
	gs, err := s.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d images survived; gc removed %d chunks and %d temp files", len(ms), gs.ChunksRemoved, gs.TempRemoved)
	assertNoGarbage(t, s)
	dst := filepath.Join(t.TempDir(), "dst")
	if _, err := s.Materialize(ctx, ms[len(ms)-1].ID, dst, GetOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestConcurrentPutsAndGC runs several writers with overlapping data against a gc loop and
// removals; every image that Put returned must verify, and nothing may be left over.
func TestConcurrentPutsAndGC(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t)
	shared := t.TempDir()
	writeRandom(t, filepath.Join(shared, "base"), 8*testChunk, 99)
	base, _ := os.ReadFile(filepath.Join(shared, "base"))
	const writers, perWriter = 4, 4
	var wg sync.WaitGroup
	errs := make(chan error, writers*perWriter+1)
	stop := make(chan struct{})
	var gcRuns int
	gcDone := make(chan struct{})
	go func() { // gc and removal of every writer's first image, in a loop
		defer close(gcDone)
		for {
			select {
			case <-stop:
				return
			default:
			}
			for w := range writers {
				s.Remove(fmt.Sprintf("w%d-0", w))
			}
			if _, err := s.GC(ctx); err != nil {
				errs <- err
				return
			}
			gcRuns++
			time.Sleep(5 * time.Millisecond)
		}
	}()
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perWriter {
				src := filepath.Join(t.TempDir(), "src")
				os.Mkdir(src, 0o755)
				b := append([]byte(nil), base...)
				b[(w*perWriter+i)%8*testChunk] ^= 0xff // one chunk unique, seven shared
				os.WriteFile(filepath.Join(src, "pages-1.img"), b, 0o644)
				name := fmt.Sprintf("w%d-%d", w, i)
				if _, _, err := s.Put(ctx, src, PutOptions{Name: name, ChunkSize: testChunk, Workers: 2}); err != nil {
					errs <- err
					return
				}
				// Verify right away, while gc keeps running.
				// (the gc loop may have removed a -0 image already: not found is fine)
				if _, err := s.Verify(ctx, name); err != nil && !errors.Is(err, ErrNotFound) {
					errs <- err
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	<-gcDone
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	ms, _ := s.List()
	for _, m := range ms {
		if _, err := s.Verify(ctx, m.Name); err != nil {
			t.Errorf("after concurrent gc: %v", err)
		}
	}
	if _, err := s.GC(ctx); err != nil {
		t.Fatal(err)
	}
	assertNoGarbage(t, s)
	t.Logf("%d images, %d gc runs during the puts", len(ms), gcRuns)
}

// TestENOSPC fills a small tmpfs: the Put must fail with ENOSPC, leave no image, and gc must
// return the store to a clean, usable state.
func TestENOSPC(t *testing.T) {
	mnt := t.TempDir()
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "mounting a tmpfs needs root")
	}
	if err := syscall.Mount("tmpfs", mnt, "tmpfs", 0, "size=2m,mode=0700"); err != nil {
		testreq.Skip(t, "tmpfs", "cannot mount a tmpfs (needs CAP_SYS_ADMIN): %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(mnt, syscall.MNT_DETACH) })
	ctx := context.Background()
	s, err := Open(filepath.Join(mnt, "store"))
	if err != nil {
		t.Fatal(err)
	}
	src := t.TempDir()
	writeRandom(t, filepath.Join(src, "pages-1.img"), 4<<20, 5)
	_, _, err = s.Put(ctx, src, PutOptions{Name: "big", ChunkSize: testChunk})
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("put into a full tmpfs: %v, want ENOSPC", err)
	}
	if _, err := s.Get("big"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("failed put left an image: %v", err)
	}
	// The failed Put removes the chunk files it staged but had not renamed into place.
	if ents, _ := os.ReadDir(s.tmpDir()); len(ents) > 0 {
		t.Errorf("failed put left %d temp files", len(ents))
	}
	if _, err := s.GC(ctx); err != nil {
		t.Fatal(err)
	}
	assertNoGarbage(t, s)
	small := t.TempDir()
	writeRandom(t, filepath.Join(small, "f"), 100<<10, 6)
	if _, _, err := s.Put(ctx, small, PutOptions{Name: "small", ChunkSize: testChunk}); err != nil {
		t.Fatalf("store unusable after ENOSPC: %v", err)
	}
	if _, err := s.Verify(ctx, "small"); err != nil {
		t.Fatal(err)
	}
}
