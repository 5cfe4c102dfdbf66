package failover

import (
	"bytes"
	"slices"
	"strings"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestFlagsAreValidated(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"zero rounds are refused", []string{"--rounds", "0"}, "--rounds 0: must be between 1 and 1000"},
		{"too many clients are refused", []string{"--clients", "1000"}, "--clients 1000: must be between 1 and 256"},
		{"a hold that overfills the pool is refused", []string{"--clients", "100", "--hold", "20"}, "must stay within the pool's 1280 slices"},
		{"a settle below 100ms is refused", []string{"--settle", "10ms"}, "--settle 10ms: must be at least 100ms"},
		{"a TTL that may expire during the run is refused", []string{"--ttl", "30s"}, "--ttl 30s: must be at least 1m"},
		{"an empty --out is refused", []string{"--out", ""}, "--out: must name a directory"},
		{"a missing binary is refused", []string{"--gpupool", "/nonexistent/gpupool"}, "--gpupool /nonexistent/gpupool: not a file"},
		{"a positional argument is refused", []string{"extra"}, `unexpected argument "extra"`},
		{"an unknown flag is refused", []string{"--kill", "leader"}, "flag provided but not defined: -kill"},
		{"a malformed duration is refused", []string{"--settle", "2"}, "invalid value"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if code := Run(t.Context(), tt.args, &stdout, &stderr); code != 2 {
				t.Fatalf("got exit code %d, want 2; stderr:\n%s", code, stderr.String())
			}
			if !strings.Contains(stderr.String(), tt.want) {
				t.Errorf("got stderr %q, want it to contain %q", stderr.String(), tt.want)
			}
		})
	}
}

func TestHelpPrintsTheUsageAndSucceeds(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := Run(t.Context(), []string{"--help"}, &stdout, &stderr); code != 0 {
		t.Fatalf("got exit code %d, want 0", code)
	}
	for _, want := range []string{"Usage: failover", "--rounds", "--clients", "--gpupool"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("the usage lacks %q:\n%s", want, stdout.String())
		}
	}
}

func TestDefaultsAreValid(t *testing.T) {
	o, err := parseFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.rounds != 10 || o.clients != 8 || o.out != "bench/results" {
		t.Errorf("got rounds %d, clients %d, out %q; want 10, 8, bench/results", o.rounds, o.clients, o.out)
	}
}

func TestPercentileIsNearestRank(t *testing.T) {
	tests := []struct {
		name   string
		sorted []float64
		q      int
		want   float64
	}{
		{"p50 of four values is the second", []float64{1, 2, 3, 4}, 50, 2},
		{"p50 of five values is the third", []float64{1, 2, 3, 4, 5}, 50, 3},
		{"p99 of ten values is the largest", []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 99, 10},
		{"any percentile of one value is that value", []float64{7}, 50, 7},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := percentile(tt.sorted, tt.q); got != tt.want {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}

func lease(id string, state gpupoolv1.LeaseState, lost bool) *gpupoolv1.Lease {
	return &gpupoolv1.Lease{Id: id, State: state, Lost: lost, Reason: "why"}
}

func TestLostLeases(t *testing.T) {
	granted, released := gpupoolv1.LeaseState_LEASE_STATE_GRANTED, gpupoolv1.LeaseState_LEASE_STATE_RELEASED
	tests := []struct {
		name           string
		have           []*gpupoolv1.Lease
		view           ledgerView
		wantLost       []string
		wantNotApplied []string
	}{
		{"a held lease still granted is not lost",
			[]*gpupoolv1.Lease{lease("a", granted, false)}, ledgerView{held: []string{"a"}}, nil, nil},
		{"a held lease that is missing is lost",
			nil, ledgerView{held: []string{"a"}}, []string{"a: not found"}, nil},
		{"a held lease that ended is lost",
			[]*gpupoolv1.Lease{lease("a", released, false)}, ledgerView{held: []string{"a"}}, []string{"a: LEASE_STATE_RELEASED (why)"}, nil},
		{"a held lease whose host went down is lost",
			[]*gpupoolv1.Lease{lease("a", granted, true)}, ledgerView{held: []string{"a"}}, []string{"a: marked lost (its host went down)"}, nil},
		{"a lease the client released may be gone",
			nil, ledgerView{released: []string{"a"}, releasing: []string{"b"}}, nil, nil},
		{"a lease whose release returned OK but is still granted is reported",
			[]*gpupoolv1.Lease{lease("a", granted, false)}, ledgerView{released: []string{"a"}}, nil, []string{"a"}},
		{"a lease whose release had no answer may still be granted",
			[]*gpupoolv1.Lease{lease("b", granted, false)}, ledgerView{releasing: []string{"b"}}, nil, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			have := map[string]*gpupoolv1.Lease{}
			for _, l := range tt.have {
				have[l.Id] = l
			}
			lost, notApplied, err := lostLeases(have, tt.view)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(lost, tt.wantLost) || !slices.Equal(notApplied, tt.wantNotApplied) {
				t.Errorf("got lost %q, not applied %q; want %q, %q", lost, notApplied, tt.wantLost, tt.wantNotApplied)
			}
		})
	}
}

func TestLedgerSortsLeasesByWhatTheClientDid(t *testing.T) {
	l := newLedger()
	for _, id := range []string{"a", "b", "c"} {
		l.acked(id, 1)
	}
	l.acked("a", 2) // a retry that returned the same lease
	l.releasing("b")
	l.releasing("c")
	l.released("c")
	v := l.view()
	if !slices.Equal(v.held, []string{"a"}) || !slices.Equal(v.releasing, []string{"b"}) || !slices.Equal(v.released, []string{"c"}) {
		t.Errorf("got held %q, releasing %q, released %q; want [a], [b], [c]", v.held, v.releasing, v.released)
	}
}

func TestSummaryTakesP50AndMaxAndCountsEachLostLeaseOnce(t *testing.T) {
	rounds := []roundResult{
		{KillToAcquireMs: 300, AcquiresOK: 10, Checked: 5},
		{KillToAcquireMs: 100, AcquiresOK: 20, Checked: 6, Lost: []string{"x: not found"}, LostOnRestarted: []string{"x: not found"}},
		{KillToAcquireMs: 200, AcquiresOK: 30, Checked: 7, ReleasesNotApplied: []string{"y"}},
	}
	s := summarize(rounds)
	if s.KillToAcquireP50Ms != 200 || s.KillToAcquireMaxMs != 300 {
		t.Errorf("got p50 %v, max %v; want 200, 300", s.KillToAcquireP50Ms, s.KillToAcquireMaxMs)
	}
	if s.Lost != 1 || s.AcquiresOK != 60 || s.Checked != 7 || s.ReleasesNotApplied != 1 {
		t.Errorf("got lost %d, acquires %d, checked %d, not applied %d; want 1, 60, 7, 1", s.Lost, s.AcquiresOK, s.Checked, s.ReleasesNotApplied)
	}
}

func TestRoundLoadTimesOnlyAcquiresSentAfterTheKill(t *testing.T) {
	rl := newRoundLoad()
	t0 := rl.start
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	rl.ok(at(0), at(10))
	rl.kill(at(100))
	rl.ok(at(90), at(150)) // sent before the kill: answered by the old leader
	if _, ok := rl.sinceKill(); ok {
		t.Fatal("an acquire sent before the kill counted")
	}
	rl.ok(at(200), at(1600))
	rl.ok(at(300), at(1700))
	if d, ok := rl.sinceKill(); !ok || d != 1500*time.Millisecond {
		t.Errorf("got %v, %v; want 1.5s, true", d, ok)
	}
}
