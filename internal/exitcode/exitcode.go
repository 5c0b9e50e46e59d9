// Package exitcode maps ptxmig's failures to the process exit status operators script against.
//
// The codes are part of the CLI contract (see README and `ptxmig --help`):
//
//	0  success
//	1  the operation failed
//	2  usage error (bad flags or arguments)
//	3  refused by preflight: nothing was touched
//	4  failed after the target was touched, and was rolled back: the process runs as before
//	5  busy: another ptxmig operation holds the lock on the same target
package exitcode

import (
	"errors"
	"fmt"
)

// Exit statuses.
const (
	OK         = 0
	Failed     = 1
	Usage      = 2
	Refused    = 3
	RolledBack = 4
	Busy       = 5
)

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

// Name is a short word for a code, used in --json error output.
func Name(code int) string {
	switch code {
	case OK:
		return "ok"
	case Usage:
		return "usage"
	case Refused:
		return "refused"
	case RolledBack:
		return "rolled-back"
	case Busy:
		return "busy"
	default:
		return "failed"
	}
}
