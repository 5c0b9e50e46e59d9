package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/store"
)

// exitCodesText renders the table for help: "   0    success", one a line.
func exitCodesText(indent string) string {
	var b strings.Builder
	for _, e := range exitcode.Codes {
		fmt.Fprintf(&b, "%s%-4d %s\n", indent, e.Code, e.Meaning)
	}
	fmt.Fprintf(&b, "%sptxmig run passes the command's own status through: only 125-127 are ptxmig's.\n", indent)
	return b.String()
}

// errNoProcess marks "no process with that pid" found by a command before the operation's plan.
var errNoProcess = errors.New("no such process")

// exitStatus maps a command's error to its exit status. Statuses attached with internal/exitcode
// stay, except that "not found" (an image, a process, a store) is always 6, an invalid name or an
// ambiguous id prefix always 2, and a cancelled command that touched nothing 130.
func exitStatus(err error) int {
	if err == nil {
		return exitcode.OK
	}
	code := exitcode.Of(err)
	switch code {
	case exitcode.RolledBack, exitcode.Busy, exitcode.RunFailed, exitcode.RunNoExec, exitcode.RunNotFound:
		return code
	}
	switch {
	case errors.Is(err, store.ErrNotFound), errors.Is(err, store.ErrNoStore), errors.Is(err, errNoProcess):
		return exitcode.NotFound
	case errors.Is(err, store.ErrInvalidName), errors.Is(err, store.ErrAmbiguous):
		return exitcode.Usage
	case code == exitcode.Failed && errors.Is(err, context.Canceled):
		return exitcode.Interrupted
	}
	return code
}
