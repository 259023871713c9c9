package postgres

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"

	schema "github.com/caddy-idempotency/idempotency/migrations"
	"github.com/jackc/pgx/v5"
)

// MigrationsTable records which migrations each table has had. It lives
// in the table's schema, where the database user is known to be allowed to
// create tables.
const MigrationsTable = "idempotency_schema_migrations"

// migrationLockKey serialises migrations across every instance and every
// table of a cluster: starting several instances together must not run a
// migration twice, and migrations are rare enough that sharing one lock
// costs nothing.
var migrationLockKey = advisoryKey("idempotency migrations")

// TxBeginner opens a transaction. *pgxpool.Pool, *pgx.Conn and pgx.Tx
// satisfy it.
type TxBeginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Migrate applies to table the embedded migrations it has not had yet,
// each in its own transaction under an advisory lock, and returns how many
// it applied. table is a name as the store's "table" option takes it.
func Migrate(ctx context.Context, db TxBeginner, table string) (applied int, err error) {
	t, err := ParseTable(table)
	if err != nil {
		return 0, fmt.Errorf("migrating: %w", err)
	}
	migrations, err := loadMigrations()
	if err != nil {
		return 0, err
	}
	for _, m := range migrations {
		ok, err := applyMigration(ctx, db, t, m)
		if err != nil {
			return applied, fmt.Errorf("migrating %s to version %d (%s): %w", t, m.version, m.name, err)
		}
		if ok {
			applied++
		}
	}
	return applied, nil
}

type migration struct {
	version int
	name    string
	sql     string
}

var migrationName = regexp.MustCompile(`^([0-9]{4})_[a-z0-9_]+\.sql$`)

// loadMigrations returns the embedded migrations in version order.
func loadMigrations() ([]migration, error) {
	entries, err := schema.Files.ReadDir(".")
	if err != nil {
		return nil, err
	}
	var migrations []migration
	for _, e := range entries {
		m := migrationName.FindStringSubmatch(e.Name())
		if m == nil {
			return nil, fmt.Errorf("migration file %s is not named NNNN_name.sql", e.Name())
		}
		version, _ := strconv.Atoi(m[1]) // four digits
		sql, err := schema.Files.ReadFile(e.Name())
		if err != nil {
			return nil, err
		}
		migrations = append(migrations, migration{version: version, name: e.Name(), sql: string(sql)})
	}
	slices.SortFunc(migrations, func(a, b migration) int { return a.version - b.version })
	for i, m := range migrations {
		if m.version != i+1 {
			return nil, fmt.Errorf("migration %s: expected version %d", m.name, i+1)
		}
	}
	return migrations, nil
}

// applyMigration applies m to t unless the bookkeeping says it was, and
// reports whether it did.
func applyMigration(ctx context.Context, db TxBeginner, t Table, m migration) (bool, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer tx.Rollback(ctx) // a no-op once committed

	// The lock comes first: CREATE TABLE IF NOT EXISTS is not safe
	// against a concurrent identical statement.
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", unnamed, migrationLockKey); err != nil {
		return false, err
	}
	if err := checkTable(ctx, tx, t); err != nil {
		return false, err
	}
	bookkeeping := t.sibling(MigrationsTable)
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+bookkeeping+` (
	table_name text NOT NULL,
	version integer NOT NULL,
	name text NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now(),
	PRIMARY KEY (table_name, version)
)`); err != nil {
		return false, err
	}
	var done bool
	if err := tx.QueryRow(ctx,
		`SELECT EXISTS (SELECT FROM `+bookkeeping+` WHERE table_name = $1 AND version = $2)`,
		unnamed, t.String(), m.version,
	).Scan(&done); err != nil {
		return false, err
	}
	if done && m.version == 1 {
		// The bookkeeping outlives a table dropped by hand, and would
		// keep it from being created again: every request would then
		// fail on a missing relation. A missing table is a table with no
		// migrations, the later ones included.
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, unnamed, t.quoted()).Scan(&exists); err != nil {
			return false, err
		}
		if !exists {
			if _, err := tx.Exec(ctx, `DELETE FROM `+bookkeeping+` WHERE table_name = $1`, unnamed, t.String()); err != nil {
				return false, err
			}
			done = false
		}
	}
	if done {
		return false, tx.Commit(ctx)
	}
	// Without arguments, pgx sends the file as one simple query, which
	// may hold several statements.
	if _, err := tx.Exec(ctx, t.render(m.sql)); err != nil {
		return false, err
	}
	if _, err := tx.Exec(ctx,
		`INSERT INTO `+bookkeeping+` (table_name, version, name) VALUES ($1, $2, $3)`,
		unnamed, t.String(), m.version, m.name,
	); err != nil {
		return false, err
	}
	return true, tx.Commit(ctx)
}

// recordTableColumns are the columns, with their types, that migration
// 0001 creates: a table that exists but lacks one is not a table of
// records, and is neither migrated nor pruned.
var recordTableColumns = map[string]string{
	"credential_hash":  "bytea",
	"key":              "text",
	"fingerprint":      "bytea",
	"method":           "text",
	"path":             "text",
	"status":           "text",
	"lock_token":       "bytea",
	"locked_at":        "timestamp with time zone",
	"created_at":       "timestamp with time zone",
	"expires_at":       "timestamp with time zone",
	"response_status":  "integer",
	"response_headers": "jsonb",
	"response_body":    "bytea",
	"replayable":       "boolean",
	"response_size":    "bigint",
}

// queryRower runs a query of one row: a pool, a connection and a
// transaction do.
type queryRower interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// checkTable returns an error naming t if t exists but is not a table of
// records, with their columns and primary key (credential_hash, key): a
// table option that names an application's table by mistake must not
// have an index added to it, nor its rows pruned.
func checkTable(ctx context.Context, db queryRower, t Table) error {
	var (
		exists  bool
		columns map[string]string
		pkey    []string
	)
	err := db.QueryRow(ctx, `SELECT c.oid IS NOT NULL,
	(SELECT jsonb_object_agg(a.attname, format_type(a.atttypid, a.atttypmod))
		FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped),
	(SELECT array_agg(a.attname::text ORDER BY k.i)
		FROM pg_index x, unnest(x.indkey::int2[]) WITH ORDINALITY AS k(attnum, i), pg_attribute a
		WHERE x.indrelid = c.oid AND x.indisprimary AND a.attrelid = c.oid AND a.attnum = k.attnum)
FROM (SELECT to_regclass($1)::oid AS oid) AS c`, unnamed, t.quoted()).Scan(&exists, &columns, &pkey)
	if err != nil {
		return fmt.Errorf("checking table %s: %w", t, err)
	}
	if !exists {
		return nil
	}
	var missing []string
	for name, typ := range recordTableColumns {
		if columns[name] != typ {
			missing = append(missing, name+" "+typ)
		}
	}
	slices.Sort(missing)
	if len(missing) > 0 || !slices.Equal(pkey, []string{"credential_hash", "key"}) {
		return fmt.Errorf("table %s is not a table of idempotency records (columns %s, primary key (%s)); refusing to migrate or prune it: check the store's table option",
			t, describeMissing(missing), strings.Join(pkey, ", "))
	}
	return nil
}

func describeMissing(missing []string) string {
	if len(missing) == 0 {
		return "as expected"
	}
	return "missing or of another type: " + strings.Join(missing, ", ")
}

// defaultTableIdents matches, in a migration, the default table name and
// the names derived from it (idempotency_keys_expires_at_idx).
var defaultTableIdents = regexp.MustCompile(`\b` + DefaultTable + `(\w*)\b`)

// render rewrites a migration written for the default table for t. A
// derived name keeps its suffix: an index is named after its table, and
// index names must be unique in a schema. The secret's and the primaries'
// tables, and the functions, are qualified like t; an index's name must
// not be.
func (t Table) render(sql string) string {
	return defaultTableIdents.ReplaceAllStringFunc(sql, func(ident string) string {
		suffix := strings.TrimPrefix(ident, DefaultTable)
		switch suffix {
		case "":
			return t.quoted()
		case secretTableSuffix:
			return t.SecretTable()
		case primariesTableSuffix:
			return t.PrimariesTable()
		case acquireRowsSuffix, ownedRowsSuffix, completeRowsSuffix:
			return t.rowsFunction(suffix)
		}
		return pgx.Identifier{derivedName(t.name, suffix)}.Sanitize()
	})
}
