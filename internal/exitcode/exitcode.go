// Package exitcode maps ptxmig's failures to the process exit status operators script against.
//
// The codes are part of the CLI contract: Codes is their one table, which `ptxmig --help`, the
// man page, the README and --json error documents ("kind": Name) show.
//
//	0    success
//	1    the operation failed
//	2    usage error (bad command, flag or argument)
//	3    refused by preflight: nothing was touched
//	4    failed after the target was touched, and was rolled back: the process runs as before
//	5    busy: another ptxmig operation holds the lock on the same target
//	6    not found: no such image, process or store
//	125  ptxmig run: ptxmig itself failed, the command was not started
//	126  ptxmig run: the command was found but cannot be executed
//	127  ptxmig run: the command was not found
//	130  interrupted by SIGINT or SIGTERM
package exitcode

import (
	"errors"
	"fmt"
)

// Exit statuses.
const (
	OK          = 0
	Failed      = 1
	Usage       = 2
	Refused     = 3
	RolledBack  = 4
	Busy        = 5
	NotFound    = 6   // no such image, process or store
	RunFailed   = 125 // ptxmig run itself failed (before the exec)
	RunNoExec   = 126 // ptxmig run: the command was found but cannot be executed
	RunNotFound = 127 // ptxmig run: the command was not found
	Interrupted = 130 // SIGINT/SIGTERM stopped a command that had touched nothing
)

// Code is one exit status of the CLI contract.
type Code struct {
	Code    int
	Kind    string // its Name: the "kind" of a --json error document
	Meaning string // for people: help, the man page, the README
}

// Codes is the one table of exit statuses, in the order help and the man page list them.
var Codes = []Code{
	{OK, "ok", "success"},
	{Failed, "failed", "the operation failed; the error and --json's process_state say each process's state, read from /proc and the driver"},
	{Usage, "usage", "usage error: bad command, flag or argument (also an invalid image name or an ambiguous id prefix)"},
	{Refused, "refused", "refused by preflight: nothing was touched"},
	{RolledBack, "rolled-back", "failed after touching the process, and rolled back: it runs as before (also when the failed step undid its own part: a stalled CRIU ended, a full disk mid-dump)"},
	{Busy, "busy", "busy: another ptxmig operation holds the same target"},
	{NotFound, "not-found", "not found: no such image, process or store (nothing was touched)"},
	{RunFailed, "run-failed", "ptxmig run: ptxmig itself failed, the command was not started"},
	{RunNoExec, "cannot-execute", "ptxmig run: the command was found but cannot be executed"},
	{RunNotFound, "command-not-found", "ptxmig run: the command was not found"},
	{Interrupted, "interrupted", "interrupted by SIGINT or SIGTERM before anything was touched (an operation that had touched a process rolls back: 4)"},
}

// Error attaches an exit status to an error without hiding it from errors.Is/As.
type Error struct {
	Code int
	Err  error
}

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// Wrap returns err carrying code; nil stays nil.
func Wrap(code int, err error) error {
	if err == nil {
		return nil
	}
	return &Error{Code: code, Err: err}
}

// Usagef builds a usage error.
func Usagef(format string, args ...any) error {
	return &Error{Code: Usage, Err: fmt.Errorf(format, args...)}
}

// Refusedf builds a preflight refusal.
func Refusedf(format string, args ...any) error {
	return &Error{Code: Refused, Err: fmt.Errorf(format, args...)}
}

// Of returns the exit status for err: the outermost *Error's code, else Failed; OK for nil.
func Of(err error) int {
	if err == nil {
		return OK
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return Failed
}

// Name is a short word for a code (Codes' Kind), used in --json error output; "failed" for a
// code not in the table.
func Name(code int) string {
	for _, c := range Codes {
		if c.Code == code {
			return c.Kind
		}
	}
	return "failed"
}
