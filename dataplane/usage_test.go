package dataplane

import (
	"context"
	"errors"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestUsageStreamsUntilTheContextEnds(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	ctx, cancel := context.WithCancel(t.Context())
	var got []*gpupoolv1.LeaseUsage
	err := c.Usage(ctx, testToken, 100*time.Millisecond, func(u *gpupoolv1.LeaseUsage) {
		got = append(got, u)
		if len(got) == 2 {
			cancel()
		}
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want context.Canceled", err)
	}
	if len(got) != 2 || got[0].GetLeaseId() != testLease || got[1].GetHost() != "host-a" {
		t.Fatalf("got %v, want two samples of %s", got, testLease)
	}
}

func TestUsageEndsWithTheLease(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	err := c.Usage(t.Context(), testToken, 0, func(*gpupoolv1.LeaseUsage) {
		a.leases.end(testLease)
		a.srv.Revoke(testLease)
	})
	if !errors.Is(err, ErrLeaseEnded) {
		t.Fatalf("got %v, want ErrLeaseEnded", err)
	}
}

func TestUsageRefusesAnIntervalOutOfRange(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	err := c.Usage(t.Context(), testToken, time.Millisecond, func(*gpupoolv1.LeaseUsage) {})
	wantRefused(t, err, gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "interval_ms 1: must be 0 (1000) or between 100 and 3600000")
}
