// Package journal records every operation that touches a process (checkpoint, restore, migrate)
// and each of its steps as it happens, so that if ptxmig dies before the operation commits, its
// guardian (or `ptxmig recover`) knows exactly what to roll back or finish.
//
// A journal is one file, DIR/ID.journal (DIR is /run/ptxmig/journal or $PTXMIG_JOURNAL_DIR, a
// directory only root can use), of JSON lines. The first line is the operation ("begin": its
// kind, owner, process tree with start times, CUDA processes, staging directory, image, the
// steps it plans); then, in order, "guardian" (the guardian process), "step" records (phase
// begin before the step's action, done/failed after it, undo/undone/undo-failed during an
// in-process rollback), "helper" (a CRIU process that must not outlive the operation),
// "commit" (the operation's result is final: the image is stored, the restored tree runs),
// "attempt" (a recovery that did not complete) and "end" (the outcome, just before the file is
// removed). The owner holds an flock(2) on the file for its whole life: a journal whose lock can
// be taken belongs to a dead ptxmig.
//
// A journal is input like any other: Read refuses a file that is not a regular file of the
// caller's own (0600, one link, no symlink), a line that is not a known record with known
// fields and valid values, a record out of order, and anything past the size limits. Only a
// last line cut short (ptxmig died while writing it) is tolerated, and ignored.
package journal

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/store"
)

// Version of the journal format. Version 2 records each planned step's kind and the data its
// recovery needs (Step); a journal of another version is refused, and so kept aside, by a
// recovery: its steps cannot be rebuilt.
const Version = 2

// DefaultDir is where journals live unless $PTXMIG_JOURNAL_DIR says otherwise.
const DefaultDir = "/run/ptxmig/journal"

// Ext ends every journal's file name.
const Ext = ".journal"

// Limits on what a journal may hold.
const (
	MaxSize     = 8 << 20 // the whole file
	MaxLine     = 4 << 20 // one record (a begin record lists the tree)
	MaxRecords  = 10000
	MaxTree     = 1 << 16
	MaxSteps    = 32
	MaxStepData = 1 << 20 // one step's data
	MaxHelpers  = 64
	MaxAttempts = 100
	maxErrText  = 4096
	maxPID      = 1 << 22 // PID_MAX_LIMIT
)

// Kinds of operations.
const (
	OpCheckpoint = "checkpoint"
	OpRestore    = "restore"
	OpMigrate    = "migrate"
)

// Record types.
const (
	TBegin    = "begin"
	TGuardian = "guardian"
	TStep     = "step"
	THelper   = "helper"
	TCommit   = "commit"
	TAttempt  = "attempt"
	TEnd      = "end"
)

// Phases of a step record.
const (
	PhaseBegin      = "begin"
	PhaseDone       = "done"
	PhaseFailed     = "failed"
	PhaseUndo       = "undo"
	PhaseUndone     = "undone"
	PhaseUndoFailed = "undo-failed"
)

// Outcomes of an end record.
const (
	Committed  = "committed"   // the operation completed
	RolledBack = "rolled-back" // it failed and its own rollback completed
	Failed     = "failed"      // it failed and its rollback did not complete (the error said so)
	Recovered  = "recovered"   // ptxmig died; the guardian or recover rolled it back or finished it
)

// ErrInvalid marks a journal that fails validation.
var ErrInvalid = errors.New("invalid journal")

// ErrNoBegin marks a journal without a complete begin record: ptxmig died while creating it,
// before anything was done.
var ErrNoBegin = fmt.Errorf("%w: no complete begin record", ErrInvalid)

// ErrUnsafe marks a journal file or directory that another user could have written or redirected.
var ErrUnsafe = errors.New("unsafe journal location")

// Dir is the journal directory in use.
func Dir() string {
	if d := os.Getenv("PTXMIG_JOURNAL_DIR"); d != "" {
		return d
	}
	return DefaultDir
}

// Proc names a process across pid reuse: its pid and its start time (clock ticks after boot,
// /proc/PID/stat field 22; 0 when unknown, and then nothing is done to the pid by identity).
type Proc struct {
	PID   int    `json:"pid"`
	Start uint64 `json:"start"`
}

// Header is the first record: the operation.
type Header struct {
	V            int       `json:"v"`
	Op           string    `json:"op"`
	ID           string    `json:"id"`
	Boot         string    `json:"boot"` // boot id: pids mean nothing after a reboot
	Time         time.Time `json:"time"`
	Owner        Proc      `json:"owner"`   // the ptxmig process
	Session      int       `json:"session"` // its session (the CRIU it starts shares it)
	Root         int       `json:"root"`    // the process (tree root) operated on
	Tree         []Proc    `json:"tree"`    // root first
	CUDA         []int     `json:"cuda,omitempty"`
	LeaveRunning bool      `json:"leave_running,omitempty"`
	Staging      string    `json:"staging,omitempty"` // DIR/ID: removed when the operation ends, whatever happened
	Store        string    `json:"store,omitempty"`
	Image        string    `json:"image,omitempty"`
	Steps        []Step    `json:"steps"` // in order
	// CRIUStall: how long the operation's CRIU may make no progress before it is killed (0: no
	// bound); a guardian holds CRIU to the same bound.
	CRIUStall time.Duration `json:"criu_stall_ns,omitempty"`
}

// Step is one planned step of an operation: its name, its kind (what a recovery rebuilds the
// step's undo and finish from: the kinds registered with op.RegisterKind; "" for a step with
// nothing to undo or finish), whether it commits the operation, and the data its kind needs.
type Step struct {
	Name   string          `json:"name"`
	Kind   string          `json:"kind,omitempty"`
	Commit bool            `json:"commit,omitempty"`
	Data   json.RawMessage `json:"data,omitempty"`
}

// Plan returns the planned step named name (nil when the operation has none).
func (h *Header) Plan(name string) *Step {
	for i := range h.Steps {
		if h.Steps[i].Name == name {
			return &h.Steps[i]
		}
	}
	return nil
}

// MaxCRIUStall is the longest stall bound a journal may record.
const MaxCRIUStall = 24 * time.Hour

// Record is one line.
type Record struct {
	T     string  `json:"t"`
	Begin *Header `json:"begin,omitempty"`
	Step  string  `json:"step,omitempty"`
	Phase string  `json:"phase,omitempty"`
	At    int64   `json:"at,omitempty"` // CLOCK_BOOTTIME ns, on a step's begin
	Proc  *Proc   `json:"proc,omitempty"`
	// Outcome of an end record; Err of an attempt (or of an end that failed).
	Outcome string `json:"outcome,omitempty"`
	Err     string `json:"err,omitempty"`
}

// StepState is what the journal says of one step.
type StepState struct {
	Name                  string
	Began, Done, Failed   bool
	UndoBegan, Undone     bool
	At                    time.Duration // CLOCK_BOOTTIME when it began
	UndoFailed            bool
	beganIndex, doneIndex int
}

// State is a parsed, validated journal.
type State struct {
	Header    Header
	Guardian  *Proc
	Helpers   []Proc
	Steps     []*StepState // in the order they began
	Committed bool
	Outcome   string // of the end record; "" while the operation runs (or its owner died)
	Attempts  []string
	Truncated bool // the last line was cut short and ignored
	Records   int
}

// Step returns the state of the named step (nil when it never began).
func (s *State) Step(name string) *StepState {
	for _, st := range s.Steps {
		if st.Name == name {
			return st
		}
	}
	return nil
}

// Began reports whether the named step began.
func (s *State) Began(name string) bool { return s.Step(name) != nil }

// AllDone reports whether every planned step is done.
func (s *State) AllDone() bool {
	for _, n := range s.Header.Steps {
		if st := s.Step(n.Name); st == nil || !st.Done {
			return false
		}
	}
	return true
}

var (
	idRE   = regexp.MustCompile(`^(checkpoint|restore|migrate)-[1-9][0-9]{0,6}-[0-9a-f]{16}$`)
	bootRE = regexp.MustCompile(`^[0-9a-f-]{16,64}$`)
	stepRE = regexp.MustCompile(`^[a-z][a-z0-9-]{0,31}$`)
	kindRE = regexp.MustCompile(`^[a-z][a-z0-9-]{0,31}(\.[a-z][a-z0-9-]{0,31})?$`)
)

// NewID makes a journal id for an operation of kind op by process pid.
func NewID(op string, pid int) (string, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return fmt.Sprintf("%s-%d-%s", op, pid, hex.EncodeToString(b[:])), nil
}

// ValidID reports whether id is a journal id (and so a safe file and directory name).
func ValidID(id string) bool { return idRE.MatchString(id) }

func validPID(pid int) bool { return pid > 1 && pid < maxPID }

func validProc(p Proc) error {
	if !validPID(p.PID) {
		return fmt.Errorf("pid %d out of range", p.PID)
	}
	return nil
}

func cleanAbs(p string) bool {
	return p != "" && filepath.IsAbs(p) && filepath.Clean(p) == p && len(p) < 4096 &&
		!strings.ContainsFunc(p, func(r rune) bool { return r < ' ' || r == 0x7f })
}

// Validate checks a header.
func (h *Header) Validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: begin: %s", ErrInvalid, fmt.Sprintf(format, a...))
	}
	switch {
	case h.V != Version:
		return bad("version %d, this ptxmig reads %d", h.V, Version)
	case h.Op != OpCheckpoint && h.Op != OpRestore && h.Op != OpMigrate:
		return bad("unknown operation %q", h.Op)
	case !idRE.MatchString(h.ID) || !strings.HasPrefix(h.ID, h.Op+"-"):
		return bad("bad id %q", h.ID)
	case !bootRE.MatchString(h.Boot):
		return bad("bad boot id %q", h.Boot)
	case h.Time.IsZero():
		return bad("no time")
	case validProc(h.Owner) != nil || h.Owner.Start == 0:
		return bad("bad owner %+v", h.Owner)
	case h.Session < 0 || h.Session >= maxPID: // 0: the session's leader is outside this PID namespace
		return bad("bad session %d", h.Session)
	case !validPID(h.Root):
		return bad("bad root pid %d", h.Root)
	case len(h.Tree) == 0 || len(h.Tree) > MaxTree:
		return bad("tree of %d processes", len(h.Tree))
	case h.Tree[0].PID != h.Root:
		return bad("tree does not start at the root %d", h.Root)
	case h.Staging != "" && (!cleanAbs(h.Staging) || filepath.Base(h.Staging) != h.ID || filepath.Dir(h.Staging) == "/"):
		return bad("bad staging directory %q", h.Staging)
	case h.Store != "" && !cleanAbs(h.Store):
		return bad("bad store %q", h.Store)
	case h.Image != "" && store.ValidateName(h.Image) != nil:
		return bad("bad image name %q", h.Image)
	case len(h.Steps) == 0 || len(h.Steps) > MaxSteps:
		return bad("%d steps", len(h.Steps))
	case h.CRIUStall < 0 || h.CRIUStall > MaxCRIUStall:
		return bad("CRIU stall bound %s", h.CRIUStall)
	}
	seen := map[int]bool{}
	for _, p := range h.Tree {
		if err := validProc(p); err != nil || seen[p.PID] {
			return bad("bad or repeated tree pid %d", p.PID)
		}
		seen[p.PID] = true
	}
	cuda := map[int]bool{}
	for _, pid := range h.CUDA {
		if !seen[pid] || cuda[pid] {
			return bad("CUDA pid %d not in the tree, or repeated", pid)
		}
		cuda[pid] = true
	}
	for i, s := range h.Steps {
		if !stepRE.MatchString(s.Name) || h.Plan(s.Name) != &h.Steps[i] {
			return bad("bad or repeated step %q", s.Name)
		}
		if s.Kind != "" && !kindRE.MatchString(s.Kind) {
			return bad("step %s: bad kind %q", s.Name, s.Kind)
		}
		if len(s.Data) > MaxStepData || (len(s.Data) > 0 && !json.Valid(s.Data)) {
			return bad("step %s: bad data (%d bytes)", s.Name, len(s.Data))
		}
	}
	return nil
}

// Parse validates a journal's bytes; name is its file name (ID.journal).
func Parse(data []byte, name string) (*State, error) {
	if len(data) > MaxSize {
		return nil, fmt.Errorf("%w: %d bytes, more than %d", ErrInvalid, len(data), MaxSize)
	}
	st := &State{}
	lines := bytes.Split(data, []byte{'\n'})
	if last := lines[len(lines)-1]; len(last) > 0 {
		st.Truncated = true // no newline: cut short while written
	}
	lines = lines[:len(lines)-1]
	if len(lines) == 0 {
		return nil, ErrNoBegin
	}
	if len(lines) > MaxRecords {
		return nil, fmt.Errorf("%w: more than %d records", ErrInvalid, MaxRecords)
	}
	for i, line := range lines {
		if err := st.apply(line, i, name); errors.Is(err, ErrInvalid) {
			return nil, fmt.Errorf("record %d: %w", i+1, err)
		} else if err != nil {
			return nil, fmt.Errorf("%w: record %d: %v", ErrInvalid, i+1, err)
		}
	}
	return st, nil
}

func decode(line []byte) (*Record, error) {
	if len(line) > MaxLine {
		return nil, fmt.Errorf("longer than %d bytes", MaxLine)
	}
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	var r Record
	if err := dec.Decode(&r); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("trailing data")
	}
	return &r, nil
}

// beginVersion is the format version a begin record claims (0 when it claims none), read
// leniently: a journal of another version may not decode as this one.
func beginVersion(line []byte) int {
	var r struct {
		T     string `json:"t"`
		Begin struct {
			V int `json:"v"`
		} `json:"begin"`
	}
	if len(line) > MaxLine || json.Unmarshal(line, &r) != nil || r.T != TBegin {
		return 0
	}
	return r.Begin.V
}

// only refuses a record that carries fields other than allowed (besides "t").
func (r *Record) only(allowed ...string) error {
	set := map[string]bool{
		"begin": r.Begin != nil, "step": r.Step != "", "phase": r.Phase != "", "at": r.At != 0,
		"proc": r.Proc != nil, "outcome": r.Outcome != "", "err": r.Err != "",
	}
	for f, present := range set {
		if present && !slices.Contains(allowed, f) {
			return fmt.Errorf("%s record with field %q", r.T, f)
		}
	}
	return nil
}

func (st *State) apply(line []byte, i int, name string) error {
	r, err := decode(line)
	if err != nil {
		if v := beginVersion(line); i == 0 && v != 0 && v != Version {
			return fmt.Errorf("%w: begin: version %d (written by another ptxmig), this ptxmig reads %d", ErrInvalid, v, Version)
		}
		return err
	}
	st.Records++
	if st.Outcome != "" {
		return errors.New("record after the end")
	}
	if (i == 0) != (r.T == TBegin) {
		return fmt.Errorf("%q record at position %d (begin comes first, once)", r.T, i+1)
	}
	switch r.T {
	case TBegin:
		if err := r.only("begin"); err != nil {
			return err
		}
		if r.Begin == nil {
			return errors.New("begin record without the operation")
		}
		if err := r.Begin.Validate(); err != nil {
			return err
		}
		if name != "" && name != r.Begin.ID+Ext {
			return fmt.Errorf("file %q holds operation %q", name, r.Begin.ID)
		}
		st.Header = *r.Begin
	case TGuardian:
		if err := r.only("proc"); err != nil {
			return err
		}
		if r.Proc == nil || validProc(*r.Proc) != nil || st.Guardian != nil {
			return errors.New("bad or repeated guardian")
		}
		p := *r.Proc
		st.Guardian = &p
	case THelper:
		if err := r.only("proc"); err != nil {
			return err
		}
		if r.Proc == nil || validProc(*r.Proc) != nil || len(st.Helpers) >= MaxHelpers {
			return errors.New("bad helper, or too many")
		}
		st.Helpers = append(st.Helpers, *r.Proc)
	case TStep:
		if err := r.only("step", "phase", "at"); err != nil {
			return err
		}
		return st.applyStep(r, i)
	case TCommit:
		if err := r.only(); err != nil {
			return err
		}
		if st.Committed {
			return errors.New("second commit")
		}
		st.Committed = true
	case TAttempt:
		if err := r.only("err"); err != nil {
			return err
		}
		if len(r.Err) > maxErrText || len(st.Attempts) >= MaxAttempts {
			return errors.New("attempt error too long, or too many attempts")
		}
		st.Attempts = append(st.Attempts, r.Err)
	case TEnd:
		if err := r.only("outcome", "err"); err != nil {
			return err
		}
		switch r.Outcome {
		case Committed, RolledBack, Failed, Recovered:
		default:
			return fmt.Errorf("unknown outcome %q", r.Outcome)
		}
		if len(r.Err) > maxErrText {
			return errors.New("end error too long")
		}
		st.Outcome = r.Outcome
	default:
		return fmt.Errorf("unknown record type %q", r.T)
	}
	return nil
}

func (st *State) applyStep(r *Record, i int) error {
	if st.Header.Plan(r.Step) == nil {
		return fmt.Errorf("step %q is not one of the operation's", r.Step)
	}
	s := st.Step(r.Step)
	if r.Phase != PhaseBegin && r.At != 0 {
		return fmt.Errorf("step %s %s with a time", r.Step, r.Phase)
	}
	switch r.Phase {
	case PhaseBegin:
		if s != nil {
			return fmt.Errorf("step %s began twice", r.Step)
		}
		if r.At <= 0 {
			return fmt.Errorf("step %s began without a time", r.Step)
		}
		st.Steps = append(st.Steps, &StepState{Name: r.Step, Began: true, At: time.Duration(r.At), beganIndex: i})
		return nil
	case PhaseDone, PhaseFailed:
		if s == nil || s.Done || s.Failed || s.UndoBegan {
			return fmt.Errorf("step %s %s out of order", r.Step, r.Phase)
		}
		s.Done, s.Failed, s.doneIndex = r.Phase == PhaseDone, r.Phase == PhaseFailed, i
	case PhaseUndo:
		if s == nil || s.UndoBegan {
			return fmt.Errorf("undo of step %s out of order", r.Step)
		}
		s.UndoBegan = true
	case PhaseUndone, PhaseUndoFailed:
		if s == nil || !s.UndoBegan || s.Undone || s.UndoFailed {
			return fmt.Errorf("step %s %s out of order", r.Step, r.Phase)
		}
		s.Undone, s.UndoFailed = r.Phase == PhaseUndone, r.Phase == PhaseUndoFailed
	default:
		return fmt.Errorf("unknown phase %q", r.Phase)
	}
	return nil
}

// checkDir refuses a journal directory another user could write: it must be a directory (not a
// symlink) of the caller's own, mode 0700.
func checkDir(dir string) error {
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return err
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("%s: %w: not a directory (or a symlink)", dir, ErrUnsafe)
	case int(st.Uid) != os.Geteuid():
		return fmt.Errorf("%s: %w: owned by uid %d", dir, ErrUnsafe, st.Uid)
	case st.Mode&0o077 != 0:
		return fmt.Errorf("%s: %w: mode %04o (want 0700)", dir, ErrUnsafe, st.Mode&0o7777)
	}
	return nil
}

// List returns the journals in dir, by path, sorted. A missing dir holds none. Other names are
// skipped.
func List(dir string) ([]string, error) {
	if err := checkDir(dir); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
		return nil, err
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if id, ok := strings.CutSuffix(e.Name(), Ext); ok && idRE.MatchString(id) {
			out = append(out, filepath.Join(dir, e.Name()))
		}
	}
	return out, nil
}

// Open opens a journal for reading and locking, refusing anything but a regular file of the
// caller's own, mode 0600, with one link, in a safe directory.
func Open(path string) (*os.File, error) {
	if err := checkDir(filepath.Dir(path)); err != nil {
		return nil, err
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			return nil, fmt.Errorf("%s: %w: a symlink", path, ErrUnsafe)
		}
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		f.Close()
		return nil, err
	}
	var why string
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		why = "not a regular file"
	case int(st.Uid) != os.Geteuid():
		why = fmt.Sprintf("owned by uid %d", st.Uid)
	case st.Mode&0o077 != 0:
		why = fmt.Sprintf("mode %04o (want 0600)", st.Mode&0o7777)
	case st.Nlink != 1:
		why = fmt.Sprintf("%d links", st.Nlink)
	case st.Size > MaxSize:
		why = fmt.Sprintf("%d bytes, more than %d", st.Size, MaxSize)
	}
	if why != "" {
		f.Close()
		return nil, fmt.Errorf("%s: %w: %s", path, ErrUnsafe, why)
	}
	return f, nil
}

// ReadFrom reads and validates the journal open as f.
func ReadFrom(f *os.File) (*State, error) {
	b, err := io.ReadAll(io.LimitReader(io.NewSectionReader(f, 0, MaxSize+1), MaxSize+1))
	if err != nil {
		return nil, err
	}
	st, err := Parse(b, filepath.Base(f.Name()))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", f.Name(), err)
	}
	return st, nil
}

// Read opens, reads and validates the journal at path.
func Read(path string) (*State, error) {
	f, err := Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return ReadFrom(f)
}

// TryLock takes the journal's lock without waiting; false when another process holds it (its
// owner is alive, or a guardian or recover is working on it).
func TryLock(f *os.File) (bool, error) {
	err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	if errors.Is(err, unix.EWOULDBLOCK) {
		return false, nil
	}
	return err == nil, err
}

// Lock takes the journal's lock, waiting up to wait.
func Lock(f *os.File, wait time.Duration) (bool, error) {
	deadline := time.Now().Add(wait)
	for {
		ok, err := TryLock(f)
		if ok || err != nil || time.Now().After(deadline) {
			return ok, err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Same reports whether f is still the file at its path (not removed or replaced meanwhile).
func Same(f *os.File) bool {
	var a, b unix.Stat_t
	if unix.Fstat(int(f.Fd()), &a) != nil || unix.Lstat(f.Name(), &b) != nil {
		return false
	}
	return a.Dev == b.Dev && a.Ino == b.Ino
}

// AppendTo appends records to the journal open as f (by path, O_APPEND): the guardian and
// recover note their attempts and the end. f must be locked.
func AppendTo(f *os.File, recs ...Record) error {
	fd, err := unix.Open(f.Name(), unix.O_WRONLY|unix.O_APPEND|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: f.Name(), Err: err}
	}
	defer unix.Close(fd)
	for _, r := range recs {
		if err := writeRecord(fd, r); err != nil {
			return err
		}
	}
	return nil
}

// Remove unlinks the journal open (and locked) as f, if it is still the file at its path.
func Remove(f *os.File) error {
	if !Same(f) {
		return nil
	}
	if err := os.Remove(f.Name()); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

func writeRecord(fd int, r Record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	if len(b) > MaxLine {
		return fmt.Errorf("journal record of %d bytes, more than %d", len(b), MaxLine)
	}
	b = append(b, '\n')
	// One write: O_APPEND puts the line at the end in one piece.
	if n, err := unix.Write(fd, b); err != nil || n != len(b) {
		if err == nil {
			err = io.ErrShortWrite
		}
		return fmt.Errorf("write journal: %w", err)
	}
	if err := unix.Fdatasync(fd); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("sync journal: %w", err)
	}
	return nil
}

// Writer is an operation's own journal: created with its header, held locked, appended to as
// the operation goes, removed when it ends.
type Writer struct {
	mu    sync.Mutex
	f     *os.File
	path  string
	ended bool
}

// Create writes a new journal for h in dir (created private if missing) and locks it.
func Create(dir string, h Header) (*Writer, error) {
	if err := h.Validate(); err != nil {
		return nil, err
	}
	if err := oplock.PrivateDir(dir); err != nil {
		return nil, fmt.Errorf("journal directory: %w", err)
	}
	path := filepath.Join(dir, h.ID+Ext)
	fd, err := unix.Open(path, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_APPEND|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, &os.PathError{Op: "create", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		_ = os.Remove(path)
		return nil, fmt.Errorf("lock journal %s: %w", path, err)
	}
	w := &Writer{f: f, path: path}
	if err := writeRecord(fd, Record{T: TBegin, Begin: &h}); err != nil {
		f.Close()
		_ = os.Remove(path)
		return nil, err
	}
	return w, nil
}

// Path is the journal's file.
func (w *Writer) Path() string { return w.path }

// Append writes records (safe for concurrent use).
func (w *Writer) Append(recs ...Record) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.ended {
		return errors.New("journal already ended")
	}
	for _, r := range recs {
		if err := writeRecord(int(w.f.Fd()), r); err != nil {
			return err
		}
	}
	return nil
}

// End records the outcome, removes the journal and releases its lock.
func (w *Writer) End(outcome, errText string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.ended {
		return nil
	}
	w.ended = true
	if len(errText) > maxErrText {
		errText = errText[:maxErrText]
	}
	err := writeRecord(int(w.f.Fd()), Record{T: TEnd, Outcome: outcome, Err: errText})
	if rerr := Remove(w.f); rerr != nil {
		err = errors.Join(err, rerr)
	}
	return errors.Join(err, w.f.Close())
}

// Abandon closes the journal without ending it, as if ptxmig had died (tests).
func (w *Writer) Abandon() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.ended {
		w.ended = true
		w.f.Close()
	}
}
