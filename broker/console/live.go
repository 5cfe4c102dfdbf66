package console

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// A page's live stream (GET /events?page=NAME&FILTERS) is server-sent
// events:
//
//   - "parts": JSON [{id, html}]: replace the element with that id (the
//     whole live region has id "live");
//   - "signout": the session ended or its token is no longer valid (data:
//     why); the stream ends;
//   - "fail": the stream cannot go on (data: why), e.g. too many streams.
//
// The stream re-renders the page's live region whenever one of the
// broker's watch streams it follows reports a change, and every
// LiveInterval (for what changes without an event: usage, ages), and sends
// what differs from what it sent.

// minRenderGap spaces re-renders of one stream.
const minRenderGap = 250 * time.Millisecond

func (s *Server) events(w http.ResponseWriter, r *http.Request) {
	sse, ok := newSSE(w, s.cfg.Timeouts.Write)
	if !ok {
		http.Error(w, "streaming unsupported", http.StatusInternalServerError)
		return
	}
	sess, fail := s.authenticate(r)
	if sess == nil {
		if fail.unchecked {
			sse.send("fail", fail.why)
		} else {
			sse.send("signout", fail.why)
		}
		return
	}
	k, ok := pageByName(r.URL.Query().Get("page"))
	if !ok {
		sse.send("fail", fmt.Sprintf("page %q: must be one of pool, host, leases, lease, queue, tenants, cluster", r.URL.Query().Get("page")))
		return
	}
	var f filters
	var err error
	f, err = parseFilters(k, r.URL.Query(), r.URL.Query().Get("id"), "page", "id", "render")
	if err != nil {
		sse.send("fail", err.Error())
		return
	}
	if !s.streams.acquire(sess.key) {
		sse.send("fail", fmt.Sprintf("too many live streams for this token (at most %d open at once): close other console tabs; this page no longer updates", s.cfg.StreamsPerToken))
		return
	}
	defer s.streams.release(sess.key)

	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	lv := &liveStream{s: s, sess: sess, kind: k, f: f, trig: make(chan struct{}, 1), authErr: make(chan string, 1)}
	lv.follow(ctx)
	lv.run(ctx, sse, s.baselines.take(sess, r.URL.Query().Get("render")))
}

// sse writes server-sent events, extending the write deadline per event.
type sse struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
	last    time.Time // of the last write
}

func newSSE(w http.ResponseWriter, timeout time.Duration) (*sse, bool) {
	if _, ok := w.(http.Flusher); !ok {
		return nil, false
	}
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Accel-Buffering", "no")
	return &sse{w: w, rc: http.NewResponseController(w), timeout: timeout}, true
}

func (e *sse) send(event, data string) error {
	var b strings.Builder
	fmt.Fprintf(&b, "event: %s\n", event)
	for _, line := range strings.Split(data, "\n") {
		fmt.Fprintf(&b, "data: %s\n", line)
	}
	b.WriteString("\n")
	return e.write(b.String())
}

func (e *sse) write(s string) error {
	_ = e.rc.SetWriteDeadline(time.Now().Add(e.timeout))
	if _, err := e.w.Write([]byte(s)); err != nil {
		return err
	}
	e.last = time.Now()
	return e.rc.Flush()
}

// keepAlive writes a comment when nothing was written for half the write
// timeout, so that a quiet stream's connection stays open.
func (e *sse) keepAlive() error {
	if time.Since(e.last) < e.timeout/2 {
		return nil
	}
	return e.write(": ping\n\n")
}

// liveStream is one page's stream.
type liveStream struct {
	s    *Server
	sess *session
	kind pageKind
	f    filters
	// trig is signalled when a followed watch reports a change.
	trig chan struct{}
	// authErr receives why the broker refused the token.
	authErr chan string

	mu     sync.Mutex
	hosts  map[string]*gpupoolv1.Host // guarded by mu; the pool's, from WatchHosts
	order  []string                   // guarded by mu
	events []*gpupoolv1.LeaseEvent    // guarded by mu; a lease's, newest first
}

func (lv *liveStream) signal() {
	select {
	case lv.trig <- struct{}{}:
	default:
	}
}

// follow starts the broker watches the page depends on.
func (lv *liveStream) follow(ctx context.Context) {
	ctx = lv.sess.outgoing(ctx)
	api := lv.s.api
	switch lv.kind {
	case pagePool:
		lv.hosts = map[string]*gpupoolv1.Host{}
		go lv.watch(ctx, func(ctx context.Context) (func() error, error) {
			st, err := api.pool.WatchHosts(ctx, &gpupoolv1.WatchHostsRequest{})
			if err != nil {
				return nil, err
			}
			lv.mu.Lock()
			lv.hosts, lv.order = map[string]*gpupoolv1.Host{}, nil
			lv.mu.Unlock()
			return func() error {
				ev, err := st.Recv()
				if err != nil {
					return err
				}
				lv.mu.Lock()
				switch ev.Type {
				case gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT, gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_UPDATED:
					if _, ok := lv.hosts[ev.HostId]; !ok {
						lv.order = append(lv.order, ev.HostId)
					}
					lv.hosts[ev.HostId] = ev.Host
				case gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_REMOVED:
					delete(lv.hosts, ev.HostId)
					lv.order = slices.DeleteFunc(lv.order, func(id string) bool { return id == ev.HostId })
				}
				synced := ev.Type != gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT
				lv.mu.Unlock()
				if synced {
					lv.signal()
				}
				return nil
			}, nil
		})
		if lv.f.Tenant != "" {
			go lv.watchLeases(ctx, &gpupoolv1.WatchLeasesRequest{Tenant: lv.f.Tenant})
		}
	case pageHost:
		go lv.watch(ctx, func(ctx context.Context) (func() error, error) {
			st, err := api.pool.WatchHosts(ctx, &gpupoolv1.WatchHostsRequest{HostId: lv.f.ID})
			if err != nil {
				return nil, err
			}
			return func() error { _, err := st.Recv(); lv.signal(); return err }, nil
		})
		go lv.watchLeases(ctx, &gpupoolv1.WatchLeasesRequest{})
	case pageLeases:
		go lv.watchLeases(ctx, &gpupoolv1.WatchLeasesRequest{Tenant: lv.f.Tenant})
	case pageLease:
		go lv.watchLeases(ctx, &gpupoolv1.WatchLeasesRequest{LeaseId: lv.f.ID})
	case pageQueue:
		go lv.watch(ctx, func(ctx context.Context) (func() error, error) {
			st, err := api.lease.WatchQueue(ctx, &gpupoolv1.WatchQueueRequest{Tenant: lv.f.Tenant})
			if err != nil {
				return nil, err
			}
			return func() error { _, err := st.Recv(); lv.signal(); return err }, nil
		})
	case pageTenants:
		go lv.watchLeases(ctx, &gpupoolv1.WatchLeasesRequest{Tenant: lv.f.Tenant})
	case pageCluster:
		go lv.watch(ctx, func(ctx context.Context) (func() error, error) {
			st, err := api.operator.AuditLog(ctx, &gpupoolv1.AuditLogRequest{Follow: true, Limit: 1})
			if err != nil {
				return nil, err
			}
			return func() error { _, err := st.Recv(); lv.signal(); return err }, nil
		})
	}
}

func (lv *liveStream) watchLeases(ctx context.Context, req *gpupoolv1.WatchLeasesRequest) {
	lv.watch(ctx, func(ctx context.Context) (func() error, error) {
		st, err := lv.s.api.lease.Watch(ctx, req)
		if err != nil {
			return nil, err
		}
		return func() error {
			ev, err := st.Recv()
			if err == nil && lv.kind == pageLease && ev.Type != gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_SNAPSHOT {
				lv.mu.Lock()
				lv.events = append([]*gpupoolv1.LeaseEvent{ev}, lv.events...)
				if len(lv.events) > maxLiveEvents {
					lv.events = lv.events[:maxLiveEvents]
				}
				lv.mu.Unlock()
			}
			lv.signal()
			return err
		}, nil
	})
}

// maxLiveEvents bounds the events a lease page's stream keeps.
const maxLiveEvents = 50

// watch keeps one broker stream open until ctx ends: open it, receive
// until it fails, and open it again after a pause, unless the token was
// refused (then authErr says why).
func (lv *liveStream) watch(ctx context.Context, open func(context.Context) (func() error, error)) {
	pause := 200 * time.Millisecond
	for ctx.Err() == nil {
		recv, err := open(ctx)
		for err == nil {
			err = recv()
		}
		if status.Code(err) == codes.Unauthenticated {
			select {
			case lv.authErr <- status.Convert(err).Message():
			default:
			}
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(pause):
		}
		pause = min(2*pause, 5*time.Second)
	}
}

// run renders and sends until the client goes, the token is refused or
// the console closes.
func (lv *liveStream) run(ctx context.Context, out *sse, base *baseline) {
	s := lv.s
	tick := time.NewTicker(s.cfg.LiveInterval)
	defer tick.Stop()
	// The comment line tells the client the stream is open.
	if out.write(": live\n\n") != nil {
		return
	}
	var lastShape string
	lastParts := map[string]uint64{}
	var lastWhole string
	first := true
	if lv.kind == pagePool && !lv.wait(ctx, out, tick) {
		return // the pool renders from its hosts' watch once it is synced
	}
	for {
		doc, err := lv.render(ctx)
		switch {
		case ctx.Err() != nil:
			return
		case status.Code(err) == codes.Unauthenticated:
			lv.refused(out, status.Convert(err).Message())
			return
		case err != nil:
			if out.send("stale", "live updates paused: "+status.Convert(err).Message()) != nil {
				return
			}
		default:
			var send []part
			if first && base != nil && base.shape == hash64(doc.Shape) {
				// Start from what the page showed.
				lastShape, lastParts = doc.Shape, base.parts
				if len(doc.Parts) == 0 {
					lastWhole = doc.Whole
				}
			}
			if doc.Shape != lastShape || len(doc.Parts) == 0 {
				if doc.Whole != lastWhole {
					send = []part{{ID: "live", HTML: doc.Whole}}
				}
				lastParts = map[string]uint64{}
				for _, p := range doc.Parts {
					lastParts[p.ID] = hash64(p.HTML)
				}
			} else {
				for _, p := range doc.Parts {
					if h := hash64(p.HTML); lastParts[p.ID] != h {
						send = append(send, p)
						lastParts[p.ID] = h
					}
				}
			}
			lastShape, lastWhole, first = doc.Shape, doc.Whole, false
			if len(send) > 0 {
				b, _ := json.Marshal(send)
				if out.send("parts", string(b)) != nil {
					return
				}
			}
		}
		if !lv.wait(ctx, out, tick) {
			return
		}
	}
}

// wait blocks until the next render is due: an event of a followed watch,
// or (except for the pool, which changes only with its hosts' events) a
// tick. Every tick checks the token, so a revoked token's stream ends even
// when nothing it follows changes. It reports false when the stream ends.
func (lv *liveStream) wait(ctx context.Context, out *sse, tick *time.Ticker) bool {
	s := lv.s
	for {
		select {
		case <-ctx.Done():
			return false
		case <-s.ctx.Done():
			return false
		case why := <-lv.authErr:
			lv.refused(out, why)
			return false
		case <-lv.trig:
		case <-tick.C:
			if out.keepAlive() != nil {
				return false
			}
			if lv.sess.id != "" {
				// An open page is use of its session; a session that
				// ended (signed out, too old) ends its streams.
				if live, why := s.sessions.use(lv.sess.id); live == nil {
					out.send("signout", why)
					return false
				}
				_, err := s.api.acl.WhoAmI(lv.sess.outgoing(ctx), &gpupoolv1.WhoAmIRequest{})
				if status.Code(err) == codes.Unauthenticated {
					lv.refused(out, status.Convert(err).Message())
					return false
				}
			}
			if lv.kind == pagePool {
				continue
			}
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(minRenderGap):
			return true
		}
	}
}

// refused ends the stream's session, whose token the broker refused for
// why, and tells the page.
func (lv *liveStream) refused(out *sse, why string) {
	lv.s.endSession(lv.sess)
	out.send("signout", "Your token was refused: "+why)
}

func (lv *liveStream) render(ctx context.Context) (liveDoc, error) {
	if lv.kind != pagePool {
		lv.mu.Lock()
		events := slices.Clone(lv.events)
		lv.mu.Unlock()
		return lv.s.renderLive(ctx, lv.sess, lv.kind, lv.f, fromStream{events: events})
	}
	lv.mu.Lock()
	hosts := make([]*gpupoolv1.Host, 0, len(lv.order))
	for _, id := range lv.order {
		hosts = append(hosts, lv.hosts[id])
	}
	lv.mu.Unlock()
	if len(hosts) == 0 {
		hosts = nil // not synced yet: read them
	}
	return lv.s.renderLive(ctx, lv.sess, lv.kind, lv.f, fromStream{hosts: hosts})
}
