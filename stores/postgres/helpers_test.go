package postgres

import (
	"context"
	"os"
	"testing"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddyserver/caddy/v2"
)

func init() {
	// Before any pool is opened: every pool of the test binary is
	// traced, and statementCounter only counts the tables it watches.
	QueryTracer = statementCounter
}

// statementCounter counts the statements that the tests' stores send.
var statementCounter = &pgtest.StatementCounter{Name: func(table, sql string) string {
	tn, _ := ParseTable(table)
	return StatementName(tn, sql)
}}

func TestMain(m *testing.M) {
	code := m.Run()
	pgtest.Cleanup()
	os.Exit(code)
}

// newTestStore provisions a store on table as Caddy would, and
// cleans it up when the test ends.
func newTestStore(t *testing.T, table string, maxConns int32) *Store {
	t.Helper()
	return provisionTestStore(t, &Store{DSN: pgtest.DSN(t), Table: table, MaxConns: maxConns})
}

// provisionTestStore provisions s as Caddy would, waits for its start
// (its migrations), and cleans it up when the test ends.
func provisionTestStore(t *testing.T, s *Store) *Store {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := s.Provision(ctx); err != nil {
		t.Fatalf("provisioning: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Cleanup(); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	if err := s.Ready(ctx); err != nil {
		t.Fatalf("starting: %v", err)
	}
	if err := s.Validate(); err != nil {
		t.Fatalf("validating: %v", err)
	}
	return s
}

func mustExec(t *testing.T, s *Store, sql string, args ...any) {
	t.Helper()
	if _, err := s.pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// migrationCount is how many migrations a new table gets.
func migrationCount(t testing.TB) int {
	t.Helper()
	migrations, err := loadMigrations()
	if err != nil {
		t.Fatal(err)
	}
	return len(migrations)
}

// primaryLongUp makes the server look, to the leases of table, as if it
// had been the primary since long ago (PrimaryLongUpSQL).
func primaryLongUp(t testing.TB, dsn, table string) {
	t.Helper()
	tn, err := ParseTable(table)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, dsn, PrimaryLongUpSQL(tn))
}
