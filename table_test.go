package idempotency

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
)

// A table option that names an application's table (one with an
// expires_at column) is refused, at start and by every pruner, and the
// table is left as it was: no index added, no row deleted.
func TestPostgresRefusesForeignTable(t *testing.T) {
	dsn := testDSN(t)
	table := freshTable(t)
	pgExec(t, dsn, "CREATE TABLE "+table+" (id text PRIMARY KEY, expires_at timestamptz NOT NULL)")
	pgExec(t, dsn, "INSERT INTO "+table+" SELECT 'session-' || i, now() - interval '1 day' FROM generate_series(1, 5) AS i")
	untouched := func() {
		t.Helper()
		rows := pgQuery(t, dsn, `SELECT (SELECT count(*) FROM `+table+`),
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
	s := &PostgresStore{DSN: dsn, Table: table}
	if err := s.Provision(ctx); err != nil {
		t.Fatalf("provision: %v", err)
	}
	wantRefusal("start", s.ready(ctx))
	_ = s.Cleanup()

	off := false
	s = &PostgresStore{DSN: dsn, Table: table, Migrate: &off}
	if err := s.Provision(ctx); err != nil {
		t.Fatalf("provision with migrate off: %v", err)
	}
	defer s.Cleanup()
	_, err := s.Prune(ctx, 100)
	wantRefusal("prune", err)

	_, err = Migrate(ctx, s.pool, table)
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
	s := newTestPostgresStore(t, freshTable(t), 2)
	ctx := context.Background()
	req := testAcquireRequest("cred", "clock-key", "body")
	req.Retention = 10 * time.Second
	if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	if err := s.Complete(ctx, req.Key, req.Token, &store.Response{Status: 201, Body: []byte("x"), Replayable: true, BodySize: 1}, req.Retention); err != nil {
		t.Fatal(err)
	}
	mustExec(t, s, "UPDATE "+s.table.quoted()+" SET expires_at = now() + interval '2 seconds'")

	c := newReplayCache(s, 1<<20)
	c.now = func() time.Time { return time.Now().Add(-10 * time.Second) }
	start := time.Now()
	if res, err := c.Acquire(ctx, retryRequest(req)); err != nil || res.Outcome != store.OutcomeExisting {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	if c.get(req.Key, c.now()) == nil {
		t.Fatal("the completed record was not cached")
	}
	time.Sleep(time.Until(start.Add(2 * time.Second)))
	if rec := c.get(req.Key, c.now()); rec != nil {
		t.Fatalf("served from the cache after the record expired in the database")
	}
	if res, err := c.Acquire(ctx, retryRequest(req)); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire after expiry: %+v, %v; want the key free again", res, err)
	}
}

// A connection dialled while the database is silent (its replies lost,
// no reset) must not hold its place in the pool for ever: its startup
// never ends, and a pool whose places are all taken so answers every
// request with 503 long after the database is back. Catches a pool
// whose dials have no bound unless the DSN sets connect_timeout (ten
// silences of a second filled a pool of 16 for good).
func TestPostgresDialDuringSilenceIsBounded(t *testing.T) {
	t.Parallel()
	fwd := newTCPForwarder(t, postgresAddr(t, testDSN(t)))
	u, err := url.Parse(testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Host = fwd.Addr() // and no connect_timeout
	s := provisionTestStore(t, &PostgresStore{DSN: u.String(), Table: freshTable(t), MaxConns: 4})
	// Silences, each with requests that give up during it, having made
	// the pool dial connections for them.
	for round := range 6 {
		fwd.Mute()
		var wg sync.WaitGroup
		for i := range 8 {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
				defer cancel()
				_, _ = s.Acquire(ctx, testAcquireRequest("cred", fmt.Sprintf("silent-%d-%d", round, i), "body"))
			})
		}
		wg.Wait()
		fwd.Unmute()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*storeTimeout)
	defer cancel()
	start := time.Now()
	res, err := s.Acquire(ctx, testAcquireRequest("cred", "after", "body"))
	if err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire after the silence: %+v, %v (after %v); want created within the store timeout",
			res, err, time.Since(start).Round(time.Millisecond))
	}
}

// A database that is down refuses a new request at once (503), even when
// the first attempt went to a pooled connection that the outage had
// closed: writing to it fails before anything is sent, so there is no
// committed acquire to come back for. Waiting out the store timeout
// instead would hold every client for seconds in an outage.
func TestPostgresAcquireFailsFastWhenDatabaseDown(t *testing.T) {
	t.Parallel()
	fwd := newTCPForwarder(t, postgresAddr(t, testDSN(t)))
	s := provisionTestStore(t, &PostgresStore{DSN: throughForwarder(t, testDSN(t), fwd), Table: freshTable(t), MaxConns: 4})
	ctx := context.Background()
	// Several requests at once, so that the pool keeps several
	// connections, each dead after the cut.
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.Acquire(ctx, testAcquireRequest("cred", fmt.Sprintf("warm-%d", i), "body")); err != nil {
				t.Errorf("acquire: %v", err)
			}
		}()
	}
	wg.Wait()
	fwd.Cut()
	start := time.Now()
	_, err := s.Acquire(ctx, testAcquireRequest("cred", "during", "body"))
	// Half the store timeout: a loaded machine's margin, and still not
	// the timeout waited out.
	if took := time.Since(start); err == nil || took > storeTimeout/2 {
		t.Fatalf("acquire with the database down: %v after %v; want an error well within the store timeout (%v)",
			err, took.Round(time.Millisecond), storeTimeout)
	}
	fwd.Restore()
	res, err := s.Acquire(ctx, testAcquireRequest("cred", "during", "body"))
	if err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire after the restore: %+v, %v; want created (the refused attempt left nothing)", res, err)
	}
}

// An acquire whose connection the server ended is tried again, with the
// same token, instead of failing the request.
func TestPostgresAcquireSurvivesKilledConnections(t *testing.T) {
	t.Parallel()
	app := "idem_acq_" + randomHex(4)
	s := provisionTestStore(t, &PostgresStore{DSN: withApplicationName(testDSN(t), app), Table: freshTable(t), MaxConns: 4})
	ctx := context.Background()
	for i := range 5 {
		// Warm connections, then kill them all: the next statement on
		// each fails.
		warm := testAcquireRequest("cred", fmt.Sprintf("warm-%d", i), "body")
		if _, err := s.Acquire(ctx, warm); err != nil {
			t.Fatalf("acquire: %v", err)
		}
		rows := pgQuery(t, testDSN(t), "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1", app)
		if rows[0][0] == "0" {
			t.Fatalf("no connection killed")
		}
		req := testAcquireRequest("cred", fmt.Sprintf("after-kill-%d", i), "body")
		actx, done := context.WithTimeout(ctx, storeTimeout)
		res, err := s.Acquire(actx, req)
		done()
		if err != nil || res.Outcome != store.OutcomeCreated {
			t.Fatalf("acquire after the connections were killed: %+v, %v; want created", res, err)
		}
	}
}
