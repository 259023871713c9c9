package idempotency

// Round trips to the store, counted through real HTTP: a pgx tracer sees
// every statement the Postgres store sends. A first execution costs two
// (acquire, complete), a replay one (acquire), and a replay from the
// replay cache none.

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
)

func init() {
	// Before any pool is opened: every pool of the test binary is
	// traced, and statementCounter only counts the tables it watches.
	postgres.QueryTracer = statementCounter
}

var statementCounter = &pgtest.StatementCounter{Name: func(table, sql string) string {
	tn, _ := postgres.ParseTable(table)
	return postgres.StatementName(tn, sql)
}}

func TestStoreRoundTrips(t *testing.T) {
	dsn := pgtest.DSN(t)
	table := pgtest.FreshTable(t)
	statementCounter.Watch(t, table)
	up := newUpstream(t)

	// wantStatements waits for the request's statements (Complete may
	// still be running when the client has the whole response), then
	// checks that no more come.
	wantStatements := func(t *testing.T, what string, want ...string) {
		t.Helper()
		if len(want) > 0 {
			storetest.WaitFor(t, 15*time.Second, fmt.Sprintf("%d statements", len(want)), func() bool {
				return statementCounter.Count(table) >= len(want)
			})
		}
		time.Sleep(50 * time.Millisecond)
		got, prepares := statementCounter.Take(table)
		if strings.Join(got, ",") != strings.Join(want, ",") {
			t.Errorf("%s: statements %q, want %q", what, got, want)
		}
		if prepares != 0 {
			t.Errorf("%s: %d statements prepared, want 0 once the connection is warm", what, prepares)
		}
	}
	// One connection, so that its prepared statements are those of
	// every request; no pruning, no renewals.
	start := func(t *testing.T, cache string) *site {
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store postgres {
			dsn %q
			table %s
			max_conns 1
		}
		prune_interval 0
		%s
	}
	reverse_proxy %s
}
`, port, dsn, table, cache, up.Addr()))
		// Warm the connection: its first statements are prepared.
		warm := call{Key: newKey(), Body: payBody()}
		wantExecuted(t, s.Do(t, warm), 201)
		storetest.WaitFor(t, 15*time.Second, "the warm-up's statements", func() bool {
			return statementCounter.Count(table) >= 2
		})
		time.Sleep(50 * time.Millisecond)
		statementCounter.Take(table)
		return s
	}

	done := call{Key: newKey(), Body: payBody()}
	var first reply
	t.Run("cache off", func(t *testing.T) {
		s := start(t, "replay_cache off")
		first = s.Do(t, done)
		wantExecuted(t, first, 201)
		wantStatements(t, "first execution", "acquire", "complete")
		for i := range 3 {
			wantReplayOf(t, s.Do(t, done), first)
			wantStatements(t, fmt.Sprintf("replay %d", i+1), "acquire")
		}
		other := done
		other.Body = payBody()
		wantProblem(t, s.Do(t, other), 409)
		wantStatements(t, "mismatch", "acquire")
		wantCount(t, up, 2)
	})
	if t.Failed() {
		return
	}

	t.Run("cache on", func(t *testing.T) {
		s := start(t, "replay_cache 1MiB")
		// Completed by the previous instance: the first replay learns it.
		wantReplayOf(t, s.Do(t, done), first)
		wantStatements(t, "first replay of another instance's record", "acquire")
		for i := range 3 {
			wantReplayOf(t, s.Do(t, done), first)
			wantStatements(t, fmt.Sprintf("cached replay %d", i+1))
		}
		other := done
		other.Body = payBody()
		wantProblem(t, s.Do(t, other), 409)
		wantStatements(t, "mismatch from the cache")

		// Executed here: replays come from the cache at once.
		c := call{Key: newKey(), Body: payBody()}
		r := s.Do(t, c)
		wantExecuted(t, r, 201)
		wantStatements(t, "first execution", "acquire", "complete")
		wantReplayOf(t, s.Do(t, c), r)
		wantStatements(t, "replay of this instance's record")

		// Another tenant, same key and body: its own execution, never the
		// cached response of the first tenant.
		b := c
		b.Cred = "Bearer tenant-b-token"
		rb := s.Do(t, b)
		wantExecuted(t, rb, 201)
		if rb.Header.Get("X-Execution-Id") == r.Header.Get("X-Execution-Id") {
			t.Error("tenant B got tenant A's response")
		}
		wantStatements(t, "another tenant's first execution", "acquire", "complete")
		wantReplayOf(t, s.Do(t, b), rb)
		wantStatements(t, "another tenant's replay")
		wantCount(t, up, 5) // two warm-ups, done, c, b
	})
}
