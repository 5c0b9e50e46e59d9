package imagedesc

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/store"
)

// legacyMeta is metadata in the layout before version 2 (as ptxmig before it wrote it): base
// members, then the extra strings.
func legacyMeta(pid int, kind string, extra map[string]string) store.Metadata {
	b, _ := json.Marshal(struct {
		Kind  string            `json:"kind,omitempty"`
		PID   int               `json:"pid,omitempty"`
		Extra map[string]string `json:"extra,omitempty"`
	}{kind, pid, extra})
	return b
}

func encodeTree(t []TreeProc) string {
	b, _ := json.Marshal(t)
	return string(b)
}

// v2Meta is the same in version 2: the extra strings as typed members (tree only here).
func v2Meta(pid int, kind string, extra map[string]string) store.Metadata {
	m := map[string]any{"image": Version, "kind": kind, "pid": pid}
	for k, v := range extra {
		switch k {
		case ExtraTree:
			m["tree"] = json.RawMessage(v)
		case ExtraComm:
			m["comm"] = v
		default:
			panic(k)
		}
	}
	b, _ := json.Marshal(m)
	return b
}

// TestImageTree checks the tree a manifest records: good trees read back, images without one hold
// their root, and every malformed field is refused with a reason; in both layouts.
func TestImageTree(t *testing.T) {
	good := []TreeProc{{PID: 100, Comm: "bash"}, {PID: 101, PPID: 100, Comm: "python3", CUDA: true}, {PID: 102, PPID: 101, Comm: "worker"}}
	type meta struct {
		pid   int
		kind  string
		extra map[string]string
	}
	tests := []struct {
		name    string
		meta    meta
		want    []TreeProc
		wantErr string
	}{
		{name: "recorded", meta: meta{100, KindCUDA, map[string]string{ExtraTree: encodeTree(good)}}, want: good},
		{name: "older image: the root alone", meta: meta{7, KindCUDA, map[string]string{ExtraComm: "counter"}},
			want: []TreeProc{{PID: 7, Comm: "counter", CUDA: true}}},
		{name: "not JSON", meta: meta{100, "", map[string]string{ExtraTree: "[{"}}, wantErr: "process tree"},
		{name: "empty", meta: meta{100, "", map[string]string{ExtraTree: "[]"}}, wantErr: "does not start"},
		{name: "other root", meta: meta{5, "", map[string]string{ExtraTree: encodeTree(good)}}, wantErr: "does not start"},
		{name: "repeated pid", meta: meta{100, "", map[string]string{ExtraTree: encodeTree([]TreeProc{{PID: 100}, {PID: 100, PPID: 100}})}}, wantErr: "repeated"},
		{name: "pid 1", meta: meta{100, "", map[string]string{ExtraTree: encodeTree([]TreeProc{{PID: 100}, {PID: 1, PPID: 100}})}}, wantErr: "bad"},
		{name: "huge pid", meta: meta{100, "", map[string]string{ExtraTree: encodeTree([]TreeProc{{PID: 100}, {PID: 1 << 30, PPID: 100}})}}, wantErr: "bad"},
		{name: "negative ppid", meta: meta{100, "", map[string]string{ExtraTree: encodeTree([]TreeProc{{PID: 100, PPID: -1}})}}, wantErr: "bad"},
		{name: "child before parent", meta: meta{100, "", map[string]string{ExtraTree: encodeTree([]TreeProc{{PID: 100}, {PID: 102, PPID: 101}, {PID: 101, PPID: 100}})}}, wantErr: "not listed before"},
		{name: "bad cgroup", meta: meta{100, "", map[string]string{ExtraTree: encodeTree([]TreeProc{{PID: 100, Cgroup: "/a/../b"}})}}, wantErr: "pid 100"},
	}
	for _, layout := range []struct {
		name string
		enc  func(int, string, map[string]string) store.Metadata
	}{{"legacy", legacyMeta}, {"v2", v2Meta}} {
		for _, tt := range tests {
			if layout.name == "v2" && tt.name == "not JSON" {
				continue // a typed member is JSON; TestDecodeErrors covers one of the wrong type
			}
			t.Run(layout.name+"/"+tt.name, func(t *testing.T) {
				d, err := Decode(layout.enc(tt.meta.pid, tt.meta.kind, tt.meta.extra))
				got := d.Processes()
				if tt.wantErr != "" {
					if err == nil || !strings.Contains(err.Error(), tt.wantErr) || d.Problem(FieldTree) == nil {
						t.Fatalf("err = %v, want one containing %q", err, tt.wantErr)
					}
					return
				}
				if err != nil || !reflect.DeepEqual(got, tt.want) {
					t.Fatalf("got %+v, %v; want %+v", got, err, tt.want)
				}
			})
		}
	}
	if got := TreePIDs(good, true); !reflect.DeepEqual(got, []int{101}) {
		t.Errorf("TreePIDs(cuda only) = %v", got)
	}
}
