package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/jackc/pgx/v5"
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
	// the dsn is ignored. Default: 4 per GOMAXPROCS, at least 8.
	MaxConns int32 `json:"max_conns,omitempty"`

	// Whether to apply the embedded schema migrations at start. Turn it
	// off when the database user may not create tables, and apply the
	// files in migrations/ by hand. Off, Caddy also starts while the
	// database is down, and answers 503 until it is up. Default: true.
	Migrate *bool `json:"migrate,omitempty"`

	table   tableName
	poolKey postgresPoolKey
	pool    *pgxpool.Pool
	cleaned int32 // set once by Cleanup; atomic.Bool would make the module type uncopyable
	sql     postgresSQL
	logger  *zap.Logger
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

type postgresPoolKey struct {
	dsn      string
	maxConns int32
}

// sharedPool lets the usage pool close a pgxpool with its last reference.
type sharedPool struct{ *pgxpool.Pool }

func (p sharedPool) Destruct() error {
	p.Close()
	return nil
}

// defaultMaxConns sizes the pool. A request holds a connection only for
// the length of one statement (Acquire, Renew, Complete), never while the
// upstream runs, so connections are needed in proportion to the CPUs that
// drive requests; four per CPU lets the network round trips of several
// statements overlap. The floor of 8 keeps a one- or two-CPU container from
// queueing every request behind a single statement that waits on a row
// lock, while staying small enough that ten instances fit in Postgres's
// default max_connections of 100.
func defaultMaxConns() int32 {
	return int32(max(8, 4*runtime.GOMAXPROCS(0)))
}

// Provision resolves placeholders in the DSN, opens (or shares) the
// connection pool and applies the migrations.
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
		if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
			cfg.ConnConfig.RuntimeParams["application_name"] = "caddy-idempotency"
		}
		// Not Provision's context: it is cancelled when this config is
		// unloaded, while the pool lives on in the next config.
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			return nil, fmt.Errorf("postgres store: opening pool: %w", err)
		}
		return sharedPool{pool}, nil
	})
	if err != nil {
		return err
	}
	s.poolKey = key
	s.pool = val.(sharedPool).Pool
	s.sql = newPostgresSQL(s.table.quoted())

	if s.Migrate == nil || *s.Migrate {
		n, err := Migrate(ctx, s.pool, s.table.String())
		if err != nil {
			return err
		}
		if n > 0 {
			s.logger.Info("applied schema migrations", zap.String("table", s.table.String()), zap.Int("count", n))
		}
	}
	return nil
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
	// s.pool stays set: requests of the unloaded config may still be
	// finishing (completing, renewing), and after the last reference
	// closes the pool they get an error from it, not a nil pointer.
	if s.pool == nil || !atomic.CompareAndSwapInt32(&s.cleaned, 0, 1) {
		return nil
	}
	_, err := postgresPools.Delete(s.poolKey)
	return err
}

// postgresSQL holds the statements of one table. They are built once, at
// Provision, because the table name cannot be a query parameter.
type postgresSQL struct {
	acquire, complete, release, renew, pruneBatch string
}

func newPostgresSQL(table string) postgresSQL {
	return postgresSQL{
		// The INSERT claims the key when no row exists. When one does, ON
		// CONFLICT turns it into a compare-and-swap that succeeds only on
		// an expired record (treated as absent) or on a stale lock held
		// for the same request; Postgres runs it on the latest committed
		// row version, under the row lock, so exactly one concurrent
		// caller wins. Whoever claims nothing reads the existing row
		// instead, in the same statement.
		//
		// A takeover keeps created_at (it is the same request, retried),
		// which is how the result tells a takeover from a creation; it
		// restarts expires_at so that the record cannot expire under its
		// new owner.
		//
		// $7 and $8 are the retention and the lock timeout.
		acquire: fmt.Sprintf(`WITH claimed AS (
	INSERT INTO %[1]s AS r (credential_hash, key, fingerprint, method, path, status,
		lock_token, locked_at, created_at, expires_at)
	VALUES ($1, $2, $3, $4, $5, 'in_progress', $6, now(), now(), now() + $7::interval)
	ON CONFLICT (credential_hash, key) DO UPDATE SET
		fingerprint = excluded.fingerprint,
		method = excluded.method,
		path = excluded.path,
		status = 'in_progress',
		lock_token = excluded.lock_token,
		locked_at = excluded.locked_at,
		created_at = CASE WHEN r.expires_at <= now() THEN excluded.created_at ELSE r.created_at END,
		expires_at = excluded.expires_at,
		response_status = NULL,
		response_headers = NULL,
		response_body = NULL,
		replayable = NULL,
		response_size = NULL
	WHERE r.expires_at <= now()
		OR (r.status = 'in_progress'
			AND r.fingerprint = excluded.fingerprint
			AND r.locked_at < now() - $8::interval)
	RETURNING created_at = now() AS fresh, status, fingerprint, method, path, created_at, expires_at,
		locked_at, response_status, response_headers, response_body, replayable, response_size
)
SELECT CASE WHEN fresh THEN %[2]d ELSE %[3]d END, status, fingerprint, method, path, created_at, expires_at,
	locked_at, response_status, response_headers, response_body, replayable, response_size
FROM claimed
UNION ALL
SELECT %[4]d, status, fingerprint, method, path, created_at, expires_at,
	locked_at, response_status, response_headers, response_body, replayable, response_size
FROM %[1]s
WHERE credential_hash = $1 AND key = $2 AND NOT EXISTS (SELECT FROM claimed)`,
			table, OutcomeCreated, OutcomeTakenOver, OutcomeExisting),

		complete: fmt.Sprintf(`UPDATE %s SET
	status = 'completed',
	lock_token = NULL,
	locked_at = NULL,
	response_status = $4,
	response_headers = $5,
	response_body = $6,
	replayable = $7,
	response_size = $8
WHERE credential_hash = $1 AND key = $2 AND lock_token = $3 AND status = 'in_progress'`, table),

		release: fmt.Sprintf(`DELETE FROM %s
WHERE credential_hash = $1 AND key = $2 AND lock_token = $3 AND status = 'in_progress'`, table),

		renew: fmt.Sprintf(`UPDATE %s SET locked_at = now()
WHERE credential_hash = $1 AND key = $2 AND lock_token = $3 AND status = 'in_progress'`, table),

		// ctid lets the batch be picked through the expires_at index and
		// deleted without a second lookup. The outer expires_at test is
		// rechecked on the latest row version, so a record that Acquire
		// revived meanwhile survives.
		pruneBatch: fmt.Sprintf(`DELETE FROM %[1]s
WHERE ctid = ANY (ARRAY (SELECT ctid FROM %[1]s WHERE expires_at <= now() LIMIT $1))
	AND expires_at <= now()`, table),
	}
}

// acquireAttempts bounds the retries of Acquire's statement. It returns
// no row only when another transaction inserted the key after the
// statement's snapshot was taken: the conflict makes the INSERT see that
// row, but the snapshot hides it from the SELECT. The next attempt's
// snapshot sees it.
const acquireAttempts = 5

// Acquire implements Store.
func (s *PostgresStore) Acquire(ctx context.Context, req AcquireRequest) (AcquireResult, error) {
	for range acquireAttempts {
		res, err := s.acquireOnce(ctx, req)
		if errors.Is(err, pgx.ErrNoRows) {
			continue
		}
		if err != nil {
			return AcquireResult{}, fmt.Errorf("postgres store: acquire: %w", err)
		}
		return res, nil
	}
	return AcquireResult{}, fmt.Errorf("postgres store: acquire: key still contended after %d attempts", acquireAttempts)
}

func (s *PostgresStore) acquireOnce(ctx context.Context, req AcquireRequest) (AcquireResult, error) {
	var (
		outcome     int32
		rec         Record
		status      string
		fingerprint []byte
		lockedAt    *time.Time
		respStatus  *int32
		respHeaders []byte
		respBody    []byte
		replayable  *bool
		respSize    *int64
	)
	err := s.pool.QueryRow(ctx, s.sql.acquire,
		req.Key.CredentialHash[:], req.Key.Key, req.Fingerprint[:], req.Method, req.Path,
		req.Token[:], req.Retention, req.LockTimeout,
	).Scan(&outcome, &status, &fingerprint, &rec.Method, &rec.Path, &rec.CreatedAt, &rec.ExpiresAt,
		&lockedAt, &respStatus, &respHeaders, &respBody, &replayable, &respSize)
	if err != nil {
		return AcquireResult{}, err
	}
	if Outcome(outcome) != OutcomeExisting {
		return AcquireResult{Outcome: Outcome(outcome)}, nil
	}
	rec.Status = Status(status)
	copy(rec.Fingerprint[:], fingerprint)
	rec.CreatedAt = rec.CreatedAt.UTC()
	rec.ExpiresAt = rec.ExpiresAt.UTC()
	if lockedAt != nil {
		rec.LockedAt = lockedAt.UTC()
	}
	if rec.Status == StatusCompleted {
		resp := &Response{Body: respBody}
		if respStatus != nil {
			resp.Status = int(*respStatus)
		}
		if replayable != nil {
			resp.Replayable = *replayable
		}
		if respSize != nil {
			resp.BodySize = *respSize
		}
		if err := json.Unmarshal(respHeaders, &resp.Header); err != nil {
			return AcquireResult{}, fmt.Errorf("decoding stored response headers: %w", err)
		}
		rec.Response = resp
	}
	return AcquireResult{Outcome: OutcomeExisting, Record: &rec}, nil
}

// Complete implements Store.
func (s *PostgresStore) Complete(ctx context.Context, key RecordKey, token LockToken, resp *Response) error {
	header := resp.Header
	if header == nil {
		header = http.Header{}
	}
	headers, err := json.Marshal(header)
	if err != nil {
		return fmt.Errorf("postgres store: complete: encoding headers: %w", err)
	}
	// NULL marks a body that was not kept; an empty body is kept as ''.
	var body []byte
	if resp.Replayable {
		body = resp.Body
		if body == nil {
			body = []byte{}
		}
	}
	return s.execOwned(ctx, "complete", s.sql.complete, key, token,
		resp.Status, headers, body, resp.Replayable, resp.BodySize)
}

// Release implements Store.
func (s *PostgresStore) Release(ctx context.Context, key RecordKey, token LockToken) error {
	return s.execOwned(ctx, "release", s.sql.release, key, token)
}

// Renew implements Store.
func (s *PostgresStore) Renew(ctx context.Context, key RecordKey, token LockToken) error {
	return s.execOwned(ctx, "renew", s.sql.renew, key, token)
}

// execOwned runs a statement conditioned on the caller still owning the
// record: no row affected means that the lock was lost.
func (s *PostgresStore) execOwned(ctx context.Context, op, sql string, key RecordKey, token LockToken, args ...any) error {
	args = append([]any{key.CredentialHash[:], key.Key, token[:]}, args...)
	tag, err := s.pool.Exec(ctx, sql, args...)
	if err != nil {
		return fmt.Errorf("postgres store: %s: %w", op, err)
	}
	if tag.RowsAffected() == 0 {
		return ErrLockLost
	}
	return nil
}

// Prune implements Store. It holds a session advisory lock, keyed by the
// table, on one connection for the whole run, so that among the instances
// of a cluster one prunes and the others return at once.
func (s *PostgresStore) Prune(ctx context.Context, batchSize int) (int64, error) {
	if batchSize <= 0 {
		return 0, fmt.Errorf("postgres store: prune: batch size must be positive, not %d", batchSize)
	}
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return 0, fmt.Errorf("postgres store: prune: %w", err)
	}
	lockKey := s.table.pruneLockKey()
	var locked bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", lockKey).Scan(&locked); err != nil {
		conn.Release()
		return 0, fmt.Errorf("postgres store: prune: %w", err)
	}
	if !locked {
		conn.Release()
		return 0, nil
	}
	defer unlockPrune(conn, lockKey)

	var total int64
	for {
		tag, err := conn.Exec(ctx, s.sql.pruneBatch, batchSize)
		if err != nil {
			return total, fmt.Errorf("postgres store: prune: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batchSize) {
			return total, nil
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
