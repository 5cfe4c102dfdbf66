package dataplane

import (
	"errors"
	"fmt"
	"io"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// errClientDone is the cause of a usage stream the client ended.
var errClientDone = errors.New("the client ended the stream")

// usage runs a UsageStart: a LeaseUsage now and one every interval, until
// the client ends the stream or the lease ends.
func (st *serverStream) usage(req *gpupoolv1.UsageStart) *RefusedError {
	interval := time.Second
	if ms := req.GetIntervalMs(); ms != 0 {
		if ms < 100 || ms > 3_600_000 {
			return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "interval_ms %d: must be 0 (1000) or between 100 and 3600000", ms)
		}
		interval = time.Duration(ms) * time.Millisecond
	}
	if err := st.accept(); err != nil {
		st.cancel(fmt.Errorf("accepting: %w", err))
		return nil
	}
	// The client sends nothing more; its end of stream, or a reset, ends
	// the operation.
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		var one [1]byte
		if _, err := io.ReadFull(st.qs, one[:]); err == io.EOF {
			st.cancel(errClientDone)
		} else if err == nil {
			st.protocolError(errors.New("data after a UsageStart"))
		} else {
			st.cancel(fmt.Errorf("client gone: %w", err))
		}
	}()
	defer func() {
		st.qs.CancelRead(codeCanceled)
		<-readDone
	}()

	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		u, ok := st.srv.leases.Usage(st.leaseID)
		if !ok {
			st.abort(codeLeaseEnded, ErrLeaseEnded)
			return nil
		}
		if err := st.send(u); err != nil {
			st.cancel(fmt.Errorf("sending: %w", err))
			return nil
		}
		select {
		case <-st.ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}
