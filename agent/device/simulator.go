package device

import (
	"bytes"
	"fmt"
	"math"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// Simulator drives simulated GPUs, as tests and demos need. Devices are
// named by index. What it sets is what the backend's NVML mock answers,
// so Sample and WatchHealth see it through the code real GPUs go
// through. The backend NewSimulated returns implements Simulator, and so
// does a SimClient of a simulated agent's control socket.
//
// Errors name the argument, its value and what is allowed, e.g. `device
// 9: must be between 0 and 7`. All methods are safe for concurrent use.
type Simulator interface {
	// SetProcess makes pid use usedMiB of device's memory, replacing what
	// it used before; 0 removes the process. The device's used memory is
	// the sum over its processes and cannot exceed its total.
	SetProcess(device, pid int, usedMiB int64) error
	// SetUtilization sets device's GPU utilisation, 0 to 100 percent.
	SetUtilization(device, percent int) error
	// InjectXid delivers Xid error xid (positive) of device to every
	// running WatchHealth. With none running, the event is held for the
	// next to start, so a test need not wait for WatchHealth to be ready
	// before injecting. It fails when 256 events already wait.
	InjectXid(device int, xid uint64) error
	// InjectECC delivers a double-bit (uncorrectable) or single-bit
	// (corrected) ECC error of device, as InjectXid delivers an Xid.
	InjectECC(device int, doubleBit bool) error
	// LoseGPUs makes every later NVML call about any device fail with
	// ERROR_GPU_IS_LOST, as when the GPUs fall off the bus, and
	// WatchHealth report it. There is no way back; calling it again does
	// nothing.
	LoseGPUs() error
}

// maxSimEvents bounds the undelivered events of each simulated event set,
// and the events held for sets yet to come (see Simulator.InjectXid).
const maxSimEvents = 256

// maxPID is Linux's largest pid (PID_MAX_LIMIT on 64-bit).
const maxPID = 1 << 22

// simEventTypes are the NVML event types a simulated GPU supports, those
// of a data-centre GPU with ECC memory.
const simEventTypes = nvml.EventTypeSingleBitEccError | nvml.EventTypeDoubleBitEccError |
	nvml.EventTypePState | nvml.EventTypeXidCriticalError | nvml.EventTypeClock

// SimOption changes how simulated GPUs behave.
type SimOption func(*simulator)

// SimReapExited makes a simulated process's GPU memory go away when the
// process exits, as CUDA frees a context with its process. Without it
// (for tests with made-up pids) processes stay until removed.
func SimReapExited() SimOption { return func(s *simulator) { s.reap = true } }

// simulator holds the live state of a mock server's GPUs and answers the
// server's queries about it.
type simulator struct {
	devices  []nvml.Device // the server's, by index
	totalMiB []int64       // memory of each device
	lost     chan struct{} // closed by LoseGPUs, under mu
	reap     bool          // drop processes that exited (SimReapExited)

	mu    sync.Mutex
	procs []map[int]int64       // guarded by mu; per device, MiB used by pid
	util  []int                 // guarded by mu; per device, percent
	sets  map[*simEventSet]bool // guarded by mu; event sets not yet freed
	held  []nvml.EventData      // guarded by mu; events no set has registered for
}

// newSimulator wires a simulator into srv's device queries and event
// sets, replacing what srv answered for them. It wraps the device queries
// srv answers already, so call it after configuring them.
func newSimulator(srv *server.Server) *simulator {
	n := len(srv.Devices)
	s := &simulator{
		devices:  srv.Devices,
		totalMiB: make([]int64, n),
		lost:     make(chan struct{}),
		procs:    make([]map[int]int64, n),
		util:     make([]int, n),
		sets:     map[*simEventSet]bool{},
	}
	for i, h := range srv.Devices {
		d := h.(*server.Device)
		total := d.MemoryInfo.Total
		s.totalMiB[i] = int64(total >> 20)
		s.procs[i] = map[int]int64{}

		d.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) {
			used := uint64(s.usedMiB(i)) << 20
			return nvml.Memory{Total: total, Used: used, Free: total - used}, nvml.SUCCESS
		}
		d.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
			s.mu.Lock()
			defer s.mu.Unlock()
			return nvml.Utilization{Gpu: uint32(s.util[i])}, nvml.SUCCESS
		}
		d.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
			return s.processes(i), nvml.SUCCESS
		}
		// No MPS daemon runs on a simulated host.
		d.GetMPSComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
			return []nvml.ProcessInfo{}, nvml.SUCCESS
		}
		d.GetSupportedEventTypesFunc = func() (uint64, nvml.Return) { return simEventTypes, nvml.SUCCESS }
		d.RegisterEventsFunc = func(types uint64, set nvml.EventSet) nvml.Return {
			return s.register(i, types, set)
		}
		s.guardDevice(d)
	}
	srv.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) { return s.newEventSet(), nvml.SUCCESS }
	srv.EventSetWaitFunc = func(set nvml.EventSet, ms uint32) (nvml.EventData, nvml.Return) { return set.Wait(ms) }
	srv.EventSetFreeFunc = func(set nvml.EventSet) nvml.Return { return set.Free() }
	srv.DeviceRegisterEventsFunc = func(d nvml.Device, types uint64, set nvml.EventSet) nvml.Return {
		return d.RegisterEvents(types, set)
	}
	guard1(s.lost, &srv.DeviceGetHandleByIndexFunc)
	guard1(s.lost, &srv.DeviceGetHandleByUUIDFunc)
	guard1(s.lost, &srv.DeviceGetHandleByPciBusIdFunc)
	return s
}

// guardDevice makes d's queries fail with ERROR_GPU_IS_LOST once the GPUs
// are lost.
func (s *simulator) guardDevice(d *server.Device) {
	guard(s.lost, &d.GetUUIDFunc)
	guard(s.lost, &d.GetNameFunc)
	guard(s.lost, &d.GetIndexFunc)
	guard(s.lost, &d.GetMinorNumberFunc)
	guard(s.lost, &d.GetBrandFunc)
	guard(s.lost, &d.GetArchitectureFunc)
	guard(s.lost, &d.GetMemoryInfoFunc)
	guard(s.lost, &d.GetPciInfoFunc)
	guard(s.lost, &d.GetNumaNodeIdFunc)
	guard(s.lost, &d.GetAttributesFunc)
	guard(s.lost, &d.GetUtilizationRatesFunc)
	guard(s.lost, &d.GetComputeRunningProcessesFunc)
	guard(s.lost, &d.GetMPSComputeRunningProcessesFunc)
	guard(s.lost, &d.GetSupportedEventTypesFunc)
	guard1(s.lost, &d.GetTopologyCommonAncestorFunc)
	if p2p := d.GetP2PStatusFunc; p2p != nil {
		d.GetP2PStatusFunc = func(other nvml.Device, caps nvml.GpuP2PCapsIndex) (nvml.GpuP2PStatus, nvml.Return) {
			if closed(s.lost) {
				return nvml.P2P_STATUS_UNKNOWN, nvml.ERROR_GPU_IS_LOST
			}
			return p2p(other, caps)
		}
	}
}

// guard makes the mock query *f fail with ERROR_GPU_IS_LOST once lost is
// closed. A nil query stays nil.
func guard[T any](lost <-chan struct{}, f *func() (T, nvml.Return)) {
	if next := *f; next != nil {
		*f = func() (T, nvml.Return) {
			if closed(lost) {
				var zero T
				return zero, nvml.ERROR_GPU_IS_LOST
			}
			return next()
		}
	}
}

// guard1 is guard for queries with one argument.
func guard1[A, T any](lost <-chan struct{}, f *func(A) (T, nvml.Return)) {
	if next := *f; next != nil {
		*f = func(a A) (T, nvml.Return) {
			if closed(lost) {
				var zero T
				return zero, nvml.ERROR_GPU_IS_LOST
			}
			return next(a)
		}
	}
}

func closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// checkDevice refuses a device index the simulator does not have.
func (s *simulator) checkDevice(device int) error {
	if device < 0 || device >= len(s.devices) {
		return fmt.Errorf("device %d: must be between 0 and %d", device, len(s.devices)-1)
	}
	return nil
}

func (s *simulator) SetProcess(device, pid int, usedMiB int64) error {
	if err := s.checkDevice(device); err != nil {
		return err
	}
	switch {
	case pid < 1:
		return fmt.Errorf("pid %d: must be positive", pid)
	case pid > maxPID:
		return fmt.Errorf("pid %d: must be at most %d, Linux's largest", pid, maxPID)
	case usedMiB < 0:
		return fmt.Errorf("usedMiB %d: must be 0 or more", usedMiB)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	procs := s.procs[device]
	if usedMiB == 0 {
		delete(procs, pid)
		return nil
	}
	if others := s.usedMiBLocked(device) - procs[pid]; usedMiB > s.totalMiB[device]-others {
		return fmt.Errorf("usedMiB %d: exceeds the device's %d MiB, of which other processes use %d MiB",
			usedMiB, s.totalMiB[device], others)
	}
	procs[pid] = usedMiB
	return nil
}

func (s *simulator) SetUtilization(device, percent int) error {
	if err := s.checkDevice(device); err != nil {
		return err
	}
	if percent < 0 || percent > 100 {
		return fmt.Errorf("percent %d: must be between 0 and 100", percent)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.util[device] = percent
	return nil
}

func (s *simulator) InjectXid(device int, xid uint64) error {
	if err := s.checkDevice(device); err != nil {
		return err
	}
	if xid == 0 {
		return fmt.Errorf("xid %d: must be positive", xid)
	}
	return s.deliver(device, nvml.EventTypeXidCriticalError, xid)
}

func (s *simulator) InjectECC(device int, doubleBit bool) error {
	if err := s.checkDevice(device); err != nil {
		return err
	}
	if doubleBit {
		return s.deliver(device, nvml.EventTypeDoubleBitEccError, 0)
	}
	return s.deliver(device, nvml.EventTypeSingleBitEccError, 0)
}

func (s *simulator) LoseGPUs() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !closed(s.lost) {
		close(s.lost)
	}
	return nil
}

// usedMiB is the memory device's processes use.
func (s *simulator) usedMiB(device int) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.usedMiBLocked(device)
}

func (s *simulator) usedMiBLocked(device int) int64 {
	s.reapLocked(device)
	var sum int64
	for _, mib := range s.procs[device] {
		sum += mib
	}
	return sum
}

// reapLocked forgets device's processes that exited, with SimReapExited.
func (s *simulator) reapLocked(device int) {
	if !s.reap {
		return
	}
	for pid := range s.procs[device] {
		if !processRuns(pid) {
			delete(s.procs[device], pid)
		}
	}
}

// processRuns reports whether pid is a live process (not a zombie).
func processRuns(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	// The state follows the command name, which is in parentheses.
	i := bytes.LastIndexByte(b, ')')
	return i < 0 || i+2 >= len(b) || b[i+2] != 'Z'
}

// processes lists device's processes as NVML does for a GPU without MIG,
// in no particular order.
func (s *simulator) processes(device int) []nvml.ProcessInfo {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reapLocked(device)
	out := make([]nvml.ProcessInfo, 0, len(s.procs[device]))
	for pid, mib := range s.procs[device] {
		out = append(out, nvml.ProcessInfo{
			Pid:               uint32(pid),
			UsedGpuMemory:     uint64(mib) << 20,
			GpuInstanceId:     math.MaxUint32, // not a MIG instance
			ComputeInstanceId: math.MaxUint32,
		})
	}
	return out
}

// deliver queues an event of device to every event set registered for
// its type, or holds it until one registers.
func (s *simulator) deliver(device int, eventType, data uint64) error {
	e := nvml.EventData{Device: s.devices[device], EventType: eventType, EventData: data}
	s.mu.Lock()
	defer s.mu.Unlock()
	delivered := false
	for set := range s.sets {
		if set.types[device]&eventType == 0 {
			continue
		}
		select {
		case set.events <- e:
			delivered = true
		default:
			return fmt.Errorf("device %d: %d health events already wait for WatchHealth to take them", device, maxSimEvents)
		}
	}
	if delivered {
		return nil
	}
	if len(s.held) == maxSimEvents {
		return fmt.Errorf("device %d: %d health events already wait for WatchHealth to start", device, maxSimEvents)
	}
	s.held = append(s.held, e)
	return nil
}

// register is RegisterEvents of device for set, which then receives the
// matching held events.
func (s *simulator) register(device int, types uint64, set nvml.EventSet) nvml.Return {
	if closed(s.lost) {
		return nvml.ERROR_GPU_IS_LOST
	}
	es, ok := set.(*simEventSet)
	if !ok || es.sim != s {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	if types&^simEventTypes != 0 {
		return nvml.ERROR_NOT_SUPPORTED
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.sets[es] {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	es.types[device] |= types
	kept := s.held[:0]
	for _, e := range s.held {
		if e.Device == s.devices[device] && e.EventType&types != 0 && len(es.events) < cap(es.events) {
			es.events <- e
			continue
		}
		kept = append(kept, e)
	}
	clear(s.held[len(kept):])
	s.held = kept
	return nvml.SUCCESS
}

func (s *simulator) newEventSet() *simEventSet {
	es := &simEventSet{
		sim:    s,
		events: make(chan nvml.EventData, maxSimEvents),
		types:  make([]uint64, len(s.devices)),
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sets[es] = true
	return es
}

// simEventSet is an NVML event set of simulated GPUs: a queue the
// simulator fills.
type simEventSet struct {
	sim    *simulator
	events chan nvml.EventData // sent to under sim.mu
	types  []uint64            // guarded by sim.mu; event types registered, by device index
}

// Wait returns the next event within ms milliseconds. Once the GPUs are
// lost it answers ERROR_GPU_IS_LOST, like NVML.
func (es *simEventSet) Wait(ms uint32) (nvml.EventData, nvml.Return) {
	es.sim.mu.Lock()
	live := es.sim.sets[es]
	es.sim.mu.Unlock()
	switch {
	case !live:
		return nvml.EventData{}, nvml.ERROR_INVALID_ARGUMENT
	case closed(es.sim.lost):
		return nvml.EventData{}, nvml.ERROR_GPU_IS_LOST
	}
	timeout := time.NewTimer(time.Duration(ms) * time.Millisecond)
	defer timeout.Stop()
	select {
	case e := <-es.events:
		return e, nvml.SUCCESS
	case <-es.sim.lost:
		return nvml.EventData{}, nvml.ERROR_GPU_IS_LOST
	case <-timeout.C:
		return nvml.EventData{}, nvml.ERROR_TIMEOUT
	}
}

// Free forgets the set and the events it has not delivered.
func (es *simEventSet) Free() nvml.Return {
	es.sim.mu.Lock()
	defer es.sim.mu.Unlock()
	if !es.sim.sets[es] {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	delete(es.sim.sets, es)
	return nvml.SUCCESS
}
