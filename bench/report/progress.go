package report

import (
	"fmt"
	"io"
	"sync"
	"time"
)

// Progress writes progress lines, each stamped with the time since the
// run started. Safe for concurrent use.
type Progress struct {
	start time.Time

	mu sync.Mutex
	w  io.Writer // guarded by mu
}

// NewProgress returns a Progress writing to w, its clock started now.
func NewProgress(w io.Writer) *Progress {
	return &Progress{w: w, start: time.Now()}
}

// Logf writes one line.
func (p *Progress) Logf(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(p.w, "[%7.2fs] %s\n", time.Since(p.start).Seconds(), fmt.Sprintf(format, args...))
}
