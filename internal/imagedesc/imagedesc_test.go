package imagedesc

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/golden"
	"github.com/ptxmig/ptxmig/internal/hostreq"
	"github.com/ptxmig/ptxmig/store"
)

// legacyWant is the description of testdata/legacy-manifest.json: a manifest (format 1.1)
// written by ptxmig before typed descriptions, with every extra key checkpoint wrote and a label.
// It is never regenerated.
func legacyWant() *Description {
	gpu1 := GPU{Index: 1, UUID: "GPU-11111111-2222-3333-4444-555555555555", Name: "NVIDIA H100 80GB HBM3", ComputeCap: "9.0", MemoryBytes: 8 << 30}
	return &Description{
		Kind: KindCUDA, Host: "gpu-host-7", Kernel: "6.8.0-49-generic", Driver: "580.159.04", CUDA: "13.0", CRIU: "4.1.1",
		GPUs:    []GPU{gpu1},
		Visible: []GPU{{Index: 0, UUID: "GPU-00000000-2222-3333-4444-555555555555", Name: "NVIDIA H100 80GB HBM3", ComputeCap: "9.0"}, gpu1},
		PID:     4242, Cmdline: []string{"python3", "train.py", "--epochs", "3"}, Comm: "python3",
		Tree: []TreeProc{{PID: 4242, Comm: "python3", CUDA: true, Cgroup: "/system.slice/job.service"},
			{PID: 4250, PPID: 4242, Comm: "worker", Cgroup: "/system.slice/job.service/w"}},
		Cgroup:   "/system.slice/job.service",
		CgroupV1: map[string]string{"memory": "/job", "name=systemd": "/system.slice/job.service"},
		ShellJob: true, TCPEstablished: true, NetworkLock: "nftables", LeftRunning: true,
		HostFiles: []hostreq.File{{Path: "/usr/bin/python3.12", Mode: 0o100755, Size: 6831736},
			{Path: "/var/log/job.log", Mode: 0o100644, Size: -1, Write: true}},
		HostFilesRecorded: true,
		Carried:           []hostreq.Carried{{Path: "/var/log/job.log", File: "carried-0", Size: 9, Mode: 0o100644}},
		Devmem:            map[int]string{4242: "0123456789abcdef"},
		Labels:            map[string]string{"team": "vision"},
		Legacy:            true,
	}
}

// TestLegacyManifest: a manifest in the layout before typed descriptions reads into the typed
// description; written again it takes the current layout (pinned by testdata/v2-meta.golden.json)
// and reads back the same.
func TestLegacyManifest(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("testdata", "legacy-manifest.json"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := store.DecodeManifest(b)
	if err != nil || m.FormatVersion != "1.1" {
		t.Fatalf("decode: %v", err)
	}
	d, err := Read(m)
	if err != nil {
		t.Fatal(err)
	}
	want := legacyWant()
	if !reflect.DeepEqual(d, want) {
		t.Fatalf("legacy manifest reads as\n%+v\nwant\n%+v", d, want)
	}
	meta, err := d.Encode()
	if err != nil {
		t.Fatal(err)
	}
	golden.Check(t, filepath.Join("testdata", "v2-meta.golden.json"), append(append([]byte(nil), meta...), '\n'))
	back, err := Decode(meta)
	want.Legacy = false
	if err != nil || !reflect.DeepEqual(back, want) {
		t.Fatalf("current layout reads back as\n%+v (%v)\nwant\n%+v", back, err, want)
	}
	// A plain directory image records nothing; metadata absent, null or {} alike.
	for _, raw := range []string{"", "null", "{}", `{"image":2}`} {
		d, err := Decode(store.Metadata(raw))
		if err != nil || d.Kind != "" || d.PID != 0 || d.Tree != nil || len(d.Processes()) != 1 {
			t.Errorf("metadata %q: %+v %v", raw, d, err)
		}
	}
}

// TestValidation: every field read is checked, in both layouts; a bad field is named and the
// others still read.
func TestValidation(t *testing.T) {
	tests := []struct {
		name, meta, field, want string
	}{
		{"negative pid", `{"pid":-1}`, FieldBase, "pid -1"},
		{"huge pid", `{"pid":4194304}`, FieldBase, "pid 4194304"},
		{"negative gpu index", `{"gpus":[{"index":-1}]}`, FieldBase, "gpu index -1"},
		{"negative visible index", `{"visible_gpus":[{"index":-1,"uuid":"GPU-a"}]}`, FieldBase, "gpu index -1"},
		{"pid of the wrong type", `{"pid":"7"}`, FieldBase, "pid"},
		{"not an object", `[1]`, FieldMeta, "image metadata"},
		{"newer description", `{"image":3}`, FieldImage, "upgrade ptxmig"},
		{"description version 1", `{"image":1}`, FieldImage, "not valid"},
		{"v2 tree of the wrong type", `{"image":2,"pid":5,"tree":"[]"}`, FieldTree, "tree"},
		{"v2 tree", `{"image":2,"pid":5,"tree":[{"pid":6}]}`, FieldTree, "does not start"},
		{"v2 cgroup", `{"image":2,"cgroup":"a/b"}`, FieldCgroups, "image cgroup"},
		{"v2 cgroup v1 hierarchy", `{"image":2,"cgroup_v1":{"a:b":"/x"}}`, FieldCgroups, "bad hierarchy"},
		{"v2 cgroup v1 path", `{"image":2,"cgroup_v1":{"memory":"/x/../y"}}`, FieldCgroups, "memory"},
		{"v2 host files", `{"image":2,"host_files":[{"path":"rel","mode":33188,"size":1}]}`, FieldHostFiles, "invalid host requirements"},
		{"v2 host file size", `{"image":2,"host_files":[{"path":"/a","mode":33188,"size":-2}]}`, FieldHostFiles, "size -2"},
		{"v2 carried name", `{"image":2,"carried":[{"path":"/a","file":"carried-1","size":1,"mode":33188}]}`, FieldCarried, "stored as"},
		{"v2 carried mode", `{"image":2,"carried":[{"path":"/a","file":"carried-0","size":1,"mode":16877}]}`, FieldCarried, "mode"},
		{"v2 devmem pid", `{"image":2,"devmem":[{"pid":0,"instance":"0123456789abcdef"}]}`, FieldDevmem, "owned memory"},
		{"v2 devmem instance", `{"image":2,"devmem":[{"pid":5,"instance":"0123456789ABCDEF"}]}`, FieldDevmem, "owned memory"},
		{"v2 devmem repeated", `{"image":2,"devmem":[{"pid":5,"instance":"0123456789abcdef"},{"pid":5,"instance":"0123456789abcdef"}]}`, FieldDevmem, "repeated"},
		{"v2 shell job of the wrong type", `{"image":2,"shell_job":"true"}`, FieldCRIU, "shell_job"},
		{"v2 labels of the wrong type", `{"image":2,"extra":{"a":1}}`, FieldLabels, "extra"},
		{"legacy cgroup", `{"extra":{"cgroup":"../x"}}`, FieldCgroups, "not absolute"},
		{"legacy cgroup v1", `{"extra":{"cgroup.v1":"{"}}`, FieldCgroups, "cgroups (v1)"},
		{"legacy cgroup v1 count", `{"extra":{"cgroup.v1":"{` + manyHierarchies() + `}"}}`, FieldCgroups, "65 hierarchies"},
		{"legacy host files", `{"extra":{"host.files":"[{\"path\":\"rel\"}]"}}`, FieldHostFiles, "not absolute"},
		{"legacy carried", `{"extra":{"host.carried":"x"}}`, FieldCarried, "carried files"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d, err := Decode(store.Metadata(tt.meta))
			var inv *InvalidError
			if !errors.As(err, &inv) || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want one containing %q", err, tt.want)
			}
			if p := d.Problem(tt.field); p == nil || !strings.Contains(p.Error(), tt.want) {
				t.Fatalf("problem of %s = %v (all: %v)", tt.field, p, err)
			}
		})
	}
	// The other fields still read.
	d, err := Decode(store.Metadata(`{"image":2,"kind":"cpu","pid":5,"comm":"x","cgroup":"a","host_files":[]}`))
	if err == nil || d.Kind != KindCPU || d.PID != 5 || d.Comm != "x" || !d.HostFilesRecorded || d.Cgroup != "" {
		t.Errorf("partial read: %+v %v", d, err)
	}
	// Legacy devmem stays lenient (it only finds a previous image): bad entries are skipped.
	if d, err := Decode(store.Metadata(`{"extra":{"devmem":"5:0123456789abcdef x -1:0123456789abcdef"}}`)); err != nil || len(d.Devmem) != 1 {
		t.Errorf("legacy devmem: %+v %v", d.Devmem, err)
	}
}

func manyHierarchies() string {
	var parts []string
	for i := range 65 {
		parts = append(parts, `\"h`+strings.Repeat("x", i)+`\":\"/a\"`)
	}
	return strings.Join(parts, ",")
}
