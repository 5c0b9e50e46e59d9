package hold

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/proc"
)

// The threads are held by a holder process, not by ptxmig: a process's tracer that dies detaches
// its tracees, and a thread let go while the driver has the device mappings away can kill the
// process. The holder is this program started again with HolderArg; it takes its orders on its
// stdin, and when that closes without one (ptxmig died, whatever killed it) it leaves the process
// stopped (Stop), never running, for the guardian to take from there. It ignores the signals a
// terminal or a service manager sends ptxmig's job and runs in a session of its own.

// HolderArg is the first argument of a holder process: `ptxmig HolderArg`, which then takes its
// orders on stdin: "hold PID KEEP", then "stop" or "release", then the next hold. Every program that links this package serves as one (the
// check runs in its init), test binaries included.
const HolderArg = "__ptxmig-hold"

// holderReplyTimeout bounds the wait for the holder's answer to an order: the hold's own waits
// (stopTimeout each) and the program's start.
const holderReplyTimeout = 30 * time.Second

func init() {
	if len(os.Args) > 1 && os.Args[1] == HolderArg {
		os.Exit(holderMain(os.Args[2:]))
	}
}

// holderExe is the program started as the holder.
var holderExe = "/proc/self/exe"

// Held is a process whose threads but one are seized by a holder process.
type Held struct {
	pid  int
	hp   *holderProc
	tids []int
	done bool
}

// holderProc is a started holder: it takes a "hold PID KEEP" order, then "stop" or "release",
// and then the next "hold", until its stdin closes.
type holderProc struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Reader
	outF *os.File // out's pipe, closed once the holder is reaped
}

// wait reaps the holder and closes its end of the answers' pipe.
func (hp *holderProc) wait() error {
	err := hp.cmd.Wait()
	_ = hp.outF.Close()
	return err
}

// Threads seizes every thread of pid except keep (the driver's restore thread), through a holder
// process, and returns once each of them is stopped; a process in a group-stop is continued, so
// that keep runs while the others stay stopped under ptrace. A thread created meanwhile is seized
// too. On error nothing stays seized and the process is as it was (a stopped process is stopped
// again). If this program dies before Stop or Release, the process is left stopped (Stop).
func Threads(pid, keep int) (*Held, error) {
	if pid <= 0 || keep <= 0 {
		return nil, fmt.Errorf("hold pid %d: bad thread %d", pid, keep)
	}
	order := fmt.Sprintf("hold %d %d\n", pid, keep)
	hp, err := takeHolder()
	if err == nil {
		if _, err = io.WriteString(hp.in, order); err != nil { // a spare that died meanwhile
			hp.kill()
			if hp, err = startHolder(); err == nil {
				_, err = io.WriteString(hp.in, order)
			}
		}
	}
	if err != nil {
		if hp != nil {
			hp.kill()
		}
		return nil, fmt.Errorf("hold pid %d: start the holder: %w", pid, err)
	}
	rest, err := hp.reply("held")
	if err != nil {
		hp.abandon() // its hold failed (it holds nothing), or it never answered
		return nil, fmt.Errorf("hold pid %d: %w", pid, err)
	}
	h := &Held{pid: pid, hp: hp}
	for _, f := range strings.Fields(rest) {
		tid, err := strconv.Atoi(f)
		if err != nil {
			break
		}
		h.tids = append(h.tids, tid)
	}
	return h, nil
}

// Prewarm starts a holder that waits for its order, so that the next Threads does not wait for a
// program to start (milliseconds, in the stop of the process); a holder done with a hold waits
// for the next one the same way. It ends when this program does. Safe for concurrent use.
func Prewarm() {
	spareMu.Lock()
	defer spareMu.Unlock()
	if spare != nil {
		return
	}
	if hp, err := startHolder(); err == nil {
		spare = hp
	}
}

var (
	spareMu sync.Mutex
	spare   *holderProc // a started holder waiting for its order (Prewarm, or done with a hold)
)

func takeHolder() (*holderProc, error) {
	spareMu.Lock()
	hp := spare
	spare = nil
	spareMu.Unlock()
	if hp != nil {
		return hp, nil
	}
	return startHolder()
}

// putHolder keeps a holder done with its hold for the next one (one is kept; others end).
func putHolder(hp *holderProc) {
	spareMu.Lock()
	if spare == nil {
		spare, hp = hp, nil
	}
	spareMu.Unlock()
	if hp != nil {
		_ = hp.in.Close() // idle: it exits
		go func() { _ = hp.wait() }()
	}
}

// startHolder starts a holder, which waits for a "hold PID KEEP" order on its stdin. It runs in a
// cgroup of its own (proc.KeepCgroup): a kill of ptxmig's whole cgroup (a service stopped, an OOM
// group kill) leaves it to stop the process it holds instead of letting its threads run.
func startHolder() (*holderProc, error) {
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return nil, err
	}
	cmd, _, err := proc.StartKept(func() *exec.Cmd {
		cmd := exec.Command(holderExe, HolderArg)
		cmd.Args[0] = "ptxmig"
		cmd.Dir = "/"
		cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		return cmd
	})
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		return nil, err
	}
	return &holderProc{cmd: cmd, in: inW, out: bufio.NewReader(outR), outF: outR}, nil
}

// kill ends a holder that holds nothing.
func (hp *holderProc) kill() {
	_ = hp.in.Close()
	_ = hp.cmd.Process.Kill()
	_ = hp.wait()
}

// abandonWait bounds the wait for a holder told to go (its orders closed) before it is killed.
const abandonWait = 15 * time.Second

// abandon ends a holder that may still hold (it did not answer): its orders close, so that if it
// holds it stops the process and lets go, as if ptxmig had died; it is killed only if it has not
// ended after abandonWait (a kill while it holds would let the threads run).
func (hp *holderProc) abandon() {
	_ = hp.in.Close()
	done := make(chan struct{})
	go func() { _ = hp.wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(abandonWait):
		_ = hp.cmd.Process.Kill()
		<-done
	}
}

// Held reports the threads seized (for reports and tests).
func (h *Held) Held() []int { return slices.Clone(h.tids) }

// Release lets every thread run again (the process runs, unless it is stopped by a signal that
// arrived meanwhile).
func (h *Held) Release() error { return h.order("release") }

// Stop puts the whole process in a group-stop (SIGSTOP), waits until keep has stopped, and then
// lets go of the seized threads, which stop at once without running (the group-stop is in effect
// when they are detached). The process stays stopped, with no tracer, until a SIGCONT (Threads
// sends one).
func (h *Held) Stop() error { return h.order("stop") }

func (h *Held) order(what string) error {
	if h.done {
		return nil
	}
	h.done = true
	_, err := io.WriteString(h.hp.in, what+"\n")
	if err == nil {
		_, err = h.hp.reply("ok")
	}
	var he holderError
	if err != nil && !errors.As(err, &he) { // the holder's own errors name the order and the pid
		err = fmt.Errorf("%s pid %d: %w", what, h.pid, err)
	}
	if err != nil {
		h.hp.abandon() // what it did is in err
		return err
	}
	putHolder(h.hp)
	return nil
}

// reply reads the holder's next line: "WANT REST" gives REST, "error MSG" an error with MSG.
func (hp *holderProc) reply(want string) (string, error) {
	type line struct {
		s   string
		err error
	}
	ch := make(chan line, 1)
	go func() {
		s, err := hp.out.ReadString('\n')
		ch <- line{s, err}
	}()
	var l line
	select {
	case l = <-ch:
	case <-time.After(holderReplyTimeout):
		return "", fmt.Errorf("the holder did not answer within %s", holderReplyTimeout)
	}
	s := strings.TrimSuffix(l.s, "\n")
	if l.err != nil {
		return "", fmt.Errorf("the holder ended without an answer (%v)", l.err)
	}
	verb, rest, _ := strings.Cut(s, " ")
	switch verb {
	case want:
		return rest, nil
	case "error":
		return "", holderError(rest)
	}
	return "", fmt.Errorf("the holder answered %q", s)
}

// holderError is an error the holder answered ("error MSG"): MSG names what failed and the pid.
type holderError string

func (e holderError) Error() string { return string(e) }

// holderMain is the holder: its orders come on stdin ("hold PID KEEP", then "stop" or
// "release", and again), its answers go to stdout. Each hold runs on tracer threads of its own
// (holdHere), which end with it.
func holderMain(args []string) int {
	if name, err := unix.BytePtrFromString("ptxmig-hold"); err == nil {
		_ = unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(name)), 0, 0, 0)
	}
	// A Ctrl-C or a service stop meant for ptxmig must not let the threads go: only the end of
	// stdin, an order, or SIGKILL ends a holder.
	signal.Ignore(syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGPIPE)
	out := bufio.NewWriter(os.Stdout)
	answer := func(verb, rest string) {
		fmt.Fprintf(out, "%s %s\n", verb, strings.ReplaceAll(rest, "\n", "; "))
		_ = out.Flush()
	}
	if len(args) != 0 {
		answer("error", "usage: ptxmig "+HolderArg+" (orders on stdin)")
		return 2
	}
	orders := bufio.NewReader(os.Stdin)
	for {
		first, err := orders.ReadString('\n')
		if err != nil {
			return 0 // its program ended while it held nothing
		}
		var pid, keep int
		if n, err := fmt.Sscanf(first, "hold %d %d\n", &pid, &keep); n != 2 || err != nil {
			answer("error", fmt.Sprintf("want the order \"hold PID KEEP\", got %q", first))
			return 2
		}
		h, err := holdHere(pid, keep)
		if err != nil {
			answer("error", err.Error())
			continue
		}
		tids := make([]string, len(h.tids))
		for i, t := range h.tids {
			tids[i] = strconv.Itoa(t)
		}
		answer("held", strings.Join(tids, " "))
		cmd, rerr := orders.ReadString('\n')
		switch {
		case rerr == nil && cmd == "release\n":
			err = h.release(false)
		case rerr == nil && cmd == "stop\n":
			err = h.release(true)
		default:
			// ptxmig went away (or sent nonsense): the safe side is a stopped process.
			err = h.release(true)
			if err != nil {
				fmt.Fprintf(os.Stderr, "ptxmig-hold: pid %d: left stopped after ptxmig went away: %v\n", pid, err)
			}
			return 1
		}
		if err != nil {
			answer("error", err.Error())
			continue
		}
		answer("ok", "")
	}
}
