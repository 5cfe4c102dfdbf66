package broker

import (
	"context"
	"regexp"
	"sync/atomic"

	"google.golang.org/grpc"

	"github.com/gpupool/gpupool/broker/fsm"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// agentService implements AgentService.
type agentService struct {
	gpupoolv1.UnimplementedAgentServiceServer
	*node
	leadership *leadership
	membership forwarder
}

var hostIDRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

func validateHost(h *gpupoolv1.Host) error {
	if h == nil {
		return refuse(ErrInvalid, "host: is required")
	}
	if !hostIDRE.MatchString(h.Id) {
		return refusef(ErrInvalid, "host.id %q: must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit", h.Id)
	}
	seen := map[string]bool{}
	for i, d := range h.Devices {
		switch {
		case d.Uuid == "":
			return refusef(ErrInvalid, "host.devices[%d].uuid: is required", i)
		case seen[d.Uuid]:
			return refusef(ErrInvalid, "host.devices[%d].uuid %q: reported twice", i, d.Uuid)
		case d.MemoryMib < 1:
			return refusef(ErrInvalid, "host.devices[%d].memory_mib %d: must be at least 1", i, d.MemoryMib)
		case d.Model == "":
			return refusef(ErrInvalid, "host.devices[%d].model: is required", i)
		}
		seen[d.Uuid] = true
	}
	if h.CpuMillicores < 0 || h.MemoryMib < 0 {
		return refusef(ErrInvalid, "host.cpu_millicores %d, host.memory_mib %d: must be 0 or more", h.CpuMillicores, h.MemoryMib)
	}
	return nil
}

func (e agentService) Register(ctx context.Context, req *gpupoolv1.RegisterRequest) (*gpupoolv1.RegisterResponse, error) {
	if err := validateHost(req.Host); err != nil {
		return nil, err
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewAgentServiceClient(conn).Register(fctx, req)
	}
	host := req.Host
	if keptDown(e.fsm.State(), host.Id) {
		// Registering would make the host ready in the same entry: it
		// stays down, as registered before, until its heartbeats confirm
		// the teardowns (rejoin.go).
		e.log.Info("host registers while leases freed during its absence await teardown; it stays down until its agent confirms", "host", host.Id)
	} else if _, err := e.apply(&gpupoolv1.RegisterHostCommand{Host: host, Devices: host.Devices, NowMs: e.nowMs()}); err != nil {
		return nil, err
	}
	if ls := e.leadership.currentLeader(); ls != nil {
		e.leadership.sawHeartbeat(ls, host.Id)
	}
	e.log.Info("host registered", "host", host.Id, "gpus", len(host.Devices), "backend", host.Backend)
	return &gpupoolv1.RegisterResponse{
		HostId:              host.Id,
		HeartbeatIntervalMs: e.cfg.HeartbeatInterval.Milliseconds(),
		HeartbeatTtlMs:      e.cfg.HeartbeatTTL.Milliseconds(),
		Keys:                publicKeys(e.fsm.State(), e.cfg.Clock.Now()),
	}, nil
}

// sawHeartbeat re-arms a host's heartbeat deadline on the leader.
func (ld *leadership) sawHeartbeat(ls *leaderState, hostID string) {
	ls.heartbeat.Reset(hostID, ld.cfg.HeartbeatTTL)
	ls.mu.Lock()
	ls.lastSeen[hostID] = ld.cfg.Clock.Now()
	ls.mu.Unlock()
}

// Heartbeat runs on the leader; followers proxy the stream. Every
// response carries the host's full assignment list, sent after each
// heartbeat and whenever a lease on the host changes. The stream hears
// only of its host's leases, and answers a run of their changes, applied
// while it was busy, with one list: the list is the state, so the last
// one says all that the others would have.
func (e agentService) Heartbeat(stream grpc.BidiStreamingServer[gpupoolv1.HeartbeatRequest, gpupoolv1.HeartbeatResponse]) error {
	var streamHost atomic.Pointer[string] // set once, by the first heartbeat; read as events are published
	hostID := ""
	changed := false // a lease on the host changed since the last list sent
	return serveOnLeaderWith(leaderStream{e.membership, e.leadership, e.fsm}, stream,
		func(conn *grpc.ClientConn, ctx context.Context) (grpc.BidiStreamingClient[gpupoolv1.HeartbeatRequest, gpupoolv1.HeartbeatResponse], error) {
			return gpupoolv1.NewAgentServiceClient(conn).Heartbeat(ctx)
		},
		func(ls *leaderState, r *gpupoolv1.HeartbeatRequest) error {
			if hostID == "" {
				hostID = r.HostId
				streamHost.Store(&hostID)
			} else if r.HostId != hostID {
				return refusef(ErrInvalid, "host_id %q: this stream belongs to host %q", r.HostId, hostID)
			}
			acked, err := e.leadership.heartbeat(ls, r)
			if err != nil {
				return err
			}
			resp := e.leadership.assignments(ls, hostID)
			resp.AckedEventSeq = acked
			resp.ClearHealth = ls.healthClearsFor(hostID, r)
			return stream.Send(resp)
		},
		func(fsm.Event) error {
			changed = true // keep let through only this host's leases' changes, and restores
			return nil
		},
		eventBatching{
			keep: func(ev fsm.Event) bool {
				h := streamHost.Load()
				return h != nil && concernsHost(ev.Lease, *h)
			},
			flush: func() error {
				if !changed || hostID == "" { // no list before the host's first heartbeat
					return nil
				}
				changed = false
				ls := e.leadership.currentLeader()
				if ls == nil {
					return nil // the stream ends with the leadership
				}
				return stream.Send(e.leadership.assignments(ls, hostID))
			},
		})
}

func concernsHost(l *gpupoolv1.Lease, hostID string) bool {
	if l == nil {
		return false
	}
	for _, s := range l.Slices {
		if s.Host == hostID {
			return true
		}
	}
	return false
}

// heartbeat handles one heartbeat on the leader. It returns the highest
// agent event seq now applied.
func (ld *leadership) heartbeat(ls *leaderState, req *gpupoolv1.HeartbeatRequest) (uint64, error) {
	st := ld.fsm.State()
	h := st.Host(req.HostId)
	if h == nil {
		return 0, refusef(ErrNotFound, "host %q: not registered; register first", req.HostId)
	}
	ld.sawHeartbeat(ls, h.Id)
	if waiting := awaitingTeardown(st, h, req); len(waiting) > 0 {
		ld.log.Info(stillAwaitingMsg(waiting), "host", h.Id)
	} else if h.Status == gpupoolv1.HostStatus_HOST_STATUS_DOWN {
		if _, err := ld.apply(&gpupoolv1.SetHostStatusCommand{
			HostId: h.Id, Status: gpupoolv1.HostStatus_HOST_STATUS_READY, NowMs: ld.nowMs(), Reason: "heartbeats resumed",
		}); err != nil {
			return 0, err
		}
		ld.log.Info("host back: heartbeats resumed", "host", h.Id)
	}
	ls.storeReport(h.Id, req)
	acked, err := ld.applyAgentReports(h, req)
	if err != nil {
		return 0, err
	}
	// The leases torn down everywhere are freed together: their entries
	// are sent at once and share Raft's fsyncs, so a host that tore down
	// hundreds of leases since its last heartbeat frees them in one round.
	var frees []Proposal
	for _, id := range req.TornDown {
		l := st.Lease(id)
		if l == nil || l.State != gpupoolv1.LeaseState_LEASE_STATE_RELEASING || !ls.tornDownEverywhere(h.Id, l) {
			continue
		}
		frees = append(frees, ld.applyAsync(freeAfterTeardown(l, ld.nowMs())))
	}
	for _, f := range frees {
		if _, err := f.Wait(); err != nil {
			ld.log.Debug("free lease after teardown", "err", err)
		}
	}
	return acked, nil
}

// assignments lists what a host must enforce and what it must tear down,
// with each lease's TTL and what is left of it on ls's timers.
func (ld *leadership) assignments(ls *leaderState, hostID string) *gpupoolv1.HeartbeatResponse {
	now := ld.cfg.Clock.Now()
	resp := &gpupoolv1.HeartbeatResponse{HeartbeatIntervalMs: ld.cfg.HeartbeatInterval.Milliseconds(),
		Keys: publicKeys(ld.fsm.State(), now)}
	for _, l := range ld.fsm.State().HostLeases(hostID) {
		a := &gpupoolv1.Assignment{LeaseId: l.Id, FencingToken: l.FencingToken, State: l.State, Tenant: l.Tenant, Holder: l.Holder,
			TtlMs: l.TtlMs, HostCpuMillicores: l.HostCpuMillicores, HostMemoryMib: l.HostMemoryMib}
		if d, ok := ls.ttl.Deadline(l.Id); ok {
			a.ExpiresInMs = max(1, d.Sub(now).Milliseconds())
		}
		for _, sl := range l.Slices {
			if sl.Host == hostID {
				a.Slices = append(a.Slices, sl)
			}
		}
		switch l.State {
		case gpupoolv1.LeaseState_LEASE_STATE_GRANTED:
			resp.Enforce = append(resp.Enforce, a)
		case gpupoolv1.LeaseState_LEASE_STATE_RELEASING:
			resp.Teardown = append(resp.Teardown, a)
		}
	}
	if h := ld.fsm.State().Host(hostID); h != nil {
		resp.Teardown = append(resp.Teardown, teardownOfFreed(ld.fsm.State(), h)...)
	}
	return resp
}
