package broker

import (
	"context"
	"github.com/hashicorp/raft"
	"path"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// poolService implements PoolService.
type poolService struct {
	gpupoolv1.UnimplementedPoolServiceServer
	*node
	raft       *raft.Raft
	capacity   *capacity
	leadership *leadership
	membership clusterView
	watch      stateWatch
}

// withLiveView returns a copy of h with what the leader knows live: the
// heartbeat age and its devices' readings (-1 each when this server does
// not lead or has not heard from the host).
func (ld *leadership) withLiveView(h *gpupoolv1.Host) *gpupoolv1.Host {
	h = proto.Clone(h).(*gpupoolv1.Host)
	h.LastHeartbeatAgeMs = -1
	ls := ld.currentLeader()
	if ls != nil {
		ls.mu.Lock()
		if t, ok := ls.lastSeen[h.Id]; ok {
			h.LastHeartbeatAgeMs = ld.cfg.Clock.Now().Sub(t).Milliseconds()
		}
		ls.mu.Unlock()
	}
	for _, d := range h.Devices {
		setReadings(ls, d) // d is this copy's own
	}
	return h
}

// withReadings returns a copy of d with the last readings its agent
// reported to ls, or -1 for each when ls is nil or has none.
func withReadings(ls *leaderState, d *gpupoolv1.Device) *gpupoolv1.Device {
	d = proto.Clone(d).(*gpupoolv1.Device)
	setReadings(ls, d)
	return d
}

// setReadings sets d's readings as withReadings does; d must be a copy
// (the state's objects are never modified).
func setReadings(ls *leaderState, d *gpupoolv1.Device) {
	d.UsedMemoryMib, d.UtilizationPercent = -1, -1
	if ls == nil {
		return
	}
	if r := ls.deviceReport(d.HostId, d.Uuid); r != nil {
		d.UsedMemoryMib, d.UtilizationPercent = r.UsedMemoryMib, r.UtilizationPercent
	}
}

func (e poolService) ListHosts(ctx context.Context, req *gpupoolv1.ListHostsRequest) (*gpupoolv1.ListHostsResponse, error) {
	if conn, fctx, err := e.membership.readConn(ctx, req.Stale); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewPoolServiceClient(conn).ListHosts(fctx, req)
	}
	resp := &gpupoolv1.ListHostsResponse{}
	for _, h := range e.fsm.State().HostsWithDevices() {
		resp.Hosts = append(resp.Hosts, e.leadership.withLiveView(h))
	}
	return resp, nil
}

func (e poolService) GetHost(ctx context.Context, req *gpupoolv1.GetHostRequest) (*gpupoolv1.GetHostResponse, error) {
	if req.HostId == "" {
		return nil, refuse(ErrInvalid, "host_id: is required")
	}
	if conn, fctx, err := e.membership.readConn(ctx, req.Stale); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewPoolServiceClient(conn).GetHost(fctx, req)
	}
	st := e.fsm.State()
	h := st.Host(req.HostId)
	if h == nil {
		return nil, refusef(ErrNotFound, "host %q: not found; see 'gpupool host ls'", req.HostId)
	}
	h = proto.Clone(h).(*gpupoolv1.Host)
	h.Devices = st.HostDevices(h.Id)
	h = e.leadership.withLiveView(h)
	resp := &gpupoolv1.GetHostResponse{Host: h}
	c := callerFrom(ctx)
	for _, l := range st.HostLeases(h.Id) {
		if !ended(l.State) && c.sees(l) {
			resp.Leases = append(resp.Leases, e.leadership.withLeaderView(l))
		}
	}
	return resp, nil
}

func (e poolService) ListDevices(ctx context.Context, req *gpupoolv1.ListDevicesRequest) (*gpupoolv1.ListDevicesResponse, error) {
	if _, err := path.Match(req.Model, ""); err != nil {
		return nil, refusef(ErrInvalid, "model %q: must be a valid glob such as A100*", req.Model)
	}
	if conn, fctx, err := e.membership.readConn(ctx, req.Stale); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewPoolServiceClient(conn).ListDevices(fctx, req)
	}
	st := e.fsm.State()
	devs := st.Devices()
	if req.HostId != "" {
		devs = st.HostDevices(req.HostId)
	}
	resp := &gpupoolv1.ListDevicesResponse{}
	ls := e.leadership.currentLeader()
	for _, d := range devs {
		if ok, _ := path.Match(req.Model, d.Model); req.Model == "" || ok {
			resp.Devices = append(resp.Devices, withReadings(ls, d))
		}
	}
	return resp, nil
}

func (e poolService) Status(ctx context.Context, req *gpupoolv1.StatusRequest) (*gpupoolv1.StatusResponse, error) {
	if conn, fctx, err := e.membership.readConn(ctx, req.Stale); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewPoolServiceClient(conn).Status(fctx, req)
	}
	st := e.fsm.State()
	resp := &gpupoolv1.StatusResponse{LeasesByState: map[string]int32{}, AppliedIndex: st.Index(), ServerId: e.cfg.NodeID}
	if addr, id := e.raft.LeaderWithID(); id != "" {
		resp.LeaderId = string(id)
		resp.LeaderAddress = e.membership.rpcAddrOf(string(id))
		_ = addr
	}
	models := map[string]*gpupoolv1.ModelCapacity{}
	for _, h := range st.HostsWithDevices() {
		resp.Hosts++
		switch h.Status {
		case gpupoolv1.HostStatus_HOST_STATUS_READY:
			resp.HostsReady++
		case gpupoolv1.HostStatus_HOST_STATUS_DOWN:
			resp.HostsDown++
		}
		if !h.Eligible {
			resp.HostsIneligible++
		}
		usable := h.Status == gpupoolv1.HostStatus_HOST_STATUS_READY && h.Eligible
		for _, d := range h.Devices {
			resp.Gpus++
			resp.MemoryMib += d.MemoryMib
			resp.AllocatedMemoryMib += d.AllocatedMemoryMib
			resp.ComputePercent += 100
			resp.AllocatedComputePercent += int64(d.AllocatedComputePercent)
			if d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
				resp.GpusUnhealthy++
			}
			if !usable || d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
				continue
			}
			m := models[d.Model]
			if m == nil {
				m = &gpupoolv1.ModelCapacity{Model: d.Model}
				models[d.Model] = m
			}
			m.Gpus++
			if d.LeaseCount == 0 {
				m.FreeGpus++
			}
			m.MemoryMib += d.MemoryMib
			m.AllocatedMemoryMib += d.AllocatedMemoryMib
			m.ComputePercent += 100
			m.AllocatedComputePercent += int64(d.AllocatedComputePercent)
			if free := d.MemoryMib - d.AllocatedMemoryMib; !d.AllocatedExclusive && free > m.LargestFreeMemoryMib {
				m.LargestFreeMemoryMib = free
			}
		}
	}
	for _, k := range sortedKeys(models) {
		resp.Models = append(resp.Models, models[k])
	}
	for _, l := range st.Leases() {
		resp.LeasesByState[stateName(l.State)]++
	}
	return resp, nil
}
