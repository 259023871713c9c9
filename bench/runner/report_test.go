package main

import (
	"bytes"
	"math"
	"strings"
	"testing"

	"github.com/caddy-idempotency/idempotency/bench/load"
)

func TestCompose(t *testing.T) {
	if got := compose(1000, 1000); got != 500 {
		t.Errorf("L(1000, 1000) = %v, want 500", got)
	}
	if got := compose(3000, 1500); math.Abs(got-1000) > 1e-9 {
		t.Errorf("L(3000, 1500) = %v, want 1000", got)
	}
	if compose(0, 10) != 0 {
		t.Error("L with a missing figure is not 0")
	}
}

func TestRatiosFromTheRun(t *testing.T) {
	rps := map[string]float64{"1": 10000, "2": 1700, "3": 6000, "4": 14000, "5a": 9600, "5b": 13000, "6": 2500, "6b": 5000, "7a": 20000, "7b": 15000, "7d": 40000}
	var rows []row
	for id, v := range rps {
		rows = append(rows, row{ID: id, measurement: measurement{Result: load.Result{RPS: v}}})
	}
	got := map[string]ratio{}
	for _, r := range ratios(rows) {
		got[r.Formula] = r
	}
	want := map[string]float64{
		"5a / 1":        0.96,
		"5b / 7b":       13000.0 / 15000,
		"4 / 7b":        14000.0 / 15000,
		"2 / L(1, 6)":   1700 / compose(10000, 2500),
		"2 / L(1, 6b)":  1700 / compose(10000, 5000),
		"3 / L(7b, 7a)": 6000 / compose(15000, 20000),
		"3 / L(7b, 7d)": 6000 / compose(15000, 40000),
	}
	for f, v := range want {
		if math.Abs(got[f].Value-v) > 1e-9 {
			t.Errorf("%s = %v, want %v", f, got[f].Value, v)
		}
	}
	if !got["5a / 1"].Met || got["5b / 7b"].Met || got["2 / L(1, 6)"].Met || got["2 / L(1, 6b)"].Met {
		t.Errorf("verdicts: %+v", got)
	}

	// Rows that were not run give no ratio, rather than a wrong one.
	if r := ratios(rows[:1]); len(r) != 0 {
		t.Errorf("ratios from one row: %+v", r)
	}

	var out bytes.Buffer
	(&report{Rows: rows, Ratios: ratios(rows), Config: map[string]any{}}).print(&out)
	for _, s := range []string{"req/s", "targets", "NOT met", "5b / 7b"} {
		if !strings.Contains(out.String(), s) {
			t.Errorf("report lacks %q:\n%s", s, out.String())
		}
	}
}

func TestBestRounds(t *testing.T) {
	mk := func(id string, rps float64) row {
		return row{ID: id, measurement: measurement{Result: load.Result{RPS: rps}}}
	}
	got := bestRounds([][]row{
		{mk("1", 100), mk("2", 50)},
		{mk("1", 90), mk("2", 70)},
	})
	if len(got) != 2 || got[0].RPS != 100 || got[1].RPS != 70 {
		t.Fatalf("best rounds: %+v", got)
	}
	if len(got[0].Rounds) != 2 || got[0].Rounds[1] != 90 || got[1].Rounds[0] != 50 {
		t.Errorf("rounds kept: %v %v", got[0].Rounds, got[1].Rounds)
	}
}

func TestPooledRatios(t *testing.T) {
	rows := []row{
		{ID: "2", measurement: measurement{Result: load.Result{RPS: 1000}, CPU: map[string]float64{"caddy": 0.5, "postgres": 0.5}}},
		{ID: "2b", measurement: measurement{Result: load.Result{RPS: 800}, CPU: map[string]float64{"caddy": 0.48, "postgres": 0.6, "pooler": 0.02}}},
		{ID: "3", measurement: measurement{Result: load.Result{RPS: 4000}}},
	}
	got := pooledRatios(rows)
	if len(got) != 1 || got[0].Formula != "2b / 2" {
		t.Fatalf("pooled ratios %+v, want 2b / 2 alone (row 3b was not run)", got)
	}
	p := got[0]
	if math.Abs(p.RPS-0.8) > 1e-9 || math.Abs(p.PerCPU-(800/1.1)/(1000/1.0)) > 1e-9 ||
		math.Abs(p.CaddyMicros[0]-500) > 1e-9 || math.Abs(p.CaddyMicros[1]-600) > 1e-9 ||
		math.Abs(p.PostgresMicros[0]-500) > 1e-9 || math.Abs(p.PostgresMicros[1]-750) > 1e-9 {
		t.Errorf("2b / 2: %+v", p)
	}

	var out bytes.Buffer
	(&report{Rows: rows, Pooled: got, Config: map[string]any{}}).print(&out)
	if !strings.Contains(out.String(), "through PgBouncer") || !strings.Contains(out.String(), "0.80 req/s") {
		t.Errorf("report lacks the pooled ratio:\n%s", out.String())
	}
	out.Reset()
	(&report{Rows: rows, PoolerMissing: "pgbouncer is not installed", Config: map[string]any{}}).print(&out)
	if !strings.Contains(out.String(), "NOT run: pgbouncer is not installed") {
		t.Errorf("report does not say that the pooled rows were not run:\n%s", out.String())
	}
}

// Caddy's CPU per request is the row's Caddy cores over its requests/s:
// 0.8 cores at 5,000/s is 160 µs, 0.6 at 5,000/s is 120, against 0.5 at
// 5,000/s (100) for the baseline.
func TestCPUOverBaseline(t *testing.T) {
	r := func(id string, rps, caddy float64) row {
		m := measurement{CPU: map[string]float64{"caddy": caddy}}
		m.RPS = rps
		return row{ID: id, measurement: m}
	}
	got := cpuOverBaseline([]row{r("1", 5000, 0.5), r("2", 2000, 0.5), r("3", 5000, 0.4), r("5a", 5000, 0.8), r("5c", 5000, 0.6)})
	want := []string{
		"2   250 µs against 100: +150 µs  (target <= +100) NOT met",
		"3   80 µs against 100: -20 µs",
		"5a  160 µs against 100: +60 µs  (target <= +20) NOT met",
		"5c  120 µs against 100: +20 µs  (target <= +20) met",
		"5a less 5c, the records kept in Caddy's heap: +40 µs",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if cpuOverBaseline([]row{r("5a", 5000, 0.8)}) != nil {
		t.Error("lines without a baseline")
	}
}
