package testreq

import (
	"fmt"
	"testing"
)

func TestRequired(t *testing.T) {
	tests := []struct {
		env, need string
		want      bool
	}{
		{"", "root", false},
		{"root", "root", true},
		{"root,criu,ptxas", "criu", true},
		{" root , ptxas ", "ptxas", true},
		{"root,criu", "ptxas", false},
		{"rootless", "root", false},
		{",,", "", false},
		{"all", "cc", true},
	}
	for _, tt := range tests {
		t.Setenv(Env, tt.env)
		if got := Required(tt.need); got != tt.want {
			t.Errorf("%s=%q: Required(%q) = %v, want %v", Env, tt.env, tt.need, got, tt.want)
		}
	}
}

// recorder is a testing.TB that records Skipf and Fatalf instead of stopping a test.
type recorder struct {
	testing.TB
	skipped, failed string
}

func (r *recorder) Helper()                        {}
func (r *recorder) Skipf(format string, a ...any)  { r.skipped = fmt.Sprintf(format, a...) }
func (r *recorder) Fatalf(format string, a ...any) { r.failed = fmt.Sprintf(format, a...) }

func TestSkip(t *testing.T) {
	tests := []struct {
		env, skipped, failed string
	}{
		{"", "ptxas unavailable: not on PATH (try 1)", ""},
		{"criu", "ptxas unavailable: not on PATH (try 1)", ""},
		{"root,ptxas", "", "required ptxas unavailable: not on PATH (try 1) (PTXMIG_REQUIRE=root,ptxas)"},
	}
	for _, tt := range tests {
		t.Setenv(Env, tt.env)
		r := &recorder{}
		Skip(r, "ptxas", "not on PATH (try %d)", 1)
		if r.skipped != tt.skipped || r.failed != tt.failed {
			t.Errorf("%s=%q: skipped %q, failed %q; want %q, %q", Env, tt.env, r.skipped, r.failed, tt.skipped, tt.failed)
		}
	}
}
