package client_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gpupool/gpupool/broker"
	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/dataplane"
	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// startBroker runs a one-server cluster with one registered 1-GPU host.
func startBroker(t *testing.T) *client.Client { return startBrokerOn(t, nil) }

// startBrokerOn is startBroker with the broker's clock (nil: the wall clock).
func startBrokerOn(t *testing.T, clk clock.Clock) *client.Client {
	t.Helper()
	s, err := broker.New(broker.Config{DataDir: t.TempDir(), BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", BootstrapExpect: 1, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Shutdown() })
	c, err := client.Dial([]string{s.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := c.Agent.Register(ctx, &gpupoolv1.RegisterRequest{Host: &gpupoolv1.Host{Id: "h1", Address: "127.0.0.1:1",
		Devices: []*gpupoolv1.Device{{Uuid: "GPU-1", Model: "A100-SXM4-80GB", MemoryMib: 81920}}}}); err != nil {
		t.Fatal(err)
	}
	return c
}

func TestAcquiredLeaseRenewsItselfAndReportsItsEnd(t *testing.T) {
	// The broker's clock is fake, so its TTL passes only when the test says
	// so, however slowly this machine runs the renewals.
	fake := clock.NewFake(time.Unix(1_700_000_000, 0))
	c := startBrokerOn(t, fake)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	l, err := c.Acquire(ctx, &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 1500})
	if err != nil {
		t.Fatal(err)
	}
	if tok, ok := l.Token("h1"); !ok || tok.Token == "" || tok.Address != "127.0.0.1:1" {
		t.Fatalf("token for h1: %v %t", tok, ok)
	}
	// Outlive the 1.5 s TTL twice over, 1 s at a time: after each step a
	// renewal lands (the token, signed for the new expiry, changes), which
	// pushes the expiry past the next step.
	last, _ := l.Token("h1")
	for step := range 3 {
		fake.Advance(time.Second)
		for {
			now, _ := l.Token("h1")
			if now.Token != last.Token {
				last = now
				break
			}
			select {
			case <-l.Done():
				t.Fatalf("renewal stopped after %d s: %v", step+1, l.Err())
			case <-ctx.Done():
				t.Fatalf("no renewal %d s into the lease", step+1)
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
	got, err := c.Lease.Get(ctx, &gpupoolv1.GetLeaseRequest{LeaseId: l.ID()})
	if err != nil || got.Lease.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		t.Fatalf("after 2 TTLs: %v %v, want granted", got.GetLease().GetState(), err)
	}

	// Another client releases it: the holder hears the end.
	if _, err := c.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: l.ID()}); err != nil {
		t.Fatal(err)
	}
	var sawReleasing bool
	for ev := range l.Events() {
		if ev.Type == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING {
			sawReleasing = true
		}
	}
	if !sawReleasing || !errors.Is(l.Err(), client.ErrLeaseEnded) {
		t.Fatalf("events saw releasing %t, Err %v; want both", sawReleasing, l.Err())
	}
	if err := l.Release(ctx, "done"); err != nil {
		t.Fatalf("releasing an ended lease: %v", err)
	}
}

func TestReleaseStopsRenewal(t *testing.T) {
	c := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := c.Acquire(ctx, &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, TtlMs: 60_000})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx, "test"); err != nil {
		t.Fatal(err)
	}
	got, err := c.Lease.Get(ctx, &gpupoolv1.GetLeaseRequest{LeaseId: l.ID()})
	if err != nil {
		t.Fatal(err)
	}
	if s := got.Lease.State; s == gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		t.Fatal(fmt.Sprintf("after Release the lease is %v", s))
	}
}

func TestLeaseDataPlaneCallsSayWhyTheHostCannotBeReached(t *testing.T) {
	c := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := c.Acquire(ctx, &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, TtlMs: 60_000})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx, "test")
	// h1 advertises 127.0.0.1:1, where no agent listens.
	dctx, dcancel := context.WithTimeout(ctx, 2*time.Second)
	defer dcancel()
	_, err = l.Exec(dctx, []string{"true"}, dataplane.ExecIO{})
	if err == nil || !strings.Contains(err.Error(), "reach the agent of h1 at 127.0.0.1:1") {
		t.Fatalf("Exec with no agent: %v, want it to name the host and address", err)
	}
}

func TestOnRenewRunsAfterEachRenewalWithTheNewTokens(t *testing.T) {
	c := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := c.Acquire(ctx, &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 1500})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx, "test")
	first, _ := l.Token("h1")
	renewed := make(chan string, 16)
	l.OnRenew(func() {
		tok, _ := l.Token("h1")
		select {
		case renewed <- tok.Token:
		default:
		}
	})
	for {
		select {
		case tok := <-renewed:
			if tok != first.Token {
				return // a renewal brought a new token, visible from the hook
			}
		case <-ctx.Done():
			t.Fatal("OnRenew never saw a new token")
		}
	}
}

func TestDrainNoticeReachesTheHolderWithItsDeadline(t *testing.T) {
	c := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := c.Acquire(ctx, &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 3000})
	if err != nil {
		t.Fatal(err)
	}
	renewed := make(chan struct{}, 1)
	l.OnRenew(func() {
		select {
		case renewed <- struct{}{}:
		default:
		}
	})
	select { // the KeepAlive stream follows the lease from its first renewal
	case <-renewed:
	case <-ctx.Done():
		t.Fatal("no renewal")
	}
	resp, err := c.Pool.DrainHost(ctx, &gpupoolv1.DrainHostRequest{HostId: "h1", DeadlineAfterMs: 600_000, Reason: "maintenance"})
	if err != nil {
		t.Fatal(err)
	}
	for {
		select {
		case ev := <-l.Events():
			if ev.Type != gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_DRAIN_NOTICE {
				continue
			}
			if ev.DeadlineMs != resp.Host.Drain.DeadlineMs || !strings.Contains(ev.Message, "host h1 draining (maintenance)") {
				t.Fatalf("drain notice: got deadline %d %q, want %d", ev.DeadlineMs, ev.Message, resp.Host.Drain.DeadlineMs)
			}
			return
		case <-ctx.Done():
			t.Fatal("no drain notice on Events()")
		}
	}
}

func TestAttachFetchesTheTokensOfALeaseThatCanStillBeRenewed(t *testing.T) {
	c := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	live, err := c.Acquire(ctx, &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 60_000})
	if err != nil {
		t.Fatal(err)
	}
	defer live.Release(ctx, "test")
	gone, err := c.Acquire(ctx, &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 60_000})
	if err != nil {
		t.Fatal(err)
	}
	if err := gone.Release(ctx, "test"); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name  string
		id    string
		ended bool   // want an error wrapping ErrLeaseEnded
		want  string // in the error; "" for none
	}{
		{name: "a granted lease is attached with its tokens", id: live.ID()},
		{name: "a released lease cannot be attached", id: gone.ID(), ended: true, want: "lease ended"},
		{name: "an unknown lease cannot be attached", id: "l-unknown", want: "l-unknown"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			l, err := c.Attach(ctx, tc.id)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("Attach: %v", err)
				}
				defer l.Close()
				if tok, ok := l.Token("h1"); !ok || tok.Token == "" {
					t.Errorf("token for h1: %v %t, want one", tok, ok)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) || errors.Is(err, client.ErrLeaseEnded) != tc.ended {
				t.Errorf("Attach = %v, want an error with %q (ErrLeaseEnded: %t)", err, tc.want, tc.ended)
			}
		})
	}
}
