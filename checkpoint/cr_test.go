package checkpoint_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/internal/testreq"
	"github.com/ptxmig/ptxmig/restore"
	"github.com/ptxmig/ptxmig/store"
)

// These tests drive real CRIU on real processes through the real store; they need root and a
// CRIU >= 4.0 that passes `criu check` (scripts/install-criu.sh), and skip otherwise (fail where
// PTXMIG_REQUIRE lists root and criu, as in CI).

type fixture struct {
	env   *op.Env
	st    *store.Store
	bin   string
	dir   string
	stage string
}

func setup(t *testing.T) *fixture {
	t.Helper()
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "checkpoint/restore tests need root (CRIU)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	d, text, err := criu.NewDumper(ctx)
	if err != nil {
		testreq.Skip(t, "criu", "no usable CRIU (run scripts/install-criu.sh): %v", err)
	}
	if err := criu.CheckKernel(ctx, d.Bin); err != nil {
		testreq.Skip(t, "criu", "criu check fails on this kernel: %v", err)
	}
	_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) // so restored processes can be reaped
	dir := t.TempDir()
	t.Setenv("PTXMIG_LOCK_DIR", filepath.Join(dir, "locks"))
	t.Setenv("PTXMIG_LOG_DIR", filepath.Join(dir, "logs"))
	bin, err := testproc.Build(dir)
	if err != nil {
		testreq.Skip(t, "cc", "cannot build the test program: %v", err)
	}
	st, err := store.Open(filepath.Join(dir, "store"))
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{st: st, bin: bin, dir: dir, stage: filepath.Join(dir, "staging")}
	f.env = &op.Env{CRIU: d, CRIUVersion: text, Store: st, Euid: 0,
		Host: op.ReadHostInfo(nil), Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		DriverErr: errors.New("no driver in CI")}
	return f
}

func (f *fixture) start(t *testing.T, name string) (*testproc.Proc, *testproc.Model) {
	return f.startMiB(t, name, 2)
}

func (f *fixture) startMiB(t *testing.T, name string, mib int) (*testproc.Proc, *testproc.Model) {
	t.Helper()
	p, err := testproc.Start(f.bin, filepath.Join(f.dir, name), testproc.Options{MiB: mib, IntervalMs: 5})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Kill() })
	if _, err := testproc.WaitState(p.StateFile, func(s testproc.State) bool { return s.Step >= 5 }, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	return p, testproc.NewModel(mib)
}

func (f *fixture) restore(t *testing.T, image string) *restore.Result {
	t.Helper()
	res, err := restore.Run(context.Background(), f.env, restore.Options{Image: image, StagingRoot: f.stage})
	if err != nil {
		t.Fatalf("restore %s: %v", image, err)
	}
	t.Cleanup(func() { _ = testproc.KillPID(res.PID, 10*time.Second) })
	return res
}

// advancesExactly waits for the process to get n steps past from and checks the chain.
func advancesExactly(t *testing.T, state string, m *testproc.Model, from, n int) testproc.State {
	t.Helper()
	s, err := testproc.WaitState(state, func(s testproc.State) bool { return s.Step >= from+n }, 10*time.Second)
	if err != nil {
		t.Fatalf("process does not advance: %v", err)
	}
	if err := m.Check(s); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestCheckpointKillRestore: checkpoint a running process into the store (which stops it),
// restore it from the store, and check it continues its hash chain exactly under its PID: with
// CRIU's files streamed into and out of the store, and through the staging directory.
func TestCheckpointKillRestore(t *testing.T) {
	for _, noStream := range []bool{false, true} {
		t.Run(map[bool]string{false: "stream", true: "no-stream"}[noStream], func(t *testing.T) { checkpointKillRestore(t, noStream) })
	}
}

func checkpointKillRestore(t *testing.T, noStream bool) {
	f := setup(t)
	p, m := f.start(t, "state")
	res, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: p.PID, Name: "cpu-1", StagingRoot: f.stage, NoStream: noStream})
	if err != nil {
		t.Fatal(err)
	}
	if res.Kind != op.KindCPU || res.Image != "cpu-1" || res.Sizes.Logical < 2<<20 || res.Timings.Of(checkpoint.StepDump) <= 0 ||
		res.Stream == noStream || (res.StreamOff == "") == noStream {
		t.Fatalf("result %+v", res)
	}
	select {
	case <-p.Exited():
	case <-time.After(10 * time.Second):
		t.Fatal("the process still runs after a checkpoint without --leave-running")
	}
	atDump, err := testproc.ReadState(p.StateFile)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Check(atDump); err != nil {
		t.Fatal(err)
	}
	man, err := f.st.Get("cpu-1")
	if err != nil {
		t.Fatal(err)
	}
	md, err := imagedesc.Read(man)
	if err != nil || md.PID != p.PID || md.Kind != "cpu" || len(md.Cmdline) == 0 || md.Kernel == "" || md.Comm != "ptxmig-testproc" {
		t.Errorf("manifest metadata %s (%v)", man.Meta, err)
	}
	if ents, _ := os.ReadDir(f.stage); len(ents) != 0 {
		t.Errorf("staging not cleaned: %v", ents)
	}
	if !slices.ContainsFunc(man.Files, func(f store.File) bool { return f.Path == "dump.log" }) {
		t.Error("CRIU's dump log is not in the image")
	}
	r, err := restore.Run(context.Background(), f.env, restore.Options{Image: "cpu-1", StagingRoot: f.stage, NoStream: noStream})
	if err != nil {
		t.Fatalf("restore: %v", err)
	}
	t.Cleanup(func() { _ = testproc.KillPID(r.PID, 10*time.Second) })
	if r.PID != p.PID || r.Stream == noStream {
		t.Fatalf("restore result %+v, want pid %d", r, p.PID)
	}
	advancesExactly(t, p.StateFile, m, atDump.Step, 10)
	if ents, _ := os.ReadDir(f.stage); len(ents) != 0 {
		t.Errorf("staging not cleaned after the restore: %v", ents)
	}
}

// TestLeaveRunning: the process keeps running through the checkpoint; the image, restored after
// the process is killed, resumes from the checkpoint's step (not from where the process died).
func TestLeaveRunning(t *testing.T) {
	f := setup(t)
	p, m := f.start(t, "state")
	res, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: p.PID, Name: "live", LeaveRunning: true, StagingRoot: f.stage})
	if err != nil {
		t.Fatal(err)
	}
	if !res.LeftRunning {
		t.Fatal("result does not say left running")
	}
	now, _ := testproc.ReadState(p.StateFile)
	advancesExactly(t, p.StateFile, m, now.Step, 10)

	// The taken PID refuses a restore, and touches nothing.
	_, err = restore.Run(context.Background(), f.env, restore.Options{Image: "live", StagingRoot: f.stage, PIDWait: 200 * time.Millisecond})
	if !errors.Is(err, op.ErrRefused) || !errors.Is(err, restore.ErrPIDInUse) {
		t.Fatalf("restore over a live pid: %v, want a refusal naming the pid", err)
	}
	if !testproc.Alive(p.PID) {
		t.Fatal("the refused restore hurt the running process")
	}

	if err := p.Kill(); err != nil {
		t.Fatal(err)
	}
	r := f.restore(t, "live")
	s, err := testproc.WaitState(p.StateFile, func(s testproc.State) bool { return s.Step >= 3 }, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := testproc.NewModel(2).Check(s); err != nil {
		t.Fatalf("restored pid %d: %v", r.PID, err)
	}
}

// TestLeaveRunningBusy: a process that writes its memory flat out while it is checkpointed with
// --leave-running (streamed, the default, and staged) must be restored exactly as it was when it
// was dumped: the image must not mix pages from before and after CRIU resumes it (as it would if
// a streamed dump's pipes still referred to the live pages when the process ran on).
func TestLeaveRunningBusy(t *testing.T) {
	for _, noStream := range []bool{false, true} {
		t.Run(map[bool]string{false: "stream", true: "no-stream"}[noStream], func(t *testing.T) {
			f := setup(t)
			const mib, steps = 64, 10_000_000
			p, err := testproc.Start(f.bin, filepath.Join(f.dir, "busy"), testproc.Options{MiB: mib, IntervalMs: -1, Steps: steps})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = p.Kill() })
			if _, err := testproc.WaitState(p.StateFile, func(s testproc.State) bool { return s.Step >= 1000 }, 20*time.Second); err != nil {
				t.Fatal(err)
			}
			if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: p.PID, Name: "busy", LeaveRunning: true, StagingRoot: f.stage, NoStream: noStream}); err != nil {
				t.Fatal(err)
			}
			if err := p.Kill(); err != nil {
				t.Fatal(err)
			}
			r, err := restore.Run(context.Background(), f.env, restore.Options{Image: "busy", StagingRoot: f.stage, NoStream: noStream})
			if err != nil {
				t.Fatalf("restore: %v", err)
			}
			t.Cleanup(func() { _ = testproc.KillPID(r.PID, 10*time.Second) })
			s, err := testproc.WaitState(p.StateFile, func(s testproc.State) bool { return s.Done }, 60*time.Second)
			if err != nil {
				t.Fatalf("restored process did not finish: %v", err)
			}
			if err := testproc.NewModel(mib).Check(s); err != nil {
				t.Fatalf("restored pid %d: %v", r.PID, err)
			}
		})
	}
}

// TestRollbackOnStoreFailure injects a failure (and, separately, a cancellation like SIGINT) at
// the store step: the dumped and stopped process must be resumed and continue exactly, and no
// image may be left behind.
func TestRollbackOnStoreFailure(t *testing.T) {
	for _, mode := range []string{"error", "cancel"} {
		t.Run(mode, func(t *testing.T) {
			f := setup(t)
			p, m := f.start(t, "state")
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			f.env.Hook = func(_ context.Context, step string) error {
				if step != checkpoint.StepStore {
					return nil
				}
				if mode == "cancel" {
					cancel()
					return context.Canceled
				}
				return errors.New("injected store failure")
			}
			_, err := checkpoint.Run(ctx, f.env, checkpoint.Options{PID: p.PID, Name: "never", StagingRoot: f.stage})
			var se *op.StepError
			if !errors.As(err, &se) || !se.RolledBack() || se.Step != checkpoint.StepStore {
				t.Fatalf("err = %v, want a rolled-back store failure", err)
			}
			var fl *op.Failure
			if !errors.As(err, &fl) || fl.LogDir == "" {
				t.Fatalf("err %T (%v) names no log directory", err, err)
			}
			if _, err := os.Stat(filepath.Join(fl.LogDir, "dump.log")); err != nil {
				t.Errorf("CRIU's log not kept: %v", err)
			}
			if !strings.Contains(err.Error(), "running") {
				t.Errorf("error %q does not say the process runs", err)
			}
			if ents, _ := os.ReadDir(f.stage); len(ents) != 0 {
				t.Errorf("staging left after a failure: %v", ents)
			}
			if !testproc.Alive(p.PID) {
				t.Fatal("process died")
			}
			now, _ := testproc.ReadState(p.StateFile)
			advancesExactly(t, p.StateFile, m, now.Step, 10)
			if _, err := f.st.Get("never"); !errors.Is(err, store.ErrNotFound) {
				t.Errorf("image after a failed store: %v", err)
			}
		})
	}
}

// TestPrestageDuringDump: the store encodes the dump's chunks while CRIU writes them (its temp
// files exist when the store step starts); a failed store step leaves none behind and the process
// running, and a successful one gives an image that restores exactly.
func TestPrestageDuringDump(t *testing.T) {
	for _, fail := range []bool{true, false} {
		t.Run(map[bool]string{true: "store fails", false: "store succeeds"}[fail], func(t *testing.T) {
			f := setup(t)
			p, m := f.startMiB(t, "state", 48)
			tmp := filepath.Join(f.st.Dir(), "tmp")
			staged := -1
			f.env.Hook = func(_ context.Context, step string) error {
				if step != checkpoint.StepStore {
					return nil
				}
				ents, _ := os.ReadDir(tmp)
				staged = len(ents)
				if fail {
					return errors.New("injected store failure")
				}
				return nil
			}
			_, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: p.PID, Name: "pre", StagingRoot: f.stage})
			if staged < 1 {
				t.Errorf("no chunk was staged during the dump (%d temp files when the store step began)", staged)
			}
			if ents, _ := os.ReadDir(tmp); len(ents) != 0 {
				t.Errorf("%d store temp files left after the checkpoint", len(ents))
			}
			if fail {
				if err == nil {
					t.Fatal("checkpoint succeeded despite the injected store failure")
				}
				if !testproc.Alive(p.PID) {
					t.Fatal("process died")
				}
				now, _ := testproc.ReadState(p.StateFile)
				advancesExactly(t, p.StateFile, m, now.Step, 10)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			before, _ := testproc.ReadState(p.StateFile)
			f.restore(t, "pre")
			advancesExactly(t, p.StateFile, m, before.Step, 10)
		})
	}
}

// TestPreflightRefusals: nothing is touched and the error says why.
func TestPreflightRefusals(t *testing.T) {
	f := setup(t)
	p, _ := f.start(t, "state")
	busy, err := oplock.Acquire(p.PID, "test", 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: p.PID, StagingRoot: f.stage})
	busy.Release()
	if !errors.Is(err, oplock.ErrBusy) {
		t.Errorf("checkpoint of a locked pid: %v, want ErrBusy", err)
	}
	nonRoot := *f.env
	nonRoot.Euid = 1000
	tests := []struct {
		name string
		env  *op.Env
		o    checkpoint.Options
	}{
		{"missing pid", f.env, checkpoint.Options{PID: 1 << 22}},
		{"non-root", &nonRoot, checkpoint.Options{PID: p.PID}},
		{"init", f.env, checkpoint.Options{PID: 1}},
		{"bad name", f.env, checkpoint.Options{PID: p.PID, Name: "../x"}},
		{"empty name", f.env, checkpoint.Options{PID: p.PID, NameSet: true}},
		{"taken name", f.env, checkpoint.Options{PID: p.PID, Name: "taken"}},
		{"id-like name", f.env, checkpoint.Options{PID: p.PID, Name: "deadbeef"}},
		{"ptxmig itself", f.env, checkpoint.Options{PID: os.Getpid()}},
		{"an ancestor of ptxmig", f.env, checkpoint.Options{PID: os.Getppid()}},
	}
	// "taken" exists: a plain directory image is enough to hold the name.
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "f"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.st.Put(context.Background(), src, store.PutOptions{Name: "taken"}); err != nil {
		t.Fatal(err)
	}
	before, _ := f.st.List()
	for _, tt := range tests {
		_, err := checkpoint.Run(context.Background(), tt.env, tt.o)
		if !errors.Is(err, op.ErrRefused) {
			t.Errorf("%s: %v, want a refusal", tt.name, err)
		}
	}
	if !testproc.Alive(p.PID) {
		t.Fatal("a refused checkpoint hurt the process")
	}
	if after, _ := f.st.List(); len(after) != len(before) {
		t.Errorf("refusals wrote images: %d before, %d after", len(before), len(after))
	}
	if ents, _ := os.ReadDir(f.stage); len(ents) != 0 {
		t.Errorf("refusals left staging: %v", ents)
	}
}

// TestStreamedRestoreCorruptPages flips a byte in a chunk of the memory pages, which a streamed
// restore verifies only as CRIU reads them: CRIU stops before the process runs, the error names
// the file and offset, nothing is left running, and the image is as it was.
func TestStreamedRestoreCorruptPages(t *testing.T) {
	f := setup(t)
	p, _ := f.startMiB(t, "state", 16)
	if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: p.PID, Name: "badpages", StagingRoot: f.stage}); err != nil {
		t.Fatal(err)
	}
	<-p.Exited()
	man, err := f.st.Get("badpages")
	if err != nil {
		t.Fatal(err)
	}
	var pages *store.File
	for i := range man.Files {
		if strings.HasPrefix(man.Files[i].Path, "pages-") && len(man.Files[i].Chunks) > 2 {
			pages = &man.Files[i]
		}
	}
	if pages == nil {
		t.Fatalf("no pages file of several chunks in %+v", man.Files)
	}
	ch := pages.Chunks[2]
	h := ch.Hash.String()
	path := filepath.Join(f.st.Dir(), "chunks", h[:2], h)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)-1] ^= 0x55
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = restore.Run(context.Background(), f.env, restore.Options{Image: "badpages", StagingRoot: f.stage})
	want := fmt.Sprintf("file %s at offset %d", pages.Path, ch.Offset)
	t.Logf("restore: %v", err)
	if !errors.Is(err, store.ErrCorrupt) || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "CRIU stopped before") {
		t.Fatalf("restore of corrupt pages: %v, want store.ErrCorrupt naming %q", err, want)
	}
	if testproc.Alive(p.PID) {
		t.Fatal("a process runs after a restore from corrupt pages")
	}
	if _, err := f.st.Get("badpages"); err != nil {
		t.Fatalf("image after the failed restore: %v", err)
	}
	if got, _ := os.ReadFile(path); !bytes.Equal(got, b) {
		t.Error("the failed restore changed the image's chunk")
	}
	if ents, _ := os.ReadDir(f.stage); len(ents) != 0 {
		t.Errorf("staging not cleaned: %v", ents)
	}
}

// TestStreamFailureMidDump: the store's disk fills up while CRIU streams into it: CRIU's pipes
// break, the dump fails naming the store's error, the process runs on exactly, and the store
// holds no image and no staged chunk.
func TestStreamFailureMidDump(t *testing.T) {
	f := setup(t)
	p, m := f.startMiB(t, "state", 32)
	small := filepath.Join(f.dir, "small")
	if err := os.Mkdir(small, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", small, "tmpfs", 0, "size=64m,mode=0700"); err != nil {
		t.Fatalf("mount a 64 MiB tmpfs for the store (root is required here): %v", err)
	}
	defer unix.Unmount(small, unix.MNT_DETACH)
	st, err := store.Open(filepath.Join(small, "store"))
	if err != nil {
		t.Fatal(err)
	}
	f.env.Store = st
	// The preflight sees room for the image; then, as the dump starts, another writer leaves 4 MiB.
	f.env.Hook = func(_ context.Context, step string) error {
		if step != checkpoint.StepDump {
			return nil
		}
		var sfs unix.Statfs_t
		if err := unix.Statfs(small, &sfs); err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(small, "ballast"), make([]byte, int64(sfs.Bavail)*sfs.Bsize-4<<20), 0o600)
	}
	_, err = checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: p.PID, Name: "full", StagingRoot: f.stage})
	if err == nil || !strings.Contains(err.Error(), "stream the dump into the store") || !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("checkpoint into a store that fills up: %v", err)
	}
	// The dump had frozen the process and the rollback resumed it: rolled back (exit status 4),
	// not a bare failure (1), whichever step the full disk failed.
	var se *op.StepError
	if !errors.As(err, &se) || !se.RolledBack() {
		t.Fatalf("checkpoint into a store that fills up: %v; want a rolled-back failure", err)
	}
	if !testproc.Alive(p.PID) {
		t.Fatal("process died")
	}
	now, _ := testproc.ReadState(p.StateFile)
	advancesExactly(t, p.StateFile, m, now.Step, 10)
	if _, err := st.Get("full"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("image after the failed stream: %v", err)
	}
	for _, d := range []string{"tmp", "chunks"} {
		var files []string
		filepath.WalkDir(filepath.Join(st.Dir(), d), func(path string, e os.DirEntry, err error) error {
			if err == nil && e.Type().IsRegular() {
				files = append(files, path)
			}
			return nil
		})
		if len(files) != 0 {
			t.Errorf("%d files left in the store's %s: %v", len(files), d, files[:min(3, len(files))])
		}
	}
	if ents, _ := os.ReadDir(f.stage); len(ents) != 0 {
		t.Errorf("staging not cleaned: %v", ents)
	}
}

// TestRestoreCorruptImage flips a byte in one stored chunk: restore refuses, nothing starts.
func TestRestoreCorruptImage(t *testing.T) {
	f := setup(t)
	p, _ := f.start(t, "state")
	if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: p.PID, Name: "bad", StagingRoot: f.stage}); err != nil {
		t.Fatal(err)
	}
	<-p.Exited()
	var chunks []string
	filepath.WalkDir(filepath.Join(f.st.Dir(), "chunks"), func(path string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			chunks = append(chunks, path)
		}
		return nil
	})
	if len(chunks) == 0 {
		t.Fatal("no chunk files in the store")
	}
	for _, c := range chunks {
		b, err := os.ReadFile(c)
		if err != nil {
			t.Fatal(err)
		}
		b[len(b)/2] ^= 0x55
		if err := os.WriteFile(c, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	_, err := restore.Run(context.Background(), f.env, restore.Options{Image: "bad", StagingRoot: f.stage})
	if !errors.Is(err, op.ErrRefused) || !errors.Is(err, store.ErrCorrupt) {
		t.Fatalf("restore of a corrupt image: %v, want a refusal wrapping store.ErrCorrupt", err)
	}
	if msg := err.Error(); !strings.HasPrefix(msg, "image bad is corrupt, nothing was restored: image bad: ") {
		t.Errorf("restore of a corrupt image says %q; want the image named once, then the corrupt part", msg)
	}
	if testproc.Alive(p.PID) {
		t.Fatal("a process was restored from a corrupt image")
	}
}

// TestSignalAfterCommit: a SIGINT (a cancelled context) that arrives once the store step has
// stored the image does not roll back: the checkpoint completes and says so (issue: exit 4
// "rolled back" with the image committed). One that arrives before the store rolls back, and
// leaves no image.
func TestSignalAfterCommit(t *testing.T) {
	for _, at := range []string{checkpoint.StepFinish, checkpoint.StepStore} {
		t.Run("cancelled before "+at, func(t *testing.T) {
			f := setup(t)
			p, m := f.start(t, "state")
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			f.env.Hook = func(_ context.Context, step string) error {
				if step == at {
					cancel()
				}
				return nil
			}
			res, err := checkpoint.Run(ctx, f.env, checkpoint.Options{PID: p.PID, Name: "sig", StagingRoot: f.stage})
			_, gerr := f.st.Get("sig")
			if at == checkpoint.StepFinish {
				if err != nil || res.Image != "sig" || gerr != nil {
					t.Fatalf("cancelled after the commit: %v (image: %v), want a completed checkpoint", err, gerr)
				}
				select {
				case <-p.Exited():
				case <-time.After(10 * time.Second):
					t.Fatal("the checkpointed process still runs")
				}
				return
			}
			var se *op.StepError
			if !errors.As(err, &se) || !se.RolledBack() || se.Committed || !errors.Is(gerr, store.ErrNotFound) {
				t.Fatalf("cancelled before the store: %v (image: %v), want rolled back with no image", err, gerr)
			}
			now, _ := testproc.ReadState(p.StateFile)
			advancesExactly(t, p.StateFile, m, now.Step, 5)
		})
	}
}
