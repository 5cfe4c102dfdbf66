package broker

import (
	"context"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/limits"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// onH2 is a small slice on host h2, which the tests fill.
func onH2() *gpupoolv1.LeaseRequest {
	r := slice(1024, 5)
	r.Constraints = &gpupoolv1.Constraints{Host: "h2"}
	return r
}

func TestOneTokensFloodIsRefusedWhileAnotherTokensAcquiresSucceed(t *testing.T) {
	tests := []struct {
		name   string
		limits Limits
		limit  string
		// flood makes n calls as token a and returns their errors.
		flood func(t *testing.T, a *client.Client, n int) []error
		n     int
		// want is how many of the n calls the limit lets through.
		want int
		// who is how the refusal names the caller (default: a's token).
		who string
	}{{
		name:   "acquires over the token's request rate",
		limits: Limits{TokenRate: limits.Rate{PerSecond: 1, Burst: 10}},
		limit:  LimitTokenRate, n: 30, want: 10,
		flood: func(t *testing.T, a *client.Client, n int) (errs []error) {
			for range n {
				_, err := a.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(256, 1)})
				errs = append(errs, err)
			}
			return errs
		},
	}, {
		name:   "streams over the token's cap",
		limits: Limits{TokenStreams: 4},
		limit:  LimitTokenStreams, n: 12, want: 4,
		flood: func(t *testing.T, a *client.Client, n int) []error {
			return heldUntilRefused(t, n, 4, func(ctx context.Context) error {
				w, err := a.Lease.Watch(ctx, &gpupoolv1.WatchLeasesRequest{})
				for err == nil {
					_, err = w.Recv() // until the refusal, or the end
				}
				return err
			})
		},
	}, {
		name:   "waiting acquires over the tenant's cap",
		limits: Limits{TenantPending: 3},
		limit:  LimitTenantPending, n: 20, want: 3, who: `tenant "a"`,
		flood: func(t *testing.T, a *client.Client, n int) []error {
			return heldUntilRefused(t, n, 3, func(ctx context.Context) error {
				_, err := a.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: onH2(), WaitMs: 60_000})
				return err
			})
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			as := startACLServer(t, func(c *Config) { c.Limits = &tt.limits })
			as.registerHost(t, "h2", 1, 81920)
			full := slice(81920, 100)
			full.Constraints = &gpupoolv1.Constraints{Host: "h2"}
			if _, err := as.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: full}); err != nil {
				t.Fatal(err)
			}
			aTok, aSecret := as.token(t, clientToken("a"))
			_, bSecret := as.token(t, clientToken("b"))
			a, b := as.clientWith(t, aSecret), as.clientWith(t, bSecret)

			who := tt.who
			if who == "" {
				who = aTok.AccessorId
			}
			refused := 0
			for _, err := range tt.flood(t, a, tt.n) {
				if status.Code(err) == codes.ResourceExhausted {
					wantStatus(t, err, codes.ResourceExhausted, "limit "+tt.limit, who)
					refused++
				}
			}
			if want := tt.n - tt.want; refused != want {
				t.Errorf("got %d calls refused by %s, want %d", refused, tt.limit, want)
			}
			if got := as.s.limits.set.Refusals(tt.limit); got != float64(refused) {
				t.Errorf("gpupool_limit_refusals_total{limit=%q} = %v, want %d", tt.limit, got, refused)
			}
			for i := range 5 {
				if _, err := b.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(256, 1)}); err != nil {
					t.Fatalf("token b's acquire %d during a's flood: %v", i, err)
				}
			}
		})
	}
}

// heldUntilRefused runs n calls at once, each held open until the
// other n-held are refused (ResourceExhausted), then ends them all, and
// returns the errors.
func heldUntilRefused(t *testing.T, n, held int, call func(context.Context) error) []error {
	t.Helper()
	cctx, cancel := context.WithCancel(ctx(t))
	defer cancel()
	errs := make([]error, n)
	refused := make(chan struct{}, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			errs[i] = call(cctx)
			if status.Code(errs[i]) == codes.ResourceExhausted {
				refused <- struct{}{}
			}
		})
	}
	for range n - held {
		select {
		case <-refused:
		case <-cctx.Done():
			t.Fatalf("fewer than %d of %d calls refused", n-held, n)
		}
	}
	cancel()
	wg.Wait()
	return errs
}

func TestConnectionsOverAClientsRateAreRefusedNamingTheLimit(t *testing.T) {
	ts := startServer(t, func(c *Config) {
		c.Limits = &Limits{ClientConnRate: limits.Rate{PerSecond: 1, Burst: 3}}
	})
	// The fake clock never refills the bucket: startServer's own client
	// takes one connection, two more are allowed.
	if _, err := ts.c.Pool.Status(ctx(t), &gpupoolv1.StatusRequest{}); err != nil {
		t.Fatal(err)
	}
	var errs []error
	for range 5 {
		conn, err := grpc.NewClient(ts.s.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		_, err = healthpb.NewHealthClient(conn).Check(ctx(t), &healthpb.HealthCheckRequest{})
		errs = append(errs, err)
		conn.Close()
	}
	for i, err := range errs {
		if i < 2 {
			if err != nil {
				t.Errorf("connection %d: %v, want it served", i+2, err)
			}
			continue
		}
		wantStatus(t, err, codes.ResourceExhausted, "limit "+LimitClientConnRate, "client 127.0.0.1")
	}

	// A refused connection is closed a moment later, so that its client
	// dials again rather than keeping a connection whose every call is
	// refused.
	conn, err := grpc.NewClient(ts.s.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	_, err = healthpb.NewHealthClient(conn).Check(ctx(t), &healthpb.HealthCheckRequest{})
	wantStatus(t, err, codes.ResourceExhausted, "limit "+LimitClientConnRate)
	wait := ctx(t)
	for st := conn.GetState(); st == connectivity.Ready; st = conn.GetState() {
		if !conn.WaitForStateChange(wait, st) {
			t.Fatal("a connection over the client's rate stayed open: its client would never dial again")
		}
	}
}

func TestLimitsRefuseBadValuesNamingTheFlag(t *testing.T) {
	tests := []struct {
		name   string
		limits Limits
		want   string
	}{
		{"a negative rate", Limits{TokenRate: limits.Rate{PerSecond: -1}}, "--limit-token-rate -1: must be 0 (no limit)"},
		{"a rate without a burst", Limits{ClientConnRate: limits.Rate{PerSecond: 5}}, "--limit-client-conn-burst 0: must be 1 or more"},
		{"a negative stream cap", Limits{TokenStreams: -2}, "--limit-token-streams -2: must be 0 (no limit) or more"},
		{"a negative pending cap", Limits{TenantPending: -1}, "--limit-tenant-pending -1"},
		{"negative write seats", Limits{Writes: limits.FairLimit{Seats: -1}}, "--limit-write-seats -1: must be 0 (no limit) or more"},
		{"a token's writes over the seats", Limits{Writes: limits.FairLimit{Seats: 4, Share: 8}}, "--limit-token-writes 8: must be at most --limit-write-seats (4)"},
		{"a negative write queue", Limits{Writes: limits.FairLimit{Queue: -3}}, "--limit-token-write-queue -3"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.limits.Validate()
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("got %v, want an error containing %q", err, tt.want)
			}
		})
	}
	if err := DefaultLimits().Validate(); err != nil {
		t.Errorf("the defaults: %v", err)
	}
}

func TestATokensWritesShareTheServerFairly(t *testing.T) {
	// One seat, no queue: a write of a that finds the seat taken is
	// refused, naming the limit; a waiting acquire gives its seat back
	// while it waits, so b still writes.
	as := startACLServer(t, func(c *Config) {
		c.Limits = &Limits{Writes: limits.FairLimit{Seats: 1, Share: 1, Queue: 0}}
	})
	as.registerHost(t, "h2", 1, 81920)
	full := slice(81920, 100)
	full.Constraints = &gpupoolv1.Constraints{Host: "h2"}
	if _, err := as.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: full}); err != nil {
		t.Fatal(err)
	}
	aTok, aSecret := as.token(t, clientToken("a"))
	_, bSecret := as.token(t, clientToken("b"))
	a, b := as.clientWith(t, aSecret), as.clientWith(t, bSecret)

	wctx, cancel := context.WithCancel(ctx(t))
	defer cancel()
	waited := make(chan error, 1)
	go func() {
		_, err := a.Lease.Acquire(wctx, &gpupoolv1.AcquireRequest{Request: onH2(), WaitMs: 60_000})
		waited <- err
	}()
	waitFor(t, "a's acquire waiting in the queue", func() bool { return len(as.s.fsm.State().PendingLeases()) == 1 })
	for i := range 3 {
		if _, err := b.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(256, 1)}); err != nil {
			t.Fatalf("b's acquire %d while a's acquire waits: %v", i, err)
		}
	}

	// a's burst of writes: some find the seat taken.
	var refused []error
	waitFor(t, "a write of a refused for its queue", func() bool {
		var mu sync.Mutex
		var wg sync.WaitGroup
		for range 16 {
			wg.Go(func() {
				_, err := a.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(256, 1)})
				if status.Code(err) == codes.ResourceExhausted {
					mu.Lock()
					refused = append(refused, err)
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		return len(refused) > 0
	})
	for _, err := range refused {
		wantStatus(t, err, codes.ResourceExhausted, "limit "+LimitTokenWrites, aTok.AccessorId, "--"+FlagTokenWriteQueue)
	}
	if got := as.s.limits.set.Refusals(LimitTokenWrites); got < float64(len(refused)) {
		t.Errorf("gpupool_limit_refusals_total{limit=%q} = %v, want at least %d", LimitTokenWrites, got, len(refused))
	}
	cancel()
	if err := <-waited; status.Code(err) != codes.Canceled {
		t.Errorf("a's waiting acquire: got %v, want Canceled", err)
	}
	if held, waiting := as.s.limits.writes.InFlight(); held != 0 || waiting != 0 {
		t.Errorf("got %d seats held, %d waiting after every call ended, want none", held, waiting)
	}
}
