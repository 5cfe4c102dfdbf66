package client_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestWithWaitReportsProgressUnderTheTenantTheBrokersQueuedTheRequestUnder(t *testing.T) {
	for _, tc := range []struct {
		name       string
		who        *gpupoolv1.AclToken
		tenant     string // the request's
		wantTenant string
	}{
		{"a token scoped to team-a and a request naming no tenant", &gpupoolv1.AclToken{Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{"team-a", "team-b"}}, "", "team-a"},
		{"a token scoped to team-a and b and a request naming b", &gpupoolv1.AclToken{Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{"team-a", "team-b"}}, "team-b", "team-b"},
		{"a management token and a request naming no tenant", &gpupoolv1.AclToken{Kind: gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT}, "", "default"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeLeases()
			f.block, f.reason, f.who = true, "no GPU with 80 GiB free", tc.who
			c := f.start(t)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			progress := make(chan *gpupoolv1.Lease, 16)
			done := make(chan error, 1)
			go func() {
				_, err := c.Grant(ctx, &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, TtlMs: 60_000, Tenant: tc.tenant},
					client.WithWait(time.Minute),
					client.WithPendingProgress(func(l *gpupoolv1.Lease) {
						select {
						case progress <- l:
						default:
						}
					}))
				done <- err
			}()
			sent := <-f.acquires
			select {
			case p := <-progress:
				if p.GetTenant() != tc.wantTenant || p.GetRequestId() != sent.Request.GetRequestId() || p.GetPendingReason() != f.reason {
					t.Errorf("progress: got tenant %q request %q reason %q, want %q %q %q",
						p.GetTenant(), p.GetRequestId(), p.GetPendingReason(), tc.wantTenant, sent.Request.GetRequestId(), f.reason)
				}
			case <-ctx.Done():
				t.Fatal("no pending progress")
			}
			close(f.grant)
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			for len(f.lists) > 0 {
				if l := <-f.lists; l.Tenant != tc.wantTenant {
					t.Errorf("listed the queue of tenant %q, want %q", l.Tenant, tc.wantTenant)
				}
			}
		})
	}
}

// The SDK never writes the caller's request: one without an id is sent
// with a fresh one on a copy (so a request can be a template for many
// leases), and one with an id is sent with that id, which the caller can
// name when the wait is interrupted.
func TestAnInterruptedWaitSendsAnIDAndLeavesTheCallersRequestAsItWas(t *testing.T) {
	for _, tc := range []struct {
		name string
		id   string // the request's own
	}{
		{"a request without an id", ""},
		{"a request with its own id", "mine-1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeLeases()
			f.block = true
			c := f.start(t)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			req := &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, TtlMs: 60_000, RequestId: tc.id}
			done := make(chan error, 1)
			go func() {
				_, err := c.Grant(ctx, req, client.WithWait(time.Minute), client.WithPendingProgress(func(*gpupoolv1.Lease) {}))
				done <- err
			}()
			var sent *gpupoolv1.AcquireRequest
			select {
			case sent = <-f.acquires:
			case <-time.After(10 * time.Second):
				t.Fatal("no Acquire reached the brokers")
			}
			cancel() // Ctrl-C
			select {
			case err := <-done:
				if status.Code(err) != codes.Canceled {
					t.Fatalf("got %v, want Canceled: the call ends with its context", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("Grant still waits after its context ended")
			}
			if got := sent.Request.GetRequestId(); got == "" || (tc.id != "" && got != tc.id) {
				t.Fatalf("got request id %q sent, want one (%q if given)", got, tc.id)
			}
			if req.RequestId != tc.id {
				t.Fatalf("got request id %q on the caller's request, want it as it was (%q)", req.RequestId, tc.id)
			}
		})
	}
}
