package placement

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
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

func src(i int, uuid string, mem uint64) imagedesc.GPU {
	return imagedesc.GPU{Index: i, UUID: uuid, Name: "NVIDIA H200", ComputeCap: "9.0", MemoryBytes: mem}
}

// a100Dev is a GPU of another chip family (compute capability 8.0).
func a100Dev(i int, uuid string) gpu.Device {
	d := dev(i, uuid, "NVIDIA A100-SXM4-80GB", 0)
	d.ComputeCap = "8.0"
	return d
}

// TestPlanPairs covers target choice and preflight refusals over fake inventories.
func TestPlanPairs(t *testing.T) {
	twoH200 := []gpu.Device{dev(0, u0, "NVIDIA H200", 1<<30), dev(1, u1, "NVIDIA H200", 2<<30)}
	mixed := []gpu.Device{dev(0, u0, "NVIDIA H200", 0), a100Dev(1, u1)}
	h200h100 := []gpu.Device{dev(0, u0, "NVIDIA H200", 0), dev(1, u1, "NVIDIA H100 80GB HBM3", 0)}
	full := []gpu.Device{dev(0, u0, "NVIDIA H200", 0), dev(1, u1, "NVIDIA H200", 99<<30)}
	three := append(append([]gpu.Device{}, twoH200...), dev(2, u2, "NVIDIA H200", 0))
	tests := []struct {
		name    string
		src     []imagedesc.GPU
		devs    []gpu.Device
		targets []int
		gmap    map[string]string
		live    bool
		want    []string // target UUID per source
		wantErr error
	}{
		{"same GPU by UUID", []imagedesc.GPU{src(1, u1, 4<<30)}, twoH200, nil, nil, false, []string{u1}, nil},
		{"other host: same index", []imagedesc.GPU{src(1, uX, 4<<30)}, twoH200, nil, nil, false, []string{u1}, nil},
		{"--gpu 1", []imagedesc.GPU{src(0, u0, 4<<30)}, twoH200, []int{1}, nil, false, []string{u1}, nil},
		{"--gpu per GPU", []imagedesc.GPU{src(0, u0, 1), src(1, u1, 1)}, twoH200, []int{1, 0}, nil, false, []string{u1, u0}, nil},
		{"--gpu-map by uuid", []imagedesc.GPU{src(0, u0, 1)}, twoH200, nil, map[string]string{u0: u1}, false, []string{u1}, nil},
		{"--gpu-map by index, partial", []imagedesc.GPU{src(0, u0, 1), src(1, u1, 1)}, three, nil, map[string]string{"1": "2"}, false, []string{u0, u2}, nil},
		{"another chip family: refused", []imagedesc.GPU{src(0, u0, 1)}, mixed, []int{1}, nil, false, nil, ErrChipMismatch},
		{"another model of the same chip family (H200 to H100)", []imagedesc.GPU{src(0, u0, 1)}, h200h100, []int{1}, nil, false, []string{u1}, nil},
		{"not enough memory", []imagedesc.GPU{src(0, u0, 4<<30)}, full, []int{1}, nil, false, nil, ErrNoRoom},
		{"restore needs memory on the same GPU too", []imagedesc.GPU{src(1, u1, 4<<30)}, full, nil, nil, false, nil, ErrNoRoom},
		{"live and unmoved needs no room", []imagedesc.GPU{src(1, u1, 4<<30)}, full, []int{1}, nil, true, []string{u1}, nil},
		{"missing target", []imagedesc.GPU{src(0, u0, 1)}, twoH200, []int{5}, nil, false, nil, gpu.ErrNoSuchGPU},
		{"other host, index absent", []imagedesc.GPU{src(3, uX, 1)}, twoH200, nil, nil, false, nil, gpu.ErrNoSuchGPU},
		{"one target for two GPUs", []imagedesc.GPU{src(0, u0, 1), src(1, u1, 1)}, twoH200, []int{1}, nil, false, nil, ErrBadTarget},
		{"three targets for two GPUs", []imagedesc.GPU{src(0, u0, 1), src(1, u1, 1)}, three, []int{0, 1, 2}, nil, false, nil, ErrBadTarget},
		{"duplicate target", []imagedesc.GPU{src(0, u0, 1), src(1, u1, 1)}, twoH200, []int{1, 1}, nil, false, nil, ErrBadTarget},
		{"map names an unused GPU", []imagedesc.GPU{src(0, u0, 1)}, twoH200, nil, map[string]string{u2: u1}, false, nil, ErrBadTarget},
		{"both --gpu and --gpu-map", []imagedesc.GPU{src(0, u0, 1)}, twoH200, []int{1}, map[string]string{u0: u1}, false, nil, ErrBadTarget},
		{"no GPUs recorded, no remap", nil, twoH200, nil, nil, false, nil, nil},
		{"no GPUs recorded, remap asked", nil, twoH200, []int{1}, nil, false, nil, ErrBadTarget},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// The process saw only the GPUs it used: these cases are about the used GPUs' targets.
			pairs, err := PlanPairs(tt.src, tt.src, tt.devs, tt.targets, tt.gmap, tt.live)
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
	_, err := PlanPairs([]imagedesc.GPU{src(0, u0, 1)}, nil, []gpu.Device{dev(0, u0, "NVIDIA H200", 0), a100Dev(1, u1)}, []int{1}, nil, false)
	for _, w := range []string{"NVIDIA H200", "NVIDIA A100-SXM4-80GB", "compute 8.0", u0, u1} {
		if err == nil || !contains(err.Error(), w) {
			t.Errorf("error %v does not name %s", err, w)
		}
	}
}

func contains(s, sub string) bool { return strings.Contains(s, sub) }

// TestModelChangePairs: a move onto another model of the same chip family is allowed and noted
// on the pair, with whether it was measured.
func TestModelChangePairs(t *testing.T) {
	tests := []struct {
		name           string
		from, to       string
		change, measur bool
	}{
		{"same model", "NVIDIA H200", "NVIDIA H200", false, false},
		{"H100 to H200 (measured)", "NVIDIA H100 80GB HBM3", "NVIDIA H200", true, true},
		{"H200 to H100 (measured)", "NVIDIA H200", "NVIDIA H100 80GB HBM3", true, true},
		{"H200 to GH200 (same family, not measured)", "NVIDIA H200", "NVIDIA GH200 480GB", true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := src(0, uX, 1<<30)
			s.Name = tt.from
			pairs, err := PlanPairs([]imagedesc.GPU{s}, []imagedesc.GPU{s}, []gpu.Device{dev(0, u0, tt.to, 0)}, nil, nil, false)
			if err != nil {
				t.Fatal(err)
			}
			p := pairs[0]
			if p.ModelChange != tt.change || p.ModelChangeMeasured != tt.measur || len(ModelChanges(pairs)) != map[bool]int{false: 0, true: 1}[tt.change] {
				t.Fatalf("pair %+v, want model change %v measured %v", p, tt.change, tt.measur)
			}
			// Unmeasured changes are refused unless allowed.
			err = CheckModelChanges(pairs, false)
			if (err != nil) != (tt.change && !tt.measur) || (err != nil && !errors.Is(err, ErrChipMismatch)) {
				t.Fatalf("CheckModelChanges = %v", err)
			}
			if err := CheckModelChanges(pairs, true); err != nil {
				t.Fatalf("allowed: %v", err)
			}
		})
	}
}

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
	bad := []Pair{{From: imagedesc.GPU{UUID: "GPU-x"}, To: dev(1, u1, "", 0)}}
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

const (
	u3   = "GPU-33333333-3333-3333-3333-333333333333"
	uA0  = "GPU-a0a0a0a0-0000-0000-0000-000000000000" // GPUs of the host an image came from
	uA1  = "GPU-a1a1a1a1-1111-1111-1111-111111111111"
	uA2  = "GPU-a2a2a2a2-2222-2222-2222-222222222222"
	uA3  = "GPU-a3a3a3a3-3333-3333-3333-333333333333"
	h100 = "NVIDIA H100 80GB HBM3"
	h200 = "NVIDIA H200"
)

func gpus(devs ...gpu.Device) []imagedesc.GPU { return StoreGPUs(devs, nil) }

func chip(g imagedesc.GPU, name string) imagedesc.GPU { g.Name = name; return g }

func a100(g imagedesc.GPU) imagedesc.GPU {
	g.Name, g.ComputeCap = "NVIDIA A100-SXM4-80GB", "8.0"
	return g
}

// pairsText renders a plan as "FROM>TO" by index, with "*" on used pairs.
func pairsText(pairs []Pair) []string {
	var out []string
	for _, p := range pairs {
		s := fmt.Sprintf("%d>%d", p.From.Index, p.To.Index)
		if p.Used {
			s += "*"
		}
		out = append(out, s)
	}
	return out
}

// TestPlanVisiblePairs covers the bijection over the visible GPUs that driver 580 requires.
func TestPlanVisiblePairs(t *testing.T) {
	two := []gpu.Device{dev(0, u0, h200, 0), dev(1, u1, h200, 0)}
	four := []gpu.Device{dev(0, u0, h200, 0), dev(1, u1, h200, 0), dev(2, u2, h200, 0), dev(3, u3, h200, 0)}
	mixed3 := []gpu.Device{dev(0, u0, h200, 0), dev(1, u1, h200, 0), dev(2, u2, h100, 0)}
	h200a100 := []gpu.Device{dev(0, u0, h200, 0), a100Dev(1, u1)}
	gpu0Full := []gpu.Device{dev(0, u0, h200, 100<<30), dev(1, u1, h200, 0)}
	gpu1Full := []gpu.Device{dev(0, u0, h200, 0), dev(1, u1, h200, 100<<30)}
	cvd := func(v string, devs []gpu.Device) []imagedesc.GPU {
		vis, err := gpu.VisibleDevices(map[string]string{gpu.EnvVisibleDevices: v}, devs)
		if err != nil {
			t.Fatal(err)
		}
		return gpus(vis...)
	}
	otherHost2 := []imagedesc.GPU{src(0, uA0, 1), src(1, uA1, 1)}
	otherHost4 := []imagedesc.GPU{src(0, uA0, 1), src(1, uA1, 1), src(2, uA2, 1), src(3, uA3, 1)}
	tests := []struct {
		name     string
		used     []imagedesc.GPU
		visible  []imagedesc.GPU
		devs     []gpu.Device
		targets  []int
		gmap     map[string]string
		live     bool
		want     []string
		wantErr  error
		noDriver bool // DriverPairs must be nil (nothing moves)
	}{
		{"2 GPUs, move 0 to 1: swap", []imagedesc.GPU{src(0, u0, 1)}, gpus(two...), two, []int{1}, nil, false, []string{"0>1*", "1>0"}, nil, false},
		{"2 GPUs, move 1 to 0: swap", []imagedesc.GPU{src(1, u1, 1)}, gpus(two...), two, []int{0}, nil, true, []string{"1>0*", "0>1"}, nil, false},
		{"4 GPUs, move 0 to 2", []imagedesc.GPU{src(0, u0, 1)}, gpus(four...), four, []int{2}, nil, false, []string{"0>2*", "1>1", "2>0", "3>3"}, nil, false},
		{"4 GPUs, move 0,1 to 2,3", []imagedesc.GPU{src(0, u0, 1), src(1, u1, 1)}, gpus(four...), four, []int{2, 3}, nil, false, []string{"0>2*", "1>3*", "2>0", "3>1"}, nil, false},
		{"4 GPUs, move 3 to 0 by --gpu-map", []imagedesc.GPU{src(3, u3, 1)}, gpus(four...), four, nil, map[string]string{u3: "0"}, false, []string{"3>0*", "0>3", "1>1", "2>2"}, nil, false},
		{"CUDA_VISIBLE_DEVICES=2,3 (indexes), move 2 to 0", []imagedesc.GPU{src(2, u2, 1)}, cvd("2,3", four), four, []int{0}, nil, false, []string{"2>0*", "3>3"}, nil, false},
		{"CUDA_VISIBLE_DEVICES by UUID prefix, move 1 to 3", []imagedesc.GPU{src(1, u1, 1)}, cvd("GPU-1111,GPU-3333", four), four, []int{3}, nil, false, []string{"1>3*", "3>1"}, nil, false},
		{"CUDA_VISIBLE_DEVICES=0,1 on 4 GPUs, move 0 to 2", []imagedesc.GPU{src(0, u0, 1)}, cvd("0,1", four), four, []int{2}, nil, false, []string{"0>2*", "1>1"}, nil, false},
		{"CUDA_VISIBLE_DEVICES=1,3 on 4 GPUs, move 1 to 0", []imagedesc.GPU{src(1, u1, 1)}, cvd("3,1", four), four, []int{0}, nil, false, []string{"1>0*", "3>3"}, nil, false},
		{"CUDA_VISIBLE_DEVICES=0 on 2 GPUs: one pair", []imagedesc.GPU{src(0, u0, 1)}, cvd("0", two), two, []int{1}, nil, false, []string{"0>1*"}, nil, false},
		{"no move: no driver pairs, visible listed", []imagedesc.GPU{src(0, u0, 1)}, gpus(two...), two, nil, nil, false, []string{"0>0*", "1>1"}, nil, true},
		{"no move, --gpu naming the same GPU", []imagedesc.GPU{src(1, u1, 1)}, gpus(four...), four, []int{1}, nil, false, []string{"1>1*", "0>0", "2>2", "3>3"}, nil, true},
		{"no move, a visible GPU gone from the host", []imagedesc.GPU{src(0, u0, 1)}, append(gpus(two...), src(5, uA3, 0)), two, nil, nil, false, []string{"0>0*"}, nil, true},
		{"no move, visible set unknown", []imagedesc.GPU{src(0, u0, 1)}, nil, two, nil, nil, false, []string{"0>0*"}, nil, true},
		{"mixed host: the other chip keeps its GPU", []imagedesc.GPU{src(0, u0, 1)}, gpus(mixed3...), mixed3, []int{1}, nil, false, []string{"0>1*", "1>0", "2>2"}, nil, false},
		{"other host, visible recorded: pairs by index", []imagedesc.GPU{src(1, uA1, 1)}, otherHost2, two, nil, nil, false, []string{"1>1*", "0>0"}, nil, false},
		{"other host, used GPU moved by --gpu", []imagedesc.GPU{src(1, uA1, 1)}, otherHost2, two, []int{0}, nil, false, []string{"1>0*", "0>1"}, nil, false},
		{"memory checked only where used memory goes", []imagedesc.GPU{src(0, u0, 4<<30)}, gpus(gpu0Full...), gpu0Full, []int{1}, nil, false, []string{"0>1*", "1>0"}, nil, false},
		{"used target without room refused", []imagedesc.GPU{src(0, u0, 4<<30)}, gpus(gpu1Full...), gpu1Full, []int{1}, nil, true, nil, ErrNoRoom, false},
		{"other chip needed for a visible GPU: refused", []imagedesc.GPU{src(0, uA0, 1)}, otherHost2, h200a100, nil, nil, false, nil, ErrChipMismatch, false},
		{"mixed chips in the visible set, target host all H200", []imagedesc.GPU{src(0, u0, 1)}, []imagedesc.GPU{src(0, u0, 1), a100(src(1, u1, 1))}, two, []int{1}, nil, false, nil, ErrChipMismatch, false},
		{"H100 in the visible set, target host all H200: same family", []imagedesc.GPU{src(0, u0, 1)}, []imagedesc.GPU{src(0, u0, 1), chip(src(1, u1, 1), h100)}, two, []int{1}, nil, false, []string{"0>1*", "1>0"}, nil, false},
		{"fewer target GPUs than visible: refused", []imagedesc.GPU{src(0, uA0, 1)}, otherHost4, two, nil, nil, false, nil, ErrTooFewGPUs, false},
		{"move with visible set unknown: refused", []imagedesc.GPU{src(0, u0, 1)}, nil, two, []int{1}, nil, false, nil, ErrVisibleUnknown, false},
		{"used GPU outside the visible set: refused", []imagedesc.GPU{src(1, u1, 1)}, cvd("0", two), two, []int{0}, nil, false, nil, ErrVisibleUnknown, false},
		{"visible GPU listed twice: refused", []imagedesc.GPU{src(0, u0, 1)}, append(gpus(two...), src(1, u1, 0)), two, []int{1}, nil, false, nil, ErrVisibleUnknown, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pairs, err := PlanPairs(tt.used, tt.visible, tt.devs, tt.targets, tt.gmap, tt.live)
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("err = %v, want %v", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := pairsText(pairs); !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("pairs = %v, want %v", got, tt.want)
			}
			dp, err := DriverPairs(pairs)
			if err != nil {
				t.Fatal(err)
			}
			if tt.noDriver != (dp == nil) {
				t.Fatalf("driver pairs = %v, want none: %v", dp, tt.noDriver)
			}
			if dp != nil && len(dp) != len(tt.visible) {
				t.Fatalf("%d driver pairs for %d visible GPUs", len(dp), len(tt.visible))
			}
		})
	}
}

func TestTooFewGPUsNamesBothSets(t *testing.T) {
	two := []gpu.Device{dev(0, u0, h200, 0), dev(1, u1, h200, 0)}
	vis := []imagedesc.GPU{src(0, uA0, 1), src(1, uA1, 1), src(2, uA2, 1)}
	_, err := PlanPairs(vis[:1], vis, two, nil, nil, false)
	for _, w := range []string{uA0, uA1, uA2, u0, u1, "sees 3 GPUs"} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("error %v does not name %s", err, w)
		}
	}
}

func TestDriverPairsRefusesNonBijection(t *testing.T) {
	dup := []Pair{{From: src(0, u0, 1), To: dev(1, u1, h200, 0), Used: true}, {From: src(1, u1, 1), To: dev(1, u1, h200, 0)}}
	if _, err := DriverPairs(dup); !errors.Is(err, ErrBadTarget) {
		t.Errorf("two GPUs onto one: %v, want ErrBadTarget", err)
	}
}

func TestAssumeVisible(t *testing.T) {
	two := []gpu.Device{dev(0, u0, h200, 0), dev(1, u1, h200, 0)}
	v, ok := AssumeVisible([]imagedesc.GPU{src(1, u1, 7)}, two)
	if !ok || len(v) != 2 || v[0].UUID != u0 || v[1].UUID != u1 || v[1].MemoryBytes != 7 || v[0].MemoryBytes != 0 {
		t.Errorf("same host: %+v, %v; want both GPUs, memory on GPU 1", v, ok)
	}
	if v, ok := AssumeVisible([]imagedesc.GPU{src(0, uX, 1)}, two); ok {
		t.Errorf("other host: %+v accepted; its GPUs cannot be named", v)
	}
	meta := &imagedesc.Description{GPUs: []imagedesc.GPU{src(0, u0, 1)}, Visible: []imagedesc.GPU{src(0, u0, 1)}}
	if v, assumed := RecordedVisible(meta, two); assumed || len(v) != 1 {
		t.Errorf("recorded set: %+v, assumed %v", v, assumed)
	}
	meta.Visible = nil
	if v, assumed := RecordedVisible(meta, two); !assumed || len(v) != 2 {
		t.Errorf("older image: %+v, assumed %v", v, assumed)
	}
}

func TestPairString(t *testing.T) {
	p := Pair{From: src(0, u0, 1), To: dev(1, u1, h200, 0), Used: true}
	if got, want := p.String(), "GPU 0 ("+u0+") -> GPU 1 ("+u1+") [used]"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	p.Used = false
	if !strings.HasSuffix(p.String(), "[visible]") {
		t.Errorf("String() = %q, want [visible]", p.String())
	}
}

func TestCheckRoom(t *testing.T) {
	devs := []gpu.Device{dev(0, u0, "NVIDIA H200", 0), dev(1, u1, "NVIDIA H200", 0)}
	pairs, err := PlanPairs([]imagedesc.GPU{src(0, u0, 1)}, StoreGPUs(devs, nil), devs, []int{1}, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	if err := CheckRoom(pairs, devs, true); err != nil {
		t.Fatalf("room available: %v", err)
	}
	full := []gpu.Device{devs[0], devs[1]}
	full[1].MemoryUsed = full[1].MemoryTotal
	if err := CheckRoom(pairs, full, true); !errors.Is(err, ErrNoRoom) {
		t.Fatalf("full target: err = %v, want ErrNoRoom", err)
	}
	if err := CheckRoom(pairs, devs[:1], true); !errors.Is(err, ErrBadTarget) {
		t.Fatalf("vanished target: err = %v, want ErrBadTarget", err)
	}
}

// TestCheckRoomLive: a live move counts the memory the moved processes give back on each GPU
// (a job's ranks swapped, or the two GPUs of one process), and only that: a GPU kept in place
// takes its memory back, so it frees nothing for another.
func TestCheckRoomLive(t *testing.T) {
	const gib = uint64(1) << 30
	at := func(used0, used1 uint64) []gpu.Device {
		d0, d1 := dev(0, u0, "NVIDIA H200", 0), dev(1, u1, "NVIDIA H200", 0)
		d0.MemoryTotal, d1.MemoryTotal = 100*gib, 100*gib
		d0.MemoryUsed, d1.MemoryUsed = used0, used1
		return []gpu.Device{d0, d1}
	}
	pair := func(from, to int, mem uint64) Pair {
		uu := []string{u0, u1}
		return Pair{From: src(from, uu[from], mem), To: dev(to, uu[to], "NVIDIA H200", 0), Used: true}
	}
	tests := []struct {
		name  string
		pairs []Pair
		devs  []gpu.Device
		live  bool
		ok    bool
	}{
		{"swap of 80 GiB each way on full GPUs", []Pair{pair(0, 1, 80*gib), pair(1, 0, 80*gib)}, at(90*gib, 90*gib), true, true},
		{"swap of 80 GiB each way, 30 GiB taken by others", []Pair{pair(0, 1, 80*gib), pair(1, 0, 40*gib)}, at(70*gib, 70*gib), true, false},
		{"swap from an image (nothing given back)", []Pair{pair(0, 1, 80*gib), pair(1, 0, 80*gib)}, at(90*gib, 90*gib), false, false},
		{"a GPU kept in place frees nothing", []Pair{pair(0, 0, 60*gib), pair(1, 0, 35*gib)}, at(70*gib, 40*gib), true, false},
		{"move into room", []Pair{pair(0, 1, 30*gib)}, at(40*gib, 60*gib), true, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := CheckRoom(tt.pairs, tt.devs, tt.live)
			if tt.ok != (err == nil) || err != nil && !errors.Is(err, ErrNoRoom) {
				t.Fatalf("CheckRoom = %v, want ok=%v", err, tt.ok)
			}
		})
	}
}
