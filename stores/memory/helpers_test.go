package memory

import "github.com/caddy-idempotency/idempotency/store/storetest"

// newTestMemoryStore is a store with records of its own on a clock that
// the test moves.
func newTestMemoryStore(maxEntries int) (*Store, *storetest.Clock) {
	clock := storetest.NewClock()
	return New(maxEntries, clock.Now), clock
}
