package rebalance

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestPolicyDocExample parses the example policy in docs/REBALANCE.md, keeping the document true.
func TestPolicyDocExample(t *testing.T) {
	doc, err := os.ReadFile("../docs/REBALANCE.md")
	if err != nil {
		t.Fatal(err)
	}
	_, after, ok := strings.Cut(string(doc), "<!-- policy-example -->\n```json\n")
	example, _, ok2 := strings.Cut(after, "```")
	if !ok || !ok2 {
		t.Fatal("docs/REBALANCE.md: no ```json block after <!-- policy-example -->")
	}
	file := filepath.Join(t.TempDir(), "policy.json")
	os.WriteFile(file, []byte(example), 0o600)
	p, err := LoadPolicy(file)
	if err != nil {
		t.Fatalf("documented example: %v", err)
	}
	if p.BusyThreshold != 75 || p.MaxMoves != 2 || time.Duration(p.Cooldown) != 15*time.Minute ||
		!reflect.DeepEqual(p.Pin.PIDs, []int{4242}) || len(p.Pin.Names) != 2 || p.WeightPower != 0.3 {
		t.Errorf("example parsed as %+v", p)
	}
}

func TestParsePolicy(t *testing.T) {
	p, err := ParsePolicy([]byte(`{"busy_threshold": 80, "min_age": "2m"}`))
	if err != nil {
		t.Fatal(err)
	}
	want := DefaultPolicy()
	want.BusyThreshold, want.MinAge = 80, Duration(2*time.Minute)
	if !reflect.DeepEqual(p, want) {
		t.Errorf("absent keys must keep defaults: %+v", p)
	}
	bad := []struct{ in, msg string }{
		{`{"busy_treshold": 80}`, "unknown field"},
		{`{"busy_threshold": 0}`, "busy_threshold"},
		{`{"busy_threshold": 101}`, "busy_threshold"},
		{`{"weight_load": 0, "weight_power": 0}`, "weights"},
		{`{"weight_power": -1}`, "weights"},
		{`{"min_improvement": 1}`, "min_improvement"},
		{`{"max_moves": 0}`, "max_moves"},
		{`{"min_age": "-5s"}`, "negative"},
		{`{"cooldown": 600}`, "duration string"},
		{`{"window": "1h"}`, "window"},
		{`{"pin": {"pids": [0]}}`, "not a PID"},
		{`{"pin": {"names": ["[x"]}}`, "pattern"},
		{`{"max_moves": 1} {"max_moves": 2}`, "after the JSON object"},
		{`[1]`, "cannot unmarshal"},
	}
	for _, b := range bad {
		_, err := ParsePolicy([]byte(b.in))
		if !errors.Is(err, ErrBadPolicy) || !strings.Contains(err.Error(), b.msg) {
			t.Errorf("%s: %v, want ErrBadPolicy mentioning %q", b.in, err, b.msg)
		}
	}
	if _, err := LoadPolicy(filepath.Join(t.TempDir(), "none.json")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}
