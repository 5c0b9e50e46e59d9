//go:build gpu

package rebalance

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// GPU test (2-GPU host, run by scripts/gpu-e2e.sh): two busy counter processes on GPU 0 and none
// on GPU 1. A dry run moves nothing and explains; one run moves exactly one counter to GPU 1; an
// immediate second run moves nothing; both counters end with the checksum of an uninterrupted run.
// Needs PTXMIG_BIN, PTXMIG_WORKLOADS (compiled counter), root, and two GPUs of one chip type.

const (
	gpuCounterMiB   = 512
	gpuCounterSteps = 600 // ~60-70 s at --interval-ms 100 --busy
)

func gpuEnv(t *testing.T) (bin, counter, out string) {
	t.Helper()
	bin, wl := os.Getenv("PTXMIG_BIN"), os.Getenv("PTXMIG_WORKLOADS")
	if bin == "" || wl == "" {
		t.Skip("PTXMIG_BIN and PTXMIG_WORKLOADS not set (run through scripts/gpu-e2e.sh)")
	}
	counter = filepath.Join(wl, "counter")
	if _, err := os.Stat(counter); err != nil {
		t.Skipf("counter workload not built: %v", err)
	}
	if os.Geteuid() != 0 {
		t.Skip("live migration needs root")
	}
	gpus := smi(t, "--query-gpu=index,uuid,name", "--format=csv,noheader")
	if len(gpus) < 2 {
		t.Skipf("needs two GPUs, found %d", len(gpus))
	}
	if n0, n1 := field(gpus[0], 2), field(gpus[1], 2); n0 != n1 {
		t.Skipf("GPU 0 (%s) and GPU 1 (%s) differ in chip type", n0, n1)
	}
	out = os.Getenv("PTXMIG_OUT")
	if out == "" {
		out = t.TempDir()
	}
	return bin, counter, out
}

func smi(t *testing.T, args ...string) []string {
	t.Helper()
	b, err := exec.Command("nvidia-smi", args...).Output()
	if err != nil {
		t.Skipf("nvidia-smi: %v", err)
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			lines = append(lines, l)
		}
	}
	return lines
}

func field(line string, i int) string {
	f := strings.Split(line, ",")
	if i >= len(f) {
		return ""
	}
	return strings.TrimSpace(f[i])
}

// gpuIndexOf maps pid -> GPU index from nvidia-smi's compute-apps list.
func gpuIndexOf(t *testing.T) map[int]int {
	t.Helper()
	idx := map[string]int{}
	for _, l := range smi(t, "--query-gpu=index,uuid", "--format=csv,noheader") {
		var i int
		fmt.Sscan(field(l, 0), &i)
		idx[field(l, 1)] = i
	}
	out := map[int]int{}
	b, err := exec.Command("nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader").Output()
	if err != nil {
		t.Fatalf("nvidia-smi compute apps: %v", err)
	}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var pid int
		if _, err := fmt.Sscan(field(l, 0), &pid); err == nil {
			out[pid] = idx[field(l, 1)]
		}
	}
	return out
}

func finalChecksum(b []byte) string {
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "final checksum ") {
			return strings.TrimPrefix(l, "final checksum ")
		}
	}
	return ""
}

// runRebalance runs `ptxmig --json rebalance ARGS` and decodes its report.
func runRebalance(t *testing.T, bin, store, out, name string, args ...string) Report {
	t.Helper()
	full := append([]string{"--store", store, "--log-level", "info", "--json", "rebalance", "--window", "3s", "--min-age", "0s"}, args...)
	cmd := exec.Command(bin, full...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	os.WriteFile(filepath.Join(out, "rebalance-"+name+".json"), stdout.Bytes(), 0o644)
	os.WriteFile(filepath.Join(out, "rebalance-"+name+".log"), stderr.Bytes(), 0o644)
	if err != nil {
		t.Fatalf("%s: ptxmig %s: %v\n%s\n%s", name, strings.Join(full, " "), err, stdout.String(), stderr.String())
	}
	var rep Report
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatalf("%s: decode report: %v\n%s", name, err, stdout.String())
	}
	return rep
}

func TestGPURebalanceTwoCounters(t *testing.T) {
	bin, counter, out := gpuEnv(t)
	if apps := gpuIndexOf(t); len(apps) > 0 {
		t.Skipf("GPUs are not idle: compute processes %v", apps)
	}
	// Reference: an uninterrupted run, no pauses.
	ref, err := exec.Command(counter, "--mib", fmt.Sprint(gpuCounterMiB), "--steps", fmt.Sprint(gpuCounterSteps), "--interval-ms", "0", "--device", "1").Output()
	want := finalChecksum(ref)
	if err != nil || want == "" {
		t.Fatalf("reference counter: %v\n%s", err, ref)
	}

	type proc struct {
		cmd  *exec.Cmd
		out  bytes.Buffer
		read chan struct{} // closed when stdout reached EOF
	}
	var procs []*proc
	env := []string{}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CUDA_VISIBLE_DEVICES=") {
			env = append(env, kv)
		}
	}
	for i := 0; i < 2; i++ {
		p := &proc{cmd: exec.Command(counter, "--mib", fmt.Sprint(gpuCounterMiB), "--steps", fmt.Sprint(gpuCounterSteps),
			"--interval-ms", "100", "--busy", "--device", "0")}
		p.cmd.Env = env
		pipe, _ := p.cmd.StdoutPipe()
		p.cmd.Stderr = os.Stderr
		if err := p.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		r := bufio.NewReader(pipe)
		for { // wait for the first step so the process holds its GPU memory
			line, err := r.ReadString('\n')
			p.out.WriteString(line)
			if err != nil {
				t.Fatalf("counter %d: %v\n%s", i, err, p.out.String())
			}
			if strings.HasPrefix(line, "step 1 ") {
				break
			}
		}
		p.read = make(chan struct{})
		go func() { p.out.ReadFrom(r); close(p.read) }()
		procs = append(procs, p)
		t.Cleanup(func() { p.cmd.Process.Kill() })
	}
	pids := []int{procs[0].cmd.Process.Pid, procs[1].cmd.Process.Pid}
	where := gpuIndexOf(t)
	if where[pids[0]] != 0 || where[pids[1]] != 0 {
		t.Fatalf("counters not on GPU 0: %v", where)
	}
	store := t.TempDir()

	// 1. Dry run: plans one move, explains both, moves nothing.
	rep := runRebalance(t, bin, store, out, "dry-run", "--dry-run")
	if len(rep.Plan.Moves) != 1 || len(rep.Results) != 0 || rep.Moved != 0 {
		t.Fatalf("dry run: plan %+v results %+v", rep.Plan.Moves, rep.Results)
	}
	for _, pid := range pids {
		found := false
		for _, d := range rep.Plan.Decisions {
			if d.PID == pid && d.Reason != "" {
				found = true
				t.Logf("dry run: pid %d move=%v: %s", pid, d.Move, d.Reason)
			}
		}
		if !found {
			t.Errorf("dry run does not explain pid %d", pid)
		}
	}
	if where := gpuIndexOf(t); where[pids[0]] != 0 || where[pids[1]] != 0 {
		t.Fatalf("dry run moved a process: %v", where)
	}
	if _, err := os.Stat(filepath.Join(store, "rebalance", StateFile)); err == nil {
		t.Error("dry run wrote state")
	}

	// 2. One run moves exactly one counter to GPU 1.
	rep = runRebalance(t, bin, store, out, "run1", "--metrics-file", filepath.Join(out, "rebalance.prom"))
	if rep.Moved != 1 || len(rep.Results) != 1 || !rep.Results[0].OK || rep.Results[0].Move.To.Index != 1 {
		t.Fatalf("run 1: moved %d, results %+v", rep.Moved, rep.Results)
	}
	t.Logf("run 1: moved pid %d to GPU 1 in %.2f s", rep.Results[0].Move.PID, rep.Results[0].Seconds)
	where = gpuIndexOf(t)
	on := map[int]int{}
	for _, pid := range pids {
		on[where[pid]]++
	}
	if on[0] != 1 || on[1] != 1 {
		t.Fatalf("after run 1: counters at %v, want one on each GPU", where)
	}

	// 3. An immediate second run moves nothing.
	rep = runRebalance(t, bin, store, out, "run2")
	if len(rep.Plan.Moves) != 0 || rep.Moved != 0 {
		t.Fatalf("run 2 moved: %+v", rep.Plan.Moves)
	}
	for _, d := range rep.Plan.Decisions {
		t.Logf("run 2: pid %d: %s", d.PID, d.Reason)
	}

	// Both counters finish with the uninterrupted run's checksum.
	for i, p := range procs {
		select {
		case <-p.read:
		case <-time.After(3 * time.Minute):
			t.Fatalf("counter %d did not finish", i)
		}
		if err := p.cmd.Wait(); err != nil {
			t.Errorf("counter %d: %v", i, err)
		}
		got := finalChecksum(p.out.Bytes())
		os.WriteFile(filepath.Join(out, fmt.Sprintf("rebalance-counter%d.log", i)), p.out.Bytes(), 0o644)
		if got != want {
			t.Errorf("counter %d (pid %d): final checksum %q, want %q", i, pids[i], got, want)
		}
	}
}
