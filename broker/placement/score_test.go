package placement

import (
	"math/rand"
	"strings"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

type scoredCase struct {
	name  string
	hosts []*gpupoolv1.Host
	req   rb
	opts  Options
	want  string // as placed shows it
}

func runScoredCases(t *testing.T, cases []scoredCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := PlaceWith(tc.hosts, tc.req.req, tc.opts)
			if err != nil {
				t.Fatalf("PlaceWith: got error %q, want %s", err, tc.want)
			}
			if g := placed(got); g != tc.want {
				t.Errorf("got %s, want %s", g, tc.want)
			}
		})
	}
}

// quarter is a fractional lease of a quarter of an A100 with 1 core and 1 GiB of the host.
func quarter() rb { return frac(a100Mem/4, 25).hostRes(1000, 1024) }

func TestScoredPoliciesChooseTheirHost(t *testing.T) {
	half := func(d *gpupoolv1.Device) { used(a100Mem/2, 50)(d) }
	runScoredCases(t, []scoredCase{
		{
			name:  "best-fit takes the host with the least left after the lease",
			hosts: poolOf(idle("host-1", 2), cpuUsed(host("host-2", gpu(0, half), gpu(1)), 16000, 0)),
			req:   quarter(), opts: Options{Policy: BestFit},
			want: "host-2/0",
		},
		{
			name:  "best-fit breaks a tie by rank, not host id",
			hosts: poolOf(idle("host-1", 2), idle("host-2", 2)),
			req:   quarter(), opts: Options{Policy: BestFit, Rank: map[string]int{"host-1": 1, "host-2": 0}},
			want: "host-2/0",
		},
		{
			name: "dot-product takes the host whose free resources align least with the request",
			hosts: poolOf(idle("host-1", 2),
				cpuUsed(idle("host-2", 2), 28000, 0)),
			req:  excl().hostRes(4000, 1024),
			opts: Options{Policy: DotProduct},
			want: "host-2/0",
		},
		{
			name:  "gpu-packing puts a share on a GPU in use before opening an idle one",
			hosts: poolOf(idle("host-1", 2), host("host-2", gpu(0), gpu(1, half))),
			req:   quarter(), opts: Options{Policy: GPUPacking},
			want: "host-2/1",
		},
		{
			name:  "gpu-packing puts whole GPUs on a host in use before an idle host",
			hosts: poolOf(idle("host-1", 2), host("host-2", gpu(0, held), gpu(1))),
			req:   excl().topo(sameHost), opts: Options{Policy: GPUPacking},
			want: "host-2/1",
		},
		{
			name: "gpu-clustering joins leases of the same class",
			hosts: poolOf(host("host-1", gpu(0, half), gpu(1)), idle("host-2", 1),
				host("host-3", gpu(0, func(d *gpupoolv1.Device) {
					d.AllocatedMemoryMib, d.AllocatedComputePercent, d.LeaseCount = a100Mem/2, 50, 2
				}))),
			req: quarter(), opts: Options{Policy: GPUClustering},
			want: "host-3/0",
		},
		{
			name:  "gpu-clustering prefers an idle host to one with leases of another class",
			hosts: poolOf(host("host-1", gpu(0, held), gpu(1)), idle("host-2", 1)),
			req:   quarter(), opts: Options{Policy: GPUClustering},
			want: "host-2/0",
		},
		{
			name:  "the scored policies take the lowest-index idle GPUs for whole GPUs",
			hosts: poolOf(host("host-1", gpu(0, held), gpu(1), gpu(2), gpu(3))),
			req:   excl().n(2).topo(sameHost), opts: Options{Policy: BestFit},
			want: "host-1/1 host-1/2",
		},
		{
			name:  "a model constraint with alternatives matches any of them",
			hosts: poolOf(idle("host-1", 1), host("host-2", gpu(0, model("V100M16", 16384)))),
			req:   excl().where(&gpupoolv1.Constraints{Model: "T4|V100*"}).hostRes(1, 1), opts: Options{Policy: BestFit},
			want: "host-2/0",
		},
	})
}

func TestRandomTakesEveryHostThatFitsAndNoOther(t *testing.T) {
	hosts := poolOf(idle("host-1", 1), idle("host-2", 1), host("host-3", gpu(0, held)))
	opts := Options{Policy: Random, Rand: rand.New(rand.NewSource(42))}
	seen := map[string]int{}
	for range 200 {
		ss, err := PlaceWith(hosts, quarter().req, opts)
		if err != nil {
			t.Fatalf("PlaceWith: %v", err)
		}
		seen[ss[0].Host]++
	}
	if seen["host-1"] < 50 || seen["host-2"] < 50 || seen["host-3"] != 0 {
		t.Errorf("got hosts %v in 200 draws, want host-1 and host-2 about 100 times each and never host-3", seen)
	}
}

func TestPlaceWithRefusesIncompleteOptions(t *testing.T) {
	for _, tc := range []struct {
		opts Options
		want string
	}{
		{Options{Policy: "worst-fit"}, `policy "worst-fit": must be one of binpack, spread, best-fit, dot-product, gpu-packing, gpu-clustering, random, fgd`},
		{Options{Policy: FGD}, `policy "fgd": needs a task mix (Options.Mix)`},
		{Options{Policy: Random}, `policy "random": needs a random source (Options.Rand)`},
	} {
		_, err := PlaceWith(poolOf(idle("host-1", 1)), excl().req, tc.opts)
		if err == nil || err.Error() != tc.want {
			t.Errorf("%s: got %v, want %q", tc.opts.Policy, err, tc.want)
		}
	}
}

func TestModelAlternativesAreValidated(t *testing.T) {
	for _, tc := range []struct{ model, want string }{
		{"T4||A10", `constraints.model "T4||A10": has an empty alternative`},
		{"T4|[", `constraints.model "T4|[": must be a valid glob`},
	} {
		_, err := Place(poolOf(idle("host-1", 1)), excl().where(&gpupoolv1.Constraints{Model: tc.model}).req, Binpack)
		if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("model %q: got %v, want an error starting %q", tc.model, err, tc.want)
		}
	}
}
