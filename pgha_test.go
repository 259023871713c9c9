package idempotency

import (
	"context"
	"strings"
	"testing"
	"time"

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
