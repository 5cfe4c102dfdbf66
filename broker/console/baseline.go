package console

import (
	"crypto/rand"
	"encoding/hex"
	"hash/fnv"
	"sync"
)

// A page's stream starts from what the page showed: the page handler
// records a hash of each part it rendered under a random id that the page
// passes to its stream, which then sends only the parts that changed since
// (on a large pool, a few rows instead of the whole heatmap again). An id
// is used once; unknown or forgotten ids make the stream send everything.

// maxBaselines bounds the renders kept for streams yet to start.
const maxBaselines = 256

type baseline struct {
	key   string // the session's limiter key: no one else's stream uses it
	shape uint64
	parts map[string]uint64
}

type baselines struct {
	mu    sync.Mutex
	byID  map[string]*baseline // guarded by mu
	order []string             // guarded by mu; oldest first
}

func newBaselines() *baselines { return &baselines{byID: map[string]*baseline{}} }

func hash64(s string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(s))
	return h.Sum64()
}

// put records a page's render for sess and returns its id.
func (b *baselines) put(sess *session, doc liveDoc) string {
	var raw [12]byte
	rand.Read(raw[:])
	id := hex.EncodeToString(raw[:])
	bl := &baseline{key: sess.key, shape: hash64(doc.Shape), parts: make(map[string]uint64, len(doc.Parts))}
	for _, p := range doc.Parts {
		bl.parts[p.ID] = hash64(p.HTML)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.byID[id] = bl
	b.order = append(b.order, id)
	for len(b.order) > maxBaselines {
		delete(b.byID, b.order[0])
		b.order = b.order[1:]
	}
	return id
}

// take returns and forgets the render id recorded for sess, or nil.
func (b *baselines) take(sess *session, id string) *baseline {
	b.mu.Lock()
	defer b.mu.Unlock()
	bl := b.byID[id]
	if bl == nil || bl.key != sess.key {
		return nil
	}
	delete(b.byID, id)
	return bl
}
