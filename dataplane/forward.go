package dataplane

import (
	"context"
	"io"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/quic-go/quic-go"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// dialTimeout bounds how long the agent tries to reach a forwarded port.
const dialTimeout = 5 * time.Second

// forward runs a ForwardStart: it connects to the port on the pool host's
// loopback, then carries raw bytes both ways.
func (st *serverStream) forward(req *gpupoolv1.ForwardStart) *RefusedError {
	port := req.GetPort()
	if port < 1 || port > 65535 {
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "port %d: must be between 1 and 65535", port)
	}
	if !st.srv.leases.Listens(st.leaseID, int(port)) {
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED, "port %d: no process of lease %s listens on it; forward reaches only the lease's own listeners", port, st.leaseID)
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(int(port)))
	d := net.Dialer{Timeout: dialTimeout}
	c, err := d.DialContext(st.ctx, "tcp", addr)
	if err != nil {
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_NOT_FOUND, "port %d: nothing accepts connections on %s of the pool host (%v)", port, addr, err)
	}
	if err := st.accept(); err != nil {
		c.Close()
		st.cancel(err)
		return nil
	}
	st.log.Info("forward started", "port", port)
	// The stream carries no more frames: splice writes it directly, and
	// finish's closeSend finds it closed.
	if err := splice(st.ctx, st.qs, c, forwardSpliceBuffer); err != nil {
		st.log.Info("forward ended early", "port", port, "err", err)
	}
	return nil
}

// The buffers splice copies through, each way: a forwarded connection's
// are io.Copy's; a CUDA session's hold a whole copy frame of the shim's
// (1 MiB and its header), so a frame crosses in one read and one write
// rather than thirty-two, and a small call's frame goes out in the read
// that received it.
const (
	forwardSpliceBuffer = 32 << 10
	cudaSpliceBuffer    = 1<<20 + 64<<10
)

// splice carries bytes both ways between a stream and a connection until
// both directions have ended, through a buffer of bufSize bytes each way. The end of one direction's source
// half-closes its destination (QUIC FIN, TCP CloseWrite); a failure in
// either direction, or ctx ending, resets the stream and ends both. It
// closes c, and returns nil or why it ended early.
func splice(ctx context.Context, s *quic.Stream, c net.Conn, bufSize int) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(ctx, func() {
		c.Close()
		s.CancelRead(codeCanceled)
		s.CancelWrite(codeCanceled)
	})
	defer stop()
	var wg sync.WaitGroup
	wg.Go(func() {
		if _, err := io.CopyBuffer(s, c, make([]byte, bufSize)); err != nil {
			cancel(err)
			return
		}
		s.Close()
	})
	wg.Go(func() {
		if _, err := io.CopyBuffer(c, s, make([]byte, bufSize)); err != nil {
			cancel(err)
			return
		}
		if cw, ok := c.(interface{ CloseWrite() error }); ok {
			cw.CloseWrite()
		}
	})
	wg.Wait()
	c.Close()
	return context.Cause(ctx)
}
