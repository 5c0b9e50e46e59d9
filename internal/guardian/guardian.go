// Package guardian is the process that watches one ptxmig operation from outside ptxmig's
// process group: ptxmig starts it (`ptxmig __ptxmig-guardian JOURNAL`, see op.Begin) in a
// session of its own before it touches any process, holding the write end of a pipe the
// guardian reads. When the pipe reaches end-of-file ptxmig has ended: normally it has removed
// the journal first, and the guardian exits; if the journal is still there, ptxmig died before
// the operation ended, and the guardian rolls it back (or finishes it, when it had committed)
// from the journal — op.RecoverJournal — keeping a report with the failure logs in the log
// directory.
package guardian

import (
	"context"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
)

// Name is the guardian's process name (comm).
const Name = "ptxmig-guardian"

// lockWait bounds the wait for the dead ptxmig's journal lock to go (it goes when the process is
// gone) and for a concurrent recover.
const lockWait = 2 * time.Minute

// Intercept runs the guardian and exits when this program was started as one
// (args[1] == op.GuardianArg); otherwise it declares that the program can start guardians
// (op.EnableGuardian) and returns. cmd/ptxmig calls it from init, before the CLI.
func Intercept(args []string) {
	if len(args) > 1 && args[1] == op.GuardianArg {
		os.Exit(Main(args[2:]))
	}
	op.EnableGuardian()
}

// Main is the guardian: args is the journal's path; fd 3 is the watch pipe, fd 4 the ready pipe.
func Main(args []string) int {
	if name, err := unix.BytePtrFromString(Name); err == nil {
		_ = unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(name)), 0, 0, 0)
	}
	// Signals meant for ptxmig's job (a Ctrl-C, a service stop) must not end the guardian before
	// it has done its work.
	signal.Ignore(syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGPIPE)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	if len(args) != 1 {
		log.Error("usage: ptxmig " + op.GuardianArg + " JOURNAL")
		return 2
	}
	path := args[0]
	watch, ready := os.NewFile(3, "watch"), os.NewFile(4, "ready")
	if watch == nil || ready == nil {
		log.Error("guardian started without its pipes")
		return 2
	}
	st, err := journal.Read(path)
	if err != nil {
		log.Error("guardian: refusing the journal", "err", err)
		return 1
	}
	if o := st.Header.Owner; o.PID != os.Getppid() && proc.Same(o.PID, o.Start) {
		log.Error("guardian: the journal belongs to another live process", "owner", o.PID, "parent", os.Getppid())
		return 1
	}
	// A failed write means ptxmig died already: the watch pipe says so at once.
	_, _ = ready.Write([]byte{'R'})
	ready.Close()
	_, _ = io.Copy(io.Discard, watch) // returns at end-of-file: ptxmig has ended, one way or another
	watch.Close()
	r := op.RecoverJournal(context.Background(), path, op.RecoverOptions{Log: log, Wait: lockWait})
	if r == nil {
		return 0 // the operation ended: nothing to do
	}
	log.Warn("guardian recovered an interrupted operation", "journal", r.Journal, "outcome", r.Outcome, "logs", r.LogDir, "err", r.Error)
	if r.Error != "" {
		return 1
	}
	return 0
}
