package client

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// fakeBroker answers GetHost, counts the calls it served, and names a
// leader in the response header as a broker does.
type fakeBroker struct {
	gpupoolv1.UnimplementedPoolServiceServer
	addr string

	mu     sync.Mutex
	served int
	leader *atomic.Value // string, shared by the fake cluster
}

func (b *fakeBroker) GetHost(ctx context.Context, _ *gpupoolv1.GetHostRequest) (*gpupoolv1.GetHostResponse, error) {
	b.mu.Lock()
	b.served++
	b.mu.Unlock()
	_ = grpc.SetHeader(ctx, metadata.Pairs(LeaderHeader, b.leader.Load().(string)))
	return &gpupoolv1.GetHostResponse{}, nil
}

func (b *fakeBroker) count() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.served
}

func startFakeBrokers(t *testing.T, n int, leader *atomic.Value) ([]*fakeBroker, []*grpc.Server) {
	t.Helper()
	var bs []*fakeBroker
	var srvs []*grpc.Server
	for range n {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		b := &fakeBroker{addr: lis.Addr().String(), leader: leader}
		srv := grpc.NewServer()
		gpupoolv1.RegisterPoolServiceServer(srv, b)
		go srv.Serve(lis)
		t.Cleanup(srv.Stop)
		bs = append(bs, b)
		srvs = append(srvs, srv)
	}
	return bs, srvs
}

func TestUnaryCallsGoToTheLeaderOnceABrokerNamesIt(t *testing.T) {
	leader := new(atomic.Value)
	bs, srvs := startFakeBrokers(t, 3, leader)
	leader.Store(bs[1].addr)
	c, err := Dial([]string{bs[0].addr, bs[1].addr, bs[2].addr})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	call := func() {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := c.Pool.GetHost(ctx, &gpupoolv1.GetHostRequest{HostId: "h"}); err != nil {
			t.Fatal(err)
		}
	}
	call() // any broker: it names the leader
	before := bs[1].count()
	for range 10 {
		call()
	}
	if got := bs[1].count() - before; got != 10 {
		t.Fatalf("the leader served %d of 10 calls after it was named, want all", got)
	}

	// The leader goes away: calls go to the others, and the next one named
	// leads from then on.
	srvs[1].Stop()
	leader.Store(bs[2].addr)
	call()
	before = bs[2].count()
	for range 5 {
		call()
	}
	if got := bs[2].count() - before; got != 5 {
		t.Fatalf("the new leader served %d of 5 calls, want all", got)
	}
}

func TestALeaderAddressTheClientWasNotGivenIsNotUsed(t *testing.T) {
	leader := new(atomic.Value)
	leader.Store("10.255.255.1:7641") // advertised, but not one of ours
	bs, _ := startFakeBrokers(t, 2, leader)
	c, err := Dial([]string{bs[0].addr, bs[1].addr})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for range 6 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := c.Pool.GetHost(ctx, &gpupoolv1.GetHostRequest{HostId: "h"})
		cancel()
		if err != nil {
			t.Fatalf("a call with an unusable leader address: %v", err)
		}
	}
	if bs[0].count()+bs[1].count() != 6 {
		t.Fatalf("the brokers served %d and %d calls, want 6 in all", bs[0].count(), bs[1].count())
	}
}
