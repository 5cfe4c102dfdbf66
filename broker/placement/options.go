package placement

import (
	"fmt"
	"math/rand"
	"slices"
	"strings"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Names of the scored policies. Each rates every host that fits with an integer from 0 to 100
// and takes the highest; equal scores go to the host first in Options.Rank, then by host id.
// Within the host, a fractional slice goes on the fullest GPU that fits (FGD: the first GPU
// where its score is highest; random: a GPU drawn at random) and whole GPUs are the
// lowest-index idle ones. They are the six policies of the FGD paper (Weng et al., USENIX ATC
// '23) with its artifact's scores, for the placement benchmark; the artifact's constants (128
// cores, 8 GPUs) are the largest host CPU and GPU count of the pool. A request whose slices may
// span hosts is placed as binpack places it.
const (
	// BestFit rates a host 100 less half its free CPU and half its free GPU share left after
	// the placement, each relative to the pool's largest host, and normalises the ratings of
	// the hosts that fit onto 0..100 (min-max).
	BestFit = "best-fit"
	// DotProduct rates a host 100 less half the dot product of its free CPU and GPU share with
	// the request's, each relative to the pool's largest host.
	DotProduct = "dot-product"
	// GPUPacking rates a placement on GPUs already in use 50 to 100 (the fuller, the higher),
	// one that opens idle GPUs on a host in use 33 to 49, and one on an idle host at most 33.
	GPUPacking = "gpu-packing"
	// GPUClustering rates a host by how full its GPUs are (0 to 25), plus 75 when it holds only
	// leases of the request's class (see Class and Options.Affinity), 50 when it holds that
	// class among others, 25 when it holds none.
	GPUClustering = "gpu-clustering"
	// Random takes a host that fits uniformly at random, drawn from Options.Rand.
	Random = "random"
	// FGD (fragmentation gradient descent) takes the host and GPU where the placement grows
	// the host's expected GPU fragmentation under Options.Mix the least, scored
	// 100·sigmoid(−Δ/1000) and truncated as in the paper.
	FGD = "fgd"
)

// AllPolicies lists every policy PlaceWith accepts. Place and the broker accept only Policies.
var AllPolicies = []string{Binpack, Spread, BestFit, DotProduct, GPUPacking, GPUClustering, Random, FGD}

// Options chooses how PlaceWith places a request.
type Options struct {
	// Policy is one of AllPolicies.
	Policy string
	// Mix is the task mix FGD weighs fragmentation by. Required for FGD, ignored otherwise.
	Mix *Mix
	// Rank orders hosts for the scored policies when their scores tie: lower first; a host
	// missing from Rank comes after every ranked one. Ties left break by host id.
	Rank map[string]int
	// Rand draws for Random. Required for Random, ignored otherwise. PlaceWith draws one
	// number to pick among the hosts that fit, in the order hosts are given, and for a
	// fractional slice one more per GPU of that host that fits, in device order, to pick the
	// GPU.
	Rand *rand.Rand
	// Affinity tells GPUClustering, per host id, how many leases of each class (see Class) the
	// host holds; a host missing holds none. When nil, GPUClustering reads the classes from the
	// devices: a device with a fractional share in use counts as "share-gpu", and one held
	// exclusively as the request's class when the request is exclusive (devices do not tell
	// how many GPUs each lease took).
	Affinity map[string]map[string]int

	// maxCPU and maxGPU, when set, are the pool's largest host CPU and GPU count × 1000, for
	// a placement among some of its hosts (Index.Place).
	maxCPU, maxGPU int64
}

// classShare is the lease class of one fractional slice.
const classShare = "share-gpu"

// Class is the class of a request for GPUClustering: "share-gpu" for one fractional slice,
// "N-gpu" for N whole GPUs or N slices, "" for a request of no GPUs.
func Class(req *gpupoolv1.LeaseRequest) string {
	switch n := req.GetCount(); {
	case n < 1:
		return ""
	case n == 1 && !req.GetExclusive():
		return classShare
	default:
		return fmt.Sprintf("%d-gpu", n)
	}
}

// PlaceWith is Place with options: it accepts every policy in AllPolicies. The contract of
// Place holds, except that Random depends on the order of hosts and consumes Options.Rand.
//
// A scored policy other than Random places a request its way only when the request takes one
// host (one slice, host CPU or memory, or a same-host, same-nvlink or same-pcie-root topology);
// other requests are placed as binpack places them.
func PlaceWith(hosts []*gpupoolv1.Host, req *gpupoolv1.LeaseRequest, opts Options) ([]*gpupoolv1.Slice, error) {
	if err := checkOptions(opts); err != nil {
		return nil, err
	}
	opts.maxCPU, opts.maxGPU = 0, 0
	return place(hosts, req, &opts)
}

// checkOptions checks that opts name a policy and carry what it needs.
func checkOptions(opts Options) error {
	switch {
	case !slices.Contains(AllPolicies, opts.Policy):
		return fmt.Errorf("policy %q: must be one of %s", opts.Policy, strings.Join(AllPolicies, ", "))
	case opts.Policy == FGD && opts.Mix == nil:
		return fmt.Errorf("policy %q: needs a task mix (Options.Mix)", opts.Policy)
	case opts.Policy == Random && opts.Rand == nil:
		return fmt.Errorf("policy %q: needs a random source (Options.Rand)", opts.Policy)
	}
	return nil
}

// scoredPolicy reports whether policy rates hosts with hostScore.
func scoredPolicy(policy string) bool { return policy != Binpack && policy != Spread }
