// Package state is the broker's in-memory, indexed state: servers, hosts,
// devices and leases, kept in go-memdb.
//
// Objects read from the store are constant and NEVER modified in place: a
// writer clones an object, changes the clone and puts it back. Only the
// FSM writes, and only from Apply and Restore.
package state

import (
	"fmt"
	"maps"

	"github.com/hashicorp/go-memdb"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const (
	tableServers = "servers"
	tableHosts   = "hosts"
	tablePool    = "pool"
	tableDevices = "devices"
	tableLeases  = "leases"
	tableMeta    = "meta"
	tableKeys    = "signing_keys"
	tableQuotas  = "quotas"
	tableClaims  = "tenant_claims"

	indexID      = "id"
	indexHost    = "host"
	indexRequest = "request"
	indexTenant  = "tenant_holding"
)

func schema() *memdb.DBSchema {
	return &memdb.DBSchema{Tables: map[string]*memdb.TableSchema{
		tableServers: {Name: tableServers, Indexes: map[string]*memdb.IndexSchema{
			indexID: {Name: indexID, Unique: true, Indexer: &memdb.StringFieldIndex{Field: "Id"}},
		}},
		tableMeta: {Name: tableMeta, Indexes: map[string]*memdb.IndexSchema{
			indexID: {Name: indexID, Unique: true, Indexer: &memdb.StringFieldIndex{Field: "Key"}},
		}},
		tableKeys: {Name: tableKeys, Indexes: map[string]*memdb.IndexSchema{
			indexID: {Name: indexID, Unique: true, Indexer: &memdb.StringFieldIndex{Field: "Id"}},
		}},
		tableACLTokens: {Name: tableACLTokens, Indexes: map[string]*memdb.IndexSchema{
			indexID:         {Name: indexID, Unique: true, Indexer: &memdb.StringFieldIndex{Field: "AccessorId"}},
			indexSecretHash: {Name: indexSecretHash, Unique: true, Indexer: secretHashIndex{}},
		}},
		tableAudit: {Name: tableAudit, Indexes: map[string]*memdb.IndexSchema{
			indexID: {Name: indexID, Unique: true, Indexer: auditIDIndex{}},
		}},
		tableAuditSecurity: {Name: tableAuditSecurity, Indexes: map[string]*memdb.IndexSchema{
			indexID: {Name: indexID, Unique: true, Indexer: auditIDIndex{}},
		}},
		tableQuotas: {Name: tableQuotas, Indexes: map[string]*memdb.IndexSchema{
			indexID: {Name: indexID, Unique: true, Indexer: &memdb.StringFieldIndex{Field: "Tenant"}},
		}},
		tableClaims: {Name: tableClaims, Indexes: map[string]*memdb.IndexSchema{
			indexID: {Name: indexID, Unique: true, Indexer: &memdb.StringFieldIndex{Field: "Tenant"}},
		}},
		tableHosts: {Name: tableHosts, Indexes: map[string]*memdb.IndexSchema{
			indexID: {Name: indexID, Unique: true, Indexer: &memdb.StringFieldIndex{Field: "Id"}},
		}},
		// tablePool holds each host with its devices filled in: what
		// placement reads, kept up to date by the Writer at Commit.
		tablePool: {Name: tablePool, Indexes: map[string]*memdb.IndexSchema{
			indexID: {Name: indexID, Unique: true, Indexer: &memdb.StringFieldIndex{Field: "Id"}},
		}},
		tableDevices: {Name: tableDevices, Indexes: map[string]*memdb.IndexSchema{
			indexID:   {Name: indexID, Unique: true, Indexer: &memdb.StringFieldIndex{Field: "Uuid"}},
			indexHost: {Name: indexHost, Indexer: &memdb.StringFieldIndex{Field: "HostId"}},
		}},
		tableLeases: {Name: tableLeases, Indexes: withIndexes(queueIndexes(), map[string]*memdb.IndexSchema{
			indexID:     {Name: indexID, Unique: true, Indexer: &memdb.StringFieldIndex{Field: "Id"}},
			indexHost:   {Name: indexHost, AllowMissing: true, Indexer: leaseHostsIndex{}},
			indexTenant: {Name: indexTenant, AllowMissing: true, Indexer: holdingTenantIndex{}},
			indexEnded:  {Name: indexEnded, Unique: true, AllowMissing: true, Indexer: endedIndex{}},
			indexRequest: {Name: indexRequest, Unique: true, AllowMissing: true, Indexer: &memdb.CompoundIndex{
				Indexes: []memdb.Indexer{
					&memdb.StringFieldIndex{Field: "Tenant"},
					&memdb.StringFieldIndex{Field: "RequestId"},
				},
			}},
		})},
	}}
}

func withIndexes(extra, base map[string]*memdb.IndexSchema) map[string]*memdb.IndexSchema {
	maps.Copy(base, extra)
	return base
}

// leaseHostsIndex indexes a lease under every host its slices are on,
// while it holds capacity there (see Holding): what is on a host is read
// on every heartbeat and every change to it, and a busy host ends
// thousands of leases an hour.
type leaseHostsIndex struct{}

func (leaseHostsIndex) FromObject(obj any) (bool, [][]byte, error) {
	l, ok := obj.(*gpupoolv1.Lease)
	if !ok {
		return false, nil, fmt.Errorf("state: lease host index: got %T", obj)
	}
	hosts := LeaseHosts(l)
	if len(hosts) == 0 || !Holding(l.State) {
		return false, nil, nil
	}
	vals := make([][]byte, len(hosts))
	for i, h := range hosts {
		vals[i] = []byte(h + "\x00")
	}
	return true, vals, nil
}

func (leaseHostsIndex) FromArgs(args ...any) ([]byte, error) {
	if len(args) != 1 {
		return nil, fmt.Errorf("state: lease host index takes one host id, got %d args", len(args))
	}
	s, ok := args[0].(string)
	if !ok {
		return nil, fmt.Errorf("state: lease host index: got %T, want string", args[0])
	}
	return []byte(s + "\x00"), nil
}

// LeaseHosts returns the distinct hosts of a lease's slices, in slice order.
func LeaseHosts(l *gpupoolv1.Lease) []string {
	var hosts []string
	seen := map[string]bool{}
	for _, s := range l.GetSlices() {
		if !seen[s.Host] {
			seen[s.Host] = true
			hosts = append(hosts, s.Host)
		}
	}
	return hosts
}

// metaEntry is a named counter kept with the state, such as the applied index.
type metaEntry struct {
	Key   string
	Value uint64
}

const metaApplied = "applied-index"
