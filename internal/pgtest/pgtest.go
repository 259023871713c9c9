// Package pgtest is the Postgres of the tests, of every package that
// needs one. A test calls DSN(t), which finds a server the way a
// developer's machine has it, in this order:
//
//  1. IDEMPOTENCY_TEST_DSN, when set, e.g.
//     IDEMPOTENCY_TEST_DSN='postgres://me@db.internal/scratch?sslmode=disable'
//  2. postgres://postgres@127.0.0.1:5432/test?sslmode=disable, if it answers.
//     IDEMPOTENCY_TEST_NO_DEFAULT=1 skips this probe (to exercise step 3).
//  3. A throwaway cluster started from PostgreSQL's server binaries
//     (initdb and pg_ctl on PATH or in /usr/lib/postgresql/*/bin): in a
//     temporary directory, on a free port of 127.0.0.1, run as the
//     postgres user (or nobody) when the tests run as root.
//
// Otherwise the test fails, saying how to provide one; it never skips.
// On the server found, the run creates a database of its own (see
// createRunDatabase), which the tests use and TestMain drops: the DSN's
// role needs CREATEDB.
//
// The package's TestMain must call Cleanup once the tests are done, to
// drop the run's database and stop a throwaway cluster. A run that asked
// for no Postgres starts none:
//
//	func TestMain(m *testing.M) {
//		code := m.Run()
//		pgtest.Cleanup()
//		os.Exit(code)
//	}
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DefaultDSN is the Postgres that the tests look for first.
const DefaultDSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

var testPostgres struct {
	once    sync.Once
	dsn     string
	cleanup func()
	err     error
}

// setupTestPostgres finds or starts the Postgres that tests use, once per
// test binary. cleanup stops and deletes a cluster that it started.
func setupTestPostgres() (dsn string, cleanup func(), err error) {
	p := &testPostgres
	p.once.Do(func() {
		p.cleanup = func() {}
		server, stop, err := findTestPostgres()
		if err != nil {
			p.err = err
			return
		}
		p.cleanup = stop
		dsn, drop, err := createRunDatabase(server)
		if err != nil {
			p.err = fmt.Errorf("creating the test run's database on %s: %w", "the server", err)
			return
		}
		p.dsn, p.cleanup = dsn, func() { drop(); stop() }
	})
	return p.dsn, p.cleanup, p.err
}

// findTestPostgres finds a server in the order of the comment above.
func findTestPostgres() (dsn string, cleanup func(), err error) {
	if dsn := os.Getenv("IDEMPOTENCY_TEST_DSN"); dsn != "" {
		return dsn, func() {}, nil
	}
	var probeErr error
	if os.Getenv("IDEMPOTENCY_TEST_NO_DEFAULT") == "" {
		if probeErr = Ping(DefaultDSN); probeErr == nil {
			return DefaultDSN, func() {}, nil
		}
	}
	dsn, cleanup, err = startThrowawayPostgres()
	if err != nil && probeErr != nil {
		err = fmt.Errorf("%s: %v; and %w", DefaultDSN, probeErr, err)
	}
	return dsn, cleanup, err
}

// runDatabasePrefix names the databases that test runs create, followed
// by the run's start in Unix seconds and a random suffix.
const runDatabasePrefix = "idempotency_test_"

// createRunDatabase creates a database of the run's own on the server of
// dsn, so that a run shares no table, lock or backend with other runs or
// other users of the server, and returns its DSN (dsn, a URL, with the
// database replaced) and what drops it. Databases that crashed runs left
// behind for more than a day are dropped first.
func createRunDatabase(dsn string) (string, func(), error) {
	u, err := url.Parse(dsn)
	if err != nil || u.Scheme == "" {
		return "", nil, fmt.Errorf("the tests need a DSN URL (postgres://...), got %q", dsn)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return "", nil, err
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, "SELECT datname FROM pg_database WHERE starts_with(datname, $1)", runDatabasePrefix)
	if err != nil {
		return "", nil, err
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return "", nil, err
	}
	for _, name := range names {
		started, _, _ := strings.Cut(strings.TrimPrefix(name, runDatabasePrefix), "_")
		if secs, err := strconv.ParseInt(started, 10, 64); err == nil && time.Since(time.Unix(secs, 0)) > 24*time.Hour {
			_, _ = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+QuoteIdent(name)+" WITH (FORCE)")
		}
	}
	name := fmt.Sprintf("%s%d_%s", runDatabasePrefix, time.Now().Unix(), RandomHex(4))
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+QuoteIdent(name)); err != nil {
		return "", nil, err
	}
	u.Path = "/" + name
	drop := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, dsn)
		if err != nil {
			fmt.Fprintf(os.Stderr, "dropping the test database %s: %v\n", name, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+QuoteIdent(name)+" WITH (FORCE)"); err != nil {
			fmt.Fprintf(os.Stderr, "dropping the test database %s: %v\n", name, err)
		}
	}
	return u.String(), drop, nil
}

// Cleanup drops the run's database and stops the cluster that the run
// started, if it did.
func Cleanup() {
	if cleanup := testPostgres.cleanup; cleanup != nil {
		cleanup()
	}
}

// DSN returns the connection string of the Postgres that tests use.
func DSN(t testing.TB) string {
	t.Helper()
	dsn, _, err := setupTestPostgres()
	if err != nil {
		t.Fatalf("no Postgres for the tests: %v\n"+
			"set IDEMPOTENCY_TEST_DSN=postgres://user@host:port/db?sslmode=disable to use one", err)
	}
	return dsn
}

// Ping reports whether the server of dsn answers, within 2 seconds.
func Ping(dsn string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}

// startThrowawayPostgres initialises and starts a cluster in a temporary
// directory, tuned for speed over durability.
func startThrowawayPostgres() (dsn string, cleanup func(), err error) {
	initdb, pgCtl, err := FindBinaries()
	if err != nil {
		return "", nil, err
	}
	dir, err := os.MkdirTemp("", "idempotency-pg-")
	if err != nil {
		return "", nil, err
	}
	defer func() {
		if err != nil {
			os.RemoveAll(dir)
		}
	}()

	// The server refuses to run as root.
	var asUser []string
	if os.Geteuid() == 0 {
		u, err := serverUser()
		if err != nil {
			return "", nil, err
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			return "", nil, err
		}
		asUser = []string{"runuser", "-u", u.Username, "--"}
	}
	run := func(args ...string) error {
		args = append(slices.Clone(asUser), args...)
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Dir = dir // the server user may not be allowed into the package's directory
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return nil
	}

	data := filepath.Join(dir, "data")
	if err := run(initdb, "-D", data, "--username=postgres", "--auth=trust",
		"--encoding=UTF8", "--locale=C", "--no-sync"); err != nil {
		return "", nil, err
	}
	port, err := FreePort()
	if err != nil {
		return "", nil, err
	}
	opts := fmt.Sprintf("-c listen_addresses=127.0.0.1 -p %d -k %s -c max_connections=200 "+
		"-c fsync=off -c synchronous_commit=off -c full_page_writes=off", port, dir)
	if err := run(pgCtl, "-D", data, "-l", filepath.Join(dir, "server.log"), "-o", opts, "-w", "-t", "60", "start"); err != nil {
		return "", nil, err
	}
	cleanup = func() {
		_ = run(pgCtl, "-D", data, "-m", "immediate", "-w", "stop")
		os.RemoveAll(dir)
	}
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port), cleanup, nil
}

// FindBinaries finds initdb and pg_ctl: on PATH, then in Debian's versioned
// directories, newest first.
func FindBinaries() (initdb, pgCtl string, err error) {
	if initdb, err := exec.LookPath("initdb"); err == nil {
		if pgCtl, err := exec.LookPath("pg_ctl"); err == nil {
			return initdb, pgCtl, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int {
		va, _ := strconv.Atoi(filepath.Base(filepath.Dir(a)))
		vb, _ := strconv.Atoi(filepath.Base(filepath.Dir(b)))
		return vb - va
	})
	for _, d := range dirs {
		initdb, pgCtl := filepath.Join(d, "initdb"), filepath.Join(d, "pg_ctl")
		if _, err := os.Stat(initdb); err != nil {
			continue
		}
		if _, err := os.Stat(pgCtl); err != nil {
			continue
		}
		return initdb, pgCtl, nil
	}
	return "", "", errors.New("no PostgreSQL server binaries (initdb, pg_ctl) on PATH nor in /usr/lib/postgresql/*/bin")
}

// ServerOwned gives dir to the user that the database servers run as
// when the tests run as root (PostgreSQL, PgBouncer and Patroni refuse
// to run as root) and returns that user; nil when the tests are not root.
func ServerOwned(t testing.TB, dir string) *user.User {
	t.Helper()
	if os.Geteuid() != 0 {
		return nil
	}
	u, err := serverUser()
	if err != nil {
		t.Fatal(err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if err := os.Chown(dir, uid, gid); err != nil {
		t.Fatal(err)
	}
	return u
}

func serverUser() (*user.User, error) {
	for _, name := range []string{"postgres", "nobody"} {
		if u, err := user.Lookup(name); err == nil {
			return u, nil
		}
	}
	return nil, errors.New("running as root, and neither a postgres nor a nobody user exists to run the server")
}

// The Postgres store's names for a table's secret and for the migrations'
// bookkeeping (its secretTableSuffix and migrationsTable): this package
// cannot import the store, whose own tests use it.
const (
	secretTableSuffix = "_secret"
	migrationsTable   = "idempotency_schema_migrations"
)

// FreshTable returns a table name of its own for the test, and drops the
// table and its migration bookkeeping when the test ends, so that tests
// can run in parallel on one database.
func FreshTable(t testing.TB) string {
	t.Helper()
	var b [8]byte
	_, _ = rand.Read(b[:])
	name := "it_" + hex.EncodeToString(b[:])
	dsn := DSN(t)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, dsn)
		if err != nil {
			t.Errorf("dropping test table %s: %v", name, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP TABLE IF EXISTS "+name+", "+name+secretTableSuffix); err != nil {
			t.Errorf("dropping test table %s: %v", name, err)
		}
		_, err = conn.Exec(ctx, "DELETE FROM "+migrationsTable+" WHERE table_name = $1", name)
		var pgErr *pgconn.PgError
		if err != nil && !(errors.As(err, &pgErr) && pgErr.Code == "42P01") { // undefined_table: never migrated
			t.Errorf("forgetting migrations of test table %s: %v", name, err)
		}
	})
	return name
}

// Open connects to the test database for one statement, bounded by a
// timeout; done closes the connection. (Per call, not per test: some
// tests poll through these helpers every few milliseconds.)
func Open(t testing.TB, dsn string) (ctx context.Context, conn *pgx.Conn, done func()) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		cancel()
		t.Fatalf("connecting to postgres: %v", err)
	}
	return ctx, conn, func() {
		conn.Close(context.Background())
		cancel()
	}
}

// Connect opens a connection of the test's own to the test database,
// for a session that outlasts a statement (a lock held, a transaction
// open), and closes it when the test ends.
func Connect(t testing.TB, dsn string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatalf("connecting to postgres: %v", err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// Query runs a query against the test database and returns each row's
// columns as strings.
func Query(t testing.TB, dsn, query string, args ...any) [][]string {
	t.Helper()
	ctx, conn, done := Open(t, dsn)
	defer done()
	rows, err := conn.Query(ctx, query, args...)
	if err != nil {
		t.Fatalf("query %q: %v", query, err)
	}
	defer rows.Close()
	var out [][]string
	for rows.Next() {
		vals, err := rows.Values()
		if err != nil {
			t.Fatalf("query %q: %v", query, err)
		}
		row := make([]string, len(vals))
		for i, v := range vals {
			row[i] = fmt.Sprint(v)
		}
		out = append(out, row)
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("query %q: %v", query, err)
	}
	return out
}

// Exec runs a statement against the test database.
func Exec(t testing.TB, dsn, stmt string, args ...any) int64 {
	t.Helper()
	ctx, conn, done := Open(t, dsn)
	defer done()
	tag, err := conn.Exec(ctx, stmt, args...)
	if err != nil {
		t.Fatalf("exec %q: %v", stmt, err)
	}
	return tag.RowsAffected()
}

// QuoteIdent quotes name as a Postgres identifier.
func QuoteIdent(name string) string {
	return `"` + strings.ReplaceAll(name, `"`, `""`) + `"`
}

// RandomHex returns n random bytes, hex-encoded.
func RandomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Backends counts the connections to the test database named
// applicationName.
func Backends(t testing.TB, dsn, applicationName string) int {
	t.Helper()
	rows := Query(t, dsn, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1", applicationName)
	var n int
	fmt.Sscan(rows[0][0], &n)
	return n
}

// FreePort returns a TCP port on 127.0.0.1 that nothing listens on now.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	port := l.Addr().(*net.TCPAddr).Port
	return port, l.Close()
}

// StatementCounter counts, by name, the statements that name a watched
// table, and the preparations of such statements: a pgx tracer, set on
// the store's pools (postgres.QueryTracer) before any is opened.
type StatementCounter struct {
	// Name names a statement on table (postgres.StatementName).
	Name func(table, sql string) string

	mu      sync.Mutex
	watched map[string]*tableStatements
}

type tableStatements struct {
	statements []string // names, in order
	prepares   int
}

// Watch starts counting the statements on table, until the test ends.
func (c *StatementCounter) Watch(t testing.TB, table string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.watched == nil {
		c.watched = make(map[string]*tableStatements)
	}
	c.watched[table] = &tableStatements{}
	t.Cleanup(func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		delete(c.watched, table)
	})
}

// Take returns and resets the statements and preparations seen on table.
func (c *StatementCounter) Take(table string) (statements []string, prepares int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ts := c.watched[table]
	statements, prepares = ts.statements, ts.prepares
	ts.statements, ts.prepares = nil, 0
	return statements, prepares
}

// Count is the number of statements seen on table since the last Take.
func (c *StatementCounter) Count(table string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.watched[table].statements)
}

func (c *StatementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	for table, ts := range c.watched {
		if strings.Contains(data.SQL, table) {
			name := c.Name(table, data.SQL)
			if name == "" {
				first, _, _ := strings.Cut(strings.TrimSpace(data.SQL), "\n")
				name = "other: " + first
			}
			ts.statements = append(ts.statements, name)
		}
	}
	return ctx
}

func (c *StatementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *StatementCounter) TracePrepareStart(ctx context.Context, _ *pgx.Conn, data pgx.TracePrepareStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	for table, ts := range c.watched {
		if strings.Contains(data.SQL, table) {
			ts.prepares++
		}
	}
	return ctx
}

func (c *StatementCounter) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

var (
	_ pgx.QueryTracer   = (*StatementCounter)(nil)
	_ pgx.PrepareTracer = (*StatementCounter)(nil)
)

// ThroughForwarder returns dsn with its host replaced by the forwarder's.
func ThroughForwarder(t testing.TB, dsn string, f *Forwarder) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = f.Addr()
	q := u.Query()
	q.Set("connect_timeout", "2")
	u.RawQuery = q.Encode()
	return u.String()
}

// Addr is the host:port of a DSN URL.
func Addr(t testing.TB, dsn string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	return u.Host
}

// WithApplicationName returns dsn (a URL) with application_name set, so
// that pg_stat_activity tells the test's connections apart.
func WithApplicationName(dsn, name string) string {
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	return dsn + sep + "application_name=" + name
}
