package store

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// TestRescue: a rescue record serves the files it names, byte for byte, from the ingest's staged
// chunks, from chunks of the store that the ingest deduplicated, and zero chunks; it outlives the
// ingest's writer (the ingest is never closed here, as when ptxmig is killed) and goes with
// Close. A record that lies is refused with ErrCorrupt before anything is read.
func TestRescue(t *testing.T) {
	s := openTestStore(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(7, 8))
	old := make([]byte, 3*DefaultChunkSize)
	for i := range old {
		old[i] = byte(rng.Uint32())
	}
	// A committed image holds old's chunks: the ingest below finds them there (not staged).
	in0, err := s.NewIngest(ctx, PutOptions{Name: "before"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in0.AddFile("mem", 0o600, bytes.NewReader(old)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := in0.Commit(Metadata{}); err != nil {
		t.Fatal(err)
	}
	in0.Close()

	fresh := make([]byte, 2*DefaultChunkSize+12345)
	for i := range fresh {
		fresh[i] = byte(rng.Uint32())
	}
	mixed := append(append(append([]byte{}, old[:DefaultChunkSize]...), make([]byte, DefaultChunkSize)...), fresh[:DefaultChunkSize]...)
	in, err := s.NewIngest(ctx, PutOptions{Name: "ckpt"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(in.Close)
	for name, b := range map[string][]byte{"gpu-1.mem": fresh, "gpu-2.mem": mixed, "empty.mem": nil, "other": []byte("not rescued")} {
		if _, err := in.AddFile(name, 0o600, bytes.NewReader(b)); err != nil {
			t.Fatal(err)
		}
	}
	if err := in.WriteRescue(RescueKey(42), []byte(`{"index":1}`), []string{"gpu-1.mem", "gpu-2.mem", "empty.mem"}); err != nil {
		t.Fatal(err)
	}
	if err := in.WriteRescue("bad/key", nil, nil); err == nil {
		t.Error("a key with a slash was accepted")
	}
	if err := in.WriteRescue("k", nil, []string{"missing"}); err == nil {
		t.Error("a file the ingest does not have was accepted")
	}

	r, err := s.ReadRescue(ctx, "ckpt", RescueKey(42))
	if err != nil {
		t.Fatal(err)
	}
	if string(r.Meta) != `{"index":1}` {
		t.Errorf("meta %q", r.Meta)
	}
	for name, want := range map[string][]byte{"gpu-1.mem": fresh, "gpu-2.mem": mixed, "empty.mem": nil} {
		var b bytes.Buffer
		if n, err := r.WriteFile(ctx, name, &b); err != nil || n != int64(len(want)) || !bytes.Equal(b.Bytes(), want) {
			t.Errorf("%s: %d bytes, err %v; want its %d bytes back", name, n, err, len(want))
		}
	}
	if _, err := r.WriteFile(ctx, "other", io.Discard); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a file the record does not name: %v, want ErrNotExist", err)
	}
	r.Close()

	// Lies in the record: each refused by ReadRescue.
	path := s.rescuePath("ckpt", RescueKey(42))
	orig, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var rec rescueRecord
	if err := json.Unmarshal(orig, &rec); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		edit func(r *rescueRecord)
	}{
		{"staged outside tmp", func(r *rescueRecord) { r.Files[0].Chunks[0].Staged = "../chunks/x" }},
		{"staged name not a temp chunk", func(r *rescueRecord) { r.Files[0].Chunks[0].Staged = "rescue-ckpt.pid-42.json" }},
		{"chunk too large", func(r *rescueRecord) { r.Files[0].Chunks[0].Size = MaxChunkSize + 1 }},
		{"chunk of no bytes", func(r *rescueRecord) { r.Files[0].Chunks[0].Size = 0 }},
		{"another image's record", func(r *rescueRecord) { r.Image = "before" }},
		{"file listed twice", func(r *rescueRecord) { r.Files[1].Path = r.Files[0].Path }},
		{"another version", func(r *rescueRecord) { r.Version = 9 }},
	} {
		x := rec
		x.Files = append([]rescueFile(nil), rec.Files...)
		for i := range x.Files {
			x.Files[i].Chunks = append([]rescueChunk(nil), rec.Files[i].Chunks...)
		}
		c.edit(&x)
		b, _ := json.Marshal(x)
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		if r, err := s.ReadRescue(ctx, "ckpt", RescueKey(42)); !errors.Is(err, ErrCorrupt) {
			if r != nil {
				r.Close()
			}
			t.Errorf("%s: err %v, want ErrCorrupt", c.name, err)
		}
	}
	// A record whose staged chunk was changed on disk: refused by the chunk's hash when read.
	if err := os.WriteFile(path, orig, 0o600); err != nil {
		t.Fatal(err)
	}
	staged := filepath.Join(s.tmpDir(), rec.Files[0].Chunks[0].Staged)
	if rec.Files[0].Chunks[0].Staged == "" {
		t.Fatal("the fresh file's first chunk is not staged")
	}
	good, _ := os.ReadFile(staged)
	bad := append([]byte{}, good...)
	bad[len(bad)-1] ^= 0xff
	if err := os.WriteFile(staged, bad, 0o600); err != nil {
		t.Fatal(err)
	}
	if r, err := s.ReadRescue(ctx, "ckpt", RescueKey(42)); err != nil {
		t.Fatal(err)
	} else {
		if _, err := r.WriteFile(ctx, "gpu-1.mem", io.Discard); err == nil {
			t.Error("a damaged staged chunk was served")
		}
		r.Close()
	}
	_ = os.WriteFile(staged, good, 0o600)
	// Never through a symbolic link.
	if err := os.Rename(path, path+".real"); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(path+".real", path); err != nil {
		t.Fatal(err)
	}
	if _, err := s.ReadRescue(ctx, "ckpt", RescueKey(42)); !errors.Is(err, syscall.ELOOP) {
		t.Errorf("a record behind a symbolic link: %v, want ELOOP (never followed)", err)
	}
	_ = os.Remove(path)
	if err := os.Rename(path+".real", path); err != nil {
		t.Fatal(err)
	}

	// The ingest's Close removes the record with the staged chunks.
	in.Close()
	if _, err := s.ReadRescue(ctx, "ckpt", RescueKey(42)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("after Close: %v, want ErrNotExist", err)
	}
}

// rescued writes an ingest of image "ckpt" holding file "m" (data) with a rescue record under
// RescueKey(1), and returns the ingest and the record as written.
func rescued(t *testing.T, s *Store, data []byte) (*Ingest, rescueRecord) {
	t.Helper()
	in, err := s.NewIngest(context.Background(), PutOptions{Name: "ckpt"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.AddFile("m", 0o600, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	if err := in.WriteRescue(RescueKey(1), nil, []string{"m"}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(s.rescuePath("ckpt", RescueKey(1)))
	if err != nil {
		t.Fatal(err)
	}
	var rec rescueRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		t.Fatal(err)
	}
	if rec.Files[0].Chunks[0].Staged == "" {
		t.Fatal("the first chunk is not staged")
	}
	return in, rec
}

// TestRescueEdges: a FIFO in place of the record or of a staged chunk is refused at once (never
// waited on, with the store lock held); a writer killed in Commit after its staged chunks were
// published into chunks/ still has its files served; gc keeps a record, its staged chunks and
// the chunks it needs until the record is removed (after the recovery that used it).
func TestRescueEdges(t *testing.T) {
	ctx := context.Background()
	data := make([]byte, 3*DefaultChunkSize)
	for i := range data {
		data[i] = byte(i*7>>3 + i>>20)
	}
	read := func(s *Store) ([]byte, error) {
		r, err := s.ReadRescue(ctx, "ckpt", RescueKey(1))
		if err != nil {
			return nil, err
		}
		defer r.Close()
		var b bytes.Buffer
		_, err = r.WriteFile(ctx, "m", &b)
		return b.Bytes(), err
	}
	t.Run("fifo record", func(t *testing.T) {
		s := openTestStore(t)
		if err := syscall.Mkfifo(s.rescuePath("ckpt", RescueKey(1)), 0o600); err != nil {
			t.Fatal(err)
		}
		var err error
		within(t, 5*time.Second, "ReadRescue of a FIFO", func() { _, err = read(s) })
		if !errors.Is(err, ErrCorrupt) {
			t.Fatalf("err %v, want ErrCorrupt", err)
		}
	})
	t.Run("fifo staged chunk", func(t *testing.T) {
		s := openTestStore(t)
		in, rec := rescued(t, s, data)
		defer in.Close()
		p := filepath.Join(s.tmpDir(), rec.Files[0].Chunks[0].Staged)
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Mkfifo(p, 0o600); err != nil {
			t.Fatal(err)
		}
		var err error
		within(t, 5*time.Second, "a FIFO staged chunk", func() { _, err = read(s) })
		if err == nil {
			t.Fatal("a FIFO was served as a chunk")
		}
	})
	t.Run("killed in commit", func(t *testing.T) {
		s := openTestStore(t)
		in, _ := rescued(t, s, data)
		defer in.Close()
		if err := in.pw.stage.commit(); err != nil { // Commit's renames; the writer dies before the manifest
			t.Fatal(err)
		}
		if _, err := s.Get("ckpt"); err == nil {
			t.Fatal("the image committed")
		}
		if got, err := read(s); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%d bytes, err %v; want the file from chunks/", len(got), err)
		}
	})
	t.Run("gc keeps it", func(t *testing.T) {
		s := openTestStore(t)
		in, _ := rescued(t, s, data)
		in.lk.unlock() // the writer is killed: nothing closed, its lock gone
		st, err := s.GC(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := read(s); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("after gc (%+v): %d bytes, err %v; want the rescued file whole", st, len(got), err)
		}
		if err := s.RemoveRescue("ckpt", RescueKey(1)); err != nil {
			t.Fatal(err)
		}
		if _, err := s.GC(ctx); err != nil {
			t.Fatal(err)
		}
		if ents, _ := os.ReadDir(s.tmpDir()); len(ents) != 0 {
			t.Fatalf("tmp/ after the record went and gc ran: %d entries", len(ents))
		}
	})
}

// TestRescueAfterCommit: a commit removes the ingest's rescue records (the image holds the files;
// no rollback can need them), and gc removes a record left by a writer that died between its
// commit and that removal, with nothing it named lost from the image.
func TestRescueAfterCommit(t *testing.T) {
	s := openTestStore(t)
	ctx := context.Background()
	data := bytes.Repeat([]byte("owned memory "), 2*DefaultChunkSize/13)
	in, _ := rescued(t, s, data)
	path := s.rescuePath("ckpt", RescueKey(1))
	saved, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := in.Commit(Metadata{}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("after the commit the record is still there: %v", err)
	}
	in.Close()
	// A writer that died right after its commit: its record is back, naming a committed image.
	if err := os.WriteFile(path, saved, 0o600); err != nil {
		t.Fatal(err)
	}
	st, err := s.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) || st.TempRemoved == 0 {
		t.Fatalf("gc kept the record of a committed image (%v, %d temp files removed)", err, st.TempRemoved)
	}
	if _, err := s.Verify(ctx, "ckpt"); err != nil {
		t.Fatalf("the image after gc: %v", err)
	}
}

// TestRescueOfAnIngestThatLostItsName: two ingests of one image name (two checkpoints given the
// same --name); one commits, the other's writer dies before its commit, with a rescue record of
// its own files. gc keeps that record: the committed image is another ingest's and does not hold
// them (a file of the same path and size, other bytes).
func TestRescueOfAnIngestThatLostItsName(t *testing.T) {
	s := openTestStore(t)
	ctx := context.Background()
	data := bytes.Repeat([]byte("the loser's memory "), 2*DefaultChunkSize/19)
	loser, _ := rescued(t, s, data)
	winner, err := s.NewIngest(ctx, PutOptions{Name: "ckpt"})
	if err != nil {
		t.Fatal(err)
	}
	other := bytes.Repeat([]byte("the winner's memory"), 2*DefaultChunkSize/19) // as long, other bytes
	if _, err := winner.AddFile("m", 0o600, bytes.NewReader(other)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := winner.Commit(Metadata{}); err != nil {
		t.Fatal(err)
	}
	winner.Close()
	loser.lk.unlock() // the loser's writer is killed: nothing closed, its lock gone
	if _, err := s.GC(ctx); err != nil {
		t.Fatal(err)
	}
	r, err := s.ReadRescue(ctx, "ckpt", RescueKey(1))
	if err != nil {
		t.Fatalf("after gc: %v; want the dead writer's record kept", err)
	}
	defer r.Close()
	var b bytes.Buffer
	if _, err := r.WriteFile(ctx, "m", &b); err != nil || !bytes.Equal(b.Bytes(), data) {
		t.Fatalf("after gc: %d bytes, err %v; want the rescued file whole", b.Len(), err)
	}
}
