package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/ptxmig/ptxmig/internal/exitcode"
	"github.com/ptxmig/ptxmig/store"
)

// Exit statuses beyond internal/exitcode's 0-5. They are part of the CLI contract: `ptxmig
// --help`, the man page and the README print exitCodes.
const (
	exitNotFound    = 6   // no such image, process or store
	exitRunFailed   = 125 // ptxmig run itself failed (before the exec)
	exitRunNoExec   = 126 // ptxmig run: the command was found but cannot be executed
	exitRunNotFound = 127 // ptxmig run: the command was not found
	exitInterrupted = 130 // SIGINT/SIGTERM stopped a command that had touched nothing
)

// exitCodes is the one table of exit statuses, in the order help and the man page list them.
var exitCodes = []struct {
	Code    int
	Kind    string // the "kind" of a --json error document
	Meaning string
}{
	{exitcode.OK, "ok", "success"},
	{exitcode.Failed, "failed", "the operation failed"},
	{exitcode.Usage, "usage", "usage error: bad command, flag or argument (also an invalid image name or an ambiguous id prefix)"},
	{exitcode.Refused, "refused", "refused by preflight: nothing was touched"},
	{exitcode.RolledBack, "rolled-back", "failed after touching the process, and rolled back: it runs as before"},
	{exitcode.Busy, "busy", "busy: another ptxmig operation holds the same target"},
	{exitNotFound, "not-found", "not found: no such image, process or store (nothing was touched)"},
	{exitRunFailed, "run-failed", "ptxmig run: ptxmig itself failed, the command was not started"},
	{exitRunNoExec, "cannot-execute", "ptxmig run: the command was found but cannot be executed"},
	{exitRunNotFound, "command-not-found", "ptxmig run: the command was not found"},
	{exitInterrupted, "interrupted", "interrupted by SIGINT or SIGTERM (an operation that had touched a process rolls back: 4)"},
}

// exitKind is the word for code in --json error documents.
func exitKind(code int) string {
	for _, e := range exitCodes {
		if e.Code == code {
			return e.Kind
		}
	}
	return "failed"
}

// exitCodesText renders the table for help: "   0    success", one a line.
func exitCodesText(indent string) string {
	var b strings.Builder
	for _, e := range exitCodes {
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
	case exitcode.RolledBack, exitcode.Busy, exitRunFailed, exitRunNoExec, exitRunNotFound:
		return code
	}
	switch {
	case errors.Is(err, store.ErrNotFound), errors.Is(err, store.ErrNoStore), errors.Is(err, errNoProcess):
		return exitNotFound
	case errors.Is(err, store.ErrInvalidName), errors.Is(err, store.ErrAmbiguous):
		return exitcode.Usage
	case code == exitcode.Failed && errors.Is(err, context.Canceled):
		return exitInterrupted
	}
	return code
}
