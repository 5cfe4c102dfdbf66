package broker

import (
	"errors"
	"net"
	"testing"
	"time"
)

func TestABrokerWhoseGRPCServeFailsStopsAndSaysWhy(t *testing.T) {
	ts := startServer(t)
	// The listener breaks under Serve, as a listener whose socket the
	// kernel took away would.
	ts.s.listener.Close()
	select {
	case <-ts.s.Done():
	case <-time.After(20 * time.Second):
		t.Fatal("the broker still runs 20 s after its gRPC server failed; want it stopped")
	}
	if err := ts.s.Err(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Err after a failed Serve: got %v, want the listener's error (net.ErrClosed)", err)
	}
}

func TestABrokerShutDownNormallyReportsErrShutdown(t *testing.T) {
	ts := startServer(t)
	if err := ts.s.Err(); err != nil {
		t.Fatalf("Err while serving: got %v, want nil", err)
	}
	ts.s.Shutdown()
	<-ts.s.Done()
	if err := ts.s.Err(); !errors.Is(err, ErrShutdown) {
		t.Fatalf("Err after Shutdown: got %v, want ErrShutdown (a stopped gRPC server is no failure)", err)
	}
}
