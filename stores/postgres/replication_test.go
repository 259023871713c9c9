package postgres

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestReplicationCheck: what the check finds, as a superuser and as a
// role without pg_read_all_stats (which sees the standbys' senders but
// not their state), on synchronous and asynchronous replication, and
// with a role whose commits do not wait for the standby.
func TestReplicationCheck(t *testing.T) {
	for _, synchronous := range []bool{true, false} {
		pair := pgtest.StartPair(t, synchronous, 0)
		pgtest.Exec(t, pair.PrimaryDSN(), "CREATE ROLE app LOGIN")
		pgtest.Exec(t, pair.PrimaryDSN(), "CREATE ROLE app_local LOGIN")
		pgtest.Exec(t, pair.PrimaryDSN(), "ALTER ROLE app_local SET synchronous_commit = local")
		for _, tc := range []struct {
			user string
			risk string // a prefix; "" for none
		}{
			{"postgres", map[bool]string{true: "", false: "standbys replicate asynchronously"}[synchronous]},
			{"app", map[bool]string{true: "", false: "standbys replicate asynchronously"}[synchronous]},
			{"app_local", map[bool]string{true: "synchronous_commit is local", false: "standbys replicate asynchronously"}[synchronous]},
		} {
			dsn := strings.Replace(pair.DSN(), "postgres@", tc.user+"@", 1)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			pool, err := pgxpool.New(ctx, dsn)
			if err != nil {
				t.Fatal(err)
			}
			r, err := checkReplication(ctx, pool)
			pool.Close()
			cancel()
			if err != nil {
				t.Errorf("synchronous %v, %s: %v", synchronous, tc.user, err)
				continue
			}
			if !strings.HasPrefix(r.risk, tc.risk) || (tc.risk == "") != (r.risk == "") {
				t.Errorf("synchronous %v, %s: risk %q, want %q (%+v)", synchronous, tc.user, r.risk, tc.risk, r)
			}
		}
	}
}

// A node demoted behind a connection that outlives it (a PgBouncer in
// front of each Patroni node keeps its clients' connections while its
// server turns standby) answers every write with 25006. The store must
// let go of those connections and find the primary on the multi-host
// DSN, not fail every request until pgxpool's MaxConnLifetime (an hour).
// A server set read-only by a reload stands in for the demotion: its
// sessions stay open and turn read-only, as a pooler's do.
func TestReadOnlyNodeIsLeft(t *testing.T) {
	a, _ := pgtest.StartPrimaryAlone(t, "''")
	b, _ := pgtest.StartPrimaryAlone(t, "''")
	// The table exists on both nodes, as it would after a failover.
	provisionTestStore(t, &Store{DSN: b.PrimaryDSN(), Table: "idempotency_keys"})
	dsn := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write",
		a.PrimaryPort, b.PrimaryPort)
	s := provisionTestStore(t, &Store{DSN: dsn, Table: "idempotency_keys", MaxConns: 4})
	ctx := context.Background()
	// Fill the pool: every connection is on a, and read-write.
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			storetest.MustAcquire(t, s, storetest.Request("cred", fmt.Sprintf("warm-%d", i), "{}"), store.OutcomeCreated)
		})
	}
	wg.Wait()

	pgtest.Exec(t, a.PrimaryDSN(), "ALTER SYSTEM SET default_transaction_read_only = on")
	pgtest.Exec(t, a.PrimaryDSN(), "SELECT pg_reload_conf()")
	storetest.WaitFor(t, 10*time.Second, "node a to turn read-only", func() bool {
		return pgtest.Query(t, a.PrimaryDSN(), "SHOW default_transaction_read_only")[0][0] == "on"
	})

	var errs []error
	for i := range 10 {
		req := storetest.Request("cred", fmt.Sprintf("after-%d", i), "{}")
		res, err := s.Acquire(ctx, req)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if res.Outcome != store.OutcomeCreated {
			t.Fatalf("acquire after the demotion: outcome %v", res.Outcome)
		}
		if n := pgtest.Query(t, b.PrimaryDSN(), "SELECT count(*) FROM idempotency_keys WHERE key = $1", req.Key.Key)[0][0]; n != "1" {
			t.Errorf("the record is not on node b, the writable one (%s rows)", n)
		}
		if len(errs) > 0 {
			t.Errorf("%d acquires failed before the store left the read-only node, want none: %v", len(errs), errs)
		}
		return
	}
	t.Fatalf("every acquire failed after node a turned read-only: %v", errs)
}
