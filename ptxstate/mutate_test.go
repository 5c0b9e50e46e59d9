package ptxstate

import (
	"bytes"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// Mutation kinds of TestMutatedCorpusAssembles: each rewrites PTX in a way ptxas is indifferent
// to (comments, blank lines, spacing, line endings, where '{' and labels sit), so instrumenting a
// mutant that ptxas accepts must give PTX that ptxas accepts too.
var mutations = []struct {
	name string
	fn   func(r *rand.Rand, src []byte) []byte
}{
	{"block-comments", func(r *rand.Rand, src []byte) []byte {
		return atBoundaries(r, src, 0.15, func(r *rand.Rand) string {
			return []string{"/*c*/", " /* c */ ", "/* multi\nline */", "/**/", " /* { } ; , ( ) */ "}[r.Intn(5)]
		})
	}},
	{"line-comments", func(r *rand.Rand, src []byte) []byte {
		return atBoundaries(r, src, 0.1, func(r *rand.Rand) string {
			return []string{" // c\n", "// ; } ) .param x,\n", "\t//\n"}[r.Intn(3)]
		})
	}},
	{"line-end-comments", func(r *rand.Rand, src []byte) []byte {
		return replaceSome(r, src, "\n", 0.5, func(r *rand.Rand) string {
			return []string{" // end of line\n", "/* eol */\n", "\t// x /* y\n", " /* a\nb */\n"}[r.Intn(4)]
		})
	}},
	{"blank-lines", func(r *rand.Rand, src []byte) []byte {
		return replaceSome(r, src, "\n", 0.3, func(r *rand.Rand) string { return []string{"\n\n", "\n\n\n", "\n \t\n"}[r.Intn(3)] })
	}},
	{"spacing", func(r *rand.Rand, src []byte) []byte {
		return atBoundaries(r, src, 0.3, func(r *rand.Rand) string { return []string{" ", "\t", "  \t ", "\t\t"}[r.Intn(4)] })
	}},
	{"crlf", func(r *rand.Rand, src []byte) []byte {
		return bytes.ReplaceAll(bytes.ReplaceAll(src, []byte("\r\n"), []byte("\n")), []byte("\n"), []byte("\r\n"))
	}},
	{"brace-on-header", func(r *rand.Rand, src []byte) []byte {
		src = bytes.ReplaceAll(src, []byte(")\n{"), []byte(") {"))
		return bytes.ReplaceAll(src, []byte("\n{\n"), []byte(" {\n"))
	}},
	{"stmts-on-brace-line", func(r *rand.Rand, src []byte) []byte {
		return replaceSome(r, src, "{\n", 1, func(r *rand.Rand) string { return []string{"{ ", "{", "{ /* c */ ", "{\t"}[r.Intn(4)] })
	}},
	{"label-joined", func(r *rand.Rand, src []byte) []byte {
		return replaceSome(r, src, ":\n", 1, func(r *rand.Rand) string {
			return []string{": ", ":/* c */", ": // c\n", ":\n\n// c\n\t"}[r.Intn(4)]
		})
	}},
}

// atBoundaries inserts ins(r) at a fraction p of the boundaries between tokens (never inside a
// token, never between "::"-joined parts).
func atBoundaries(r *rand.Rand, src []byte, p float64, ins func(*rand.Rand) string) []byte {
	toks, err := lex(src)
	if err != nil {
		return src
	}
	var b bytes.Buffer
	pos := 0
	for _, t := range toks {
		if t.Kind == tokEOF {
			break
		}
		if r.Float64() < p {
			b.Write(src[pos:t.Off])
			b.WriteString(ins(r))
			pos = t.Off
		}
	}
	b.Write(src[pos:])
	return b.Bytes()
}

// replaceSome replaces a fraction p of the occurrences of old.
func replaceSome(r *rand.Rand, src []byte, old string, p float64, repl func(*rand.Rand) string) []byte {
	parts := bytes.Split(src, []byte(old))
	var b bytes.Buffer
	for i, part := range parts {
		if i > 0 {
			if r.Float64() < p {
				b.WriteString(repl(r))
			} else {
				b.WriteString(old)
			}
		}
		b.Write(part)
	}
	return b.Bytes()
}

func twinCount(t *testing.T, rep *Report) int {
	n := 0
	for _, k := range rep.Kernels {
		if k.Eligible {
			n++
		}
	}
	return n
}

// TestMutatedCorpusAssembles is the property "instrumented PTX assembles whenever the input
// does, whatever the comments, blank lines, spacing or line endings": for every corpus file that
// the local ptxas assembles (lowered to sm_80, ISA 8.4), seeded mutants are generated; each one
// ptxas accepts must parse, get the same number of twins as the original, and its instrumented
// output must assemble. By default a sample of mutants runs per file (PTXSTATE_MUTANTS, default
// 6, each combining 1-3 mutation kinds, plus one mutant per single kind); PTXSTATE_MUTANTS=all
// runs 60 per file. PTXSTATE_MUTATION_SEED changes the seed (default 1).
func TestMutatedCorpusAssembles(t *testing.T) {
	ptxas := ptxasPath(t)
	if testing.Short() {
		t.Skip("ptxas runs are slow; skipped with -short")
	}
	perFile := 6
	if v := os.Getenv("PTXSTATE_MUTANTS"); v == "all" {
		perFile = 60
	} else if v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			t.Fatalf("PTXSTATE_MUTANTS=%q: want a count or \"all\"", v)
		}
		perFile = n
	}
	seed := int64(1)
	if v := os.Getenv("PTXSTATE_MUTATION_SEED"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			t.Fatalf("PTXSTATE_MUTATION_SEED=%q: %v", v, err)
		}
		seed = n
	}
	const arch = "sm_80"
	var mu sync.Mutex
	tried, accepted, checked := 0, 0, 0
	t.Cleanup(func() {
		t.Logf("mutants: %d generated, %d accepted by ptxas, %d instrumented and assembled", tried, accepted, checked)
	})
	t.Run("files", func(t *testing.T) {
		for fi, path := range corpus(t) {
			fi, path := fi, path
			t.Run(filepath.Base(path), func(t *testing.T) {
				t.Parallel()
				src0, err := os.ReadFile(path)
				if err != nil {
					t.Fatal(err)
				}
				src := lowerFor(src0, arch)
				if err := assemble(t, ptxas, arch, src); err != nil {
					t.Skipf("the original does not assemble here: %v", err)
				}
				m, err := Parse(src)
				if err != nil {
					t.Fatal(err)
				}
				_, rep, err := Instrument(m)
				if err != nil {
					t.Fatal(err)
				}
				want := twinCount(t, rep)
				r := rand.New(rand.NewSource(seed*1000 + int64(fi)))
				var plans [][]int
				for k := range mutations {
					plans = append(plans, []int{k})
				}
				for i := 0; i < perFile; i++ {
					n := 1 + r.Intn(3)
					plans = append(plans, r.Perm(len(mutations))[:n])
				}
				for _, plan := range plans {
					mut := src
					var names []string
					for _, k := range plan {
						mut = mutations[k].fn(r, mut)
						names = append(names, mutations[k].name)
					}
					label := strings.Join(names, "+")
					mu.Lock()
					tried++
					mu.Unlock()
					if err := assemble(t, ptxas, arch, mut); err != nil {
						t.Logf("%s: ptxas rejects the mutant (not a finding): %.200s", label, err)
						continue
					}
					mu.Lock()
					accepted++
					mu.Unlock()
					if err := checkMutant(t, ptxas, arch, mut, want); err != nil {
						dump := filepath.Join(os.TempDir(), fmt.Sprintf("ptxstate-mutant-%s-%d.ptx", filepath.Base(path), r.Int63()))
						_ = os.WriteFile(dump, mut, 0o644)
						t.Errorf("%s (mutant saved as %s): %v", label, dump, err)
						continue
					}
					mu.Lock()
					checked++
					mu.Unlock()
				}
			})
		}
	})
}

func checkMutant(t *testing.T, ptxas, arch string, src []byte, wantTwins int) error {
	m, err := Parse(src)
	if err != nil {
		return fmt.Errorf("parse: %w", err)
	}
	if !bytes.Equal(m.Bytes(), src) {
		return fmt.Errorf("print(parse(x)) != x")
	}
	out, rep, err := Instrument(m)
	if err != nil {
		return fmt.Errorf("instrument: %w", err)
	}
	if got := twinCount(t, rep); got != wantTwins {
		var why []string
		for _, k := range rep.Kernels {
			if !k.Eligible {
				why = append(why, k.Name+": "+strings.Join(k.Refusals, "; "))
			}
		}
		return fmt.Errorf("%d twins, the original has %d (%s)", got, wantTwins, strings.Join(why, " | "))
	}
	if err := assemble(t, ptxas, arch, out.Bytes()); err != nil {
		return fmt.Errorf("instrumented output does not assemble: %.400s", err)
	}
	return nil
}
