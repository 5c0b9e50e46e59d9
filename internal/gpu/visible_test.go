package gpu

import (
	"errors"
	"os"
	"os/exec"
	"reflect"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/testreq"
)

const (
	vu0 = "GPU-0a1b2c3d-0000-0000-0000-000000000000"
	vu1 = "GPU-0a1b9999-1111-1111-1111-111111111111"
	vu2 = "GPU-77777777-2222-2222-2222-222222222222"
	vu3 = "GPU-88888888-3333-3333-3333-333333333333"
)

func fourGPUs(names ...string) []Device {
	uuids := []string{vu0, vu1, vu2, vu3}
	var out []Device
	for i, u := range uuids {
		name := "NVIDIA H200"
		if i < len(names) {
			name = names[i]
		}
		out = append(out, Device{Index: i, UUID: u, Name: name, ComputeCap: "9.0"})
	}
	return out
}

func TestVisibleDevices(t *testing.T) {
	same := fourGPUs()
	mixed := fourGPUs("NVIDIA H200", "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3")
	unset := map[string]string{"PATH": "/bin"}
	cvd := func(v string) map[string]string { return map[string]string{EnvVisibleDevices: v} }
	tests := []struct {
		name    string
		env     map[string]string
		devs    []Device
		want    []int // NVML indexes
		wantErr error
	}{
		{"unset: every GPU", unset, same, []int{0, 1, 2, 3}, nil},
		{"unset on a mixed host: every GPU", unset, mixed, []int{0, 1, 2, 3}, nil},
		{"one index", cvd("1"), same, []int{1}, nil},
		{"indexes, any order, sorted", cvd("3,0"), same, []int{0, 3}, nil},
		{"spaces tolerated", cvd(" 2 , 1 "), same, []int{1, 2}, nil},
		{"full UUID", cvd(vu2), same, []int{2}, nil},
		{"UUID prefix", cvd("GPU-7777"), same, []int{2}, nil},
		{"UUID prefix, upper case", cvd("GPU-0A1B2C"), same, []int{0}, nil},
		{"UUID and index mixed", cvd("GPU-8888,1"), same, []int{1, 3}, nil},
		{"ambiguous prefix stops enumeration", cvd("2,GPU-0a1b,3"), same, []int{2}, nil},
		{"empty value: no GPUs", cvd(""), same, nil, nil},
		{"garbage: no GPUs", cvd("banana"), same, nil, nil},
		{"bare GPU- prefix: no GPUs", cvd("GPU-"), same, nil, nil},
		{"stops at an invalid entry", cvd("0,2,-1,1"), same, []int{0, 2}, nil},
		{"stops at an absent index", cvd("1,7,2"), same, []int{1}, nil},
		{"stops at a duplicate", cvd("1,1,2"), same, []int{1}, nil},
		{"stops at an unknown UUID", cvd("GPU-ffff,0"), same, nil, nil},
		{"NoDevFiles-style garbage", cvd("NoDevFiles"), same, nil, nil},
		{"MIG refused", cvd("MIG-4f2e7c1a-1111-2222-3333-444444444444"), same, nil, ErrMIG},
		{"MIG-GPU form refused", cvd("0,MIG-GPU-0a1b2c3d-0000-0000-0000-000000000000/1/0"), same, nil, ErrMIG},
		{"mixed host, indexes, default order: refused", cvd("0"), mixed, nil, ErrDeviceOrder},
		{"mixed host, indexes, PCI order", map[string]string{EnvVisibleDevices: "2,0", EnvDeviceOrder: "PCI_BUS_ID"}, mixed, []int{0, 2}, nil},
		{"mixed host, UUIDs need no order", cvd("GPU-8888"), mixed, []int{3}, nil},
		{"no GPUs on the host", cvd("0"), nil, nil, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := VisibleDevices(tt.env, tt.devs)
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("err = %v, want %v", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var idx []int
			for _, d := range got {
				idx = append(idx, d.Index)
			}
			if !reflect.DeepEqual(idx, tt.want) {
				t.Fatalf("visible = %v, want %v", idx, tt.want)
			}
		})
	}
}

func TestParseEnviron(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want map[string]string
	}{
		{"empty", "", map[string]string{}},
		{"plain", "A=1\x00B=two\x00", map[string]string{"A": "1", "B": "two"}},
		{"no trailing NUL", "A=1\x00B=2", map[string]string{"A": "1", "B": "2"}},
		{"empty value kept", "CUDA_VISIBLE_DEVICES=\x00", map[string]string{"CUDA_VISIBLE_DEVICES": ""}},
		{"value with '='", "X=a=b\x00", map[string]string{"X": "a=b"}},
		{"first definition wins", "A=1\x00A=2\x00", map[string]string{"A": "1"}},
		{"garbage skipped", "junk\x00=novalue\x00\x00\xff\xfe\x00C=3\x00", map[string]string{"C": "3"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := ParseEnviron([]byte(tt.in)); !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("ParseEnviron(%q) = %v, want %v", tt.in, got, tt.want)
			}
		})
	}
}

// TestVisibleToRealProcess reads the environment of a real child process.
func TestVisibleToRealProcess(t *testing.T) {
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		testreq.Skip(t, "sleep", "no sleep(1) on this host")
	}
	cmd := exec.Command(sleep, "30")
	cmd.Env = []string{"PATH=/bin", EnvVisibleDevices + "=GPU-8888,1"}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	// The environ file is filled in at exec; wait for the child to have exec'd sleep.
	deadline := time.Now().Add(5 * time.Second)
	for {
		env, err := ProcessEnviron("/proc", cmd.Process.Pid)
		if err == nil && env[EnvVisibleDevices] == "GPU-8888,1" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("environment of the child never showed %s (%v, %v)", EnvVisibleDevices, env, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	got, err := VisibleTo(cmd.Process.Pid, fourGPUs())
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Index != 1 || got[1].Index != 3 {
		t.Fatalf("visible = %+v, want GPUs 1 and 3", got)
	}
	if _, err := VisibleTo(1<<22+12345, fourGPUs()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("absent pid: err = %v, want ErrNotExist", err)
	}
}
