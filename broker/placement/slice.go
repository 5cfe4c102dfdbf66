package placement

import (
	"cmp"
	"fmt"
	"strings"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// CheckSlice reports whether slice s still fits on device d given d's current allocation. It
// returns nil when it fits, otherwise an *Error that says what is short, e.g.
// "device GPU-ab12 on host-1: 20480 MiB requested, 10240 MiB free". Never is set when s could
// not fit on d even if d were idle.
//
// A slice fits when d is not unhealthy and: for an exclusive slice, nothing is allocated on d;
// for a fractional slice, d is not held exclusively and has the slice's memory and compute
// free. CheckSlice does not look at the host's status or its CPU and memory.
func CheckSlice(d *gpupoolv1.Device, s *gpupoolv1.Slice) error {
	if d == nil || s == nil {
		return &Error{Never: true, Reason: "check slice: nil device or slice"}
	}
	where := fmt.Sprintf("device %s on %s", d.GetUuid(), cmp.Or(d.GetHostId(), s.GetHost()))
	never := func(format string, args ...any) error {
		return &Error{Never: true, Reason: where + ": " + fmt.Sprintf(format, args...)}
	}
	switch {
	case s.GetDevice() != d.GetUuid():
		return never("slice is for device %s", s.GetDevice())
	case s.GetMemoryMib() < 0 || s.GetComputePercent() < 0 || s.GetComputePercent() > 100:
		return never("slice of %d MiB and %d%% compute is malformed", s.GetMemoryMib(), s.GetComputePercent())
	case s.GetMemoryMib() > d.GetMemoryMib():
		return never("%d MiB requested, the GPU has %d MiB", s.GetMemoryMib(), d.GetMemoryMib())
	case d.GetHealth() == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY:
		return &Error{Reason: where + ": unhealthy"}
	}
	if s.GetExclusive() {
		if viewNow.idle(d) {
			return nil
		}
		return &Error{Reason: fmt.Sprintf("%s: exclusive requested, but %s hold %d MiB and %d%% compute",
			where, count(int(d.GetLeaseCount()), "slice", "slices"), d.GetAllocatedMemoryMib(), d.GetAllocatedComputePercent())}
	}
	if d.GetAllocatedExclusive() {
		return &Error{Reason: where + ": held exclusively"}
	}
	var short []string
	if free := d.GetMemoryMib() - d.GetAllocatedMemoryMib(); s.GetMemoryMib() > free {
		short = append(short, fmt.Sprintf("%d MiB requested, %d MiB free", s.GetMemoryMib(), free))
	}
	if free := 100 - d.GetAllocatedComputePercent(); s.GetComputePercent() > free {
		short = append(short, fmt.Sprintf("%d%% compute requested, %d%% free", s.GetComputePercent(), free))
	}
	if len(short) > 0 {
		return &Error{Reason: where + ": " + strings.Join(short, "; ")}
	}
	return nil
}

// Allocate adds slice s to d's allocation fields in place: its memory and compute, exclusivity,
// and one to LeaseCount (so a lease with two slices on d counts twice). It does not check; call
// CheckSlice first.
func Allocate(d *gpupoolv1.Device, s *gpupoolv1.Slice) {
	d.AllocatedMemoryMib += s.GetMemoryMib()
	d.AllocatedComputePercent += s.GetComputePercent()
	if s.GetExclusive() {
		d.AllocatedExclusive = true
	}
	d.LeaseCount++
}

// Free undoes an Allocate of the same slice on d. The fields never go below zero.
func Free(d *gpupoolv1.Device, s *gpupoolv1.Slice) {
	d.AllocatedMemoryMib = max(0, d.AllocatedMemoryMib-s.GetMemoryMib())
	d.AllocatedComputePercent = max(0, d.AllocatedComputePercent-s.GetComputePercent())
	if s.GetExclusive() {
		d.AllocatedExclusive = false
	}
	d.LeaseCount = max(0, d.LeaseCount-1)
}
