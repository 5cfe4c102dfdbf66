package device

import (
	"context"
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// HealthKind says what a HealthEvent reports. Values are append-only.
type HealthKind int

const (
	// HealthXid is an Xid error the driver logged for the device.
	HealthXid HealthKind = iota + 1
	// HealthECC is an ECC memory error.
	HealthECC
	// HealthLost means NVML answered ERROR_GPU_IS_LOST.
	HealthLost
)

func (k HealthKind) String() string {
	switch k {
	case HealthXid:
		return "xid"
	case HealthECC:
		return "ecc"
	case HealthLost:
		return "lost"
	default:
		return fmt.Sprintf("HealthKind(%d)", int(k))
	}
}

// HealthEvent is one thing that happened to a device's health.
type HealthEvent struct {
	// UUID names the device; "" means every device, as when NVML says
	// the GPUs are lost without naming one.
	UUID string
	Kind HealthKind
	// Xid is the Xid error code of a HealthXid event.
	Xid uint64
	// Critical says the device is no longer healthy. Application Xids
	// (see CriticalXid) and single-bit ECC errors, which the hardware
	// corrected, are not critical.
	Critical bool
	// Reason says what happened in one short sentence: "Xid 79",
	// "double-bit ECC error", "GPU is lost".
	Reason string
}

// applicationXids are the Xid errors a faulty application causes, not a
// faulty GPU: 13 (graphics engine exception), 31 (GPU memory page
// fault), 43 (GPU stopped processing), 45 (preemptive cleanup), 68
// (video processor exception) and 109 (context switch timeout).
var applicationXids = map[uint64]bool{13: true, 31: true, 43: true, 45: true, 68: true, 109: true}

// CriticalXid reports whether Xid x means the GPU itself is unhealthy.
// It is false for the Xids an application causes (13, 31, 43, 45, 68 and
// 109) and true for every other.
func CriticalXid(x uint64) bool { return !applicationXids[x] }

// watchedEvents are the NVML event types WatchHealth registers, where a
// device supports them.
const watchedEvents = nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError | nvml.EventTypeSingleBitEccError

// healthWaitMillis bounds each wait for an event, so that WatchHealth
// notices the end of its context within that time.
const healthWaitMillis = 500

// gpusLost is the event of NVML answering ERROR_GPU_IS_LOST.
var gpusLost = HealthEvent{Kind: HealthLost, Critical: true, Reason: "GPU is lost"}

// watchHealth reports the health events of lib's devices to fn until ctx
// ends, then returns nil; lib must be initialised. It is the only place
// that watches health, for every backend. With no devices it returns at
// once.
//
// Devices that cannot report events (ERROR_NOT_SUPPORTED, or none of the
// watched types) are not watched: they never get an event, and that is
// no error. Once NVML answers ERROR_GPU_IS_LOST, watchHealth reports one
// HealthLost event for every device, stops watching and frees its event
// set, and returns nil when ctx ends, so that a caller restarting a
// returned watch does not report the loss again and again.
func watchHealth(ctx context.Context, lib nvml.Interface, fn func(HealthEvent)) error {
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return fmt.Errorf("device: count GPUs: %w", code(ret))
	}
	if n == 0 {
		return nil
	}
	lost, err := watchEvents(ctx, lib, n, fn)
	if err != nil {
		return err
	}
	if lost {
		fn(gpusLost)
	}
	<-ctx.Done()
	return nil
}

// watchEvents reports the events of lib's n devices to fn until ctx ends
// (lost is false) or NVML says the GPUs are lost (lost is true). It frees
// the event set it creates before returning.
func watchEvents(ctx context.Context, lib nvml.Interface, n int, fn func(HealthEvent)) (lost bool, err error) {
	type watched struct {
		h     nvml.Device
		uuid  string
		types uint64 // watchedEvents the device supports
	}
	var devs []watched
	for i := range n {
		h, ret := lib.DeviceGetHandleByIndex(i)
		if ret == nvml.ERROR_GPU_IS_LOST {
			return true, nil
		} else if ret != nvml.SUCCESS {
			return false, fmt.Errorf("device: GPU %d: get handle: %w", i, code(ret))
		}
		uuid, ret := h.GetUUID()
		if ret == nvml.ERROR_GPU_IS_LOST {
			return true, nil
		} else if ret != nvml.SUCCESS {
			return false, fmt.Errorf("device: GPU %d: read UUID: %w", i, code(ret))
		}
		types, ret := h.GetSupportedEventTypes()
		switch {
		case ret == nvml.ERROR_GPU_IS_LOST:
			return true, nil
		case ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.SUCCESS && types&watchedEvents == 0:
			continue
		case ret != nvml.SUCCESS:
			return false, fmt.Errorf("device: GPU %d (%s): read supported events: %w", i, uuid, code(ret))
		}
		devs = append(devs, watched{h, uuid, types & watchedEvents})
	}
	if len(devs) == 0 {
		return false, nil
	}

	set, ret := lib.EventSetCreate()
	if ret == nvml.ERROR_GPU_IS_LOST {
		return true, nil
	} else if ret != nvml.SUCCESS {
		return false, fmt.Errorf("device: create event set: %w", code(ret))
	}
	defer set.Free()
	uuidOf := make(map[nvml.Device]string, len(devs))
	for _, d := range devs {
		switch ret := d.h.RegisterEvents(d.types, set); ret {
		case nvml.SUCCESS:
			uuidOf[d.h] = d.uuid
		case nvml.ERROR_NOT_SUPPORTED:
		case nvml.ERROR_GPU_IS_LOST:
			return true, nil
		default:
			return false, fmt.Errorf("device: GPU %s: register for events: %w", d.uuid, code(ret))
		}
	}
	if len(uuidOf) == 0 {
		return false, nil
	}

	for ctx.Err() == nil {
		e, ret := set.Wait(healthWaitMillis)
		switch ret {
		case nvml.SUCCESS:
			if ev, ok := healthEvent(e, eventUUID(e.Device, uuidOf)); ok {
				fn(ev)
			}
		case nvml.ERROR_TIMEOUT:
		case nvml.ERROR_GPU_IS_LOST:
			return true, nil
		default:
			return false, fmt.Errorf("device: wait for health events: %w", code(ret))
		}
	}
	return false, nil
}

// eventUUID names the device of an event: by the handle it was registered
// with, else by asking it, else "" (every device).
func eventUUID(h nvml.Device, uuidOf map[nvml.Device]string) string {
	if h == nil {
		return ""
	}
	if uuid, ok := uuidOf[h]; ok {
		return uuid
	}
	if uuid, ret := h.GetUUID(); ret == nvml.SUCCESS {
		return uuid
	}
	return ""
}

// healthEvent turns NVML event e of device uuid into a HealthEvent; ok is
// false for event types WatchHealth does not report.
func healthEvent(e nvml.EventData, uuid string) (ev HealthEvent, ok bool) {
	switch e.EventType {
	case nvml.EventTypeXidCriticalError:
		return HealthEvent{UUID: uuid, Kind: HealthXid, Xid: e.EventData, Critical: CriticalXid(e.EventData), Reason: fmt.Sprintf("Xid %d", e.EventData)}, true
	case nvml.EventTypeDoubleBitEccError:
		return HealthEvent{UUID: uuid, Kind: HealthECC, Critical: true, Reason: "double-bit ECC error"}, true
	case nvml.EventTypeSingleBitEccError:
		return HealthEvent{UUID: uuid, Kind: HealthECC, Reason: "single-bit ECC error"}, true
	default:
		return HealthEvent{}, false
	}
}
