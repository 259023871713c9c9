package main

import (
	"fmt"
	"io"
	"strings"
	"time"
)

type report struct {
	Started time.Time      `json:"started"`
	Env     environment    `json:"environment"`
	Config  map[string]any `json:"config"`
	Rows    []row          `json:"rows"`
	Ratios  []ratio        `json:"ratios"`
	// Pooled compares rows 2b and 3b with rows 2 and 3; PoolerMissing
	// says why they were not run.
	Pooled        []pooledRatio `json:"pooled,omitempty"`
	PoolerMissing string        `json:"pooler_missing,omitempty"`
	Scale         *scaleReport  `json:"scale,omitempty"`
}

func reportConfig(cfg config) map[string]any {
	return map[string]any{
		"duration":    cfg.duration.String(),
		"warmup":      cfg.warmup.String(),
		"concurrency": cfg.concurrency,
		"replay_keys": cfg.keys,
		"quick":       cfg.quick,
	}
}

// ratio is one of the targets, computed from this run's rows.
type ratio struct {
	What    string  `json:"what"`
	Formula string  `json:"formula"`
	Value   float64 `json:"value"`
	Target  float64 `json:"target"`
	Met     bool    `json:"met"`
	// PerCPU is the same ratio over requests per core-second of the
	// benchmark's own processes (ourCPU): a second view, less sensitive
	// to CPU taken by other tenants of the machine, and blind to waiting
	// (a commit's flush costs no CPU).
	PerCPU float64 `json:"per_cpu,omitempty"`
}

// ourCPU is the CPU the benchmark's own processes used during a row, in
// cores.
func ourCPU(cpu map[string]float64) float64 {
	return cpu["caddy"] + cpu["loadgen"] + cpu["upstream"] + cpu["postgres"] + cpu["pgx client"] + cpu["pooler"]
}

// pooledRatio is a row through PgBouncer over the same row direct.
type pooledRatio struct {
	What    string  `json:"what"`
	Formula string  `json:"formula"`
	RPS     float64 `json:"rps_ratio"`
	PerCPU  float64 `json:"per_cpu,omitempty"`
	// CaddyMicros and PostgresMicros are Caddy's and Postgres's CPU per
	// request, direct and pooled: a statement that a pooled connection
	// cannot keep prepared is parsed and planned by every execution.
	CaddyMicros    [2]float64 `json:"caddy_us"`
	PostgresMicros [2]float64 `json:"postgres_us"`
}

func pooledRatios(rows []row) []pooledRatio {
	byID := map[string]row{}
	for _, r := range rows {
		byID[r.ID] = r
	}
	var out []pooledRatio
	for _, p := range []struct{ what, direct, pooled string }{
		{"first execution, Postgres", "2", "2b"},
		{"replay, Postgres, no cache", "3", "3b"},
	} {
		d, okd := byID[p.direct]
		q, okq := byID[p.pooled]
		if !okd || !okq || d.RPS <= 0 {
			continue
		}
		r := pooledRatio{What: p.what, Formula: p.pooled + " / " + p.direct, RPS: q.RPS / d.RPS}
		if cd, cq := ourCPU(d.CPU), ourCPU(q.CPU); cd > 0 && cq > 0 {
			r.PerCPU = (q.RPS / cq) / (d.RPS / cd)
		}
		for i, x := range []row{d, q} {
			if x.RPS > 0 {
				r.CaddyMicros[i] = x.CPU["caddy"] / x.RPS * 1e6
				r.PostgresMicros[i] = x.CPU["postgres"] / x.RPS * 1e6
			}
		}
		out = append(out, r)
	}
	return out
}

// compose is the L(a, b) = 1/(1/a + 1/b): the throughput of a row
// that must do both a and b on the same CPUs.
func compose(a, b float64) float64 {
	if a <= 0 || b <= 0 {
		return 0
	}
	return 1 / (1/a + 1/b)
}

func ratios(rows []row) []ratio {
	rps, eff := map[string]float64{}, map[string]float64{}
	for _, r := range rows {
		rps[r.ID] = r.RPS
		if c := ourCPU(r.CPU); c > 0 {
			eff[r.ID] = r.RPS / c
		}
	}
	var out []ratio
	addRatio := func(what, formula string, value func(v map[string]float64) float64, target float64, need ...string) {
		for _, id := range need {
			if rps[id] == 0 {
				return
			}
		}
		v := value(rps)
		q := ratio{What: what, Formula: formula, Value: v, Target: target, Met: v >= target}
		complete := true
		for _, id := range need {
			complete = complete && eff[id] > 0
		}
		if complete {
			q.PerCPU = value(eff)
		}
		out = append(out, q)
	}
	addRatio("first execution, memory store", "5a / 1",
		func(v map[string]float64) float64 { return v["5a"] / v["1"] }, 0.95, "5a", "1")
	addRatio("first execution, memory, 2 s retention", "5c / 1",
		func(v map[string]float64) float64 { return v["5c"] / v["1"] }, 0.95, "5c", "1")
	addRatio("replay, memory store", "5b / 7b",
		func(v map[string]float64) float64 { return v["5b"] / v["7b"] }, 0.94, "5b", "7b")
	addRatio("replay, replay cache (Postgres)", "4 / 7b",
		func(v map[string]float64) float64 { return v["4"] / v["7b"] }, 0.94, "4", "7b")
	// Batched, the store beats any design that sends a statement per
	// request (rows 6 and 7a), and comes close to its own batched
	// ceilings (6b, 7d).
	addRatio("first execution, Postgres", "2 / L(1, 6)",
		func(v map[string]float64) float64 { return v["2"] / compose(v["1"], v["6"]) }, 1.25, "2", "1", "6")
	addRatio("first execution, Postgres, batched ceiling", "2 / L(1, 6b)",
		func(v map[string]float64) float64 { return v["2"] / compose(v["1"], v["6b"]) }, 0.85, "2", "1", "6b")
	addRatio("replay, Postgres, no cache", "3 / L(7b, 7a)",
		func(v map[string]float64) float64 { return v["3"] / compose(v["7b"], v["7a"]) }, 1.0, "3", "7b", "7a")
	addRatio("replay, Postgres, no cache, batched ceiling", "3 / L(7b, 7d)",
		func(v map[string]float64) float64 { return v["3"] / compose(v["7b"], v["7d"]) }, 0.85, "3", "7b", "7d")
	// The same bars with pgbench's figures for the store's statements,
	// as an outside measurement takes them.
	addRatio("first execution, Postgres, pgbench ceiling", "2 / L(1, 6p)",
		func(v map[string]float64) float64 { return v["2"] / compose(v["1"], v["6p"]) }, 1.25, "2", "1", "6p")
	addRatio("replay, Postgres, no cache, pgbench ceiling", "3 / L(7b, 7p)",
		func(v map[string]float64) float64 { return v["3"] / compose(v["7b"], v["7p"]) }, 1.0, "3", "7b", "7p")
	return out
}

func ms(d time.Duration) string {
	switch {
	case d <= 0:
		return "-"
	case d < 10*time.Millisecond:
		return fmt.Sprintf("%.2fms", float64(d)/1e6)
	default:
		return fmt.Sprintf("%.1fms", float64(d)/1e6)
	}
}

func (r *report) print(w io.Writer) {
	e := r.Env
	fmt.Fprintf(w, "\nidempotency benchmark, %s\n", e.Date)
	fmt.Fprintf(w, "machine: %s, %d CPUs; %s; Postgres %s (%s)\n", e.Machine, e.CPUs, e.Go, e.Postgres, e.PGSettings)
	fmt.Fprintf(w, "load: %v concurrent, %s per row after %s warmup; request ~500 B JSON, response ~1 KiB JSON; replays cycle %v keys\n\n",
		r.Config["concurrency"], r.Config["duration"], r.Config["warmup"], r.Config["replay_keys"])
	fmt.Fprintf(w, "%-4s %-46s %9s %8s %8s %6s %9s   %s\n", "row", "what", "req/s", "p50", "p99", "errors", "caddy µs", "CPU (cores): caddy gen upstream pg client pooler | other")
	for _, row := range r.Rows {
		fmt.Fprintf(w, "%-4s %-46s %9.0f %8s %8s %6d %9s   %s\n", row.ID, row.What, row.RPS, ms(row.P50), ms(row.P99), row.Errors, caddyMicros(row), cpuLine(row.CPU))
	}
	fmt.Fprintf(w, "caddy µs: Caddy's CPU time per request (user + system, all cores), the cost this module adds to a row\n")
	if len(r.Pooled) > 0 {
		fmt.Fprintf(w, "\nthrough PgBouncer (pool_mode = transaction, default_query_exec_mode = cache_describe) over direct, this run:\n")
		for _, p := range r.Pooled {
			perCPU := ""
			if p.PerCPU > 0 {
				perCPU = fmt.Sprintf("   [per core-second: %.2f]", p.PerCPU)
			}
			fmt.Fprintf(w, "  %-44s %-14s %5.2f req/s   caddy µs %.0f direct, %.0f pooled; postgres µs %.0f, %.0f%s\n",
				p.What, p.Formula, p.RPS, p.CaddyMicros[0], p.CaddyMicros[1], p.PostgresMicros[0], p.PostgresMicros[1], perCPU)
		}
	}
	if r.PoolerMissing != "" {
		fmt.Fprintf(w, "\nrows 2b and 3b (through PgBouncer) were NOT run: %s\n", r.PoolerMissing)
	}
	if len(r.Rows) > 0 && len(r.Rows[0].Rounds) > 1 {
		var parts []string
		for _, row := range r.Rows {
			var rps []string
			for _, v := range row.Rounds {
				rps = append(rps, fmt.Sprintf("%.0f", v))
			}
			parts = append(parts, row.ID+": "+strings.Join(rps, "/"))
		}
		fmt.Fprintf(w, "each row is the best of %d rounds (req/s of every round: %s)\n", len(r.Rows[0].Rounds), strings.Join(parts, ", "))
	}
	if len(r.Ratios) > 0 {
		fmt.Fprintf(w, "\ntargets (L(a,b) = 1/(1/a+1/b), every figure from this run):\n")
		for _, q := range r.Ratios {
			verdict := "met"
			if !q.Met {
				verdict = fmt.Sprintf("NOT met (%.1f%% short)", (1-q.Value/q.Target)*100)
			}
			perCPU := ""
			if q.PerCPU > 0 {
				perCPU = fmt.Sprintf("   [per core-second: %.2f]", q.PerCPU)
			}
			fmt.Fprintf(w, "  %-44s %-14s %5.2f  (target >= %.2f)  %-22s%s\n", q.What, q.Formula, q.Value, q.Target, verdict, perCPU)
		}
		fmt.Fprintf(w, "  [per core-second]: the same ratio over requests per CPU-second of the benchmark's own processes;\n"+
			"  a second view, less sensitive to other tenants of the machine, blind to waiting (a commit's flush costs no CPU)\n")
	}
	if lines := cpuOverBaseline(r.Rows); len(lines) > 0 {
		fmt.Fprintf(w, "\nCaddy's CPU per request over the plain proxy's (row 1):\n")
		for _, l := range lines {
			fmt.Fprintf(w, "  %s\n", l)
		}
	}
	var busy []string
	for _, row := range r.Rows {
		if row.CPU["other"] >= 0.15 {
			busy = append(busy, fmt.Sprintf("%s (%.2f cores)", row.ID, row.CPU["other"]))
		}
	}
	if len(busy) > 0 {
		fmt.Fprintf(w, "\nWARNING: other processes used CPU during rows %s: those figures were taken under foreign load; rerun before trusting them.\n", strings.Join(busy, ", "))
	}
	if r.Scale != nil {
		r.Scale.print(w)
	}
}

func cpuLine(cpu map[string]float64) string {
	f := func(k string) string {
		v := cpu[k]
		if v < 0.005 {
			return "   -"
		}
		return fmt.Sprintf("%4.2f", v)
	}
	return fmt.Sprintf("%s %s %s %s %s %s | %s", f("caddy"), f("loadgen"), f("upstream"), f("postgres"), f("pgx client"), f("pooler"), f("other"))
}

// cpuTargets bound what a row's request may cost Caddy over a bare
// proxied request, in microseconds: a first execution on the memory
// store (issue 24) and on Postgres (issue 36).
var cpuTargets = map[string]float64{"2": 100, "5a": 20, "5c": 20}

// cpuRows are the rows whose Caddy CPU per request is set against the
// baseline's, in this order.
var cpuRows = []string{"2", "2b", "3", "3b", "4", "5a", "5b", "5c"}

// cpuOverBaseline gives, for each row of cpuRows that ran, Caddy's CPU
// per request less the baseline's, and, for a row with a target, whether
// it meets it; and 5a less 5c, what the memory store's records kept in
// Caddy's heap cost. Nil without a baseline.
func cpuOverBaseline(rows []row) []string {
	micros := map[string]float64{}
	for _, r := range rows {
		if r.CPU["caddy"] >= 0.005 && r.RPS > 0 {
			micros[r.ID] = r.CPU["caddy"] / r.RPS * 1e6
		}
	}
	base, ok := micros["1"]
	if !ok {
		return nil
	}
	var out []string
	for _, id := range cpuRows {
		v, ok := micros[id]
		if !ok {
			continue
		}
		line := fmt.Sprintf("%-3s %.0f µs against %.0f: %+.0f µs", id, v, base, v-base)
		if target, ok := cpuTargets[id]; ok {
			verdict := "met"
			if v-base > target {
				verdict = "NOT met"
			}
			line += fmt.Sprintf("  (target <= +%.0f) %s", target, verdict)
		}
		out = append(out, line)
	}
	if a, ok := micros["5a"]; ok {
		if c, ok := micros["5c"]; ok {
			out = append(out, fmt.Sprintf("5a less 5c, the records kept in Caddy's heap: %+.0f µs", a-c))
		}
	}
	return out
}

// caddyMicros is Caddy's CPU per request of a row, in microseconds: the
// module's own cost is a first execution's figure less the baseline's.
func caddyMicros(r row) string {
	if r.CPU["caddy"] < 0.005 || r.RPS <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f", r.CPU["caddy"]/r.RPS*1e6)
}
