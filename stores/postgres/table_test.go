package postgres

import (
	"context"
	"fmt"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
)

// A connection dialled while the database is silent (its replies lost,
// no reset) must not hold its place in the pool for ever: its startup
// never ends, and a pool whose places are all taken so answers every
// request with 503 long after the database is back. Catches a pool
// whose dials have no bound unless the DSN sets connect_timeout (ten
// silences of a second filled a pool of 16 for good).
func TestPostgresDialDuringSilenceIsBounded(t *testing.T) {
	t.Parallel()
	fwd := pgtest.NewForwarder(t, pgtest.Addr(t, pgtest.DSN(t)))
	u, err := url.Parse(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Host = fwd.Addr() // and no connect_timeout
	s := provisionTestStore(t, &Store{DSN: u.String(), Table: pgtest.FreshTable(t), MaxConns: 4})
	// Silences, each with requests that give up during it, having made
	// the pool dial connections for them.
	for round := range 6 {
		fwd.Mute()
		var wg sync.WaitGroup
		for i := range 8 {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
				defer cancel()
				_, _ = s.Acquire(ctx, storetest.Request("cred", fmt.Sprintf("silent-%d-%d", round, i), "body"))
			})
		}
		wg.Wait()
		fwd.Unmute()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*store.CallTimeout)
	defer cancel()
	start := time.Now()
	res, err := s.Acquire(ctx, storetest.Request("cred", "after", "body"))
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
	fwd := pgtest.NewForwarder(t, pgtest.Addr(t, pgtest.DSN(t)))
	s := provisionTestStore(t, &Store{DSN: pgtest.ThroughForwarder(t, pgtest.DSN(t), fwd), Table: pgtest.FreshTable(t), MaxConns: 4})
	ctx := context.Background()
	// Several requests at once, so that the pool keeps several
	// connections, each dead after the cut.
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.Acquire(ctx, storetest.Request("cred", fmt.Sprintf("warm-%d", i), "body")); err != nil {
				t.Errorf("acquire: %v", err)
			}
		}()
	}
	wg.Wait()
	fwd.Cut()
	start := time.Now()
	_, err := s.Acquire(ctx, storetest.Request("cred", "during", "body"))
	// Half the store timeout: a loaded machine's margin, and still not
	// the timeout waited out.
	if took := time.Since(start); err == nil || took > store.CallTimeout/2 {
		t.Fatalf("acquire with the database down: %v after %v; want an error well within the store timeout (%v)",
			err, took.Round(time.Millisecond), store.CallTimeout)
	}
	fwd.Restore()
	res, err := s.Acquire(ctx, storetest.Request("cred", "during", "body"))
	if err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire after the restore: %+v, %v; want created (the refused attempt left nothing)", res, err)
	}
}

// An acquire whose connection the server ended is tried again, with the
// same token, instead of failing the request.
func TestPostgresAcquireSurvivesKilledConnections(t *testing.T) {
	t.Parallel()
	app := "idem_acq_" + pgtest.RandomHex(4)
	s := provisionTestStore(t, &Store{DSN: pgtest.WithApplicationName(pgtest.DSN(t), app), Table: pgtest.FreshTable(t), MaxConns: 4})
	ctx := context.Background()
	for i := range 5 {
		// Warm connections, then kill them all: the next statement on
		// each fails.
		warm := storetest.Request("cred", fmt.Sprintf("warm-%d", i), "body")
		if _, err := s.Acquire(ctx, warm); err != nil {
			t.Fatalf("acquire: %v", err)
		}
		rows := pgtest.Query(t, pgtest.DSN(t), "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1", app)
		if rows[0][0] == "0" {
			t.Fatalf("no connection killed")
		}
		req := storetest.Request("cred", fmt.Sprintf("after-kill-%d", i), "body")
		actx, done := context.WithTimeout(ctx, store.CallTimeout)
		res, err := s.Acquire(actx, req)
		done()
		if err != nil || res.Outcome != store.OutcomeCreated {
			t.Fatalf("acquire after the connections were killed: %+v, %v; want created", res, err)
		}
	}
}
