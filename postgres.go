package idempotency

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(PostgresStore{})
}

// PostgresStore keeps idempotency records in a Postgres table that any
// number of Caddy instances share. The primary key (credential_hash, key)
// is what makes a key execute once, and every time comparison uses the
// database's clock, so that instances whose clocks drift still agree on
// which locks are stale and which records have expired.
type PostgresStore struct {
	// The connection string, as a URL (postgres://user:pass@host/db) or
	// as key=value pairs. Required. Placeholders such as
	// {env.DATABASE_URL} are resolved at start, which keeps the secret
	// out of the config.
	DSN string `json:"dsn,omitempty"`

	// The table that holds the records, optionally qualified by one
	// schema (schema.table). Each part is an SQL identifier of 1 to 63
	// letters, digits and underscores, not starting with a digit; like
	// an unquoted identifier in SQL it is case-insensitive. Default:
	// idempotency_keys.
	Table string `json:"table,omitempty"`

	// The most connections this store opens. Handlers and config reloads
	// with the same dsn and max_conns share one pool; pool_max_conns in
	// the dsn is ignored. Default: 4 per GOMAXPROCS, at least 16.
	MaxConns int32 `json:"max_conns,omitempty"`

	// Whether to apply the embedded schema migrations at start. Turn it
	// off when the database user may not create tables, and apply the
	// files in migrations/ by hand. Either way, Caddy starts while the
	// database is down: the migrations and the first read of the
	// table's credential secret are retried in the background, and the
	// store's requests answer 503 until they have succeeded. `caddy
	// validate` writes nothing. Default: true.
	Migrate *bool `json:"migrate,omitempty"`

	table   tableName
	poolKey postgresPoolKey
	pool    *pgxpool.Pool
	// admitted is the pool's: see Acquire.
	admitted chan struct{}
	cleaned  int32 // set once by Cleanup; atomic.Bool would make the module type uncopyable
	sql      postgresSQL
	logger   *zap.Logger
	// start is the store's start (startup.go). tableSecret is set by a
	// handler that hashes credentials under the table's secret, which
	// the start then reads.
	start       *startup
	tableSecret bool
	// busy and drainMax are set by the handler (keepPoolWhile).
	busy     func() bool
	drainMax time.Duration
	// The batchers of the request path's statements (pgbatch.go).
	acquires                      *batcher[queuedAcquire, AcquireResult]
	completes, releases, renewals *ownedBatcher
	// listener and channel are set by EnableWaiting (pglisten.go).
	listener *pgListener
	channel  string
}

// CaddyModule returns the Caddy module information.
func (PostgresStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.idempotency.stores.postgres",
		New: func() caddy.Module { return new(PostgresStore) },
	}
}

// postgresPools holds one pgxpool per (dsn, max_conns). A config reload
// provisions the new config before it cleans up the old one, so counting
// references keeps the pool, and its warm connections and prepared
// statements, alive across the reload instead of opening a second one.
var postgresPools = caddy.NewUsagePool()

// testQueryTracer traces the statements of every pool opened while it is
// set. Only tests set it, before any pool is opened (roundtrip_test.go
// counts the statements a request costs).
var testQueryTracer pgx.QueryTracer

type postgresPoolKey struct {
	dsn      string
	maxConns int32
}

// sharedPool lets the usage pool close a pgxpool with its last reference.
type sharedPool struct {
	*pgxpool.Pool
	// admitted bounds the acquires running at once, below the pool's
	// size (acquireSlots): see Acquire.
	admitted chan struct{}
}

// ownerConns is how many of a pool's connections are kept from acquires
// for the requests that already own a record (renew, complete, release),
// up to a quarter of the pool.
const ownerConns = 2

// acquireSlots is how many acquires may hold connections of a pool of
// maxConns at once.
func acquireSlots(maxConns int32) int {
	return int(maxConns - min(ownerConns, maxConns/4))
}

func (p sharedPool) Destruct() error {
	p.Close()
	return nil
}

// defaultMaxConns sizes the pool. A request holds a connection only for
// the length of one statement (Acquire, Renew, Complete), never while the
// upstream runs, so connections are needed in proportion to the CPUs that
// drive requests; four per CPU lets the network round trips of several
// statements overlap. The floor of 16 is for first executions: each one
// waits for two commits to be flushed to disk, a wait that depends on
// the disk, not on the CPU count, and Postgres flushes the commits that
// wait together in one go, so the more connections commit at once, the
// more each flush carries. On two CPUs with 32 requests in flight, the
// store alone (bench row 6) completed about 12% more first executions
// with 16 connections than with 8, and through Caddy (make bench-pools,
// interleaved runs) 6% more, for 3% fewer uncached replays, which compete
// for the same two CPUs with twice the backends (docs/performance.md).
// Connections are opened on demand: an idle instance holds few. Since
// concurrent requests share statements (pgbatch.go), a handler's request
// path holds at most batchLanes connections per kind of statement, five
// in the benchmark's first executions; the pool's size matters for the
// handlers and pruning that share it.
func defaultMaxConns() int32 {
	return int32(max(16, 4*runtime.GOMAXPROCS(0)))
}

// Provision resolves placeholders in the DSN and opens (or shares) the
// connection pool, which connects on demand. It writes nothing: Caddy
// provisions a config that it only validates, too. The migrations wait
// for the config to run (startup.go).
func (s *PostgresStore) Provision(ctx caddy.Context) error {
	s.logger = ctx.Logger()
	// Caddy validates after provisioning; refuse a bad config before
	// connecting to anything.
	if err := s.Validate(); err != nil {
		return err
	}
	if s.Table == "" {
		s.Table = defaultTable
	}
	table, err := parseTableName(s.Table)
	if err != nil {
		return fmt.Errorf("postgres store: %w", err)
	}
	s.table = table
	if s.MaxConns == 0 {
		s.MaxConns = defaultMaxConns()
	}
	dsn := caddy.NewReplacer().ReplaceKnown(s.DSN, "")
	if dsn == "" {
		return fmt.Errorf("postgres store: dsn %q is empty once its placeholders are replaced", s.DSN)
	}

	key := postgresPoolKey{dsn: dsn, maxConns: s.MaxConns}
	val, _, err := postgresPools.LoadOrNew(key, func() (caddy.Destructor, error) {
		cfg, err := pgxpool.ParseConfig(dsn)
		if err != nil {
			// pgx's parse errors quote the DSN, password included.
			return nil, errors.New("postgres store: dsn is not a valid connection string")
		}
		cfg.MaxConns = key.maxConns
		// One round trip per statement: the statement is prepared on a
		// connection's first use and then only executed.
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
		cfg.ConnConfig.Tracer = testQueryTracer
		// The pool dials on its own, past the request that made it dial,
		// and a dial has no bound of its own: one whose startup reply
		// never comes (a database gone silent, a partition) held its
		// place in the pool for ever, and a few such silences filled
		// the pool for good, every request answered 503 long after the
		// database was back. A dial that takes longer than a statement
		// may is given up (per host of a multi-host DSN). A DSN's own
		// connect_timeout stands.
		if cfg.ConnConfig.ConnectTimeout == 0 {
			cfg.ConnConfig.ConnectTimeout = storeTimeout
		}
		if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
			cfg.ConnConfig.RuntimeParams["application_name"] = "caddy-idempotency"
		}
		// The batched statements are planned once per connection. A
		// custom plan, for the array lengths of each execution, costs
		// less on paper than the generic one (which assumes ten rows),
		// so Postgres would plan them again at every execution: with 32
		// acquires of one row in flight, the store alone ran half as
		// many. Their generic plans look every row up through the
		// primary key (TestPostgresStatementsUsePrimaryKeyWhenMostRowsExpired).
		if _, ok := cfg.ConnConfig.RuntimeParams["plan_cache_mode"]; !ok {
			cfg.ConnConfig.RuntimeParams["plan_cache_mode"] = "force_generic_plan"
		}
		// A connection keeps a statement's plan for its life, and plans
		// it for the table as it is at the statement's first use: on a
		// new table, nearly empty, a scan of its few pages costs less on
		// paper than a primary-key lookup per row of a batch, and that
		// plan then read the whole table at every completion as the
		// table grew (first executions a quarter slower at 27,000 rows,
		// and worse beyond), until an ANALYZE, which autovacuum may
		// never run, replaced it. Every statement of the store finds its
		// rows through an index, so a sequential scan is never the plan
		// it wants (TestPostgresStatementsUsePrimaryKeyOnAnEmptyTable).
		if _, ok := cfg.ConnConfig.RuntimeParams["enable_seqscan"]; !ok {
			cfg.ConnConfig.RuntimeParams["enable_seqscan"] = "off"
		}
		// Not Provision's context: it is cancelled when this config is
		// unloaded, while the pool lives on in the next config.
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			return nil, fmt.Errorf("postgres store: opening pool: %w", err)
		}
		return sharedPool{Pool: pool, admitted: make(chan struct{}, acquireSlots(key.maxConns))}, nil
	})
	if err != nil {
		return err
	}
	s.poolKey = key
	s.pool, s.admitted = val.(sharedPool).Pool, val.(sharedPool).admitted
	s.sql = newPostgresSQL(s.table.quoted())
	s.acquires = &batcher[queuedAcquire, AcquireResult]{
		lanes:  min(batchLanes, acquireSlots(s.MaxConns)),
		key:    func(r queuedAcquire) RecordKey { return r.Key },
		send:   s.sendAcquires,
		follow: followAcquire,
	}
	s.completes = s.newOwnedBatcher(opComplete, &s.sql.complete)
	s.releases = s.newOwnedBatcher(opRelease, &s.sql.release)
	s.renewals = s.newOwnedBatcher(opRenew, &s.sql.renew)
	return startStore(ctx, s)
}

// Validate checks the configuration.
func (s *PostgresStore) Validate() error {
	if s.DSN == "" {
		return errors.New("postgres store: dsn is required")
	}
	if s.MaxConns < 0 {
		return fmt.Errorf("postgres store: max_conns must be positive, not %d", s.MaxConns)
	}
	return nil
}

// Cleanup releases this store's reference to the pool; the last one
// closes it.
func (s *PostgresStore) Cleanup() error {
	if s.pool == nil || !atomic.CompareAndSwapInt32(&s.cleaned, 0, 1) {
		return nil
	}
	s.stopWaiting()
	s.start.stop()
	if s.busy == nil || !s.busy() {
		_, err := postgresPools.Delete(s.poolKey)
		return err
	}
	// A reload does not wait for the unloaded config's requests, and
	// those that own a record still have to complete it: with the pool
	// closed under them, the record would stay in progress, and its
	// retry execute a second time once the lock went stale. So the
	// reference is let go once they are done (s.pool stays set for them
	// meanwhile), or after drainMax, when the stragglers get errors.
	go func() {
		for deadline := time.Now().Add(s.drainMax); s.busy() && time.Now().Before(deadline); {
			time.Sleep(50 * time.Millisecond)
		}
		if _, err := postgresPools.Delete(s.poolKey); err != nil {
			s.logger.Error("closing the connection pool", zap.Error(err))
		}
	}()
	return nil
}

// keepPoolWhile makes Cleanup keep the pool while busy reports that a
// request of the handler owns a record, for at most drainMax.
func (s *PostgresStore) keepPoolWhile(busy func() bool, drainMax time.Duration) {
	s.busy, s.drainMax = busy, drainMax
}

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

// leaseEndSQL is when the lease of the in-progress row row ends:
// locked_until, or for rows written before migration 0002, locked_at
// plus lockTimeout (an SQL interval), the lock timeout of whoever asks.
//
// "The owner is gone" is one rule, that of a takeover, a renewal and a
// non-forced release alike: the lease has ended, leaseEndSQL <= now() by
// the database's clock. A renewal succeeds only while it is live
// (locked_until > now(): the rows an owner renews always have one), and
// the row lock orders it with a takeover or a release, so a late owner
// never renews a record that either could have taken.
func leaseEndSQL(row, lockTimeout string) string {
	return fmt.Sprintf(`COALESCE(%[1]s.locked_until, %[1]s.locked_at + %[2]s)`, row, lockTimeout)
}

// leaseEnd is leaseEndSQL in an ON CONFLICT clause, whose asker is the
// request that would take over, with the lease it would set.
var leaseEnd = leaseEndSQL("r", "(excluded.locked_until - excluded.locked_at)")

// microseconds turns a parameter of microseconds into an interval: the
// batched statements take durations as arrays of bigint.
const microseconds = ` * interval '1 microsecond'`

func newPostgresSQL(table string) postgresSQL {
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
		acquire: acquireSQL(table),

		complete: completeSQL(table, false),
		release:  releaseSQL(table, false),

		completedBy: fmt.Sprintf(`SELECT EXISTS (SELECT FROM %s
WHERE credential_hash = $1 AND key = $2 AND completed_token = $3 AND status = 'completed')`, table),

		gone: fmt.Sprintf(`SELECT NOT EXISTS (SELECT FROM %s WHERE credential_hash = $1 AND key = $2)`, table),

		// The lease keeps the length its owner gave it at acquire; the
		// record must outlive it. A lease that has ended is not renewed
		// (leaseEndSQL): from then on a retry or an operator may take
		// the record.
		renew: ownedStatement(table, false, `UPDATE %[1]s AS r SET
	locked_at = now(),
	locked_until = now() + (r.locked_until - r.locked_at),
	expires_at = GREATEST(r.expires_at, now() + (r.locked_until - r.locked_at))
FROM input AS i
WHERE r.credential_hash = i.in_hash AND r.key = i.in_key AND r.lock_token = i.in_token AND r.status = 'in_progress'
	AND r.locked_until > now()`),

		// ctid lets the batch be picked through the expires_at index and
		// deleted without a second lookup. Rows that a batch of acquires
		// holds (taking expired records over) are skipped, not waited
		// for: the two would lock them in different orders. The outer tests are rechecked
		// on the latest row version, so a record that Acquire revived
		// meanwhile survives. A live lease keeps a record whatever its
		// expiry (only rows written before migration 0002 can have one
		// past it).
		pruneBatch: fmt.Sprintf(`DELETE FROM %[1]s
WHERE ctid = ANY (ARRAY (SELECT ctid FROM %[1]s WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED))
	AND expires_at <= now() AND (locked_until IS NULL OR locked_until <= now())`, table),
	}
}

// acquireColumns are acquire's parameters, one row per request.
var acquireColumns = []string{"bytea in_hash", "text in_key", "bytea in_fingerprint", "text in_method",
	"text in_path", "bytea in_token", "bigint in_retention_us", "bigint in_lock_us"}

// acquireSQL is the acquire of table.
func acquireSQL(table string) statement {
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
	return newStatement(acquireColumns, func(rows string) string {
		return fmt.Sprintf(`WITH input AS (
	%[9]s
), found AS (
	SELECT i.n,
		r.status = 'completed' AND r.expires_at > now() AS live,
		r.status = 'in_progress' AND r.lock_token = i.in_token AND r.locked_until > now() AS mine,
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
			table, OutcomeCreated, OutcomeTakenOver, OutcomeExisting, recordColumns, leaseEnd, microseconds, recordColumnNames, rows)
	})
}

// completeSQL is the completion of table. The retention counts from the
// completion: a request that ran long keeps its record as long as a
// quick one. A NULL body is one that was not kept. notify makes it wake
// the records' waiters (pglisten.go).
func completeSQL(table string, notify bool) statement {
	return ownedStatement(table, notify, `UPDATE %[1]s AS r SET
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
func releaseSQL(table string, notify bool) statement {
	return ownedStatement(table, notify, `DELETE FROM %[1]s AS r
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
func ownedStatement(table string, notify bool, body string, cols ...string) statement {
	cols = append([]string{"bytea in_hash", "text in_key", "bytea in_token"}, cols...)
	// The rows are locked before body changes them, one at a time in the
	// batch's order (sendBatch sorts it; the lateral subquery makes the
	// nested loop follow it): the order of the acquires' INSERT too, the
	// same on every instance, so that batches of several instances, each
	// holding some rows while waiting for others, never wait for each
	// other in a cycle. The subquery finds each row through the primary
	// key whatever the table's size when a connection planned it: a join,
	// planned on a new, empty table, scanned the table for every batch
	// for as long as the connection kept the plan.
	body = fmt.Sprintf(body, table)
	return newStatement(cols, func(rows string) string {
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

// inputRows is the query that gives a statement its requests, a row each,
// with the columns cols, each "type name", and n, the row's ordinal. The
// statement's first parameters are the columns, in their order: for a
// batch, arrays of one element per request; in the form for one request,
// the values themselves. A batch of one sent in the batch's form costs
// Postgres about a tenth more than in its own (the arrays, the plan for
// an unknown number of rows), which a request at low load would wait for.
func inputRows(one bool, cols ...string) string {
	params, names, values := make([]string, len(cols)), make([]string, len(cols)), make([]string, len(cols))
	for i, col := range cols {
		typ, name, _ := strings.Cut(col, " ")
		params[i] = fmt.Sprintf("$%d::%s[]", i+1, typ)
		names[i] = name
		values[i] = fmt.Sprintf("$%d::%s AS %s", i+1, typ, name)
	}
	if one {
		return "SELECT " + strings.Join(values, ", ") + ", 1::bigint AS n"
	}
	return fmt.Sprintf("SELECT * FROM unnest(%s)\n\t\tWITH ORDINALITY AS i(%s, n)", strings.Join(params, ", "), strings.Join(names, ", "))
}

// statement is a statement of the store on the rows of a batch of
// requests, in its two forms: for a batch, and for one request.
type statement struct {
	batch, one string
	// columns is how many of its first parameters are the rows'.
	columns int
}

// newStatement builds a statement's two forms with build, from the query
// that gives its rows, with the columns cols (see inputRows).
func newStatement(cols []string, build func(rows string) string) statement {
	return statement{batch: build(inputRows(false, cols...)), one: build(inputRows(true, cols...)), columns: len(cols)}
}

// forRows is the statement's text and arguments for rows requests, whose
// first arguments are the rows' columns, each an array of an element per
// request (a slice): a single request is sent in the form for one, with
// the elements themselves.
func (st statement) forRows(rows int, args []any) (string, []any) {
	if rows != 1 {
		return st.batch, args
	}
	one := slices.Clone(args)
	for i := range st.columns {
		one[i] = reflect.ValueOf(args[i]).Index(0).Interface()
	}
	return st.one, one
}

// acquireAttempts bounds the retries of Acquire's statement. It returns
// no row only when another transaction inserted the key, or took its
// expired record, after the statement's snapshot was taken: the conflict
// makes the INSERT see that row, but the snapshot hides it from the
// SELECT. The next attempt's snapshot sees it.
const acquireAttempts = 5

// Acquire implements Store. The acquires of concurrent requests share
// statements (pgbatch.go); each request gets its own outcome.
func (s *PostgresStore) Acquire(ctx context.Context, req AcquireRequest) (AcquireResult, error) {
	if err := s.ready(ctx); err != nil {
		return AcquireResult{}, err
	}
	contended, start := 0, time.Now()
	// sent: an attempt's statement may have reached the database, and
	// committed there, before its connection was lost.
	sent := false
	for backoff := 10 * time.Millisecond; ; backoff = min(2*backoff, 250*time.Millisecond) {
		res, err := s.acquires.do(ctx, queuedAcquire{AcquireRequest: req, sent: sent})
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			if contended++; contended < acquireAttempts {
				continue
			}
			return AcquireResult{}, fmt.Errorf("postgres store: acquire: key still contended after %d attempts", acquireAttempts)
		case err == nil:
			return res, nil
		}
		// A statement whose connection failed may have committed all
		// the same: the record would then be locked by a request that
		// never learned it, and every retry get 409 until the lock ran
		// out. Trying again with the same token either finds that
		// record, the caller's, or does what the first attempt did not.
		// It is tried again within the store timeout, through a
		// failover too (the new primary refuses connections until it is
		// promoted): an acquire that committed on the old primary was
		// replicated to it. A database that refuses the first attempt's
		// connection is down, and nothing was sent: the request fails at
		// once, as it would have. A pooled connection that the database
		// closed while idle fails before anything is written to it
		// (SafeToRetry): that attempt sent nothing either.
		var connectErr *pgconn.ConnectError
		refused := errors.As(err, &connectErr)
		sent = sent || connectionLost(err) && !refused && !pgconn.SafeToRetry(err)
		if !connectionLost(err) || refused && !sent || ctx.Err() != nil || time.Since(start)+backoff > storeTimeout {
			return AcquireResult{}, fmt.Errorf("postgres store: acquire: %w", err)
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return AcquireResult{}, fmt.Errorf("postgres store: acquire: %w", err)
		}
	}
}

// storedResponse is the response of a completed record, from its
// columns but the headers, which each caller decodes as it needs.
func storedResponse(status *int32, replayable *bool, size *int64, body []byte) *Response {
	resp := &Response{Body: body}
	if status != nil {
		resp.Status = int(*status)
	}
	if replayable != nil {
		resp.Replayable = *replayable
	}
	if size != nil {
		resp.BodySize = *size
	}
	return resp
}

// connectionLost reports whether err is the loss of the connection (or a
// failure to get one), after which a statement's effect is unknown, or
// certainly absent, rather than the database's answer to it.
func connectionLost(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// 08: connection exception; FATAL: the server ended the session
		// (57P01, pg_terminate_backend, among others).
		return pgErr.Severity == "FATAL" || strings.HasPrefix(pgErr.Code, "08")
	}
	var netErr net.Error
	return pgconn.SafeToRetry(err) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		(errors.As(err, &netErr) && !netErr.Timeout())
}

// queuedAcquire is an acquire as its batcher queues it. sent: an earlier
// attempt of the same acquire may have committed.
type queuedAcquire struct {
	AcquireRequest
	sent bool
}

// followAcquire gives c, an acquire of the key that lead acquired in the
// batch before it, lead's outcome where the statement would have given
// it the same: a completed record, live (the statement never answers an
// expired one), whatever c's request; a record in progress, to a request of
// the same fingerprint, which takes a stale lock over exactly when lead
// would have. Not to an acquire whose earlier attempt may have created
// the record in progress: that record is its own. Anything else, a
// failed statement included, c sends itself.
func followAcquire(lead, c *batchCall[queuedAcquire, AcquireResult]) bool {
	if lead.err != nil || c.req.sent || lead.res.Outcome != OutcomeExisting || lead.res.Record == nil {
		return false
	}
	if lead.res.Record.Status != StatusCompleted && lead.req.Fingerprint != c.req.Fingerprint {
		return false
	}
	rec := *lead.res.Record
	c.res = AcquireResult{Outcome: OutcomeExisting, Record: &rec}
	return true
}

// sendAcquires runs the acquire statement for a batch of requests.
//
// Its statements take at most acquireSlots of the pool's connections at
// once. A request that owns a record must renew its lock and complete it
// before the lock goes stale, or a retry takes the record over and runs
// the request a second time. When the database falls behind, new
// requests queue for connections faster than they get them; if owners
// queued behind them, their renewals and completions would wait as long.
// So new requests wait here instead, and the connections kept from them
// serve the owners first (whose statements have batchers of their own):
// under overload, new requests are slowed or refused (503, after the
// store timeout), never the ones in flight.
func (s *PostgresStore) sendAcquires(ctx context.Context, calls []*batchCall[queuedAcquire, AcquireResult]) {
	fail := func(err error) {
		for _, c := range calls {
			c.err = err
		}
	}
	select {
	case s.admitted <- struct{}{}:
		defer func() { <-s.admitted }()
	case <-ctx.Done():
		fail(fmt.Errorf("waiting for a connection: %w", ctx.Err()))
		return
	}
	var (
		hashes, fingerprints, tokens [][]byte
		keys, methods, paths         []string
		retentions, locks            []int64
	)
	for _, c := range calls {
		r := &c.req
		hashes = append(hashes, r.Key.CredentialHash[:])
		keys = append(keys, r.Key.Key)
		fingerprints = append(fingerprints, r.Fingerprint[:])
		methods = append(methods, r.Method)
		paths = append(paths, r.Path)
		tokens = append(tokens, r.Token[:])
		retentions = append(retentions, r.Retention.Microseconds())
		locks = append(locks, r.LockTimeout.Microseconds())
	}
	sql, args := s.sql.acquire.forRows(len(calls), []any{hashes, keys, fingerprints, methods, paths, tokens, retentions, locks})
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		s.dropDeadConns(err)
		fail(err)
		return
	}
	answered := 0
	for rows.Next() {
		var (
			n           int64
			outcome     int32
			status      *string
			fingerprint []byte
			method      *string
			path        *string
			createdAt   *time.Time
			expiresAt   *time.Time
			lockedAt    *time.Time
			lockedUntil *time.Time
			respStatus  *int32
			respHeaders []byte
			respBody    []byte
			replayable  *bool
			respSize    *int64
			ttl         *int64
		)
		if err = rows.Scan(&n, &outcome, &status, &fingerprint, &method, &path, &createdAt, &expiresAt,
			&lockedAt, &lockedUntil, &respStatus, &respHeaders, &respBody, &replayable, &respSize, &ttl); err != nil {
			break
		}
		if n < 1 || int(n) > len(calls) {
			continue
		}
		c := calls[n-1]
		answered++
		switch {
		case outcome < 0:
			c.err = pgx.ErrNoRows
			continue
		case Outcome(outcome) != OutcomeExisting:
			c.res = AcquireResult{Outcome: Outcome(outcome)}
			continue
		}
		rec := Record{
			Status:    Status(*status),
			Method:    *method,
			Path:      *path,
			CreatedAt: createdAt.UTC(),
			ExpiresAt: expiresAt.UTC(),
			TTL:       time.Duration(*ttl) * time.Microsecond,
		}
		copy(rec.Fingerprint[:], fingerprint)
		if lockedAt != nil {
			rec.LockedAt = lockedAt.UTC()
		}
		if lockedUntil != nil {
			rec.LockedUntil = lockedUntil.UTC()
		}
		if rec.Status == StatusCompleted {
			resp := storedResponse(respStatus, replayable, respSize, respBody)
			var err error
			if resp.Header, err = decodeHeaders(respHeaders); err != nil {
				c.err = fmt.Errorf("decoding stored response headers: %w", err)
				continue
			}
			rec.Response = resp
		}
		c.res = AcquireResult{Outcome: OutcomeExisting, Record: &rec}
	}
	rows.Close()
	if err == nil {
		err = rows.Err()
	}
	if err == nil && answered != len(calls) {
		err = fmt.Errorf("the statement answered %d of %d requests", answered, len(calls))
	}
	if err != nil {
		s.dropDeadConns(err)
		fail(err)
	}
}

// Complete implements Store.
func (s *PostgresStore) Complete(ctx context.Context, key RecordKey, token LockToken, resp *Response, retention time.Duration) error {
	// NULL marks a body that was not kept; an empty body is kept as ''.
	var body []byte
	if resp.Replayable {
		body = resp.Body
		if body == nil {
			body = []byte{}
		}
	}
	err := s.execOwned(ctx, s.completes, ownedRequest{key: key, token: token, resp: &completion{
		status: int32(resp.Status), headers: encodeHeaders(resp.Header), body: body,
		replayable: resp.Replayable, size: resp.BodySize, retention: retention,
	}})
	if permanentError(err) {
		return fmt.Errorf("%w: %w", ErrUnstorable, err)
	}
	if errors.Is(err, ErrLockLost) {
		// An earlier attempt whose reply was lost may have completed it.
		return s.afterLockLost(ctx, opComplete, s.sql.completedBy, key.CredentialHash[:], key.Key, token[:])
	}
	return err
}

// afterLockLost runs check, a query that tells whether an earlier
// attempt of the same call took effect, after a statement found no
// record of the caller's: nil if it did, ErrLockLost if not.
func (s *PostgresStore) afterLockLost(ctx context.Context, op, check string, args ...any) error {
	var done bool
	if err := s.pool.QueryRow(ctx, check, args...).Scan(&done); err != nil {
		s.dropDeadConns(err)
		return fmt.Errorf("postgres store: %s: %w", op, err)
	}
	if done {
		return nil
	}
	return ErrLockLost
}

// permanentError reports whether err is the database refusing the
// statement's data, which no retry changes: a data exception (class 22),
// an integrity constraint violation (23) or a program limit exceeded
// (54), such as a value too large.
func permanentError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code[:min(2, len(pgErr.Code))] {
	case "22", "23", "54":
		return true
	}
	return false
}

// Release implements Store. A record that is gone counts as released:
// an earlier attempt whose reply was lost, or an operator, deleted it;
// either way the key is free.
func (s *PostgresStore) Release(ctx context.Context, key RecordKey, token LockToken) error {
	err := s.execOwned(ctx, s.releases, ownedRequest{key: key, token: token})
	if errors.Is(err, ErrLockLost) {
		return s.afterLockLost(ctx, opRelease, s.sql.gone, key.CredentialHash[:], key.Key)
	}
	return err
}

// Renew implements Store.
func (s *PostgresStore) Renew(ctx context.Context, key RecordKey, token LockToken) error {
	return s.execOwned(ctx, s.renewals, ownedRequest{key: key, token: token})
}

// renewChunk bounds the locks that one renewal statement carries: a
// renewal row is some 80 bytes, so a statement of renewChunk rows stays
// small while covering the locks of any plausible instance at once.
const renewChunk = 4096

// RenewLocks implements LockRenewer: the locks are renewed in one
// statement (one per renewChunk locks), outside the renewal batcher,
// which serves the single renewals that confirm a late acquire. Like
// every statement of an owner, it never waits behind acquires.
func (s *PostgresStore) RenewLocks(ctx context.Context, locks []HeldLock) []error {
	// The rows go in the batches' order (sendBatch): order holds the
	// locks' indexes sorted so.
	order := make([]int, len(locks))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(x, y int) int { return compareKeys(locks[x].Key, locks[y].Key) })
	errs := make([]error, len(locks))
	for start := 0; start < len(order); start += renewChunk {
		part := order[start:min(start+renewChunk, len(order))]
		calls := make([]*batchCall[ownedRequest, bool], len(part))
		for i, j := range part {
			calls[i] = &batchCall[ownedRequest, bool]{req: ownedRequest{key: locks[j].Key, token: locks[j].Token}}
		}
		s.sendOwned(ctx, opRenew, s.sql.renew, calls)
		for i, c := range calls {
			switch {
			case c.err != nil:
				errs[part[i]] = c.err
			case !c.res:
				errs[part[i]] = ErrLockLost
			}
		}
	}
	return errs
}

// ownedRequest is a statement on a record that the caller owns under
// token: a completion (with resp), a release or a renewal.
type ownedRequest struct {
	key   RecordKey
	token LockToken
	resp  *completion
}

// completion is a response as the complete statement stores it.
type completion struct {
	status     int32
	headers    []byte
	body       []byte
	replayable bool
	size       int64
	retention  time.Duration
}

// ownedBatcher sends one kind of statement on owned records.
type ownedBatcher = batcher[ownedRequest, bool]

// newOwnedBatcher returns the batcher of the statement that *sql holds
// (read at each batch: EnableWaiting changes it), op naming it in errors.
func (s *PostgresStore) newOwnedBatcher(op string, sql *statement) *ownedBatcher {
	return &ownedBatcher{
		lanes: batchLanes,
		key:   func(r ownedRequest) RecordKey { return r.key },
		size: func(r ownedRequest) int {
			if r.resp == nil {
				return 0
			}
			return len(r.resp.headers) + len(r.resp.body)
		},
		send: func(ctx context.Context, calls []*batchCall[ownedRequest, bool]) {
			s.sendOwned(ctx, op, *sql, calls)
		},
	}
}

// execOwned runs a statement conditioned on the caller still owning the
// record, in a batch: a row the statement did not change means that the
// lock was lost.
func (s *PostgresStore) execOwned(ctx context.Context, b *ownedBatcher, req ownedRequest) error {
	changed, err := b.do(ctx, req)
	if err != nil {
		return err
	}
	if !changed {
		return ErrLockLost
	}
	return nil
}

// sendOwned runs st for a batch of owned records and tells each call
// whether its row changed. The database refusing one row's data (a
// permanent error) would fail the whole statement: the rows of a batch
// that failed so are then sent alone, so that only the culprit fails.
func (s *PostgresStore) sendOwned(ctx context.Context, op string, st statement, calls []*batchCall[ownedRequest, bool]) {
	var (
		hashes, tokens [][]byte
		keys           []string
		args           []any
	)
	for _, c := range calls {
		hashes = append(hashes, c.req.key.CredentialHash[:])
		keys = append(keys, c.req.key.Key)
		tokens = append(tokens, c.req.token[:])
	}
	args = append(args, hashes, keys, tokens)
	if calls[0].req.resp != nil {
		var (
			statuses          []int32
			headers, bodies   [][]byte
			replayables       []bool
			sizes, retentions []int64
		)
		for _, c := range calls {
			r := c.req.resp
			statuses = append(statuses, r.status)
			headers = append(headers, r.headers)
			bodies = append(bodies, r.body)
			replayables = append(replayables, r.replayable)
			sizes = append(sizes, r.size)
			retentions = append(retentions, r.retention.Microseconds())
		}
		args = append(args, statuses, headers, bodies, replayables, sizes, retentions)
	}
	var n int64
	dest := []any{&n}
	if s.listener != nil && op != opRenew {
		// EnableWaiting made the statements that end a record notify:
		// their rows have a second column, pg_notify's void.
		dest = append(dest, nil)
		payloads := make([]string, len(calls))
		for i, c := range calls {
			payloads[i] = notifyPayload(c.req.key)
		}
		args = append(args, s.channel, payloads)
	}
	sql, args := st.forRows(len(calls), args)
	rows, err := s.pool.Query(ctx, sql, args...)
	if err == nil {
		for rows.Next() {
			if err = rows.Scan(dest...); err != nil {
				break
			}
			if n >= 1 && int(n) <= len(calls) {
				calls[n-1].res = true
			}
		}
		rows.Close()
		if err == nil {
			err = rows.Err()
		}
	}
	if err == nil {
		return
	}
	s.dropDeadConns(err)
	if permanentError(err) && len(calls) > 1 {
		for _, c := range calls {
			c.res = false
			s.sendOwned(ctx, op, st, []*batchCall[ownedRequest, bool]{c})
		}
		return
	}
	for _, c := range calls {
		c.res, c.err = false, fmt.Errorf("postgres store: %s: %w", op, err)
	}
}

// dropDeadConns empties the pool when err says the server ended a
// connection (a restart, a failover, pg_terminate_backend). Its idle
// siblings were almost certainly ended with it, and the pool only finds
// out by failing one statement on each: a completion retried against
// them could run out its lock's lifetime on dead connections, and a
// retry would then execute the request again.
func (s *PostgresStore) dropDeadConns(err error) {
	var pgErr *pgconn.PgError
	if (errors.As(err, &pgErr) && pgErr.Severity == "FATAL") || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		s.pool.Reset()
	}
}

// Prune implements Store. It holds a session advisory lock, keyed by the
// table, on one connection for the whole run, so that among the instances
// of a cluster one prunes and the others return at once.
func (s *PostgresStore) Prune(ctx context.Context, batchSize int) (int64, error) {
	if err := s.ready(ctx); err != nil {
		return 0, err
	}
	n, _, err := s.prune(ctx, batchSize)
	return n, err
}

// prune is Prune, and also reports whether it held the lock: false means
// that another instance was pruning (the operator CLI says so).
func (s *PostgresStore) prune(ctx context.Context, batchSize int) (total int64, locked bool, err error) {
	if batchSize <= 0 {
		return 0, false, fmt.Errorf("postgres store: prune: batch size must be positive, not %d", batchSize)
	}
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("postgres store: prune: %w", err)
	}
	lockKey := s.table.pruneLockKey()
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", lockKey).Scan(&locked); err != nil {
		conn.Release()
		return 0, false, fmt.Errorf("postgres store: prune: %w", err)
	}
	if !locked {
		conn.Release()
		return 0, false, nil
	}
	defer unlockPrune(conn, lockKey)
	// With migrate off, nothing else has looked at the table.
	if err := checkTable(ctx, conn, s.table); err != nil {
		return 0, true, fmt.Errorf("postgres store: prune: %w", err)
	}

	for {
		start := time.Now()
		tag, err := conn.Exec(ctx, s.sql.pruneBatch, batchSize)
		if err != nil {
			return total, true, fmt.Errorf("postgres store: prune: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batchSize) {
			return total, true, nil
		}
		// Pruning yields to live traffic: after a full batch it rests
		// twice as long as the batch took, so that a backlog of expired
		// rows takes at most a third of the database's time from the
		// requests being served. Resting only as long let their p99
		// reach twice its figure without pruning in some runs of
		// `make bench-scale`; a backlog still drains at thousands of
		// rows a second.
		t := time.NewTimer(2 * time.Since(start))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return total, true, fmt.Errorf("postgres store: prune: %w", ctx.Err())
		}
	}
}

// unlockPrune gives the prune lock back. A session lock outlives the work
// it guards: returned to the pool still held, it would stop every instance
// from pruning for as long as the connection lives. So the unlock does not
// use the caller's context, which may be why pruning stopped, and a
// connection that cannot unlock is closed, which unlocks it.
func unlockPrune(conn *pgxpool.Conn, lockKey int64) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_unlock($1)", lockKey); err != nil {
		_ = conn.Hijack().Close(ctx)
		return
	}
	conn.Release()
}

// UnmarshalCaddyfile sets up the store from Caddyfile tokens. Syntax:
//
//	postgres {
//	    dsn       <connection string>
//	    table     <name>
//	    max_conns <n>
//	    migrate   on|off
//	}
//
// The first token is the backend name, postgres.
func (s *PostgresStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the backend name
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := make(map[string]bool)
	for d.NextBlock(0) {
		opt := d.Val()
		if seen[opt] {
			return d.Errf("postgres store: %s specified more than once", opt)
		}
		seen[opt] = true
		var arg string
		switch opt {
		case "dsn":
			if !d.AllArgs(&s.DSN) {
				return d.ArgErr()
			}
		case "table":
			if !d.AllArgs(&arg) {
				return d.ArgErr()
			}
			if _, err := parseTableName(arg); err != nil {
				return d.Errf("postgres store: %v", err)
			}
			s.Table = arg
		case "max_conns":
			if !d.AllArgs(&arg) {
				return d.ArgErr()
			}
			n, err := strconv.ParseInt(arg, 10, 32)
			if err != nil || n <= 0 {
				return d.Errf("postgres store: max_conns must be a positive integer, not %q", arg)
			}
			s.MaxConns = int32(n)
		case "migrate":
			if !d.AllArgs(&arg) {
				return d.ArgErr()
			}
			switch arg {
			case "on":
				s.Migrate = nil // the default, kept out of the JSON
			case "off":
				off := false
				s.Migrate = &off
			default:
				return d.Errf("postgres store: migrate must be on or off, not %q", arg)
			}
		default:
			return d.Errf("postgres store: unrecognized option %q", opt)
		}
	}
	if s.DSN == "" {
		return d.Err("postgres store: dsn is required")
	}
	return nil
}

// Interface guards
var (
	_ caddy.Module          = (*PostgresStore)(nil)
	_ caddy.Provisioner     = (*PostgresStore)(nil)
	_ caddy.Validator       = (*PostgresStore)(nil)
	_ caddy.CleanerUpper    = (*PostgresStore)(nil)
	_ caddyfile.Unmarshaler = (*PostgresStore)(nil)
	_ Store                 = (*PostgresStore)(nil)
	_ caddy.Destructor      = sharedPool{}
)
