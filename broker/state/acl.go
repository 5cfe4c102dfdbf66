package state

import (
	"fmt"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const (
	tableACLTokens  = "acl_tokens"
	indexSecretHash = "secret"

	metaACLBootstrap = "acl-bootstrap-index"
)

// ACLToken returns a token by accessor id, or nil.
func (r *Reader) ACLToken(accessorID string) *gpupoolv1.AclToken {
	return first[gpupoolv1.AclToken](r, tableACLTokens, indexID, accessorID)
}

// ACLTokenBySecret returns the token whose secret has this SHA-256, or nil.
func (r *Reader) ACLTokenBySecret(sha256 []byte) *gpupoolv1.AclToken {
	return first[gpupoolv1.AclToken](r, tableACLTokens, indexSecretHash, sha256)
}

// ACLTokens returns every token, by accessor id.
func (r *Reader) ACLTokens() []*gpupoolv1.AclToken {
	return all[gpupoolv1.AclToken](r, tableACLTokens, indexID)
}

// ACLBootstrapIndex is the Raft index of the ACL bootstrap, 0 before it.
func (r *Reader) ACLBootstrapIndex() uint64 {
	if m := first[metaEntry](r, tableMeta, indexID, metaACLBootstrap); m != nil {
		return m.Value
	}
	return 0
}

// IndexWatch returns the applied index and a channel closed by the next
// write that commits.
func (r *Reader) IndexWatch() (uint64, <-chan struct{}) {
	ch, obj, err := r.txn.FirstWatch(tableMeta, indexID, metaApplied)
	if err != nil {
		panic(fmt.Sprintf("state: %s: %v", tableMeta, err))
	}
	if obj == nil {
		return 0, ch
	}
	return obj.(*metaEntry).Value, ch
}

// PutACLToken inserts or replaces a token.
func (w *Writer) PutACLToken(t *gpupoolv1.AclToken) {
	w.insert(tableACLTokens, t)
	w.tokensChanged = true
}

// SetACLBootstrapIndex records the index of the ACL bootstrap.
func (w *Writer) SetACLBootstrapIndex(index uint64) {
	w.insert(tableMeta, &metaEntry{Key: metaACLBootstrap, Value: index})
}

// secretHashIndex indexes a token by the SHA-256 of its secret.
type secretHashIndex struct{}

func (secretHashIndex) FromObject(obj any) (bool, []byte, error) {
	t, ok := obj.(*gpupoolv1.AclToken)
	if !ok {
		return false, nil, fmt.Errorf("state: secret hash index: got %T", obj)
	}
	if len(t.SecretSha256) == 0 {
		return false, nil, fmt.Errorf("state: token %s has no secret hash", t.AccessorId)
	}
	return true, t.SecretSha256, nil
}

func (secretHashIndex) FromArgs(args ...any) ([]byte, error) {
	if len(args) != 1 {
		return nil, fmt.Errorf("state: secret hash index takes one hash, got %d args", len(args))
	}
	b, ok := args[0].([]byte)
	if !ok {
		return nil, fmt.Errorf("state: secret hash index: got %T, want []byte", args[0])
	}
	return b, nil
}
