package main

// The rows of the main table: what a row holds and which of its rounds
// is kept, each row's Caddyfile site and load generator arguments, and
// how the rows are measured.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-idempotency/idempotency/bench/load"
)

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
	m, err := b.rowLoad(ctx, c, id, args...)
	return row{ID: id, What: what, measurement: m}, err
}

// rowLoad measures the load of args on c as row id, with a CPU profile of
// Caddy during the measured window if -profile asks for one.
func (b *bench) rowLoad(ctx context.Context, c *caddyProc, id string, args ...string) (measurement, error) {
	profiled := make(chan error, 1)
	if b.cfg.profile != "" {
		// Within the measured window: after the warmup, and ending before
		// the load does.
		// The allocations are Caddy's since it started: the profiles at
		// either end of the window, compared (pprof -base), give the
		// window's.
		go func() {
			select {
			case <-time.After(b.cfg.warmup):
				path := filepath.Join(b.cfg.profile, "row"+id)
				err := c.pprof(ctx, "allocs", path+".allocs-start.pprof")
				if err == nil {
					err = c.profile(ctx, b.cfg.duration-time.Second, path+".pprof")
				}
				if err == nil {
					err = c.pprof(ctx, "allocs", path+".allocs-end.pprof")
				}
				profiled <- err
			case <-ctx.Done():
				profiled <- ctx.Err()
			}
		}()
	}
	m, err := b.runLoad(ctx, "row"+id, c.addr, b.cfg.warmup, nil, append(b.timing(), args...)...)
	if b.cfg.profile != "" {
		if perr := <-profiled; perr != nil && err == nil {
			err = fmt.Errorf("row %s: profile: %w", id, perr)
		}
	}
	return m, err
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
				m, err := b.rowLoad(ctx, c, "5a", firstArgs(run.name("5a"))...)
				if err := add(row{ID: "5a", What: "first execution, memory store", measurement: m}, err); err != nil {
					return err
				}
			}
			if selected("5b") {
				if err := b.preload(ctx, "row5b-preload", c.addr, run.name("5b")); err != nil {
					return err
				}
				m, err := b.rowLoad(ctx, c, "5b", replayArgs(run.name("5b"), keys)...)
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
			m, err := b.rowLoad(ctx, c, "3", replayArgs(replayKeys, keys)...)
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
