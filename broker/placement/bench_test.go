package placement

import (
	"fmt"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// benchPool is 10,000 hosts of 8 NVLinked A100s, about half of them in use.
func benchPool() []*gpupoolv1.Host {
	r := newRand(42)
	hosts := make([]*gpupoolv1.Host, 10000)
	for i := range hosts {
		devs := make([]*gpupoolv1.Device, 8)
		for j := range devs {
			devs[j] = gpu(int32(j), pcie(fmt.Sprintf("r%d", j/4)))
			switch r.IntN(4) {
			case 0:
				held(devs[j])
			case 1:
				used(int64(10240*(1+r.IntN(6))), int32(10*(1+r.IntN(6))))(devs[j])
			}
		}
		hosts[i] = nvlinked(host(fmt.Sprintf("host-%05d", i), devs...), 0, 1, 2, 3, 4, 5, 6, 7)
	}
	return hosts
}

func BenchmarkPlace(b *testing.B) {
	hosts := benchPool()
	for _, bc := range []struct {
		name string
		req  rb
	}{
		{"fractional", frac(10240, 10)},
		{"fractional x4", frac(10240, 10).n(4)},
		{"exclusive x2 same-nvlink", excl().n(2).topo(sameNVLink)},
		{"exclusive x4 same-pcie-root", excl().n(4).topo(samePCIeRoot)},
		{"exclusive x8 same-host (does not fit)", excl().n(8).topo(sameHost)},
	} {
		for _, policy := range Policies {
			b.Run(bc.name+"/"+policy, func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					_, _ = Place(hosts, bc.req.req, policy)
				}
			})
		}
	}
}
