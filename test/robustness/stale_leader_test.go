package robustness

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/gpupool/gpupool/internal/proc"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// TestPartitionedLeaderRenewsNothing cuts the leader off from the other
// brokers (not from the test) and renews a lease on it, over and over,
// until the others have elected a new leader and the old one has stepped
// down. Before it steps down the old leader still believes it leads, and
// its memory still holds the lease's TTL: every renewal it answers must
// be a failure, because it can no longer confirm with a quorum that it
// leads. Once healed, the lease renews on the new leader.
func TestPartitionedLeaderRenewsNothing(t *testing.T) {
	needsCluster(t)
	cl, nw := startSafetyCluster(t, DefaultTiming)
	if nw.Kind() != "netns" {
		t.Skipf("needs a partition between brokers, which the %s network cannot make: %s", nw.Kind(), nw.Describe())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	leader, err := cl.WaitLeader(ctx, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := cl.Client.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{
		Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 60_000, Holder: "stale-leader", RequestId: fmt.Sprintf("stale-leader-%d", time.Now().UnixNano()),
	}})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.Lease.Id

	// A connection to the old leader alone: no leader discovery, no
	// forwarding by the client.
	addr, err := nw.BrokerAddr("", brokerNode(leader), cl.Addrs[leader])
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	old := gpupoolv1.NewLeaseServiceClient(conn)
	info := gpupoolv1.NewClusterServiceClient(conn)
	renewOnOld := func() (*gpupoolv1.KeepAliveResponse, error) {
		cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
		defer ccancel()
		ka, err := old.KeepAlive(cctx)
		if err != nil {
			return nil, err
		}
		if err := ka.Send(&gpupoolv1.KeepAliveRequest{LeaseId: id}); err != nil {
			return nil, err
		}
		for {
			r, err := ka.Recv()
			if err != nil {
				return nil, err
			}
			if r.Event == nil && r.LeaseId == id {
				return r, nil
			}
		}
	}
	if r, err := renewOnOld(); err != nil || r.Error != "" {
		t.Fatalf("renewal on the leader before the partition: %v %v", err, r.GetError())
	}

	for j := range cl.Brokers {
		if j == leader {
			continue
		}
		for _, err := range []error{nw.Block(brokerNode(j), brokerNode(leader)), nw.Block(brokerNode(leader), brokerNode(j))} {
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Cleanup(func() { nw.Heal() })

	// Renew on the old leader until it no longer says it leads; count
	// the renewals sent while it still did.
	var whileLeading, tries int
	for {
		si, err := info.ServerInfo(ctx, &gpupoolv1.ServerInfoRequest{})
		stillLeads := err == nil && si.LeaderId == brokerNode(leader)
		r, err := renewOnOld()
		tries++
		if err == nil && r.Error == "" && r.TtlMs > 0 {
			t.Fatalf("renewal %d on the partitioned leader %s was acknowledged (TTL %dms), want a failure", tries, brokerNode(leader), r.TtlMs)
		}
		if !stillLeads {
			break
		}
		whileLeading++
		if ctx.Err() != nil {
			t.Fatal("the partitioned leader never stepped down")
		}
	}
	t.Logf("%d renewals on the partitioned leader, %d of them while it still said it led: all refused", tries, whileLeading)

	if err := nw.Heal(); err != nil {
		t.Fatal(err)
	}
	if err := proc.Poll(ctx, 60*time.Second, func(ctx context.Context) error {
		r, err := keepAliveOnce(ctx, cl.Client, id)
		switch {
		case err != nil:
			return err
		case r.Error != "":
			return errors.New(r.Error)
		}
		return nil
	}); err != nil {
		t.Fatalf("the lease does not renew on the new leader after the heal: %v", err)
	}
}
