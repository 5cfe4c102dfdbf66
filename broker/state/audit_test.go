package state

import (
	"bytes"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// writeAudit commits a write at index with n audit entries.
func writeAudit(s *Store, index uint64, n int) {
	w := s.Write()
	for range n {
		w.Audit(&gpupoolv1.AuditEntry{Kind: gpupoolv1.AuditKind_AUDIT_KIND_LEASE_GRANTED, AtMs: int64(index)})
	}
	w.Commit(index)
}

// ids returns the (index, seq) of entries.
func ids(entries []*gpupoolv1.AuditEntry) [][2]uint64 {
	var out [][2]uint64
	for _, e := range entries {
		out = append(out, [2]uint64{e.Index, uint64(e.Seq)})
	}
	return out
}

func TestTheAuditLogKeepsTheNewestEntries(t *testing.T) {
	old := auditLimit
	auditLimit = 5
	t.Cleanup(func() { auditLimit = old })

	s := New()
	writeAudit(s, 1, 2)
	writeAudit(s, 2, 0) // a write without entries
	writeAudit(s, 3, 3)
	writeAudit(s, 4, 2) // two over the limit: index 1's drop
	tests := []struct {
		name  string
		since uint64
		want  [][2]uint64
	}{
		{"the oldest beyond the limit are dropped", 0, [][2]uint64{{3, 0}, {3, 1}, {3, 2}, {4, 0}, {4, 1}}},
		{"since an index gives the later ones", 3, [][2]uint64{{4, 0}, {4, 1}}},
		{"since the last index gives none", 4, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := ids(s.Read().AuditLog(tt.since))
			if len(got) != len(tt.want) {
				t.Fatalf("got %v, want %v", got, tt.want)
			}
			for i := range got {
				if got[i] != tt.want[i] {
					t.Fatalf("got %v, want %v", got, tt.want)
				}
			}
		})
	}

	// A restored store holds the same entries and trims the same way.
	b, err := s.Read().Encode(1)
	if err != nil {
		t.Fatal(err)
	}
	r := New()
	if err := r.Restore(b, anyVersion); err != nil {
		t.Fatal(err)
	}
	writeAudit(s, 5, 1)
	writeAudit(r, 5, 1)
	a, err := s.Read().Encode(1)
	if err != nil {
		t.Fatal(err)
	}
	c, err := r.Read().Encode(1)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a, c) {
		t.Fatalf("after the same write, the restored store differs: %v vs %v", ids(r.Read().AuditLog(0)), ids(s.Read().AuditLog(0)))
	}
	if got := ids(r.Read().AuditLog(0)); len(got) != 5 || got[0] != [2]uint64{3, 1} {
		t.Fatalf("restored store after one more entry: got %v, want 5 entries from (3, 1)", got)
	}
}

func TestAnAbortedWriteAddsNoAuditEntry(t *testing.T) {
	s := New()
	w := s.Write()
	w.Audit(&gpupoolv1.AuditEntry{Kind: gpupoolv1.AuditKind_AUDIT_KIND_QUOTA_SET})
	w.Abort()
	writeAudit(s, 2, 1)
	if got := ids(s.Read().AuditLog(0)); len(got) != 1 || got[0] != [2]uint64{2, 0} {
		t.Fatalf("got %v, want only (2, 0)", got)
	}
}
