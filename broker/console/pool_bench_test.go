package console

import (
	"fmt"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// BenchmarkPoolDoc renders the heatmap of 10k hosts with 8 GPUs each.
func BenchmarkPoolDoc(b *testing.B) {
	tpl, err := parseTemplates()
	if err != nil {
		b.Fatal(err)
	}
	s := &Server{tpl: tpl}
	var hosts []*gpupoolv1.Host
	for i := range 10000 {
		h := &gpupoolv1.Host{Id: fmt.Sprintf("host-%05d", i), Status: gpupoolv1.HostStatus_HOST_STATUS_READY, Eligible: true}
		for g := range 8 {
			h.Devices = append(h.Devices, &gpupoolv1.Device{Uuid: fmt.Sprintf("GPU-%05d-%d", i, g), Index: int32(g), Model: "A100-SXM4-80GB",
				MemoryMib: 81920, AllocatedMemoryMib: int64(g * 4096), AllocatedComputePercent: int32(g * 5), LeaseCount: int32(g % 2), UsedMemoryMib: 1024, UtilizationPercent: 7})
		}
		hosts = append(hosts, h)
	}
	b.ResetTimer()
	for b.Loop() {
		if _, err := s.poolDoc(hosts, filters{}, nil, time.Now()); err != nil {
			b.Fatal(err)
		}
	}
}
