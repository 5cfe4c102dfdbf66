package client

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// scriptedStream is a KeepAlive stream in memory: answer says what the
// broker answers to each renewal (nothing at all: a half-open stream).
type scriptedStream struct {
	ctx    context.Context
	answer func(id string) []received
	out    chan received // what Recv returns, in order

	mu   sync.Mutex
	sent []string // guarded by mu; every renewal sent, in order
}

func (s *scriptedStream) Send(r *gpupoolv1.KeepAliveRequest) error {
	s.mu.Lock()
	s.sent = append(s.sent, r.GetLeaseId())
	s.mu.Unlock()
	for _, a := range s.answer(r.GetLeaseId()) {
		s.out <- a
	}
	return nil
}

func (s *scriptedStream) Recv() (*gpupoolv1.KeepAliveResponse, error) {
	select {
	case m := <-s.out:
		return m.resp, m.err
	case <-s.ctx.Done():
		return nil, s.ctx.Err()
	}
}

func (s *scriptedStream) CloseSend() error { return nil }

// renewals lists the renewals sent so far.
func (s *scriptedStream) renewals() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.sent)
}

// scriptedBroker opens one scriptedStream per script, in order; the last
// script serves every stream after it.
type scriptedBroker struct {
	scripts []func(id string) []received

	mu      sync.Mutex
	streams []*scriptedStream // guarded by mu
}

func (b *scriptedBroker) open(ctx context.Context) (KeepAliveStream, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	script := b.scripts[min(len(b.streams), len(b.scripts)-1)]
	s := &scriptedStream{ctx: ctx, answer: script, out: make(chan received, 1024)}
	b.streams = append(b.streams, s)
	return s, nil
}

// stream is the nth stream opened (from 0), or nil.
func (b *scriptedBroker) stream(n int) *scriptedStream {
	b.mu.Lock()
	defer b.mu.Unlock()
	if n < len(b.streams) {
		return b.streams[n]
	}
	return nil
}

// grants answers every renewal with a granted TTL of ttl.
func grants(ttl time.Duration) func(string) []received {
	return func(id string) []received {
		return []received{{resp: &gpupoolv1.KeepAliveResponse{LeaseId: id, TtlMs: ttl.Milliseconds(), State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED,
			Tokens: []*gpupoolv1.HostToken{{Host: "h1", Token: id + "#" + fmt.Sprint(time.Now().UnixNano())}}}}}
	}
}

// silent never answers: the stream is half-open.
func silent(string) []received { return nil }

// until polls cond, advancing the fake clock by step between polls (0:
// not at all), and fails after a generous deadline.
func until(t *testing.T, clk *clock.Fake, step time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for !cond() {
		if step > 0 {
			clk.Advance(step)
		}
		select {
		case <-deadline:
			t.Fatalf("never saw %s", what)
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// count is how often id stands in ids.
func count(ids []string, id string) int {
	n := 0
	for _, x := range ids {
		if x == id {
			n++
		}
	}
	return n
}

func TestALeaseRenewsThroughTheRenewer(t *testing.T) {
	const ttl = 3 * time.Second
	info := &gpupoolv1.Lease{Id: "p-1", State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED, TtlMs: ttl.Milliseconds(),
		Slices: []*gpupoolv1.Slice{{Host: "h1", MemoryMib: 1024}}}
	cases := []struct {
		name    string
		scripts []func(string) []received
		// run drives the lease after its first renewal went out on stream 0.
		run func(t *testing.T, clk *clock.Fake, b *scriptedBroker, l *Lease)
	}{{
		name:    "a lease and its extras are renewed in the same rounds on one stream",
		scripts: []func(string) []received{grants(ttl)},
		run: func(t *testing.T, clk *clock.Fake, b *scriptedBroker, l *Lease) {
			st := b.stream(0)
			st.out <- received{resp: grownResp(extraLease("x-1", "p-1"))}
			var ev *gpupoolv1.LeaseEvent
			select {
			case ev = <-l.Events():
			case <-time.After(20 * time.Second):
				t.Fatal("no event after the extra grew")
			}
			if ev.GetType() != gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN || ev.GetLease().GetId() != "x-1" {
				t.Fatalf("first event %v, want GROWN for x-1", ev)
			}
			// GROWN is passed on once the extra's first renewal brought its tokens.
			if tok, ok := l.TokenFor("x-1", "h1"); !ok || !strings.HasPrefix(tok.Token, "x-1#") {
				t.Errorf("TokenFor(x-1) = %v, %t; want the extra's token from its first renewal", tok, ok)
			}
			if got := sliceIDsOf(l); got != "p-1 x-1" {
				t.Errorf("Slices held by %q, want p-1 x-1", got)
			}
			until(t, clk, 100*time.Millisecond, "three rounds", func() bool { return count(st.renewals(), "p-1") >= 3 })
			got := st.renewals()
			if n := count(got, "x-1"); n < 2 {
				t.Errorf("renewals %v: x-1 renewed %d times, want it renewed with each round of p-1", got, n)
			}
			if b.stream(1) != nil || l.Err() != nil {
				t.Errorf("a second stream opened, or Err = %v; want one stream and the lease renewed", l.Err())
			}
		},
	}, {
		name:    "a half-open stream ends the lease once its TTL passes with no renewal",
		scripts: []func(string) []received{silent},
		run: func(t *testing.T, clk *clock.Fake, b *scriptedBroker, l *Lease) {
			until(t, clk, 100*time.Millisecond, "the lease to end", func() bool { return isDone(l) })
			if err := l.Err(); !errors.Is(err, ErrLeaseEnded) || !strings.Contains(err.Error(), "could not renew it before it expired") {
				t.Errorf("Err = %v, want ErrLeaseEnded saying it expired", err)
			}
		},
	}, {
		name: "a broker that no longer knows the lease ends it with the broker's reason",
		scripts: []func(string) []received{func(id string) []received {
			return []received{{resp: &gpupoolv1.KeepAliveResponse{LeaseId: id, Error: "lease " + id + " not found"}}}
		}},
		run: func(t *testing.T, clk *clock.Fake, b *scriptedBroker, l *Lease) {
			until(t, clk, 0, "the lease to end", func() bool { return isDone(l) })
			if err := l.Err(); !errors.Is(err, ErrLeaseEnded) || !strings.Contains(err.Error(), "lease p-1 not found") {
				t.Errorf("Err = %v, want ErrLeaseEnded with the broker's words", err)
			}
		},
	}, {
		name: "a revocation reaches the holder as an event and ends the lease",
		scripts: []func(string) []received{func(id string) []received {
			return []received{{resp: &gpupoolv1.KeepAliveResponse{LeaseId: id, Event: &gpupoolv1.LeaseEvent{
				Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED, Lease: &gpupoolv1.Lease{Id: id}, Message: "revoked: host h1 is down"}}}}
		}},
		run: func(t *testing.T, clk *clock.Fake, b *scriptedBroker, l *Lease) {
			var ended bool
			for ev := range l.Events() {
				ended = ended || ev.GetType() == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED
			}
			if err := l.Err(); !ended || !errors.Is(err, ErrLeaseEnded) || !strings.Contains(err.Error(), "revoked: host h1 is down") {
				t.Errorf("ENDED seen %t, Err = %v; want both, with the reason", ended, err)
			}
		},
	}, {
		name: "a broken stream is reopened and the lease carries on there",
		scripts: []func(string) []received{
			func(string) []received { return []received{{err: status.Error(codes.Unavailable, "leader lost")}} },
			grants(ttl),
		},
		run: func(t *testing.T, clk *clock.Fake, b *scriptedBroker, l *Lease) {
			until(t, clk, 10*time.Millisecond, "a renewal on a second stream", func() bool {
				s := b.stream(1)
				return s != nil && count(s.renewals(), "p-1") > 0 && l.Err() == nil && strings.HasPrefix(tokenOf(l), "p-1#")
			})
		},
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			clk := clock.NewFake(time.Unix(1_700_000_000, 0))
			b := &scriptedBroker{scripts: tc.scripts}
			l := (&Client{}).followWith(info, []*gpupoolv1.HostToken{{Host: "h1", Token: "first"}}, clk, b.open)
			t.Cleanup(l.Close)
			until(t, clk, 0, "the first renewal", func() bool { s := b.stream(0); return s != nil && len(s.renewals()) > 0 })
			tc.run(t, clk, b, l)
		})
	}
}

func TestManyLeasesRenewOnOneStream(t *testing.T) {
	cases := []struct {
		name    string
		scripts []func(string) []received
		// expiring get a TTL up front and are given up after it.
		expiring []string
		want     string // the error Renew returns
		streams  int    // this many streams opened
	}{{
		name:    "leases answered are renewed round after round, each until the broker refuses it",
		scripts: []func(string) []received{grantsUntilRefused(map[string]int{"l-1": 3, "l-2": 1, "l-3": 2})},
		want:    "3 of 3 leases not renewed: l-1: lease l-1 not found; l-2: lease l-2 not found; l-3: lease l-3 not found",
		streams: 1,
	}, {
		name:     "a half-open stream gives up the leases whose TTL passed and reopens for the others",
		scripts:  []func(string) []received{silent, grantsUntilRefused(map[string]int{"l-3": 2})},
		expiring: []string{"l-1", "l-2"},
		want:     "3 of 3 leases not renewed: l-1: could not renew it before it expired",
		streams:  2,
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			clk := clock.NewFake(time.Unix(1_700_000_000, 0))
			b := &scriptedBroker{scripts: tc.scripts}
			sched := newRenewSchedule([]string{"l-1", "l-2", "l-3"}, 0, false)
			for _, id := range tc.expiring {
				sched.expireAfter(id, 3*time.Second, clk.Now())
			}
			var broken []string
			k := &renewer{sched: sched, open: b.open, clk: clk, onBroken: func(why string) { broken = append(broken, why) }}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- k.run(ctx) }()
			var err error
			until(t, clk, 100*time.Millisecond, "Renew to return", func() bool {
				select {
				case err = <-done:
					return true
				default:
					return false
				}
			})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Renew = %v, want %q", err, tc.want)
			}
			if b.stream(tc.streams-1) == nil || b.stream(tc.streams) != nil {
				t.Errorf("opened a number of streams other than %d", tc.streams)
			}
			if got := b.stream(0).renewals(); !slices.Equal(got[:3], []string{"l-1", "l-2", "l-3"}) {
				t.Errorf("first renewals %v, want l-1 l-2 l-3 on the first stream", got)
			}
			if last := b.stream(tc.streams - 1).renewals(); count(last, "l-3") != 3 {
				t.Errorf("renewals on the last stream %v: l-3 renewed %d times, want 3 (2 granted, 1 refused)", last, count(last, "l-3"))
			}
			if tc.streams > 1 && (len(broken) == 0 || !strings.Contains(broken[0], "half-open")) {
				t.Errorf("stream broke with %q, want it called half-open", broken)
			}
		})
	}
}

// grantsUntilRefused grants the renewals of each lease in renewals so
// many times, then refuses it as a broker that lost it does.
func grantsUntilRefused(renewals map[string]int) func(string) []received {
	var mu sync.Mutex
	seen := map[string]int{}
	grant := grants(3 * time.Second)
	return func(id string) []received {
		mu.Lock()
		defer mu.Unlock()
		if seen[id]++; seen[id] > renewals[id] {
			return []received{{resp: &gpupoolv1.KeepAliveResponse{LeaseId: id, Error: "lease " + id + " not found"}}}
		}
		return grant(id)
	}
}

func isDone(l *Lease) bool {
	select {
	case <-l.Done():
		return true
	default:
		return false
	}
}

func tokenOf(l *Lease) string {
	tok, _ := l.Token("h1")
	return tok.GetToken()
}

func sliceIDsOf(l *Lease) string {
	var ids []string
	for _, s := range l.Slices() {
		ids = append(ids, s.LeaseID)
	}
	return strings.Join(ids, " ")
}
