package idempotency

// The handler's side of its store: the store modules it brings, and the
// chain of wrappers it calls its store through. The contract between the
// two is package store; each store is a package of its own.

import (
	"fmt"

	"github.com/caddy-idempotency/idempotency/store"

	// The stores, registered with Caddy: `xcaddy build --with` this
	// module brings both.
	_ "github.com/caddy-idempotency/idempotency/stores/memory"
	_ "github.com/caddy-idempotency/idempotency/stores/postgres"
)

// wrapStore builds the chain of stores that a handler calls, around the
// store module raw: the metrics time each call that reaches raw, the
// seals are made and opened above them (seal.go), and the replay cache,
// outermost, answers replays without a call (its hits are no round trips
// of the store). A cacheSize of 0 leaves the cache out; the
// cache is returned too, nil then, for the admin API, whose releases
// evict what it holds. raw's capabilities stay reachable through the
// chain (store.As).
func wrapStore(raw store.Store, m *storeMetrics, cacheSize int64) (store.Store, *replayCache) {
	// The seals are below the cache, which holds opened responses.
	var s store.Store = sealingStore{instrumentedStore{raw, m}}
	if cacheSize <= 0 {
		return s, nil
	}
	// Even in front of the memory store: a hit skips the store's lock
	// and its defensive copy of the response.
	rc := newReplayCache(s, cacheSize)
	_, inProcess := store.As[store.InProcess](raw)
	rc.learnOnComplete = !inProcess
	return rc, rc
}

// recordsOf names the records that a store module holds: handlers whose
// stores have the same name read and write the same records. The admin
// API groups handlers by it too.
func recordsOf(st store.Store) string {
	if rs, ok := store.As[store.RecordSet](st); ok {
		return rs.Records()
	}
	// Its own records, as far as this package can tell.
	s := store.Innermost(st)
	return fmt.Sprintf("%T %p", s, s)
}
