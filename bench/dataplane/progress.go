package dataplanebench

import (
	"io"
	"time"

	"github.com/gpupool/gpupool/bench/report"
)

// meter returns a meter for a transfer of total bytes described by what.
func newMeter(p *report.Progress, what string, total int64) *meter {
	return &meter{p: p, what: what, total: total, start: time.Now(), next: 1}
}

// meter logs a transfer's progress at 25%, 50% and 75% of its size; the
// caller logs its end. Not safe for concurrent use.
type meter struct {
	p     *report.Progress
	what  string
	total int64
	start time.Time
	done  int64
	next  int64 // the next quarter to log, 1 to 3; 4 once all are logged
}

func (m *meter) add(n int) {
	m.done += int64(n)
	for m.next < 4 && m.done*4 >= m.total*m.next {
		m.p.Logf("%s: %d%% after %.2fs", m.what, 25*m.next, time.Since(m.start).Seconds())
		m.next++
	}
}

// meteredReader counts what is read from r on m.
type meteredReader struct {
	r io.Reader
	m *meter
}

func (r *meteredReader) Read(b []byte) (int, error) {
	n, err := r.r.Read(b)
	r.m.add(n)
	return n, err
}

// meteredWriter counts what is written to w on m, and in n.
type meteredWriter struct {
	w io.Writer
	m *meter
	n int64
}

func (w *meteredWriter) Write(b []byte) (int, error) {
	n, err := w.w.Write(b)
	w.n += int64(n)
	w.m.add(n)
	return n, err
}
