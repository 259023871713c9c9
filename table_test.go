package idempotency

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
	"github.com/caddyserver/caddy/v2"
)

// A table option that names an application's table (one with an
// expires_at column) is refused, at start and by every pruner, and the
// table is left as it was: no index added, no row deleted.
func TestPostgresRefusesForeignTable(t *testing.T) {
	dsn := pgtest.DSN(t)
	table := pgtest.FreshTable(t)
	pgtest.Exec(t, dsn, "CREATE TABLE "+table+" (id text PRIMARY KEY, expires_at timestamptz NOT NULL)")
	pgtest.Exec(t, dsn, "INSERT INTO "+table+" SELECT 'session-' || i, now() - interval '1 day' FROM generate_series(1, 5) AS i")
	untouched := func() {
		t.Helper()
		rows := pgtest.Query(t, dsn, `SELECT (SELECT count(*) FROM `+table+`),
	(SELECT count(*) FROM pg_index WHERE indrelid = to_regclass($1))`, table)
		if rows[0][0] != "5" || rows[0][1] != "1" {
			t.Fatalf("%s has %s rows and %s indexes; want its 5 rows and its primary key only", table, rows[0][0], rows[0][1])
		}
	}
	wantRefusal := func(what string, err error) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), table) || !strings.Contains(err.Error(), "not a table of idempotency records") {
			t.Errorf("%s: %v; want a refusal naming %s", what, err, table)
		}
		untouched()
	}

	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	s := &postgres.Store{DSN: dsn, Table: table}
	if err := s.Provision(ctx); err != nil {
		t.Fatalf("provision: %v", err)
	}
	wantRefusal("start", s.Ready(ctx))
	_ = s.Cleanup()

	off := false
	s = &postgres.Store{DSN: dsn, Table: table, Migrate: &off}
	if err := s.Provision(ctx); err != nil {
		t.Fatalf("provision with migrate off: %v", err)
	}
	defer s.Cleanup()
	_, err := s.Prune(ctx, 100)
	wantRefusal("prune", err)

	_, err = s.ApplyMigrations(ctx)
	wantRefusal("migrate", err)

	res := runCLI(t, []string{"IDEMPOTENCY_DSN=" + dsn}, "prune", "--table", table)
	wantCLI(t, res, exitError, table, "not a table of idempotency records")
	untouched()
}

// The replay cache never outlives the record as the database measures
// its lifetime, whatever the local clock says: here the local clock is
// 10s behind the database's, and the record has 2s left.
func TestReplayCacheFollowsTheDatabasesClock(t *testing.T) {
	t.Parallel()
	s := newTestPostgresStore(t, pgtest.FreshTable(t), 2)
	ctx := context.Background()
	req := storetest.Request("cred", "clock-key", "body")
	req.Retention = 10 * time.Second
	if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	if err := s.Complete(ctx, req.Key, req.Token, &store.Response{Status: 201, Body: []byte("x"), Replayable: true, BodySize: 1}, req.Retention); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, s.DSN, "UPDATE "+pgtest.QuoteIdent(s.Table)+" SET expires_at = now() + interval '2 seconds'")

	c := newReplayCache(s, 1<<20)
	c.now = func() time.Time { return time.Now().Add(-10 * time.Second) }
	start := time.Now()
	if res, err := c.Acquire(ctx, storetest.Retry(req)); err != nil || res.Outcome != store.OutcomeExisting {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	if c.get(req.Key, c.now()) == nil {
		t.Fatal("the completed record was not cached")
	}
	time.Sleep(time.Until(start.Add(2 * time.Second)))
	if rec := c.get(req.Key, c.now()); rec != nil {
		t.Fatalf("served from the cache after the record expired in the database")
	}
	if res, err := c.Acquire(ctx, storetest.Retry(req)); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire after expiry: %+v, %v; want the key free again", res, err)
	}
}
