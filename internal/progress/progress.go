// Package progress draws a one-line progress bar with throughput on a terminal. It is silent
// when its writer is not a terminal, so scripts and logs never see control characters.
package progress

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/term"

	"github.com/ptxmig/ptxmig/internal/bytesize"
)

// Bar is a progress line on a terminal; a nil *Bar or one on a non-terminal does nothing.
type Bar struct {
	mu    sync.Mutex
	w     io.Writer
	label string
	start time.Time
	drawn bool
}

// New returns a bar writing to w when w is a terminal, else nil (silent).
func New(w io.Writer, label string) *Bar {
	f, ok := w.(*os.File)
	if !ok || !term.IsTerminal(int(f.Fd())) {
		return nil
	}
	return &Bar{w: w, label: label, start: time.Now()}
}

// Update redraws the bar; safe to call from any goroutine.
func (b *Bar) Update(done, total int64) {
	if b == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	fmt.Fprint(b.w, "\r"+Line(b.label, done, total, time.Since(b.start), 30)+"\x1b[K")
	b.drawn = true
}

// Done clears the bar's line.
func (b *Bar) Done() {
	if b == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.drawn {
		fmt.Fprint(b.w, "\r\x1b[K")
	}
}

// Func adapts the bar to a func(done, total int64) callback; nil when the bar is silent.
func (b *Bar) Func() func(done, total int64) {
	if b == nil {
		return nil
	}
	return b.Update
}

// Line renders one bar line: label, bar of width cells, percentage, bytes and throughput.
func Line(label string, done, total int64, elapsed time.Duration, width int) string {
	frac := 1.0
	if total > 0 {
		frac = min(1, max(0, float64(done)/float64(total)))
	}
	full := int(frac * float64(width))
	bar := strings.Repeat("█", full) + strings.Repeat("░", width-full)
	rate := 0.0
	if s := elapsed.Seconds(); s > 0 {
		rate = float64(done) / s
	}
	return fmt.Sprintf("%s %s %3.0f%% %s/%s %s/s", label, bar, frac*100, bytesize.Format(done), bytesize.Format(total), bytesize.Format(int64(rate)))
}
