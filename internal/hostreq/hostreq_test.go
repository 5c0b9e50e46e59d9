package hostreq

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fown"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/regfile"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

// TestDecodeRealDump: a real CRIU dump of a shell that holds a log open for appending, a state
// file open for reading and writing, and a deleted file open for reading lists the log
// (writable, mode checked, size not: CRIU leaves appended logs' size alone), the state file
// (size and mode checked), the shell's executable, and not the deleted file (CRIU keeps it in
// the image).
func TestDecodeRealDump(t *testing.T) {
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "CRIU dump needs root")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, _, err := criu.NewDumper(ctx)
	if err != nil {
		testreq.Skip(t, "criu", "no usable CRIU (run scripts/install-criu.sh): %v", err)
	}
	dir := t.TempDir()
	log, gone, state := filepath.Join(dir, "job.log"), filepath.Join(dir, "gone"), filepath.Join(dir, "state")
	for _, f := range []string{gone, state} {
		if err := os.WriteFile(f, []byte("twelve bytes"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("/bin/sh", "-c", `exec 3>>"$1"; exec 4<"$2"; rm "$2"; exec 5<>"$3"; echo started >&3; while :; do sleep 1; done`,
		"sh", log, gone, state)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); _ = cmd.Wait() }()
	for i := 0; ; i++ {
		if b, _ := os.ReadFile(log); len(b) > 0 {
			break
		}
		if i > 200 {
			t.Fatal("the shell did not start")
		}
		time.Sleep(10 * time.Millisecond)
	}
	images := filepath.Join(dir, "images")
	if err := os.Mkdir(images, 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Dump(ctx, criu.DumpOptions{PID: cmd.Process.Pid, ImagesDir: images, LeaveRunning: true}); err != nil {
		t.Fatal(err)
	}
	files, _ := os.ReadFile(filepath.Join(images, FilesImage))
	remaps, err := os.ReadFile(filepath.Join(images, RemapImage))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	got, err := Decode(files, remaps)
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(got, func(f File) bool { return f.Path == log })
	if i < 0 {
		t.Fatalf("the log is not listed: %+v", got)
	}
	if f := got[i]; !f.Write || !f.Regular() || f.Size != -1 || f.Mode&0o777 == 0 {
		t.Errorf("log entry %+v", f)
	}
	if i := slices.IndexFunc(got, func(f File) bool { return f.Path == state }); i < 0 || !got[i].Write || got[i].Size != 12 || got[i].Mode != unix.S_IFREG|0o600 {
		t.Errorf("state entry: %+v", got)
	}
	if slices.ContainsFunc(got, func(f File) bool { return strings.HasPrefix(f.Path, gone) }) {
		t.Errorf("the deleted file is listed: %+v", got)
	}
	sh, _ := filepath.EvalSymlinks("/bin/sh")
	if !slices.ContainsFunc(got, func(f File) bool { return f.Path == sh && !f.Write }) {
		t.Errorf("the shell's executable %s is not listed: %+v", sh, got)
	}
	// CRIU recorded the shell's build-ID (its default file validation), as this host reads it.
	if id, err := readBuildID(sh); err != nil {
		t.Errorf("build-ID of %s: %v", sh, err)
	} else if i := slices.IndexFunc(got, func(f File) bool { return f.Path == sh }); i >= 0 && got[i].BuildID != hex.EncodeToString(padded(id)) {
		t.Errorf("recorded build-ID %q, the file has %x", got[i].BuildID, id)
	}
	// This host has them all as they were: no problem.
	if p := Check(got, nil); len(p) != 0 {
		t.Errorf("problems on the host the dump came from: %v", p)
	}
	// The log moved aside, then grown: named, with the fix.
	if err := os.Rename(log, log+".away"); err != nil {
		t.Fatal(err)
	}
	p := Check(got, nil)
	if len(p) != 1 || p[0].Path != log || p[0].Have != "no such file" || !strings.Contains(p[0].Fix, "--carry-files") {
		t.Fatalf("problems with the log missing: %v", p)
	}
	// Back with another mode, and the state file grown: both named.
	if err := os.Rename(log+".away", log); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(log, 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(state, []byte("thirteen byte"), 0o600); err != nil {
		t.Fatal(err)
	}
	p = Check(got, nil)
	if len(p) != 2 || !strings.Contains(p[0].Have, "mode 0640") || !strings.Contains(p[1].Have, "of 13 bytes") {
		t.Fatalf("problems with another mode and size: %v", p)
	}
	// Through the manifest's record.
	back, err := Parse(Encode(got))
	if err != nil || !slices.Equal(back, got) {
		t.Fatalf("round trip: %v", err)
	}
}

func image(magic uint32, msgs ...proto.Message) []byte {
	b := binary.LittleEndian.AppendUint32(nil, magicCommon)
	b = binary.LittleEndian.AppendUint32(b, magic)
	for _, m := range msgs {
		e, _ := proto.Marshal(m)
		b = binary.LittleEndian.AppendUint32(b, uint32(len(e)))
		b = append(b, e...)
	}
	return b
}

func regEntry(id uint32, name string) *fdinfo.FileEntry {
	return &fdinfo.FileEntry{Type: fdinfo.FdTypes_REG.Enum(), Id: proto.Uint32(id), Reg: &regfile.RegFileEntry{
		Id: proto.Uint32(id), Flags: proto.Uint32(unix.O_RDONLY), Pos: proto.Uint64(0), Fown: &fown.FownEntry{Uid: proto.Uint32(0),
			Euid: proto.Uint32(0), Signum: proto.Uint32(0), PidType: proto.Uint32(0), Pid: proto.Uint32(0)}, Name: proto.String(name)}}
}

// TestDecodeRefusesHostileImages: malformed or out-of-bounds images are refused, naming what is
// wrong, never half-read.
func TestDecodeRefusesHostileImages(t *testing.T) {
	ok := image(magicFiles, regEntry(1, "/usr/bin/app"))
	truncated := ok[:len(ok)-3]
	huge := binary.LittleEndian.AppendUint32(image(magicFiles), 1<<30)
	tests := []struct {
		name, want string
		files      []byte
	}{
		{"empty", "bad magic", nil},
		{"another image", "bad magic", image(magicRemap)},
		{"truncated entry", "entry of", truncated},
		{"entry larger than the image", "entry of", huge},
		{"relative path", "not absolute", image(magicFiles, regEntry(1, "usr/bin/app"))},
		{"path with ..", "not absolute and clean", image(magicFiles, regEntry(1, "/usr/../etc/shadow"))},
		{"NUL in a path", "not valid UTF-8 text", image(magicFiles, regEntry(1, "/usr/bin/a\x00pp"))},
		{"garbage entry", "", append(image(magicFiles), 3, 0, 0, 0, 0xff, 0xff, 0xff)},
		{"too large", "more than", make([]byte, MaxImageBytes+1)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Decode(tt.files, nil)
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want ErrInvalid with %q", err, tt.want)
			}
		})
	}
	if _, err := Decode(ok, nil); err != nil {
		t.Fatalf("valid image: %v", err)
	}
	for _, s := range []string{`[{"path":"rel","size":1}]`, `[{"path":"/a","size":-2}]`, `{`} {
		if _, err := Parse(s); !errors.Is(err, ErrInvalid) {
			t.Errorf("Parse(%s) = %v", s, err)
		}
	}
}
