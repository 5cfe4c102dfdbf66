package state

import (
	"cmp"
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/hashicorp/go-memdb"
	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Store holds the state. Reads may run concurrently with one writer.
type Store struct {
	db    atomic.Pointer[memdb.MemDB] // swapped whole by Restore
	obs   PoolObserver                // set before the first write; may be nil
	share *sharer                     // the writer's; see ShareLease
	// tokens counts the commits that changed an ACL token, and restores:
	// see TokensVersion.
	tokens atomic.Uint64
}

// PoolObserver is told of every change to the pool view (HostsWithDevices), on the writer's
// goroutine, before the write becomes visible to readers: an observer is never behind a
// Reader, though it may be ahead of one read before the change.
type PoolObserver interface {
	// Update gives a host's new pool view (a host with its devices). It must not be modified.
	Update(h *gpupoolv1.Host)
	// Remove says the host with id is gone.
	Remove(id string)
	// Reset gives the whole pool view after a restore.
	Reset(hosts []*gpupoolv1.Host)
}

// ObservePool makes o observe the pool view from the next write on. Call it before the first
// write.
func (s *Store) ObservePool(o PoolObserver) { s.obs = o }

// New returns an empty store.
func New() *Store {
	db, err := memdb.NewMemDB(schema())
	if err != nil {
		// The schema is static; an error here is a programming mistake.
		panic(fmt.Sprintf("state: bad schema: %v", err))
	}
	s := &Store{share: &sharer{}}
	s.db.Store(db)
	return s
}

// Read returns a consistent read-only view of the state as of now.
func (s *Store) Read() *Reader {
	return &Reader{txn: s.db.Load().Txn(false)}
}

// Write starts the one write transaction. Call Commit or Abort.
func (s *Store) Write() *Writer {
	return &Writer{Reader: Reader{txn: s.db.Load().Txn(true)}, obs: s.obs, share: s.share, tokens: &s.tokens}
}

// Reader is a snapshot-consistent view of the state.
type Reader struct {
	txn *memdb.Txn
}

func first[T any](r *Reader, table, index string, args ...any) *T {
	obj, err := r.txn.First(table, index, args...)
	if err != nil {
		panic(fmt.Sprintf("state: %s.%s: %v", table, index, err))
	}
	if obj == nil {
		return nil
	}
	return obj.(*T)
}

func all[T any](r *Reader, table, index string, args ...any) []*T {
	it, err := r.txn.Get(table, index, args...)
	if err != nil {
		panic(fmt.Sprintf("state: %s.%s: %v", table, index, err))
	}
	var out []*T
	for obj := it.Next(); obj != nil; obj = it.Next() {
		out = append(out, obj.(*T))
	}
	return out
}

// Index returns the Raft index of the last applied write.
func (r *Reader) Index() uint64 {
	if m := first[metaEntry](r, tableMeta, indexID, metaApplied); m != nil {
		return m.Value
	}
	return 0
}

// Servers returns the broker servers, by id.
func (r *Reader) Servers() []*gpupoolv1.UpsertServerCommand {
	return all[gpupoolv1.UpsertServerCommand](r, tableServers, indexID)
}

// Server returns one broker server, or nil.
func (r *Reader) Server(id string) *gpupoolv1.UpsertServerCommand {
	return first[gpupoolv1.UpsertServerCommand](r, tableServers, indexID, id)
}

// Host returns a host (without devices), or nil.
func (r *Reader) Host(id string) *gpupoolv1.Host {
	return first[gpupoolv1.Host](r, tableHosts, indexID, id)
}

// Hosts returns every host (without devices), by id.
func (r *Reader) Hosts() []*gpupoolv1.Host {
	return all[gpupoolv1.Host](r, tableHosts, indexID)
}

// Device returns a device, or nil.
func (r *Reader) Device(uuid string) *gpupoolv1.Device {
	return first[gpupoolv1.Device](r, tableDevices, indexID, uuid)
}

// Devices returns every device, by uuid.
func (r *Reader) Devices() []*gpupoolv1.Device {
	return all[gpupoolv1.Device](r, tableDevices, indexID)
}

// HostDevices returns a host's devices, by index.
func (r *Reader) HostDevices(hostID string) []*gpupoolv1.Device {
	devs := all[gpupoolv1.Device](r, tableDevices, indexHost, hostID)
	sortDevices(devs)
	return devs
}

// HostsWithDevices returns every host, by id, with its devices filled in,
// as placement wants them. Hosts and devices are shared with the store:
// they must not be modified (clone them first). The view is kept up to
// date write by write, so reading it costs no copying, however large the
// pool.
func (r *Reader) HostsWithDevices() []*gpupoolv1.Host {
	return all[gpupoolv1.Host](r, tablePool, indexID)
}

// HostWithDevices returns one host with its devices filled in, as
// HostsWithDevices does, or nil. It must not be modified.
func (r *Reader) HostWithDevices(id string) *gpupoolv1.Host {
	return first[gpupoolv1.Host](r, tablePool, indexID, id)
}

// Lease returns a lease, or nil.
func (r *Reader) Lease(id string) *gpupoolv1.Lease {
	return first[gpupoolv1.Lease](r, tableLeases, indexID, id)
}

// Leases returns every lease, by id.
func (r *Reader) Leases() []*gpupoolv1.Lease {
	return all[gpupoolv1.Lease](r, tableLeases, indexID)
}

// HostLeases returns the leases holding capacity on the host (granted or
// releasing; see Holding), by id. Ended leases are found with Leases.
func (r *Reader) HostLeases(hostID string) []*gpupoolv1.Lease {
	return all[gpupoolv1.Lease](r, tableLeases, indexHost, hostID)
}

// LeaseByRequest returns the lease a tenant acquired with requestID, or nil.
func (r *Reader) LeaseByRequest(tenant, requestID string) *gpupoolv1.Lease {
	if requestID == "" {
		return nil
	}
	return first[gpupoolv1.Lease](r, tableLeases, indexRequest, tenant, requestID)
}

// SigningKeys returns the token signing keys, by id.
func (r *Reader) SigningKeys() []*gpupoolv1.SigningKey {
	return all[gpupoolv1.SigningKey](r, tableKeys, indexID)
}

// Writer is the single write transaction.
type Writer struct {
	Reader
	// dirty holds the hosts whose pool view Commit must rebuild.
	dirty map[string]struct{}
	// audit holds the audit entries Commit writes.
	audit []*gpupoolv1.AuditEntry
	obs   PoolObserver // told of pool view changes; nil for none
	share *sharer      // nil for none
	// tokens is the store's Store.tokens, counted once by Commit if
	// tokensChanged; nil in a restore's writer (Restore counts).
	tokens        *atomic.Uint64
	tokensChanged bool
}

func (w *Writer) touch(hostID string) {
	if w.dirty == nil {
		w.dirty = map[string]struct{}{}
	}
	w.dirty[hostID] = struct{}{}
}

// rebuildPool refreshes the pool view of every host written to.
func (w *Writer) rebuildPool() {
	for id := range w.dirty {
		h := w.Host(id)
		if h == nil {
			if _, err := w.txn.DeleteAll(tablePool, indexID, id); err != nil {
				panic(fmt.Sprintf("state: delete pool view %s: %v", id, err))
			}
			if w.obs != nil {
				w.obs.Remove(id)
			}
			continue
		}
		v := proto.CloneOf(h)
		v.Devices = w.HostDevices(id)
		w.insert(tablePool, v)
		if w.obs != nil {
			w.obs.Update(v)
		}
	}
	w.dirty = nil
}

func (w *Writer) insert(table string, obj any) {
	if err := w.txn.Insert(table, obj); err != nil {
		panic(fmt.Sprintf("state: insert into %s: %v", table, err))
	}
}

// PutServer inserts or replaces a server.
func (w *Writer) PutServer(s *gpupoolv1.UpsertServerCommand) { w.insert(tableServers, s) }

// PutHost inserts or replaces a host. Its Devices field must be empty.
func (w *Writer) PutHost(h *gpupoolv1.Host) {
	w.insert(tableHosts, h)
	w.touch(h.Id)
}

// PutDevice inserts or replaces a device.
func (w *Writer) PutDevice(d *gpupoolv1.Device) {
	w.insert(tableDevices, d)
	w.touch(d.HostId)
}

// DeleteDevice removes a device.
func (w *Writer) DeleteDevice(d *gpupoolv1.Device) {
	if err := w.txn.Delete(tableDevices, d); err != nil {
		panic(fmt.Sprintf("state: delete device %s: %v", d.Uuid, err))
	}
	w.touch(d.HostId)
}

// PutLease inserts or replaces a lease.
func (w *Writer) PutLease(l *gpupoolv1.Lease) { w.insert(tableLeases, l) }

// Commit makes the writes visible and records index as the applied index.
func (w *Writer) Commit(index uint64) {
	w.rebuildPool()
	w.commitAudit(index)
	w.insert(tableMeta, &metaEntry{Key: metaApplied, Value: index})
	w.txn.Commit()
	if w.tokensChanged && w.tokens != nil {
		// After the commit: a reader that sees the new version reads
		// the new tokens.
		w.tokens.Add(1)
	}
}

// TokensVersion changes whenever a commit changed an ACL token, or a
// restore replaced them all, after the change is visible to a Read: what
// was read of a token while it had not changed since is still current.
func (s *Store) TokensVersion() uint64 { return s.tokens.Load() }

// SetSigningKeys replaces every signing key by keys.
func (w *Writer) SetSigningKeys(keys []*gpupoolv1.SigningKey) {
	if _, err := w.txn.DeleteAll(tableKeys, indexID); err != nil {
		panic(fmt.Sprintf("state: delete signing keys: %v", err))
	}
	for _, k := range keys {
		w.insert(tableKeys, k)
	}
}

// Abort drops the writes.
func (w *Writer) Abort() { w.txn.Abort() }

// Encode returns the whole state as deterministic bytes: the same state
// always gives the same bytes.
func (r *Reader) Encode(version uint32) ([]byte, error) {
	snap := &gpupoolv1.StateSnapshot{
		Version: version,

		Servers: r.Servers(),
		Hosts:   r.Hosts(),
		Devices: r.Devices(),
		Leases:  r.Leases(),
		Index:   r.Index(),

		SigningKeys: r.SigningKeys(),
		Quotas:      r.Quotas(),

		TenantClaims: r.TenantClaims(),

		AclTokens:         r.ACLTokens(),
		AclBootstrapIndex: r.ACLBootstrapIndex(),

		Audit: r.AuditLog(0),
	}
	return proto.MarshalOptions{Deterministic: true}.Marshal(snap)
}

// Restore replaces the whole state with an encoded snapshot.
func (s *Store) Restore(b []byte, check func(version uint32) error) error {
	var snap gpupoolv1.StateSnapshot
	if err := proto.Unmarshal(b, &snap); err != nil {
		return fmt.Errorf("state: decode snapshot: %w", err)
	}
	if err := check(max(snap.Version, 1)); err != nil {
		return err
	}
	db, err := memdb.NewMemDB(schema())
	if err != nil {
		return err
	}
	txn := db.Txn(true)
	share := &sharer{}
	w := &Writer{Reader: Reader{txn: txn}, share: share}
	for _, v := range snap.Servers {
		w.PutServer(v)
	}
	for _, v := range snap.Hosts {
		w.PutHost(v)
	}
	for _, v := range snap.Devices {
		w.PutDevice(v)
	}
	devices := make(map[string]*gpupoolv1.Device, len(snap.Devices))
	for _, d := range snap.Devices {
		devices[d.Uuid] = d
	}
	for _, v := range snap.Leases {
		w.shareLease(v, func(uuid string) *gpupoolv1.Device { return devices[uuid] })
		w.PutLease(v)
	}
	w.SetSigningKeys(snap.SigningKeys)
	for _, v := range snap.Quotas {
		w.PutQuota(v)
	}
	for _, v := range snap.TenantClaims {
		w.PutTenantClaim(v)
	}
	for _, v := range snap.AclTokens {
		w.PutACLToken(v)
	}
	if snap.AclBootstrapIndex != 0 {
		w.SetACLBootstrapIndex(snap.AclBootstrapIndex)
	}
	w.restoreAudit(snap.Audit)
	w.Commit(snap.Index)
	if s.obs != nil {
		s.obs.Reset((&Reader{txn: db.Txn(false)}).HostsWithDevices())
	}
	s.share = share
	s.db.Store(db)
	s.tokens.Add(1)
	return nil
}

func sortDevices(devs []*gpupoolv1.Device) {
	slices.SortFunc(devs, func(a, b *gpupoolv1.Device) int {
		return cmp.Or(cmp.Compare(a.Index, b.Index), cmp.Compare(a.Uuid, b.Uuid))
	})
}
