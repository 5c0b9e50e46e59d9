package hold

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

// uvmProc starts a test process whose second thread reads a file mapping all the time (the
// stand-in for a thread touching the driver's mappings) and returns it with the file.
func uvmProc(t *testing.T) (*testproc.Proc, string) {
	t.Helper()
	dir := t.TempDir()
	bin, err := testproc.Build(dir)
	if err != nil {
		t.Fatalf("build the test process: %v", err)
	}
	p, err := testproc.StartUVM(bin, dir, testproc.Options{IntervalMs: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Kill() })
	waitThreads(t, p.PID, 2)
	return p, p.UVM
}

func waitThreads(t *testing.T, pid, n int) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; {
		if tids, _ := threads(pid); len(tids) >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d never had %d threads", pid, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// unmap takes the mapping's pages away, as the driver's checkpoint does, for d, then puts them back.
func unmap(t *testing.T, uvm string, d time.Duration) {
	t.Helper()
	if err := os.Truncate(uvm, 0); err != nil {
		t.Fatal(err)
	}
	time.Sleep(d)
	if err := os.Truncate(uvm, testproc.UVMSize); err != nil {
		t.Fatal(err)
	}
}

// states is the state letter of every thread of pid, the main thread first.
func states(pid int) string {
	tids, _ := threads(pid)
	var b strings.Builder
	b.WriteByte(proc.ThreadState(pid, pid))
	for _, tid := range tids {
		if tid != pid {
			b.WriteByte(proc.ThreadState(pid, tid))
		}
	}
	return b.String()
}

func step(t *testing.T, p *testproc.Proc) int {
	t.Helper()
	s, err := testproc.ReadState(p.StateFile)
	if err != nil {
		t.Fatal(err)
	}
	return s.Step
}

// advances reports whether p makes progress within 300 ms.
func advances(t *testing.T, p *testproc.Proc) bool {
	t.Helper()
	a := step(t, p)
	time.Sleep(300 * time.Millisecond)
	return step(t, p) > a
}

// The stand-in is faithful: a thread that runs while the mapping is gone kills the process.
func TestUnheldThreadDies(t *testing.T) {
	p, uvm := uvmProc(t)
	unmap(t, uvm, 200*time.Millisecond)
	select {
	case <-p.Exited():
	case <-time.After(2 * time.Second):
		t.Fatalf("pid %d survived its mapping going away: the test process does not touch it", p.PID)
	}
}

func TestThreadsRelease(t *testing.T) {
	p, uvm := uvmProc(t)
	h, err := Threads(p.PID, p.PID)
	if err != nil {
		t.Fatal(err)
	}
	if got := states(p.PID); got[0] == 't' || got[0] == 'T' || strings.Trim(got[1:], "t") != "" {
		t.Fatalf("held: thread states %q, want the main thread running and every other one traced (t)", got)
	}
	if len(h.Held()) != 1 {
		t.Fatalf("held %v, want the reader thread alone", h.Held())
	}
	if !advances(t, p) {
		t.Fatal("the kept thread does not run while the others are held")
	}
	unmap(t, uvm, 200*time.Millisecond)
	if err := h.Release(); err != nil {
		t.Fatal(err)
	}
	if err := h.Release(); err != nil { // a second release changes nothing
		t.Fatal(err)
	}
	if !advances(t, p) || !testproc.Alive(p.PID) {
		t.Fatalf("pid %d does not run on after the release (states %q)", p.PID, states(p.PID))
	}
	if got := states(p.PID); strings.ContainsAny(got, "tT") {
		t.Fatalf("after the release: thread states %q", got)
	}
}

// Stop leaves the whole process stopped without a tracer (as CRIU must find it); Threads on the
// stopped process lets only the kept thread run; Release lets it all run.
func TestStopThenThreads(t *testing.T) {
	p, uvm := uvmProc(t)
	h, err := Threads(p.PID, p.PID)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(uvm, 0); err != nil { // the driver's checkpoint
		t.Fatal(err)
	}
	if err := h.Stop(); err != nil {
		t.Fatal(err)
	}
	if got := states(p.PID); strings.Trim(got, "T") != "" {
		t.Fatalf("stopped: thread states %q, want every thread stopped (T)", got)
	}
	if tracer := tracerPID(t, p.PID); tracer != 0 {
		t.Fatalf("stopped pid %d is traced by %d", p.PID, tracer)
	}
	if advances(t, p) {
		t.Fatal("the stopped process runs")
	}
	h, err = Threads(p.PID, p.PID) // the driver's restore
	if err != nil {
		t.Fatal(err)
	}
	if got := states(p.PID); got[0] == 'T' || got[0] == 't' || strings.Trim(got[1:], "t") != "" {
		t.Fatalf("held after a stop: thread states %q", got)
	}
	if !advances(t, p) {
		t.Fatal("the kept thread does not run after a stop")
	}
	if err := os.Truncate(uvm, testproc.UVMSize); err != nil {
		t.Fatal(err)
	}
	if err := h.Release(); err != nil {
		t.Fatal(err)
	}
	if !advances(t, p) || strings.ContainsAny(states(p.PID), "tT") {
		t.Fatalf("pid %d does not run on after the release (states %q)", p.PID, states(p.PID))
	}
}

// A thread traced by another tracer (a debugger) cannot be held: an error, nothing left held.
func TestThreadsTracedElsewhere(t *testing.T) {
	p, _ := uvmProc(t)
	first, err := Threads(p.PID, p.PID)
	if err != nil {
		t.Fatal(err)
	}
	_, err = Threads(p.PID, p.PID)
	if err == nil || !strings.Contains(err.Error(), "debugger") {
		t.Fatalf("second hold: %v, want a refusal naming a debugger", err)
	}
	if err := first.Release(); err != nil {
		t.Fatal(err)
	}
	if !advances(t, p) || strings.ContainsAny(states(p.PID), "tT") {
		t.Fatalf("pid %d does not run on (states %q)", p.PID, states(p.PID))
	}
}

// TestStopKilledWhileHeld: a process killed while it is held (SIGKILL reaches a traced process)
// has nothing left to stop: Stop and Release succeed at once instead of waiting for a dead
// thread to stop, and nothing stays attached.
func TestStopKilledWhileHeld(t *testing.T) {
	for _, stop := range []bool{true, false} {
		t.Run(map[bool]string{true: "stop", false: "release"}[stop], func(t *testing.T) {
			p, _ := uvmProc(t)
			h, err := Threads(p.PID, p.PID)
			if err != nil {
				t.Fatal(err)
			}
			if err := syscall.Kill(p.PID, syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			for deadline := time.Now().Add(5 * time.Second); proc.ThreadState(p.PID, p.PID) != 'Z'; time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("pid %d did not die (state %c)", p.PID, proc.ThreadState(p.PID, p.PID))
				}
			}
			if stop {
				err = h.Stop()
			} else {
				err = h.Release()
			}
			if err != nil {
				t.Fatalf("after the held process was killed: %v", err)
			}
		})
	}
}

func TestThreadsBadArguments(t *testing.T) {
	p, _ := uvmProc(t)
	for _, c := range []struct{ pid, keep int }{{p.PID, 0}, {0, p.PID}, {p.PID, 1}, {1 << 30, 1 << 30}} {
		if _, err := Threads(c.pid, c.keep); err == nil {
			t.Errorf("Threads(%d, %d): no error", c.pid, c.keep)
		}
	}
	if strings.ContainsAny(states(p.PID), "tT") {
		t.Fatalf("states %q after refused holds", states(p.PID))
	}
}

func tracerPID(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "TracerPid:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	return -1
}

// The held process's parent is this process, and a goroutine of it waits for the process the
// plain way (cmd.Wait): the kernel reports the main thread's ptrace-stop to that wait too, which
// may take it first; the hold must not hang on it. (Harnesses reap with proc.WaitDead instead,
// since cmd.Wait then returns as if the process had ended.)
func TestThreadsParentWaits(t *testing.T) {
	dir := t.TempDir()
	bin, err := testproc.Build(dir)
	if err != nil {
		testreq.Skip(t, "cc", "cannot build the test program: %v", err)
	}
	uvm, err := testproc.MakeUVM(dir)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, filepath.Join(dir, "state"), "--interval-ms", "2", "--uvm", uvm)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	waited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(waited) }()
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL); <-waited })
	waitThreads(t, pid, 2)
	tids, _ := threads(pid)
	keep := 0
	for _, tid := range tids {
		if tid != pid {
			keep = tid
		}
	}
	for i := 0; i < 20; i++ {
		done := make(chan error, 1)
		var h *Held
		go func() {
			var err error
			h, err = Threads(pid, keep)
			done <- err
		}()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("Threads hangs while the parent waits for the process (round %d)", i)
		}
		if got := proc.ThreadState(pid, pid); got != 't' {
			t.Fatalf("main thread state %c, want t", got)
		}
		if err := h.Release(); err != nil {
			t.Fatal(err)
		}
	}
}

// BenchmarkHold: what the hold adds to each driver call of a process with 100 threads: hold and
// release (a restore of a running process), and the checkpoint's cycle (hold, stop; hold the
// stopped process again, release).
func BenchmarkHold(b *testing.B) {
	dir := b.TempDir()
	bin, err := testproc.Build(dir)
	if err != nil {
		b.Skip(err)
	}
	p, err := testproc.Start(bin, filepath.Join(dir, "state"), testproc.Options{IntervalMs: 5, Threads: 100})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = p.Kill() }()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if tids, _ := threads(p.PID); len(tids) == 101 {
			break
		}
		if time.Now().After(deadline) {
			b.Fatal("the test process did not start its threads")
		}
	}
	// Holds in an operation are a driver call apart: the holder Threads starts for the next hold
	// is ready by then. Each iteration waits for it outside the timing.
	ready := func(b *testing.B) {
		b.StopTimer()
		Prewarm()
		for {
			spareMu.Lock()
			h := spare
			spareMu.Unlock()
			if h != nil {
				break
			}
			time.Sleep(time.Millisecond)
		}
		time.Sleep(20 * time.Millisecond) // its runtime started and waiting for the order
		b.StartTimer()
	}
	b.Run("threads+release", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			ready(b)
			h, err := Threads(p.PID, p.PID)
			if err != nil {
				b.Fatal(err)
			}
			if err := h.Release(); err != nil {
				b.Fatal(err)
			}
		}
	})
	// The same hold from this process (no holder): the baseline of the holder's cost.
	b.Run("threads+release-in-process", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			h, err := holdHere(p.PID, p.PID)
			if err != nil {
				b.Fatal(err)
			}
			if err := h.release(false); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("checkpoint-cycle", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			ready(b)
			h, err := Threads(p.PID, p.PID)
			if err == nil {
				err = h.Stop()
			}
			if err == nil {
				ready(b)
				h, err = Threads(p.PID, p.PID)
			}
			if err == nil {
				err = h.Release()
			}
			if err != nil {
				b.Fatal(err)
			}
		}
	})
}

// A process whose main thread has exited (a zombie while the others run) is held all the same:
// the zombie is skipped, not taken for a thread traced elsewhere.
func TestThreadsZombieMain(t *testing.T) {
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		testreq.Skip(t, "gcc", "builds the test program: %v", err)
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "zmain.c")
	if err := os.WriteFile(src, []byte(`#include <pthread.h>
#include <time.h>
static void *spin(void *p) { for (;;) { struct timespec ts = {0, 1000000}; nanosleep(&ts, 0); } return p; }
int main(void) { pthread_t a, b; pthread_create(&a, 0, spin, 0); pthread_create(&b, 0, spin, 0); pthread_exit(0); }
`), 0o600); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "zmain")
	if out, err := exec.Command(gcc, "-O2", "-pthread", "-o", bin, src).CombinedOutput(); err != nil {
		t.Fatalf("gcc: %v: %s", err, out)
	}
	cmd := exec.Command(bin)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = proc.WaitDead(cmd) })
	var workers []int
	for deadline := time.Now().Add(5 * time.Second); len(workers) < 2; time.Sleep(10 * time.Millisecond) {
		workers = workers[:0]
		if proc.ThreadState(pid, pid) == 'Z' {
			tids, _ := threads(pid)
			for _, tid := range tids {
				if tid != pid {
					workers = append(workers, tid)
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the main thread did not exit with two workers left")
		}
	}
	h, err := Threads(pid, workers[0])
	if err != nil {
		t.Fatalf("hold with a zombie main thread: %v", err)
	}
	if got := h.Held(); len(got) != 1 || got[0] != workers[1] {
		t.Fatalf("held %v, want the other worker %d", got, workers[1])
	}
	if err := h.Stop(); err != nil {
		t.Fatal(err)
	}
	h, err = Threads(pid, workers[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Release(); err != nil {
		t.Fatal(err)
	}
	for _, tid := range workers {
		if s := proc.ThreadState(pid, tid); s == 'T' || s == 't' {
			t.Errorf("worker %d left in state %c", tid, s)
		}
	}
}

// The holder outlives whoever asked for the hold: when its orders end without one (ptxmig died,
// here in the middle of the driver's checkpoint: the mapping is gone), it leaves the process
// stopped, with no tracer, every thread alive; the signals a terminal or a service manager sends
// ptxmig's job do not end it meanwhile. A later hold (the guardian's restore) and its release let
// the process run on.
func TestHolderStopsWhenPtxmigGoes(t *testing.T) {
	p, uvm := uvmProc(t)
	h, err := Threads(p.PID, p.PID)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(uvm, 0); err != nil { // the driver's checkpoint, under way
		t.Fatal(err)
	}
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP} {
		_ = syscall.Kill(h.hp.cmd.Process.Pid, sig)
	}
	time.Sleep(50 * time.Millisecond)
	if got := states(p.PID); strings.Trim(got[1:], "t") != "" {
		t.Fatalf("after SIGINT, SIGTERM and SIGHUP to the holder: thread states %q, want the others still held (t)", got)
	}
	_ = h.hp.in.Close() // ptxmig is gone: no order will come
	if err := h.hp.cmd.Wait(); err == nil {
		t.Error("the holder exited 0 without an order")
	}
	if got := states(p.PID); strings.Trim(got, "T") != "" {
		t.Fatalf("after ptxmig went away: thread states %q, want every thread stopped (T)", got)
	}
	if tracer := tracerPID(t, p.PID); tracer != 0 {
		t.Fatalf("pid %d is still traced by %d", p.PID, tracer)
	}
	if advances(t, p) || !testproc.Alive(p.PID) {
		t.Fatalf("pid %d runs, or died, while the mapping is gone", p.PID)
	}
	h, err = Threads(p.PID, p.PID) // the guardian restores it
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(uvm, testproc.UVMSize); err != nil {
		t.Fatal(err)
	}
	if err := h.Release(); err != nil {
		t.Fatal(err)
	}
	if !advances(t, p) || strings.ContainsAny(states(p.PID), "tT") {
		t.Fatalf("pid %d does not run on (states %q)", p.PID, states(p.PID))
	}
}

// The same with ptxmig killed: a process of its own (this test binary again) holds the threads
// and is killed while they are held and the mapping is gone — by a SIGKILL, or with its whole
// cgroup (cgroup.kill: a service stopped, an OOM group kill), which the holder survives in
// proc.KeepCgroup (started in ptxmig's cgroup it died too, and the threads ran).
func TestHolderStopsWhenPtxmigIsKilled(t *testing.T) {
	if os.Getenv("HOLD_TEST_CHILD") != "" {
		return // the child's side runs in TestMain
	}
	for _, group := range []bool{false, true} {
		name := map[bool]string{false: "SIGKILL", true: "cgroup.kill"}[group]
		t.Run(name, func(t *testing.T) {
			p, uvm := uvmProc(t)
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), "HOLD_TEST_CHILD="+strconv.Itoa(p.PID))
			var svc string
			if group {
				var fd int
				svc, fd = testproc.ServiceCgroup(t)
				cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: fd}
			}
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			line, err := bufio.NewReader(out).ReadString('\n')
			if err != nil || line != "held\n" {
				_ = cmd.Process.Kill()
				t.Fatalf("the holding child said %q (%v)", line, err)
			}
			if err := os.Truncate(uvm, 0); err != nil {
				t.Fatal(err)
			}
			if group {
				err = testproc.KillCgroup(svc)
			} else {
				err = cmd.Process.Kill()
			}
			if err != nil {
				t.Fatal(err)
			}
			_ = cmd.Wait()
			for deadline := time.Now().Add(5 * time.Second); strings.Trim(states(p.PID), "T") != "" || tracerPID(t, p.PID) != 0; time.Sleep(5 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("after ptxmig was killed: thread states %q, tracer %d; want every thread stopped, untraced", states(p.PID), tracerPID(t, p.PID))
				}
			}
			if advances(t, p) || !testproc.Alive(p.PID) {
				t.Fatalf("pid %d runs, or died, while the mapping is gone", p.PID)
			}
			if err := os.Truncate(uvm, testproc.UVMSize); err != nil {
				t.Fatal(err)
			}
			h, err := Threads(p.PID, p.PID)
			if err != nil {
				t.Fatal(err)
			}
			if err := h.Release(); err != nil {
				t.Fatal(err)
			}
			if !advances(t, p) {
				t.Fatalf("pid %d does not run on (states %q)", p.PID, states(p.PID))
			}
		})
	}
}

func TestMain(m *testing.M) {
	if s := os.Getenv("HOLD_TEST_CHILD"); s != "" {
		// The stand-in for ptxmig in TestHolderStopsWhenPtxmigIsKilled: hold, say so, wait to be killed.
		pid, _ := strconv.Atoi(s)
		if _, err := Threads(pid, pid); err != nil {
			fmt.Println("error", err)
			os.Exit(1)
		}
		fmt.Println("held")
		time.Sleep(time.Hour)
	}
	os.Exit(m.Run())
}
