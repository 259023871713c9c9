package postgres

// The Postgres store's SQL text: the statements of one table, built once
// at Provision.

import (
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/caddy-idempotency/idempotency/store"
)

// postgresSQL holds the statements of one table. They are built once, at
// Provision, because the table name cannot be a query parameter.
type postgresSQL struct {
	acquire, complete, release, renew statement
	pruneBatch                        string
	// completedBy and gone tell, after a completion or a release that
	// changed no row, whether an earlier attempt of the same call did.
	completedBy, gone string
	// lookup reads the live completed record of one key: the one
	// primary-key lookup that a replay cannot do without, alone (bench
	// row 7a measures it; acquire looks up every row of its batch).
	lookup string
}

// unnamed, first among a statement's arguments, has pgx run it without a
// named prepared statement (describe, then execute), whatever the dsn's
// mode. The statements of a store's start, its checks and the CLI's are
// run so: each runs once, and in pgx's default mode through a
// transaction pooler, a named statement that one instance's start leaves
// on a server connection is met again by the next instance's start on
// that connection ("already exists"), which would then never start. The
// requests' statements keep the dsn's mode, so that a pooler that loses
// them is still named (nameExecMode).
const unnamed = pgx.QueryExecModeDescribeExec

// recordColumns are the columns of a record, in the order that acquire's
// and the lookup's rows give them. The headers are in
// response_header_bytes, or as JSON in response_headers on records that
// were completed before migration 0002. The last column is the record's
// remaining lifetime in microseconds, measured by the database, which
// the replay cache relies on instead of comparing clocks.
const recordColumns = `status, fingerprint, method, path, created_at, expires_at,
	locked_at, locked_until, response_status,
	COALESCE(response_header_bytes, convert_to(response_headers::text, 'UTF8')) AS headers,
	response_body, replayable, response_size,
	(extract(epoch FROM expires_at - now()) * 1000000)::bigint AS ttl_us`

// recordColumnNames names recordColumns in a row that gives them (in
// acquire, the rows found).
const recordColumnNames = `status, fingerprint, method, path, created_at, expires_at,
	locked_at, locked_until, response_status, headers, response_body, replayable, response_size, ttl_us`

// primariesTableSuffix names the table where the instances of a Postgres
// table note when they first saw each primary (migration 0004).
const primariesTableSuffix = "_primaries"

// The suffixes of the functions of migration 0006 that give a batch's
// rows (inputRows), one per kind of row.
const (
	acquireRowsSuffix  = "_acquire_rows_v1"
	ownedRowsSuffix    = "_owned_rows_v1"
	completeRowsSuffix = "_complete_rows_v1"
)

// rowsFunction is the quoted name of t's function of migration 0006 with
// suffix, in t's schema.
func (t Table) rowsFunction(suffix string) string {
	return t.sibling(derivedName(t.name, suffix))
}

// PrimariesTable is the quoted name of t's primaries table, in t's schema.
func (t Table) PrimariesTable() string {
	return t.sibling(derivedName(t.name, primariesTableSuffix))
}

// thisPrimarySQL is the server's system identifier and timeline, the key
// of its row in the primaries table. The timeline is the current WAL
// file's (a promotion starts a new one at once; pg_control's checkpoint
// timeline changes only at the next checkpoint), read by every
// statement: a standby promoted keeps its connections, and their next
// statements must see the new timeline. A standby has none: the CASE
// keeps pg_walfile_name, which fails during recovery, from being called
// there. pg_control_system() reads pg_control from disk, some
// microseconds of the server's CPU: acquire reads it once
// (thisPrimaryCTE). It is not kept in a session setting, which would be
// cheaper: the store keeps no session state, for the poolers that share
// server connections.
const thisPrimarySQL = `(SELECT system_identifier FROM pg_control_system()),
	CASE WHEN NOT pg_is_in_recovery() THEN ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::int END`

// serverStartSQL is when the server last started: the postmaster's
// start, or its recovery from a crash, the later. After a crash (a backend
// killed), the postmaster restarts every process and recovers without a
// new start time or timeline, but recovery discards the statistics and
// dates their reset (migration 0005). A reset by hand of the bgwriter's
// statistics also counts as a start: it delays takeovers by a lease.
const serverStartSQL = `GREATEST(pg_postmaster_start_time(), pg_stat_get_bgwriter_stat_reset_time())`

// primarySinceSQL is when the server became the primary that it is now:
// the first acquire that it served on its timeline since it last started
// (serverStartSQL). Without such a row (a standby promoted, or a server
// restarted, that no acquire has reached yet, or a standby), it is
// now(): time spent before is not known to have been spent as this
// primary, up.
func primarySinceSQL(t Table) string {
	return primarySinceFrom(firstSeenSQL(t, thisPrimarySQL, serverStartSQL))
}

// firstSeenSQL is the first_seen of the row of the server key (its
// system identifier and timeline) in t's primaries table, noted since
// started, the server's last start: NULL without one.
func firstSeenSQL(t Table, key, started string) string {
	return fmt.Sprintf(`(SELECT p.first_seen FROM %s AS p
	WHERE (p.system_identifier, p.timeline) = (%s) AND p.started >= %s)`, t.PrimariesTable(), key, started)
}

// primarySinceFrom is primarySinceSQL with firstSeen, the first_seen of
// the server's row in the primaries table since its last start (NULL
// without one).
func primarySinceFrom(firstSeen string) string {
	return `COALESCE(` + firstSeen + `, now())`
}

// thisPrimaryCTE is the WITH query, named this_primary, of a statement
// that judges leases and notes the primary (acquire): the server's
// system identifier, its timeline, its last start and the first_seen of
// its row since that start, looked up once for both.
func thisPrimaryCTE(t Table) string {
	return fmt.Sprintf(`this_primary AS (
	SELECT s.system_identifier, s.timeline, s.started, %s AS first_seen
	FROM (SELECT %s, %s) AS s (system_identifier, timeline, started)
)`, firstSeenSQL(t, "s.system_identifier, s.timeline", "s.started"), thisPrimarySQL, serverStartSQL)
}

// notePrimarySQL notes the server in the primaries table if this_primary
// (thisPrimaryCTE) found no row since its last start: a data-modifying
// WITH query of acquire. Its row is not seen by the statement that
// writes it (one snapshot), which judges leases as if there were none.
// Of acquires racing after a start, one rewrites the row; the others'
// updates find it current.
func notePrimarySQL(t Table) string {
	return fmt.Sprintf(`INSERT INTO %s AS p (system_identifier, timeline, started, first_seen)
	SELECT system_identifier, timeline, started, now() FROM this_primary
	WHERE timeline IS NOT NULL AND first_seen IS NULL
	ON CONFLICT (system_identifier, timeline) DO UPDATE SET started = excluded.started, first_seen = excluded.first_seen
	WHERE p.started IS NULL OR p.started < excluded.started`, t.PrimariesTable())
}

// leaseEndSQL is when the lease of the in-progress row row of t ends:
// locked_until, or for rows written before migration 0002, locked_at
// plus lockTimeout (an SQL interval), the lock timeout of whoever asks;
// but never sooner than the lease's length after the server became the
// primary it is now (primarySinceSQL). Time during which the database
// was down, or had no primary, does not count against a lease: an owner
// that waits for the database to store its answer gets, once it is back,
// a whole lease to renew or to complete, before a retry can take over.
// A dead owner's record is taken over too, only that much later.
//
// "The owner is gone" is one rule, that of a takeover, a renewal and a
// non-forced release alike: the lease has ended, leaseEndSQL <= now() by
// the database's clock. A renewal succeeds only while it is live, and
// the row lock orders it with a takeover or a release, so a late owner
// never renews a record that either could have taken.
//
// since is primarySinceSQL, or a statement's reference to it.
func leaseEndSQL(since, row, lockTimeout string) string {
	return fmt.Sprintf(`GREATEST(COALESCE(%[1]s.locked_until, %[1]s.locked_at + %[2]s),
	%[3]s + COALESCE(%[1]s.locked_until - %[1]s.locked_at, %[2]s))`, row, lockTimeout, since)
}

// microseconds turns a parameter of microseconds into an interval: the
// batched statements take durations as arrays of bigint.
const microseconds = ` * interval '1 microsecond'`

func newPostgresSQL(t Table) postgresSQL {
	table := t.quoted()
	// The row is found through the primary key alone, and only then
	// tested: OFFSET 0 keeps the planner from pushing the tests into the
	// scan. Otherwise, once most rows are expired (a pruning backlog) and
	// ANALYZE has seen it, the planner estimates that hardly any row has
	// expires_at > now() and looks keys up through the expires_at index,
	// filtering every live record for each lookup: with a million expired
	// rows, first executions fell to a third of their rate, and lower as
	// live records accumulated.
	lookup := fmt.Sprintf(`SELECT %s
FROM (SELECT * FROM %s WHERE credential_hash = $1 AND key = $2 OFFSET 0) AS r
WHERE status = 'completed' AND expires_at > now()`, recordColumns, table)
	return postgresSQL{
		lookup:  lookup,
		acquire: acquireSQL(t),

		complete: completeSQL(t, false),
		release:  releaseSQL(t, false),

		completedBy: fmt.Sprintf(`SELECT EXISTS (SELECT FROM %s
WHERE credential_hash = $1 AND key = $2 AND completed_token = $3 AND status = 'completed')`, table),

		gone: fmt.Sprintf(`SELECT NOT EXISTS (SELECT FROM %s WHERE credential_hash = $1 AND key = $2)`, table),

		// The lease keeps the length its owner gave it at acquire; the
		// record must outlive it. A lease that has ended is not renewed
		// (leaseEndSQL): from then on a retry or an operator may take
		// the record.
		renew: ownedStatement(t, false, `UPDATE %[1]s AS r SET
	locked_at = now(),
	locked_until = now() + (r.locked_until - r.locked_at),
	expires_at = GREATEST(r.expires_at, now() + (r.locked_until - r.locked_at))
FROM input AS i
WHERE r.credential_hash = i.in_hash AND r.key = i.in_key AND r.lock_token = i.in_token AND r.status = 'in_progress'
	AND `+leaseEndSQL(primarySinceSQL(t), "r", "NULL::interval")+` > now()`),

		// ctid lets the batch be picked through the expires_at index and
		// deleted without a second lookup. Rows that a batch of acquires
		// holds (taking expired records over) are skipped, not waited
		// for: the two would lock them in different orders. The outer tests are rechecked
		// on the latest row version, so a record that Acquire revived
		// meanwhile survives. A live lease keeps a record whatever its
		// expiry (only rows written before migration 0002 can have one
		// past it).
		pruneBatch: fmt.Sprintf(`DELETE FROM %[1]s AS r
WHERE ctid = ANY (ARRAY (SELECT ctid FROM %[1]s WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED))
	AND expires_at <= now() AND (locked_until IS NULL OR %[2]s <= now())`, table, leaseEndSQL(primarySinceSQL(t), "r", "NULL::interval")),
	}
}

// acquireColumns are acquire's parameters, one row per request.
var acquireColumns = []string{"bytea in_hash", "text in_key", "bytea in_fingerprint", "text in_method",
	"text in_path", "bytea in_token", "bigint in_retention_us", "bigint in_lock_us"}

// acquireSQL is the acquire of t.
func acquireSQL(t Table) statement {
	table := t.quoted()
	// Every request's row is looked up first, through the primary
	// key (a lateral subquery per row, OFFSET 0 for the reason given
	// in newPostgresSQL), in the statement's snapshot.
	//
	// The INSERT claims the key when no row exists. When one does, ON
	// CONFLICT turns it into a compare-and-swap that succeeds only on
	// an expired record (treated as absent) or on a stale lock held
	// for the same request; Postgres runs it on the latest committed
	// row version, under the row lock, so exactly one concurrent
	// caller wins. Whoever claims nothing gets the row it looked up,
	// if that row is live or in progress. A request whose row neither
	// existed in the snapshot nor was claimed (another transaction
	// inserted it after the snapshot was taken) gets -1 and tries
	// again; so does one whose snapshot's row was an expired record
	// that it could not claim: another transaction took the record
	// after the snapshot, to execute it again, and the expired answer
	// must never be replayed, not even to a request that raced that
	// re-execution.
	//
	// The lease is the record's: its owner sets locked_until from
	// its own lock timeout, and a takeover waits for it whatever the
	// retrier's timeout. An in_progress record whose lease is live
	// is never expired: renewals keep expires_at at or after
	// locked_until, and the expiry test also checks the lease, for
	// rows written before migration 0002.
	//
	// A takeover keeps created_at (it is the same request, retried),
	// which is how the result tells a takeover from a creation.
	//
	// A live completed record, the common case of a retry, is
	// immutable until it expires: it is not offered to the INSERT,
	// so a replay neither locks the row nor writes, and costs what a
	// SELECT costs. Everything else goes to the INSERT, whose
	// arbitration on the latest row version is what makes a key
	// execute once.
	//
	// A record in progress under the caller's own token, with a live
	// lease, was created by an earlier attempt of this very acquire,
	// whose reply was lost: it is the caller's, as created.
	//
	// The requests of a batch are distinct keys (ON CONFLICT cannot
	// affect a row twice), and the INSERT takes them in the batch's
	// order, the same on every instance, so that batches never
	// deadlock on each other's row locks.
	// The server's primary_since is read once, and only by a statement
	// that judges a lease; the lookup it needs tells the note too
	// whether the server has a row.
	const since = "(SELECT since FROM primary_since)"
	return newStatement(t.rowsFunction(acquireRowsSuffix), acquireColumns, func(rows string) string {
		return fmt.Sprintf(`WITH input AS (
	%[9]s
), %[12]s, primary_since AS (
	SELECT %[13]s AS since FROM this_primary
), found AS (
	SELECT i.n,
		r.status = 'completed' AND r.expires_at > now() AS live,
		r.status = 'in_progress' AND r.lock_token = i.in_token AND %[11]s > now() AS mine,
		%[5]s
	FROM input AS i
	CROSS JOIN LATERAL (SELECT * FROM %[1]s WHERE credential_hash = i.in_hash AND key = i.in_key OFFSET 0) AS r
), claimed AS (
	INSERT INTO %[1]s AS r (credential_hash, key, fingerprint, method, path, status,
		lock_token, locked_at, locked_until, created_at, expires_at)
	SELECT in_hash, in_key, in_fingerprint, in_method, in_path, 'in_progress', in_token,
		now(), now() + in_lock_us%[7]s, now(), now() + GREATEST(in_retention_us, in_lock_us)%[7]s
	FROM input AS i
	WHERE NOT EXISTS (SELECT FROM found AS f WHERE f.n = i.n AND (f.live OR f.mine))
	ORDER BY n
	ON CONFLICT (credential_hash, key) DO UPDATE SET
		fingerprint = excluded.fingerprint,
		method = excluded.method,
		path = excluded.path,
		status = 'in_progress',
		lock_token = excluded.lock_token,
		locked_at = excluded.locked_at,
		locked_until = excluded.locked_until,
		created_at = CASE WHEN r.expires_at <= now() THEN excluded.created_at ELSE r.created_at END,
		expires_at = excluded.expires_at,
		response_status = NULL,
		response_headers = NULL,
		response_header_bytes = NULL,
		response_body = NULL,
		replayable = NULL,
		response_size = NULL,
		completed_token = NULL
	WHERE (r.expires_at <= now() AND (r.status = 'completed' OR %[6]s <= now()))
		OR (r.status = 'in_progress'
			AND r.fingerprint = excluded.fingerprint
			AND %[6]s <= now())
	RETURNING credential_hash, key, created_at = now() AS fresh
), noted AS (
	%[10]s
)
SELECT i.n, CASE
		WHEN c.fresh THEN %[2]d
		WHEN NOT c.fresh THEN %[3]d
		WHEN f.mine THEN %[2]d
		WHEN f.live OR f.status = 'in_progress' THEN %[4]d
		ELSE -1
	END,
	%[8]s
FROM input AS i
LEFT JOIN claimed AS c ON c.credential_hash = i.in_hash AND c.key = i.in_key
LEFT JOIN found AS f ON f.n = i.n`,
			table, store.OutcomeCreated, store.OutcomeTakenOver, store.OutcomeExisting, recordColumns,
			leaseEndSQL(since, "r", "(excluded.locked_until - excluded.locked_at)"), microseconds, recordColumnNames, rows, notePrimarySQL(t),
			leaseEndSQL(since, "r", "NULL::interval"), thisPrimaryCTE(t), primarySinceFrom("first_seen"))
	})
}

// completeSQL is the completion of table. The retention counts from the
// completion: a request that ran long keeps its record as long as a
// quick one. A NULL body is one that was not kept. notify makes it wake
// the records' waiters (pglisten.go).
func completeSQL(t Table, notify bool) statement {
	return ownedStatement(t, notify, `UPDATE %[1]s AS r SET
	status = 'completed',
	lock_token = NULL,
	locked_at = NULL,
	locked_until = NULL,
	completed_token = i.in_token,
	expires_at = now() + i.in_retention_us`+microseconds+`,
	response_status = i.in_status,
	response_header_bytes = i.in_headers,
	response_body = i.in_body,
	replayable = i.in_replayable,
	response_size = i.in_size
FROM input AS i
WHERE r.credential_hash = i.in_hash AND r.key = i.in_key AND r.lock_token = i.in_token AND r.status = 'in_progress'`,
		"int in_status", "bytea in_headers", "bytea in_body", "boolean in_replayable", "bigint in_size", "bigint in_retention_us")
}

// releaseSQL is the release of table; notify as for completeSQL.
func releaseSQL(t Table, notify bool) statement {
	return ownedStatement(t, notify, `DELETE FROM %[1]s AS r
USING input AS i
WHERE r.credential_hash = i.in_hash AND r.key = i.in_key AND r.lock_token = i.in_token AND r.status = 'in_progress'`)
}

// ownedStatement builds a statement on the records that callers own:
// body works on the rows of input, each a record key and its owner's
// token (in_hash, in_key, in_token) followed by the columns cols (each
// "type name", as for inputRows), and only on the rows that the token
// still owns. The statement returns the ordinal of each row it changed:
// a row missing from its answer has lost its lock. With notify, the
// parameter after the rows' is the NOTIFY channel, and the next one an
// array of the payload of each row, and every row changed wakes its
// waiters.
func ownedStatement(t Table, notify bool, body string, cols ...string) statement {
	fn := t.rowsFunction(ownedRowsSuffix)
	if len(cols) > 0 {
		fn = t.rowsFunction(completeRowsSuffix)
	}
	cols = append([]string{"bytea in_hash", "text in_key", "bytea in_token"}, cols...)
	table := t.quoted()
	// The rows are locked before body changes them, one at a time in the
	// batch's order (sendBatch sorts it; the lateral subquery makes the
	// nested loop follow it): the order of the acquires' INSERT too, the
	// same on every instance, so that batches of several instances, each
	// holding some rows while waiting for others, never wait for each
	// other in a cycle. The subquery finds each row through the primary
	// key whatever the table's size when a connection planned it: a join,
	// planned on a new, empty table, scanned the table for every batch
	// for as long as the connection kept the plan. body's own join of
	// input to the table is a primary-key lookup per row because the
	// planner counts input's rows as one (migration 0006).
	body = fmt.Sprintf(body, table)
	return newStatement(fn, cols, func(rows string) string {
		input := fmt.Sprintf(`WITH given AS (
	%s
), input AS (
	SELECT g.* FROM given AS g
	CROSS JOIN LATERAL (SELECT FROM %s AS x WHERE x.credential_hash = g.in_hash AND x.key = g.in_key FOR UPDATE) AS x
)`, rows, table)
		if !notify {
			return input + "\n" + body + "\nRETURNING i.n"
		}
		n := len(cols)
		return fmt.Sprintf("%s, done AS (\n%s\nRETURNING i.n\n)\nSELECT n, pg_notify($%d, ($%d::text[])[n]) FROM done",
			input, body, n+1, n+2)
	})
}
