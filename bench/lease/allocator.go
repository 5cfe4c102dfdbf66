package leasebench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// The allocator's keys in etcd. A device key's value is a device as JSON;
// a lease key's value is a leaseRecord as JSON, attached to the etcd lease
// whose ID (hex) ends the key, so that it goes when the lease expires.
const (
	devicePrefix = "/gpupool-bench/devices/"
	leasePrefix  = "/gpupool-bench/leases/"
)

// ErrNoCapacity is returned by acquire when no device has room for the
// slice.
var ErrNoCapacity = errors.New("etcd allocator: no device has room for the slice")

// slice is what a lease takes from one device.
type slice struct {
	MemoryMiB      int64 `json:"memory_mib"`
	ComputePercent int   `json:"compute_percent"`
}

// device is one GPU's record. Invariant: FreeMemoryMiB and
// FreeComputePercent are the capacity minus the sum of Allocations, and
// never negative.
type device struct {
	Host               string           `json:"host"`
	Index              int              `json:"index"`
	MemoryMiB          int64            `json:"memory_mib"`
	ComputePercent     int              `json:"compute_percent"`
	FreeMemoryMiB      int64            `json:"free_memory_mib"`
	FreeComputePercent int              `json:"free_compute_percent"`
	Allocations        map[string]slice `json:"allocations,omitempty"` // by lease ID
}

// newDevice is an empty device of the given capacity.
func newDevice(host string, index int, memoryMiB int64, computePercent int) device {
	return device{Host: host, Index: index, MemoryMiB: memoryMiB, ComputePercent: computePercent,
		FreeMemoryMiB: memoryMiB, FreeComputePercent: computePercent}
}

// key is the device's key in etcd; keys sort by host, then index.
func (d *device) key() string { return fmt.Sprintf("%s%s/%02d", devicePrefix, d.Host, d.Index) }

// fits reports whether s fits in what is free on d.
func (d *device) fits(s slice) bool {
	return s.MemoryMiB <= d.FreeMemoryMiB && s.ComputePercent <= d.FreeComputePercent
}

// allocate records s for lease id. The caller has checked that it fits.
func (d *device) allocate(id string, s slice) {
	if d.Allocations == nil {
		d.Allocations = map[string]slice{}
	}
	d.Allocations[id] = s
	d.FreeMemoryMiB -= s.MemoryMiB
	d.FreeComputePercent -= s.ComputePercent
}

// free removes lease id's allocation and reports whether it had one.
func (d *device) free(id string) bool {
	s, ok := d.Allocations[id]
	if !ok {
		return false
	}
	delete(d.Allocations, id)
	d.FreeMemoryMiB += s.MemoryMiB
	d.FreeComputePercent += s.ComputePercent
	return true
}

// firstFit returns the index of the first device in devs that fits s, or
// -1 when none does.
func firstFit(devs []device, s slice) int {
	for i := range devs {
		if devs[i].fits(s) {
			return i
		}
	}
	return -1
}

// leaseRecord is the value of a lease key: where the lease's slice is.
type leaseRecord struct {
	Device string `json:"device"`
	Slice  slice  `json:"slice"`
}

// etcdAllocator is the allocator a team would write on etcd: optimistic
// concurrency on one key per device. Safe for concurrent use.
type etcdAllocator struct {
	cli *clientv3.Client
	ttl int64 // seconds, of each lease's etcd lease

	// conflicts counts transactions that failed their mod-revision
	// compare and were retried.
	conflicts atomic.Int64
}

// seedPool replaces every device record with devs, empty.
func seedPool(ctx context.Context, cli *clientv3.Client, devs []device) error {
	if _, err := cli.Delete(ctx, devicePrefix, clientv3.WithPrefix()); err != nil {
		return err
	}
	if _, err := cli.Delete(ctx, leasePrefix, clientv3.WithPrefix()); err != nil {
		return err
	}
	for i := range devs {
		b, err := json.Marshal(&devs[i])
		if err != nil {
			return err
		}
		if _, err := cli.Put(ctx, devs[i].key(), string(b)); err != nil {
			return err
		}
	}
	return nil
}

// readPool reads every device record, in key order, with each one's mod
// revision.
func readPool(ctx context.Context, cli *clientv3.Client) ([]device, []int64, error) {
	resp, err := cli.Get(ctx, devicePrefix, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
	if err != nil {
		return nil, nil, err
	}
	devs := make([]device, len(resp.Kvs))
	revs := make([]int64, len(resp.Kvs))
	for i, kv := range resp.Kvs {
		if err := json.Unmarshal(kv.Value, &devs[i]); err != nil {
			return nil, nil, fmt.Errorf("device record %s: %w", kv.Key, err)
		}
		revs[i] = kv.ModRevision
	}
	return devs, revs, nil
}

// etcdHeld is a slice the allocator granted: what release needs.
type etcdHeld struct {
	device string           // the device's key
	lease  clientv3.LeaseID // the etcd lease the lease record is attached to
}

// acquire grants s on the first device that fits, for the allocator's TTL:
// an etcd lease (granted while the pool is read), then one transaction
// that, if the device's mod revision is still the one read, puts the
// device with the new allocation and the lease record attached to the
// etcd lease. A failed compare reads the pool again. It returns
// ErrNoCapacity when no device fits.
func (a *etcdAllocator) acquire(ctx context.Context, s slice) (etcdHeld, error) {
	grant := make(chan grantResult, 1)
	go func() {
		resp, err := a.cli.Grant(ctx, a.ttl)
		grant <- grantResult{resp, err}
	}()
	var lease clientv3.LeaseID // 0 until the grant is in
	awaitGrant := func() error {
		if lease != 0 {
			return nil
		}
		g := <-grant
		if g.err != nil {
			return fmt.Errorf("grant an etcd lease: %w", g.err)
		}
		lease = g.resp.ID
		return nil
	}
	fail := func(err error) (etcdHeld, error) {
		if awaitGrant() == nil {
			// Best effort: a lease left behind expires after the TTL.
			a.cli.Revoke(context.WithoutCancel(ctx), lease)
		}
		return etcdHeld{}, err
	}
	for {
		devs, revs, err := readPool(ctx, a.cli)
		if err != nil {
			return fail(err)
		}
		i := firstFit(devs, s)
		if i < 0 {
			return fail(ErrNoCapacity)
		}
		if err := awaitGrant(); err != nil {
			return etcdHeld{}, err
		}
		id, key := leaseKeyID(lease), devs[i].key()
		devs[i].allocate(id, s)
		dev, err := json.Marshal(&devs[i])
		if err != nil {
			return fail(err)
		}
		rec, err := json.Marshal(leaseRecord{Device: key, Slice: s})
		if err != nil {
			return fail(err)
		}
		tr, err := a.cli.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(key), "=", revs[i])).
			Then(clientv3.OpPut(key, string(dev)), clientv3.OpPut(leasePrefix+id, string(rec), clientv3.WithLease(lease))).
			Commit()
		if err != nil {
			return fail(err)
		}
		if tr.Succeeded {
			return etcdHeld{device: key, lease: lease}, nil
		}
		a.conflicts.Add(1)
	}
}

// grantResult is the outcome of an etcd lease grant.
type grantResult struct {
	resp *clientv3.LeaseGrantResponse
	err  error
}

// release frees h's allocation in a transaction on the device's mod
// revision (read again on a failed compare) that also deletes the lease
// record, then revokes the etcd lease.
func (a *etcdAllocator) release(ctx context.Context, h etcdHeld) error {
	id := leaseKeyID(h.lease)
	for {
		resp, err := a.cli.Get(ctx, h.device)
		if err != nil {
			return err
		}
		if len(resp.Kvs) == 0 {
			return fmt.Errorf("device record %s: missing", h.device)
		}
		var d device
		if err := json.Unmarshal(resp.Kvs[0].Value, &d); err != nil {
			return fmt.Errorf("device record %s: %w", h.device, err)
		}
		if !d.free(id) {
			break // released already
		}
		b, err := json.Marshal(&d)
		if err != nil {
			return err
		}
		tr, err := a.cli.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(h.device), "=", resp.Kvs[0].ModRevision)).
			Then(clientv3.OpPut(h.device, string(b)), clientv3.OpDelete(leasePrefix+id)).
			Commit()
		if err != nil {
			return err
		}
		if tr.Succeeded {
			break
		}
		a.conflicts.Add(1)
	}
	_, err := a.cli.Revoke(ctx, h.lease)
	return err
}

// leaseKeyID is the etcd lease's ID as it appears in keys and
// allocations.
func leaseKeyID(id clientv3.LeaseID) string { return strconv.FormatInt(int64(id), 16) }
