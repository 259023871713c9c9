package idempotency

import (
	"context"
	"strings"
	"testing"

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
	err := s.Provision(ctx)
	if err == nil {
		_ = s.Cleanup()
	}
	wantRefusal("provision", err)

	off := false
	s = &PostgresStore{DSN: dsn, Table: table, Migrate: &off}
	if err := s.Provision(ctx); err != nil {
		t.Fatalf("provision with migrate off: %v", err)
	}
	defer s.Cleanup()
	_, err = s.Prune(ctx, 100)
	wantRefusal("prune", err)

	_, err = Migrate(ctx, s.pool, table)
	wantRefusal("migrate", err)

	res := runCLI(t, []string{"IDEMPOTENCY_DSN=" + dsn}, "prune", "--table", table)
	wantCLI(t, res, exitError, table, "not a table of idempotency records")
	untouched()
}
