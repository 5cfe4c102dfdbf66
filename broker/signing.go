package broker

import "sync"

// signing holds the cluster's token signing keys (in the state) and
// signs the lease tokens agents check (tokens.go). It implements
// tokenSigner for the components that answer grants; the operator's key
// rotation calls it directly.
type signing struct {
	*node
	// keysMu serialises changes to the signing keys. It is never taken
	// under placeMu: a change waits for its commit.
	keysMu sync.Mutex
}
