package postgres

import (
	"testing"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
)

// The store, bare, on a table of each test's own, its waiting enabled.
func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store {
		s := newTestStore(t, pgtest.FreshTable(t), 8)
		if err := s.EnableWaiting(); err != nil {
			t.Fatal(err)
		}
		return s
	})
}
