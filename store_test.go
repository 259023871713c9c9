package idempotency

// The store conformance suite (store/storetest), run on every store as a
// handler calls it: under the wrappers a handler puts around it
// (metrics, the replay cache). Each store's own package runs it on the
// bare store.

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddy-idempotency/idempotency/stores/memory"
	"github.com/caddyserver/caddy/v2"
)

func TestConformanceWrapped(t *testing.T) {
	for _, name := range storeBackendNames {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			storetest.Run(t, func(t *testing.T) store.Store {
				return wrapLikeHandler(newStoreBackend(t, name).openWaiting(t))
			})
		})
	}
}

// wrapLikeHandler wraps s as Provision does (wrapStore), with the
// default replay cache.
func wrapLikeHandler(s store.Store) store.Store {
	wrapped, _ := wrapStore(s, newStoreMetrics("conformance"), defaultReplayCache)
	return wrapped
}

// A handler finds a store's capabilities through its wrappers, and the
// wrappers' own where they add to one: a wrapper that hid one would turn
// wait, the default credential secret, the pool's drain or the admin API
// off for its store.
func TestStoreCapabilitiesThroughTheChain(t *testing.T) {
	mem := memory.New(100, time.Now)
	chain, cache := wrapStore(mem, newStoreMetrics("conformance"), defaultReplayCache)
	if cache == nil || chain != store.Store(cache) {
		t.Fatalf("wrapStore returned %T and cache %v; want the cache outermost", chain, cache)
	}
	if w, ok := store.As[store.Waiter](chain); !ok || w != store.Waiter(mem) {
		t.Errorf("Waiter through the chain: %T, %v; want the memory store", w, ok)
	}
	if _, ok := store.As[store.SecretKeeper](chain); !ok {
		t.Error("SecretKeeper not found through the chain")
	}
	if _, ok := store.As[store.Inspector](chain); !ok {
		t.Error("the admin API's capability not found through the chain")
	}
	if got := recordsOf(chain); got != mem.Records() {
		t.Errorf("records of the chain: %q, want the memory store's", got)
	}
	if r, ok := store.As[store.LockRenewer](chain); !ok || r != store.LockRenewer(cache) {
		t.Errorf("LockRenewer: %T, %v; want the cache's own, which forgets lost locks", r, ok)
	}
	if cache.learnOnComplete {
		t.Error("a cache in front of the memory store copies the responses it completes")
	}
	if store.Innermost(chain) != store.Store(mem) {
		t.Errorf("innermost: %T, want the memory store", store.Innermost(chain))
	}

	pg := newTestPostgresStore(t, pgtest.FreshTable(t), 4)
	chain, cache = wrapStore(pg, newStoreMetrics("conformance"), 0)
	if cache != nil {
		t.Fatal("a cache of size 0 was built")
	}
	if d, ok := store.As[store.Drainer](chain); !ok || d != store.Drainer(pg) {
		t.Errorf("Drainer through the chain: %T, %v; want the Postgres store", d, ok)
	}
	if got, want := recordsOf(chain), pg.Records(); got != want {
		t.Errorf("records of the chain: %q, want %q", got, want)
	}
}

// outsideStore is a store of another module: it offers the memory
// store's records and their inspection, and nothing else of it.
type outsideStore struct {
	store.Store
	inspect store.Inspector
}

func (outsideStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.idempotency.stores.outside"}
}

func (s outsideStore) InspectRecords(ctx context.Context, f store.RecordFilter) ([]store.InspectedRecord, error) {
	return s.inspect.InspectRecords(ctx, f)
}

func (s outsideStore) DeleteRecord(ctx context.Context, key store.RecordKey, force bool, lockTimeout time.Duration) (store.Status, error) {
	return s.inspect.DeleteRecord(ctx, key, force, lockTimeout)
}

// A store of another module that implements Inspector is served by the
// admin API, named after its module, through the handler's wrappers.
func TestAdminAPIServesAnOutsideInspector(t *testing.T) {
	mem := memory.New(100, time.Now)
	h := &Handler{}
	h.store, h.cache = wrapStore(outsideStore{Store: mem, inspect: mem}, newStoreMetrics("conformance"), defaultReplayCache)
	h.records = recordsOf(h.store)
	h.registerStore()
	t.Cleanup(h.unregisterStore)
	for _, s := range adminStores() {
		if s.Name == "outside" && s.Backend == "outside" && len(s.users) == 1 && s.users[0].h == h && s.users[0].cache == h.cache {
			return
		}
	}
	t.Fatalf("the outside store is not among the admin API's stores: %+v", adminStores())
}
