package client

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// DrainProgress is one host's drain as WatchDrain last read it.
type DrainProgress struct {
	Host string
	Resp *gpupoolv1.GetHostResponse // the host and its leases; nil when Err is set
	Err  error                      // why the host could not be read this round
}

// Done reports whether there is nothing left to wait for on the host:
// drained, cancelled, or down with no lease left.
func (p DrainProgress) Done() bool {
	if p.Resp == nil {
		return false
	}
	h := p.Resp.GetHost()
	return h.GetDrain() == nil || h.GetStatus() == gpupoolv1.HostStatus_HOST_STATUS_DRAINED ||
		(h.GetStatus() == gpupoolv1.HostStatus_HOST_STATUS_DOWN && len(p.Resp.GetLeases()) == 0)
}

// WatchDrain follows the drains of the hosts ids: every interval it reads
// each host (each read bounded by callTimeout) and calls fn with their
// progress, until every one is Done; then it returns their final state.
// A host that does not exist ends the watch with its NotFound error; any
// other failed read is reported in the progress and tried again. When ctx
// ends it returns ctx.Err().
func (c *Client) WatchDrain(ctx context.Context, ids []string, interval, callTimeout time.Duration, fn func([]DrainProgress)) ([]*gpupoolv1.DrainHostResponse, error) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		prog := make([]DrainProgress, len(ids))
		all := true
		for i, id := range ids {
			cctx, cancel := context.WithTimeout(ctx, callTimeout)
			resp, err := c.Pool.GetHost(cctx, &gpupoolv1.GetHostRequest{HostId: id})
			cancel()
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if status.Code(err) == codes.NotFound {
				return nil, fmt.Errorf("host %s: %w", id, err)
			}
			prog[i] = DrainProgress{Host: id, Resp: resp, Err: err}
			all = all && prog[i].Done()
		}
		if fn != nil {
			fn(prog)
		}
		if all {
			out := make([]*gpupoolv1.DrainHostResponse, 0, len(prog))
			for _, p := range prog {
				out = append(out, &gpupoolv1.DrainHostResponse{Host: p.Resp.GetHost(), Leases: int32(len(p.Resp.GetLeases()))})
			}
			return out, nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-tick.C:
		}
	}
}
