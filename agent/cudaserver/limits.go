package cudaserver

import "fmt"

// SessionLimits bound the driver objects one session (one client process)
// may hold at once, by kind, so that one program cannot grow the server,
// or the driver under it, without bound. A call that would create one
// past its limit fails with CUDA_ERROR_OUT_OF_MEMORY, what the driver
// answers when it cannot make another stream, event, context or module,
// and runs nothing; destroying (or unloading) one frees its slot. The
// session logs the first refusal of each limit, once.
//
// The defaults are well above what real programs hold: PyTorch keeps
// pools of 32 streams per priority on each device it uses, and its
// caching allocator and profiler a few thousand events at most; programs
// run on the primary context, one per device, which no limit counts; the
// CUDA runtime loads one module or library per fatbinary a program
// registers (about one per .cu file: hundreds to a few thousand in the
// largest libraries), and resolves one function per kernel it launches.
type SessionLimits struct {
	// Contexts are the contexts cuCtxCreate made and cuCtxDestroy did not
	// destroy. Primary contexts are not counted.
	Contexts int `json:"contexts"`
	// Streams are the streams cuStreamCreate made.
	Streams int `json:"streams"`
	// Events are the events cuEventCreate made.
	Events int `json:"events"`
	// Modules are the modules and libraries loaded, and not unloaded. A
	// library's module (cuLibraryGetModule) is the library's and is not
	// counted again. Libraries belong to no context: destroying or resetting the
	// context they were loaded under frees no slot.
	Modules int `json:"modules"`
	// Functions are the functions and kernels resolved in them; unloading
	// their module or library frees theirs.
	Functions int `json:"functions"`
}

// DefaultSessionLimits are SessionLimits' defaults (see there for why).
func DefaultSessionLimits() SessionLimits {
	return SessionLimits{Contexts: 16, Streams: 1024, Events: 8192, Modules: 4096, Functions: 16384}
}

// MaxSessionLimit is the most any of SessionLimits may be: every handle a
// session holds, of all kinds together.
const MaxSessionLimit = 1 << 16

// The agent's flags that set SessionLimits.
const (
	FlagSessionContexts  = "limit-cuda-session-contexts"
	FlagSessionStreams   = "limit-cuda-session-streams"
	FlagSessionEvents    = "limit-cuda-session-events"
	FlagSessionModules   = "limit-cuda-session-modules"
	FlagSessionFunctions = "limit-cuda-session-functions"
)

// Validate checks every limit, naming the flag of a wrong one and what it
// may be.
func (l SessionLimits) Validate() error {
	for k, v := range l.byKind() {
		if v < 1 || v > MaxSessionLimit {
			return fmt.Errorf("cudaserver: --%s %d: must be between 1 and %d (the most handles a session holds)", limitFlags[k], v, MaxSessionLimit)
		}
	}
	return nil
}

// limitKind is one of SessionLimits.
type limitKind int

const (
	limitContexts limitKind = iota
	limitStreams
	limitEvents
	limitModules
	limitFunctions
	numLimits
)

var (
	limitNames = [numLimits]string{"contexts", "streams", "events", "modules", "functions"}
	limitFlags = [numLimits]string{FlagSessionContexts, FlagSessionStreams, FlagSessionEvents, FlagSessionModules, FlagSessionFunctions}
)

func (l SessionLimits) byKind() [numLimits]int {
	return [numLimits]int{l.Contexts, l.Streams, l.Events, l.Modules, l.Functions}
}

// opLimits are the calls that create an object some limit counts, by that
// limit: the session refuses them once the session holds the limit's
// most. The other calls of opCreates return an object the session already
// holds, or one per object it holds (a primary context per device, a
// library's module, a stream's context).
var opLimits = map[uint16]limitKind{
	opCuCtxCreateV2:              limitContexts,
	opCuStreamCreate:             limitStreams,
	opCuStreamCreateWithPriority: limitStreams,
	opCuEventCreate:              limitEvents,
	opCuModuleLoadData:           limitModules,
	opGpupoolLibraryLoadData:     limitModules,
	opCuModuleGetFunction:        limitFunctions,
	opCuLibraryGetKernel:         limitFunctions,
	opCuKernelGetFunction:        limitFunctions,
}

// limitOf is the limit that counts h, a handle of kind; false for one no
// limit counts (a primary context).
func (s *session) limitOf(kind HandleKind, h uint64) (limitKind, bool) {
	switch kind {
	case HandleContext:
		return limitContexts, !s.isPrimary(h)
	case HandleStream:
		return limitStreams, true
	case HandleEvent:
		return limitEvents, true
	case HandleModule:
		// A library's module is the library's: its slot is the library's.
		return limitModules, s.handles[s.owner[h]] != HandleLibrary
	case HandleLibrary:
		return limitModules, true
	case HandleFunction, HandleKernel:
		return limitFunctions, true
	}
	return 0, false
}

// overLimit reports whether op would create an object past its limit, and
// logs the first such refusal of each limit in the session.
func (s *session) overLimit(op uint16) bool {
	k, ok := opLimits[op]
	if !ok || s.held[k] < s.srv.limits[k] {
		return false
	}
	if !s.limitLogged[k] {
		s.limitLogged[k] = true
		s.log.Warn("cuda session limit reached: creating more fails with CUDA_ERROR_OUT_OF_MEMORY until the session destroys some (logged once per session)",
			"limit", limitNames[k], "max", s.srv.limits[k], "flag", "--"+limitFlags[k], "op", opNames[op])
	}
	return true
}
