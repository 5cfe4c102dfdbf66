package broker

import (
	"context"
	"path"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// The watch streams of hosts, devices and the queue compare what they
// would send now with what they sent, whenever the state changes and every
// interval (leader memory — heartbeats, readings, why-pending texts —
// changes without a write), and send the difference. They run on the
// leader, which has that memory; a follower proxies the stream, and ends
// it with Unavailable when the leader goes, as KeepAlive does.

// Bounds of a watch's interval_ms.
const (
	defaultWatchInterval = time.Second
	minWatchInterval     = 100 * time.Millisecond
	maxWatchInterval     = time.Minute
)

// watchInterval validates a request's interval_ms.
func watchInterval(ms int64) (time.Duration, error) {
	if ms == 0 {
		return defaultWatchInterval, nil
	}
	d := time.Duration(ms) * time.Millisecond
	if d < minWatchInterval || d > maxWatchInterval {
		return 0, refusef(ErrInvalid, "interval_ms %d: must be 0 (1000) or between %d and %d",
			ms, minWatchInterval.Milliseconds(), maxWatchInterval.Milliseconds())
	}
	return d, nil
}

// stateWatch runs the rounds of a watch stream; poolService and
// leaseService each hold one.
type stateWatch struct {
	*node
	leadership leaderMemory
	gatekeeper rechecker
}

// rechecker checks a caller's token again during a stream. It is
// implemented by gatekeeper.
type rechecker interface {
	// recheck returns nil while c's token, read again from the state,
	// is still valid (not deleted, not expired); an anonymous caller
	// (ACL off) always is.
	recheck(c *caller) error
}

// watchState calls build with the current state at once, then whenever the
// state changes (at most every minWatchInterval) and every interval, until
// ctx ends, build fails, or — unless stale — this server stops leading.
// Every round re-checks the caller's token, so a revoked token's watch
// ends even when nothing changes.
func (w stateWatch) watchState(ctx context.Context, interval time.Duration, stale bool, build func(*state.Reader) error) error {
	c := callerFrom(ctx)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		if !stale && w.leadership.currentLeader() == nil {
			return refuse(ErrUnavailable, "this server no longer leads; watch again")
		}
		if err := w.gatekeeper.recheck(c); err != nil {
			return err
		}
		st := w.fsm.State()
		_, changed := st.IndexWatch()
		if err := build(st); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err() // the caller's deadline or cancellation, not a clean end
		case <-w.ctx.Done():
			return refuse(ErrUnavailable, "server shutting down")
		case <-tick.C:
		case <-changed:
			// Let a burst of writes land before building again.
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(minWatchInterval):
			}
		}
	}
}

// diff keeps what a watch sent, by key, and sends what changed.
type diff[M proto.Message] struct {
	sent   map[string]M
	synced bool
}

// round sends every object of now that differs from what was sent
// (compared after norm), and removes those no longer there. The first
// round sends snapshots, then the synced marker.
func (d *diff[M]) round(now map[string]M, order []string, norm func(M) M,
	send func(t gpupoolv1.WatchEventType, key string, m M) error) error {
	typ := gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_UPDATED
	if !d.synced {
		typ = gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT
		d.sent = map[string]M{}
	}
	for _, k := range order {
		m := now[k]
		cmp := norm(m)
		if old, ok := d.sent[k]; ok && proto.Equal(old, cmp) {
			continue
		}
		if err := send(typ, k, m); err != nil {
			return err
		}
		d.sent[k] = cmp
	}
	for k := range d.sent {
		if _, ok := now[k]; !ok {
			var zero M
			if err := send(gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_REMOVED, k, zero); err != nil {
				return err
			}
			delete(d.sent, k)
		}
	}
	if !d.synced {
		d.synced = true
		var zero M
		return send(gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED, "", zero)
	}
	return nil
}

func (e poolService) WatchHosts(req *gpupoolv1.WatchHostsRequest, stream grpc.ServerStreamingServer[gpupoolv1.HostEvent]) error {
	interval, err := watchInterval(req.IntervalMs)
	if err != nil {
		return err
	}
	return watchOnLeader(e.membership, stream, req.Stale,
		func(conn *grpc.ClientConn, ctx context.Context) (grpc.ServerStreamingClient[gpupoolv1.HostEvent], error) {
			return gpupoolv1.NewPoolServiceClient(conn).WatchHosts(ctx, req)
		},
		func() error {
			var d diff[*gpupoolv1.Host]
			norm := func(h *gpupoolv1.Host) *gpupoolv1.Host {
				if req.HeartbeatAge || h.LastHeartbeatAgeMs <= 0 {
					return h
				}
				h = proto.CloneOf(h)
				h.LastHeartbeatAgeMs = 0
				return h
			}
			return e.watch.watchState(stream.Context(), interval, req.Stale, func(st *state.Reader) error {
				now, order := map[string]*gpupoolv1.Host{}, []string{}
				hosts := st.HostsWithDevices()
				if req.HostId != "" {
					hosts = nil
					if h := st.Host(req.HostId); h != nil {
						h = proto.CloneOf(h)
						h.Devices = st.HostDevices(h.Id)
						hosts = append(hosts, h)
					}
				}
				for _, h := range hosts {
					if !req.Stale {
						h = e.leadership.withLiveView(h)
					}
					now[h.Id] = h
					order = append(order, h.Id)
				}
				return d.round(now, order, norm, func(t gpupoolv1.WatchEventType, id string, h *gpupoolv1.Host) error {
					return stream.Send(&gpupoolv1.HostEvent{Type: t, Host: h, HostId: id, Index: st.Index()})
				})
			})
		})
}

func (e poolService) WatchDevices(req *gpupoolv1.WatchDevicesRequest, stream grpc.ServerStreamingServer[gpupoolv1.DeviceEvent]) error {
	if _, err := path.Match(req.Model, ""); err != nil {
		return refusef(ErrInvalid, "model %q: must be a valid glob such as A100*", req.Model)
	}
	interval, err := watchInterval(req.IntervalMs)
	if err != nil {
		return err
	}
	return watchOnLeader(e.membership, stream, req.Stale,
		func(conn *grpc.ClientConn, ctx context.Context) (grpc.ServerStreamingClient[gpupoolv1.DeviceEvent], error) {
			return gpupoolv1.NewPoolServiceClient(conn).WatchDevices(ctx, req)
		},
		func() error {
			var d diff[*gpupoolv1.Device]
			same := func(d *gpupoolv1.Device) *gpupoolv1.Device { return d }
			return e.watch.watchState(stream.Context(), interval, req.Stale, func(st *state.Reader) error {
				devs := st.Devices()
				if req.HostId != "" {
					devs = st.HostDevices(req.HostId)
				}
				var ls *leaderState
				if !req.Stale {
					ls = e.leadership.currentLeader()
				}
				now, order := map[string]*gpupoolv1.Device{}, []string{}
				for _, dev := range devs {
					if ok, _ := path.Match(req.Model, dev.Model); req.Model != "" && !ok {
						continue
					}
					dev = withReadings(ls, dev)
					now[dev.Uuid] = dev
					order = append(order, dev.Uuid)
				}
				return d.round(now, order, same, func(t gpupoolv1.WatchEventType, id string, dev *gpupoolv1.Device) error {
					return stream.Send(&gpupoolv1.DeviceEvent{Type: t, Device: dev, Uuid: id, Index: st.Index()})
				})
			})
		})
}

func (e leaseService) WatchQueue(req *gpupoolv1.WatchQueueRequest, stream grpc.ServerStreamingServer[gpupoolv1.QueueSnapshot]) error {
	c := callerFrom(stream.Context())
	if req.Tenant != "" {
		if err := protocol.ValidateTenant("tenant", req.Tenant); err != nil {
			return toStatus(err)
		}
		if err := c.mayActFor(req.Tenant, "tenant"); err != nil {
			return err
		}
	}
	interval, err := watchInterval(req.IntervalMs)
	if err != nil {
		return err
	}
	return watchOnLeader(e.membership, stream, req.Stale,
		func(conn *grpc.ClientConn, ctx context.Context) (grpc.ServerStreamingClient[gpupoolv1.QueueSnapshot], error) {
			return gpupoolv1.NewLeaseServiceClient(conn).WatchQueue(ctx, req)
		},
		func() error {
			var last *gpupoolv1.QueueSnapshot
			return e.watch.watchState(stream.Context(), interval, req.Stale, func(st *state.Reader) error {
				q := e.queueSnapshot(st, c, req.Tenant)
				if last != nil && proto.Equal(last, q) {
					return nil
				}
				last = q
				out := proto.CloneOf(q)
				out.AtMs = e.nowMs()
				return stream.Send(out)
			})
		})
}

// queueSnapshot is the queue as c may see it (of one tenant, or all),
// without its time.
func (e leaseService) queueSnapshot(st *state.Reader, c *caller, tenant string) *gpupoolv1.QueueSnapshot {
	match := func(l *gpupoolv1.Lease) bool { return (tenant == "" || l.Tenant == tenant) && c.sees(l) }
	q := &gpupoolv1.QueueSnapshot{Index: st.Index()}
	why := e.capacity.explainer(st)
	seen := map[string]bool{}
	for _, p := range st.PendingLeases() {
		for _, v := range st.PreemptedFor(p.Id) {
			if match(v) && !seen[v.Id] {
				seen[v.Id] = true
				q.Preempting = append(q.Preempting, e.queueView(v))
			}
		}
		if match(p) {
			q.Pending = append(q.Pending, e.leadership.view(why, p))
		}
	}
	for _, l := range st.ElasticLeases() {
		if !match(l) {
			continue
		}
		el := &gpupoolv1.ElasticLease{Lease: e.queueView(l)}
		for _, x := range st.Extras(l.Id) {
			if state.Holding(x.State) {
				el.Extras = append(el.Extras, e.queueView(x))
			}
		}
		q.Elastic = append(q.Elastic, el)
	}
	return q
}

// queueView is a granted lease as the queue's snapshot shows it: the
// leader's view without the expiry, which moves on every renewal and
// would make every round differ.
func (e leaseService) queueView(l *gpupoolv1.Lease) *gpupoolv1.Lease {
	l = proto.CloneOf(e.leadership.withLeaderView(l))
	l.ExpiresAtMs = 0
	return l
}
