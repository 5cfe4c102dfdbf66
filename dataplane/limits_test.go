package dataplane

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpupool/gpupool/internal/limits"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestALeasesStreamFloodIsRefusedWhileAnotherLeaseIsServed(t *testing.T) {
	set := limits.NewSet(nil)
	a := newTestAgentWith(t, func(c *ServerConfig) {
		c.Limits = &Limits{LeaseStreams: 3}
		c.LimitSet = set
	})
	c := a.dial(t)
	const n, held = 10, 3
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	errs := make([]error, n)
	refused := make(chan struct{}, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			errs[i] = c.Usage(ctx, testToken, time.Hour, func(*gpupoolv1.LeaseUsage) {})
			var r *RefusedError
			if errors.As(errs[i], &r) {
				refused <- struct{}{}
			}
		})
	}
	for range n - held {
		select {
		case <-refused:
		case <-time.After(20 * time.Second):
			t.Fatalf("fewer than %d of %d streams refused", n-held, n)
		}
	}
	// While the flood holds its streams, another lease is served.
	if _, err := c.Put(t.Context(), otherToken, strings.NewReader("x"), 1, "f", 0o644); err != nil {
		t.Errorf("another lease's put during the flood: %v", err)
	}
	cancel()
	wg.Wait()
	got := 0
	for _, err := range errs {
		var r *RefusedError
		if errors.As(err, &r) {
			wantRefused(t, err, gpupoolv1.AcceptCode_ACCEPT_CODE_RESOURCE_EXHAUSTED, "limit "+LimitLeaseStreams+" reached by lease "+testLease)
			got++
		}
	}
	if got != n-held {
		t.Errorf("got %d streams refused, want %d", got, n-held)
	}
	if r := set.Refusals(LimitLeaseStreams); r != float64(n-held) {
		t.Errorf("got %v refusals counted, want %d", r, n-held)
	}
}

func TestConnectionsOverAClientsLimitsAreClosedNamingTheLimit(t *testing.T) {
	tests := []struct {
		name   string
		limits Limits
		limit  string
	}{
		{"over the connections open at once", Limits{ClientConns: 2}, LimitClientConns},
		{"over the new connections per second", Limits{ClientConnRate: limits.Rate{PerSecond: 0.001, Burst: 2}}, LimitClientConnRate},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := newTestAgentWith(t, func(c *ServerConfig) { c.Limits = &tt.limits })
			for i := range 2 {
				if _, err := a.dial(t).Put(t.Context(), testToken, strings.NewReader("x"), 1, "f", 0o644); err != nil {
					t.Fatalf("connection %d: %v", i+1, err)
				}
			}
			c, err := Dial(t.Context(), a.srv.Addr().String(), a.certFP)
			if err == nil {
				defer c.Close()
				_, err = c.Put(t.Context(), testToken, strings.NewReader("x"), 1, "f", 0o644)
			}
			wantRefused(t, err, gpupoolv1.AcceptCode_ACCEPT_CODE_RESOURCE_EXHAUSTED, "limit "+tt.limit+" reached by client 127.0.0.1")
		})
	}
}
