package postgres

// What a program outside the store, such as the handler's tests, needs to
// watch the store's statements and to stage its tables. Nothing in the
// store depends on them.

import "github.com/jackc/pgx/v5"

// QueryTracer traces the statements of every pool that a provisioned
// store opens while it is set: set it before any pool is opened (the
// handler's tests count the statements that a request costs with it).
var QueryTracer pgx.QueryTracer

// StatementName names sql, a statement that the store sends on table:
// "acquire", "complete", "release", "renew" or "lookup", or "" for
// another (a migration's, pruning's, a listener's).
func StatementName(table Table, sql string) string {
	q := newPostgresSQL(table)
	switch sql {
	case q.acquire.batch, q.acquire.one:
		return "acquire"
	case q.complete.batch, q.complete.one:
		return "complete"
	case q.release.batch, q.release.one:
		return "release"
	case q.renew.batch, q.renew.one:
		return "renew"
	case q.lookup:
		return "lookup"
	}
	return ""
}

// PrimaryLongUpSQL is the statement that makes the server look, to the
// leases of table, as if it had been the primary since long ago: a lease
// dated an hour back then means one that ran out while the server was up,
// not one that a failover since may have cut short.
func PrimaryLongUpSQL(table Table) string {
	return `INSERT INTO ` + table.PrimariesTable() + ` (system_identifier, timeline, started, first_seen)
	SELECT ` + thisPrimarySQL + `, ` + serverStartSQL + `, '-infinity'
	ON CONFLICT (system_identifier, timeline) DO UPDATE SET started = excluded.started, first_seen = excluded.first_seen`
}
