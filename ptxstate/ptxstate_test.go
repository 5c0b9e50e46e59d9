package ptxstate

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/golden"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

// corpus returns every PTX file of the test corpus (nvcc 13 and nvcc 12.4 output, hand-written
// edge cases) plus the *.ptx files of the directories in $PTXSTATE_EXTRA_PTX (colon-separated),
// so that the round-trip, instrumentation, ptxas and convergence tests can be run on PTX that is
// not committed (TestGolden covers the committed files only).
func corpus(t testing.TB) []string {
	t.Helper()
	files := committedCorpus(t)
	for _, dir := range filepath.SplitList(os.Getenv("PTXSTATE_EXTRA_PTX")) {
		if dir == "" {
			continue
		}
		m, err := filepath.Glob(filepath.Join(dir, "*.ptx"))
		if err != nil || len(m) == 0 {
			t.Fatalf("PTXSTATE_EXTRA_PTX: no *.ptx in %s (%v)", dir, err)
		}
		files = append(files, m...)
	}
	return files
}

// committedCorpus returns the PTX files under testdata/.
func committedCorpus(t testing.TB) []string {
	t.Helper()
	var files []string
	for _, pat := range []string{"testdata/corpus/*.ptx", "testdata/nvcc12/*.ptx", "testdata/public/*.ptx", "testdata/edge/*.ptx"} {
		m, err := filepath.Glob(pat)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	if len(files) == 0 {
		t.Fatal("no PTX corpus under testdata/")
	}
	return files
}

func mustParse(t testing.TB, path string) (*Module, []byte) {
	t.Helper()
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	m, err := Parse(src)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return m, src
}

func TestRoundTrip(t *testing.T) {
	for _, path := range corpus(t) {
		t.Run(filepath.Base(path), func(t *testing.T) {
			m, src := mustParse(t, path)
			if got := m.Bytes(); !bytes.Equal(got, src) {
				t.Fatalf("print(parse(x)) != x (%d vs %d bytes)", len(got), len(src))
			}
			// The instrumented module (with mid-block twins too) must itself parse and print
			// back unchanged.
			for _, o := range []Options{{}, {MidBlock: true}} {
				out, _, err := InstrumentWith(m, o)
				if err != nil {
					t.Fatal(err)
				}
				text := out.Bytes()
				m2, err := Parse(text)
				if err != nil {
					t.Fatalf("instrumented module (mid-block %v) does not parse: %v", o.MidBlock, err)
				}
				if !bytes.Equal(m2.Bytes(), text) {
					t.Fatalf("instrumented module (mid-block %v) does not round-trip", o.MidBlock)
				}
			}
			out, _, err := Instrument(m)
			if err != nil {
				t.Fatal(err)
			}
			text := out.Bytes()
			// Instrumenting never changes the original items.
			if !bytes.HasPrefix(text, src[:len(src)-len(m.Trailer)][:firstFuncEnd(m)]) {
				t.Fatal("text before the first twin changed")
			}
		})
	}
}

// firstFuncEnd is the byte length of the module up to the end of its first kernel.
func firstFuncEnd(m *Module) int {
	n := 0
	for _, it := range m.Items {
		n += len(it.Lead)
		if it.Func != nil {
			var b bytes.Buffer
			it.Func.print(&b)
			n += b.Len()
			if it.Func.Entry && !it.Func.Proto {
				return n
			}
		} else {
			n += len(it.Text)
		}
	}
	return n
}

func TestGolden(t *testing.T) {
	for _, path := range committedCorpus(t) {
		name := strings.TrimSuffix(filepath.Base(path), ".ptx")
		dir := filepath.Base(filepath.Dir(path))
		t.Run(dir+"/"+name, func(t *testing.T) {
			m, _ := mustParse(t, path)
			r, err := Analyze(m)
			if err != nil {
				t.Fatal(err)
			}
			js, err := json.MarshalIndent(r, "", "  ")
			if err != nil {
				t.Fatal(err)
			}
			golden.Check(t, filepath.Join("testdata", "golden", dir+"-"+name+".analyze.json"), append(js, '\n'))
			out, _, err := Instrument(m)
			if err != nil {
				t.Fatal(err)
			}
			golden.Check(t, filepath.Join("testdata", "golden", dir+"-"+name+".instrumented.ptx"), out.Bytes())
		})
	}
}

// TestEligibility pins which corpus kernels get a twin and why the others do not.
func TestEligibility(t *testing.T) {
	tests := []struct {
		file, kernel string
		refusal      string // "" means eligible
	}{
		{"corpus/vecadd.ptx", "vecadd", ""},
		{"corpus/vecadd.ptx", "saxpy", ""},
		{"corpus/grids.ptx", "matadd2d", ""},
		{"corpus/grids.ptx", "transpose2d", ""},
		{"corpus/grids.ptx", "coords3d", ""},
		{"corpus/reduce.ptx", "reduce_sum", ""},
		{"corpus/reduce.ptx", "reduce_max_rows", ""},
		{"corpus/earlyret.ptx", "clamp_tail", ""},
		{"corpus/earlyret.ptx", "ret_then_sync", "reached divergently"},
		{"corpus/dynsmem.ptx", "scan_dyn", ""},
		{"corpus/warp.ptx", "warp_sum", ""},
		{"corpus/warp.ptx", "warp_vote", ""},
		{"corpus/atomics.ptx", "histogram", ""},
		{"corpus/atomics.ptx", "max_abs", ""},
		{"corpus/devfunc.ptx", "apply_poly", ""},
		{"corpus/devfunc.ptx", "index_via_call", "reads %ctaid.x"},
		{"corpus/localarr.ptx", "local_sort8", ""},
		{"corpus/gridstride.ptx", "scale_gridstride", ""},
		{"corpus/coopgrid.ptx", "two_phase", "grid-wide synchronisation"},
		{"corpus/mangled.ptx", "_ZN3ops4fillEPiii", ""},
		{"edge/barriers.ptx", "divergent_ret_then_bar", "reached divergently"},
		{"edge/barriers.ptx", "uniform_ret_then_bar", ""},
		{"edge/refuse.ptx", "gridsync", "spin-wait"},
		{"edge/refuse.ptx", "spin", "spin-wait"},
		{"edge/refuse.ptx", "workqueue", "already persistent"},
		{"edge/refuse.ptx", "clustered", "clusters"},
		{"edge/refuse.ptx", "launcher", "dynamic parallelism"},
		{"edge/refuse.ptx", "ctaid_in_func", "reads %ctaid.x"},
		{"edge/syntax.ptx", "edges", ""},
		{"edge/sm90.ptx", "tma_bulk_scale", ""},
		{"edge/sm90.ptx", "tma_tensor_tile", ""},
		{"edge/sm90.ptx", "cp_async_hints", ""},
		{"edge/sm90.ptx", "dsmem_exchange", "thread-block cluster operation mapa"},
		{"edge/sm90.ptx", "cta_flag_generic", ""},
		{"edge/sm90.ptx", "cta_flag_shared", ""},
		{"edge/sm90.ptx", "cta_work_counter", ""},
		{"edge/sm90.ptx", "global_flag", "spin-wait"},
		{"edge/sm90.ptx", "either_flag", "spin-wait"},
		{"nvcc12/async.sm_80.ptx", "pipeline_sum", ""},
		{"nvcc12/async.sm_90.ptx", "pipeline_sum", ""},
		{"nvcc12/async.sm_90.ptx", "async_bulk_scale", ""},
		{"nvcc12/bitonic.sm_90.ptx", "bitonic_sort_chunk", ""},
		{"nvcc12/bitonic.sm_90.ptx", "bitonic_merge_global", ""},
		{"nvcc12/histogram.sm_90.ptx", "histogram_bytes", ""},
		{"nvcc12/histogram.sm_90.ptx", "histogram64_vote", ""},
		{"nvcc12/matmul.sm_90.ptx", "matmul16", ""},
		{"nvcc12/matmul.sm_90.ptx", "matmul32", ""},
		{"nvcc12/options.sm_90.ptx", "black_scholes", ""},
		{"nvcc12/options.sm_90.ptx", "monte_carlo_call", ""},
		{"nvcc12/scan.sm_90.ptx", "scan_tiles", ""},
		{"nvcc12/scan.sm_90.ptx", "scan_add_sums", ""},
		{"nvcc12/sync.sm_90.ptx", "cta_handoff", ""},
		{"nvcc12/sync.sm_90.ptx", "chained_block_sums", "spin-wait"},
		// the "last block" flag is a shared-memory load, which the uniformity analysis cannot
		// prove equal in all threads
		{"nvcc12/sync.sm_90.ptx", "sum_last_block", "reached divergently"},
		{"nvcc12/transpose.sm_90.ptx", "transpose_padded", ""},
		{"nvcc12/transpose.sm_90.ptx", "transpose_diagonal", ""},
	}
	reports := map[string]*Report{}
	for _, tt := range tests {
		r, ok := reports[tt.file]
		if !ok {
			m, _ := mustParse(t, filepath.Join("testdata", tt.file))
			var err error
			if r, err = Analyze(m); err != nil {
				t.Fatal(err)
			}
			reports[tt.file] = r
		}
		var k *KernelReport
		for i := range r.Kernels {
			if r.Kernels[i].Name == tt.kernel {
				k = &r.Kernels[i]
			}
		}
		if k == nil {
			t.Errorf("%s: kernel %s not found", tt.file, tt.kernel)
			continue
		}
		if tt.refusal == "" {
			if !k.Eligible {
				t.Errorf("%s: %s refused: %v", tt.file, tt.kernel, k.Refusals)
			}
			continue
		}
		if k.Eligible || !strings.Contains(strings.Join(k.Refusals, "\n"), tt.refusal) {
			t.Errorf("%s: %s: want a refusal containing %q, got eligible=%v %v", tt.file, tt.kernel, tt.refusal, k.Eligible, k.Refusals)
		}
	}
}

func TestLivenessAtBarriers(t *testing.T) {
	m, _ := mustParse(t, "testdata/edge/vecadd_like.ptx")
	r, err := Analyze(m)
	if err != nil {
		t.Fatal(err)
	}
	var red *KernelReport
	for i := range r.Kernels {
		if r.Kernels[i].Name == "reduce_sum" {
			red = &r.Kernels[i]
		}
	}
	if red == nil || len(red.Barriers) != 2 {
		t.Fatalf("reduce_sum: want 2 barrier sites, got %+v", red)
	}
	// After the first barrier: tid (%r1), the shared slot (%r3), the loop counter init is not
	// yet live, %r6 (ctaid) and %rd3 (out) are; %f7 (already stored) and %r5 (n) are dead.
	want := []string{"%r1", "%r3", "%r6", "%rd3"}
	if got := red.Barriers[0].Live; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("live after first barrier = %v, want %v", got, want)
	}
	want = []string{"%r1", "%r15", "%r3", "%r6", "%rd3"}
	if got := red.Barriers[1].Live; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("live after loop barrier = %v, want %v", got, want)
	}
	if red.SharedStaticBytes != 1024 || red.SaveBytesPerCTA == nil {
		t.Errorf("shared = %d, save/CTA = %v", red.SharedStaticBytes, red.SaveBytesPerCTA)
	}
}

func TestMalformed(t *testing.T) {
	tests := []struct {
		name, src string
		line, col int
	}{
		{"unterminated comment", ".version 8.4\n/* never closed", 2, 1},
		{"missing semicolon", ".version 8.4\n.visible .entry k()\n{\n\tmov.u32 %r1, 1\n}\n", 4, 2},
		{"missing brace", ".version 8.4\n.visible .entry k()\n{\n\tret;\n", 3, 1},
		{"bad module item", ".version 8.4\nmov.u32 %r1, 1;\n", 2, 1},
		{"bad character", ".version 8.4\n.global .u32 x = 1 # 2;\n", 2, 20},
		{"unterminated string", ".version 8.4\n.pragma \"abc\n;", 2, 9},
		{"label to nowhere", ".version 8.4\n.target sm_80\n.address_size 64\n.visible .entry k()\n{\n\tbra $L_x;\n}\n", 0, 0},
		{"unbalanced", ".version 8.4\n.visible .entry k()\n{\n\tld.u32 %r1, [%rd1]];\n}\n", 4, 20},
		{"number", ".version 8.4\n.global .u32 x = 12abc;\n", 2, 18},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := Parse([]byte(tt.src))
			if err == nil {
				_, err = Analyze(m)
			}
			if err == nil {
				t.Fatal("no error")
			}
			var se *SyntaxError
			if tt.line == 0 {
				if !strings.Contains(err.Error(), "line") {
					t.Fatalf("error without a line: %v", err)
				}
				return
			}
			if !errors.As(err, &se) || !errors.Is(err, ErrSyntax) {
				t.Fatalf("want *SyntaxError, got %T %v", err, err)
			}
			if se.Line != tt.line || se.Col != tt.col {
				t.Errorf("at %d:%d, want %d:%d (%v)", se.Line, se.Col, tt.line, tt.col, err)
			}
		})
	}
}

var versionRe = regexp.MustCompile(`(?m)^\.version\s+(\d+)\.(\d+)`)
var targetRe = regexp.MustCompile(`(?m)^\.target\s+sm_(\d+)[af]?`)

// lowerFor rewrites .version to at most 8.4 (the ISA the local ptxas 12.4 accepts) and .target to
// arch when the file names a newer SM. Which files this is valid for is decided by assembling the
// lowered original first: a file whose original no longer assembles uses a newer feature and is
// skipped for that arch, with the reason logged.
func lowerFor(src []byte, arch string) []byte {
	out := versionRe.ReplaceAllFunc(src, func(v []byte) []byte {
		m := versionRe.FindSubmatch(v)
		if string(m[1]) > "8" || string(m[1]) == "8" && len(m[2]) == 1 && m[2][0] > '4' {
			return []byte(".version 8.4")
		}
		return v
	})
	return targetRe.ReplaceAll(out, []byte(".target "+arch))
}

func ptxasPath(t *testing.T) string {
	if p := os.Getenv("PTXAS"); p != "" {
		return p
	}
	p, err := exec.LookPath("ptxas")
	if err != nil {
		testreq.Skip(t, "ptxas", "ptxas not found (scripts/install-ptxas.sh installs it)")
	}
	return p
}

func assemble(t *testing.T, ptxas, arch string, src []byte) error {
	dir := t.TempDir()
	in := filepath.Join(dir, "in.ptx")
	if err := os.WriteFile(in, src, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(ptxas, "-c", "-arch="+arch, "-o", filepath.Join(dir, "out.cubin"), in)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return errors.New(strings.TrimSpace(string(out)))
	}
	return nil
}

// TestAssemble runs the real ptxas on every instrumented module, for sm_80 and sm_90. The nvcc
// corpus is ISA 9.0 (CUDA 13) and the local ptxas 12.4 accepts at most 8.4: the .version line is
// lowered, which is valid only for files that use no 8.5+ feature; assembling the lowered
// original first proves that for each file.
func TestAssemble(t *testing.T) {
	ptxas := ptxasPath(t)
	if testing.Short() {
		t.Skip("ptxas runs are slow; skipped with -short")
	}
	twins := 0
	for _, path := range corpus(t) {
		m, src := mustParse(t, path)
		out, rep, err := Instrument(m)
		if err != nil {
			t.Fatal(err)
		}
		for _, arch := range []string{"sm_80", "sm_90"} {
			t.Run(filepath.Base(path)+"/"+arch, func(t *testing.T) {
				assembleBoth(t, ptxas, arch, src, out.Bytes())
				for _, k := range rep.Kernels {
					if k.Eligible {
						twins++
					}
				}
			})
		}
	}
	if twins == 0 {
		t.Fatal("no twin was assembled")
	}
}

// assembleBoth assembles the original src (lowered for arch), skipping the test when that fails
// (a feature newer than the local ptxas), then the instrumented module, failing the test if it
// does not assemble.
func assembleBoth(t *testing.T, ptxas, arch string, src, instrumented []byte) {
	t.Helper()
	if err := assemble(t, ptxas, arch, lowerFor(src, arch)); err != nil {
		t.Skipf("the original, lowered to ISA 8.4/%s, does not assemble here (newer feature): %v", arch, err)
	}
	if err := assemble(t, ptxas, arch, lowerFor(instrumented, arch)); err != nil {
		t.Fatalf("instrumented module does not assemble: %v", err)
	}
}

func FuzzParse(f *testing.F) {
	for _, path := range corpus(f) {
		src, err := os.ReadFile(path)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(src)
	}
	// Found by fuzzing: a body starting on the line of its "{" (the twin once printed it into the
	// comment before the copied body).
	f.Add([]byte(".address_size 64\n.entry A(){{\n}}"))
	f.Fuzz(func(t *testing.T, src []byte) {
		m, err := Parse(src)
		if err != nil {
			return
		}
		if !bytes.Equal(m.Bytes(), src) {
			t.Fatal("print(parse(x)) != x")
		}
		for _, o := range []Options{{}, {MidBlock: true}} {
			out, _, err := InstrumentWith(m, o)
			if err != nil {
				return
			}
			text := out.Bytes()
			m2, err := Parse(text)
			if err != nil {
				t.Fatalf("instrumented output (mid-block %v) does not parse: %v", o.MidBlock, err)
			}
			if !bytes.Equal(m2.Bytes(), text) {
				t.Fatalf("instrumented output (mid-block %v) does not round-trip", o.MidBlock)
			}
		}
	})
}

func BenchmarkParseInstrument(b *testing.B) {
	var srcs [][]byte
	total := 0
	for _, path := range corpus(b) {
		src, err := os.ReadFile(path)
		if err != nil {
			b.Fatal(err)
		}
		srcs = append(srcs, src)
		total += len(src)
	}
	b.SetBytes(int64(total))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, src := range srcs {
			m, err := Parse(src)
			if err != nil {
				b.Fatal(err)
			}
			out, _, err := Instrument(m)
			if err != nil {
				b.Fatal(err)
			}
			_ = out.Bytes()
		}
	}
}

func TestClaimSize(t *testing.T) {
	tests := []struct {
		name             string
		left, ctas       uint64
		bmin, bmax, bdiv uint32
		want             uint64
	}{
		{"defaults, plenty left: capped at max", 1 << 20, 1056, 0, 0, 0, DefaultBatchMax},
		{"defaults, guided middle", 10 * 4 * 1056, 1056, 0, 0, 0, 10},
		{"defaults, tail: floor at min", 2000, 1056, 0, 0, 0, DefaultBatchMin},
		{"defaults, last wave: one each", 100, 1056, 0, 0, 0, 1},
		{"defaults, one-wave grid: one each", 1056, 1056, 0, 0, 0, 1},
		{"defaults, just over one wave: min", 1057, 1056, 0, 0, 0, DefaultBatchMin},
		{"fair share caps a large min", 40, 10, 8, 16, 4, 4},
		{"nothing left", 0, 1056, 1, 8, 2, 0},
		{"max below min is raised to min", 1 << 30, 8, 8, 4, 1, 8},
		{"no batching", 1 << 30, 132, 1, 1, 1, 1},
		{"zero ctas treated as one", 64, 0, 1, 100, 2, 32},
		{"custom divisor", 1000, 10, 1, 1000, 10, 10},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := ClaimSize(tc.left, tc.ctas, tc.bmin, tc.bmax, tc.bdiv); got != tc.want {
				t.Errorf("ClaimSize(%d, %d, %d, %d, %d) = %d, want %d", tc.left, tc.ctas, tc.bmin, tc.bmax, tc.bdiv, got, tc.want)
			}
		})
	}
}

// TestCtrlHeader checks that shim/include/ptxmig_ctrl.h, the shim's copy of the control-block
// layout, defines the same offsets and constants as ctrl.go.
func TestCtrlHeader(t *testing.T) {
	src, err := os.ReadFile("../shim/include/ptxmig_ctrl.h")
	if err != nil {
		t.Fatal(err)
	}
	defs := map[string]string{}
	for _, m := range regexp.MustCompile(`(?m)^#define (PTXMIG_\w+) (\S+)`).FindAllSubmatch(src, -1) {
		defs[string(m[1])] = strings.TrimSuffix(string(m[2]), "u")
	}
	want := map[string]int{
		"PTXMIG_CTL_OFF_NEXT_BLOCK": CtlOffNextBlock, "PTXMIG_CTL_OFF_TOTAL_BLOCKS": CtlOffTotalBlocks,
		"PTXMIG_CTL_OFF_BLOCKS_DONE": CtlOffBlocksDone, "PTXMIG_CTL_OFF_GRID_X": CtlOffGridX,
		"PTXMIG_CTL_OFF_PREEMPT": CtlOffPreempt, "PTXMIG_CTL_OFF_STATUS": CtlOffStatus,
		"PTXMIG_CTL_OFF_BATCH_MAX": CtlOffBatchMax, "PTXMIG_CTL_OFF_BATCH_MIN": CtlOffBatchMin,
		"PTXMIG_CTL_OFF_BATCH_DIV": CtlOffBatchDiv, "PTXMIG_CTL_SIZE": CtlSize,
		"PTXMIG_CTL_MAGIC": CtlMagic, "PTXMIG_CTL_VERSION": CtlVersion, "PTXMIG_CTL_STATUS_PREEMPTED": CtlStatusPreempted,
		"PTXMIG_BATCH_MIN_DEFAULT": DefaultBatchMin, "PTXMIG_BATCH_MAX_DEFAULT": DefaultBatchMax,
		"PTXMIG_BATCH_DIV_DEFAULT":     DefaultBatchDiv,
		"PTXMIG_CTL_VERSION_MID_BLOCK": CtlVersionMidBlock, "PTXMIG_RECORD_MAGIC": RecordMagic,
		"PTXMIG_CTL_OFF_SAVE_AREA": CtlOffSaveArea, "PTXMIG_CTL_OFF_RECORD_BYTES": CtlOffRecordBytes,
		"PTXMIG_CTL_OFF_SAVED": CtlOffSaved, "PTXMIG_CTL_OFF_RESUME_COUNT": CtlOffResumeCount,
		"PTXMIG_CTL_OFF_RESUME_CURSOR": CtlOffResumeCursor, "PTXMIG_CTL_OFF_RESUME_AREA": CtlOffResumeArea,
		"PTXMIG_CTL_OFF_SAVE_CAPACITY": CtlOffSaveCapacity, "PTXMIG_CTL_OFF_FORCE_VISIT": CtlOffForceVisit,
		"PTXMIG_CTL_SIZE_V3": CtlSizeV3,
	}
	for name, v := range want {
		got, ok := defs[name]
		if !ok {
			t.Errorf("%s: not defined in ptxmig_ctrl.h", name)
			continue
		}
		n, err := strconv.ParseInt(got, 0, 64)
		if err != nil || n != int64(v) {
			t.Errorf("%s = %s in ptxmig_ctrl.h, ctrl.go has %d", name, got, v)
		}
	}
}

// TestTwinConvergence checks two structural properties of every twin that the GPU relies on
// and that a batched scheduler once broke (transpose2d faulted with
// CUDA_ERROR_INVALID_ADDRESS_SPACE on an H200, its body's bar.sync reached by a warp whose
// leader lane was still in claim code):
//   - the control flow is reducible: every retreating edge of a depth-first walk goes to a block
//     that dominates its source (the scheduler loop has one entry, so ptxas can reconverge the
//     leader's divergent set-up before it);
//   - no path from a branch on the leader predicate reaches the original body ($__ptxmig_body)
//     without passing a bar.sync first: leader-only code always ends at a barrier, so every warp
//     enters the body (with its own aligned barriers and shfl.sync/vote) converged.
func TestTwinConvergence(t *testing.T) {
	for _, path := range corpus(t) {
		m, _ := mustParse(t, path)
		out, _, err := Instrument(m)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		m2, err := Parse(out.Bytes())
		if err != nil {
			t.Fatalf("%s: instrumented output: %v", path, err)
		}
		for _, it := range m2.Items {
			if it.Kind != ItemFunc || !strings.HasSuffix(it.Func.Name, TwinSuffix) {
				continue
			}
			t.Run(filepath.Base(path)+"/"+it.Func.Name, func(t *testing.T) {
				g, err := buildCFG(it.Func)
				if err != nil {
					t.Fatal(err)
				}
				if bad := irreducibleEdges(g); len(bad) > 0 {
					t.Errorf("irreducible control flow: retreating edges to non-dominators %v (block -> block)", bad)
				}
				if line, ok := leaderReachesBody(g); !ok {
					t.Errorf("the leader-only instruction at line %d reaches the original body without a CTA barrier (warp 0 would run it split)", line)
				}
				if orig := findFunc(m2, strings.TrimSuffix(it.Func.Name, TwinSuffix)); orig != nil {
					if want, got := schedulerBarrier(orig.Body), twinBarriers(it.Func); len(got) != 2 || got[0] != want || got[1] != want {
						t.Errorf("scheduler barriers %q, want two %q (the body's barrier flavour)", got, want)
					}
				}
			})
		}
	}
}

func findFunc(m *Module, name string) *Function {
	for _, it := range m.Items {
		if it.Kind == ItemFunc && it.Func.Name == name {
			return it.Func
		}
	}
	return nil
}

// twinBarriers returns the scheduler's barrier instructions of a twin (those outside the original
// body: before $__ptxmig_body and after $__ptxmig_next), as printed by schedulerBarrier.
func twinBarriers(f *Function) []string {
	var out []string
	inBody := false
	for _, s := range f.Body {
		if s.Kind == StLabel {
			switch s.Name {
			case labelPrefix + "body":
				inBody = true
			case labelPrefix + "next":
				inBody = false
			}
			continue
		}
		if s.Kind == StInstr && !inBody && (s.Op == "bar.sync" || s.Op == "barrier.sync") {
			args := make([]string, len(s.Args))
			for i, a := range s.Args {
				args[i] = a.Text
			}
			out = append(out, s.Op+" \t"+strings.Join(args, ", ")+";")
		}
	}
	return out
}

// TestSchedulerBarrierFlavour: the twin's own barriers are non-aligned exactly when the body has a
// non-aligned CTA barrier (mixing the two computed wrong blocks on an H100).
func TestSchedulerBarrierFlavour(t *testing.T) {
	for _, tt := range []struct{ body, want string }{
		{"bar.sync 0;", "bar.sync \t0;"},
		{"bar.sync 1, 64;", "bar.sync \t0;"},
		{"barrier.sync.aligned 0;", "bar.sync \t0;"},
		{"barrier.cta.sync.aligned 0;", "bar.sync \t0;"},
		{"bar.warp.sync -1;", "bar.sync \t0;"},
		{"barrier.sync 0;", "barrier.sync \t0;"},
		{"barrier.cta.sync 0;", "barrier.sync \t0;"},
		{"barrier.sync 1, 64;", "barrier.sync \t0;"},
		{"barrier.red.popc.u32 %r2, 0, %p1;", "barrier.sync \t0;"},
		{"", "bar.sync \t0;"},
	} {
		src := ".version 9.0\n.target sm_90\n.address_size 64\n.visible .entry k(.param .u64 p)\n{\n" +
			"\t.reg .pred %p<2>;\n\t.reg .b32 %r<3>;\n\t.reg .b64 %rd<3>;\n" +
			"\tld.param.u64 %rd1, [p];\n\tcvta.to.global.u64 %rd2, %rd1;\n\tmov.u32 %r1, %ctaid.x;\n" +
			"\tsetp.eq.u32 %p1, %r1, 0;\n\t" + tt.body + "\n\tst.global.u32 [%rd2], %r1;\n\tret;\n}\n"
		m, err := Parse([]byte(src))
		if err != nil {
			t.Fatalf("%q: %v", tt.body, err)
		}
		out, rep, err := Instrument(m)
		if err != nil {
			t.Fatalf("%q: %v", tt.body, err)
		}
		if len(rep.Kernels) != 1 || !rep.Kernels[0].Eligible {
			t.Fatalf("%q: kernel not eligible: %+v", tt.body, rep.Kernels)
		}
		m2, err := Parse(out.Bytes())
		if err != nil {
			t.Fatal(err)
		}
		got := twinBarriers(findFunc(m2, "k"+TwinSuffix))
		if len(got) != 2 || got[0] != tt.want || got[1] != tt.want {
			t.Errorf("body %q: scheduler barriers %q, want two %q", tt.body, got, tt.want)
		}
	}
}

// dominators returns, per block, the set of blocks dominating it (entry: block 0; iterative).
func dominators(g *CFG) []bitset {
	n := len(g.Blocks)
	dom := make([]bitset, n)
	for i := range dom {
		dom[i] = newBitset(n)
		if i == 0 {
			dom[i].set(0)
			continue
		}
		for j := 0; j < n; j++ {
			dom[i].set(j)
		}
	}
	tmp := newBitset(n)
	for changed := true; changed; {
		changed = false
		for i := 1; i < n; i++ {
			first := true
			for _, p := range g.Blocks[i].Preds {
				if first {
					tmp.copyFrom(dom[p])
					first = false
					continue
				}
				for k := range tmp {
					tmp[k] &= dom[p][k]
				}
			}
			if first { // unreachable: leave as is
				continue
			}
			tmp.set(i)
			if !tmp.equal(dom[i]) {
				dom[i].copyFrom(tmp)
				changed = true
			}
		}
	}
	return dom
}

// irreducibleEdges returns the retreating edges (to a block on the DFS stack) whose target does
// not dominate their source, as "from->to".
func irreducibleEdges(g *CFG) []string {
	dom := dominators(g)
	state := make([]uint8, len(g.Blocks)) // 0 new, 1 on stack, 2 done
	var bad []string
	var dfs func(b int)
	dfs = func(b int) {
		state[b] = 1
		for _, s := range g.Blocks[b].Succs {
			if s >= len(g.Blocks) {
				continue
			}
			switch state[s] {
			case 0:
				dfs(s)
			case 1:
				if !dom[b].has(s) {
					bad = append(bad, strconv.Itoa(b)+"->"+strconv.Itoa(s))
				}
			}
		}
		state[b] = 2
	}
	dfs(0)
	return bad
}

// leaderReachesBody reports the first instruction guarded by the leader's predicate (pLead, or a
// predicate computed from it in the same basic block: one computed in another block is not
// followed, a limit of this check) from which the original body can be
// reached without passing a CTA barrier, or that lies inside the body with no barrier after it
// in its straight run of code. Such a guard is a branch
// in ptxas' output (a predicated load is one too): lane 0 leaves the rest of warp 0, and nothing
// before the body's end brings it back, so warp 0 runs the body twice over (a clock-bound spin's
// block twin ran at 0.44x on an H200 for it).
func leaderReachesBody(g *CFG) (int, bool) {
	body := g.Fn.Body
	isBar := func(s *Stmt) bool {
		return s.Kind == StInstr && (s.Base() == "bar" || s.Base() == "barrier") && (s.HasMod("sync") || s.Op == "bar" || s.HasMod("red"))
	}
	inBody := make([]bool, len(body))
	for i, on := 0, false; i < len(body); i++ {
		if s := body[i]; s.Kind == StLabel {
			switch s.Name {
			case labelPrefix + "body":
				on = true
			case labelPrefix + "next":
				on = false
			}
		}
		inBody[i] = on
	}
	// reaches: from statement i of block b on, the body is reached before a barrier.
	reaches := func(b, i int) bool {
		for _, s := range body[i:g.Blocks[b].End] {
			if s.Kind == StLabel && s.Name == labelPrefix+"body" {
				return true
			}
			if isBar(s) {
				return false
			}
		}
		seen := make([]bool, len(g.Blocks))
		work := append([]int(nil), g.Blocks[b].Succs...)
		for len(work) > 0 {
			x := work[len(work)-1]
			work = work[:len(work)-1]
			if x >= len(g.Blocks) || seen[x] {
				continue
			}
			seen[x] = true
			stopped := false
			for _, s := range body[g.Blocks[x].Start:g.Blocks[x].End] {
				if s.Kind == StLabel && s.Name == labelPrefix+"body" {
					return true
				}
				if isBar(s) {
					stopped = true
					break
				}
			}
			if !stopped {
				work = append(work, g.Blocks[x].Succs...)
			}
		}
		return false
	}
	for bi, b := range g.Blocks {
		derived := map[string]bool{pLead: true}
		for i := b.Start; i < b.End; i++ {
			s := body[i]
			if s.Kind != StInstr {
				continue
			}
			if s.Pred != "" && derived[s.Pred] {
				// Inside the body a barrier must follow in the same straight run (a site's vote).
				barAhead := slices.ContainsFunc(body[i+1:b.End], isBar)
				if reaches(bi, i) || (inBody[i] && !barAhead) {
					return s.Line, false
				}
			}
			// A predicate written here is the leader's if any operand is.
			if len(s.Args) > 0 && (s.Base() == "setp" || strings.HasSuffix(s.Op, ".pred")) {
				d := false
				for _, a := range s.Args[1:] {
					for _, r := range a.Regs {
						d = d || derived[r]
					}
				}
				for _, r := range s.Args[0].Regs {
					derived[r] = d
				}
			}
		}
	}
	return 0, true
}
