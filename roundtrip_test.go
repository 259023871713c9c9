package idempotency

// Round trips to the store, counted through real HTTP: a pgx tracer sees
// every statement the Postgres store sends. A first execution costs two
// (acquire, complete), a replay one (acquire), and a replay from the
// replay cache none.

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func init() {
	// Before any pool is opened: every pool of the test binary is
	// traced, and statementCounter only counts the tables it watches.
	testQueryTracer = statementCounter
}

var statementCounter = &tableTracer{watched: make(map[string]*tableStatements)}

// tableTracer counts the statements and preparations that name a watched
// table.
type tableTracer struct {
	mu      sync.Mutex
	watched map[string]*tableStatements
}

type tableStatements struct {
	sql        postgresSQL
	statements []string // labels, in order
	prepares   int
}

// watch starts counting the statements on table.
func (tr *tableTracer) watch(t *testing.T, table string) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.watched[table] = &tableStatements{sql: newPostgresSQL(tableName{name: table})}
	t.Cleanup(func() {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		delete(tr.watched, table)
	})
}

// take returns and resets the statements and preparations seen on table.
func (tr *tableTracer) take(table string) (statements []string, prepares int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	ts := tr.watched[table]
	statements, prepares = ts.statements, ts.prepares
	ts.statements, ts.prepares = nil, 0
	return statements, prepares
}

func (tr *tableTracer) count(table string) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return len(tr.watched[table].statements)
}

func (tr *tableTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for table, ts := range tr.watched {
		if strings.Contains(data.SQL, table) {
			ts.statements = append(ts.statements, ts.label(data.SQL))
		}
	}
	return ctx
}

func (tr *tableTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (tr *tableTracer) TracePrepareStart(ctx context.Context, _ *pgx.Conn, data pgx.TracePrepareStartData) context.Context {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for table, ts := range tr.watched {
		if strings.Contains(data.SQL, table) {
			ts.prepares++
		}
	}
	return ctx
}

func (tr *tableTracer) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

func (ts *tableStatements) label(sql string) string {
	switch sql {
	case ts.sql.acquire.batch, ts.sql.acquire.one:
		return "acquire"
	case ts.sql.complete.batch, ts.sql.complete.one:
		return "complete"
	case ts.sql.release.batch, ts.sql.release.one:
		return "release"
	case ts.sql.renew.batch, ts.sql.renew.one:
		return "renew"
	case ts.sql.lookup:
		return "lookup"
	}
	first, _, _ := strings.Cut(strings.TrimSpace(sql), "\n")
	return "other: " + first
}

var (
	_ pgx.QueryTracer   = (*tableTracer)(nil)
	_ pgx.PrepareTracer = (*tableTracer)(nil)
)

func TestStoreRoundTrips(t *testing.T) {
	dsn := testDSN(t)
	table := freshTable(t)
	statementCounter.watch(t, table)
	up := newUpstream(t)

	// wantStatements waits for the request's statements (Complete may
	// still be running when the client has the whole response), then
	// checks that no more come.
	wantStatements := func(t *testing.T, what string, want ...string) {
		t.Helper()
		if len(want) > 0 {
			waitFor(t, 15*time.Second, fmt.Sprintf("%d statements", len(want)), func() bool {
				return statementCounter.count(table) >= len(want)
			})
		}
		time.Sleep(50 * time.Millisecond)
		got, prepares := statementCounter.take(table)
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
		waitFor(t, 15*time.Second, "the warm-up's statements", func() bool {
			return statementCounter.count(table) >= 2
		})
		time.Sleep(50 * time.Millisecond)
		statementCounter.take(table)
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
