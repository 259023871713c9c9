package main

// The names of one run: the key namespace of each row, and the Postgres
// tables the run creates and drops.

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// runNames gives each row's keys a namespace of their own (8 characters:
// the run's prefix and the row).
type runNames struct{ prefix string }

func (r runNames) name(row string) string { return fmt.Sprintf("%s%-4.4s", r.prefix, row+"____") }

// tables are the Postgres tables of one run.
type tables struct {
	dsn   string
	main  string // rows 2, 3, 4, 7a, 7c, 7d and the scale runs
	store string // rows 6 and 6b: an empty table, as row 2 starts from
	// pgbench is rows 6p and 7p's: their records have numbers for keys,
	// which pgbench can make.
	pgbench string
	pools   string
	others  []string
}

func newTables(cfg config, prefix string) *tables {
	return &tables{
		dsn:     cfg.dsn,
		main:    "bench_" + prefix + "_main",
		store:   "bench_" + prefix + "_ceiling",
		pgbench: "bench_" + prefix + "_pgbench",
		pools:   "bench_" + prefix + "_pools",
	}
}

func (t *tables) drop(ctx context.Context) {
	conn, err := pgx.Connect(ctx, t.dsn)
	if err != nil {
		return
	}
	defer conn.Close(ctx)
	for _, name := range append([]string{t.main, t.store, t.pgbench, t.pools}, t.others...) {
		// With the store's tables beside each: the credential secret's
		// (migration 0003) and the primaries' (0004).
		for _, suffix := range []string{"", "_secret", "_primaries"} {
			_, _ = conn.Exec(ctx, "DROP TABLE IF EXISTS "+pgx.Identifier{name + suffix}.Sanitize())
		}
		_, _ = conn.Exec(ctx, "DELETE FROM idempotency_schema_migrations WHERE table_name = $1", name)
	}
}
