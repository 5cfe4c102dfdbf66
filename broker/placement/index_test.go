package placement

import (
	"errors"
	"fmt"
	mrand "math/rand"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// twinPool is 20 to 60 hosts cut from a few templates of randomPool, so that many hosts share
// a state, as in a real pool; host CPU varies between templates.
func twinPool(r *rand.Rand) []*gpupoolv1.Host {
	templates := randomPool(r)
	hosts := make([]*gpupoolv1.Host, 20+r.IntN(41))
	for i := range hosts {
		t := templates[r.IntN(len(templates))]
		var devs []*gpupoolv1.Device
		for _, d := range t.Devices {
			c := gpu(d.Index, model(d.Model, d.MemoryMib), pcie(d.PcieRoot))
			c.Health = d.Health
			devs = append(devs, c)
		}
		h := host(fmt.Sprintf("host-%03d", i), devs...)
		h.Labels, h.Status, h.Eligible = t.Labels, t.Status, t.Eligible
		h.CpuMillicores = 16000 * int64(1+len(t.Devices)%3)
		for _, d := range h.Devices {
			for _, p := range t.Devices[d.Index].NvlinkPeers {
				d.NvlinkPeers = append(d.NvlinkPeers, strings.Replace(p, t.Id, h.Id, 1))
			}
		}
		hosts[i] = h
	}
	return hosts
}

// indexPool is a pool that changes as leases are granted and freed, with an index kept up to
// date change by change.
type indexPool struct {
	hosts  []*gpupoolv1.Host
	byID   map[string]*gpupoolv1.Host
	idx    *Index
	leases []testLease
}

func newIndexPool(hosts []*gpupoolv1.Host, rank map[string]int) *indexPool {
	p := &indexPool{hosts: hosts, byID: map[string]*gpupoolv1.Host{}, idx: NewIndex(hosts, rank)}
	for _, h := range hosts {
		p.byID[h.Id] = h
	}
	return p
}

func (p *indexPool) grant(req *gpupoolv1.LeaseRequest, ss []*gpupoolv1.Slice) {
	p.change(req, ss, Allocate, 1)
	p.leases = append(p.leases, testLease{req, ss})
}

func (p *indexPool) free(i int) {
	l := p.leases[i]
	p.change(l.req, l.slices, Free, -1)
	p.leases = slices.Delete(p.leases, i, i+1)
}

func (p *indexPool) change(req *gpupoolv1.LeaseRequest, ss []*gpupoolv1.Slice, f func(*gpupoolv1.Device, *gpupoolv1.Slice), sign int64) {
	touched := map[string]bool{}
	for _, s := range ss {
		h := p.byID[s.Host]
		f(h.Devices[s.DeviceIndex], s)
		if !touched[s.Host] {
			touched[s.Host] = true
			h.AllocatedCpuMillicores += sign * req.GetHostCpuMillicores()
			h.AllocatedMemoryMib += sign * req.GetHostMemoryMib()
		}
	}
	for id := range touched {
		p.idx.Update(p.byID[id])
	}
}

// testMix is an FGD mix of a few shapes of the random requests.
func testMix(t *testing.T) *Mix {
	t.Helper()
	m, err := NewMix([]Shape{{GPUs: 1, Milli: 250}, {GPUs: 1, Milli: 500}, {GPUs: 1, Milli: 1000}, {GPUs: 2, Milli: 1000, CPU: 8000}},
		[]float64{4, 3, 2, 1})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestIndexPlacesAsTheExhaustiveSearchForEveryPolicy(t *testing.T) {
	mix := testMix(t)
	for _, seed := range []uint64{1, 2, 3, 4, 5, 6} {
		t.Run(fmt.Sprint("seed ", seed), func(t *testing.T) {
			r := newRand(seed)
			hosts := twinPool(r)
			var rank map[string]int
			if seed%2 == 0 {
				rank = map[string]int{}
				for i, j := range r.Perm(len(hosts)) {
					rank[hosts[i].Id] = j
				}
			}
			p := newIndexPool(hosts, rank)
			var placed, refused int
			for step := range 400 {
				req := pinSome(r, randomRequest(r), hosts)
				opts := Options{Policy: AllPolicies[r.IntN(len(AllPolicies))], Rank: rank, Mix: mix,
					Rand: mrand.New(mrand.NewSource(int64(step)))}
				got, gotErr := p.idx.Place(req, opts)
				want, wantErr := PlaceWith(hosts, req, opts)
				if opts.Policy == Random {
					if (gotErr == nil) != (wantErr == nil) {
						t.Fatalf("step %d: random %v: index got %v, exhaustive got %v", step, req, gotErr, wantErr)
					}
					for _, s := range got {
						if err := CheckSlice(p.byID[s.Host].Devices[s.DeviceIndex], s); err != nil {
							t.Fatalf("step %d: random %v: index placed a slice that does not fit: %v", step, req, err)
						}
					}
					want = got
				} else if fmt.Sprint(gotErr) != fmt.Sprint(wantErr) || placedText(got) != placedText(want) {
					t.Fatalf("step %d: %s %v: index got %s (%v), want %s (%v)", step, opts.Policy, req,
						placedText(got), gotErr, placedText(want), wantErr)
				}
				if wantErr != nil {
					var pe *Error
					if !errors.As(wantErr, &pe) {
						t.Fatalf("step %d: got %v, want an *Error", step, wantErr)
					}
					refused++
				} else {
					p.grant(req, want)
					placed++
				}
				if len(p.leases) > 0 && r.IntN(3) == 0 {
					p.free(r.IntN(len(p.leases)))
				}
			}
			if placed < 50 || refused < 20 {
				t.Errorf("placed %d and refused %d requests: want both to happen often", placed, refused)
			}
		})
	}
}

// pinSome pins one request in four to a host: one of hosts, mostly, else one the pool lacks.
func pinSome(r *rand.Rand, req *gpupoolv1.LeaseRequest, hosts []*gpupoolv1.Host) *gpupoolv1.LeaseRequest {
	switch r.IntN(8) {
	case 0:
		req.Constraints.Host = "no-such-host"
	case 1, 2:
		req.Constraints.Host = hosts[r.IntN(len(hosts))].Id
	}
	return req
}

// placedText is the slices as host/index, or "-".
func placedText(ss []*gpupoolv1.Slice) string {
	if ss == nil {
		return "-"
	}
	return placed(ss)
}

func TestIndexRebuiltFromThePoolEqualsTheOneKeptUpToDate(t *testing.T) {
	r := newRand(7)
	hosts := twinPool(r)
	p := newIndexPool(hosts, nil)
	opts := Options{Policy: Binpack}
	for step := range 300 {
		if ss, err := p.idx.Place(randomRequest(r), opts); err == nil {
			_ = ss
		}
		req := randomRequest(r)
		if ss, err := PlaceWith(hosts, req, opts); err == nil {
			p.grant(req, ss)
		}
		if len(p.leases) > 0 && r.IntN(3) == 0 {
			p.free(r.IntN(len(p.leases)))
		}
		if step%50 == 49 {
			if got, want := p.idx.Dump(), NewIndex(cloneHosts(hosts), nil).Dump(); got != want {
				t.Fatalf("step %d: the index kept up to date:\n%s\nwant the one rebuilt from the pool:\n%s", step, got, want)
			}
		}
	}
	for len(p.leases) > 0 {
		p.free(0)
	}
	if got, want := p.idx.Groups(), NewIndex(emptied(hosts), nil).Groups(); got > want+2 {
		t.Errorf("after every lease was freed: got %d groups, want about %d (the pool's templates)", got, want)
	}
}

func TestIndexRefusesWhatNoHostCanHoldWithTheExhaustiveReason(t *testing.T) {
	hosts := poolOf(idle("host-1", 2), host("host-2", gpu(0, held), gpu(1)))
	idx := NewIndex(hosts, nil)
	for _, tc := range []struct {
		name string
		req  *gpupoolv1.LeaseRequest
	}{
		{"more memory than any GPU", frac(a100Mem+1, 10).req},
		{"more whole GPUs than a host has", excl().n(3).topo(sameHost).req},
		{"a model no host has", excl().where(&gpupoolv1.Constraints{Model: "H100*"}).req},
		{"more host CPU than any host", excl().hostRes(1<<40, 1).req},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, got := idx.Place(tc.req, Options{Policy: Binpack})
			_, want := Place(hosts, tc.req, Binpack)
			if got == nil || fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("got %v, want %v", got, want)
			}
		})
	}
}

func TestIndexPlacesOverHostsItDoesNotHoldYetAsTheExhaustiveSearch(t *testing.T) {
	mix := testMix(t)
	for _, seed := range []uint64{11, 12, 13} {
		t.Run(fmt.Sprint("seed ", seed), func(t *testing.T) {
			r := newRand(seed)
			hosts := twinPool(r)
			p := newIndexPool(hosts, nil)
			policies := slices.DeleteFunc(slices.Clone(AllPolicies), func(s string) bool { return s == Random })
			for step := range 200 {
				// Grants in flight: copies of a few hosts with a lease the index has not seen.
				var over []*gpupoolv1.Host
				view := slices.Clone(hosts)
				for _, i := range r.Perm(len(hosts))[:1+r.IntN(3)] {
					c := cloneHosts(hosts[i : i+1])[0]
					if ss, err := Place([]*gpupoolv1.Host{c}, randomRequest(r), Binpack); err == nil {
						for _, s := range ss {
							Allocate(c.Devices[s.DeviceIndex], s)
						}
					}
					over, view[i] = append(over, c), c
				}
				req := pinSome(r, randomRequest(r), hosts)
				opts := Options{Policy: policies[r.IntN(len(policies))], Mix: mix}
				got, gotErr := p.idx.PlaceOver(over, req, opts)
				want, wantErr := PlaceWith(view, req, opts)
				if fmt.Sprint(gotErr) != fmt.Sprint(wantErr) || placedText(got) != placedText(want) {
					t.Fatalf("step %d: %s %v: index got %s (%v), want %s (%v)", step, opts.Policy, req,
						placedText(got), gotErr, placedText(want), wantErr)
				}
				if req := randomRequest(r); r.IntN(2) == 0 {
					if ss, err := PlaceWith(hosts, req, Options{Policy: Binpack}); err == nil {
						p.grant(req, ss)
					}
				} else if len(p.leases) > 0 {
					p.free(r.IntN(len(p.leases)))
				}
			}
		})
	}
}

func TestIndexRemembersFGDScoresOnlyWhileTheyHold(t *testing.T) {
	// FGD's scores are remembered per group, request and mix: the placements must stay those
	// of the exhaustive search while the mix changes under them (a learner's epochs, look-ahead
	// and not) and hosts change state.
	plain := testMix(t)
	other, err := NewMix([]Shape{{GPUs: 1, Milli: 100}, {GPUs: 1, Milli: 700, CPU: 2000}, {GPUs: 4, Milli: 1000}},
		[]float64{1, 5, 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, seed := range []uint64{21, 22, 23, 24} {
		t.Run(fmt.Sprint("seed ", seed), func(t *testing.T) {
			r := newRand(seed)
			hosts := twinPool(r)
			var rank map[string]int
			if seed%2 == 0 {
				rank = map[string]int{}
				for i, j := range r.Perm(len(hosts)) {
					rank[hosts[i].Id] = j
				}
			}
			p := newIndexPool(hosts, rank)
			learner := MixLearner{LookAhead: true}
			mixes := []*Mix{plain, plain.LookAhead(), other, other.LookAhead()}
			var placed int
			for step := range 500 {
				req := randomRequest(r)
				learner.Observe(ShapeOf(req))
				mix := learner.Mix()
				if step%97 < 40 { // runs of a fixed mix between the learner's
					mix = mixes[(step/97)%len(mixes)]
				}
				opts := Options{Policy: FGD, Rank: rank, Mix: mix}
				got, gotErr := p.idx.Place(req, opts)
				want, wantErr := PlaceWith(hosts, req, opts)
				if fmt.Sprint(gotErr) != fmt.Sprint(wantErr) || placedText(got) != placedText(want) {
					t.Fatalf("step %d: %v: index got %s (%v), want %s (%v)", step, req, placedText(got), gotErr,
						placedText(want), wantErr)
				}
				if wantErr == nil {
					p.grant(req, want)
					placed++
				}
				if len(p.leases) > 0 && r.IntN(3) == 0 {
					p.free(r.IntN(len(p.leases)))
				}
			}
			if placed < 100 {
				t.Errorf("placed %d requests: want many", placed)
			}
		})
	}
}
