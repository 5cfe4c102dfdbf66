package top

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/mattn/go-runewidth"
)

// Render lays v out for a terminal of width x height cells: a header, then
// the pool by model, the busiest hosts, the queue, drains and recent
// events, each cut to what fits. Narrow terminals lose the least useful
// columns first and then have cells cut (marked "~"), never wrapped, so
// every line is at most width cells. Lines are plain text; section titles
// start with "-- ".
func Render(v View, paused bool, width, height int) []string {
	width = max(width, 20)
	height = max(height, 3)
	var head []string
	state := "live"
	if paused {
		state = "PAUSED"
	}
	items := []string{"gpupool top", state}
	if v.Leader != "" {
		items = append(items, "leader "+v.Leader)
	} else {
		items = append(items, "no leader known")
	}
	items = append(items, fmt.Sprintf("hosts %d/%d ready", v.HostsUp, v.Hosts), fmt.Sprintf("%d GPUs", v.GPUs),
		"leases "+leaseSums(v.LeaseSums))
	if !v.Now.IsZero() {
		items = append(items, v.Now.Format("15:04:05"))
	}
	head = append(head, flow(items, "  ", width, 2)...)
	filters := []string{"sort " + v.Options.Sort.String(), "tenant " + orAll(v.Options.Tenant), "model " + orAll(v.Options.Model)}
	keys := "keys: s sort, t tenant, m model, a all, p pause, q quit"
	if width < 60 {
		keys = "s t m a p q"
	}
	head = append(head, flow(append(filters, keys), "  ", width, 2)...)
	for i, e := range v.Errors {
		if i == 2 {
			head = append(head, fit(fmt.Sprintf("! and %d more", len(v.Errors)-2), width))
			break
		}
		head = append(head, fit("! "+e, width))
	}
	if len(head) >= height {
		return head[:height]
	}

	secs := []*section{poolSection(v, width), hostSection(v, width), queueSection(v, width), drainSection(v, width), eventSection(v, width)}
	allot(secs, height-len(head))
	out := head
	for _, s := range secs {
		out = append(out, s.lines()...)
	}
	return out
}

func orAll(s string) string {
	if s == "" {
		return "all"
	}
	return s
}

func leaseSums(m map[string]int) string {
	var parts []string
	for _, st := range []string{"pending", "granted", "releasing"} {
		if n := m[st]; n > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n, st))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// flow puts items on at most maxLines lines of width, separated by sep;
// an item that does not fit the last line is cut.
func flow(items []string, sep string, width, maxLines int) []string {
	var lines []string
	cur := ""
	for _, it := range items {
		switch {
		case cur == "":
			cur = it
		case runewidth.StringWidth(cur+sep+it) <= width:
			cur += sep + it
		case len(lines)+1 < maxLines:
			lines = append(lines, fit(cur, width))
			cur = it
		default:
			cur += sep + it
		}
	}
	return append(lines, fit(cur, width))
}

// fit cuts s to width cells, marking a cut with "~".
func fit(s string, width int) string {
	if runewidth.StringWidth(s) <= width {
		return s
	}
	if width <= 1 {
		return runewidth.Truncate(s, width, "")
	}
	return runewidth.Truncate(s, width, "~")
}

// section is a titled table whose rows are cut to the lines it is given.
type section struct {
	title  string
	header string
	rows   []string
	empty  string // said on the title line when there are no rows
	width  int
	// min and want: lines below which the section is left out, and
	// beyond which it has no use for more. give is what allot gave.
	give int
}

func (s *section) need() int {
	if len(s.rows) == 0 {
		return 1
	}
	return 2 + len(s.rows)
}

func (s *section) lines() []string {
	if s.give <= 0 {
		return nil
	}
	title := "-- " + s.title + " "
	if len(s.rows) == 0 && s.empty != "" {
		title += "(" + s.empty + ") "
	}
	shown := min(len(s.rows), max(s.give-2, 0))
	if shown < len(s.rows) && shown > 0 {
		title += fmt.Sprintf("[%d of %d] ", shown, len(s.rows))
	}
	if w := runewidth.StringWidth(title); w < s.width {
		title += strings.Repeat("-", s.width-w)
	}
	out := []string{fit(title, s.width)}
	if shown > 0 {
		out = append(out, s.header)
		out = append(out, s.rows[:shown]...)
	}
	return out
}

// allot shares n lines between the sections: each first gets its title,
// header and first row (from the first section on, while lines last),
// then the pool gets all its rows, the queue and drains up to 3, the
// hosts up to 8, and the hosts and events share what is left.
func allot(secs []*section, n int) {
	pool, hosts, queue, drains, events := secs[0], secs[1], secs[2], secs[3], secs[4]
	grow := func(s *section, upto int) {
		want := min(s.need(), upto)
		if d := want - s.give; d > 0 {
			d = min(d, n)
			s.give += d
			n -= d
		}
	}
	for _, s := range secs {
		grow(s, min(s.need(), 3))
	}
	grow(pool, pool.need())
	grow(queue, 2+3)
	grow(drains, 2+3)
	grow(hosts, 2+8)
	grow(events, 2+8)
	for n > 0 {
		before := n
		grow(hosts, hosts.give+1)
		grow(events, events.give+1)
		grow(queue, queue.give+1)
		grow(drains, drains.give+1)
		if n == before {
			break
		}
	}
}

// column of a table. Columns of lower keep are left out first when the
// table is too wide; the flex column is cut before any is left out.
type column struct {
	title string
	keep  int
	right bool
	flex  bool
}

// layout formats rows under cols in at most width cells per line and
// returns the header and the rows.
func layout(cols []column, rows [][]string, width int) (string, []string) {
	natural := make([]int, len(cols))
	for i, c := range cols {
		natural[i] = runewidth.StringWidth(c.title)
		for _, r := range rows {
			natural[i] = max(natural[i], runewidth.StringWidth(r[i]))
		}
	}
	on := make([]bool, len(cols))
	for i := range on {
		on[i] = true
	}
	widths := make([]int, len(cols))
	for {
		total, n := 0, 0
		flex := -1
		for i := range cols {
			if !on[i] {
				continue
			}
			widths[i] = natural[i]
			total += widths[i]
			n++
			if cols[i].flex {
				flex = i
			}
		}
		total += 2 * (n - 1)
		if total <= width {
			break
		}
		if flex >= 0 {
			least := min(natural[flex], max(runewidth.StringWidth(cols[flex].title), 12))
			if total-(natural[flex]-least) <= width {
				widths[flex] = natural[flex] - (total - width)
				break
			}
		}
		// Leave out the column least worth keeping (never the first).
		drop := -1
		for i := 1; i < len(cols); i++ {
			if on[i] && (drop < 0 || cols[i].keep < cols[drop].keep) {
				drop = i
			}
		}
		if drop < 0 {
			widths[0] = width
			break
		}
		on[drop] = false
	}
	line := func(cells []string) string {
		var b strings.Builder
		first := true
		for i, c := range cols {
			if !on[i] {
				continue
			}
			if !first {
				b.WriteString("  ")
			}
			first = false
			cell := fit(cells[i], widths[i])
			pad := strings.Repeat(" ", max(widths[i]-runewidth.StringWidth(cell), 0))
			if c.right {
				b.WriteString(pad + cell)
			} else {
				b.WriteString(cell + pad)
			}
		}
		return fit(strings.TrimRight(b.String(), " "), width)
	}
	titles := make([]string, len(cols))
	for i, c := range cols {
		titles[i] = c.title
	}
	out := make([]string, len(rows))
	for i, r := range rows {
		out[i] = line(r)
	}
	return line(titles), out
}

func newSection(title, empty string, width int, cols []column, rows [][]string) *section {
	h, r := layout(cols, rows, width)
	return &section{title: title, empty: empty, header: h, rows: r, width: width}
}

func pctCell(p int) string {
	if p < 0 {
		return "-"
	}
	return strconv.Itoa(p) + "%"
}

// bar draws reserved (=) against measured (#) use in n cells.
func bar(reserved, measured, n int) string {
	cells := func(p int) int { return min(max((p*n+50)/100, 0), n) }
	r, m := cells(reserved), cells(max(measured, 0))
	b := []byte(strings.Repeat(".", n))
	for i := range r {
		b[i] = '='
	}
	for i := range m {
		b[i] = '#'
	}
	return "[" + string(b) + "]"
}

func poolSection(v View, width int) *section {
	cols := []column{{title: "MODEL", keep: 10}, {title: "GPUS", keep: 9, right: true}, {title: "COMP RESV", keep: 8, right: true},
		{title: "UTIL", keep: 8, right: true}, {title: "MEM RESV", keep: 7, right: true}, {title: "MEM USED", keep: 6, right: true},
		{title: "RESERVED(=) VS UTIL(#)", keep: 2}, {title: "LEASES", keep: 5, right: true}, {title: "BAD", keep: 3, right: true}}
	var rows [][]string
	for _, m := range v.Models {
		used := -1
		if m.UsedMiB >= 0 {
			used = pct(m.UsedMiB, m.MemoryMiB)
		}
		rp := pct(m.ReservedPct, m.ComputePct)
		rows = append(rows, []string{m.Model, strconv.Itoa(m.GPUs), pctCell(rp), pctCell(m.Util), pctCell(pct(m.ReservedMiB, m.MemoryMiB)),
			pctCell(used), bar(rp, m.Util, 20), strconv.Itoa(m.Leases), strconv.Itoa(m.Unhealthy)})
	}
	title := "POOL by model, reserved vs measured"
	if v.Options.Tenant != "" {
		title += ", reserved by " + v.Options.Tenant
	}
	return newSection(title, "no GPUs", width, cols, rows)
}

func hostSection(v View, width int) *section {
	cols := []column{{title: "HOST", keep: 10}, {title: "STATUS", keep: 9}, {title: "GPUS", keep: 5, right: true},
		{title: "UTIL", keep: 9, right: true}, {title: "RESV", keep: 8, right: true}, {title: "MEM RESV", keep: 6, right: true},
		{title: "MEM USED", keep: 4, right: true}, {title: "LEASES", keep: 7, right: true}, {title: "BAD", keep: 3, right: true},
		{title: "HEARTBEAT", keep: 2, right: true}, {title: "NOTE", keep: 1, flex: true}}
	var rows [][]string
	for _, h := range v.HostRows {
		hb := "-"
		if h.HeartbeatAge >= 0 {
			hb = shortDuration(h.HeartbeatAge) + " ago"
		}
		rows = append(rows, []string{h.ID, h.Status, strconv.Itoa(h.GPUs), pctCell(h.UtilPct), pctCell(h.ReservedPct), pctCell(h.MemReservedPct),
			pctCell(h.MemUsedPct), strconv.Itoa(h.Leases), strconv.Itoa(h.Unhealthy), hb, h.Note})
	}
	return newSection("HOSTS busiest first, by "+v.Options.Sort.String(), "none", width, cols, rows)
}

func queueSection(v View, width int) *section {
	cols := []column{{title: "LEASE", keep: 10}, {title: "TENANT", keep: 9}, {title: "PRIO", keep: 4, right: true},
		{title: "REQUEST", keep: 6}, {title: "WAITED", keep: 5, right: true}, {title: "WHY PENDING", keep: 8, flex: true}}
	var rows [][]string
	for _, q := range v.Queue {
		rows = append(rows, []string{q.ID, q.Tenant, strconv.Itoa(int(q.Priority)), q.Request, shortDuration(q.Waited), orDash(q.Why)})
	}
	return newSection(fmt.Sprintf("QUEUE %d pending", len(v.Queue)), "empty", width, cols, rows)
}

func drainSection(v View, width int) *section {
	cols := []column{{title: "HOST", keep: 10}, {title: "LEASES", keep: 9, right: true}, {title: "DEADLINE", keep: 8},
		{title: "BY", keep: 3}, {title: "REASON", keep: 5, flex: true}}
	var rows [][]string
	for _, d := range v.Drains {
		deadline := "none"
		switch {
		case d.Forced:
			deadline = "now (forced)"
		case !d.Deadline.IsZero():
			deadline = "in " + shortDuration(max(d.Deadline.Sub(v.Now), 0))
		}
		rows = append(rows, []string{d.Host, strconv.Itoa(d.Leases), deadline, orDash(d.By), orDash(d.Reason)})
	}
	return newSection(fmt.Sprintf("DRAINS %d in progress", len(v.Drains)), "none", width, cols, rows)
}

func eventSection(v View, width int) *section {
	cols := []column{{title: "TIME", keep: 7}, {title: "EVENT", keep: 10}, {title: "SUBJECT", keep: 9}, {title: "TENANT", keep: 6},
		{title: "DETAIL", keep: 8, flex: true}}
	var rows [][]string
	for _, e := range v.Events {
		rows = append(rows, []string{e.At.Format("15:04:05"), e.Kind, shortSubject(e.Subject), orDash(e.Tenant), orDash(e.Text)})
	}
	return newSection("EVENTS newest first", "none yet", width, cols, rows)
}

// shortSubject cuts a token's accessor id (a UUID) to its first 8
// characters, which tell tokens apart on one screen; other subjects stay.
func shortSubject(s string) string {
	if len(s) == 36 && strings.Count(s, "-") == 4 {
		return s[:8]
	}
	return s
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// shortDuration is d in at most two units: 45s, 3m12s, 2h5m, 3d4h.
func shortDuration(d time.Duration) string {
	d = d.Round(time.Second)
	switch {
	case d < time.Minute:
		return strconv.Itoa(int(d.Seconds())) + "s"
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
}
