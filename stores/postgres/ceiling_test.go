package postgres

// The store ceilings of the benchmark (bench/runner, `make bench`): the
// exact statements of the Postgres store issued straight through pgx, at
// the benchmark's concurrency, with no HTTP at all. They live in the
// package's tests because they run the store's own SQL (postgresSQL),
// which is not exported; the runner builds this test binary and runs
// TestBenchCeiling with its settings in the environment. In an ordinary
// `go test` run it is skipped.
//
//	IDEMPOTENCY_BENCH_CEILING  acquire_complete | acquire_complete_batched | lookup | lookup_batched |
//	                           replay_statement | preload | prune | pgbench
//	IDEMPOTENCY_BENCH_SCRIPTS                   pgbench: where to write its scripts
//	IDEMPOTENCY_BENCH_DSN, _TABLE, _CONCURRENCY, _DURATION, _WARMUP, _MAX_CONNS
//	IDEMPOTENCY_BENCH_RUN, _KEYS, _CREDENTIAL   the keys (bench/load.Key) of the rows
//	IDEMPOTENCY_BENCH_ROWS, _EXPIRED            preload: how many rows, expired or live
//	IDEMPOTENCY_BENCH_OUT                       where to write the result, as JSON

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-idempotency/idempotency/bench/load"
)

// The handler's defaults (its lock_timeout and retention) and its
// pruning batch, which the ceilings send as the handler would.
const (
	defaultLockTimeout = 30 * time.Second
	defaultRetention   = 24 * time.Hour
	pruneBatchSize     = 5000
)

func TestBenchCeiling(t *testing.T) {
	mode := os.Getenv("IDEMPOTENCY_BENCH_CEILING")
	if mode == "" {
		t.Skip("run by the benchmark (make bench) only")
	}
	// Only this test runs in the benchmark's process: the statement
	// counter of helpers_test.go must not cost the ceiling anything.
	QueryTracer = nil
	benchCeiling(t, mode, func(name, def string) string {
		if v := os.Getenv("IDEMPOTENCY_BENCH_" + name); v != "" {
			return v
		}
		return def
	})
}

// TestBenchCeilingSmoke runs every mode of the ceiling for a moment on a
// table of its own, so that the benchmark's SQL paths cannot rot
// unnoticed between benchmark runs.
func TestBenchCeilingSmoke(t *testing.T) {
	table := pgtest.FreshTable(t)
	settings := map[string]string{
		"DSN": pgtest.DSN(t), "TABLE": table, "RUN": "smoke000", "KEYS": "1",
		"CONCURRENCY": "2", "WARMUP": "0s", "DURATION": "500ms", "ROWS": "300", "EXPIRED": "1",
	}
	settings["SCRIPTS"] = t.TempDir()
	for _, mode := range []string{"acquire_complete", "acquire_complete_batched", "lookup", "lookup_batched", "replay_statement", "preload", "prune", "pgbench"} {
		out := benchCeiling(t, mode, func(name, def string) string {
			if name == "RUN" && mode == "acquire_complete_batched" {
				return "smoke001" // keys of its own: the other modes' are taken
			}
			if v, ok := settings[name]; ok {
				return v
			}
			return def
		})
		if res, ok := out["result"].(load.Result); ok && (res.Requests == 0 || res.Errors > 0) {
			t.Errorf("%s: %d requests, %d errors (%s)", mode, res.Requests, res.Errors, res.FirstError)
		}
		if mode == "prune" && out["rows"].(int64) < 300 {
			t.Errorf("pruned %v rows, want the 300 expired ones preloaded", out["rows"])
		}
	}
	pgbenchSmoke(t, pgtest.DSN(t), settings["SCRIPTS"])
}

// benchCeiling runs mode with the settings env gives, and returns what
// it measured (also written to the file OUT names, as JSON).
func benchCeiling(t *testing.T, mode string, env func(name, def string) string) map[string]any {
	envInt := func(name string, def int) int {
		n, err := strconv.Atoi(env(name, strconv.Itoa(def)))
		if err != nil {
			t.Fatalf("IDEMPOTENCY_BENCH_%s: %v", name, err)
		}
		return n
	}
	envDur := func(name string, def time.Duration) time.Duration {
		d, err := time.ParseDuration(env(name, def.String()))
		if err != nil {
			t.Fatalf("IDEMPOTENCY_BENCH_%s: %v", name, err)
		}
		return d
	}
	concurrency := envInt("CONCURRENCY", 32)
	cfg := load.Config{
		Concurrency: concurrency,
		Warmup:      envDur("WARMUP", 2*time.Second),
		Duration:    envDur("DURATION", 10*time.Second),
	}
	s := &Store{
		DSN:      env("DSN", pgtest.DefaultDSN),
		Table:    env("TABLE", "bench_ceiling"),
		MaxConns: int32(envInt("MAX_CONNS", max(concurrency, int(defaultMaxConns())))),
		// As a handler without credential_secret asks.
		tableSecret: true,
	}
	pctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := s.Provision(pctx); err != nil {
		t.Fatalf("provisioning the store: %v", err)
	}
	defer s.Cleanup()

	run := env("RUN", "ceiling0")
	// The credential is hashed as Caddy hashes it, under the store's
	// secret, so that the lookups find the records Caddy completed.
	secret, serr := s.CredentialSecret(context.Background())
	if serr != nil {
		t.Fatalf("the store's credential secret: %v", serr)
	}
	mac := hmac.New(sha256.New, secret) // the handler's keyed hash of a credential
	mac.Write([]byte(env("CREDENTIAL", "Bearer sk_test_bench_tenant_0001")))
	credHash := [32]byte(mac.Sum(nil))
	keys := int64(envInt("KEYS", 1000))
	ctx := context.Background()

	// The response the upstream gives, as the handler would store it.
	resp := &store.Response{
		Status: http.StatusOK,
		Header: http.Header{
			"Content-Type":   {"application/json"},
			"Content-Length": {strconv.Itoa(load.ResponseBodySize)},
			"Date":           {time.Now().UTC().Format(http.TimeFormat)},
		},
		Body:       load.ResponseBody(load.ResponseBodySize),
		Replayable: true,
		BodySize:   load.ResponseBodySize,
	}
	request := func(key string) store.AcquireRequest {
		return store.AcquireRequest{
			Key:         store.RecordKey{CredentialHash: credHash, Key: key},
			Token:       store.NewLockToken(),
			Fingerprint: sha256.Sum256([]byte(key)),
			Method:      http.MethodPost,
			Path:        "/v1/charges",
			LockTimeout: defaultLockTimeout,
			Retention:   defaultRetention,
		}
	}

	var (
		res load.Result
		err error
		out = map[string]any{"mode": mode, "max_conns": s.MaxConns, "concurrency": concurrency}
	)
	switch mode {
	case "acquire_complete", "acquire_complete_batched":
		// A first execution's two statements, on a new key each time:
		// one statement per request each (the store's own statements,
		// with batches of one), or through the store, whose concurrent
		// requests share statements.
		acquire, complete := s.Acquire, s.Complete
		if mode == "acquire_complete" {
			acquire, complete = s.acquireAlone, s.completeAlone
		}
		res, err = load.Run(ctx, cfg, func(int) (load.Op, error) {
			return func(ctx context.Context, seq int64) error {
				req := request(load.Key(run, seq))
				acq, err := acquire(ctx, req)
				if err != nil {
					return err
				}
				if acq.Outcome != store.OutcomeCreated {
					return fmt.Errorf("acquire: outcome %d, want created", acq.Outcome)
				}
				return complete(ctx, req.Key, req.Token, resp, req.Retention)
			}, nil
		})
	case "lookup":
		// The primary-key lookup of a completed record: the statement a
		// replay cannot do without.
		res, err = load.Run(ctx, cfg, func(int) (load.Op, error) {
			return func(ctx context.Context, seq int64) error {
				return lookupOnce(ctx, s, store.RecordKey{CredentialHash: credHash, Key: load.Key(run, seq%keys)})
			}, nil
		})
	case "lookup_batched":
		// The same lookups, those in flight together sharing a statement
		// as the store's batches do.
		lookups := lookupBatcher(s)
		res, err = load.Run(ctx, cfg, func(int) (load.Op, error) {
			return func(ctx context.Context, seq int64) error {
				key := store.RecordKey{CredentialHash: credHash, Key: load.Key(run, seq%keys)}
				found, err := lookups.do(ctx, key)
				if err == nil && !found {
					err = fmt.Errorf("lookup %s: no completed record", key.Key)
				}
				return err
			}, nil
		})
	case "replay_statement":
		// What the handler sends for a replay: Acquire on a completed key.
		res, err = load.Run(ctx, cfg, func(int) (load.Op, error) {
			return func(ctx context.Context, seq int64) error {
				acq, err := s.Acquire(ctx, request(load.Key(run, seq%keys)))
				if err != nil {
					return err
				}
				if acq.Outcome != store.OutcomeExisting || acq.Record.Status != store.StatusCompleted {
					return fmt.Errorf("acquire: outcome %d, want a completed record", acq.Outcome)
				}
				return nil
			}, nil
		})
	case "preload":
		n := envInt("ROWS", 1_000_000)
		start := time.Now()
		err = benchPreload(ctx, s, n, env("EXPIRED", "") == "1", resp)
		out["rows"] = n
		out["seconds"] = time.Since(start).Seconds()
	case "prune":
		start := time.Now()
		var total int64
		total, err = s.Prune(ctx, pruneBatchSize)
		out["rows"] = total
		out["seconds"] = time.Since(start).Seconds()
	case "pgbench":
		// The same statements for pgbench -M prepared (the runner runs
		// it): scripts in SCRIPTS, and KEYS completed records for the
		// lookup script to find.
		err = writePgbenchScripts(ctx, s, env("SCRIPTS", "."), credHash, int(keys), resp)
	default:
		t.Fatalf("IDEMPOTENCY_BENCH_CEILING=%q: want acquire_complete, acquire_complete_batched, lookup, lookup_batched, replay_statement, preload, prune or pgbench", mode)
	}
	if err != nil {
		t.Fatalf("%s: %v", mode, err)
	}
	if res.Requests > 0 || res.Errors > 0 {
		out["result"] = res
		// Connections are opened on demand and kept: what the pool
		// holds now is the most the load needed at once.
		out["pool_conns"] = s.pool.Stat().TotalConns()
	}
	data, _ := json.Marshal(out)
	if path := env("OUT", ""); path != "" {
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("%s", data)
	return out
}

// lookupOnce runs the store's lookup statement for key and scans what a
// replay needs.
func lookupOnce(ctx context.Context, s *Store, key store.RecordKey) error {
	var (
		status, method, path  string
		fingerprint           []byte
		createdAt, expiresAt  time.Time
		lockedAt, lockedUntil *time.Time
		respStatus            *int32
		respHeaders, respBody []byte
		replayable            *bool
		respSize              *int64
		ttl                   int64
	)
	err := s.pool.QueryRow(ctx, s.sql.lookup, key.CredentialHash[:], key.Key).Scan(
		&status, &fingerprint, &method, &path, &createdAt, &expiresAt,
		&lockedAt, &lockedUntil, &respStatus, &respHeaders, &respBody, &replayable, &respSize, &ttl)
	if err != nil {
		return fmt.Errorf("lookup %s: %w", key.Key, err)
	}
	return nil
}

// acquireAlone is Acquire in a statement of its own, as a store that
// does not batch would send it.
func (s *Store) acquireAlone(ctx context.Context, req store.AcquireRequest) (store.AcquireResult, error) {
	c := &batchCall[queuedAcquire, store.AcquireResult]{ctx: ctx, req: queuedAcquire{AcquireRequest: req}}
	s.sendAcquires(ctx, []*batchCall[queuedAcquire, store.AcquireResult]{c})
	return c.res, c.err
}

// completeAlone is Complete in a statement of its own.
func (s *Store) completeAlone(ctx context.Context, key store.RecordKey, token store.LockToken, resp *store.Response, retention time.Duration) error {
	c := &batchCall[ownedRequest, bool]{ctx: ctx, req: ownedRequest{key: key, token: token, resp: &completion{
		status: int32(resp.Status), headers: store.EncodeHeaders(resp.Header), body: resp.Body,
		replayable: resp.Replayable, size: resp.BodySize, retention: retention,
	}}}
	s.sendOwned(ctx, store.OpComplete, s.sql.complete, []*batchCall[ownedRequest, bool]{c})
	if c.err == nil && !c.res {
		return store.ErrLockLost
	}
	return c.err
}

// lookupBatcher looks completed records up in batches: the lookup
// statement over arrays, scanning what a replay needs.
func lookupBatcher(s *Store) *batcher[store.RecordKey, bool] {
	sql := fmt.Sprintf(`SELECT i.n, %s
FROM unnest($1::bytea[], $2::text[]) WITH ORDINALITY AS i(in_hash, in_key, n)
CROSS JOIN LATERAL (SELECT * FROM %s WHERE credential_hash = i.in_hash AND key = i.in_key OFFSET 0) AS r
WHERE status = 'completed' AND expires_at > now()`, recordColumns, s.table.quoted())
	return &batcher[store.RecordKey, bool]{
		lanes: batchLanes,
		key:   func(k store.RecordKey) store.RecordKey { return k },
		send: func(ctx context.Context, calls []*batchCall[store.RecordKey, bool]) {
			var (
				hashes [][]byte
				keys   []string
			)
			for _, c := range calls {
				hashes = append(hashes, c.req.CredentialHash[:])
				keys = append(keys, c.req.Key)
			}
			rows, err := s.pool.Query(ctx, sql, hashes, keys)
			if err == nil {
				for rows.Next() {
					var (
						n                     int64
						status, method, path  string
						fingerprint           []byte
						createdAt, expiresAt  time.Time
						lockedAt, lockedUntil *time.Time
						respStatus            *int32
						respHeaders, respBody []byte
						replayable            *bool
						respSize              *int64
						ttl                   int64
					)
					if err = rows.Scan(&n, &status, &fingerprint, &method, &path, &createdAt, &expiresAt,
						&lockedAt, &lockedUntil, &respStatus, &respHeaders, &respBody, &replayable, &respSize, &ttl); err != nil {
						break
					}
					calls[n-1].res = true
				}
				rows.Close()
				if err == nil {
					err = rows.Err()
				}
			}
			for _, c := range calls {
				c.err = err
			}
		},
	}
}

// benchPreload inserts n completed records with generate_series, in
// batches, live (expiring in a day) or already expired.
func benchPreload(ctx context.Context, s *Store, n int, expired bool, resp *store.Response) error {
	headers, err := json.Marshal(resp.Header)
	if err != nil {
		return err
	}
	expires := "now() + interval '1 day'"
	if expired {
		expires = "now() - interval '1 hour'"
	}
	nonce := strconv.FormatInt(time.Now().UnixNano(), 36)
	const batch = 250_000
	for from := 0; from < n; from += batch {
		to := min(from+batch, n) - 1
		_, err := s.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (credential_hash, key, fingerprint, method, path, status,
	created_at, expires_at, response_status, response_headers, response_body, replayable, response_size)
SELECT sha256(('preload-tenant-' || (i %% 1000))::bytea), 'preload-%s-' || i, sha256(i::text::bytea), 'POST', '/v1/charges',
	'completed', now(), %s, 200, $1::jsonb, $2::bytea, true, octet_length($2::bytea)
FROM generate_series($3::int, $4::int) AS i`, s.table.quoted(), nonce, expires),
			headers, resp.Body, from, to)
		if err != nil {
			return err
		}
	}
	// Vacuum now what autovacuum would otherwise vacuum during the rows
	// measured next: millions of rows inserted at once cross its insert
	// threshold, and a table that grew over days would have been
	// vacuumed as it grew.
	if _, err := s.pool.Exec(ctx, "VACUUM (ANALYZE) "+s.table.quoted()); err != nil {
		return err
	}
	// Write the preload's pages out now rather than in a checkpoint
	// during the rows measured next. Only a superuser (or, from
	// Postgres 15, pg_checkpoint) may: without it, the figures after a
	// preload may include that checkpoint.
	_, _ = s.pool.Exec(ctx, "CHECKPOINT")
	return nil
}

// writePgbenchScripts writes the store ceiling and the lookup ceiling as
// pgbench scripts into dir: first.sql runs a first execution's acquire
// and complete, lookup.sql a replay's lookup, each the store's own
// statement text for one request, with its parameters as pgbench
// variables (which -M prepared sends as parameters of a prepared
// statement, as pgx does). vars.txt holds the constant variables, one
// -D argument a line. A new key per transaction is a random number, so
// the keys of lookup.sql are the numbers 1..keys, completed here.
func writePgbenchScripts(ctx context.Context, s *Store, dir string, credHash [32]byte, keys int, resp *store.Response) error {
	hexa := func(b []byte) string { return `\x` + hex.EncodeToString(b) }
	token := store.NewLockToken()
	fp := sha256.Sum256([]byte("pgbench"))
	c := completion{status: int32(resp.Status), headers: store.EncodeHeaders(resp.Header), body: resp.Body,
		replayable: resp.Replayable, size: resp.BodySize, retention: defaultRetention}
	acquireArgs := []string{hexa(credHash[:]), "", hexa(fp[:]), http.MethodPost, "/v1/charges", hexa(token[:]),
		strconv.FormatInt(defaultRetention.Microseconds(), 10), strconv.FormatInt(defaultLockTimeout.Microseconds(), 10)}
	completeArgs := []string{hexa(credHash[:]), "", hexa(token[:]), strconv.Itoa(int(c.status)), hexa(c.headers), hexa(c.body),
		strconv.FormatBool(c.replayable), strconv.FormatInt(c.size, 10), strconv.FormatInt(c.retention.Microseconds(), 10)}
	var vars []string
	// script rewrites $n as :<prefix><n>, the key ($2) as :k.
	param := regexp.MustCompile(`\$([0-9]+)`)
	script := func(prefix, sql string, args []string) (string, error) {
		var bad error
		out := param.ReplaceAllStringFunc(sql, func(m string) string {
			n, _ := strconv.Atoi(m[1:])
			if n < 1 || n > len(args) {
				bad = fmt.Errorf("%s: parameter %s of %d", prefix, m, len(args))
				return m
			}
			if n == 2 {
				return ":k"
			}
			return fmt.Sprintf(":%s%d", prefix, n)
		})
		for i, a := range args {
			if i != 1 {
				vars = append(vars, fmt.Sprintf("%s%d=%s", prefix, i+1, a))
			}
		}
		// pgbench ends a statement at a semicolon, and knows no tabs
		// from spaces: one statement a line.
		return strings.Join(strings.Fields(out), " ") + ";\n", bad
	}
	acquire, err := script("a", s.sql.acquire.one, acquireArgs)
	if err != nil {
		return err
	}
	complete, err := script("c", s.sql.complete.one, completeArgs)
	if err != nil {
		return err
	}
	lookup, err := script("l", s.sql.lookup, []string{hexa(credHash[:]), ""})
	if err != nil {
		return err
	}
	files := map[string]string{
		"first.sql":  "\\set k random(1, 1000000000000000)\n" + acquire + complete,
		"lookup.sql": fmt.Sprintf("\\set k random(1, %d)\n", keys) + lookup,
		"vars.txt":   strings.Join(vars, "\n") + "\n",
	}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			return err
		}
	}
	for i := 1; i <= keys; i++ {
		req := store.AcquireRequest{
			Key: store.RecordKey{CredentialHash: credHash, Key: strconv.Itoa(i)}, Token: token, Fingerprint: fp,
			Method: http.MethodPost, Path: "/v1/charges", LockTimeout: defaultLockTimeout, Retention: defaultRetention,
		}
		if _, err := s.Acquire(ctx, req); err != nil {
			return err
		}
		if err := s.Complete(ctx, req.Key, token, resp, defaultRetention); err != nil && !errors.Is(err, store.ErrLockLost) {
			return err
		}
	}
	return nil
}

// pgbenchSmoke runs the scripts that writePgbenchScripts wrote into dir
// for a moment, so that the benchmark's pgbench rows cannot rot: every
// transaction must succeed, and the lookups must find their records.
func pgbenchSmoke(t *testing.T, dsn, dir string) {
	vars, err := os.ReadFile(filepath.Join(dir, "vars.txt"))
	if err != nil {
		t.Fatal(err)
	}
	for _, script := range []string{"first.sql", "lookup.sql"} {
		args := []string{"-n", "-M", "prepared", "-c", "2", "-t", "20", "-f", filepath.Join(dir, script)}
		for _, v := range strings.Fields(string(vars)) {
			args = append(args, "-D", v)
		}
		out, err := exec.Command("pgbench", append(args, dsn)...).CombinedOutput()
		if err != nil {
			t.Fatalf("pgbench %s: %v\n%s", script, err, out)
		}
		if !strings.Contains(string(out), "number of failed transactions: 0") && strings.Contains(string(out), "failed") {
			t.Errorf("pgbench %s failed transactions:\n%s", script, out)
		}
	}
}
