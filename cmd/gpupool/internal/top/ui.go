package top

import (
	"context"
	"errors"
	"io"
	"reflect"
	"strings"
	"time"

	tea "github.com/charmbracelet/bubbletea"
	"github.com/mattn/go-runewidth"
)

// Model is the terminal program (a bubbletea model): it applies the
// updates that reach it, answers keys, and renders the screen. Keys:
//
//	s      next host order (util, reserved, memory, leases, name)
//	t / T  next / no tenant filter
//	m / M  next / no model filter
//	a      no filters
//	p, space  pause (updates wait, the screen stays) / resume
//	q, ctrl+c, esc  quit
type Model struct {
	state   State
	opts    Options
	paused  bool
	held    []Update // updates that arrived while paused, in order
	width   int
	height  int
	updates <-chan Update
	now     func() time.Time
}

// NewModel is a Model fed from updates, starting with opts.
func NewModel(updates <-chan Update, opts Options, now func() time.Time) *Model {
	if now == nil {
		now = time.Now
	}
	return &Model{opts: opts, updates: updates, width: 80, height: 24, now: now}
}

// updatesMsg carries the updates read at once from the channel.
type updatesMsg []Update

type tickMsg time.Time

// waitForUpdates reads one update, then whatever else is ready (up to
// 512), so that a burst renders once.
func (m *Model) waitForUpdates() tea.Msg {
	u, ok := <-m.updates
	if !ok {
		return nil
	}
	batch := updatesMsg{u}
	for len(batch) < 512 {
		select {
		case u, ok := <-m.updates:
			if !ok {
				return batch
			}
			batch = append(batch, u)
		default:
			return batch
		}
	}
	return batch
}

func tick() tea.Cmd {
	return tea.Tick(time.Second, func(t time.Time) tea.Msg { return tickMsg(t) })
}

// Init implements tea.Model.
func (m *Model) Init() tea.Cmd { return tea.Batch(m.waitForUpdates, tick()) }

// Update implements tea.Model.
func (m *Model) Update(msg tea.Msg) (tea.Model, tea.Cmd) {
	switch msg := msg.(type) {
	case updatesMsg:
		for _, u := range msg {
			m.apply(u)
		}
		return m, m.waitForUpdates
	case tickMsg:
		m.apply(Tick{Now: time.Time(msg)})
		return m, tick()
	case tea.WindowSizeMsg:
		m.width, m.height = msg.Width, msg.Height
	case tea.KeyMsg:
		return m, m.Key(msg.String())
	}
	return m, nil
}

func (m *Model) apply(u Update) {
	if m.paused {
		// Updates that replace a whole part of the state keep only their
		// latest while paused, so a long pause holds one copy of the
		// hosts, not one per poll.
		switch u.(type) {
		case HostsUpdate, StatusUpdate, QueueUpdate, Tick:
			for i, h := range m.held {
				if reflect.TypeOf(h) == reflect.TypeOf(u) {
					m.held[i] = u
					return
				}
			}
		}
		m.held = append(m.held, u)
		return
	}
	m.state.Apply(u, m.now())
}

// Key acts on one key press (tea's names: "s", "ctrl+c", " ").
func (m *Model) Key(k string) tea.Cmd {
	switch k {
	case "q", "ctrl+c", "esc":
		return tea.Quit
	case "s":
		m.opts.Sort = m.opts.Sort.Next()
	case "t":
		m.opts.Tenant = NextOf(m.state.Tenants(), m.opts.Tenant)
	case "T":
		m.opts.Tenant = ""
	case "m":
		m.opts.Model = NextOf(m.state.Models(), m.opts.Model)
	case "M":
		m.opts.Model = ""
	case "a":
		m.opts.Tenant, m.opts.Model = "", ""
	case "p", " ":
		m.paused = !m.paused
		if !m.paused {
			for _, u := range m.held {
				m.state.Apply(u, m.now())
			}
			m.held = nil
		}
	}
	return nil
}

// Options are the sort and filters in force.
func (m *Model) Options() Options { return m.opts }

// Paused says whether updates are held.
func (m *Model) Paused() bool { return m.paused }

// View implements tea.Model: the screen as plain lines, the first in
// reverse video and section titles in bold.
func (m *Model) View() string {
	lines := Render(Derive(&m.state, m.opts), m.paused, m.width, m.height)
	for i, l := range lines {
		switch {
		case i == 0:
			lines[i] = "\x1b[7m" + l + strings.Repeat(" ", max(m.width-runewidth.StringWidth(l), 0)) + "\x1b[0m"
		case strings.HasPrefix(l, "-- "):
			lines[i] = "\x1b[1m" + l + "\x1b[0m"
		}
	}
	return strings.Join(lines, "\n")
}

// Run shows the dashboard on the terminal of in and out until the user
// quits or ctx ends. src feeds it from its own goroutine.
func Run(ctx context.Context, src Source, opts Options, in io.Reader, out io.Writer) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	updates := make(chan Update, 1024)
	go src.Run(ctx, updates)
	p := tea.NewProgram(NewModel(updates, opts, nil), tea.WithContext(ctx), tea.WithInput(in), tea.WithOutput(out), tea.WithAltScreen())
	_, err := p.Run()
	if errors.Is(err, tea.ErrProgramKilled) && ctx.Err() != nil {
		return nil // interrupted: not a failure
	}
	return err
}
