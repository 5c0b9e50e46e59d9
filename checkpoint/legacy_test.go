package checkpoint_test

import (
	"context"
	"encoding/json"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/hostreq"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/restore"
	"github.com/ptxmig/ptxmig/store"
)

// legacyMeta renders a description in the layout ptxmig wrote before typed descriptions (the
// tree, cgroups and host files as JSON strings in extra), as that version's checkpoint did.
func legacyMeta(t *testing.T, d *imagedesc.Description) store.Metadata {
	t.Helper()
	extra := map[string]string{}
	for k, v := range d.Labels {
		extra[k] = v
	}
	set := func(k, v string) {
		if v != "" {
			extra[k] = v
		}
	}
	flag := func(k string, b bool) {
		if b {
			extra[k] = "true"
		}
	}
	js := func(v any) string {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	set(imagedesc.ExtraComm, d.Comm)
	flag(imagedesc.ExtraShellJob, d.ShellJob)
	flag(imagedesc.ExtraTTY, d.TTY)
	flag(imagedesc.ExtraTCPEstablished, d.TCPEstablished)
	set(imagedesc.ExtraNetworkLock, d.NetworkLock)
	flag(imagedesc.ExtraLeftRunning, d.LeftRunning)
	set(imagedesc.ExtraCgroup, d.Cgroup)
	if len(d.CgroupV1) > 0 {
		extra[imagedesc.ExtraCgroupV1] = js(d.CgroupV1)
	}
	if d.Tree != nil {
		extra[imagedesc.ExtraTree] = js(d.Tree)
	}
	if d.HostFilesRecorded {
		extra[imagedesc.ExtraHostFiles] = hostreq.Encode(d.HostFiles)
	}
	if d.Carried != nil {
		extra[imagedesc.ExtraCarried] = hostreq.EncodeCarried(d.Carried)
	}
	if len(d.Devmem) > 0 {
		extra[imagedesc.ExtraDevmem] = imagedesc.EncodeDevmemLegacy(d.Devmem)
	}
	return store.Metadata(js(struct {
		Kind    string            `json:"kind,omitempty"`
		Host    string            `json:"host,omitempty"`
		Kernel  string            `json:"kernel,omitempty"`
		Driver  string            `json:"driver,omitempty"`
		CUDA    string            `json:"cuda,omitempty"`
		CRIU    string            `json:"criu,omitempty"`
		GPUs    []imagedesc.GPU   `json:"gpus,omitempty"`
		Visible []imagedesc.GPU   `json:"visible_gpus,omitempty"`
		PID     int               `json:"pid,omitempty"`
		Cmdline []string          `json:"cmdline,omitempty"`
		Extra   map[string]string `json:"extra,omitempty"`
	}{d.Kind, d.Host, d.Kernel, d.Driver, d.CUDA, d.CRIU, d.GPUs, d.Visible, d.PID, d.Cmdline, extra}))
}

// TestRestoreLegacyImage: an image whose manifest has the layout of ptxmig before typed
// descriptions (the same files, the metadata as that version wrote it) reads into the same
// description and restores, with real CRIU.
func TestRestoreLegacyImage(t *testing.T) {
	f := setup(t)
	p, m := f.start(t, "state")
	if _, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: p.PID, Name: "typed", StagingRoot: f.stage}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Exited():
	case <-time.After(10 * time.Second):
		t.Fatal("the process still runs after a checkpoint without --leave-running")
	}
	atDump, err := testproc.ReadState(p.StateFile)
	if err != nil {
		t.Fatal(err)
	}
	typed, err := f.st.Get("typed")
	if err != nil {
		t.Fatal(err)
	}
	d, err := imagedesc.Read(typed)
	if err != nil || d.Legacy || d.Tree == nil || !d.HostFilesRecorded {
		t.Fatalf("checkpoint's description: %+v (%v)", d, err)
	}
	files := filepath.Join(t.TempDir(), "files")
	if _, err := f.st.Materialize(context.Background(), "typed", files, store.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.st.Put(context.Background(), files, store.PutOptions{Name: "legacy", Meta: legacyMeta(t, d), ChunkSize: typed.ChunkSize}); err != nil {
		t.Fatal(err)
	}
	legacy, err := f.st.Get("legacy")
	if err != nil {
		t.Fatal(err)
	}
	ld, err := imagedesc.Read(legacy)
	want := *d
	want.Legacy = true
	if err != nil || !reflect.DeepEqual(ld, &want) {
		t.Fatalf("legacy layout reads as\n%+v (%v)\nwant\n%+v", ld, err, &want)
	}
	r, err := restore.Run(context.Background(), f.env, restore.Options{Image: "legacy", StagingRoot: f.stage})
	if err != nil {
		t.Fatalf("restore of the legacy image: %v", err)
	}
	t.Cleanup(func() { _ = testproc.KillPID(r.PID, 10*time.Second) })
	if r.PID != p.PID || len(r.Tree) != len(d.Tree) {
		t.Fatalf("restore result %+v, want pid %d", r, p.PID)
	}
	advancesExactly(t, p.StateFile, m, atDump.Step, 10)
}
