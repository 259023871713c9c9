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
	"strconv"
	"time"
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
	profile     string
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
	flag.StringVar(&cfg.profile, "profile", "", "write a CPU profile of Caddy during each HTTP row's measured window to this directory (row<id>.pprof, the last round's), and its allocations at the window's start and end (row<id>.allocs-start.pprof, row<id>.allocs-end.pprof: compare them with pprof -base)")
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
	if cfg.profile != "" {
		if err := os.MkdirAll(cfg.profile, 0o755); err != nil {
			return err
		}
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
