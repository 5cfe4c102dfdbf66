package placement

import (
	"cmp"
	"errors"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

type placeCase struct {
	name   string
	hosts  []*gpupoolv1.Host
	req    rb
	policy string // binpack when empty
	want   string // as placed shows it
}

func runPlaceCases(t *testing.T, cases []placeCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Place(tc.hosts, tc.req.req, cmp.Or(tc.policy, Binpack))
			if err != nil {
				t.Fatalf("Place: got error %q, want %s", err, tc.want)
			}
			if g := placed(got); g != tc.want {
				t.Errorf("got %s, want %s", g, tc.want)
			}
		})
	}
}

func TestPlaceBinpack(t *testing.T) {
	runPlaceCases(t, []placeCase{{
		name:  "fills the fullest GPU that fits",
		hosts: poolOf(host("host-1", gpu(0), gpu(1, used(51200, 10)), gpu(2, used(71680, 10)))),
		req:   frac(20480, 10),
		want:  "host-1/1",
	}, {
		name:  "prefers a GPU in use over an idle one, even a smaller idle one",
		hosts: poolOf(host("host-1", gpu(0, model("L4", 24576)), gpu(1, used(40960, 10)))),
		req:   frac(10240, 10),
		want:  "host-1/1",
	}, {
		name:  "breaks a memory tie by the least free compute",
		hosts: poolOf(host("host-1", gpu(0, used(40960, 10)), gpu(1, used(40960, 60)))),
		req:   frac(10240, 10),
		want:  "host-1/1",
	}, {
		name:  "puts a whole GPU on the fullest host",
		hosts: poolOf(idle("host-1", 2), host("host-2", gpu(0, held), gpu(1))),
		req:   excl(),
		want:  "host-2/1",
	}, {
		name:  "breaks ties by host id, then device index",
		hosts: poolOf(idle("host-2", 2), idle("host-1", 2)),
		req:   frac(10240, 10),
		want:  "host-1/0",
	}, {
		name:  "packs two slices onto one GPU",
		hosts: poolOf(idle("host-1", 2)),
		req:   frac(20480, 25).n(2),
		want:  "host-1/0 host-1/0",
	}, {
		name:  "fills one host with whole GPUs before opening the next",
		hosts: poolOf(idle("host-1", 2), idle("host-2", 2)),
		req:   excl().n(3),
		want:  "host-1/0 host-1/1 host-2/0",
	}})
}

func TestPlaceSpread(t *testing.T) {
	runPlaceCases(t, []placeCase{{
		name:   "picks the emptiest GPU",
		hosts:  poolOf(host("host-1", gpu(0, used(51200, 10)), gpu(1), gpu(2, used(10240, 10)))),
		req:    frac(20480, 10),
		policy: Spread,
		want:   "host-1/1",
	}, {
		name:   "puts a whole GPU on the emptiest host",
		hosts:  poolOf(host("host-1", gpu(0, held), gpu(1)), idle("host-2", 2)),
		req:    excl(),
		policy: Spread,
		want:   "host-2/0",
	}, {
		name:   "puts two slices on two GPUs",
		hosts:  poolOf(idle("host-1", 2)),
		req:    frac(20480, 25).n(2),
		policy: Spread,
		want:   "host-1/0 host-1/1",
	}, {
		name:   "spreads whole GPUs over hosts",
		hosts:  poolOf(idle("host-1", 2), idle("host-2", 2)),
		req:    excl().n(2),
		policy: Spread,
		want:   "host-1/0 host-2/0",
	}, {
		name:   "breaks ties by host id, then device index",
		hosts:  poolOf(idle("host-2", 2), idle("host-1", 2)),
		req:    frac(10240, 10),
		policy: Spread,
		want:   "host-1/0",
	}})
}

func TestPlaceTopology(t *testing.T) {
	oneWay := host("host-1", gpu(0), gpu(1), gpu(2), gpu(3))
	oneWay.Devices[0].NvlinkPeers = []string{"GPU-host-1-1"} // GPU 1 does not list GPU 0
	nvlinked(oneWay, 2, 3)

	runPlaceCases(t, []placeCase{{
		name:  "same-host picks the fullest host with enough GPUs",
		hosts: poolOf(idle("host-1", 2), idle("host-2", 3), idle("host-3", 4)),
		req:   excl().n(3).topo(sameHost),
		want:  "host-2/0 host-2/1 host-2/2",
	}, {
		name:   "same-host with spread picks the emptiest host with enough GPUs",
		hosts:  poolOf(idle("host-1", 2), idle("host-2", 3), idle("host-3", 4)),
		req:    excl().n(3).topo(sameHost),
		policy: Spread,
		want:   "host-3/0 host-3/1 host-3/2",
	}, {
		name:  "same-host slices share the GPU already in use",
		hosts: poolOf(idle("host-1", 1), host("host-2", gpu(0, used(40960, 10)))),
		req:   frac(10240, 10).n(2).topo(sameHost),
		want:  "host-2/0 host-2/0",
	}, {
		name:  "whole GPUs without topology may span hosts",
		hosts: poolOf(idle("host-1", 1), idle("host-2", 1)),
		req:   excl().n(2),
		want:  "host-1/0 host-2/0",
	}, {
		name:  "distinct-gpus puts each slice on its own GPU",
		hosts: poolOf(idle("host-1", 1), idle("host-2", 1)),
		req:   frac(10240, 10).n(2).topo(distinctGPUs),
		want:  "host-1/0 host-2/0",
	}, {
		name: "same-nvlink picks GPUs that are peers",
		hosts: poolOf(nvlinked(nvlinked(host("host-1",
			gpu(0, used(1024, 5)), gpu(1), gpu(2), gpu(3)), 0, 1), 2, 3)),
		req:  excl().n(2).topo(sameNVLink),
		want: "host-1/2 host-1/3",
	}, {
		name:  "same-nvlink needs the link listed on both GPUs",
		hosts: poolOf(oneWay),
		req:   excl().n(2).topo(sameNVLink),
		want:  "host-1/2 host-1/3",
	}, {
		name:  "same-nvlink finds three GPUs that are all peers",
		hosts: poolOf(nvlinked(nvlinked(nvlinked(idle("host-1", 6), 0, 1), 1, 2), 2, 3, 5)),
		req:   frac(10240, 10).n(3).topo(sameNVLink),
		want:  "host-1/2 host-1/3 host-1/5",
	}, {
		name:  "same-nvlink skips a host without enough peers",
		hosts: poolOf(nvlinked(idle("host-1", 4), 0, 1), nvlinked(idle("host-2", 4), 0, 1, 2)),
		req:   excl().n(3).topo(sameNVLink),
		want:  "host-2/0 host-2/1 host-2/2",
	}, {
		name: "same-pcie-root picks GPUs under one root",
		hosts: poolOf(host("host-1",
			gpu(0, pcie("r0")), gpu(1, pcie("r1")), gpu(2, pcie("r1")), gpu(3, pcie("r0"), used(1024, 5)))),
		req:  excl().n(2).topo(samePCIeRoot),
		want: "host-1/1 host-1/2",
	}, {
		name: "same-pcie-root ignores GPUs without a root",
		hosts: poolOf(idle("host-1", 2),
			host("host-2", gpu(0, pcie("r0")), gpu(1, pcie("r0")))),
		req:  frac(10240, 10).n(2).topo(samePCIeRoot),
		want: "host-2/0 host-2/1",
	}, {
		name:  "a single slice with same-nvlink needs no peer",
		hosts: poolOf(idle("host-1", 1)),
		req:   excl().topo(sameNVLink),
		want:  "host-1/0",
	}})
}

func TestPlaceFractionalPacking(t *testing.T) {
	for _, tc := range []struct {
		name    string
		mem     int64
		compute int32
		want    int
		reason  string
	}{
		{"memory runs out first", 20480, 10, 4,
			"no A100-SXM4-80GB with 20 GiB and 10% compute free (1 has 0 MiB free)"},
		{"compute runs out first", 1024, 30, 3,
			"no A100-SXM4-80GB with 1 GiB and 30% compute free (1 has the memory but at most 10% compute free)"},
		{"both run out together", 40960, 50, 2,
			"no A100-SXM4-80GB with 40 GiB and 50% compute free (1 has 0 MiB free)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hosts := poolOf(idle("host-1", 1))
			d := hosts[0].Devices[0]
			req := frac(tc.mem, tc.compute).req
			var got int
			var err error
			for range 200 {
				var ss []*gpupoolv1.Slice
				if ss, err = Place(hosts, req, Binpack); err != nil {
					break
				}
				if err := CheckSlice(d, ss[0]); err != nil {
					t.Fatalf("CheckSlice of slice %d: %v", got+1, err)
				}
				Allocate(d, ss[0])
				got++
			}
			if got != tc.want {
				t.Errorf("got %d slices, want %d", got, tc.want)
			}
			var pe *Error
			if !errors.As(err, &pe) || pe.Never || pe.Reason != tc.reason {
				t.Errorf("got error %#v, want not-never %q", err, tc.reason)
			}
		})
	}
}

func TestPlaceExclusivity(t *testing.T) {
	leaseOnly := func(d *gpupoolv1.Device) { d.LeaseCount = 1 }
	runPlaceCases(t, []placeCase{{
		name:  "exclusive skips a GPU with a slice on it",
		hosts: poolOf(host("host-1", gpu(0, used(1024, 5)), gpu(1))),
		req:   excl(),
		want:  "host-1/1",
	}, {
		name:  "exclusive skips a GPU with a lease that holds nothing",
		hosts: poolOf(host("host-1", gpu(0, leaseOnly), gpu(1))),
		req:   excl(),
		want:  "host-1/1",
	}, {
		name:  "fractional skips a GPU held exclusively",
		hosts: poolOf(host("host-1", gpu(0, held), gpu(1))),
		req:   frac(1024, 5),
		want:  "host-1/1",
	}, {
		name:  "exclusive slices of one request land on distinct GPUs",
		hosts: poolOf(idle("host-1", 2)),
		req:   excl().n(2).topo(sameHost),
		want:  "host-1/0 host-1/1",
	}})
}

func TestPlaceFillsSliceFields(t *testing.T) {
	l4 := host("host-1", gpu(3, model("L4", 24576)))
	for _, tc := range []struct {
		name string
		req  rb
		want *gpupoolv1.Slice
	}{
		{"a fractional slice takes what was asked", frac(10240, 30), &gpupoolv1.Slice{
			Host: "host-1", Device: "GPU-host-1-3", Model: "L4", DeviceIndex: 3,
			MemoryMib: 10240, ComputePercent: 30,
		}},
		{"an exclusive slice takes the whole GPU", excl(), &gpupoolv1.Slice{
			Host: "host-1", Device: "GPU-host-1-3", Model: "L4", DeviceIndex: 3,
			MemoryMib: 24576, ComputePercent: 100, Exclusive: true,
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Place(poolOf(l4), tc.req.req, Binpack)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != 1 || !proto.Equal(got[0], tc.want) {
				t.Errorf("got %v, want %v", got, tc.want)
			}
		})
	}
}

func TestPlaceConstraints(t *testing.T) {
	zoned := func() []*gpupoolv1.Host {
		return poolOf(labels(idle("host-1", 1), "zone", "a"), labels(idle("host-2", 1), "zone", "b", "rack", "1"),
			labels(idle("host-3", 1), "zone", "b"))
	}
	runPlaceCases(t, []placeCase{{
		name:  "model glob picks a matching GPU",
		hosts: poolOf(host("host-1", gpu(0, model("L4", 24576)), gpu(1))),
		req:   frac(1024, 5).where(&gpupoolv1.Constraints{Model: "A100*"}),
		want:  "host-1/1",
	}, {
		name:  "min memory compares to the GPU's total memory",
		hosts: poolOf(host("host-1", gpu(0, model("A100-SXM4-40GB", 40960)), gpu(1))),
		req:   frac(1024, 5).where(&gpupoolv1.Constraints{MinMemoryMib: 49152}),
		want:  "host-1/1",
	}, {
		name:  "host picks that host",
		hosts: poolOf(idle("host-1", 1), idle("host-2", 1)),
		req:   frac(1024, 5).where(&gpupoolv1.Constraints{Host: "host-2"}),
		want:  "host-2/0",
	}, {
		name:  "labels must all be present with equal values",
		hosts: zoned(),
		req:   frac(1024, 5).where(&gpupoolv1.Constraints{Labels: map[string]string{"zone": "b", "rack": "1"}}),
		want:  "host-2/0",
	}, {
		name:  "a label with another value does not match",
		hosts: zoned(),
		req:   frac(1024, 5).where(&gpupoolv1.Constraints{Labels: map[string]string{"zone": "b"}}),
		want:  "host-2/0",
	}, {
		name:  "a device constraint overrides binpack's choice",
		hosts: poolOf(host("host-1", gpu(0), gpu(1, used(51200, 10)))),
		req:   frac(1024, 5).where(&gpupoolv1.Constraints{Devices: []string{"GPU-host-1-0"}}),
		want:  "host-1/0",
	}, {
		name:  "several devices: slices go only to those",
		hosts: poolOf(idle("host-1", 3), idle("host-2", 1)),
		req:   excl().n(2).where(&gpupoolv1.Constraints{Devices: []string{"GPU-host-2-0", "GPU-host-1-2"}}),
		want:  "host-1/2 host-2/0",
	}})
}

func TestPlaceHostResources(t *testing.T) {
	runPlaceCases(t, []placeCase{{
		name:  "host cpu puts all slices on a host with that much free",
		hosts: poolOf(cpuUsed(idle("host-1", 2), 28000, 0), idle("host-2", 2)),
		req:   excl().n(2).hostRes(8000, 0),
		want:  "host-2/0 host-2/1",
	}, {
		name:  "host memory puts all slices on a host with that much free",
		hosts: poolOf(cpuUsed(idle("host-1", 2), 0, 262144), idle("host-2", 2)),
		req:   frac(1024, 5).n(2).hostRes(0, 1024),
		want:  "host-2/0 host-2/0",
	}, {
		name:  "host cpu keeps slices on one host even without topology",
		hosts: poolOf(idle("host-1", 1), idle("host-2", 2)),
		req:   excl().n(2).hostRes(1000, 0),
		want:  "host-2/0 host-2/1",
	}, {
		name:  "host cpu is charged once per lease, not per slice",
		hosts: poolOf(cpuUsed(idle("host-1", 1), 24000, 0)),
		req:   frac(1024, 5).n(4).hostRes(8000, 0),
		want:  "host-1/0 host-1/0 host-1/0 host-1/0",
	}})
}

func TestPlaceSkipsHostsAndGPUsOutOfService(t *testing.T) {
	runPlaceCases(t, []placeCase{{
		name:  "a down host",
		hosts: poolOf(down(idle("host-1", 1)), idle("host-2", 1)),
		req:   excl(),
		want:  "host-2/0",
	}, {
		name:  "an ineligible host",
		hosts: poolOf(ineligible(idle("host-1", 1)), idle("host-2", 1)),
		req:   excl(),
		want:  "host-2/0",
	}, {
		name:  "a draining host",
		hosts: poolOf(status(idle("host-1", 1), gpupoolv1.HostStatus_HOST_STATUS_DRAINING), idle("host-2", 1)),
		req:   excl(),
		want:  "host-2/0",
	}, {
		name:  "a host with no status yet",
		hosts: poolOf(status(idle("host-1", 1), gpupoolv1.HostStatus_HOST_STATUS_UNSPECIFIED), idle("host-2", 1)),
		req:   excl(),
		want:  "host-2/0",
	}, {
		name:  "an unhealthy GPU",
		hosts: poolOf(host("host-1", gpu(0, unhealthy, used(1024, 5)), gpu(1))),
		req:   frac(1024, 5),
		want:  "host-1/1",
	}})
}

func TestPlaceErrors(t *testing.T) {
	mixed := func() []*gpupoolv1.Host {
		return poolOf(host("host-1", gpu(0, model("L4", 24576), used(20480, 10)), gpu(1, used(71680, 10))))
	}
	for _, tc := range []struct {
		name      string
		hosts     []*gpupoolv1.Host
		req       rb
		wantNever bool
		want      string
	}{
		// Never: the request does not fit the pool's shape.
		{"more memory than the largest GPU can never fit",
			poolOf(idle("host-1", 1)), frac(90000, 10), true,
			"memory 90000 MiB: larger than any matching GPU (largest A100-SXM4-80GB has 81920 MiB)"},
		{"more memory than the largest GPU can never fit, even when hosts are down",
			poolOf(down(idle("host-1", 1))), frac(90000, 10), true,
			"memory 90000 MiB: larger than any matching GPU (largest A100-SXM4-80GB has 81920 MiB)"},
		{"more GPUs on one host than any host has can never fit",
			poolOf(idle("host-1", 8), idle("host-2", 4)), excl().n(9).topo(sameHost), true,
			"count 9 exclusive with same-host: no host has 9 matching GPUs (most: 8 on host-1)"},
		{"more slices on one host than fit there can never fit",
			poolOf(idle("host-1", 8), idle("host-2", 4)), frac(40960, 10).n(17).topo(sameHost), true,
			"count 17 with same-host: no host has room for 17 slices (most: 16 on host-1)"},
		{"more slices than the pool holds can never fit",
			poolOf(idle("host-1", 1), idle("host-2", 1)), frac(40960, 10).n(5), true,
			"count 5: matching GPUs have room for only 4"},
		{"more distinct GPUs than the pool has can never fit",
			poolOf(idle("host-1", 1), down(idle("host-2", 1))), frac(1024, 5).n(3).topo(distinctGPUs), true,
			"count 3 with distinct-gpus: the pool has only 2 matching GPUs"},
		{"no host matching the constraints can never fit",
			poolOf(labels(idle("host-1", 1), "zone", "a")),
			frac(1024, 5).where(&gpupoolv1.Constraints{Model: "H100*", Labels: map[string]string{"zone": "b"}}), true,
			`no host matches constraints (model "H100*", labels zone=b)`},
		{"an unknown device can never fit",
			poolOf(idle("host-1", 1)), excl().where(&gpupoolv1.Constraints{Devices: []string{"GPU-gone"}}), true,
			`no host matches constraints (devices GPU-gone)`},
		{"no GPU matching the model can never fit",
			poolOf(idle("host-1", 1)), excl().where(&gpupoolv1.Constraints{Model: "H100*"}), true,
			`no host matches constraints (model "H100*")`},
		{"more host cpu than any host offers can never fit",
			poolOf(idle("host-1", 1)), excl().hostRes(64000, 0), true,
			"host cpu 64000 millicores: more than any matching host offers (most: 32000 on host-1)"},
		{"more NVLink peers than any host has can never fit",
			poolOf(nvlinked(nvlinked(idle("host-1", 4), 0, 1), 2, 3)), excl().n(4).topo(sameNVLink), true,
			"count 4 exclusive with same-nvlink: no host has 4 matching GPUs that are all NVLink peers (most: 2 on host-1)"},
		{"host cpu only where no GPU fits can never fit",
			poolOf(host("host-1", gpu(0, model("L4", 24576))), func() *gpupoolv1.Host {
				h := idle("host-2", 1)
				h.CpuMillicores = 4000
				return h
			}()),
			frac(40960, 10).hostRes(8000, 0), true,
			"host cpu 8000 millicores: no host with a matching GPU that fits the slice has that much"},
		{"an empty pool can never fit", nil, excl(), true, "the pool has no hosts"},
		{"count 0 is invalid", poolOf(idle("host-1", 1)), excl().n(0), true, "count 0: must be between 1 and 256 GPUs"},
		{"compute 0 is invalid", poolOf(idle("host-1", 1)), frac(1024, 0), true, "compute_percent 0: must be between 1 and 100 (percent of one GPU's SMs)"},
		{"a bad model glob is invalid", poolOf(idle("host-1", 1)),
			excl().where(&gpupoolv1.Constraints{Model: "["}), true, `constraints.model "[": must be a valid glob such as A100* ([ needs a matching ]), alternatives separated by |`},

		// Not now: the request would fit an empty pool.
		{"no GPU with the memory free names the most free and what is out of service",
			poolOf(host("host-1", gpu(0, used(61440, 10)), gpu(1, used(61440, 10))), down(idle("host-2", 1)),
				ineligible(idle("host-3", 1))),
			frac(40960, 25), false,
			"no A100-SXM4-80GB with 40 GiB and 25% compute free (2 have 20 GiB free); host host-2 down; host host-3 ineligible"},
		{"no GPU with the compute free says so",
			poolOf(host("host-1", gpu(0, used(1024, 90)))), frac(1024, 25), false,
			"no A100-SXM4-80GB with 1 GiB and 25% compute free (1 has the memory but at most 10% compute free)"},
		{"mixed models are called matching GPUs",
			mixed(), frac(20480, 10), false,
			"no matching GPU with 20 GiB and 10% compute free (1 has 10 GiB free)"},
		{"no idle GPU for an exclusive request",
			poolOf(host("host-1", gpu(0, used(1024, 5)), gpu(1, held))), excl(), false,
			"no idle A100-SXM4-80GB (all 2 in use)"},
		{"every GPU held exclusively",
			poolOf(host("host-1", gpu(0, held), gpu(1, held))), frac(1024, 5), false,
			"no A100-SXM4-80GB with 1 GiB and 5% compute free (all 2 held exclusively)"},
		{"every GPU out of service",
			poolOf(host("host-1", gpu(0, unhealthy)), status(idle("host-2", 1), gpupoolv1.HostStatus_HOST_STATUS_DRAINING)),
			excl(), false,
			"no matching GPU is in service; host host-2 draining; 1 GPU unhealthy"},
		{"too few free GPUs on any one host",
			poolOf(host("host-1", gpu(0), gpu(1), gpu(2, held), gpu(3, held)), host("host-2", gpu(0), gpu(1, held))),
			excl().n(3).topo(sameHost), false,
			"count 3 exclusive with same-host: no host has 3 free matching GPUs (most: 2 on host-1)"},
		{"too few free GPUs in the pool",
			poolOf(host("host-1", gpu(0), gpu(1, held)), idle("host-2", 2)), excl().n(4), false,
			"count 4 exclusive: only 3 matching GPUs are free"},
		{"too little room for slices in the pool",
			poolOf(host("host-1", gpu(0, used(40960, 10)))), frac(20480, 10).n(3), false,
			"count 3: matching GPUs have room for only 2 more"},
		{"no host with a free GPU has the host cpu free",
			poolOf(cpuUsed(idle("host-1", 1), 28000, 0), host("host-2", gpu(0, held))), excl().hostRes(8000, 0), false,
			"host cpu 8000 millicores: no host with a free matching GPU has that much free (most: 4000 on host-1)"},
		{"no free NVLink peers",
			poolOf(nvlinked(host("host-1", gpu(0), gpu(1, held), gpu(2)), 0, 1)), excl().n(2).topo(sameNVLink), false,
			"count 2 exclusive with same-nvlink: no host has 2 free matching GPUs that are all NVLink peers (most: 1 on host-1)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Place(tc.hosts, tc.req.req, Binpack)
			var pe *Error
			if !errors.As(err, &pe) {
				t.Fatalf("got %s, %v; want *Error %q", placed(got), err, tc.want)
			}
			if pe.Never != tc.wantNever || pe.Reason != tc.want {
				t.Errorf("got Never=%t %q,\nwant Never=%t %q", pe.Never, pe.Reason, tc.wantNever, tc.want)
			}
		})
	}
}

func TestPlaceRejectsAnUnknownPolicy(t *testing.T) {
	for _, policy := range []string{"foo", ""} {
		_, err := Place(poolOf(idle("host-1", 1)), excl().req, policy)
		want := `policy "` + policy + `": must be one of binpack, spread`
		var pe *Error
		if err == nil || err.Error() != want || errors.As(err, &pe) {
			t.Errorf("policy %q: got %v, want plain error %q", policy, err, want)
		}
	}
}

func TestPlaceIsDeterministicAndLeavesInputsAlone(t *testing.T) {
	reqs := []rb{
		frac(10240, 10), frac(20480, 25).n(3), frac(5120, 5).n(4).topo(sameHost),
		excl().n(2), excl().n(2).topo(sameNVLink), excl().n(2).topo(samePCIeRoot),
		frac(10240, 10).n(3).topo(distinctGPUs).hostRes(1000, 1024),
		frac(10240, 10).where(&gpupoolv1.Constraints{Model: "A100*", Labels: map[string]string{"zone": "a"}}),
	}
	for seed := range uint64(20) {
		hosts := randomPool(newRand(seed))
		for _, r := range reqs {
			for _, policy := range Policies {
				beforeHosts := cloneHosts(hosts)
				beforeReq := proto.Clone(r.req)
				first, err1 := Place(hosts, r.req, policy)
				second, err2 := Place(hosts, r.req, policy)
				reversed := slices.Clone(hosts)
				slices.Reverse(reversed)
				third, err3 := Place(reversed, r.req, policy)
				if !sameSlices(first, second) || !sameSlices(first, third) ||
					errText(err1) != errText(err2) || errText(err1) != errText(err3) {
					t.Fatalf("seed %d, %s, %v: got %s (%v), then %s (%v), reversed %s (%v); want the same each time",
						seed, policy, r.req, placed(first), err1, placed(second), err2, placed(third), err3)
				}
				for i := range hosts {
					if !proto.Equal(hosts[i], beforeHosts[i]) {
						t.Fatalf("seed %d, %s, %v: Place modified host %s", seed, policy, r.req, hosts[i].Id)
					}
				}
				if !proto.Equal(r.req, beforeReq) {
					t.Fatalf("seed %d, %s: Place modified the request: got %v, want %v", seed, policy, r.req, beforeReq)
				}
			}
		}
	}
}

func cloneHosts(hs []*gpupoolv1.Host) []*gpupoolv1.Host {
	out := make([]*gpupoolv1.Host, len(hs))
	for i, h := range hs {
		out[i] = proto.Clone(h).(*gpupoolv1.Host)
	}
	return out
}

func sameSlices(a, b []*gpupoolv1.Slice) bool {
	return slices.EqualFunc(a, b, func(x, y *gpupoolv1.Slice) bool { return proto.Equal(x, y) })
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
