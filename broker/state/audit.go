package state

import (
	"encoding/binary"
	"fmt"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// The audit log is an append-only record of AuditEntry, ordered by
// (index, seq). The FSM adds entries with Writer.Audit; Commit stamps them
// with the command's Raft index and drops the oldest beyond the limit, so
// every server holds the same entries after the same log.
//
// Entries are kept in two tables with a limit each: lease churn (grants
// and ends of leases, which any tenant makes in volume) and everything
// else, the security-relevant entries (ACL bootstrap and tokens, quotas,
// drains, eligibility, host registrations and identity changes). No
// number of lease events can therefore evict a security entry. AuditLog
// merges the two.

// AuditLimit is how many lease-churn entries the state keeps, and
// SecurityAuditLimit how many of the others. They are part of the
// replicated state machine: changing them changes what a log replays to,
// so every server of a cluster must use the same values.
const (
	AuditLimit         = 10_000
	SecurityAuditLimit = 10_000
)

const (
	tableAudit         = "audit"
	tableAuditSecurity = "audit-security"
	metaAudit          = "audit-count"
	metaAuditSecurity  = "audit-security-count"
)

// auditLimit and securityAuditLimit are the limits; tests lower them.
var (
	auditLimit         = AuditLimit
	securityAuditLimit = SecurityAuditLimit
)

// auditClass is one of the two tables and its count and limit.
type auditClass struct {
	table, meta string
	limit       *int
}

var (
	leaseChurn = auditClass{tableAudit, metaAudit, &auditLimit}
	security   = auditClass{tableAuditSecurity, metaAuditSecurity, &securityAuditLimit}
)

// IsLeaseChurn reports whether entries of kind k are lease churn rather
// than security-relevant.
func IsLeaseChurn(k gpupoolv1.AuditKind) bool {
	switch k {
	case gpupoolv1.AuditKind_AUDIT_KIND_LEASE_GRANTED, gpupoolv1.AuditKind_AUDIT_KIND_LEASE_RELEASED,
		gpupoolv1.AuditKind_AUDIT_KIND_LEASE_EXPIRED, gpupoolv1.AuditKind_AUDIT_KIND_LEASE_REVOKED,
		gpupoolv1.AuditKind_AUDIT_KIND_LEASE_PREEMPTED:
		return true
	}
	return false
}

func classOf(e *gpupoolv1.AuditEntry) auditClass {
	if IsLeaseChurn(e.Kind) {
		return leaseChurn
	}
	return security
}

// Audit adds an entry to write at Commit, which stamps its index and seq.
func (w *Writer) Audit(e *gpupoolv1.AuditEntry) { w.audit = append(w.audit, e) }

// Audited returns the entries Commit wrote, stamped.
func (w *Writer) Audited() []*gpupoolv1.AuditEntry { return w.audit }

// commitAudit stamps and inserts the entries of this write, then trims
// each table to its limit, oldest first.
func (w *Writer) commitAudit(index uint64) {
	if len(w.audit) == 0 {
		return
	}
	added := map[auditClass]uint64{}
	for i, e := range w.audit {
		e.Index, e.Seq = index, uint32(i)
		c := classOf(e)
		w.insert(c.table, e)
		added[c]++
	}
	for _, c := range []auditClass{leaseChurn, security} {
		if added[c] > 0 {
			w.setAuditCount(c, w.auditCount(c)+added[c])
			w.trimAudit(c)
		}
	}
}

func (w *Writer) trimAudit(c auditClass) {
	n := w.auditCount(c)
	if n <= uint64(*c.limit) {
		return
	}
	excess := int(n - uint64(*c.limit))
	it, err := w.txn.Get(c.table, indexID)
	if err != nil {
		panic(fmt.Sprintf("state: %s: %v", c.table, err))
	}
	old := make([]any, 0, excess)
	for obj := it.Next(); obj != nil && len(old) < excess; obj = it.Next() {
		old = append(old, obj)
	}
	for _, obj := range old {
		if err := w.txn.Delete(c.table, obj); err != nil {
			panic(fmt.Sprintf("state: delete audit entry: %v", err))
		}
	}
	w.setAuditCount(c, n-uint64(len(old)))
}

func (r *Reader) auditCount(c auditClass) uint64 {
	if m := first[metaEntry](r, tableMeta, indexID, c.meta); m != nil {
		return m.Value
	}
	return 0
}

func (w *Writer) setAuditCount(c auditClass, n uint64) {
	w.insert(tableMeta, &metaEntry{Key: c.meta, Value: n})
}

// AuditLog returns the audit entries after Raft index since, of both
// tables, oldest first.
func (r *Reader) AuditLog(since uint64) []*gpupoolv1.AuditEntry {
	a, b := r.auditTable(tableAudit, since), r.auditTable(tableAuditSecurity, since)
	out := make([]*gpupoolv1.AuditEntry, 0, len(a)+len(b))
	for len(a) > 0 && len(b) > 0 {
		if a[0].Index < b[0].Index || a[0].Index == b[0].Index && a[0].Seq < b[0].Seq {
			out, a = append(out, a[0]), a[1:]
		} else {
			out, b = append(out, b[0]), b[1:]
		}
	}
	return append(append(out, a...), b...)
}

func (r *Reader) auditTable(table string, since uint64) []*gpupoolv1.AuditEntry {
	it, err := r.txn.LowerBound(table, indexID, since+1, uint32(0))
	if err != nil {
		panic(fmt.Sprintf("state: %s: %v", table, err))
	}
	var out []*gpupoolv1.AuditEntry
	for obj := it.Next(); obj != nil; obj = it.Next() {
		out = append(out, obj.(*gpupoolv1.AuditEntry))
	}
	return out
}

// restoreAudit puts entries read from a snapshot back as they were.
func (w *Writer) restoreAudit(entries []*gpupoolv1.AuditEntry) {
	n := map[auditClass]uint64{}
	for _, e := range entries {
		c := classOf(e)
		w.insert(c.table, e)
		n[c]++
	}
	for _, c := range []auditClass{leaseChurn, security} {
		if n[c] > 0 {
			w.setAuditCount(c, n[c])
		}
		w.trimAudit(c)
	}
}

// auditIDIndex orders entries by (index, seq), big-endian so that byte
// order is numeric order.
type auditIDIndex struct{}

func (auditIDIndex) FromObject(obj any) (bool, []byte, error) {
	e, ok := obj.(*gpupoolv1.AuditEntry)
	if !ok {
		return false, nil, fmt.Errorf("state: audit id index: got %T", obj)
	}
	return true, auditKey(e.Index, e.Seq), nil
}

func (auditIDIndex) FromArgs(args ...any) ([]byte, error) {
	if len(args) != 2 {
		return nil, fmt.Errorf("state: audit id index takes an index and a seq, got %d args", len(args))
	}
	index, ok1 := args[0].(uint64)
	seq, ok2 := args[1].(uint32)
	if !ok1 || !ok2 {
		return nil, fmt.Errorf("state: audit id index: got %T, %T, want uint64, uint32", args[0], args[1])
	}
	return auditKey(index, seq), nil
}

func auditKey(index uint64, seq uint32) []byte {
	b := make([]byte, 12)
	binary.BigEndian.PutUint64(b, index)
	binary.BigEndian.PutUint32(b[8:], seq)
	return b
}
