package state

import (
	"encoding/binary"
	"fmt"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// The audit log is an append-only table of AuditEntry, ordered by (index,
// seq). The FSM adds entries with Writer.Audit; Commit stamps them with the
// command's Raft index and drops the oldest beyond AuditLimit, so every
// server holds the same entries after the same log.

// AuditLimit is how many audit entries the state keeps. It is part of the
// replicated state machine: changing it changes what a log replays to, so
// every server of a cluster must use the same value.
const AuditLimit = 10_000

const (
	tableAudit = "audit"
	metaAudit  = "audit-count"
)

// auditLimit is AuditLimit; tests lower it.
var auditLimit = AuditLimit

// Audit adds an entry to write at Commit, which stamps its index and seq.
func (w *Writer) Audit(e *gpupoolv1.AuditEntry) { w.audit = append(w.audit, e) }

// Audited returns the entries Commit wrote, stamped.
func (w *Writer) Audited() []*gpupoolv1.AuditEntry { return w.audit }

// commitAudit stamps and inserts the entries of this write, then trims the
// table to auditLimit, oldest first.
func (w *Writer) commitAudit(index uint64) {
	if len(w.audit) == 0 {
		return
	}
	for i, e := range w.audit {
		e.Index, e.Seq = index, uint32(i)
		w.insert(tableAudit, e)
	}
	w.setAuditCount(w.auditCount() + uint64(len(w.audit)))
	w.trimAudit()
}

func (w *Writer) trimAudit() {
	n := w.auditCount()
	if n <= uint64(auditLimit) {
		return
	}
	excess := int(n - uint64(auditLimit))
	it, err := w.txn.Get(tableAudit, indexID)
	if err != nil {
		panic(fmt.Sprintf("state: %s: %v", tableAudit, err))
	}
	old := make([]any, 0, excess)
	for obj := it.Next(); obj != nil && len(old) < excess; obj = it.Next() {
		old = append(old, obj)
	}
	for _, obj := range old {
		if err := w.txn.Delete(tableAudit, obj); err != nil {
			panic(fmt.Sprintf("state: delete audit entry: %v", err))
		}
	}
	w.setAuditCount(n - uint64(len(old)))
}

func (r *Reader) auditCount() uint64 {
	if m := first[metaEntry](r, tableMeta, indexID, metaAudit); m != nil {
		return m.Value
	}
	return 0
}

func (w *Writer) setAuditCount(n uint64) {
	w.insert(tableMeta, &metaEntry{Key: metaAudit, Value: n})
}

// AuditLog returns the audit entries after Raft index since, oldest first.
func (r *Reader) AuditLog(since uint64) []*gpupoolv1.AuditEntry {
	it, err := r.txn.LowerBound(tableAudit, indexID, since+1, uint32(0))
	if err != nil {
		panic(fmt.Sprintf("state: %s: %v", tableAudit, err))
	}
	var out []*gpupoolv1.AuditEntry
	for obj := it.Next(); obj != nil; obj = it.Next() {
		out = append(out, obj.(*gpupoolv1.AuditEntry))
	}
	return out
}

// restoreAudit puts entries read from a snapshot back as they were.
func (w *Writer) restoreAudit(entries []*gpupoolv1.AuditEntry) {
	for _, e := range entries {
		w.insert(tableAudit, e)
	}
	if len(entries) > 0 {
		w.setAuditCount(uint64(len(entries)))
	}
	w.trimAudit()
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
