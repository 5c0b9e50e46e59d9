package checkpoint

import (
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/internal/gpu"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

// fakeLister is an NVML inventory of two H200s on which pid runs on GPU 0.
type fakeLister struct{ pid int }

func (f fakeLister) Devices() ([]gpu.Device, error) {
	return []gpu.Device{
		{Index: 0, UUID: "GPU-00000000-0000-0000-0000-000000000000", Name: "NVIDIA H200", ComputeCap: "9.0", Minor: 0,
			Processes: []gpu.Process{{PID: f.pid, UsedMemory: 3 << 20}}},
		{Index: 1, UUID: "GPU-11111111-1111-1111-1111-111111111111", Name: "NVIDIA H200", ComputeCap: "9.0", Minor: 1},
	}, nil
}

// startWithEnv starts a real process with the given environment and waits until its
// /proc/PID/environ shows it (it is filled in at exec).
func startWithEnv(t *testing.T, env []string) int {
	t.Helper()
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		testreq.Skip(t, "sleep", "no sleep(1) on this host")
	}
	cmd := exec.Command(sleep, "30")
	cmd.Env = append([]string{"PTXMIG_TEST_MARK=1"}, env...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if e, err := gpu.ProcessEnviron("/proc", cmd.Process.Pid); err == nil && e["PTXMIG_TEST_MARK"] == "1" {
			return cmd.Process.Pid
		}
		if time.Now().After(deadline) {
			t.Fatal("child never exec'd")
		}
	}
}

// TestSourceGPUsRecordsVisible checks that the image records every GPU of the host as the set to
// pair on restore, whatever CUDA_VISIBLE_DEVICES real processes were started with (the driver
// pairs over all host GPUs), and that MIG instances are refused.
func TestSourceGPUsRecordsVisible(t *testing.T) {
	tests := []struct {
		name        string
		env         []string
		wantVisible []int
		wantErr     error
	}{
		{"unset: every GPU", nil, []int{0, 1}, nil},
		{"index subset: still every GPU", []string{"CUDA_VISIBLE_DEVICES=0"}, []int{0, 1}, nil},
		{"UUID prefixes", []string{"CUDA_VISIBLE_DEVICES=GPU-1111,GPU-0000"}, []int{0, 1}, nil},
		{"other GPU only: still every GPU", []string{"CUDA_VISIBLE_DEVICES=1"}, []int{0, 1}, nil},
		{"garbage: still every GPU", []string{"CUDA_VISIBLE_DEVICES=banana"}, []int{0, 1}, nil},
		{"MIG refused", []string{"CUDA_VISIBLE_DEVICES=MIG-4f2e7c1a-1111-2222-3333-444444444444"}, nil, gpu.ErrMIG},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pid := startWithEnv(t, tt.env)
			used, visible, err := (&op.Env{GPUs: fakeLister{pid: pid}}).TreeGPUs([]int{pid})
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("err = %v, want %v", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(used) != 1 || used[0].Index != 0 || used[0].MemoryBytes != 3<<20 {
				t.Fatalf("used = %+v, want GPU 0 with 3 MiB", used)
			}
			var idx []int
			for _, v := range visible {
				idx = append(idx, v.Index)
				if v.Index == 0 && v.MemoryBytes != 3<<20 || v.Index != 0 && v.MemoryBytes != 0 {
					t.Errorf("visible GPU %d records %d bytes", v.Index, v.MemoryBytes)
				}
			}
			if len(idx) != len(tt.wantVisible) {
				t.Fatalf("visible = %v, want %v", idx, tt.wantVisible)
			}
			for i := range idx {
				if idx[i] != tt.wantVisible[i] {
					t.Fatalf("visible = %v, want %v", idx, tt.wantVisible)
				}
			}
		})
	}
}

// sharedLister adds other processes to fakeLister's GPUs: others[i] runs on GPU i.
type sharedLister struct {
	fakeLister
	others []int
}

func (f sharedLister) Devices() ([]gpu.Device, error) {
	devs, _ := f.fakeLister.Devices()
	for i, pid := range f.others {
		if pid != 0 {
			devs[i].Processes = append(devs[i].Processes, gpu.Process{PID: pid})
		}
	}
	return devs, nil
}

// TestSharedWarning: a --leave-running checkpoint warns when the process's GPU also runs another
// process (not one of its own tree), and only for the GPUs it uses.
func TestSharedWarning(t *testing.T) {
	const pid, child = 500, 501
	used := []imagedesc.GPU{{Index: 0, UUID: "GPU-00000000-0000-0000-0000-000000000000"}}
	tree := []op.TreeProc{{PID: pid}, {PID: child}}
	tests := []struct {
		name   string
		others []int
		want   string
	}{
		{"alone", nil, ""},
		{"its own child beside it", []int{child}, ""},
		{"another process on another GPU", []int{0, 4242}, ""},
		{"another process on its GPU", []int{4242}, "GPU 0 also runs pid 4242"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := sharedWarning(&op.Env{GPUs: sharedLister{fakeLister{pid: pid}, tt.others}}, used, tree)
			if tt.want == "" && len(w) != 0 || tt.want != "" && (len(w) != 1 || !strings.HasPrefix(w[0], tt.want)) {
				t.Fatalf("warnings %q, want %q", w, tt.want)
			}
		})
	}
}
