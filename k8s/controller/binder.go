package controller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/retry"
	"k8s.io/client-go/util/workqueue"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/clock"
	"github.com/gpupool/gpupool/k8s/driver"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// DefaultLeaseTTL is the TTL of the binder's leases. The binder renews
// them, and so does the node plugin of a pod that uses one.
const DefaultLeaseTTL = 60 * time.Second

// Reasons of the conditions the binder sets and of the events it sends.
const (
	ReasonLeaseGranted = "LeaseGranted"
	// ReasonLeaseEnded: the lease of a device ended (released, expired,
	// revoked or lost) while the claim was still allocated.
	ReasonLeaseEnded = "LeaseEnded"
	// ReasonDeviceNotPublished: the allocated device is in no ResourceSlice
	// any more, so the binder cannot tell which GPU it is.
	ReasonDeviceNotPublished = "DeviceNotPublished"
	// ReasonWaitingForOtherShares: this share of a GPU is leased, but
	// another share of the same GPU in the claim has no outcome yet. The
	// scheduler reads one status entry per device for all its shares, so
	// Leased=True waits until every share has its lease or has failed.
	ReasonWaitingForOtherShares = "WaitingForOtherShares"
	// ReasonBrokerError: the brokers failed the lease request several times
	// in a row with an error that is neither a refusal nor unavailability.
	// The binder keeps trying; the claim is not failed.
	ReasonBrokerError = "BrokerError"
)

// Broker is what the binder needs of the brokers. BrokerClient adapts a
// *client.Client; tests use a fake.
type Broker interface {
	// Acquire grants the lease req asks for, or returns the lease an
	// earlier Acquire of the same tenant and request id got, in whatever
	// state that lease is now. A granted lease renews itself until it is
	// released or closed. A refusal is a gRPC status error with code
	// InvalidArgument, FailedPrecondition, ResourceExhausted,
	// AlreadyExists, PermissionDenied, Unauthenticated or Unimplemented;
	// any other error may pass.
	Acquire(ctx context.Context, req *gpupoolv1.LeaseRequest) (HeldLease, error)
	// Attach renews a granted lease from this process, as Acquire does; it
	// fails when the lease has ended.
	Attach(ctx context.Context, leaseID string) (HeldLease, error)
	// Leases lists the granted leases of tenant.
	Leases(ctx context.Context, tenant string) ([]*gpupoolv1.Lease, error)
	// Release ends a lease this process does not hold. Releasing an
	// unknown or ended lease is not an error.
	Release(ctx context.Context, leaseID, reason string) error
}

// HeldLease is a lease that renews itself; *client.Lease is one.
type HeldLease interface {
	// Info is the lease as the brokers last described it.
	Info() *gpupoolv1.Lease
	// Token is the current token and agent address for one host.
	Token(host string) (*gpupoolv1.HostToken, bool)
	// Events carries what happens to the lease and is closed once Done is.
	Events() <-chan *gpupoolv1.LeaseEvent
	// Done is closed when the lease is no longer renewed; Err says why.
	Done() <-chan struct{}
	Err() error
	// Release stops renewing and ends the lease.
	Release(ctx context.Context, reason string) error
	// Close stops renewing without ending the lease.
	Close()
}

// BrokerClient adapts c to Broker.
func BrokerClient(c *client.Client) Broker { return brokerClient{c} }

type brokerClient struct{ c *client.Client }

func (b brokerClient) Acquire(ctx context.Context, req *gpupoolv1.LeaseRequest) (HeldLease, error) {
	l, err := b.c.Acquire(ctx, req)
	if err != nil {
		return nil, err
	}
	return l, nil
}

func (b brokerClient) Attach(ctx context.Context, leaseID string) (HeldLease, error) {
	l, err := b.c.Attach(ctx, leaseID)
	if err != nil {
		return nil, err
	}
	return l, nil
}

func (b brokerClient) Leases(ctx context.Context, tenant string) ([]*gpupoolv1.Lease, error) {
	resp, err := b.c.Lease.List(ctx, &gpupoolv1.ListLeasesRequest{
		Tenant: tenant, States: []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_GRANTED},
	})
	return resp.GetLeases(), err
}

func (b brokerClient) Release(ctx context.Context, leaseID, reason string) error {
	_, err := b.c.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: leaseID, Reason: reason})
	if status.Code(err) == codes.NotFound {
		return nil
	}
	return err
}

// BinderConfig configures a Binder.
type BinderConfig struct {
	// Tenant of the leases; empty means DefaultTenant. The binder takes
	// every granted lease of the tenant whose request id starts with a
	// claim UID for its own.
	Tenant string
	// LeaseTTL defaults to DefaultLeaseTTL.
	LeaseTTL time.Duration
	// Workers is how many claims are handled at once; default 8.
	Workers int
	// Recorder sends the events on pods; nil sends them through the
	// binder's clientset.
	Recorder record.EventRecorder
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

func (c BinderConfig) withDefaults() BinderConfig {
	if c.Tenant == "" {
		c.Tenant = DefaultTenant
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.Workers <= 0 {
		c.Workers = 8
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Binder turns every device allocated from gpu.gpupool.dev in a
// ResourceClaim into a broker lease for exactly that GPU and the capacity
// the claim consumes of it, and reports the outcome in the claim's
// status.devices[]:
//   - granted: Leased=True, with driver.DeviceStatusData;
//   - refused by the brokers (or ended before the claim could use it):
//     LeaseFailed=True with the brokers' message, so that the scheduler
//     allocates the claim again;
//   - ended while allocated: Leased=False and LeaseFailed=True, reason
//     LeaseEnded, and a Warning event on each pod the claim is reserved for.
//
// Brokers that cannot be reached are retried with backoff, never reported
// as LeaseFailed; other broker errors are too, and once a request failed
// brokerErrorReports times in a row its device says Leased=False, reason
// BrokerError. While one share of a GPU has no outcome yet, the other
// shares of that GPU in the claim say Leased=False, reason
// WaitingForOtherShares, since the scheduler reads one of them for all.
// The binder renews its leases and releases them once the claim is
// deallocated or deleted.
//
// The request id of a lease is "<claim UID>/<shareID>" ("<claim
// UID>/<pool>/<device>" for a result without shareID), so a retried or
// restarted binder gets the same lease back.
type Binder struct {
	kube   kubernetes.Interface
	broker Broker
	cfg    BinderConfig
	log    *slog.Logger
	queue  workqueue.TypedRateLimitingInterface[string]

	claimFactory informers.SharedInformerFactory
	sliceFactory informers.SharedInformerFactory
	claims       resourcelisters.ResourceClaimLister
	claimsSynced cache.InformerSynced
	slices       cache.Indexer
	slicesSynced cache.InformerSynced

	mu     sync.Mutex
	held   map[string]*heldClaim                // guarded by mu; by claim key namespace/name
	failed map[string]map[string]*failureCounts // guarded by mu; by claim key, then request id
	// ended remembers, while the device stays allocated, the leases that
	// ended under a claim: a sync that reads the claim before its status
	// says so neither acquires again nor warns the pods twice.
	ended map[string]map[string]*endedLease // guarded by mu; by claim key, then request id

	// followers are the goroutines keep starts, one per held lease. Each
	// ends when its lease stops renewing or the context it was kept under
	// ends; Run returns only once all have.
	followers sync.WaitGroup
}

// failureCounts counts, for one request id, the syncs in a row that failed
// for each failureKind.
type failureCounts [numFailureKinds]int

type failureKind int

const (
	// brokerFailure: Acquire failed with neither a refusal nor
	// unavailability.
	brokerFailure failureKind = iota
	// unpublishedFailure: the device is in no ResourceSlice the binder has
	// seen.
	unpublishedFailure
	numFailureKinds
)

// heldClaim is the leases held for one claim. Only the worker handling
// the claim's key touches it (the work queue hands a key to one worker at
// a time), or Run before and after the workers.
type heldClaim struct {
	uid    types.UID
	leases map[string]HeldLease // by request id
}

// NewBinder returns a binder that watches claims and slices through kube
// and takes leases from broker.
func NewBinder(kube kubernetes.Interface, broker Broker, cfg BinderConfig) *Binder {
	cfg = cfg.withDefaults()
	b := &Binder{
		kube:   kube,
		broker: broker,
		cfg:    cfg,
		log:    cfg.Logger.With("component", "binder"),
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](100*time.Millisecond, 30*time.Second),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "gpupool_claims"},
		),
		held:   map[string]*heldClaim{},
		failed: map[string]map[string]*failureCounts{},
		ended:  map[string]map[string]*endedLease{},
	}
	b.claimFactory = informers.NewSharedInformerFactory(kube, 10*time.Minute)
	claims := b.claimFactory.Resource().V1().ResourceClaims()
	b.claims = claims.Lister()
	b.claimsSynced = claims.Informer().HasSynced
	_, _ = claims.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { b.enqueueIf(obj, ours(obj)) },
		UpdateFunc: func(old, obj any) {
			b.enqueueIf(obj, ours(old) || ours(obj))
		},
		DeleteFunc: func(obj any) {
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = t.Obj
			}
			b.enqueueIf(obj, true)
		},
	})

	b.sliceFactory = informers.NewSharedInformerFactoryWithOptions(kube, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector(resourceapi.ResourceSliceSelectorDriver, driver.Name).String()
	}))
	slices := b.sliceFactory.Resource().V1().ResourceSlices().Informer()
	_ = slices.AddIndexers(cache.Indexers{poolIndex: func(obj any) ([]string, error) {
		s, ok := obj.(*resourceapi.ResourceSlice)
		if !ok || s.Spec.Driver != driver.Name {
			return nil, nil
		}
		return []string{s.Spec.Pool.Name}, nil
	}})
	b.slices = slices.GetIndexer()
	b.slicesSynced = slices.HasSynced
	return b
}

const poolIndex = "pool"

func (b *Binder) enqueueIf(obj any, ok bool) {
	if !ok {
		return
	}
	if key, err := cache.MetaNamespaceKeyFunc(obj); err == nil {
		b.queue.Add(key)
	}
}

// ours reports whether obj is a claim with a device of this driver
// allocated.
func ours(obj any) bool {
	c, ok := obj.(*resourceapi.ResourceClaim)
	return ok && len(driver.Results(c)) > 0
}

// RequestID is the request id of the lease for result r of the claim
// with uid: "<uid>/<shareID>", or "<uid>/<pool>/<device>" for a result
// without shareID (device names are unique only within a pool). Either
// way the claim UID comes before the first '/'.
func RequestID(uid types.UID, r resourceapi.DeviceRequestAllocationResult) string {
	if r.ShareID != nil {
		return string(uid) + "/" + string(*r.ShareID)
	}
	return string(uid) + "/" + r.Pool + "/" + r.Device
}

// Run binds until ctx ends. It waits for the informers, releases the
// tenant's leases whose claim is gone and takes over the others, then
// handles claims. When it returns it has stopped renewing its leases
// without releasing them, for the next binder to take over.
func (b *Binder) Run(ctx context.Context) error {
	if b.cfg.Recorder == nil {
		bc := record.NewBroadcaster(record.WithContext(ctx))
		bc.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: b.kube.CoreV1().Events("")})
		defer bc.Shutdown()
		b.cfg.Recorder = bc.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "gpupool-k8s-controller"})
	}
	b.claimFactory.Start(ctx.Done())
	b.sliceFactory.Start(ctx.Done())
	defer b.sliceFactory.Shutdown()
	defer b.claimFactory.Shutdown()
	defer b.queue.ShutDown()
	if !cache.WaitForCacheSync(ctx.Done(), b.claimsSynced, b.slicesSynced) {
		return nil
	}

	wait := newBackoff(100*time.Millisecond, 5*time.Second)
	for {
		err := b.adopt(ctx)
		if err == nil {
			break
		}
		b.log.Warn("cannot take over the leases of an earlier binder; retrying", "err", err, "retry_in", wait.peek())
		if !clock.Sleep(ctx, clock.Real, wait.next()) {
			b.closeAll()
			return nil
		}
	}

	var wg sync.WaitGroup
	for range b.cfg.Workers {
		wg.Go(func() {
			for b.processNext(ctx) {
			}
		})
	}
	b.log.Info("binding claims", "tenant", b.cfg.Tenant, "workers", b.cfg.Workers)
	<-ctx.Done()
	b.queue.ShutDown()
	wg.Wait()
	b.closeAll()
	return nil
}

// closeAll stops renewing every held lease and waits until no goroutine
// follows one.
func (b *Binder) closeAll() {
	b.mu.Lock()
	for key, cl := range b.held {
		for _, l := range cl.leases {
			l.Close()
		}
		delete(b.held, key)
	}
	b.mu.Unlock()
	b.followers.Wait()
}

// adopt goes through the tenant's granted leases once the informers have
// synced: it takes over those of a device still allocated to their claim,
// and releases those of claims that are gone or no longer allocated that
// device.
//
// Only the list must succeed. A lease it cannot release is renewed by
// nobody and expires; one it cannot take over is acquired again, with the
// same request id, by its claim's sync.
func (b *Binder) adopt(ctx context.Context) error {
	lctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	leases, err := b.broker.Leases(lctx, b.cfg.Tenant)
	if err != nil {
		return fmt.Errorf("list leases of tenant %s: %w", b.cfg.Tenant, err)
	}
	claims, err := b.claims.List(labels.Everything())
	if err != nil {
		return err
	}
	allocated := map[string]string{} // request id -> claim key
	for _, c := range claims {
		for _, r := range driver.Results(c) {
			allocated[RequestID(c.UID, r)] = c.Namespace + "/" + c.Name
		}
	}
	for _, l := range leases {
		uid, _, ok := strings.Cut(l.GetRequestId(), "/")
		if !ok || uuid.Validate(uid) != nil {
			continue // not the binder's
		}
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		key, ok := allocated[l.GetRequestId()]
		if !ok {
			err := b.broker.Release(cctx, l.GetId(), "its Kubernetes claim is gone or no longer allocated this device")
			cancel()
			if err != nil {
				b.log.Warn("cannot release a lease whose claim is gone; it expires unrenewed", "lease", l.GetId(), "err", err)
				continue
			}
			b.log.Info("released a lease whose claim is gone", "lease", l.GetId(), "request_id", l.GetRequestId())
			continue
		}
		if b.holds(key, l.GetRequestId()) {
			cancel()
			continue
		}
		hl, err := b.broker.Attach(cctx, l.GetId())
		cancel()
		if err != nil {
			if !errors.Is(err, client.ErrLeaseEnded) && status.Code(err) != codes.NotFound {
				b.log.Warn("cannot take over a lease; its claim's sync acquires it again", "lease", l.GetId(), "claim", key, "err", err)
			}
			continue // an ended one is found by the claim's sync too
		}
		b.keep(ctx, key, types.UID(uid), l.GetRequestId(), hl)
		b.log.Info("took over lease", "lease", l.GetId(), "claim", key)
	}
	return nil
}

func (b *Binder) holds(key, requestID string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	cl := b.held[key]
	return cl != nil && cl.leases[requestID] != nil
}

// keep records l as held for the claim and, until l stops renewing or
// ctx (the binder's lifetime) ends, passes l's events on and enqueues the
// claim when l ends.
func (b *Binder) keep(ctx context.Context, key string, uid types.UID, requestID string, l HeldLease) {
	b.mu.Lock()
	cl := b.held[key]
	if cl == nil {
		cl = &heldClaim{uid: uid, leases: map[string]HeldLease{}}
		b.held[key] = cl
	}
	cl.leases[requestID] = l
	b.mu.Unlock()
	b.followers.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case ev, ok := <-l.Events():
				if !ok {
					// Renewal stopped: released or closed here, or ended.
					b.queue.Add(key)
					return
				}
				b.onLeaseEvent(key, l, ev)
			}
		}
	})
}

// onLeaseEvent passes what happens to a lease on to the pods that use it.
func (b *Binder) onLeaseEvent(key string, l HeldLease, ev *gpupoolv1.LeaseEvent) {
	var reason string
	switch ev.GetType() {
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_VIOLATION:
		reason = "LeaseViolation"
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_DEVICE_UNHEALTHY:
		reason = "DeviceUnhealthy"
	default:
		return
	}
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	claim, err := b.claims.ResourceClaims(ns).Get(name)
	if err != nil {
		return
	}
	b.log.Warn("lease event", "lease", l.Info().GetId(), "claim", key, "type", ev.GetType().String(), "message", ev.GetMessage())
	b.eventOnPods(claim, reason, fmt.Sprintf("gpupool lease %s of claim %s: %s", l.Info().GetId(), name, ev.GetMessage()))
}

// heldFor returns the leases held for key, or nil.
func (b *Binder) heldFor(key string) *heldClaim {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.held[key]
}

// drop forgets lease requestID of key, which ended.
func (b *Binder) drop(key, requestID string) {
	if cl := b.heldFor(key); cl != nil {
		delete(cl.leases, requestID)
	}
}

// countFailure counts one more failure of kind for request id of key, and
// returns how many there were in a row.
func (b *Binder) countFailure(key, id string, kind failureKind) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	byID := b.failed[key]
	if byID == nil {
		byID = map[string]*failureCounts{}
		b.failed[key] = byID
	}
	c := byID[id]
	if c == nil {
		c = &failureCounts{}
		byID[id] = c
	}
	c[kind]++
	return c[kind]
}

// resetFailures ends the run of failures of kind for request id of key.
func (b *Binder) resetFailures(key, id string, kind failureKind) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if c := b.failed[key][id]; c != nil {
		c[kind] = 0
		if *c == (failureCounts{}) {
			delete(b.failed[key], id)
		}
	}
	if len(b.failed[key]) == 0 {
		delete(b.failed, key)
	}
}

// pruneFailures forgets the failures of key's request ids that want does
// not have (all of them for a nil want).
func (b *Binder) pruneFailures(key string, want map[string]bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for id := range b.ended[key] {
		if !want[id] {
			delete(b.ended[key], id)
		}
	}
	if len(b.ended[key]) == 0 {
		delete(b.ended, key)
	}
	for id := range b.failed[key] {
		if !want[id] {
			delete(b.failed[key], id)
		}
	}
	if len(b.failed[key]) == 0 {
		delete(b.failed, key)
	}
}

// endedLease is the outcome of a lease that ended under its claim, and
// whether its pods were told.
type endedLease struct {
	o        outcome
	notified bool
}

// recordEnded remembers that lease id of key ended with outcome o.
func (b *Binder) recordEnded(key, id string, o outcome) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ended[key] == nil {
		b.ended[key] = map[string]*endedLease{}
	}
	if b.ended[key][id] == nil {
		b.ended[key][id] = &endedLease{o: o}
	}
}

// endedOutcome returns the outcome of lease id of key if it ended.
func (b *Binder) endedOutcome(key, id string) *outcome {
	b.mu.Lock()
	defer b.mu.Unlock()
	if e := b.ended[key][id]; e != nil {
		o := e.o
		return &o
	}
	return nil
}

// notifyOnce reports whether the pods of key still need to be told that
// lease id ended, and records that they are.
func (b *Binder) notifyOnce(key, id string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	e := b.ended[key][id]
	if e == nil {
		return true
	}
	first := !e.notified
	e.notified = true
	return first
}

// forget drops the record of key once it holds no lease.
func (b *Binder) forget(key string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if cl := b.held[key]; cl != nil && len(cl.leases) == 0 {
		delete(b.held, key)
	}
}

func (b *Binder) processNext(ctx context.Context) bool {
	key, shutdown := b.queue.Get()
	if shutdown {
		return false
	}
	defer b.queue.Done(key)
	if err := b.sync(ctx, key); err != nil {
		if ctx.Err() == nil {
			b.log.Warn("claim not bound yet; retrying", "claim", key, "err", err, "retries", b.queue.NumRequeues(key))
		}
		b.queue.AddRateLimited(key)
		return true
	}
	b.queue.Forget(key)
	return true
}

// outcome is what the binder has to say about one allocated device.
type outcome struct {
	lease   HeldLease // granted and renewed: Leased=True
	reason  string    // not leased: the condition reason, e.g. ResourceExhausted or LeaseEnded
	message string
	// waiting: not leased yet but not failed either, e.g. BrokerError:
	// Leased=False alone, without LeaseFailed.
	waiting bool
	// held: with reason LeaseEnded, the lease ended while this binder
	// held it for the claim, so its pods may have used it and are told,
	// even when the claim read from the cache does not show Leased=True
	// yet.
	held bool
}

// settled reports whether o ends the wait for its device: it was leased
// or it failed.
func (o outcome) settled() bool { return o.lease != nil || !o.waiting }

// sync brings the leases of one claim and its status.devices[] in line
// with its allocation.
func (b *Binder) sync(ctx context.Context, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil
	}
	claim, err := b.claims.ResourceClaims(ns).Get(name)
	if apierrors.IsNotFound(err) {
		b.pruneFailures(key, nil)
		return b.releaseAll(ctx, key, fmt.Sprintf("Kubernetes claim %s was deleted", key))
	}
	if err != nil {
		return err
	}
	if cl := b.heldFor(key); cl != nil && cl.uid != claim.UID {
		if err := b.releaseAll(ctx, key, fmt.Sprintf("Kubernetes claim %s was deleted", key)); err != nil {
			return err
		}
	}
	results := driver.Results(claim)
	if len(results) == 0 {
		b.pruneFailures(key, nil)
		return b.releaseAll(ctx, key, fmt.Sprintf("Kubernetes claim %s was deallocated", key))
	}

	// Leases of devices the claim no longer has allocated go first.
	want := map[string]bool{}
	for _, r := range results {
		want[RequestID(claim.UID, r)] = true
	}
	b.pruneFailures(key, want)
	var errs []error
	if cl := b.heldFor(key); cl != nil {
		for id, l := range cl.leases {
			if !want[id] {
				if err := b.release(ctx, l, fmt.Sprintf("Kubernetes claim %s no longer has this device allocated", key)); err != nil {
					errs = append(errs, err)
					continue
				}
				delete(cl.leases, id)
			}
		}
	}

	outcomes := map[string]outcome{}
	for _, r := range results {
		o, err := b.ensure(ctx, key, claim, r)
		if err != nil {
			errs = append(errs, err)
		}
		if o != nil {
			outcomes[RequestID(claim.UID, r)] = *o
		}
	}
	if err := b.writeStatus(ctx, claim, outcomes); err != nil {
		errs = append(errs, err)
	}
	b.forget(key)
	return errors.Join(errs...)
}

// ensure makes sure result r of claim has a lease, or says why not. It
// returns no outcome when there is nothing new to say: the device's status
// says it already, or the claim is to be tried again (err) before the
// device's status changes. An outcome with an error is reported, and the
// claim tried again too.
func (b *Binder) ensure(ctx context.Context, key string, claim *resourceapi.ResourceClaim, r resourceapi.DeviceRequestAllocationResult) (*outcome, error) {
	id := RequestID(claim.UID, r)
	if cl := b.heldFor(key); cl != nil {
		if l := cl.leases[id]; l != nil {
			select {
			case <-l.Done():
				return b.reattach(ctx, key, claim.UID, id, l)
			default:
				return &outcome{lease: l}, nil
			}
		}
	}
	if o := b.endedOutcome(key, id); o != nil {
		return o, nil // it ended under the claim: no other lease for this allocation
	}
	if ds := driver.DeviceStatus(claim, r); ds != nil && meta.IsStatusConditionTrue(ds.Conditions, driver.ConditionLeaseFailed) {
		return nil, nil // wait for the scheduler to allocate the claim again
	}
	req, o := b.leaseRequest(claim, r)
	if o != nil {
		if b.countFailure(key, id, unpublishedFailure) <= unpublishedRetries {
			// The slice informer may lag behind the scheduler's.
			return nil, errors.New(o.message)
		}
		b.resetFailures(key, id, unpublishedFailure)
		return o, nil
	}
	b.resetFailures(key, id, unpublishedFailure)
	actx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	l, err := b.broker.Acquire(actx, req)
	if err != nil {
		st := status.Convert(err)
		switch {
		case refused(err):
			b.resetFailures(key, id, brokerFailure)
			b.log.Info("brokers refused the lease", "claim", key, "device", r.Pool+"/"+r.Device, "code", st.Code().String(), "message", st.Message())
			return &outcome{reason: st.Code().String(), message: st.Message()}, nil
		case unavailable(err):
			return nil, fmt.Errorf("acquire lease %s: %w", id, err)
		}
		n := b.countFailure(key, id, brokerFailure)
		err = fmt.Errorf("acquire lease %s: %w", id, err)
		ds := driver.DeviceStatus(claim, r)
		if n < brokerErrorReports || (ds != nil && meta.IsStatusConditionTrue(ds.Conditions, driver.ConditionLeased)) {
			// A device already leased keeps saying so: its pod may run
			// with the lease, which the node plugin renews.
			return nil, err
		}
		return &outcome{waiting: true, reason: ReasonBrokerError,
			message: fmt.Sprintf("the brokers keep failing the lease request; retrying: %s: %s", st.Code(), st.Message())}, err
	}
	b.resetFailures(key, id, brokerFailure)
	if info := l.Info(); info.GetState() != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		// The request id names a lease that ended: this allocation cannot
		// get another one.
		l.Close()
		o := outcome{reason: ReasonLeaseEnded, message: endMessage(info, nil)}
		b.recordEnded(key, id, o)
		return &o, nil
	}
	b.keep(ctx, key, claim.UID, id, l)
	b.log.Info("lease granted", "claim", key, "device", r.Pool+"/"+r.Device, "lease", l.Info().GetId())
	return &outcome{lease: l}, nil
}

// reattach follows up on held lease l whose renewal stopped. This process
// may merely have lost touch with the brokers for longer than the TTL
// while the node plugin kept the lease alive, so only the brokers can say
// it ended.
func (b *Binder) reattach(ctx context.Context, key string, uid types.UID, id string, l HeldLease) (*outcome, error) {
	actx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	info := l.Info()
	nl, err := b.broker.Attach(actx, info.GetId())
	switch {
	case err == nil:
		b.keep(ctx, key, uid, id, nl)
		b.log.Info("renewing lease again", "claim", key, "lease", info.GetId(), "renewal_stopped_by", l.Err())
		return &outcome{lease: nl}, nil
	case errors.Is(err, client.ErrLeaseEnded) || status.Code(err) == codes.NotFound:
		o := outcome{reason: ReasonLeaseEnded, message: endMessage(info, l.Err()), held: true}
		b.recordEnded(key, id, o)
		b.drop(key, id)
		b.log.Warn("lease ended under its claim", "claim", key, "lease", info.GetId(), "err", err)
		return &o, nil
	}
	return nil, fmt.Errorf("renew lease %s again: %w", info.GetId(), err)
}

// unpublishedRetries is how many times a device no ResourceSlice has is
// tried again before it is reported as LeaseFailed.
const unpublishedRetries = 3

// brokerErrorReports is how many times in a row a lease request fails with
// neither a refusal nor unavailability before its device says
// Leased=False, reason BrokerError.
const brokerErrorReports = 5

// refused reports whether err is the brokers saying no, as opposed to
// not answering.
func refused(err error) bool {
	switch status.Code(err) {
	case codes.InvalidArgument, codes.FailedPrecondition, codes.ResourceExhausted, codes.AlreadyExists,
		codes.PermissionDenied, codes.Unauthenticated, codes.Unimplemented:
		return true
	}
	return false
}

// unavailable reports whether err is the brokers not answering (yet),
// which is retried without saying so in the claim.
func unavailable(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return true
	}
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Aborted, codes.Canceled:
		return true
	}
	return false
}

func endMessage(l *gpupoolv1.Lease, err error) string {
	msg := fmt.Sprintf("lease %s ended", l.GetId())
	if s := l.GetState(); s != gpupoolv1.LeaseState_LEASE_STATE_GRANTED && s != gpupoolv1.LeaseState_LEASE_STATE_UNSPECIFIED {
		msg = fmt.Sprintf("lease %s is %s", l.GetId(), protocol.EnumLabel(s))
	}
	if l.GetReason() != "" {
		msg += ": " + l.GetReason()
	} else if err != nil {
		msg += ": " + err.Error()
	}
	return msg
}

// leaseRequest is the request for result r of claim, or, when the device
// cannot be found among the published ones, why there is none.
func (b *Binder) leaseRequest(claim *resourceapi.ResourceClaim, r resourceapi.DeviceRequestAllocationResult) (*gpupoolv1.LeaseRequest, *outcome) {
	dev := b.publishedDevice(r.Pool, r.Device)
	if dev == nil || dev.Attributes[driver.AttrUUID].StringValue == nil {
		return nil, &outcome{reason: ReasonDeviceNotPublished,
			message: fmt.Sprintf("device %s of pool %s is not published by %s any more; its host may have left the pool", r.Device, r.Pool, driver.Name)}
	}
	req := &gpupoolv1.LeaseRequest{
		Count:       1,
		Constraints: &gpupoolv1.Constraints{Host: r.Pool, Devices: []string{*dev.Attributes[driver.AttrUUID].StringValue}},
		TtlMs:       b.cfg.LeaseTTL.Milliseconds(),
		RequestId:   RequestID(claim.UID, r),
		Tenant:      b.cfg.Tenant,
		Holder:      holder(claim),
		Topology:    pinnedTopology(claim, r),
	}
	whole := wholeMemory(dev)
	mem, okMem := r.ConsumedCapacity[driver.CapacityMemory]
	compute, okCompute := r.ConsumedCapacity[driver.CapacityCompute]
	if !okMem && !okCompute {
		req.Exclusive = true // nothing consumed in part: the device was allocated whole
		return req, nil
	}
	memBytes, computeVal := whole, int64(100)
	if okMem {
		memBytes = mem.Value()
	}
	if okCompute {
		computeVal = compute.Value()
	}
	if memBytes == whole && computeVal == 100 {
		req.Exclusive = true
		return req, nil
	}
	// Out-of-range values go to the brokers as they are: their refusal
	// says what is wrong.
	req.MemoryMib = (memBytes + mib - 1) / mib
	req.ComputePercent = int32(min(max(computeVal, math.MinInt32), math.MaxInt32))
	return req, nil
}

// pinnedTopology is the brokers' topology that a matchAttribute constraint
// of claim on the request of r stands for: same-pcie-root for the standard
// PCIe root attribute, same-nvlink for the NVLink domain, unspecified for
// none. Each device of a claim is a lease of its own, pinned to its UUID,
// so the scheduler's allocation is what aligns them; the topology in the
// lease records why they were chosen together, and the brokers check that
// the device has a PCIe root (or NVLink peers) to match on.
func pinnedTopology(claim *resourceapi.ResourceClaim, r resourceapi.DeviceRequestAllocationResult) gpupoolv1.Topology {
	parent, _, _ := strings.Cut(r.Request, "/") // a subrequest's constraints are its parent's
	for _, c := range claim.Spec.Devices.Constraints {
		if c.MatchAttribute == nil || len(c.Requests) > 0 && !slices.Contains(c.Requests, parent) && !slices.Contains(c.Requests, r.Request) {
			continue
		}
		switch string(*c.MatchAttribute) {
		case string(driver.AttrPCIeRoot):
			return gpupoolv1.Topology_TOPOLOGY_SAME_PCIE_ROOT
		case driver.Name + "/" + string(driver.AttrNVLinkDomain):
			return gpupoolv1.Topology_TOPOLOGY_SAME_NVLINK
		}
	}
	return gpupoolv1.Topology_TOPOLOGY_UNSPECIFIED
}

// holder names the claim to the brokers: "<namespace>/<name> <uid>", the
// name cut short when that would be longer than they accept.
func holder(claim *resourceapi.ResourceClaim) string {
	name := claim.Name
	if over := len(claim.Namespace) + len(name) + len(claim.UID) + 2 - protocol.MaxHolderLen; over > 0 {
		name = name[:len(name)-over-3] + "..."
	}
	return fmt.Sprintf("%s/%s %s", claim.Namespace, name, claim.UID)
}

// wholeMemory is the memory of the whole device in bytes: the memory
// policy's default, else its published capacity.
func wholeMemory(dev *resourceapi.Device) int64 {
	c := dev.Capacity[driver.CapacityMemory]
	if c.RequestPolicy != nil && c.RequestPolicy.Default != nil {
		return c.RequestPolicy.Default.Value()
	}
	return c.Value.Value()
}

// publishedDevice is device of pool in the driver's ResourceSlices, or
// nil.
func (b *Binder) publishedDevice(pool, device string) *resourceapi.Device {
	objs, _ := b.slices.ByIndex(poolIndex, pool)
	for _, o := range objs {
		s := o.(*resourceapi.ResourceSlice)
		for i := range s.Spec.Devices {
			if s.Spec.Devices[i].Name == device {
				return &s.Spec.Devices[i]
			}
		}
	}
	return nil
}

// errAllocationChanged stops a status update when the claim got another
// allocation meanwhile: the next sync handles that one.
var errAllocationChanged = errors.New("the claim's allocation changed; syncing again")

// writeStatus writes outcomes into the claim's status.devices[], retrying
// on conflicts while the allocation stays the same. Devices without an
// outcome keep their status; entries of this driver for devices no longer
// allocated go.
func (b *Binder) writeStatus(ctx context.Context, claim *resourceapi.ResourceClaim, outcomes map[string]outcome) error {
	first := true
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if !first {
			fresh, err := b.kube.ResourceV1().ResourceClaims(claim.Namespace).Get(ctx, claim.Name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			if fresh.UID != claim.UID || !apiequality.Semantic.DeepEqual(driver.Results(fresh), driver.Results(claim)) {
				return errAllocationChanged
			}
			claim = fresh
		}
		first = false
		devices, ended := b.desiredDevices(claim, outcomes)
		if apiequality.Semantic.DeepEqual(devices, claim.Status.Devices) {
			return nil
		}
		c := claim.DeepCopy()
		c.Status.Devices = devices
		if _, err := b.kube.ResourceV1().ResourceClaims(c.Namespace).UpdateStatus(ctx, c, metav1.UpdateOptions{}); err != nil {
			return err
		}
		for _, n := range ended {
			if b.notifyOnce(cache.MetaObjectToName(claim).String(), n.id) {
				b.eventOnPods(claim, ReasonLeaseEnded, n.msg)
			}
		}
		return nil
	})
}

// endNote is the message for the pods of a claim whose lease id ended.
type endNote struct{ id, msg string }

// desiredDevices is claim's status.devices[] with outcomes applied, and the
// messages of the leases that ended under a claim that had them.
//
// The scheduler reads the first entry of a pool and device for every share
// of it. So while one share of a device has no outcome yet (its lease is
// being tried again, say), no share of that device says Leased=True: the
// pod would be bound with that share unleased. And once all have one, a
// share that is not leased comes before the leased ones.
func (b *Binder) desiredDevices(claim *resourceapi.ResourceClaim, outcomes map[string]outcome) ([]resourceapi.AllocatedDeviceStatus, []endNote) {
	var out []resourceapi.AllocatedDeviceStatus
	for _, d := range claim.Status.Devices {
		if d.Driver != driver.Name {
			out = append(out, d)
		}
	}
	others := len(out)
	results := driver.Results(claim)

	type poolDevice struct{ pool, device string }
	waiting := map[poolDevice]bool{} // a share of it has no outcome yet
	for _, r := range results {
		if o, ok := outcomes[RequestID(claim.UID, r)]; ok {
			if !o.settled() {
				waiting[poolDevice{r.Pool, r.Device}] = true
			}
			continue
		}
		if prior := driver.DeviceStatus(claim, r); prior == nil || !(meta.IsStatusConditionTrue(prior.Conditions, driver.ConditionLeased) ||
			meta.IsStatusConditionTrue(prior.Conditions, driver.ConditionLeaseFailed)) {
			waiting[poolDevice{r.Pool, r.Device}] = true
		}
	}
	wait := outcome{waiting: true, reason: ReasonWaitingForOtherShares,
		message: "leased; waiting for the leases of the other shares of this device in the claim"}

	var ended []endNote
	for _, r := range results {
		prior := driver.DeviceStatus(claim, r)
		o, ok := outcomes[RequestID(claim.UID, r)]
		if !ok {
			if prior == nil {
				continue
			}
			ds := *prior.DeepCopy()
			if waiting[poolDevice{r.Pool, r.Device}] && meta.IsStatusConditionTrue(ds.Conditions, driver.ConditionLeased) {
				b.apply(&ds, wait, claim.Generation)
			}
			out = append(out, ds)
			continue
		}
		ds := resourceapi.AllocatedDeviceStatus{Driver: r.Driver, Pool: r.Pool, Device: r.Device}
		if r.ShareID != nil {
			ds.ShareID = (*string)(r.ShareID)
		}
		if prior != nil {
			ds = *prior.DeepCopy()
		}
		if o.lease == nil && o.reason == ReasonLeaseEnded && (o.held || prior != nil && meta.IsStatusConditionTrue(prior.Conditions, driver.ConditionLeased)) {
			ended = append(ended, endNote{RequestID(claim.UID, r), fmt.Sprintf("the gpupool lease for device %s of pool %s in claim %s ended: %s", r.Device, r.Pool, claim.Name, o.message)})
		}
		if o.lease != nil && waiting[poolDevice{r.Pool, r.Device}] {
			o = wait
		}
		b.apply(&ds, o, claim.Generation)
		out = append(out, ds)
	}
	slices.SortStableFunc(out[others:], func(a, b resourceapi.AllocatedDeviceStatus) int {
		la, lb := meta.IsStatusConditionTrue(a.Conditions, driver.ConditionLeased), meta.IsStatusConditionTrue(b.Conditions, driver.ConditionLeased)
		switch {
		case la == lb:
			return 0
		case lb:
			return -1
		}
		return 1
	})
	return out, ended
}

// apply sets the conditions and data of ds for o.
func (b *Binder) apply(ds *resourceapi.AllocatedDeviceStatus, o outcome, generation int64) {
	if o.lease == nil {
		meta.SetStatusCondition(&ds.Conditions, metav1.Condition{Type: driver.ConditionLeased, Status: metav1.ConditionFalse,
			Reason: o.reason, Message: o.message, ObservedGeneration: generation})
		if o.waiting {
			return
		}
		meta.SetStatusCondition(&ds.Conditions, metav1.Condition{Type: driver.ConditionLeaseFailed, Status: metav1.ConditionTrue,
			Reason: o.reason, Message: o.message, ObservedGeneration: generation})
		return
	}
	info := o.lease.Info()
	var data driver.DeviceStatusData
	data.LeaseID = info.GetId()
	if ss := info.GetSlices(); len(ss) > 0 {
		data.Host, data.MemoryMiB, data.ComputePercent = ss[0].GetHost(), ss[0].GetMemoryMib(), ss[0].GetComputePercent()
	}
	if t, ok := o.lease.Token(data.Host); ok {
		data.AgentAddress, data.CertSHA256 = t.GetAddress(), t.GetCertSha256()
	}
	if !sameData(ds.Data, data) {
		raw, _ := json.Marshal(data)
		ds.Data = &runtime.RawExtension{Raw: raw}
	}
	msg := fmt.Sprintf("lease %s: %d MiB and %d%% compute on host %s", data.LeaseID, data.MemoryMiB, data.ComputePercent, data.Host)
	meta.SetStatusCondition(&ds.Conditions, metav1.Condition{Type: driver.ConditionLeased, Status: metav1.ConditionTrue,
		Reason: ReasonLeaseGranted, Message: msg, ObservedGeneration: generation})
	meta.RemoveStatusCondition(&ds.Conditions, driver.ConditionLeaseFailed)
}

// sameData reports whether raw holds data, however it is spelled.
func sameData(raw *runtime.RawExtension, data driver.DeviceStatusData) bool {
	if raw == nil {
		return false
	}
	var got driver.DeviceStatusData
	return json.Unmarshal(raw.Raw, &got) == nil && got == data
}

// eventOnPods sends a Warning event to each pod claim is reserved for.
func (b *Binder) eventOnPods(claim *resourceapi.ResourceClaim, reason, msg string) {
	for _, ref := range claim.Status.ReservedFor {
		if ref.APIGroup != "" || ref.Resource != "pods" {
			continue
		}
		pod := &corev1.ObjectReference{APIVersion: "v1", Kind: "Pod", Namespace: claim.Namespace, Name: ref.Name, UID: ref.UID}
		b.cfg.Recorder.Event(pod, corev1.EventTypeWarning, reason, msg)
	}
}

// release ends one held lease.
func (b *Binder) release(ctx context.Context, l HeldLease, reason string) error {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	if err := l.Release(ctx, reason); err != nil {
		return fmt.Errorf("release lease %s: %w", l.Info().GetId(), err)
	}
	b.log.Info("lease released", "lease", l.Info().GetId(), "why", reason)
	return nil
}

// releaseAll ends every lease held for key.
func (b *Binder) releaseAll(ctx context.Context, key, reason string) error {
	cl := b.heldFor(key)
	if cl == nil {
		return nil
	}
	var errs []error
	for id, l := range cl.leases {
		if err := b.release(ctx, l, reason); err != nil {
			errs = append(errs, err)
			continue
		}
		delete(cl.leases, id)
	}
	b.forget(key)
	return errors.Join(errs...)
}
