package journal

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/testreq"
)

const testID = "checkpoint-4242-0123456789abcdef"

func header() Header {
	return Header{V: Version, Op: OpCheckpoint, ID: testID, Boot: "38ee6935-5739-4d86-aed6-d886d4953c23",
		Time: time.Date(2026, 11, 25, 5, 0, 0, 0, time.UTC), Owner: Proc{PID: 4242, Start: 100}, Session: 4000, Root: 777,
		Tree: []Proc{{PID: 777, Start: 50}, {PID: 778, Start: 51}}, CUDA: []int{778},
		Staging: "/dev/shm/ptxmig/" + testID, Store: "/var/lib/ptxmig", Image: "job-1",
		Steps: named("quiesce", "lock", "checkpoint", "detach", "dump", "store", "finish")}
}

func named(names ...string) []Step {
	out := make([]Step, len(names))
	for i, n := range names {
		out[i] = Step{Name: n}
	}
	return out
}

func line(t *testing.T, r any) string {
	t.Helper()
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	return string(b) + "\n"
}

func begin(t *testing.T, mod func(h *Header)) string {
	h := header()
	if mod != nil {
		mod(&h)
	}
	return line(t, Record{T: TBegin, Begin: &h})
}

// TestParseValid: a whole journal, as an operation writes it, reads back.
func TestParseValid(t *testing.T) {
	j := begin(t, nil) +
		`{"t":"guardian","proc":{"pid":4300,"start":101}}` + "\n" +
		`{"t":"step","step":"quiesce","phase":"begin","at":5}` + "\n" +
		`{"t":"step","step":"quiesce","phase":"done"}` + "\n" +
		`{"t":"step","step":"lock","phase":"begin","at":6}` + "\n" +
		`{"t":"step","step":"lock","phase":"done"}` + "\n" +
		`{"t":"step","step":"dump","phase":"begin","at":7}` + "\n" +
		`{"t":"helper","proc":{"pid":4301,"start":102}}` + "\n" +
		`{"t":"step","step":"dump","phase":"failed"}` + "\n" +
		`{"t":"step","step":"lock","phase":"undo"}` + "\n" +
		`{"t":"step","step":"lock","phase":"undone"}` + "\n" +
		`{"t":"attempt","err":"driver gone"}` + "\n" +
		`{"t":"step","step":"store"` // cut short: ignored
	st, err := Parse([]byte(j), testID+Ext)
	if err != nil {
		t.Fatal(err)
	}
	if !st.Truncated || st.Guardian == nil || st.Guardian.PID != 4300 || len(st.Helpers) != 1 || len(st.Attempts) != 1 {
		t.Fatalf("state %+v", st)
	}
	if !st.Began("dump") || st.Step("dump").Done || !st.Step("dump").Failed || st.Step("dump").At != 7 || st.Began("store") {
		t.Fatalf("dump step %+v", st.Step("dump"))
	}
	if l := st.Step("lock"); !l.Done || !l.Undone || st.Committed || st.AllDone() || st.Outcome != "" {
		t.Fatalf("lock %+v, state %+v", l, st)
	}
}

// TestParseSessionOutsideNamespace: ptxmig started from a session whose leader lives outside its
// PID namespace (docker exec, CI runners) sees session 0; its journals are valid.
func TestParseSessionOutsideNamespace(t *testing.T) {
	if _, err := Parse([]byte(begin(t, func(h *Header) { h.Session = 0 })), testID+Ext); err != nil {
		t.Fatal(err)
	}
}

// TestParseRefusesHostileJournals: every malformed, inconsistent or out-of-range journal is
// refused (ErrInvalid) and names the problem; none is half-applied.
func TestParseRefusesHostileJournals(t *testing.T) {
	b := begin(t, nil)
	step := func(name, phase string, at int64) string {
		return line(t, Record{T: TStep, Step: name, Phase: phase, At: at})
	}
	tests := []struct {
		name, journal, want string
	}{
		{"not JSON", "hello\n", "invalid character"},
		{"not an object", "[1,2]\n", "cannot unmarshal"},
		{"two objects on a line", strings.TrimSuffix(b, "\n") + `{"t":"commit"}` + "\n", "trailing data"},
		{"unknown field", b + `{"t":"commit","force":true}` + "\n", "unknown field"},
		{"unknown record type", b + `{"t":"exec","err":"rm -rf /"}` + "\n", "unknown record type"},
		{"field of another record type", b + `{"t":"commit","step":"dump"}` + "\n", "commit record with field"},
		{"begin not first", `{"t":"commit"}` + "\n" + b, "begin comes first"},
		{"begin twice", b + b, "begin comes first"},
		{"begin without body", `{"t":"begin"}` + "\n", "without the operation"},
		{"future version", begin(t, func(h *Header) { h.V = Version + 1 }), fmt.Sprintf("version %d", Version+1)},
		{"unknown operation", begin(t, func(h *Header) { h.Op = "format-disk"; h.ID = "format-disk-1-0123456789abcdef" }), "unknown operation"},
		{"id of another operation kind", begin(t, func(h *Header) { h.Op = OpRestore }), "bad id"},
		{"id with a path", begin(t, func(h *Header) { h.ID = "checkpoint-1-../../etc" }), "bad id"},
		{"file of another id", begin(t, func(h *Header) {
			h.ID = "checkpoint-4242-fedcba9876543210"
			h.Staging = "/dev/shm/ptxmig/" + h.ID
		}), "holds operation"},
		{"bad boot id", begin(t, func(h *Header) { h.Boot = "x" }), "bad boot id"},
		{"no time", begin(t, func(h *Header) { h.Time = time.Time{} }), "no time"},
		{"owner pid 1", begin(t, func(h *Header) { h.Owner = Proc{PID: 1, Start: 5} }), "bad owner"},
		{"owner without start", begin(t, func(h *Header) { h.Owner.Start = 0 }), "bad owner"},
		{"negative session", begin(t, func(h *Header) { h.Session = -1 }), "bad session"},
		{"root pid 1", begin(t, func(h *Header) { h.Root = 1; h.Tree[0].PID = 1 }), "bad root"},
		{"root beyond PID_MAX", begin(t, func(h *Header) { h.Root = 1 << 23; h.Tree[0].PID = 1 << 23 }), "bad root"},
		{"empty tree", begin(t, func(h *Header) { h.Tree = nil }), "tree of 0"},
		{"tree not at the root", begin(t, func(h *Header) { h.Tree[0].PID = 779 }), "does not start at the root"},
		{"tree pid 1 (init)", begin(t, func(h *Header) { h.Tree[1].PID = 1 }), "bad or repeated tree pid 1"},
		{"tree pid negative", begin(t, func(h *Header) { h.Tree[1].PID = -5 }), "bad or repeated tree pid -5"},
		{"repeated tree pid", begin(t, func(h *Header) { h.Tree[1].PID = 777 }), "bad or repeated tree pid 777"},
		{"CUDA pid outside the tree", begin(t, func(h *Header) { h.CUDA = []int{1234} }), "not in the tree"},
		{"staging not absolute", begin(t, func(h *Header) { h.Staging = "ptxmig/" + testID }), "bad staging"},
		{"staging with ..", begin(t, func(h *Header) { h.Staging = "/dev/shm/ptxmig/../../" + testID }), "bad staging"},
		{"staging not named by the id", begin(t, func(h *Header) { h.Staging = "/etc" }), "bad staging"},
		{"staging at the root", begin(t, func(h *Header) { h.Staging = "/" + testID }), "bad staging"},
		{"staging with a control character", begin(t, func(h *Header) { h.Staging = "/dev/shm/\x1b[2J/" + testID }), "bad staging"},
		{"store relative", begin(t, func(h *Header) { h.Store = "store" }), "bad store"},
		{"image name with a path", begin(t, func(h *Header) { h.Image = "../../x" }), "bad image"},
		{"no steps", begin(t, func(h *Header) { h.Steps = nil }), "0 steps"},
		{"bad step name", begin(t, func(h *Header) { h.Steps = named("rm -rf") }), "bad or repeated step"},
		{"repeated step", begin(t, func(h *Header) { h.Steps = named("dump", "dump") }), "bad or repeated step"},
		{"bad step kind", begin(t, func(h *Header) { h.Steps[0].Kind = "../x" }), "bad kind"},
		{"step data too long", begin(t, func(h *Header) { h.Steps[0].Data = []byte(`"` + strings.Repeat("x", MaxStepData) + `"`) }), "bad data"},
		{"journal of version 1", `{"t":"begin","begin":{"v":1,"op":"checkpoint","steps":["dump"]}}` + "\n", "version 1 (written by another ptxmig), this ptxmig reads 2"},
		{"step not planned", b + step("format", PhaseBegin, 5), "not one of the operation's"},
		{"step done before it began", b + step("dump", PhaseDone, 0), "out of order"},
		{"step began twice", b + step("dump", PhaseBegin, 5) + step("dump", PhaseBegin, 6), "began twice"},
		{"step begin without time", b + step("dump", PhaseBegin, 0), "without a time"},
		{"time on a done", b + step("dump", PhaseBegin, 5) + `{"t":"step","step":"dump","phase":"done","at":9}` + "\n", "with a time"},
		{"unknown phase", b + step("dump", PhaseBegin, 5) + step("dump", "skip", 0), "unknown phase"},
		{"undone before undo", b + step("dump", PhaseBegin, 5) + step("dump", PhaseUndone, 0), "out of order"},
		{"done after undo", b + step("dump", PhaseBegin, 5) + step("dump", PhaseUndo, 0) + step("dump", PhaseDone, 0), "out of order"},
		{"guardian twice", b + `{"t":"guardian","proc":{"pid":9,"start":1}}` + "\n" + `{"t":"guardian","proc":{"pid":9,"start":1}}` + "\n", "repeated guardian"},
		{"guardian pid 1", b + `{"t":"guardian","proc":{"pid":1,"start":1}}` + "\n", "bad or repeated guardian"},
		{"helper pid 0", b + `{"t":"helper","proc":{"pid":0,"start":1}}` + "\n", "bad helper"},
		{"helper without proc", b + `{"t":"helper"}` + "\n", "bad helper"},
		{"commit twice", b + `{"t":"commit"}` + "\n" + `{"t":"commit"}` + "\n", "second commit"},
		{"unknown outcome", b + `{"t":"end","outcome":"maybe"}` + "\n", "unknown outcome"},
		{"record after the end", b + `{"t":"end","outcome":"committed"}` + "\n" + `{"t":"commit"}` + "\n", "after the end"},
		{"attempt error too long", b + line(t, Record{T: TAttempt, Err: strings.Repeat("x", 5000)}), "too long"},
		{"line too long", b + `{"t":"attempt","err":"` + strings.Repeat("x", MaxLine) + `"}` + "\n", "longer than"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st, err := Parse([]byte(tt.journal), testID+Ext)
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Parse = %+v, %v; want ErrInvalid mentioning %q", st, err, tt.want)
			}
		})
	}
	t.Run("too many records", func(t *testing.T) {
		j := b + strings.Repeat(`{"t":"helper","proc":{"pid":9,"start":1}}`+"\n", MaxHelpers+1)
		if _, err := Parse([]byte(j), testID+Ext); !errors.Is(err, ErrInvalid) {
			t.Fatalf("%d helpers: %v", MaxHelpers+1, err)
		}
		j = b + strings.Repeat(`{"t":"step","step":"dump","phase":"undo"}`+"\n", MaxRecords)
		if _, err := Parse([]byte(j), testID+Ext); !errors.Is(err, ErrInvalid) {
			t.Fatalf("%d records: %v", MaxRecords+1, err)
		}
	})
	t.Run("too large", func(t *testing.T) {
		if _, err := Parse(make([]byte, MaxSize+1), testID+Ext); !errors.Is(err, ErrInvalid) {
			t.Fatalf("%d bytes: %v", MaxSize+1, err)
		}
	})
	for _, j := range []string{"", `{"t":"begin","begin":{"v":1`} {
		if _, err := Parse([]byte(j), testID+Ext); !errors.Is(err, ErrNoBegin) {
			t.Errorf("Parse(%q) = %v, want ErrNoBegin (ptxmig died while creating it)", j, err)
		}
	}
}

// TestWriterRoundTrip: Create locks and writes the header, Append adds records, End removes the
// file; a second locker cannot take the lock while the writer lives.
func TestWriterRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "journal")
	h := header()
	h.Staging = ""
	w, err := Create(dir, h)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("journal directory %v %v, want 0700", fi.Mode(), err)
	}
	if err := w.Append(Record{T: TStep, Step: "dump", Phase: PhaseBegin, At: 3}, Record{T: THelper, Proc: &Proc{PID: 99, Start: 4}}); err != nil {
		t.Fatal(err)
	}
	if err := w.Append(Record{T: TStep, Step: "dump", Phase: PhaseBegin, At: 3}); err != nil {
		t.Fatal(err) // the writer does not validate; Read does
	}
	paths, err := List(dir)
	if err != nil || len(paths) != 1 || paths[0] != w.Path() {
		t.Fatalf("List = %v, %v", paths, err)
	}
	if _, err := Read(w.Path()); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a journal with a step begun twice reads as %v", err)
	}
	f, err := Open(w.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if ok, err := TryLock(f); ok || err != nil {
		t.Fatalf("TryLock while the writer lives = %v, %v", ok, err)
	}
	if err := w.End(Committed, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(w.Path()); !os.IsNotExist(err) {
		t.Fatalf("journal still there after End: %v", err)
	}
	if ok, err := TryLock(f); !ok || err != nil {
		t.Fatalf("TryLock after End = %v, %v", ok, err)
	}
	if _, err := Create(dir, Header{V: Version, Op: "mkfs"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Create with a bad header: %v", err)
	}
}

// TestOpenRefusesUnsafeFiles: a journal must be a regular file of root's own, mode 0600, one
// link, in a 0700 directory of root's own; a symlink, a FIFO, a hard link, a readable or foreign
// file, or an open directory is refused before a byte is read.
func TestOpenRefusesUnsafeFiles(t *testing.T) {
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "needs root to make files owned by another user")
	}
	dir := filepath.Join(t.TempDir(), "journal")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	good := filepath.Join(dir, testID+Ext)
	h := header()
	if err := os.WriteFile(good, []byte(begin(t, func(x *Header) { *x = h })), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Read(good); err != nil {
		t.Fatalf("a good journal: %v", err)
	}
	mk := func(name string, f func(p string) error) string {
		p := filepath.Join(dir, name+Ext)
		if err := f(p); err != nil {
			t.Fatal(err)
		}
		return p
	}
	body := []byte(begin(t, nil))
	cases := map[string]string{
		"symlink":      mk("checkpoint-1-0000000000000001", func(p string) error { return os.Symlink(good, p) }),
		"fifo":         mk("checkpoint-1-0000000000000002", func(p string) error { return syscall.Mkfifo(p, 0o600) }),
		"hard link":    mk("checkpoint-1-0000000000000003", func(p string) error { return os.Link(good, p) }),
		"mode 0644":    mk("checkpoint-1-0000000000000004", func(p string) error { return os.WriteFile(p, body, 0o644) }),
		"foreign file": mk("checkpoint-1-0000000000000005", func(p string) error { return errors.Join(os.WriteFile(p, body, 0o600), os.Chown(p, 65534, 65534)) }),
		"directory":    mk("checkpoint-1-0000000000000006", func(p string) error { return os.Mkdir(p, 0o700) }),
		"huge":         mk("checkpoint-1-0000000000000007", func(p string) error { return errors.Join(os.WriteFile(p, body, 0o600), os.Truncate(p, MaxSize+1)) }),
	}
	for what, p := range cases {
		if _, err := Read(p); !errors.Is(err, ErrUnsafe) {
			t.Errorf("%s: Read = %v, want ErrUnsafe", what, err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "notes.txt"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if paths, err := List(dir); err != nil || len(paths) != 1+len(cases) {
		t.Errorf("List = %d paths, %v; want only the *.journal entries with journal ids", len(paths), err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := Read(good); !errors.Is(err, ErrUnsafe) {
		t.Errorf("a journal in a 0755 directory: %v, want ErrUnsafe", err)
	}
	if _, err := List(dir); !errors.Is(err, ErrUnsafe) {
		t.Errorf("List of a 0755 directory: %v, want ErrUnsafe", err)
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	if _, err := List(link); !errors.Is(err, ErrUnsafe) {
		t.Errorf("List of a symlinked directory: %v, want ErrUnsafe", err)
	}
}
