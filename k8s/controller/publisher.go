package controller

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"

	"github.com/gpupool/gpupool/internal/clock"
	"github.com/gpupool/gpupool/k8s/driver"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Defaults of the publisher and binder configuration.
const (
	// DefaultTenant is the broker tenant of the leases the binder takes.
	DefaultTenant = "k8s"
	// DefaultNodeSelectorLabel marks the nodes that can reach the pool
	// hosts; it must be "true".
	DefaultNodeSelectorLabel = "gpu.gpupool.dev/client"
	// DefaultResync is how often the publisher reads the pool even when no
	// lease changed: host status and device health have no watch.
	DefaultResync = 10 * time.Second
	// DefaultDebounce is how long the publisher gathers lease events
	// before it reads the pool again.
	DefaultDebounce = 200 * time.Millisecond
)

const mib = 1 << 20

// DefaultNodeSelector returns the node selector pools get by default:
// gpu.gpupool.dev/client=true.
func DefaultNodeSelector() map[string]string {
	return map[string]string{DefaultNodeSelectorLabel: "true"}
}

// PublisherConfig says what the publisher publishes.
type PublisherConfig struct {
	// Tenant is the binder's broker tenant: what its leases hold is
	// Kubernetes' own and stays in the published capacity. Empty means
	// DefaultTenant.
	Tenant string
	// NodeSelector is the labels a node needs to use the pool hosts' GPUs.
	// Empty means every node.
	NodeSelector map[string]string
	// Resync and Debounce default to DefaultResync and DefaultDebounce.
	Resync   time.Duration
	Debounce time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

func (c PublisherConfig) withDefaults() PublisherConfig {
	if c.Tenant == "" {
		c.Tenant = DefaultTenant
	}
	if c.Resync <= 0 {
		c.Resync = DefaultResync
	}
	if c.Debounce <= 0 {
		c.Debounce = DefaultDebounce
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// CheckPoolName says why a host id cannot name a ResourceSlice pool, or
// returns nil. Hosts whose id cannot are not published.
func CheckPoolName(hostID string) error {
	if msgs := validation.IsDNS1123Subdomain(hostID); len(msgs) > 0 {
		return fmt.Errorf("host id %q cannot name a Kubernetes resource pool: %s", hostID, strings.Join(msgs, "; "))
	}
	if len(hostID) > resourceapi.DeviceAttributeMaxValueLength {
		return fmt.Errorf("host id %q cannot be a device attribute: longer than %d characters", hostID, resourceapi.DeviceAttributeMaxValueLength)
	}
	return nil
}

// BuildResources is what Kubernetes should see of the pool: one pool per
// host whose id can name one (see CheckPoolName), named after the host,
// with one device per GPU, named after its UUID (see DeviceName), so that a
// GPU replaced at the same index is a new device beside the old one, which
// the brokers keep (unhealthy, so tainted) while leases hold it. Each device's capacity is its own
// less what leases of other tenants than cfg.Tenant hold of it (granted or
// releasing). Devices of draining, drained or down hosts and unhealthy
// devices carry a NoExecute taint, devices with nothing left a NoSchedule
// one. Every slice it returns passes the apiserver's validation.
func BuildResources(hosts []*gpupoolv1.Host, leases []*gpupoolv1.Lease, cfg PublisherConfig) *resourceslice.DriverResources {
	cfg = cfg.withDefaults()
	held := heldOutside(hosts, leases, cfg.Tenant)
	sel := nodeSelector(cfg.NodeSelector)
	out := &resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{}}
	for _, h := range hosts {
		if CheckPoolName(h.GetId()) != nil {
			continue
		}
		devs := slices.Clone(h.GetDevices())
		slices.SortStableFunc(devs, func(a, b *gpupoolv1.Device) int {
			return cmp.Or(cmp.Compare(a.GetIndex(), b.GetIndex()), strings.Compare(a.GetUuid(), b.GetUuid()))
		})
		domains := nvlinkDomains(devs)
		var devices []resourceapi.Device
		seen := map[string]bool{}
		for _, d := range devs {
			name := DeviceName(d.GetUuid())
			switch {
			case seen[name] || d.GetUuid() == "":
				continue // two UUIDs that differ only in case
			case len(d.GetUuid()) > resourceapi.DeviceAttributeMaxValueLength:
				continue // no attribute could name it to the binder
			}
			seen[name] = true
			dev := buildDevice(h, d, held[d.GetUuid()])
			topologyAttributes(&dev, h.GetId(), d.GetPcieRoot(), domains[d.GetUuid()])
			devices = append(devices, dev)
		}
		pool := resourceslice.Pool{Slices: []resourceslice.Slice{{}}}
		if sel == nil {
			pool.AllNodes = true
		} else {
			pool.NodeSelector = sel.DeepCopy()
		}
		// A slice with taints holds at most 64 devices.
		for chunk := range slices.Chunk(devices, resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures) {
			if len(pool.Slices[len(pool.Slices)-1].Devices) > 0 {
				pool.Slices = append(pool.Slices, resourceslice.Slice{})
			}
			pool.Slices[len(pool.Slices)-1].Devices = chunk
		}
		out.Pools[h.GetId()] = pool
	}
	return out
}

// usage is what leases hold of one device.
type usage struct {
	memoryMiB int64
	compute   int64
	exclusive bool
}

// heldOutside is, per device UUID, what leases of other tenants than
// tenant hold of it (granted or releasing). It is the larger of two
// readings: the other tenants' leases the controller can see, and the
// device's allocation less the tenant's own leases. A controller whose ACL
// token is scoped to its own tenant sees only its own leases, so the second
// reading is what keeps it from offering capacity other tenants hold.
func heldOutside(hosts []*gpupoolv1.Host, leases []*gpupoolv1.Lease, tenant string) map[string]usage {
	others, own := map[string]usage{}, map[string]usage{}
	for _, l := range leases {
		if s := l.GetState(); s != gpupoolv1.LeaseState_LEASE_STATE_GRANTED && s != gpupoolv1.LeaseState_LEASE_STATE_RELEASING {
			continue
		}
		sum := others
		if l.GetTenant() == tenant {
			sum = own
		}
		for _, s := range l.GetSlices() {
			u := sum[s.GetDevice()]
			u.memoryMiB += s.GetMemoryMib()
			u.compute += int64(s.GetComputePercent())
			u.exclusive = u.exclusive || s.GetExclusive()
			sum[s.GetDevice()] = u
		}
	}
	out := others
	for _, h := range hosts {
		for _, d := range h.GetDevices() {
			mine := own[d.GetUuid()]
			u := out[d.GetUuid()]
			u.memoryMiB = max(u.memoryMiB, d.GetAllocatedMemoryMib()-mine.memoryMiB)
			u.compute = max(u.compute, int64(d.GetAllocatedComputePercent())-mine.compute)
			u.exclusive = u.exclusive || (d.GetAllocatedExclusive() && !mine.exclusive)
			if u != (usage{}) {
				out[d.GetUuid()] = u
			}
		}
	}
	return out
}

// nodeSelector turns labels into a node selector of one term, or nil for
// none.
func nodeSelector(labels map[string]string) *corev1.NodeSelector {
	if len(labels) == 0 {
		return nil
	}
	var term corev1.NodeSelectorTerm
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		term.MatchExpressions = append(term.MatchExpressions, corev1.NodeSelectorRequirement{
			Key: k, Operator: corev1.NodeSelectorOpIn, Values: []string{labels[k]},
		})
	}
	return &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{term}}
}

// DeviceName is the name of the device with uuid in its pool: the UUID in
// lower case with every other character than a letter or digit as '-'
// ("GPU-8a1b..." is "gpu-8a1b..."), prefixed with "gpu-" unless it starts
// with "gpu-" or "mig-" already; or, when that is no DNS label (longer than
// 63 characters), "gpu-" and 16 hex digits of the UUID's SHA-256. UUIDs
// that differ only in case or punctuation get the same name.
func DeviceName(uuid string) string {
	b := []byte(strings.ToLower(uuid))
	for i, c := range b {
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9') {
			b[i] = '-'
		}
	}
	name := strings.Trim(string(b), "-")
	if !strings.HasPrefix(name, "gpu-") && !strings.HasPrefix(name, "mig-") {
		name = "gpu-" + name
	}
	if len(validation.IsDNS1123Label(name)) > 0 {
		sum := sha256.Sum256([]byte(uuid))
		name = "gpu-" + hex.EncodeToString(sum[:8])
	}
	return name
}

// nvlinkDomains names the NVLink island of each device of one host that has
// an NVLink peer, by UUID: "nvlink-<k>", numbered in the order of devs by
// their first device. An island is what NVLinks connect, directly or
// through other GPUs of the host; a link counts when either side reports
// it.
func nvlinkDomains(devs []*gpupoolv1.Device) map[string]string {
	byUUID := map[string]int{}
	for i, d := range devs {
		byUUID[d.GetUuid()] = i
	}
	parent := make([]int, len(devs))
	for i := range parent {
		parent[i] = i
	}
	var find func(int) int
	find = func(i int) int {
		if parent[i] != i {
			parent[i] = find(parent[i])
		}
		return parent[i]
	}
	linked := make([]bool, len(devs))
	for i, d := range devs {
		for _, p := range d.GetNvlinkPeers() {
			j, ok := byUUID[p]
			if !ok || j == i {
				continue
			}
			linked[i], linked[j] = true, true
			if a, b := find(i), find(j); a != b {
				parent[max(a, b)] = min(a, b)
			}
		}
	}
	out := map[string]string{}
	names := map[int]string{}
	for i, d := range devs {
		if !linked[i] {
			continue
		}
		r := find(i)
		if _, ok := names[r]; !ok {
			names[r] = fmt.Sprintf("nvlink-%d", len(names))
		}
		out[d.GetUuid()] = names[r]
	}
	return out
}

// topologyAttributes adds the PCIe root and NVLink domain of a device of
// host, qualified by the host so that no two hosts' compare equal; each
// only when known and short enough to be an attribute.
func topologyAttributes(dev *resourceapi.Device, host, root, domain string) {
	for name, v := range map[resourceapi.QualifiedName]string{driver.AttrPCIeRoot: root, driver.AttrNVLinkDomain: domain} {
		if v == "" {
			continue
		}
		if v = host + "/" + v; len(v) <= resourceapi.DeviceAttributeMaxValueLength {
			dev.Attributes[name] = resourceapi.DeviceAttribute{StringValue: ptr.To(v)}
		}
	}
}

func buildDevice(h *gpupoolv1.Host, d *gpupoolv1.Device, held usage) resourceapi.Device {
	memLeft := max(0, d.GetMemoryMib()-held.memoryMiB)
	computeLeft := max(0, 100-held.compute)
	if held.exclusive {
		memLeft, computeLeft = 0, 0
	}
	whole := resource.NewQuantity(d.GetMemoryMib()*mib, resource.BinarySI)
	compute := resource.NewQuantity(computeLeft, resource.DecimalSI)
	dev := resourceapi.Device{
		Name: DeviceName(d.GetUuid()),
		Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			driver.AttrModel: {StringValue: ptr.To(truncate(d.GetModel(), resourceapi.DeviceAttributeMaxValueLength))},
			driver.AttrUUID:  {StringValue: ptr.To(d.GetUuid())},
			driver.AttrHost:  {StringValue: ptr.To(h.GetId())},
			driver.AttrIndex: {IntValue: ptr.To(int64(d.GetIndex()))},
			driver.AttrMPS:   {BoolValue: ptr.To(h.GetMps())},
		},
		Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
			// Memory in steps of 1 MiB from 1 MiB, by default the whole GPU:
			// more than is left once anything else holds some of it.
			driver.CapacityMemory: {
				Value:         *resource.NewQuantity(memLeft*mib, resource.BinarySI),
				RequestPolicy: rangePolicy(memLeft*mib, whole, resource.MustParse("1Mi"), resource.MustParse("1Mi"), nil),
			},
			// Compute in steps of 1 from 1 to what is left of 100, by
			// default all of that.
			driver.CapacityCompute: {
				Value:         *compute,
				RequestPolicy: rangePolicy(computeLeft, compute, *resource.NewQuantity(1, resource.DecimalSI), *resource.NewQuantity(1, resource.DecimalSI), compute),
			},
		},
		AllowMultipleAllocations: ptr.To(true),
		BindingConditions:        []string{driver.ConditionLeased},
		BindingFailureConditions: []string{driver.ConditionLeaseFailed},
	}
	if d.GetMemoryMib() < 1 {
		// Without memory there is no default the policy could accept.
		dev.Capacity[driver.CapacityMemory] = resourceapi.DeviceCapacity{Value: dev.Capacity[driver.CapacityMemory].Value}
	}
	dev.Taints = deviceTaints(h, d, memLeft < 1 || computeLeft < 1)
	return dev
}

// rangePolicy is the request policy "from min in steps of step up to max
// (nil: no bound but value), by default def", less what the apiserver
// would refuse given value, what is left of the capacity: no policy when
// not even min is left, no step when min plus one step is not. max, when
// given, must not exceed value.
func rangePolicy(value int64, def *resource.Quantity, min, step resource.Quantity, max *resource.Quantity) *resourceapi.CapacityRequestPolicy {
	if value < min.Value() {
		return nil
	}
	r := &resourceapi.CapacityRequestPolicyRange{Min: &min}
	if max != nil {
		r.Max = ptr.To(max.DeepCopy())
	}
	if value >= min.Value()+step.Value() {
		r.Step = &step
	}
	return &resourceapi.CapacityRequestPolicy{Default: ptr.To(def.DeepCopy()), ValidRange: r}
}

// hostTaint is the taint of the devices of a host in each status.
var hostTaint = map[gpupoolv1.HostStatus]string{
	gpupoolv1.HostStatus_HOST_STATUS_DRAINING: driver.TaintDraining,
	gpupoolv1.HostStatus_HOST_STATUS_DRAINED:  driver.TaintDrained,
	gpupoolv1.HostStatus_HOST_STATUS_DOWN:     driver.TaintDown,
}

// deviceTaints are the taints of device d of host h; busy says nothing of
// it is left for Kubernetes.
func deviceTaints(h *gpupoolv1.Host, d *gpupoolv1.Device, busy bool) []resourceapi.DeviceTaint {
	var out []resourceapi.DeviceTaint
	if key, ok := hostTaint[h.GetStatus()]; ok {
		out = append(out, resourceapi.DeviceTaint{Key: key, Value: labelValue(h.GetStatusReason()), Effect: resourceapi.DeviceTaintEffectNoExecute})
	}
	if d.GetHealth() == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
		out = append(out, resourceapi.DeviceTaint{Key: driver.TaintUnhealthy, Value: labelValue(d.GetHealthReason()), Effect: resourceapi.DeviceTaintEffectNoExecute})
	}
	if busy {
		out = append(out, resourceapi.DeviceTaint{Key: driver.TaintBusy, Effect: resourceapi.DeviceTaintEffectNoSchedule})
	}
	return out
}

// labelValue turns a free-text reason ("no heartbeat for 10s") into a
// label value a taint can carry ("no-heartbeat-for-10s"): runs of other
// characters than letters, digits, '.', '_' and '-' become one '-', and it
// is cut to 63 characters that start and end with a letter or digit.
func labelValue(s string) string {
	var b strings.Builder
	dash := false
	for _, r := range s {
		ok := r < 128 && (r == '.' || r == '_' || r == '-' || ('a' <= r && r <= 'z') || ('A' <= r && r <= 'Z') || ('0' <= r && r <= '9'))
		switch {
		case ok:
			b.WriteRune(r)
			dash = false
		case !dash:
			b.WriteByte('-')
			dash = true
		}
	}
	v := b.String()
	if len(v) > validation.LabelValueMaxLength {
		v = v[:validation.LabelValueMaxLength]
	}
	v = strings.TrimFunc(v, func(r rune) bool { return r == '.' || r == '_' || r == '-' })
	if len(validation.IsValidLabelValue(v)) > 0 {
		return ""
	}
	return v
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// PoolSource is what the publisher reads of the brokers; the generated
// clients in *client.Client satisfy it.
type PoolSource struct {
	Pool  gpupoolv1.PoolServiceClient
	Lease gpupoolv1.LeaseServiceClient
}

// Publisher mirrors the pool into ResourceSlices (see BuildResources): it
// reads the pool when leases change, at most every Debounce, and every
// Resync.
type Publisher struct {
	kube kubernetes.Interface
	src  PoolSource
	cfg  PublisherConfig
	log  *slog.Logger
}

// NewPublisher returns a publisher that reads the pool from src and
// publishes it with kube.
func NewPublisher(kube kubernetes.Interface, src PoolSource, cfg PublisherConfig) *Publisher {
	cfg = cfg.withDefaults()
	return &Publisher{kube: kube, src: src, cfg: cfg, log: cfg.Logger.With("component", "publisher")}
}

// callTimeout bounds one call to the brokers: the client retries an
// unavailable broker until the call's deadline.
const callTimeout = 10 * time.Second

// Run publishes until ctx ends. The first publication waits for the first
// read of the pool, so that a controller that cannot reach the brokers
// does not withdraw the pools of a running one; later failures keep the
// last publication. The ResourceSlices stay when Run returns.
func (p *Publisher) Run(ctx context.Context) error {
	var (
		res   *resourceslice.DriverResources
		err   error
		retry = newBackoff(100*time.Millisecond, 5*time.Second)
	)
	for {
		if res, err = p.read(ctx); err == nil {
			break
		}
		p.log.Warn("cannot read the pool from the brokers; retrying", "err", err, "retry_in", retry.peek())
		if !clock.Sleep(ctx, clock.Real, retry.next()) {
			return nil
		}
	}
	ctrl, err := resourceslice.StartController(ctx, resourceslice.Options{
		DriverName: driver.Name,
		KubeClient: p.kube,
		Resources:  res,
		ErrorHandler: func(_ context.Context, err error, msg string) {
			p.log.Error("publishing ResourceSlices failed; retrying", "what", msg, "err", err)
		},
	})
	if err != nil {
		return fmt.Errorf("publisher: %w", err)
	}
	defer ctrl.Stop()
	p.log.Info("publishing pools", "pools", len(res.Pools))

	changed := make(chan struct{}, 1)
	go p.watchLeases(ctx, changed)
	tick := time.NewTicker(p.cfg.Resync)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		case <-changed:
			if !clock.Sleep(ctx, clock.Real, p.cfg.Debounce) {
				return nil
			}
			select { // events during the wait are in this read
			case <-changed:
			default:
			}
		}
		res, err := p.read(ctx)
		if err != nil {
			if ctx.Err() == nil {
				p.log.Warn("cannot read the pool from the brokers; keeping the last publication", "err", err)
			}
			continue
		}
		ctrl.Update(res)
	}
}

// read lists hosts and leases and builds what to publish.
func (p *Publisher) read(ctx context.Context) (*resourceslice.DriverResources, error) {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	// Hosts and leases are two reads of a state that moves between them.
	// The leases are read on both sides of the hosts, so that what the
	// publisher subtracts from a GPU's allocation as its own is only what
	// was its own all along: see stableLeases.
	listLeases := func() ([]*gpupoolv1.Lease, error) {
		resp, err := p.src.Lease.List(ctx, &gpupoolv1.ListLeasesRequest{
			States: []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_GRANTED, gpupoolv1.LeaseState_LEASE_STATE_RELEASING},
		})
		if err != nil {
			return nil, fmt.Errorf("list leases: %w", err)
		}
		return resp.GetLeases(), nil
	}
	before, err := listLeases()
	if err != nil {
		return nil, err
	}
	hosts, err := p.src.Pool.ListHosts(ctx, &gpupoolv1.ListHostsRequest{})
	if err != nil {
		return nil, fmt.Errorf("list hosts: %w", err)
	}
	after, err := listLeases()
	if err != nil {
		return nil, err
	}
	for _, h := range hosts.GetHosts() {
		if err := CheckPoolName(h.GetId()); err != nil {
			p.log.Debug("host not published", "host", h.GetId(), "err", err)
		}
	}
	return BuildResources(hosts.GetHosts(), stableLeases(before, after, p.cfg.Tenant), p.cfg), nil
}

// stableLeases merges two readings of the leases taken before and after
// the hosts were read, so that heldOutside never counts other tenants'
// use too low: the tenant's own leases only when in both readings (one
// granted or ended in between may or may not be in the hosts' allocation,
// and subtracting it could hide another tenant's use), and other tenants'
// leases when in either (counting one too many only offers less).
func stableLeases(before, after []*gpupoolv1.Lease, tenant string) []*gpupoolv1.Lease {
	inBefore := map[string]bool{}
	for _, l := range before {
		inBefore[l.GetId()] = true
	}
	var out []*gpupoolv1.Lease
	seen := map[string]bool{}
	for _, l := range after {
		seen[l.GetId()] = true
		if l.GetTenant() != tenant || inBefore[l.GetId()] {
			out = append(out, l)
		}
	}
	for _, l := range before {
		if !seen[l.GetId()] && l.GetTenant() != tenant {
			out = append(out, l)
		}
	}
	return out
}

// watchLeases signals changed on every lease event until ctx ends,
// watching again after a broken stream.
func (p *Publisher) watchLeases(ctx context.Context, changed chan<- struct{}) {
	retry := newBackoff(100*time.Millisecond, 5*time.Second)
	for ctx.Err() == nil {
		got, err := p.watchOnce(ctx, changed)
		if ctx.Err() != nil {
			return
		}
		if got {
			retry.reset()
		}
		p.log.Debug("lease watch broken; watching again", "err", err, "retry_in", retry.peek())
		clock.Sleep(ctx, clock.Real, retry.next())
	}
}

// watchOnce runs one Watch stream; got says whether it carried an event.
func (p *Publisher) watchOnce(ctx context.Context, changed chan<- struct{}) (got bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := p.src.Lease.Watch(ctx, &gpupoolv1.WatchLeasesRequest{})
	if err != nil {
		return false, err
	}
	for {
		if _, err := stream.Recv(); err != nil {
			return got, err
		}
		got = true
		select {
		case changed <- struct{}{}:
		default:
		}
	}
}

// backoff is a doubling delay between attempts.
type backoff struct{ cur, min, max time.Duration }

func newBackoff(min, max time.Duration) *backoff { return &backoff{cur: min, min: min, max: max} }

func (b *backoff) peek() time.Duration { return b.cur }
func (b *backoff) reset()              { b.cur = b.min }
func (b *backoff) next() time.Duration {
	d := b.cur
	b.cur = min(2*b.cur, b.max)
	return d
}
