package idempotency

// The tests' stores: each backend as a site configures it, and as a
// test calls it, bare or under a handler called directly.

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddy-idempotency/idempotency/stores/memory"
	"github.com/caddyserver/caddy/v2"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// ---------------------------------------------------------------------------
// Stores

// storeBackend is one of the two stores a store-neutral test runs against.
type storeBackend struct {
	Name  string // "memory" or "postgres"
	DSN   string // postgres only
	Table string // postgres only
}

// waitCompleted waits for key's record to be completed. A client has
// its answer while the record is being completed: a test that rewrites
// the record behind the handler's back must wait, or the completion,
// arriving after the rewrite, finds it or overwrites it.
func (sb storeBackend) waitCompleted(t testing.TB, key string) {
	t.Helper()
	storetest.WaitFor(t, 10*time.Second, "the completion of "+key, func() bool {
		return len(pgtest.Query(t, sb.DSN, `SELECT 1 FROM `+pgtest.QuoteIdent(sb.Table)+` WHERE key = $1 AND status = 'completed'`, key)) == 1
	})
}

// Block returns the store subdirective for the Caddyfile.
func (sb storeBackend) Block() string {
	if sb.Name == "memory" {
		return "store memory"
	}
	return fmt.Sprintf("store postgres {\n\t\t\tdsn %q\n\t\t\ttable %s\n\t\t}", sb.DSN, sb.Table)
}

// storeBackendNames are the stores a store-neutral test runs against.
var storeBackendNames = []string{"memory", "postgres"}

// newStoreBackend returns the backend named name, Postgres on a fresh
// table.
func newStoreBackend(t *testing.T, name string) storeBackend {
	t.Helper()
	if name == "postgres" {
		return postgresBackend(t)
	}
	return storeBackend{Name: name}
}

// eachStore runs fn as a subtest for each backend, "memory" and
// "postgres" (the latter on a fresh table).
func eachStore(t *testing.T, fn func(t *testing.T, sb storeBackend)) {
	t.Helper()
	for _, name := range storeBackendNames {
		t.Run(name, func(t *testing.T) { fn(t, newStoreBackend(t, name)) })
	}
}

// open returns the backend's store itself, on the real clock, as a
// handler's config would provision it (Postgres on sb.Table).
func (sb storeBackend) open(t *testing.T) store.Store {
	t.Helper()
	if sb.Name == "postgres" {
		return newTestPostgresStore(t, sb.Table, 4)
	}
	return memory.New(100, time.Now)
}

// openWaiting is open, with the store's waiting enabled.
func (sb storeBackend) openWaiting(t *testing.T) store.Store {
	t.Helper()
	s := sb.open(t)
	if err := s.(store.Waiter).EnableWaiting(); err != nil {
		t.Fatal(err)
	}
	return s
}

// postgresBackend returns the Postgres store on a fresh table.
func postgresBackend(t *testing.T) storeBackend {
	t.Helper()
	return storeBackend{Name: "postgres", DSN: pgtest.DSN(t), Table: pgtest.FreshTable(t)}
}

// pgCount counts the rows of a table.
func pgCount(t testing.TB, sb storeBackend) int {
	t.Helper()
	rows := pgtest.Query(t, sb.DSN, "SELECT count(*) FROM "+pgx.Identifier{sb.Table}.Sanitize())
	n, _ := strconv.Atoi(rows[0][0])
	return n
}

// ---------------------------------------------------------------------------
// Stores, called directly

func newTestMemoryStore(maxEntries int) (*memory.Store, *storetest.Clock) {
	clock := storetest.NewClock()
	return memory.New(maxEntries, clock.Now), clock
}

// ---------------------------------------------------------------------------
// A handler, called directly

// provisionHandler provisions h outside a config, and unloads it at the
// test's end as Caddy unloads a config: h's Cleanup, then its context's
// (its store's). A handler made by hand stays among the admin API's
// running stores otherwise, in the tests that follow.
func provisionHandler(tb testing.TB, h *Handler) error {
	tb.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	tb.Cleanup(cancel)
	err := h.Provision(ctx)
	tb.Cleanup(func() { _ = h.Cleanup() })
	return err
}

// lockHandler is a provisioned handler on a fresh memory store, wrapped
// by a scriptedStore, logging to an observer.
func lockHandler(t *testing.T, lockTimeout time.Duration) (*Handler, *scriptedStore, *observer.ObservedLogs) {
	t.Helper()
	h := &Handler{LockTimeout: caddy.Duration(lockTimeout), PruneInterval: new(caddy.Duration)}
	if err := provisionHandler(t, h); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	h.logger = zap.New(core)
	s := &scriptedStore{Store: h.store}
	h.store = s
	return h, s, logs
}

// serve sends one protected request through h with ctx, and returns the
// status the client got. Memory stores share their records, so keys are
// made unique to the test run.
func serve(ctx context.Context, h *Handler, key string, next caddyhttp.Handler) int {
	status, _ := serveResult(ctx, h, key, next)
	return status
}

// serveResult is serve, with the {http.idempotency.result} it set.
func serveResult(ctx context.Context, h *Handler, key string, next caddyhttp.Handler) (status int, result string) {
	r := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader(`{"amount":1}`))
	key += "-" + runID
	r.Header.Set("Idempotency-Key", key)
	r.Header.Set("Authorization", defaultCred)
	r.Header.Set("Content-Type", "application/json")
	repl := caddy.NewReplacer()
	r = r.WithContext(context.WithValue(ctx, caddy.ReplacerCtxKey, repl))
	w := httptest.NewRecorder()
	err := h.ServeHTTP(w, r, next)
	result, _ = repl.GetString("http.idempotency.result")
	if err != nil {
		return -1, result
	}
	return w.Code, result
}

// runID tells this test binary's keys from those of earlier runs.
var runID = pgtest.RandomHex(4)

// created is a next handler that counts its calls and answers 201.
func created(calls *atomic.Int32) caddyhttp.Handler {
	return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		calls.Add(1)
		w.WriteHeader(http.StatusCreated)
		return nil
	})
}
