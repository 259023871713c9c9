package idempotency

// The metrics, as the admin endpoint serves them to Prometheus.

import (
	"context"
	"net/http"
	"slices"
	"testing"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
	"github.com/caddyserver/caddy/v2"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// metricsSnapshot is the admin endpoint's /metrics, parsed.
type metricsSnapshot map[string]*dto.MetricFamily

func scrapeMetrics(t *testing.T, adminAddr string) metricsSnapshot {
	t.Helper()
	resp, err := http.Get("http://" + adminAddr + "/metrics")
	if err != nil {
		t.Fatalf("GET /metrics: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %s", resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parsing /metrics: %v", err)
	}
	return fams
}

// of is m with only the series of the servers named, and those that no
// server labels.
func (m metricsSnapshot) of(servers []string) metricsSnapshot {
	out := metricsSnapshot{}
	for name, fam := range m {
		kept := &dto.MetricFamily{Name: fam.Name, Help: fam.Help, Type: fam.Type}
	series:
		for _, metric := range fam.GetMetric() {
			for _, lp := range metric.GetLabel() {
				if lp.GetName() == "server" && !slices.Contains(servers, lp.GetValue()) {
					continue series
				}
			}
			kept.Metric = append(kept.Metric, metric)
		}
		out[name] = kept
	}
	return out
}

// value is the sum of the counter or gauge values, or of the histogram
// sample counts, of the series of name whose labels include the label pairs
// given.
func (m metricsSnapshot) value(name string, labelPairs ...string) float64 {
	fam, ok := m[name]
	if !ok {
		return 0
	}
	var sum float64
series:
	for _, metric := range fam.GetMetric() {
		for i := 0; i+1 < len(labelPairs); i += 2 {
			found := false
			for _, lp := range metric.GetLabel() {
				if lp.GetName() == labelPairs[i] && lp.GetValue() == labelPairs[i+1] {
					found = true
				}
			}
			if !found {
				continue series
			}
		}
		if h := metric.GetHistogram(); h != nil {
			sum += float64(h.GetSampleCount())
		} else if g := metric.GetGauge(); g != nil {
			sum += g.GetValue()
		} else {
			sum += metric.GetCounter().GetValue()
		}
	}
	return sum
}

// newTestPostgresStore provisions a Postgres store on table as Caddy
// would, and cleans it up when the test ends.
func newTestPostgresStore(t *testing.T, table string, maxConns int32) *postgres.Store {
	t.Helper()
	return provisionTestStore(t, &postgres.Store{DSN: pgtest.DSN(t), Table: table, MaxConns: maxConns})
}

// provisionTestStore provisions s as Caddy would, waits for its start
// (its migrations), and cleans it up when the test ends.
func provisionTestStore(t *testing.T, s *postgres.Store) *postgres.Store {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := s.Provision(ctx); err != nil {
		t.Fatalf("provisioning: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Cleanup(); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	if err := s.Ready(ctx); err != nil {
		t.Fatalf("starting: %v", err)
	}
	return s
}
