package main

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
)

// The tables of a run are dropped with the store's tables beside them,
// which a run's migrations create too.
func TestTablesDropTheStoresSiblings(t *testing.T) {
	dsn := envOr("BENCH_DSN", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Skipf("no Postgres at %s: %v", dsn, err)
	}
	defer conn.Close(ctx)
	tables := newTables(config{dsn: dsn}, "tst")
	names := []string{tables.main, tables.main + "_secret", tables.main + "_primaries"}
	for _, name := range names {
		if _, err := conn.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+pgx.Identifier{name}.Sanitize()+" ()"); err != nil {
			t.Fatal(err)
		}
	}
	tables.drop(ctx)
	var left []string
	rows, err := conn.Query(ctx, "SELECT tablename FROM pg_tables WHERE tablename = ANY ($1)", names)
	if err == nil {
		left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(left) > 0 {
		t.Errorf("left after the run: %v", left)
	}
}
