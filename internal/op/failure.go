package op

import (
	"errors"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/proc"
)

// Failure is an operation that failed after preflight: the failed step and its rollback, where
// its logs were kept, CRIU's log tail, and the state of the processes after the rollback.
type Failure struct {
	*StepError
	LogDir   string   // the failure's kept logs ("" when there were none or they could not be kept)
	CRIUTail []string // last lines of CRIU's log
	State    string   // "pid 42 is running", "stopped: pid 43", ... after the rollback
}

func (f *Failure) Unwrap() error { return f.StepError }

func (f *Failure) Error() string {
	s := f.StepError.Error()
	if f.State != "" {
		s += " [" + f.State + "]"
	}
	return s
}

// NewFailure wraps the error of Execute. err must be a *StepError (anything else is returned
// as is); logs are the files to keep (see KeepLogs); pids are the processes whose state the
// operator needs to know about.
func NewFailure(err error, op string, root int, logs []string, pids []int) error {
	f := &Failure{}
	if !errors.As(err, &f.StepError) {
		return err
	}
	var ce *criu.Error
	if errors.As(err, &ce) {
		f.CRIUTail = ce.Tail
	}
	if len(logs) > 0 {
		dir, kerr := KeepLogs(op, root, logs...)
		if dir != "" {
			f.LogDir = dir
		}
		_ = kerr // a log that could not be kept must not hide the operation's own error
	}
	if len(pids) > 0 {
		f.State = proc.Describe(pids)
	}
	return f
}
