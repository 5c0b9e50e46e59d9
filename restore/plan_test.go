package restore

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/store"
)

const (
	u0 = "GPU-00000000-0000-0000-0000-000000000000"
	u1 = "GPU-11111111-1111-1111-1111-111111111111"
	u2 = "GPU-22222222-2222-2222-2222-222222222222"
	uX = "GPU-99999999-9999-9999-9999-999999999999" // a GPU of another host
)

func dev(i int, uuid, name string, used uint64) gpu.Device {
	return gpu.Device{Index: i, UUID: uuid, Name: name, ComputeCap: "9.0", MemoryUsed: used, MemoryTotal: 100 << 30}
}

func src(i int, uuid string, mem uint64) store.GPU {
	return store.GPU{Index: i, UUID: uuid, Name: "NVIDIA H200", ComputeCap: "9.0", MemoryBytes: mem}
}

// TestPlanPairs covers target choice and preflight refusals over fake inventories.
func TestPlanPairs(t *testing.T) {
	twoH200 := []gpu.Device{dev(0, u0, "NVIDIA H200", 1<<30), dev(1, u1, "NVIDIA H200", 2<<30)}
	mixed := []gpu.Device{dev(0, u0, "NVIDIA H200", 0), dev(1, u1, "NVIDIA H100 80GB HBM3", 0)}
	full := []gpu.Device{dev(0, u0, "NVIDIA H200", 0), dev(1, u1, "NVIDIA H200", 99<<30)}
	three := append(append([]gpu.Device{}, twoH200...), dev(2, u2, "NVIDIA H200", 0))
	tests := []struct {
		name    string
		src     []store.GPU
		devs    []gpu.Device
		targets []int
		gmap    map[string]string
		live    bool
		want    []string // target UUID per source
		wantErr error
	}{
		{"same GPU by UUID", []store.GPU{src(1, u1, 4<<30)}, twoH200, nil, nil, false, []string{u1}, nil},
		{"other host: same index", []store.GPU{src(1, uX, 4<<30)}, twoH200, nil, nil, false, []string{u1}, nil},
		{"--gpu 1", []store.GPU{src(0, u0, 4<<30)}, twoH200, []int{1}, nil, false, []string{u1}, nil},
		{"--gpu per GPU", []store.GPU{src(0, u0, 1), src(1, u1, 1)}, twoH200, []int{1, 0}, nil, false, []string{u1, u0}, nil},
		{"--gpu-map by uuid", []store.GPU{src(0, u0, 1)}, twoH200, nil, map[string]string{u0: u1}, false, []string{u1}, nil},
		{"--gpu-map by index, partial", []store.GPU{src(0, u0, 1), src(1, u1, 1)}, three, nil, map[string]string{"1": "2"}, false, []string{u0, u2}, nil},
		{"chip mismatch", []store.GPU{src(0, u0, 1)}, mixed, []int{1}, nil, false, nil, ErrChipMismatch},
		{"not enough memory", []store.GPU{src(0, u0, 4<<30)}, full, []int{1}, nil, false, nil, ErrNoRoom},
		{"restore needs memory on the same GPU too", []store.GPU{src(1, u1, 4<<30)}, full, nil, nil, false, nil, ErrNoRoom},
		{"live and unmoved needs no room", []store.GPU{src(1, u1, 4<<30)}, full, []int{1}, nil, true, []string{u1}, nil},
		{"missing target", []store.GPU{src(0, u0, 1)}, twoH200, []int{5}, nil, false, nil, gpu.ErrNoSuchGPU},
		{"other host, index absent", []store.GPU{src(3, uX, 1)}, twoH200, nil, nil, false, nil, gpu.ErrNoSuchGPU},
		{"one target for two GPUs", []store.GPU{src(0, u0, 1), src(1, u1, 1)}, twoH200, []int{1}, nil, false, nil, ErrBadTarget},
		{"three targets for two GPUs", []store.GPU{src(0, u0, 1), src(1, u1, 1)}, three, []int{0, 1, 2}, nil, false, nil, ErrBadTarget},
		{"duplicate target", []store.GPU{src(0, u0, 1), src(1, u1, 1)}, twoH200, []int{1, 1}, nil, false, nil, ErrBadTarget},
		{"map names an unused GPU", []store.GPU{src(0, u0, 1)}, twoH200, nil, map[string]string{u2: u1}, false, nil, ErrBadTarget},
		{"both --gpu and --gpu-map", []store.GPU{src(0, u0, 1)}, twoH200, []int{1}, map[string]string{u0: u1}, false, nil, ErrBadTarget},
		{"no GPUs recorded, no remap", nil, twoH200, nil, nil, false, nil, nil},
		{"no GPUs recorded, remap asked", nil, twoH200, []int{1}, nil, false, nil, ErrBadTarget},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pairs, err := PlanPairs(tt.src, tt.devs, tt.targets, tt.gmap, tt.live)
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("err = %v, want %v", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, p := range pairs {
				got = append(got, p.To.UUID)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("targets = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestChipMismatchNamesBoth(t *testing.T) {
	_, err := PlanPairs([]store.GPU{src(0, u0, 1)}, []gpu.Device{dev(0, u0, "NVIDIA H200", 0), dev(1, u1, "NVIDIA H100 80GB HBM3", 0)}, []int{1}, nil, false)
	for _, w := range []string{"NVIDIA H200", "NVIDIA H100 80GB HBM3", u0, u1} {
		if err == nil || !contains(err.Error(), w) {
			t.Errorf("error %v does not name %s", err, w)
		}
	}
}

func contains(s, sub string) bool { return strings.Contains(s, sub) }

func TestDriverPairs(t *testing.T) {
	same := []Pair{{From: src(0, u0, 1), To: dev(0, u0, "NVIDIA H200", 0)}}
	if p, err := DriverPairs(same); err != nil || p != nil {
		t.Errorf("identity plan: %v, %v; want no pairs (works on drivers without remap)", p, err)
	}
	moved := []Pair{{From: src(0, u0, 1), To: dev(1, u1, "NVIDIA H200", 0)}, {From: src(1, u1, 1), To: dev(0, u0, "NVIDIA H200", 0)}}
	p, err := DriverPairs(moved)
	if err != nil || len(p) != 2 || p[0].Old.String() != u0 || p[0].New.String() != u1 || p[1].New.String() != u0 {
		t.Errorf("swap plan: %+v, %v", p, err)
	}
	bad := []Pair{{From: store.GPU{UUID: "GPU-x"}, To: dev(1, u1, "", 0)}}
	if _, err := DriverPairs(bad); !errors.Is(err, ErrBadTarget) {
		t.Errorf("bad uuid: %v", err)
	}
}

func TestParseFlags(t *testing.T) {
	if g, err := ParseGPUList("1, 0"); err != nil || !reflect.DeepEqual(g, []int{1, 0}) {
		t.Errorf("ParseGPUList = %v, %v", g, err)
	}
	for _, bad := range []string{"x", "-1", "1,,2"} {
		if _, err := ParseGPUList(bad); err == nil {
			t.Errorf("ParseGPUList(%q) accepted", bad)
		}
	}
	if m, err := ParseGPUMap(u0 + "=1,1=0"); err != nil || m[u0] != "1" || m["1"] != "0" {
		t.Errorf("ParseGPUMap = %v, %v", m, err)
	}
	for _, bad := range []string{"a", "a=", "=b", "a=1,a=2"} {
		if _, err := ParseGPUMap(bad); err == nil {
			t.Errorf("ParseGPUMap(%q) accepted", bad)
		}
	}
}
