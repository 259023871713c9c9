package idempotency

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The start of the warning that pgha.go logs.
const asyncWarning = "a failover of this database can lose records"

// TestAsyncReplicationWarning: a store whose primary replicates
// asynchronously says so at start, once.
func TestAsyncReplicationWarning(t *testing.T) {
	pair := startPGPair(t, false, 0)
	s := protectedSite(t, storeBackend{Name: "postgres", DSN: pair.DSN(), Table: "idempotency_keys"}, "")
	var line map[string]any
	waitFor(t, 10*time.Second, "the replication warning", func() bool {
		for _, l := range s.moduleLogLines(t) {
			if msg, _ := l["msg"].(string); strings.HasPrefix(msg, asyncWarning) {
				line = l
				return true
			}
		}
		return false
	})
	if line["level"] != "warn" || line["synchronous_standby_names"] != "" || line["async_standbys"] == "" {
		t.Errorf("warning line %v: want level warn, synchronous_standby_names \"\", the standby named", line)
	}
	t.Logf("logged: %v", line)
}

// TestReplicationCheck: what the check finds, as a superuser and as a
// role without pg_read_all_stats (which sees the standbys' senders but
// not their state), on synchronous and asynchronous replication, and
// with a role whose commits do not wait for the standby.
func TestReplicationCheck(t *testing.T) {
	for _, synchronous := range []bool{true, false} {
		pair := startPGPair(t, synchronous, 0)
		pgExec(t, pair.PrimaryDSN(), "CREATE ROLE app LOGIN")
		pgExec(t, pair.PrimaryDSN(), "CREATE ROLE app_local LOGIN")
		pgExec(t, pair.PrimaryDSN(), "ALTER ROLE app_local SET synchronous_commit = local")
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
	a, _ := startPGPrimary(t, "''")
	b, _ := startPGPrimary(t, "''")
	// The table exists on both nodes, as it would after a failover.
	provisionTestStore(t, &PostgresStore{DSN: b.PrimaryDSN(), Table: "idempotency_keys"})
	dsn := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write",
		a.PrimaryPort, b.PrimaryPort)
	s := provisionTestStore(t, &PostgresStore{DSN: dsn, Table: "idempotency_keys", MaxConns: 4})
	ctx := context.Background()
	// Fill the pool: every connection is on a, and read-write.
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			mustAcquirePG(t, s, testAcquireRequest("cred", fmt.Sprintf("warm-%d", i), "{}"), store.OutcomeCreated)
		})
	}
	wg.Wait()

	pgExec(t, a.PrimaryDSN(), "ALTER SYSTEM SET default_transaction_read_only = on")
	pgExec(t, a.PrimaryDSN(), "SELECT pg_reload_conf()")
	waitFor(t, 10*time.Second, "node a to turn read-only", func() bool {
		return pgQuery(t, a.PrimaryDSN(), "SHOW default_transaction_read_only")[0][0] == "on"
	})

	var errs []error
	for i := range 10 {
		req := testAcquireRequest("cred", fmt.Sprintf("after-%d", i), "{}")
		res, err := s.Acquire(ctx, req)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if res.Outcome != store.OutcomeCreated {
			t.Fatalf("acquire after the demotion: outcome %v", res.Outcome)
		}
		if n := pgQuery(t, b.PrimaryDSN(), "SELECT count(*) FROM idempotency_keys WHERE key = $1", req.Key.Key)[0][0]; n != "1" {
			t.Errorf("the record is not on node b, the writable one (%s rows)", n)
		}
		if len(errs) > 0 {
			t.Errorf("%d acquires failed before the store left the read-only node, want none: %v", len(errs), errs)
		}
		return
	}
	t.Fatalf("every acquire failed after node a turned read-only: %v", errs)
}
