package postgres

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
)

// waitingStore is a store on a fresh table with waiting enabled, once
// its wakes flow.
func waitingStore(t *testing.T) *Store {
	t.Helper()
	s := newTestStore(t, pgtest.FreshTable(t), 2)
	if err := s.EnableWaiting(); err != nil {
		t.Fatal(err)
	}
	storetest.WaitForWakes(t, s)
	return s
}

// Stores that share a listener (one DSN) come and go with configs;
// another store's channel joining it wakes none of this store's waiters,
// whose records did not change: only their completion or release does
// (or the listener's reconnection). Catches a listener that woke every
// waiter whenever its channels changed, which had each ask its store
// again for nothing, and failed the conformance suite's waiter test
// when tests ran in parallel.
func TestListenerChannelChangesWakeOnlyTheirWaiters(t *testing.T) {
	a := waitingStore(t)
	req := storetest.Request("Bearer waiter", "key", "{}")
	storetest.MustAcquire(t, a, req, store.OutcomeCreated)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch := a.WaitCompleted(ctx, req.Key)
	if a.listener != waitingStore(t).listener {
		t.Fatal("the two stores do not share a listener")
	}
	// The second store's probe was heard: the listener has listened to
	// its channel, and woken whom it would.
	select {
	case <-ch:
		t.Fatal("another store's channel joining the listener woke a waiter of this one")
	default:
	}
	if err := a.Release(context.Background(), req.Key, req.Token); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatal("the release did not wake its waiter")
	}
}
