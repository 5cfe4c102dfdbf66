package protocol

import "time"

// Limits of a lease request.
const (
	// MaxCount is the most GPUs (or slices) one lease, elastic extras
	// included, may hold.
	MaxCount = 256
	// MinTTL and MaxTTL bound a lease's TTL.
	MinTTL = time.Second
	MaxTTL = 24 * time.Hour
	// MaxPriority is the highest priority a request may ask for.
	MaxPriority = 1000
	// MaxWait is the longest an Acquire may wait in the queue.
	MaxWait = 24 * time.Hour
	// MaxHolderLen and MaxRequestIDLen bound those free-form fields, in
	// bytes.
	MaxHolderLen    = 256
	MaxRequestIDLen = 128
	// MaxConstraintDevices bounds the device-UUID constraint, and
	// MaxDeviceUUIDLen each UUID in it, in bytes.
	MaxConstraintDevices = 64
	MaxDeviceUUIDLen     = 128
	// DefaultTenant is the tenant a request naming none counts against
	// when its caller's token names no tenant (see FillDefaults).
	DefaultTenant = "default"
)

// Limits of a host drain.
const (
	// DefaultDrainDeadline is how long a drain from the CLI gives leases
	// before revoking them, unless told otherwise.
	DefaultDrainDeadline = time.Hour
	// MinDrainDeadline is the shortest deadline the CLI asks for (shorter
	// is --force); MaxDrainDeadline the longest a request may ask for.
	MinDrainDeadline = time.Second
	MaxDrainDeadline = 30 * 24 * time.Hour
	// MaxDrainReasonLen bounds a drain's reason, in bytes.
	MaxDrainReasonLen = 256
)
