package leasebench

import (
	"fmt"
	"io"
	"sync"
	"time"
)

// progress writes progress lines, each stamped with the time since the
// run started. Safe for concurrent use.
type progress struct {
	start time.Time

	mu sync.Mutex
	w  io.Writer // guarded by mu
}

func newProgress(w io.Writer) *progress {
	return &progress{w: w, start: time.Now()}
}

func (p *progress) logf(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(p.w, "[%7.2fs] %s\n", time.Since(p.start).Seconds(), fmt.Sprintf(format, args...))
}
