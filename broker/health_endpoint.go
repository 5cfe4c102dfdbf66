package broker

import (
	"context"
	"fmt"
	"slices"
	"strconv"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// ClearDeviceHealth asks a GPU's agent to forget that the GPU is
// unhealthy. The clear lives in the leader's memory and goes to the agent
// in every heartbeat response (clear_health) until the agent reports the
// GPU healthy; the state changes then, through the agent's report, like
// any other health change.
func (e poolService) ClearDeviceHealth(ctx context.Context, req *gpupoolv1.ClearDeviceHealthRequest) (*gpupoolv1.ClearDeviceHealthResponse, error) {
	switch {
	case req.HostId == "":
		return nil, refuse(ErrInvalid, "host_id: is required; see 'gpupool host ls'")
	case req.Device == "":
		return nil, refuse(ErrInvalid, "device: is required: a GPU's index on the host or its uuid; see 'gpupool host get HOST'")
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewPoolServiceClient(conn).ClearDeviceHealth(fctx, req)
	}
	ls := e.leadership.currentLeader()
	if ls == nil {
		return nil, refuse(ErrUnavailable, "leader is still starting; retry")
	}
	st := e.fsm.State()
	if st.Host(req.HostId) == nil {
		return nil, refusef(ErrNotFound, "host %q: not found; see 'gpupool host ls'", req.HostId)
	}
	devs := st.HostDevices(req.HostId)
	i := slices.IndexFunc(devs, func(d *gpupoolv1.Device) bool {
		return d.Uuid == req.Device || strconv.Itoa(int(d.Index)) == req.Device
	})
	if i < 0 {
		return nil, refusef(ErrNotFound, "GPU %q: host %s has no such GPU (%s); give an index or a uuid from 'gpupool host get %s'",
			req.Device, req.HostId, gpuIndexes(devs), req.HostId)
	}
	d := devs[i]
	if d.Health != gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
		return nil, refusef(ErrPrecondition, "GPU %d (%s) of host %s is healthy: there is nothing to clear", d.Index, d.Uuid, req.HostId)
	}
	ls.requestHealthClear(req.HostId, d.Uuid)
	e.log.Info("GPU health clear requested", "host", req.HostId, "device", d.Uuid, "was", d.HealthReason, "by", callerFrom(ctx).actor())
	return &gpupoolv1.ClearDeviceHealthResponse{Device: d}, nil
}

func gpuIndexes(devs []*gpupoolv1.Device) string {
	if len(devs) == 0 {
		return "it has no GPUs"
	}
	idx := make([]int, 0, len(devs))
	for _, d := range devs {
		idx = append(idx, int(d.Index))
	}
	slices.Sort(idx)
	return fmt.Sprintf("it has GPUs %d to %d", idx[0], idx[len(idx)-1])
}

// requestHealthClear records that host's agent must clear device's mark.
func (ls *leaderState) requestHealthClear(host, device string) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.healthClears[host] == nil {
		ls.healthClears[host] = map[string]bool{}
	}
	ls.healthClears[host][device] = true
}

// healthClearsFor lists the clears host's agent has yet to act on, and
// drops those its heartbeat req (nil: none) reports healthy.
func (ls *leaderState) healthClearsFor(host string, req *gpupoolv1.HeartbeatRequest) []string {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	pending := ls.healthClears[host]
	for _, d := range req.GetDevices() {
		if d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY {
			delete(pending, d.Uuid)
		}
	}
	if len(pending) == 0 {
		delete(ls.healthClears, host)
		return nil
	}
	out := make([]string, 0, len(pending))
	for id := range pending {
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}
