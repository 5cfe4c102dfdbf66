package placement

import (
	"errors"
	"testing"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestCheckSlice(t *testing.T) {
	dev := func(opts ...func(*gpupoolv1.Device)) *gpupoolv1.Device {
		d := gpu(0, opts...)
		d.Uuid, d.HostId = "GPU-ab12", "host-1"
		return d
	}
	fracSlice := func(mem int64, compute int32) *gpupoolv1.Slice {
		return &gpupoolv1.Slice{Host: "host-1", Device: "GPU-ab12", MemoryMib: mem, ComputePercent: compute}
	}
	whole := &gpupoolv1.Slice{Host: "host-1", Device: "GPU-ab12", MemoryMib: a100Mem, ComputePercent: 100, Exclusive: true}
	for _, tc := range []struct {
		name      string
		d         *gpupoolv1.Device
		s         *gpupoolv1.Slice
		want      string // "" when the slice fits
		wantNever bool
	}{
		{"a slice that fits exactly", dev(used(40960, 50)), fracSlice(40960, 50), "", false},
		{"a whole GPU on an idle GPU", dev(), whole, "", false},
		{"too little memory free", dev(used(71680, 10)), fracSlice(20480, 10),
			"device GPU-ab12 on host-1: 20480 MiB requested, 10240 MiB free", false},
		{"too little compute free", dev(used(1024, 80)), fracSlice(1024, 30),
			"device GPU-ab12 on host-1: 30% compute requested, 20% free", false},
		{"too little of both free", dev(used(71680, 80)), fracSlice(20480, 30),
			"device GPU-ab12 on host-1: 20480 MiB requested, 10240 MiB free; 30% compute requested, 20% free", false},
		{"a whole GPU on a GPU in use", dev(used(1024, 5)), whole,
			"device GPU-ab12 on host-1: exclusive requested, but 1 slice hold 1024 MiB and 5% compute", false},
		{"a fractional slice on a GPU held exclusively", dev(held), fracSlice(1024, 5),
			"device GPU-ab12 on host-1: held exclusively", false},
		{"an unhealthy GPU", dev(unhealthy), fracSlice(1024, 5), "device GPU-ab12 on host-1: unhealthy", false},
		{"more memory than the GPU has", dev(), fracSlice(90000, 5),
			"device GPU-ab12 on host-1: 90000 MiB requested, the GPU has 81920 MiB", true},
		{"a slice for another device", dev(), &gpupoolv1.Slice{Device: "GPU-cd34", MemoryMib: 1, ComputePercent: 1},
			"device GPU-ab12 on host-1: slice is for device GPU-cd34", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckSlice(tc.d, tc.s)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("got %v, want nil", err)
				}
				return
			}
			var pe *Error
			if !errors.As(err, &pe) || pe.Reason != tc.want || pe.Never != tc.wantNever {
				t.Errorf("got %#v,\nwant Never=%t %q", err, tc.wantNever, tc.want)
			}
		})
	}
}

func TestAllocateAndFreeRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name   string
		start  *gpupoolv1.Device
		slices []*gpupoolv1.Slice
		mid    *gpupoolv1.Device // after allocating every slice
	}{
		{
			name:  "two fractional slices add up",
			start: gpu(0, used(1024, 5)),
			slices: []*gpupoolv1.Slice{
				{MemoryMib: 10240, ComputePercent: 10}, {MemoryMib: 20480, ComputePercent: 25},
			},
			mid: gpu(0, func(d *gpupoolv1.Device) {
				d.AllocatedMemoryMib, d.AllocatedComputePercent, d.LeaseCount = 31744, 40, 3
			}),
		},
		{
			name:   "an exclusive slice holds the whole GPU",
			start:  gpu(0),
			slices: []*gpupoolv1.Slice{{MemoryMib: a100Mem, ComputePercent: 100, Exclusive: true}},
			mid:    gpu(0, held),
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := proto.Clone(tc.start).(*gpupoolv1.Device)
			for _, s := range tc.slices {
				Allocate(d, s)
			}
			if !proto.Equal(d, tc.mid) {
				t.Errorf("after Allocate: got %v, want %v", d, tc.mid)
			}
			for _, s := range tc.slices {
				Free(d, s)
			}
			if !proto.Equal(d, tc.start) {
				t.Errorf("after Free: got %v, want %v", d, tc.start)
			}
		})
	}
}
