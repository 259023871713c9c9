package postgres

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(Store{})
}

// Store keeps idempotency records in a Postgres table that any
// number of Caddy instances share. The primary key (credential_hash, key)
// is what makes a key execute once, and every time comparison uses the
// database's clock, so that instances whose clocks drift still agree on
// which locks are stale and which records have expired.
type Store struct {
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

	// The connection string of the LISTEN connection that `wait` needs,
	// when dsn goes through a transaction pooler, which cannot carry a
	// LISTEN: a direct connection to the database (the primary's
	// address, or a session-mode pool). The store takes dsn to be pooled
	// when it sets pgx's default_query_exec_mode to anything but
	// cache_statement (cache_describe, exec, simple_protocol: the modes a
	// transaction pooler needs); a handler with `wait` on such a dsn
	// refuses to start without listen_dsn. Placeholders as for dsn.
	// Default: dsn.
	ListenDSN string `json:"listen_dsn,omitempty"`

	table   Table
	poolKey postgresPoolKey
	pool    *pgxpool.Pool
	// admitted is the pool's: see Acquire.
	admitted chan struct{}
	// prepares and execModeNamed are the pool's: see nameExecMode.
	prepares      bool
	execModeNamed *atomic.Bool
	cleaned       int32 // set once by Cleanup; atomic.Bool would make the module type uncopyable
	sql           postgresSQL
	logger        *zap.Logger
	// start is the store's start (startup.go). tableSecret is set by a
	// handler that hashes credentials under the table's secret, which
	// the start then reads.
	start       *startState
	tableSecret bool
	// busy and drainMax are set by the handler (DrainWhile).
	busy     func() bool
	drainMax time.Duration
	// The batchers of the request path's statements (pgbatch.go).
	acquires                      *batcher[queuedAcquire, store.AcquireResult]
	completes, releases, renewals *ownedBatcher
	// listener, listenKey (its DSN) and channel are set by
	// EnableWaiting (pglisten.go).
	listener  *pgListener
	listenKey string
	channel   string
}

// CaddyModule returns the Caddy module information.
func (Store) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.idempotency.stores.postgres",
		New: func() caddy.Module { return new(Store) },
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
type sharedPool struct {
	*pgxpool.Pool
	// admitted bounds the acquires running at once, below the pool's
	// size (acquireSlots): see Acquire.
	admitted chan struct{}
	// prepares: pgx prepares named statements on the pool's connections
	// (cache_statement). execModeNamed is set once a store of the pool
	// has said that a pooler loses them (nameExecMode).
	prepares      bool
	execModeNamed *atomic.Bool
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

// pooledDSN says whether the store takes cfg's DSN to go through a
// transaction pooler: one that asks pgx for anything but its default
// exec mode, cache_statement, whose prepared statements a transaction
// pooler does not carry (before PgBouncer 1.21). Such a DSN cannot carry
// a LISTEN either, so `wait` needs listen_dsn with it.
func pooledDSN(cfg *pgx.ConnConfig) bool {
	return cfg.DefaultQueryExecMode != pgx.QueryExecModeCacheStatement
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
func (s *Store) Provision(ctx caddy.Context) error {
	// Named by the server of the handler whose store this is, as its lines are.
	s.logger = ctx.Logger().With(zap.String("server", store.ServerName(ctx)))
	// Caddy validates after provisioning; refuse a bad config before
	// connecting to anything.
	if err := s.Validate(); err != nil {
		return err
	}
	if s.Table == "" {
		s.Table = DefaultTable
	}
	table, err := ParseTable(s.Table)
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
		// The DSN's default_query_exec_mode stands. pgx's default,
		// cache_statement, prepares each statement on a connection's
		// first use and then only executes it: one round trip. Through a
		// transaction pooler, whose server connections do not follow the
		// client's, the DSN says cache_describe, exec or simple_protocol
		// (see pooledDSN). No mode sets a planner setting: a pooler
		// refuses startup parameters it does not know, and the
		// statements plan alike without them (migration 0006).
		cfg.ConnConfig.Tracer = QueryTracer
		cfg.AfterConnect = afterConnect
		// The pool dials on its own, past the request that made it dial,
		// and a dial has no bound of its own: one whose startup reply
		// never comes (a database gone silent, a partition) held its
		// place in the pool for ever, and a few such silences filled
		// the pool for good, every request answered 503 long after the
		// database was back. A dial that takes longer than a statement
		// may is given up (per host of a multi-host DSN). A DSN's own
		// connect_timeout stands.
		if cfg.ConnConfig.ConnectTimeout == 0 {
			cfg.ConnConfig.ConnectTimeout = store.CallTimeout
		}
		if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
			cfg.ConnConfig.RuntimeParams["application_name"] = "caddy-idempotency"
		}
		// Not Provision's context: it is cancelled when this config is
		// unloaded, while the pool lives on in the next config.
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			return nil, fmt.Errorf("postgres store: opening pool: %w", err)
		}
		return sharedPool{Pool: pool, admitted: make(chan struct{}, acquireSlots(key.maxConns)),
			prepares:      cfg.ConnConfig.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement,
			execModeNamed: new(atomic.Bool)}, nil
	})
	if err != nil {
		return err
	}
	s.poolKey = key
	s.wire(val.(sharedPool))
	return startStore(ctx, s)
}

// wire sets s up on pool, for its table: the one constructor of a store,
// provisioned (Provision) or opened by a program (Open).
func (s *Store) wire(pool sharedPool) {
	s.pool, s.admitted, s.prepares, s.execModeNamed = pool.Pool, pool.admitted, pool.prepares, pool.execModeNamed
	s.sql = newPostgresSQL(s.table)
	s.acquires = &batcher[queuedAcquire, store.AcquireResult]{
		lanes:      min(batchLanes, acquireSlots(s.MaxConns)),
		stallAfter: batchStall,
		key:        func(r queuedAcquire) store.RecordKey { return r.Key },
		send:       s.sendAcquires,
		follow:     followAcquire,
	}
	s.completes = s.newOwnedBatcher(store.OpComplete, &s.sql.complete)
	s.releases = s.newOwnedBatcher(store.OpRelease, &s.sql.release)
	s.renewals = s.newOwnedBatcher(store.OpRenew, &s.sql.renew)
}

// ErrDSN is Open's error for a DSN that is not a Postgres connection
// string. pgx's own parse errors quote the DSN, password included.
var ErrDSN = errors.New("the DSN is not a valid Postgres connection string")

// Open returns a store on table, in the database that dsn names, on a
// pool of its own of two connections named appName, once the database
// answers: for a program that uses a store outside a Caddy config, such
// as the idempotency CLI. It applies no migration (ApplyMigrations does)
// and logs nothing; Close closes it.
func Open(ctx context.Context, dsn string, table Table, appName string) (*Store, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, ErrDSN
	}
	const conns = 2
	cfg.MaxConns = conns
	cfg.AfterConnect = afterConnect
	cfg.ConnConfig.RuntimeParams["application_name"] = appName
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = 10 * time.Second
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connecting to Postgres: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connecting to Postgres: %w", err)
	}
	s := &Store{DSN: dsn, Table: table.String(), MaxConns: conns, table: table,
		poolKey: postgresPoolKey{dsn: dsn, maxConns: conns}, logger: zap.NewNop()}
	s.wire(sharedPool{Pool: pool, admitted: make(chan struct{}, acquireSlots(conns)),
		prepares:      cfg.ConnConfig.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement,
		execModeNamed: new(atomic.Bool)})
	return s, nil
}

// Close closes the pool of a store that Open returned.
func (s *Store) Close() { s.pool.Close() }

// TableName is the store's table.
func (s *Store) TableName() Table { return s.table }

// ApplyMigrations applies the migrations that the store's table has not
// had yet, as the store does as it starts unless `migrate off`, and
// returns how many it applied.
func (s *Store) ApplyMigrations(ctx context.Context) (int, error) {
	return Migrate(ctx, s.pool, s.table.String())
}

// UndefinedTable reports whether err is the database's answer that a
// table does not exist (SQLSTATE 42P01).
func UndefinedTable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42P01"
}

// Validate checks the configuration.
func (s *Store) Validate() error {
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
func (s *Store) Cleanup() error {
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

// DrainWhile implements Drainer: Cleanup keeps the pool while busy
// reports that a request of the handler owns a record, for at most
// drainMax.
func (s *Store) DrainWhile(busy func() bool, drainMax time.Duration) {
	s.busy, s.drainMax = busy, drainMax
}

// Records implements RecordSet: a table of one database.
func (s *Store) Records() string { return s.poolKey.dsn + "\x00" + s.table.String() }

// Interface guards
var (
	_ caddy.Module          = (*Store)(nil)
	_ caddy.Provisioner     = (*Store)(nil)
	_ caddy.Validator       = (*Store)(nil)
	_ caddy.CleanerUpper    = (*Store)(nil)
	_ caddyfile.Unmarshaler = (*Store)(nil)
	_ store.Store           = (*Store)(nil)
	_ store.LockRenewer     = (*Store)(nil)
	_ store.SecretKeeper    = (*Store)(nil)
	_ store.Drainer         = (*Store)(nil)
	_ store.RecordSet       = (*Store)(nil)
	_ caddy.Destructor      = sharedPool{}
)

// UnmarshalCaddyfile sets up the store from Caddyfile tokens. Syntax:
//
//	postgres {
//	    dsn        <connection string>
//	    listen_dsn <connection string>
//	    table      <name>
//	    max_conns  <n>
//	    migrate    on|off
//	}
//
// The first token is the backend name, postgres.
func (s *Store) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the backend name
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := make(map[string]bool)
	for d.NextBlock(0) {
		opt := d.Val()
		if seen[opt] {
			return d.Errf("postgres store: %s given more than once", opt)
		}
		seen[opt] = true
		var arg string
		switch opt {
		case "dsn":
			if !d.AllArgs(&s.DSN) {
				return d.ArgErr()
			}
		case "listen_dsn":
			if !d.AllArgs(&s.ListenDSN) {
				return d.ArgErr()
			}
		case "table":
			if !d.AllArgs(&arg) {
				return d.ArgErr()
			}
			if _, err := ParseTable(arg); err != nil {
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

// DescribeDSN names a DSN's database without its credentials.
func DescribeDSN(dsn string) string {
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return "an unparsable dsn"
	}
	return net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))) + "/" + cfg.Database
}
