package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/shimctl/shimctltest"
)

// serveKernels answers kernels requests on dir/<our pid>.sock with reply, as the shim would for
// this process (ptxmig checks the socket's peer pid, so the test process serves its own).
func serveKernels(t *testing.T, reply string) string {
	t.Helper()
	dir := t.TempDir()
	shimctltest.Serve(t, filepath.Join(dir, strconv.Itoa(os.Getpid())+".sock"), map[string]string{"kernels": reply + "\n"})
	return dir
}

func TestKernelsOutput(t *testing.T) {
	kernels := func(extra string) string {
		return `"kernels":[{"name":"k","handle":"0x1","module":1,"launches":5,"shapes":[{"grid":[2,1,1],"block":[128,1,1],"launches":5}],"timed":2,"time_us":{"p50":1.5,"p99":2,"mean":1.7,"max":2}` + extra + `}],"graphs":[],"total_launches":5`
	}
	tests := []struct {
		name, selfTime, kernel string
		want, notWant          []string
	}{
		{name: "no self time (older shim)", want: []string{"1 kernels, 5 launches"}, notWant: []string{"bookkeeping"}},
		{name: "self time off", selfTime: `,"self_time":{"enabled":false,"launches":0,"ns":0,"clock_ns":0}`,
			want: []string{"1 kernels, 5 launches"}, notWant: []string{"bookkeeping"}},
		{name: "twin launched as the original", selfTime: `,"self_time":null`,
			kernel: `,"twin":true,"twin_reason":null,"twin_launches":2,"original_reason":"grid fits in one wave (auto: its twin could not stop sooner)"`,
			want:   []string{"yes (2)", "ran as the original: k: 3 of 5 launches, the last because: grid fits in one wave"}},
		{name: "mid-block twin", selfTime: `,"self_time":null`,
			kernel: `,"twin":true,"twin_reason":null,"twin_launches":5,"mid_block":{"sites":2,"register_slots":5,"static_shared_bytes":0,"local_bytes":0,"launches":5,"stops":1}`,
			want:   []string{"mid-block (5)"}, notWant: []string{"yes (5)"}},
		{name: "self time on", selfTime: `,"self_time":{"enabled":true,"launches":5,"ns":1500,"clock_ns":25}`,
			want: []string{"2x1x1/128x1x1", "shim bookkeeping: 300 ns per launch (5 launches, 0.002 ms in all; includes 2 clock reads of 25 ns each)"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := serveKernels(t, `{"ok":true,"proto":1,"cmd":"kernels","result":{`+kernels(tt.kernel)+tt.selfTime+`}}`)
			out, errOut, code := runCLI(t, "kernels", "--socket-dir", dir, strconv.Itoa(os.Getpid()))
			if code != 0 {
				t.Fatalf("exit %d: %s", code, errOut)
			}
			for _, w := range tt.want {
				if !strings.Contains(out, w) {
					t.Errorf("output lacks %q:\n%s", w, out)
				}
			}
			for _, w := range tt.notWant {
				if strings.Contains(out, w) {
					t.Errorf("output has %q:\n%s", w, out)
				}
			}
		})
	}
}
