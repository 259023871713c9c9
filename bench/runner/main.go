// Command runner is the benchmark of `make bench`: it builds Caddy with the
// module, starts a trivial upstream, and measures side by side, with the
// same load generator, concurrency and payload (a ~500-byte JSON charge
// request, a ~1 KiB JSON response):
//
//	1   baseline: reverse_proxy to the upstream, no idempotency
//	2   first execution, Postgres store (a new key per request)
//	2b  row 2 through PgBouncer, pool_mode = transaction (pooler.go)
//	3   replay, Postgres store, replay cache off (keys completed beforehand)
//	3b  row 3 through PgBouncer
//	4   replay, Postgres store, replay cache on
//	5a  first execution, memory store
//	5b  replay, memory store
//	5c  row 5a with records expiring 2 s after they are stored: the same
//	    path at a heap that stops growing, so that 5a less 5c is what the
//	    records kept in Caddy's heap cost
//	6   store ceiling: acquire + complete, the store's own SQL through pgx, no HTTP,
//	    one statement per request
//	6b  batched store ceiling: the same through the store, whose concurrent
//	    requests share statements
//	7a  lookup ceiling: the primary-key lookup of a completed record through pgx
//	7b  Caddy respond with the same ~1 KiB body
//	7c  (for reference) the replay statement, acquire on a completed key, through the store
//	7d  batched lookup ceiling: the lookups in flight together share a statement
//	6p, 7p  rows 6 and 7a through pgbench -M prepared: the store's own
//	    statements, as an outside measurement of the SQL alone runs them
//
// and prints requests/s, p50, p99 and Caddy's CPU per request for each,
// the ratios and those of the pooled rows to the direct ones,
// computed from figures of this run only. Rows 2b and 3b need PgBouncer:
// without it, the report says that they were not run. -scale adds the scale runs
// (5M rows, pruning 1M expired rows under load, RSS under 64 concurrent
// 1 MiB bodies); -pools sweeps the Postgres pool size.
//
// Run it from the module's root: go run ./bench/runner [flags].
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/caddy-idempotency/idempotency/bench/load"
)

type config struct {
	duration    time.Duration
	warmup      time.Duration
	concurrency int
	keys        int
	dsn         string
	quick       bool
	scale       bool
	scaleRows   int
	pruneRows   int
	rssConc     int
	scaleParts  string
	pools       string
	rows        string
	keep        bool
	rounds      int
	pgbouncer   string
}

// appDSN is the DSN with an application_name that lets the CPU sampler
// tell the benchmark's Postgres backends from anyone else's.
func (c config) appDSN() string {
	u, err := url.Parse(c.dsn)
	if err != nil || u.Scheme == "" {
		return c.dsn + " application_name=idempotency-bench"
	}
	q := u.Query()
	q.Set("application_name", "idempotency-bench")
	u.RawQuery = q.Encode()
	return u.String()
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func main() {
	var cfg config
	defDur, _ := time.ParseDuration(envOr("BENCH_DURATION", "6s"))
	defConc, _ := strconv.Atoi(envOr("BENCH_CONCURRENCY", "32"))
	flag.DurationVar(&cfg.duration, "d", defDur, "measured duration of each row (env BENCH_DURATION)")
	flag.DurationVar(&cfg.warmup, "warmup", 2*time.Second, "unmeasured warmup of each row")
	flag.IntVar(&cfg.concurrency, "c", defConc, "concurrency: requests in flight, for every row (env BENCH_CONCURRENCY)")
	flag.IntVar(&cfg.keys, "keys", 1000, "completed keys that the replay rows cycle through")
	flag.StringVar(&cfg.dsn, "dsn", envOr("BENCH_DSN", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "Postgres (env BENCH_DSN)")
	flag.BoolVar(&cfg.quick, "quick", os.Getenv("BENCH_QUICK") == "1", "smoke test: 2s rows, 1s warmup, 200 keys (env BENCH_QUICK=1)")
	flag.BoolVar(&cfg.scale, "scale", false, "also run the scale benchmark (minutes): 5M rows, pruning under load, RSS")
	flag.IntVar(&cfg.scaleRows, "scale-rows", 5_000_000, "rows preloaded for the scale benchmark")
	flag.IntVar(&cfg.pruneRows, "prune-rows", 1_000_000, "expired rows pruned under load in the scale benchmark")
	flag.IntVar(&cfg.rssConc, "rss-c", 64, "concurrent 1 MiB requests of the memory run")
	flag.StringVar(&cfg.scaleParts, "scale-parts", "", "with -scale, only these parts: rows, prune, rss (default all)")
	flag.StringVar(&cfg.pools, "pools", "", "sweep the Postgres pool size over these max_conns (e.g. 4,8,16,32) instead of the main table")
	flag.StringVar(&cfg.rows, "rows", "", "run only these rows of the main table (e.g. 1,2,6); the ratios need their rows")
	flag.BoolVar(&cfg.keep, "keep", false, "keep the benchmark's tables")
	flag.IntVar(&cfg.rounds, "rounds", 2, "measure every row this many times and keep each row's best round")
	flag.StringVar(&cfg.pgbouncer, "pgbouncer", "", "PgBouncer binary of rows 2b and 3b (default: on PATH or /usr/sbin/pgbouncer; off: skip them)")
	flag.Parse()
	if cfg.quick {
		// Shorter everything, but what the command line says.
		set := map[string]bool{}
		flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if !set["d"] {
			cfg.duration = 2 * time.Second
		}
		if !set["warmup"] {
			cfg.warmup = time.Second
		}
		if !set["keys"] {
			cfg.keys = 200
		}
		if !set["scale-rows"] {
			cfg.scaleRows = 200_000
		}
		if !set["prune-rows"] {
			cfg.pruneRows = 50_000
		}
		if !set["rounds"] {
			cfg.rounds = 1
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg config) error {
	root, err := os.Getwd()
	if err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(root, "cmd", "caddy")); err != nil {
		return fmt.Errorf("run from the module's root (make bench): %v", err)
	}
	started := time.Now()
	logs := filepath.Join(root, "bench", "results", started.UTC().Format("20060102-150405"))
	if err := os.MkdirAll(logs, 0o755); err != nil {
		return err
	}
	bin, err := os.MkdirTemp("", "idempotency-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(bin)

	b := &bench{cfg: cfg, bin: bin, logs: logs}
	env, err := describeEnvironment(ctx, cfg)
	if err != nil {
		return err
	}
	progress("building caddy, the load generator, the upstream and the ceiling test binary")
	if err := b.build(root); err != nil {
		return err
	}
	b.sampler = newCPUSampler(cfg.appDSN())
	defer b.sampler.stop()
	// The runner's own sampling is the benchmark's, not another tenant's.
	b.sampler.track(os.Getpid(), "runner")
	if err := b.startUpstream(); err != nil {
		return err
	}
	defer b.stopUpstream()

	var nonce [2]byte
	_, _ = rand.Read(nonce[:])
	// Three hex digits name the run, the fourth its round.
	prefix := hex.EncodeToString(nonce[:])[:3]
	run := runNames{prefix: prefix + "1"}
	tables := newTables(cfg, prefix)
	if !cfg.keep {
		defer tables.drop(context.Background())
	}

	if cfg.pools != "" {
		return b.poolSweep(ctx, run, tables, env, started)
	}
	defer func() {
		if b.pooler != nil {
			b.pooler.stop(logs)
		}
	}()

	// Every row is measured in each round and its best round kept: the
	// machine's other tenants (a compiler, a test run) only ever slow a
	// row down, so the best of a few is the least disturbed.
	var rounds [][]row
	for r := 1; r <= cfg.rounds; r++ {
		if cfg.rounds > 1 {
			progress("round %d of %d", r, cfg.rounds)
		}
		rows, err := b.mainRows(ctx, runNames{prefix: prefix + strconv.Itoa(r%10)}, tables)
		if err != nil {
			return err
		}
		rounds = append(rounds, rows)
	}
	rows := bestRounds(rounds)
	report := &report{Env: env, Config: reportConfig(cfg), Rows: rows, Started: started.UTC(), PoolerMissing: b.poolerMissing}
	report.Ratios = ratios(rows)
	report.Pooled = pooledRatios(rows)
	if cfg.scale {
		sc, err := b.scaleRuns(ctx, run, tables, rows)
		if err != nil {
			return err
		}
		report.Scale = sc
	}
	report.print(os.Stdout)
	data, _ := json.MarshalIndent(report, "", "  ")
	_ = os.WriteFile(filepath.Join(logs, "results.json"), data, 0o644)
	fmt.Printf("\nlogs, Caddyfiles and results.json: %s\n", logs)
	return nil
}

func progress(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...)
}

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

// row is one line of the table.
type row struct {
	ID   string `json:"id"`
	What string `json:"what"`
	measurement
	// Rounds are the requests/s of every round, the kept one included.
	Rounds []float64 `json:"rounds_rps,omitempty"`
}

// bestRounds keeps, for every row, the round with the most requests/s.
func bestRounds(rounds [][]row) []row {
	if len(rounds) == 0 {
		return nil
	}
	out := make([]row, 0, len(rounds[0]))
	for _, first := range rounds[0] {
		best := first
		var all []float64
		for _, rows := range rounds {
			for _, r := range rows {
				if r.ID != first.ID {
					continue
				}
				all = append(all, r.RPS)
				if r.RPS > best.RPS {
					best = r
				}
			}
		}
		if len(rounds) > 1 {
			best.Rounds = all
		}
		out = append(out, best)
	}
	return out
}

// environment describes the machine and the database.
type environment struct {
	Date       string `json:"date"`
	Machine    string `json:"machine"`
	CPUs       int    `json:"cpus"`
	Go         string `json:"go"`
	Postgres   string `json:"postgres"`
	PGSettings string `json:"postgres_settings"`
}

func describeEnvironment(ctx context.Context, cfg config) (environment, error) {
	env := environment{
		Date:    time.Now().UTC().Format("2006-01-02 15:04 UTC"),
		Machine: runtime.GOOS + "/" + runtime.GOARCH,
		CPUs:    runtime.NumCPU(),
		Go:      runtime.Version(),
	}
	if model := cpuModel(); model != "" {
		env.Machine += ", " + model
	}
	conn, err := pgx.Connect(ctx, cfg.dsn)
	if err != nil {
		return env, fmt.Errorf("connecting to Postgres (%s): %w", cfg.dsn, err)
	}
	defer conn.Close(ctx)
	if err := conn.QueryRow(ctx, "SELECT split_part(version(), ' ', 2)").Scan(&env.Postgres); err != nil {
		return env, err
	}
	rows, err := conn.Query(ctx, `SELECT name || '=' || setting || coalesce(unit, '') FROM pg_settings
		WHERE name IN ('synchronous_commit', 'fsync', 'shared_buffers', 'max_connections') ORDER BY name`)
	if err != nil {
		return env, err
	}
	settings, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return env, err
	}
	env.PGSettings = strings.Join(settings, " ")
	return env, nil
}

func cpuModel() string {
	data, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "model name"); ok {
			return strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
		}
	}
	return ""
}

// Sites of the Caddyfiles.

func (b *bench) proxySite() string {
	return fmt.Sprintf("\treverse_proxy %s", b.upstream)
}

func (b *bench) postgresSite(table, extra string) string {
	return b.postgresSiteDSN(b.cfg.appDSN(), table, extra)
}

func (b *bench) postgresSiteDSN(dsn, table, extra string) string {
	return fmt.Sprintf(`	idempotency {
		store postgres {
			dsn %q
			table %s%s
		}
		prune_interval 0
		%s
	}
	reverse_proxy %s`, dsn, table, "", extra, b.upstream)
}

func (b *bench) postgresSitePool(table string, maxConns int, extra string) string {
	return fmt.Sprintf(`	idempotency {
		store postgres {
			dsn %q
			table %s
			max_conns %d
		}
		prune_interval 0
		%s
	}
	reverse_proxy %s`, b.cfg.appDSN(), table, maxConns, extra, b.upstream)
}

func (b *bench) memorySite() string { return b.memorySiteWith("") }

// expiringRecords has row 5c's records expire, and pruned, within
// seconds: the store then holds a few seconds' records, and Caddy's heap
// stops growing once the row has run that long.
const expiringRecords = `
		lock_timeout 1s
		retention 2s
		prune_interval 1s`

func (b *bench) memorySiteWith(extra string) string {
	// Room for every key of a run: a full memory store answers 503.
	return fmt.Sprintf(`	idempotency {
		store memory {
			max_entries 50000000
		}%s
	}
	reverse_proxy %s`, extra, b.upstream)
}

func respondSite() string {
	return fmt.Sprintf("\theader Content-Type application/json\n\trespond `%s` 200", load.ResponseBody(load.ResponseBodySize))
}

// Load generator arguments.

func firstArgs(run string) []string {
	return []string{"-run", run, "-replay", "false"}
}

func replayArgs(run string, keys int) []string {
	return []string{"-run", run, "-keys", strconv.Itoa(keys), "-replay", "true"}
}

func (b *bench) timing() []string {
	return []string{"-d", b.cfg.duration.String(), "-warmup", b.cfg.warmup.String()}
}

// preload completes keys 0..keys-1 of run through addr.
func (b *bench) preload(ctx context.Context, name, addr, run string) error {
	m, err := b.runLoad(ctx, name, addr, 0, nil, "-run", run, "-count", strconv.Itoa(b.cfg.keys), "-replay", "false")
	if err != nil {
		return err
	}
	if m.Errors > 0 || m.Requests != int64(b.cfg.keys) {
		return fmt.Errorf("%s: %d of %d keys completed, %d errors: %s", name, m.Requests, b.cfg.keys, m.Errors, m.FirstError)
	}
	return nil
}

// httpRow starts Caddy with site and measures the load of args.
func (b *bench) httpRow(ctx context.Context, id, what, site string, args ...string) (row, error) {
	progress("row %s: %s", id, what)
	c, err := b.startCaddy("row"+id, site)
	if err != nil {
		return row{}, err
	}
	defer c.stop()
	m, err := b.runLoad(ctx, "row"+id, c.addr, b.cfg.warmup, nil, append(b.timing(), args...)...)
	return row{ID: id, What: what, measurement: m}, err
}

// pooledDSN is the store's DSN through PgBouncer, which it starts at the
// first pooled row of the run. Without PgBouncer, it notes why in
// b.poolerMissing, for the report, and returns false.
func (b *bench) pooledDSN() (string, bool) {
	if b.pooler == nil && b.poolerMissing == "" {
		bin, err := findPgBouncer(b.cfg.pgbouncer)
		if err == nil {
			b.pooler, err = b.startPooler(bin)
		}
		if err != nil {
			b.poolerMissing = err.Error()
			progress("rows 2b, 3b: not run: %s", b.poolerMissing)
		}
	}
	if b.pooler == nil {
		return "", false
	}
	return b.pooler.dsn, true
}

func (b *bench) ceilingRow(ctx context.Context, id, what, mode string, env map[string]string) (row, error) {
	progress("row %s: %s", id, what)
	m, _, err := b.runCeiling(ctx, "row"+id, mode, env)
	return row{ID: id, What: what, measurement: m}, err
}

// mainRows measures the table's rows, in an order that keeps each
// row's preconditions (completed keys) and its neighbours' leftovers out
// of the way, and returns them in the order.
func (b *bench) mainRows(ctx context.Context, run runNames, t *tables) ([]row, error) {
	want := map[string]bool{}
	for _, id := range strings.Split(b.cfg.rows, ",") {
		if id = strings.TrimSpace(id); id != "" {
			want[id] = true
			if id == "5" || id == "7" {
				want[id+"a"], want[id+"b"] = true, true
			}
		}
	}
	selected := func(id string) bool { return len(want) == 0 || want[id] }
	var rows []row
	add := func(r row, err error) error {
		if err != nil {
			return err
		}
		if r.Errors > 0 {
			progress("row %s: %d errors, the first: %s", r.ID, r.Errors, r.FirstError)
		}
		rows = append(rows, r)
		return nil
	}
	keys := b.cfg.keys

	// The baseline and respond rows send the very requests of the rows
	// they are compared with, Idempotency-Key included: the same bytes
	// for Caddy to parse and, in the baseline, to forward; and the same
	// work for the load generator, which shares the CPUs.
	if selected("1") {
		if err := add(b.httpRow(ctx, "1", "baseline: reverse_proxy, no idempotency", b.proxySite(),
			"-run", run.name("1"), "-expect", "200")); err != nil {
			return nil, err
		}
	}
	if selected("7b") {
		if err := add(b.httpRow(ctx, "7b", "Caddy respond, the same ~1 KiB body", respondSite(),
			"-run", run.name("7b"), "-keys", strconv.Itoa(keys), "-expect", "200")); err != nil {
			return nil, err
		}
	}
	if selected("5a") || selected("5b") {
		progress("row 5: memory store")
		c, err := b.startCaddy("row5", b.memorySite())
		if err != nil {
			return nil, err
		}
		err = func() error {
			defer c.stop()
			if selected("5a") {
				m, err := b.runLoad(ctx, "row5a", c.addr, b.cfg.warmup, nil, append(b.timing(), firstArgs(run.name("5a"))...)...)
				if err := add(row{ID: "5a", What: "first execution, memory store", measurement: m}, err); err != nil {
					return err
				}
			}
			if selected("5b") {
				if err := b.preload(ctx, "row5b-preload", c.addr, run.name("5b")); err != nil {
					return err
				}
				m, err := b.runLoad(ctx, "row5b", c.addr, b.cfg.warmup, nil, append(b.timing(), replayArgs(run.name("5b"), keys)...)...)
				return add(row{ID: "5b", What: "replay, memory store", measurement: m}, err)
			}
			return nil
		}()
		if err != nil {
			return nil, err
		}
	}
	if selected("5c") {
		if err := add(b.httpRow(ctx, "5c", "first execution, memory store, 2 s retention", b.memorySiteWith(expiringRecords),
			firstArgs(run.name("5c"))...)); err != nil {
			return nil, err
		}
	}
	if selected("2") {
		if err := add(b.httpRow(ctx, "2", "first execution, Postgres", b.postgresSite(t.main, ""),
			firstArgs(run.name("2"))...)); err != nil {
			return nil, err
		}
	}
	if selected("2b") {
		if dsn, ok := b.pooledDSN(); ok {
			if err := add(b.httpRow(ctx, "2b", "first execution, Postgres via PgBouncer", b.postgresSiteDSN(dsn, t.main, ""),
				firstArgs(run.name("2b"))...)); err != nil {
				return nil, err
			}
		}
	}
	replayKeys := run.name("3")
	if selected("3") || selected("3b") || selected("4") || selected("7a") || selected("7c") || selected("7d") {
		progress("row 3: completing %d keys for the replay rows", keys)
		c, err := b.startCaddy("row3", b.postgresSite(t.main, "replay_cache off"))
		if err != nil {
			return nil, err
		}
		err = func() error {
			defer c.stop()
			if err := b.preload(ctx, "row3-preload", c.addr, replayKeys); err != nil {
				return err
			}
			if !selected("3") {
				return nil
			}
			progress("row 3: replay, Postgres, replay cache off")
			m, err := b.runLoad(ctx, "row3", c.addr, b.cfg.warmup, nil, append(b.timing(), replayArgs(replayKeys, keys)...)...)
			return add(row{ID: "3", What: "replay, Postgres, replay cache off", measurement: m}, err)
		}()
		if err != nil {
			return nil, err
		}
	}
	if selected("3b") {
		if dsn, ok := b.pooledDSN(); ok {
			if err := add(b.httpRow(ctx, "3b", "replay, Postgres via PgBouncer, cache off", b.postgresSiteDSN(dsn, t.main, "replay_cache off"),
				replayArgs(replayKeys, keys)...)); err != nil {
				return nil, err
			}
		}
	}
	if selected("4") {
		if err := add(b.httpRow(ctx, "4", "replay, Postgres, replay cache on", b.postgresSite(t.main, ""),
			replayArgs(replayKeys, keys)...)); err != nil {
			return nil, err
		}
	}
	if selected("6") {
		if err := add(b.ceilingRow(ctx, "6", "store ceiling: acquire + complete via pgx", "acquire_complete",
			map[string]string{"TABLE": t.store, "RUN": run.name("6")})); err != nil {
			return nil, err
		}
	}
	if selected("6b") {
		if err := add(b.ceilingRow(ctx, "6b", "batched store ceiling: acquire + complete via the store", "acquire_complete_batched",
			map[string]string{"TABLE": t.store, "RUN": run.name("6b")})); err != nil {
			return nil, err
		}
	}
	lookupEnv := map[string]string{"TABLE": t.main, "RUN": replayKeys, "KEYS": strconv.Itoa(keys)}
	if selected("7a") {
		if err := add(b.ceilingRow(ctx, "7a", "lookup ceiling: replay SELECT via pgx", "lookup", lookupEnv)); err != nil {
			return nil, err
		}
	}
	if selected("7c") {
		if err := add(b.ceilingRow(ctx, "7c", "(ref.) acquire on a completed key via the store", "replay_statement", lookupEnv)); err != nil {
			return nil, err
		}
	}
	if selected("7d") {
		if err := add(b.ceilingRow(ctx, "7d", "batched lookup ceiling: replay SELECTs sharing statements", "lookup_batched", lookupEnv)); err != nil {
			return nil, err
		}
	}
	if selected("6p") || selected("7p") {
		// The same statements through pgbench -M prepared, the tool an
		// outside measurement uses for a store's SQL alone: scripts from
		// the store's own text, on tables of their own.
		dir := filepath.Join(b.logs, "pgbench")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
		if _, _, err := b.runCeiling(ctx, "pgbench-prepare", "pgbench", map[string]string{
			"TABLE": t.pgbench, "SCRIPTS": dir, "KEYS": strconv.Itoa(keys)}); err != nil {
			return nil, err
		}
		for _, r := range []struct{ id, what, script string }{
			{"6p", "store ceiling: acquire + complete via pgbench", "first.sql"},
			{"7p", "lookup ceiling: replay SELECT via pgbench", "lookup.sql"},
		} {
			if !selected(r.id) {
				continue
			}
			progress("row %s: %s", r.id, r.what)
			m, err := b.runPgbench(ctx, "row"+r.id, dir, r.script)
			if err := add(row{ID: r.id, What: r.what, measurement: m}, err); err != nil {
				return nil, err
			}
		}
	}
	order := []string{"1", "2", "2b", "3", "3b", "4", "5a", "5b", "5c", "6", "6b", "6p", "7a", "7b", "7c", "7d", "7p"}
	sorted := make([]row, 0, len(rows))
	for _, id := range order {
		for _, r := range rows {
			if r.ID == id {
				sorted = append(sorted, r)
			}
		}
	}
	return sorted, nil
}
