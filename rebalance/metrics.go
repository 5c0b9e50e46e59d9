package rebalance

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/ptxmig/ptxmig/internal/atomicfile"
)

// MetricsPrefix starts every metric name.
const MetricsPrefix = "ptxmig_rebalance_"

type metricWriter struct {
	w   io.Writer
	err error
}

func (m *metricWriter) family(name, typ, help string) {
	if m.err == nil {
		_, m.err = fmt.Fprintf(m.w, "# HELP %s%s %s\n# TYPE %s%s %s\n", MetricsPrefix, name, help, MetricsPrefix, name, typ)
	}
}

// sample writes one sample; labels alternate name, value.
func (m *metricWriter) sample(name string, v float64, labels ...string) {
	if m.err != nil {
		return
	}
	var b strings.Builder
	b.WriteString(MetricsPrefix + name)
	if len(labels) > 0 {
		b.WriteByte('{')
		for i := 0; i+1 < len(labels); i += 2 {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(labels[i] + `="` + escapeLabel(labels[i+1]) + `"`)
		}
		b.WriteByte('}')
	}
	b.WriteString(" " + strconv.FormatFloat(v, 'g', -1, 64) + "\n")
	_, m.err = io.WriteString(m.w, b.String())
}

// escapeLabel escapes a label value for the text exposition format.
func escapeLabel(s string) string {
	return strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`).Replace(s)
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// WriteMetrics writes rep in the Prometheus text exposition format (version 0.0.4), as read by
// node_exporter's textfile collector. The names are documented in docs/REBALANCE.md.
func WriteMetrics(w io.Writer, rep *Report) error {
	m := &metricWriter{w: w}
	gpuLabels := func(g GPU) []string {
		return []string{"gpu", strconv.Itoa(g.Index), "uuid", g.UUID, "name", g.Name}
	}
	procs := map[string]int{}
	for _, p := range rep.Observation.Procs {
		for _, u := range p.GPUs {
			procs[u]++
		}
	}
	gpuFamilies := []struct {
		name, help string
		v          func(GPU) float64
	}{
		{"gpu_utilization_ratio", "GPU utilization averaged over the sampling window (0 to 1).", func(g GPU) float64 { return g.Util }},
		{"gpu_memory_used_bytes", "GPU memory in use.", func(g GPU) float64 { return float64(g.MemUsed) }},
		{"gpu_memory_total_bytes", "GPU memory in all.", func(g GPU) float64 { return float64(g.MemTotal) }},
		{"gpu_power_watts", "GPU power draw averaged over the sampling window.", func(g GPU) float64 { return g.PowerW }},
		{"gpu_power_limit_watts", "Enforced GPU power limit (0: unknown).", func(g GPU) float64 { return g.PowerLimitW }},
		{"gpu_processes", "CUDA compute processes on the GPU.", func(g GPU) float64 { return float64(procs[g.UUID]) }},
	}
	if len(rep.Observation.GPUs) > 0 {
		for _, f := range gpuFamilies {
			m.family(f.name, "gauge", f.help)
			for _, g := range rep.Observation.GPUs {
				m.sample(f.name, f.v(g), gpuLabels(g)...)
			}
		}
	}
	m.family("runs_total", "counter", "Rebalance runs that acted (dry runs excluded).")
	m.sample("runs_total", float64(rep.Totals.Runs))
	m.family("moves_total", "counter", "Processes moved successfully, over all runs.")
	m.sample("moves_total", float64(rep.Totals.Moves))
	m.family("failures_total", "counter", "Failed moves (rolled back or not verified), over all runs.")
	m.sample("failures_total", float64(rep.Totals.Failures))
	m.family("last_run_planned_moves", "gauge", "Moves the last run planned.")
	m.sample("last_run_planned_moves", float64(len(rep.Plan.Moves)))
	m.family("last_run_moves", "gauge", "Moves the last run completed.")
	m.sample("last_run_moves", float64(rep.Moved))
	m.family("last_run_failures", "gauge", "Moves the last run failed.")
	m.sample("last_run_failures", float64(rep.Failed))
	m.family("last_run_success", "gauge", "1 when the last run ended without error.")
	m.sample("last_run_success", b2f(rep.Error == ""))
	m.family("last_run_dry_run", "gauge", "1 when the last run was a dry run.")
	m.sample("last_run_dry_run", b2f(rep.DryRun))
	m.family("last_run_duration_seconds", "gauge", "Duration of the last run's phases (observe, plan, migrate, total).")
	for _, ph := range []string{"observe", "plan", "migrate", "total"} {
		if v, ok := rep.Durations[ph]; ok {
			m.sample("last_run_duration_seconds", v, "phase", ph)
		}
	}
	if len(rep.Results) > 0 {
		m.family("last_run_migration_seconds", "gauge", "Duration of each migration of the last run.")
		for _, r := range rep.Results {
			m.sample("last_run_migration_seconds", r.Seconds, "pid", strconv.Itoa(r.Move.PID),
				"from", strconv.Itoa(r.Move.From.Index), "to", strconv.Itoa(r.Move.To.Index), "ok", strconv.FormatBool(r.OK))
		}
	}
	m.family("last_run_timestamp_seconds", "gauge", "Unix time the last run started.")
	m.sample("last_run_timestamp_seconds", float64(rep.Start.UnixMilli())/1000)
	if !rep.Totals.LastSuccess.IsZero() {
		m.family("last_success_timestamp_seconds", "gauge", "Unix time the last successful (non-dry) run started.")
		m.sample("last_success_timestamp_seconds", float64(rep.Totals.LastSuccess.UnixMilli())/1000)
	}
	return m.err
}

// WriteMetricsFile writes the metrics to file atomically (temp file + rename in the same
// directory), mode 0644 so node_exporter can read it.
func WriteMetricsFile(file string, rep *Report) error {
	var b bytes.Buffer
	if err := WriteMetrics(&b, rep); err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	if fi, err := os.Lstat(file); err == nil && !fi.Mode().IsRegular() {
		return fmt.Errorf("metrics file %s: exists and is not a regular file", file)
	}
	return atomicfile.WriteFile(file, b.Bytes(), 0o644)
}
