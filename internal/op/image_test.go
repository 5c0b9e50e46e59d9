package op

import (
	"reflect"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/store"
)

// TestImageTree checks the tree a manifest records: good trees read back, images without one hold
// their root, and every malformed field is refused with a reason.
func TestImageTree(t *testing.T) {
	good := []TreeProc{{PID: 100, Comm: "bash"}, {PID: 101, PPID: 100, Comm: "python3", CUDA: true}, {PID: 102, PPID: 101, Comm: "worker"}}
	tests := []struct {
		name    string
		meta    store.Metadata
		want    []TreeProc
		wantErr string
	}{
		{name: "recorded", meta: store.Metadata{PID: 100, Kind: KindCUDA, Extra: map[string]string{ExtraTree: EncodeTree(good)}}, want: good},
		{name: "older image: the root alone", meta: store.Metadata{PID: 7, Kind: KindCUDA, Extra: map[string]string{ExtraComm: "counter"}},
			want: []TreeProc{{PID: 7, Comm: "counter", CUDA: true}}},
		{name: "not JSON", meta: store.Metadata{PID: 100, Extra: map[string]string{ExtraTree: "[{"}}, wantErr: "process tree"},
		{name: "empty", meta: store.Metadata{PID: 100, Extra: map[string]string{ExtraTree: "[]"}}, wantErr: "does not start"},
		{name: "other root", meta: store.Metadata{PID: 5, Extra: map[string]string{ExtraTree: EncodeTree(good)}}, wantErr: "does not start"},
		{name: "repeated pid", meta: store.Metadata{PID: 100, Extra: map[string]string{ExtraTree: EncodeTree([]TreeProc{{PID: 100}, {PID: 100, PPID: 100}})}}, wantErr: "repeated"},
		{name: "pid 1", meta: store.Metadata{PID: 100, Extra: map[string]string{ExtraTree: EncodeTree([]TreeProc{{PID: 100}, {PID: 1, PPID: 100}})}}, wantErr: "bad"},
		{name: "huge pid", meta: store.Metadata{PID: 100, Extra: map[string]string{ExtraTree: EncodeTree([]TreeProc{{PID: 100}, {PID: 1 << 30, PPID: 100}})}}, wantErr: "bad"},
		{name: "negative ppid", meta: store.Metadata{PID: 100, Extra: map[string]string{ExtraTree: EncodeTree([]TreeProc{{PID: 100, PPID: -1}})}}, wantErr: "bad"},
		{name: "child before parent", meta: store.Metadata{PID: 100, Extra: map[string]string{ExtraTree: EncodeTree([]TreeProc{{PID: 100}, {PID: 102, PPID: 101}, {PID: 101, PPID: 100}})}}, wantErr: "not listed before"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ImageTree(tt.meta)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("got %+v, %v; want %+v", got, err, tt.want)
			}
		})
	}
	if got := TreePIDs(good, true); !reflect.DeepEqual(got, []int{101}) {
		t.Errorf("TreePIDs(cuda only) = %v", got)
	}
}
