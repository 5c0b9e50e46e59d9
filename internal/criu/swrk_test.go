package criu

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/imgstream"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

func TestBuildDumpOpts(t *testing.T) {
	tests := []struct {
		name    string
		in      DumpOptions
		check   func(t *testing.T, o string)
		wantErr bool
	}{
		{"plain", DumpOptions{PID: 42}, func(t *testing.T, o string) {
			for _, w := range []string{"images_dir_fd:7", "pid:42", "log_level:4", `log_file:"dump.log"`} {
				if !strings.Contains(o, w) {
					t.Errorf("opts %s lack %s", o, w)
				}
			}
			for _, no := range []string{"shell_job", "leave_running", "tcp_established", "leave_stopped"} {
				if strings.Contains(o, no) {
					t.Errorf("opts %s set %s unasked", o, no)
				}
			}
		}, false},
		{"all", DumpOptions{PID: 1, LeaveStopped: true, ShellJob: true, TCPEstablished: true, LogFile: "x.log"}, func(t *testing.T, o string) {
			for _, w := range []string{"leave_stopped:true", "shell_job:true", "tcp_established:true", `log_file:"x.log"`} {
				if !strings.Contains(o, w) {
					t.Errorf("opts %s lack %s", o, w)
				}
			}
		}, false},
		{"bad pid", DumpOptions{PID: 0}, nil, true},
		{"exclusive", DumpOptions{PID: 3, LeaveRunning: true, LeaveStopped: true}, nil, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, err := BuildDumpOpts(tt.in, 7)
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v, wantErr %v", err, tt.wantErr)
			}
			if err == nil {
				tt.check(t, strings.ReplaceAll(o.String(), " ", ""))
			}
		})
	}
}

func TestBuildRestoreOpts(t *testing.T) {
	o := strings.ReplaceAll(must(BuildRestoreOpts(RestoreOptions{ShellJob: true}, 5, 6)).String(), " ", "")
	for _, w := range []string{"images_dir_fd:5", "work_dir_fd:6", "shell_job:true", `log_file:"restore.log"`, "log_level:4"} {
		if !strings.Contains(o, w) {
			t.Errorf("restore opts %s lack %s", o, w)
		}
	}
	if o2 := must(BuildRestoreOpts(RestoreOptions{}, 5, -1)).String(); strings.Contains(o2, "work_dir_fd") {
		t.Errorf("restore opts %s set a work dir", o2)
	}
	if _, err := BuildRestoreOpts(RestoreOptions{NetworkLock: "pf"}, 5, -1); err == nil || !strings.Contains(err.Error(), `"pf"`) {
		t.Errorf("an unknown network lock method: %v", err)
	}
	if o3 := must(BuildRestoreOpts(RestoreOptions{TCPEstablished: true, NetworkLock: NetworkLockNftables}, 5, -1)).String(); !strings.Contains(o3, "NFTABLES") {
		t.Errorf("restore opts %s lack the nftables lock", o3)
	}
}

func TestLogTail(t *testing.T) {
	p := filepath.Join(t.TempDir(), "log")
	var b strings.Builder
	for i := 0; i < 100; i++ {
		b.WriteString(strings.Repeat("x", i%7) + "\n")
	}
	b.WriteString("Error (criu/cr-dump.c:1): last line\n")
	if err := os.WriteFile(p, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	tail := LogTail(p, 3)
	if len(tail) != 3 || tail[2] != "Error (criu/cr-dump.c:1): last line" {
		t.Fatalf("tail = %q", tail)
	}
	if LogTail(filepath.Join(t.TempDir(), "none"), 3) != nil {
		t.Fatal("tail of a missing file")
	}
}

// usableCRIU skips the test unless it runs as root with a CRIU >= 4.0 that passes `criu check`.
func usableCRIU(t *testing.T) *Dumper {
	t.Helper()
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "CRIU dump/restore needs root")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	d, _, err := NewDumper(ctx)
	if err != nil {
		testreq.Skip(t, "criu", "no usable CRIU (run scripts/install-criu.sh): %v", err)
	}
	if err := CheckKernel(ctx, d.Bin); err != nil {
		testreq.Skip(t, "criu", "criu check fails on this kernel: %v", err)
	}
	return d
}

// TestDumpRestoreRealProcess dumps a running CPU process with the installed CRIU, restores it from
// the images, and checks that it continues its hash chain exactly under its original PID: through
// CRIU's RPC with an images directory, and as `criu --stream` commands whose files cross the
// image-streamer socket (kept in a directory by the test's streamer).
func TestDumpRestoreRealProcess(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(map[bool]string{false: "rpc", true: "stream"}[stream], func(t *testing.T) { dumpRestoreRealProcess(t, stream) })
	}
}

func dumpRestoreRealProcess(t *testing.T, stream bool) {
	d := usableCRIU(t)
	_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) // reap the restored process too
	dir := t.TempDir()
	bin, err := testproc.Build(dir)
	if errors.Is(err, testproc.ErrNoCompiler) {
		testreq.Skip(t, "cc", "cannot build the test program: %v", err)
	}
	if err != nil {
		t.Fatalf("cannot build the test program: %v", err)
	}
	state := filepath.Join(dir, "state")
	p, err := testproc.Start(bin, state, testproc.Options{MiB: 2, IntervalMs: 5})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	if _, err := testproc.WaitState(state, func(s testproc.State) bool { return s.Step >= 5 }, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	images := filepath.Join(dir, "images")
	work := filepath.Join(dir, "work")
	kept := filepath.Join(dir, "kept") // the streamed files
	for _, d := range []string{images, work, kept} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	var served func() (imgstream.Stats, error)
	if stream {
		served = streamer(t, images, imgstream.Capture, dirFiles(kept))
	}
	if _, err := d.Dump(ctx, DumpOptions{PID: p.PID, ImagesDir: images, Stream: stream}); err != nil {
		var ce *Error
		if errors.As(err, &ce) {
			t.Logf("criu log tail:\n%s", strings.Join(ce.Tail, "\n"))
		}
		t.Fatal(err)
	}
	if stream {
		st, err := served()
		if err != nil || st.Files < 5 || st.Bytes < 2<<20 {
			t.Fatalf("capture: %+v, %v", st, err)
		}
		if ents, _ := os.ReadDir(images); len(ents) != 2 { // dump.log, stats-dump
			t.Errorf("streamed dump left %d files in the images directory, want its log and stats", len(ents))
		}
	}
	select {
	case <-p.Exited():
	case <-time.After(10 * time.Second):
		t.Fatal("process still alive 10 s after the dump")
	}
	atDump, err := testproc.ReadState(state)
	if err != nil {
		t.Fatal(err)
	}
	m := testproc.NewModel(2)
	if err := m.Check(atDump); err != nil {
		t.Fatal(err)
	}

	rimages := images
	if stream {
		rimages = filepath.Join(dir, "rimages")
		if err := os.Mkdir(rimages, 0o700); err != nil {
			t.Fatal(err)
		}
		served = streamer(t, rimages, imgstream.Serve, dirFiles(kept))
	}
	res, err := d.Restore(ctx, RestoreOptions{ImagesDir: rimages, WorkDir: work, Stream: stream})
	if err != nil {
		var ce *Error
		if errors.As(err, &ce) {
			t.Logf("criu log tail:\n%s", strings.Join(ce.Tail, "\n"))
		}
		t.Fatal(err)
	}
	defer testproc.KillPID(res.PID, 10*time.Second)
	if stream {
		if st, err := served(); err != nil || st.Files < 5 {
			t.Fatalf("serve: %+v, %v", st, err)
		}
	}
	if res.PID != p.PID {
		t.Fatalf("restored pid %d, want the original %d", res.PID, p.PID)
	}
	after, err := testproc.WaitState(state, func(s testproc.State) bool { return s.Step >= atDump.Step+5 }, 10*time.Second)
	if err != nil {
		t.Fatalf("restored process does not advance: %v", err)
	}
	if err := m.Check(after); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(work, "restore.log")); err != nil {
		t.Errorf("restore log not kept in the work dir: %v", err)
	}
}

// dirFiles keeps streamed files in a directory and serves them back.
type dirFiles string

func (d dirFiles) Has(name string) bool {
	fi, err := os.Lstat(filepath.Join(string(d), name))
	return err == nil && fi.Mode().IsRegular()
}

func (d dirFiles) WriteFile(_ context.Context, name string, w io.Writer) (int64, error) {
	f, err := os.Open(filepath.Join(string(d), name))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return io.Copy(w, f)
}

func (d dirFiles) sink(name string, r io.Reader) error {
	f, err := os.OpenFile(filepath.Join(string(d), name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, r); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// streamer serves dir's streamer socket in mode in the background; the returned function waits
// for it.
func streamer(t *testing.T, dir string, mode imgstream.Mode, files dirFiles) func() (imgstream.Stats, error) {
	t.Helper()
	srv, err := imgstream.Listen(dir, mode)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	type result struct {
		st  imgstream.Stats
		err error
	}
	done := make(chan result, 1)
	go func() {
		defer srv.Close()
		var r result
		if mode == imgstream.Capture {
			r.st, r.err = srv.Capture(ctx, files.sink)
		} else {
			r.st, r.err = srv.Serve(ctx, files)
		}
		done <- r
	}()
	t.Cleanup(cancel)
	return func() (imgstream.Stats, error) {
		r := <-done
		return r.st, r.err
	}
}

// TestDumpFailureCarriesLog checks a failing dump (no such process) reports CRIU's log tail.
func TestDumpFailureCarriesLog(t *testing.T) {
	d := usableCRIU(t)
	images := t.TempDir()
	_, err := d.Dump(context.Background(), DumpOptions{PID: 1 << 22, ImagesDir: images})
	var ce *Error
	if !errors.As(err, &ce) || !errors.Is(err, ErrFailed) {
		t.Fatalf("dump of a missing pid: %v, want *criu.Error", err)
	}
	if len(ce.Tail) == 0 || ce.LogPath != filepath.Join(images, "dump.log") {
		t.Fatalf("error lacks the log: %+v", ce)
	}
}

func TestLogCause(t *testing.T) {
	tests := []struct {
		name, log, want string
	}{
		{"harmless first", "(00.000100) Error (criu/rlimit.c:30): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n" +
			"(00.010000) Error (criu/tty.c:2020): tty: Found dangling tty with sid 0 pgid (0) (ctl) (pts/3)\n" +
			"(00.020000) Error (criu/cr-dump.c:2093): Dumping FAILED.\n",
			"tty: Found dangling tty with sid 0 pgid (0) (ctl) (pts/3)"},
		{"none", "(00.000100) Dumping finished successfully\n", ""},
		{"no position", "(00.000100) Error: nothing here\n", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "dump.log")
			if err := os.WriteFile(p, []byte(tt.log), 0o600); err != nil {
				t.Fatal(err)
			}
			if got := LogCause(p); got != tt.want {
				t.Errorf("LogCause = %q, want %q", got, tt.want)
			}
		})
	}
	if LogCause(filepath.Join(t.TempDir(), "missing")) != "" {
		t.Error("missing log has a cause")
	}
}
