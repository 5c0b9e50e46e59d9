package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/term"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/op"
)

// opProgress is the status line of a checkpoint, restore or migrate on a terminal: the phase
// (with its place among the plan's steps), time in the operation, the bytes done and total of
// the store phases with throughput, and an ETA: from the byte rate while bytes move, else from
// the plan's estimate. It redraws itself every 200 ms so that long driver phases visibly tick,
// and clears its line when done. A nil *opProgress (stderr is not a terminal) does nothing, so
// logs and pipes never see it.
//
// It is fed through what the operation packages offer: op.Env.Hook (called with each step's name
// before the step runs) and the store's Progress callback of checkpoint/restore Options.
type opProgress struct {
	mu       sync.Mutex
	w        io.Writer
	what     string
	steps    []string          // plan step names, in order
	labels   map[string]string // step name -> label
	estimate time.Duration     // the whole operation, when the plan gives one
	start    time.Time
	phase    string
	index    int // 1-based place of phase in steps; 0 when unknown
	done     int64
	total    int64
	bytesAt  time.Time // when the current byte count started
	stop     chan struct{}
	stopped  sync.WaitGroup
	drawn    bool
}

// newOpProgress starts the status line on w when w is a terminal, else returns nil.
func newOpProgress(w io.Writer, what string, steps []op.PlanStep, labels map[string]string, estimate time.Duration) *opProgress {
	f, ok := w.(*os.File)
	if !ok || !term.IsTerminal(int(f.Fd())) {
		return nil
	}
	return startOpProgress(w, what, steps, labels, estimate, 200*time.Millisecond)
}

func startOpProgress(w io.Writer, what string, steps []op.PlanStep, labels map[string]string, estimate, every time.Duration) *opProgress {
	p := &opProgress{w: w, what: what, labels: labels, estimate: estimate, start: time.Now(), stop: make(chan struct{})}
	for _, s := range steps {
		if !strings.HasPrefix(s.Step, "on ") { // "on failure" describes the rollback, not a step
			p.steps = append(p.steps, s.Step)
		}
	}
	if every > 0 {
		p.stopped.Add(1)
		go func() {
			defer p.stopped.Done()
			t := time.NewTicker(every)
			defer t.Stop()
			for {
				select {
				case <-p.stop:
					return
				case <-t.C:
					p.redraw()
				}
			}
		}()
	}
	return p
}

// Phase marks the start of step name.
func (p *opProgress) Phase(name string) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.phase = name
	for i, s := range p.steps {
		if s == name {
			p.index = i + 1
		}
	}
	p.done, p.total = 0, 0
	p.mu.Unlock()
	p.redraw()
}

// Hook wraps an op.Hook: the phase changes before the step (and inner) runs.
func (p *opProgress) Hook(inner op.Hook) op.Hook {
	if p == nil {
		return inner
	}
	return func(ctx context.Context, step string) error {
		p.Phase(step)
		if inner != nil {
			return inner(ctx, step)
		}
		return nil
	}
}

// Bytes is the store's progress callback (func(done, total int64)); nil when p is.
func (p *opProgress) Bytes() func(done, total int64) {
	if p == nil {
		return nil
	}
	return func(done, total int64) {
		p.mu.Lock()
		if p.total == 0 && p.done == 0 {
			p.bytesAt = time.Now()
		}
		p.done, p.total = done, total
		p.mu.Unlock()
	}
}

// Done stops the redraws and clears the line.
func (p *opProgress) Done() {
	if p == nil {
		return
	}
	select {
	case <-p.stop:
		return
	default:
		close(p.stop)
	}
	p.stopped.Wait()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.drawn {
		fmt.Fprint(p.w, "\r\x1b[K")
	}
}

func (p *opProgress) redraw() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.stop:
		return
	default:
	}
	fmt.Fprint(p.w, "\r"+p.line(time.Now())+"\x1b[K")
	p.drawn = true
}

// line renders the status: "checkpoint 4242 [5/7] store  1.2 GiB/3.0 GiB  41%  450.0 MiB/s  ETA 4 s  (9.8 s)".
func (p *opProgress) line(now time.Time) string {
	var b strings.Builder
	b.WriteString(p.what)
	label := p.phase
	if l, ok := p.labels[p.phase]; ok {
		label = l
	}
	if p.index > 0 {
		fmt.Fprintf(&b, " [%d/%d]", p.index, len(p.steps))
	}
	if label != "" {
		b.WriteString(" " + label)
	}
	elapsed := now.Sub(p.start)
	eta := time.Duration(-1)
	if p.total > 0 {
		frac := min(1, float64(p.done)/float64(p.total))
		fmt.Fprintf(&b, "  %s/%s  %3.0f%%", bytesize.Format(p.done), bytesize.Format(p.total), frac*100)
		if s := now.Sub(p.bytesAt).Seconds(); s > 0.2 && p.done > 0 {
			rate := float64(p.done) / s
			fmt.Fprintf(&b, "  %s/s", bytesize.Format(int64(rate)))
			eta = time.Duration(float64(p.total-p.done) / rate * float64(time.Second))
		}
	} else if p.estimate > 0 && elapsed < p.estimate {
		eta = p.estimate - elapsed
	}
	if eta >= 0 {
		fmt.Fprintf(&b, "  ETA %s", roughDuration(eta))
	}
	fmt.Fprintf(&b, "  (%s)", roughDuration(elapsed))
	return b.String()
}

// roughDuration: "850 ms", "12.3 s", "4m05s".
func roughDuration(d time.Duration) string {
	switch {
	case d < time.Second:
		return fmt.Sprintf("%d ms", d.Milliseconds())
	case d < time.Minute:
		return fmt.Sprintf("%.1f s", d.Seconds())
	}
	return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
}
