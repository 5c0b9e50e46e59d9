package ptxstate

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// genKernel generates a kernel of the shapes that made analysis blow up (issue 20): "ifs" is
// n if-blocks in sequence (diamonds), "ring" n labels in a ring of branches, "straight" one
// block of n instructions, "nest" n nested if-blocks.
func genKernel(shape string, n int) []byte {
	var b strings.Builder
	b.WriteString(".version 8.4\n.target sm_80\n.address_size 64\n\n.visible .entry big(\n\t.param .u64 big_param_0\n)\n{\n")
	b.WriteString("\t.reg .pred \t%p<2>;\n\t.reg .b32 \t%r<8>;\n\t.reg .b64 \t%rd<4>;\n\n")
	b.WriteString("\tld.param.u64 \t%rd1, [big_param_0];\n\tcvta.to.global.u64 \t%rd2, %rd1;\n\tmov.u32 \t%r1, %tid.x;\n\tmov.u32 \t%r2, %ctaid.x;\n")
	switch shape {
	case "ifs":
		for i := 0; i < n; i++ {
			fmt.Fprintf(&b, "\tsetp.gt.u32 \t%%p1, %%r1, %d;\n\t@%%p1 bra \t$L_%d;\n\tadd.s32 \t%%r2, %%r2, %d;\n$L_%d:\n", i%1024, i, i, i)
		}
	case "ring":
		fmt.Fprintf(&b, "\tbra \t$L_0;\n")
		for i := 0; i < n; i++ {
			fmt.Fprintf(&b, "$L_%d:\n\tadd.s32 \t%%r2, %%r2, 1;\n\tsetp.gt.u32 \t%%p1, %%r2, %d;\n\t@%%p1 bra \t$L_end;\n\tbra \t$L_%d;\n", i, 1000+i, (i+1)%n)
		}
		b.WriteString("$L_end:\n")
	case "straight":
		for i := 0; i < n; i++ {
			fmt.Fprintf(&b, "\tadd.s32 \t%%r%d, %%r%d, %%r%d;\n", 3+i%5, 3+(i+1)%5, 1+i%2)
		}
	case "nest":
		for i := 0; i < n; i++ {
			fmt.Fprintf(&b, "\tsetp.gt.u32 \t%%p1, %%r2, %d;\n\t@%%p1 bra \t$L_%d;\n\tadd.s32 \t%%r2, %%r2, 1;\n", i, i)
		}
		for i := n - 1; i >= 0; i-- {
			fmt.Fprintf(&b, "$L_%d:\n\tadd.s32 \t%%r2, %%r2, %d;\n", i, i)
		}
	}
	b.WriteString("\tmul.wide.u32 \t%rd3, %r2, 4;\n\tadd.s64 \t%rd3, %rd2, %rd3;\n\tst.global.u32 \t[%rd3], %r2;\n\tret;\n}\n")
	return []byte(b.String())
}

func parseInstrument(src []byte) (*Report, error) {
	m, err := Parse(src)
	if err != nil {
		return nil, err
	}
	out, rep, err := Instrument(m)
	if err != nil {
		return nil, err
	}
	_ = out.Bytes()
	return rep, nil
}

// TestScale: kernels of 10,000 basic blocks (and 100,000 straight-line instructions) parse,
// analyse and instrument in time close to linear. The bound is a sanity limit only (about
// 100 times what a 2-core CI machine needs, under -race); BenchmarkScale measures.
func TestScale(t *testing.T) {
	const limit = 20 * time.Second
	for _, c := range []struct {
		shape string
		n     int
	}{{"ifs", 10000}, {"ring", 10000}, {"nest", 5000}, {"straight", 100000}} {
		t.Run(fmt.Sprintf("%s-%d", c.shape, c.n), func(t *testing.T) {
			src := genKernel(c.shape, c.n)
			start := time.Now()
			rep, err := parseInstrument(src)
			if err != nil {
				t.Fatal(err)
			}
			d := time.Since(start)
			t.Logf("%d bytes: %v (eligible %v)", len(src), d, rep.Kernels[0].Eligible)
			if d > limit {
				t.Fatalf("took %v, limit %v", d, limit)
			}
		})
	}
}

func BenchmarkScale(b *testing.B) {
	for _, c := range []struct {
		shape string
		n     int
	}{{"ifs", 1000}, {"ifs", 10000}, {"ring", 10000}, {"nest", 5000}, {"straight", 100000}} {
		src := genKernel(c.shape, c.n)
		b.Run(fmt.Sprintf("%s-%d", c.shape, c.n), func(b *testing.B) {
			b.SetBytes(int64(len(src)))
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				if _, err := parseInstrument(src); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestLimits: input past a documented limit fails with ErrLimit, quickly.
func TestLimits(t *testing.T) {
	if _, err := Parse(make([]byte, MaxSourceBytes+1)); !errors.Is(err, ErrLimit) {
		t.Fatalf("oversized module: %v, want ErrLimit", err)
	}
	_, err := parseInstrument(genKernel("ifs", MaxBlocksPerKernel))
	if !errors.Is(err, ErrLimit) || !strings.Contains(err.Error(), "basic blocks") {
		t.Fatalf("%d if-blocks: %v, want ErrLimit", MaxBlocksPerKernel, err)
	}
	// One long line of statements: refused by the token limit while lexing, before the body is
	// held (a 50 MB line took 6.6–8.9 GiB before; 783 MiB peak and 1.3 s now, measured by hand).
	line := ".version 8.4\n.target sm_80\n.address_size 64\n.visible .entry big(){ .reg .b32 %r<2>; " +
		strings.Repeat("add.s32 %r1, %r1, 1; ", MaxTokens/7+1) + "ret; }\n"
	if _, err := Parse([]byte(line)); !errors.Is(err, ErrLimit) || !strings.Contains(err.Error(), "tokens") {
		t.Fatalf("%d-byte line: %v, want ErrLimit naming tokens", len(line), err)
	}
}

// TestBranchTargetsScale: brx.idx with a 100,000-entry .branchtargets (issue 20: no exit, 2.9 GiB)
// is refused by the block limit or analysed quickly.
func TestBranchTargetsScale(t *testing.T) {
	var b strings.Builder
	b.WriteString(".version 8.4\n.target sm_80\n.address_size 64\n.visible .entry k(.param .u32 k_p)\n{\n.reg .b32 %r<2>;\nld.param.u32 %r1, [k_p];\n$L_t: .branchtargets ")
	const n = 100000
	for i := 0; i < n; i++ {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "$L_%d", i%10)
	}
	b.WriteString(";\nbrx.idx %r1, $L_t;\n")
	for i := 0; i < 10; i++ {
		fmt.Fprintf(&b, "$L_%d:\nadd.s32 %%r1, %%r1, 1;\n", i)
	}
	b.WriteString("ret;\n}\n")
	start := time.Now()
	if _, err := parseInstrument([]byte(b.String())); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("took %v", d)
	}
}
