//go:build gpu

package gputest

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// The lines of a sample's output that must not change between runs (its verdicts, not its
// timings): the patterns of bench/bench-p2.sh, plus the samples' "...inspecting ...: OK" lines.
var (
	verdictKeep = regexp.MustCompile(`^(final|checksum|result|part )|^\s*\.\.\.|Test passed|Test failed|PASS|FAIL|[Pp]assed|[Ff]ailed|[Ee]rror`)
	verdictDrop = regexp.MustCompile(`time|[Tt]hroughput|GFlop|GB/s|[0-9]+\.[0-9]+ *(ms|s|sec)\b|msec|MOptions|Gops`)
	midDesc     = regexp.MustCompile(`__ptxmig_mid_[A-Za-z0-9_$]+`)
)

// midAlways: every kernel with PTX as a twin, mid-block twins where a kernel has sites.
var midAlways = []string{"--preempt", "always", "--mid-block"}

func verdict(path string) string {
	var keep []string
	for _, l := range lines(path) {
		if verdictKeep.MatchString(l) && !verdictDrop.MatchString(l) {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "\n")
}

// buildSamples compiles every sample of the bundle's samples/ (NVIDIA/cuda-samples sources) for
// sm_90 with PTX, so that the shim can instrument them, as bench-p2.sh does. A sample that does
// not build is logged and left out.
func buildSamples(t *testing.T) map[string]string {
	t.Helper()
	src := os.Getenv("PTXMIG_SAMPLES")
	if st, err := os.Stat(filepath.Join(src, "Common")); src == "" || err != nil || !st.IsDir() {
		t.Skip("no cuda-samples in the bundle (gpu-bundle.sh with PTXMIG_CUDA_SAMPLES=DIR)")
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	var mu sync.Mutex
	built := map[string]string{}
	var wg sync.WaitGroup
	for _, e := range ents {
		if !e.IsDir() || e.Name() == "Common" {
			continue
		}
		wg.Add(1)
		go func(name string) {
			defer wg.Done()
			files, _ := filepath.Glob(filepath.Join(src, name, "*.cu"))
			cpp, _ := filepath.Glob(filepath.Join(src, name, "*.cpp"))
			exe := filepath.Join(dir, name)
			args := append([]string{"-O3", "-std=c++17", "-I" + filepath.Join(src, "Common"), "-gencode", "arch=compute_90,code=sm_90",
				"-gencode", "arch=compute_90,code=compute_90", "-o", exe}, append(files, cpp...)...)
			o, err := exec.Command("nvcc", append(args, "-lpthread")...).CombinedOutput()
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				t.Logf("sample %s did not build: %v\n%s", name, err, o)
				return
			}
			built[name] = exe
		}(e.Name())
	}
	wg.Wait()
	if len(built) == 0 {
		t.Fatal("no sample built")
	}
	return built
}

// TestMidBlockSamples: public NVIDIA cuda-samples programs run under `ptxmig run --preempt always
// --mid-block` (every kernel with PTX as a twin; kernels with safe points inside their blocks as
// mid-block twins) give the same verdicts as plain runs; which kernels got mid-block twins is read from each
// sample's instrumentation cache. Then matrixMul (8192^2, 300 launches of a kernel whose blocks loop
// over tiles with CTA-wide barriers) is checkpointed with --leave-running five times while it
// runs: the kernels in flight stop inside their blocks and the run still passes its own check.
func TestMidBlockSamples(t *testing.T) {
	devs := need(t, 1)
	if devs[0].ComputeCap != "9.0" {
		t.Skipf("the samples are built for sm_90; GPU 0 is %s (%s)", devs[0].Name, devs[0].ComputeCap)
	}
	samples := buildSamples(t)
	names := make([]string, 0, len(samples))
	for n := range samples {
		names = append(names, n)
	}
	sort.Strings(names)
	args := map[string][]string{"matrixMul": {"-wA=2048", "-hA=2048", "-wB=2048", "-hB=2048"}}
	var report strings.Builder
	fmt.Fprintf(&report, "cuda-samples under ptxmig run --preempt always --mid-block, %s, %s\n", devs[0].Name, time.Now().UTC().Format(time.RFC3339))
	midKernels := 0
	for _, n := range names {
		plain := start(t, samples[n], args[n]...)
		wait(t, plain, 3*time.Minute)
		cache := filepath.Join(t.TempDir(), "cache")
		sh := startShimmedCache(t, midAlways, cache, samples[n], args[n]...)
		wait(t, sh, 3*time.Minute)
		want, got := verdict(plain.log), verdict(sh.log)
		if want == "" {
			t.Errorf("%s: the plain run printed no verdict line:\n%s", n, strings.Join(lines(plain.log), "\n"))
		}
		if got != want {
			t.Errorf("%s: verdict under ptxmig run differs:\n--- got\n%s\n--- want (plain)\n%s", n, got, want)
		}
		mids := cachedMidKernels(t, cache)
		midKernels += len(mids)
		fmt.Fprintf(&report, "%-22s verdict %-5v mid-block twins %d %v\n", n, got == want, len(mids), mids)
	}
	if exe, ok := samples["matrixMul"]; ok {
		report.WriteString(checkpointMatrixMul(t, exe))
	}
	t.Log(report.String())
	_ = os.WriteFile(filepath.Join(out, "midblock-samples.txt"), []byte(report.String()), 0o644)
	if midKernels == 0 {
		t.Error("no sample kernel got a mid-block twin")
	}
}

// wait waits for a started process to exit.
func wait(t *testing.T, p *proc, d time.Duration) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(d):
		t.Fatalf("pid %d still running after %s; log:\n%s", p.pid, d, strings.Join(lines(p.log), "\n"))
	}
}

// cachedMidKernels lists the kernels whose instrumented module (PTX or cubin in the shim's cache)
// carries a mid-block record layout.
func cachedMidKernels(t *testing.T, cache string) []string {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(cache, "*"))
	seen := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, ".why") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range midDesc.FindAll(b, -1) {
			seen[strings.TrimPrefix(string(m), "__ptxmig_mid_")] = true
		}
	}
	var out []string
	for k := range seen {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// checkpointMatrixMul checkpoints a running matrixMul with --leave-running five times and checks
// that it still passes; it returns the report lines.
func checkpointMatrixMul(t *testing.T, exe string) string {
	t.Helper()
	// About 20 s of kernels on an H100; its output is block-buffered (a file), so the test does
	// not wait for a line: the first checkpoint comes 3 s after the start, within the loop.
	args := []string{"-wA=8192", "-hA=8192", "-wB=8192", "-hB=8192"}
	p := startShimmedCache(t, midAlways, filepath.Join(t.TempDir(), "cache"), exe, args...)
	time.Sleep(3 * time.Second)
	var b strings.Builder
	mid := 0
	for i := 0; i < 5; i++ {
		so, se, code, _ := ptxmigWithin(t, time.Minute, "--json", "checkpoint", "--leave-running", "--name",
			fmt.Sprintf("mm-%d", i), strconv.Itoa(p.pid))
		if code != 0 {
			t.Fatalf("checkpoint %d of matrixMul: exit %d: %s", i, code, se)
		}
		var r ckptJSON
		if err := json.Unmarshal([]byte(so), &r); err != nil || len(r.Preemption) != 1 || r.Preemption[0].Quiesce == nil {
			t.Fatalf("checkpoint %d: no quiesce report: %v\n%s", i, err, so)
		}
		q := r.Preemption[0].Quiesce
		for _, l := range q.Preempted {
			fmt.Fprintf(&b, "matrixMul checkpoint %d: quiesce %d us: %s stopped %s, %d records, %d of %d blocks done\n", i, q.ElapsedUS,
				l.Kernel, l.Stop, l.Records, l.BlocksDone, l.BlocksTotal)
			if l.MidBlockStop() {
				mid++
			}
		}
		if len(q.Preempted) == 0 {
			fmt.Fprintf(&b, "matrixMul checkpoint %d: quiesce %d us: nothing preempted (drained %d, left to the lock %d)\n", i, q.ElapsedUS,
				len(q.Drained), len(q.NotStopped)+len(q.Originals))
		}
		time.Sleep(300 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	select {
	case <-p.done:
	case <-ctx.Done():
		t.Fatal("matrixMul did not finish after the checkpoints")
	}
	if v := verdict(p.log); !strings.Contains(v, "Result = PASS") {
		t.Errorf("matrixMul after five checkpoints: %q, want Result = PASS; log:\n%s", v, strings.Join(lines(p.log), "\n"))
	}
	if mid == 0 {
		t.Errorf("no checkpoint of matrixMul stopped a kernel mid-block:\n%s", b.String())
	}
	return b.String()
}
