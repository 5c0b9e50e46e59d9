package rebalance

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

func sampleReport() *Report {
	g0, g1 := h200(0, 0.97, 650, 8), h200(1, 0.02, 90, 1)
	g1.Name = `odd "name"\with` + "\nnewline"
	return &Report{
		Start:       t0,
		Observation: Observation{Time: t0, Window: 5 * time.Second, GPUs: []GPU{g0, g1}, Procs: []Process{procOn(10, 0, 0.5, 2), procOn(11, 0, 0.5, 3)}},
		Plan:        Plan{Moves: []Move{{PID: 10, From: GPURef{0, g0.UUID}, To: GPURef{1, g1.UUID}}}},
		Results:     []MoveResult{{Move: Move{PID: 10, From: GPURef{0, g0.UUID}, To: GPURef{1, g1.UUID}}, OK: true, Seconds: 3.25}},
		Moved:       1,
		Durations:   map[string]float64{"observe": 5, "plan": 0.001, "migrate": 3.5, "total": 8.6},
		Totals:      Totals{Runs: 12, Moves: 4, Failures: 1, LastSuccess: t0},
	}
}

func TestMetricsParseBack(t *testing.T) {
	var b bytes.Buffer
	if err := WriteMetrics(&b, sampleReport()); err != nil {
		t.Fatal(err)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(b.Bytes()))
	if err != nil {
		t.Fatalf("Prometheus text parser rejects the output: %v\n%s", err, b.String())
	}
	get := func(name string, labels map[string]string) (float64, dto.MetricType) {
		t.Helper()
		f := fams[MetricsPrefix+name]
		if f == nil {
			t.Fatalf("metric %s missing", name)
		}
	next:
		for _, m := range f.Metric {
			have := map[string]string{}
			for _, l := range m.Label {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue next
				}
			}
			switch f.GetType() {
			case dto.MetricType_COUNTER:
				return m.Counter.GetValue(), f.GetType()
			default:
				return m.Gauge.GetValue(), f.GetType()
			}
		}
		t.Fatalf("%s%v missing", name, labels)
		return 0, 0
	}
	checks := []struct {
		name   string
		labels map[string]string
		want   float64
		typ    dto.MetricType
	}{
		{"gpu_utilization_ratio", map[string]string{"gpu": "0"}, 0.97, dto.MetricType_GAUGE},
		{"gpu_utilization_ratio", map[string]string{"gpu": "1", "name": `odd "name"\with` + "\nnewline"}, 0.02, dto.MetricType_GAUGE},
		{"gpu_memory_used_bytes", map[string]string{"gpu": "0"}, 8 * gib, dto.MetricType_GAUGE},
		{"gpu_power_watts", map[string]string{"gpu": "0"}, 650, dto.MetricType_GAUGE},
		{"gpu_processes", map[string]string{"gpu": "0"}, 2, dto.MetricType_GAUGE},
		{"gpu_processes", map[string]string{"gpu": "1"}, 0, dto.MetricType_GAUGE},
		{"moves_total", nil, 4, dto.MetricType_COUNTER},
		{"failures_total", nil, 1, dto.MetricType_COUNTER},
		{"runs_total", nil, 12, dto.MetricType_COUNTER},
		{"last_run_moves", nil, 1, dto.MetricType_GAUGE},
		{"last_run_planned_moves", nil, 1, dto.MetricType_GAUGE},
		{"last_run_success", nil, 1, dto.MetricType_GAUGE},
		{"last_run_duration_seconds", map[string]string{"phase": "migrate"}, 3.5, dto.MetricType_GAUGE},
		{"last_run_duration_seconds", map[string]string{"phase": "total"}, 8.6, dto.MetricType_GAUGE},
		{"last_run_migration_seconds", map[string]string{"pid": "10", "to": "1", "ok": "true"}, 3.25, dto.MetricType_GAUGE},
		{"last_run_timestamp_seconds", nil, float64(t0.Unix()), dto.MetricType_GAUGE},
		{"last_success_timestamp_seconds", nil, float64(t0.Unix()), dto.MetricType_GAUGE},
	}
	for _, c := range checks {
		if v, typ := get(c.name, c.labels); v != c.want || typ != c.typ {
			t.Errorf("%s%v = %v (%v), want %v (%v)", c.name, c.labels, v, typ, c.want, c.typ)
		}
	}
}

func TestMetricsFileAtomic(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "ptxmig_rebalance.prom")
	os.WriteFile(file, []byte("old content\n"), 0o644)
	rep := sampleReport()
	rep.Error = "move pid 10: migration failed"
	if err := WriteMetricsFile(file, rep); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(file)
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	if v := fams[MetricsPrefix+"last_run_success"].Metric[0].Gauge.GetValue(); v != 0 {
		t.Errorf("failed run: last_run_success %v", v)
	}
	fi, _ := os.Stat(file)
	if fi.Mode().Perm() != 0o644 {
		t.Errorf("mode %v", fi.Mode().Perm())
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Errorf("temp files left: %v", entries)
	}
	if err := WriteMetricsFile(dir, rep); err == nil {
		t.Error("a directory as metrics file was accepted")
	}
	if err := WriteMetricsFile(filepath.Join(dir, "no", "such", "dir.prom"), rep); err == nil {
		t.Error("missing directory accepted")
	}
}
