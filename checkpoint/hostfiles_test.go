package checkpoint_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/hostreq"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/restore"
	"github.com/ptxmig/ptxmig/store"
)

// logCounter starts a shell tree that counts into a log it holds open for appending (fd 3), as
// a job writing its log does. It returns the pid and the log's path.
func logCounter(t *testing.T, dir string) (int, string) {
	t.Helper()
	log := filepath.Join(dir, "logs", "job.log")
	if err := os.MkdirAll(filepath.Dir(log), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bash", "-c", `exec 3>>"$1"; i=0; while :; do i=$((i+1)); echo $i >&3; sleep 0.05; done`, "bash", log)
	null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	cmd.Stdin, cmd.Stdout, cmd.Stderr = null, null, null
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait() }()
	t.Cleanup(func() { killTree(cmd.Process.Pid) })
	waitCount(t, log, 3)
	return cmd.Process.Pid, log
}

// consecutive checks the log counts 1, 2, 3, … with no gap and no repeat: the restored shell
// went on exactly from the checkpoint, appending to the file that was put in place.
func consecutive(t *testing.T, path string) {
	t.Helper()
	b, _ := os.ReadFile(path)
	for i, f := range strings.Fields(string(b)) {
		if f != strconv.Itoa(i+1) {
			t.Fatalf("log %s line %d is %q, want %d:\n%s", path, i+1, f, i+1, b)
		}
	}
}

// TestAnotherHost: two stores on one machine stand in for two hosts. A job is checkpointed into
// store A, exported, imported into store B, its log moved aside (the other host does not have
// it), and restored from B: refused with the log named and the fix when the image carries
// nothing; put in place from the image when it was checkpointed with --carry-files; a different
// log at the path is never replaced unless asked, and then moved aside, not lost.
func TestAnotherHost(t *testing.T) {
	for _, tc := range []struct {
		name            string
		carry, noStream bool
	}{{"without carried files", false, false}, {"with carried files", true, false}, {"with carried files, not streamed", true, true}} {
		carry, noStream := tc.carry, tc.noStream
		t.Run(tc.name, func(t *testing.T) {
			f := setup(t)
			pid, log := logCounter(t, f.dir)
			res, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: "job", StagingRoot: f.stage,
				CarryFiles: carry, NoStream: noStream})
			if err != nil {
				t.Fatal(err)
			}
			killTree(pid) // ended by the checkpoint already; make sure
			atCkpt := readCount(log)
			m, err := f.st.Get("job")
			if err != nil {
				t.Fatal(err)
			}
			d, err := imagedesc.Read(m)
			files := d.HostFiles
			if err != nil || !d.HostFilesRecorded || !containsPath(files, log) {
				t.Fatalf("the manifest does not record the log as needed: %v %+v", err, files)
			}
			if ok := d.Carried != nil; ok != carry {
				t.Fatalf("carried files recorded: %v, want %v (%v)", ok, carry, res.Image)
			}

			// "The other host": store B, filled by export and import.
			var exp bytes.Buffer
			if err := f.st.Export(context.Background(), "job", &exp); err != nil {
				t.Fatal(err)
			}
			stB, err := store.Open(filepath.Join(f.dir, "storeB"))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := stB.Import(context.Background(), &exp); err != nil {
				t.Fatal(err)
			}
			envB := *f.env
			envB.Store = stB
			kept := filepath.Join(f.dir, "job.log.source-host")
			if err := os.Rename(log, kept); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(filepath.Dir(log)); err != nil && carry {
				t.Fatal(err) // the whole log directory is missing "there"
			}

			_, err = restore.Run(context.Background(), &envB, restore.Options{Image: "job", StagingRoot: f.stage, NoStream: noStream})
			if !carry {
				if !errors.Is(err, op.ErrRefused) || !strings.Contains(err.Error(), log) || !strings.Contains(err.Error(), "no such file") ||
					!strings.Contains(err.Error(), "--carry-files") {
					t.Fatalf("restore without the log: %v, want a refusal naming %s and the fix", err, log)
				}
				// Copied over by hand, as the message says: it restores.
				if err := os.MkdirAll(filepath.Dir(log), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.Rename(kept, log); err != nil {
					t.Fatal(err)
				}
				r, err := restore.Run(context.Background(), &envB, restore.Options{Image: "job", StagingRoot: f.stage, NoStream: noStream})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { killTree(r.PID) })
				waitCount(t, log, atCkpt+5)
				consecutive(t, log)
				return
			}
			if err != nil {
				t.Fatalf("restore with the log carried: %v", err)
			}
			// Restored: the log was put in place from the image and the shell counts on in it.
			killAfter := func(pid int) { t.Cleanup(func() { killTree(pid) }) }
			killAfter(pid)
			waitCount(t, log, atCkpt+5)
			consecutive(t, log)
			killTree(pid)

			// A different log there (another mode): refused, unless --overwrite-files, which
			// moves it aside.
			if err := os.Remove(log); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(log, []byte("someone else's\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			_, err = restore.Run(context.Background(), &envB, restore.Options{Image: "job", StagingRoot: f.stage, NoStream: noStream})
			if !errors.Is(err, op.ErrRefused) || !strings.Contains(err.Error(), "--overwrite-files") {
				t.Fatalf("restore over a different log: %v, want a refusal naming --overwrite-files", err)
			}
			if b, _ := os.ReadFile(log); string(b) != "someone else's\n" {
				t.Fatalf("the refused restore touched the log: %q", b)
			}
			r, err := restore.Run(context.Background(), &envB, restore.Options{Image: "job", StagingRoot: f.stage, OverwriteFiles: true, NoStream: noStream})
			if err != nil {
				t.Fatal(err)
			}
			killAfter(r.PID)
			if len(r.Placed) != 1 || !r.Placed[0].Replace {
				t.Fatalf("placed %+v", r.Placed)
			}
			waitCount(t, log, atCkpt+5)
			consecutive(t, log)
			aside, _ := filepath.Glob(log + ".ptxmig-replaced-*")
			if len(aside) != 1 {
				t.Fatalf("the replaced log is not kept aside: %v", aside)
			}
			if b, _ := os.ReadFile(aside[0]); string(b) != "someone else's\n" {
				t.Fatalf("the log moved aside holds %q", b)
			}
		})
	}
}

func containsPath(files []hostreq.File, p string) bool {
	for _, f := range files {
		if f.Path == p {
			return true
		}
	}
	return false
}

// TestStreamSparseMemory: a process with a 1 GiB mapping of which 16 pages were written streams
// into the store and back: the image holds the written pages, not the mapping's size, and the
// restored process finds every written byte where it was (it checks them each round and counts
// only while they are intact).
func TestStreamSparseMemory(t *testing.T) {
	f := setup(t)
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Fatalf("python3 is needed for this test's process: %v", err)
	}
	count := filepath.Join(f.dir, "count")
	script := `
import mmap, sys, time
m = mmap.mmap(-1, 1 << 30)
offs = [i * (64 << 20) + 123 for i in range(16)]
for i, o in enumerate(offs):
    m[o] = 1 + i
n = 0
while True:
    if any(m[o] != 1 + i for i, o in enumerate(offs)):
        sys.exit(3)
    n += 1
    with open(sys.argv[1], "w") as c:
        c.write(str(n))
    time.sleep(0.05)
`
	cmd := exec.Command(python, "-c", script, count)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait() }()
	pid := cmd.Process.Pid
	t.Cleanup(func() { killTree(pid) })
	waitCount(t, count, 3)
	res, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: "sparse", StagingRoot: f.stage})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Stream || res.Sizes.Logical > 256<<20 {
		t.Fatalf("streamed %v, %d logical bytes for 16 written pages of a 1 GiB mapping", res.Stream, res.Sizes.Logical)
	}
	at := readCount(count)
	r, err := restore.Run(context.Background(), f.env, restore.Options{Image: "sparse", StagingRoot: f.stage})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { killTree(r.PID) })
	waitCount(t, count, at+5)
}

// TestPlaceRefusesSymlinkedDirectory: where the directory of a carried file is a symbolic link on
// the target host (a user could point it anywhere), restore does not follow it: it fails before
// CRIU runs, writes nothing where the link points, and leaves no process behind.
func TestPlaceRefusesSymlinkedDirectory(t *testing.T) {
	f := setup(t)
	pid, log := logCounter(t, f.dir)
	if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: "job", StagingRoot: f.stage, CarryFiles: true}); err != nil {
		t.Fatal(err)
	}
	killTree(pid)
	logs := filepath.Dir(log)
	if err := os.RemoveAll(logs); err != nil {
		t.Fatal(err)
	}
	elsewhere := filepath.Join(f.dir, "elsewhere")
	if err := os.Mkdir(elsewhere, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(elsewhere, logs); err != nil {
		t.Fatal(err)
	}
	_, err := restore.Run(context.Background(), f.env, restore.Options{Image: "job", StagingRoot: f.stage})
	if err == nil || !strings.Contains(err.Error(), "not a plain directory") {
		t.Fatalf("restore through a symlinked directory: %v", err)
	}
	if ents, _ := os.ReadDir(elsewhere); len(ents) != 0 {
		t.Fatalf("restore wrote through the symbolic link: %v", ents)
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err == nil {
		if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); strings.TrimSpace(string(b)) == "bash" {
			t.Fatal("a process runs after the failed restore")
		}
	}
}
