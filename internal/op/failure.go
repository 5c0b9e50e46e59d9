package op

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
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
// operator needs to know about, cuda those of them the driver holds. Their state is read, never
// assumed: /proc says running, stopped or gone, and the driver (when e has one) which CUDA
// processes it still holds locked or checkpointed.
func (e *Env) NewFailure(err error, op string, root int, logs []string, pids, cuda []int) error {
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
	if held := e.driverHeld(cuda); held != "" {
		f.State = strings.TrimPrefix(f.State+"; "+held, "; ")
	}
	return f
}

// driverHeld says which of the live pids the driver holds in another state than running
// ("locked by the driver: pid 42"), "" when none (or no driver to ask).
func (e *Env) driverHeld(pids []int) string {
	if e.Driver == nil {
		return ""
	}
	by := map[cudackpt.State][]string{}
	var order []cudackpt.State
	var stopped []string
	for _, pid := range pids {
		if !proc.Alive(pid) {
			continue
		}
		st, err := e.Driver.State(pid)
		if errors.Is(err, cudackpt.ErrStopped) {
			stopped = append(stopped, strconv.Itoa(pid))
			continue
		}
		if err != nil || st == cudackpt.Running {
			continue
		}
		if by[st] == nil {
			order = append(order, st)
		}
		by[st] = append(by[st], strconv.Itoa(pid))
	}
	var parts []string
	for _, st := range order {
		parts = append(parts, fmt.Sprintf("%s by the driver: pid %s", st, strings.Join(by[st], ", ")))
	}
	if len(stopped) > 0 {
		parts = append(parts, fmt.Sprintf("stopped, its GPU state checkpointed by the driver (a stopped process cannot be asked): pid %s",
			strings.Join(stopped, ", ")))
	}
	return strings.Join(parts, "; ")
}
