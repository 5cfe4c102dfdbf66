package leasebench

import (
	"encoding/json"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// withFree is a 80 GiB device whose free memory and compute are set, as
// if other allocations held the rest.
func withFree(index int, memoryMiB int64, computePercent int) device {
	d := newDevice("host-1", index, gpuMemoryMiB, 100)
	d.FreeMemoryMiB, d.FreeComputePercent = memoryMiB, computePercent
	return d
}

func TestFirstFit(t *testing.T) {
	gib := slice{MemoryMiB: 1024, ComputePercent: 1}
	tests := []struct {
		name string
		devs []device
		s    slice
		want int
	}{
		{name: "an empty pool fits nothing", devs: nil, s: gib, want: -1},
		{name: "the first device that fits is chosen", devs: []device{withFree(0, 2048, 50), withFree(1, 80<<10, 100)}, s: gib, want: 0},
		{name: "a device short of memory is skipped", devs: []device{withFree(0, 1023, 50), withFree(1, 1024, 1)}, s: gib, want: 1},
		{name: "a device short of compute is skipped", devs: []device{withFree(0, 4096, 0), withFree(1, 4096, 5)}, s: gib, want: 1},
		{name: "a slice that takes exactly what is free fits", devs: []device{withFree(0, 1024, 1)}, s: gib, want: 0},
		{name: "no device with room fits nothing", devs: []device{withFree(0, 512, 100), withFree(1, 80<<10, 0)}, s: gib, want: -1},
		{name: "a slice larger than any GPU fits nothing", devs: simulatedPool(), s: slice{MemoryMiB: 81 << 10, ComputePercent: 1}, want: -1},
		{name: "a whole GPU fits an empty one", devs: simulatedPool(), s: slice{MemoryMiB: 80 << 10, ComputePercent: 100}, want: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := firstFit(tt.devs, tt.s); got != tt.want {
				t.Errorf("got device %d, want %d", got, tt.want)
			}
		})
	}
}

func TestAllocateAndFreeKeepTheFreeCounts(t *testing.T) {
	d := newDevice("host-2", 3, gpuMemoryMiB, 100)
	s := slice{MemoryMiB: 1024, ComputePercent: 1}
	n := 0
	for d.fits(s) {
		d.allocate(leaseKeyID(clientv3.LeaseID(1000+n)), s)
		n++
	}
	if n != 80 {
		t.Errorf("got %d slices of 1 GiB on an 80 GiB device, want 80", n)
	}
	if d.FreeMemoryMiB != 0 || d.FreeComputePercent != 20 {
		t.Errorf("got %d MiB and %d%% free on a full device, want 0 MiB and 20%%", d.FreeMemoryMiB, d.FreeComputePercent)
	}
	if !d.free(leaseKeyID(1000)) {
		t.Fatal("free of a held allocation: got false, want true")
	}
	if d.free(leaseKeyID(1000)) {
		t.Error("second free of the same allocation: got true, want false")
	}
	if d.FreeMemoryMiB != 1024 || d.FreeComputePercent != 21 || len(d.Allocations) != 79 {
		t.Errorf("after one free: got %d MiB, %d%% free and %d allocations, want 1024 MiB, 21%% and 79",
			d.FreeMemoryMiB, d.FreeComputePercent, len(d.Allocations))
	}
}

func TestDeviceRecordRoundTrips(t *testing.T) {
	d := newDevice("host-4", 7, gpuMemoryMiB, 100)
	d.allocate("1f", slice{MemoryMiB: 1024, ComputePercent: 1})
	b, err := json.Marshal(&d)
	if err != nil {
		t.Fatal(err)
	}
	var got device
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if got.key() != "/gpupool-bench/devices/host-4/07" || got.FreeMemoryMiB != 80<<10-1024 || got.Allocations["1f"].MemoryMiB != 1024 {
		t.Errorf("got %+v (key %s) back from %s", got, got.key(), b)
	}
}
