package idempotency

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	dto "github.com/prometheus/client_model/go"
)

// The metrics count what happened, through Caddy's admin endpoint: each
// request once by its final result, each store round trip (and no cache
// hit) in the latency histogram, takeovers, lost locks, pruned records
// and replay ages; and no series carries a key or a credential.
func TestMetricsCount(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	pPG, pUndialable, pDown, admin := freeTCPPort(t), freeTCPPort(t), freeTCPPort(t), fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
	down := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?sslmode=disable&connect_timeout=2", freeTCPPort(t))
	// The down store's site has a secret of its own, so that its request
	// gets as far as the acquire, without the store's.
	t.Setenv("IDEMPOTENCY_TEST_METRICS_SECRET", pgtest.RandomHex(32))
	srv := startCaddyfileAdmin(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		prune_interval 1s
		replay_cache off
	}
	reverse_proxy %s
}
http://127.0.0.1:%d {
	idempotency
	reverse_proxy 127.0.0.1:%d
}
http://127.0.0.1:%d {
	idempotency {
		store postgres {
			dsn %q
			migrate off
		}
		credential_secret {env.IDEMPOTENCY_TEST_METRICS_SECRET}
	}
	reverse_proxy %s
}
`, pPG, sb.Block(), up.Addr(), pUndialable, freeTCPPort(t), pDown, down, up.Addr()), admin)
	pg, undialable, storeDown := newSiteClient(t, srv, pPG), newSiteClient(t, srv, pUndialable), newSiteClient(t, srv, pDown)
	before := scrapeMetrics(t, admin).of(srv.Servers)

	c1 := call{Key: newKey(), Body: payBody()}
	wantExecuted(t, pg.Do(t, c1), http.StatusCreated)
	pg.Do(t, c1)
	pg.Do(t, c1)
	wantProblem(t, pg.Do(t, call{Key: c1.Key, Body: payBody()}), http.StatusConflict)

	c2 := call{Key: newKey(), Body: payBody(), Header: sleepFor(500 * time.Millisecond)}
	ch := make(chan error, 1)
	go func() {
		_, err := pg.oneShot().DoCtx(context.Background(), c2)
		ch <- err
	}()
	up.WaitStarted(t, 2)
	wantProblem(t, pg.Do(t, call{Key: c2.Key, Body: c2.Body}), http.StatusConflict)
	// As if a retry had taken the lock over: c2's completion finds it
	// lost, and its response, which no retry gets, is cut.
	pgtest.Exec(t, sb.DSN, `UPDATE `+pgtest.QuoteIdent(sb.Table)+` SET lock_token = $1 WHERE key = $2`, bytes.Repeat([]byte{0xad}, 16), c2.Key)
	if err := <-ch; err == nil {
		t.Errorf("the request whose lock was lost got a whole answer")
	}

	c3 := call{Key: newKey(), Body: payBody()}
	wantExecuted(t, pg.Do(t, c3), http.StatusCreated)
	sb.waitCompleted(t, c3.Key)
	primaryLongUp(t, sb.DSN, sb.Table)
	pgtest.Exec(t, sb.DSN, `UPDATE `+pgtest.QuoteIdent(sb.Table)+` SET status = 'in_progress',
		lock_token = $1, locked_at = now() - interval '1 hour',
		response_status = NULL, response_headers = NULL, response_body = NULL,
		replayable = NULL, response_size = NULL
		WHERE key = $2`, bytes.Repeat([]byte{0xde}, 16), c3.Key)
	wantExecuted(t, pg.Do(t, c3), http.StatusCreated) // taken over

	wantProblem(t, pg.Do(t, call{Body: payBody()}), http.StatusBadRequest)
	undialable.Do(t, call{Key: newKey(), Body: payBody()})
	wantProblem(t, storeDown.Do(t, call{Key: newKey(), Body: payBody()}), http.StatusServiceUnavailable)

	for i := range 3 {
		pgtest.Exec(t, sb.DSN, `INSERT INTO `+pgtest.QuoteIdent(sb.Table)+` (credential_hash, key, fingerprint, method, path,
			status, created_at, expires_at, response_status, response_headers, response_body, replayable, response_size)
			VALUES ($1, $2, $1, 'POST', '/pay', 'completed', now() - interval '2 days', now() - interval '1 day', 201, '{}', '', true, 0)`,
			bytes.Repeat([]byte{9}, 32), fmt.Sprintf("expired-%d", i))
	}
	storetest.WaitFor(t, 15*time.Second, "the pruner to delete the 3 expired rows", func() bool { return pgCount(t, sb) == 3 })

	var after metricsSnapshot
	delta := func(name string, labels ...string) float64 {
		return after.value(name, labels...) - before.value(name, labels...)
	}
	// The pruner's counter is added to right after its statement.
	storetest.WaitFor(t, 10*time.Second, "the pruned records to be counted", func() bool {
		after = scrapeMetrics(t, admin).of(srv.Servers)
		return delta("caddy_idempotency_pruned_records_total") >= 3
	})
	for _, tc := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"caddy_idempotency_requests_total", []string{"result", "executed"}, 4},
		{"caddy_idempotency_requests_total", []string{"result", "replayed"}, 2},
		{"caddy_idempotency_requests_total", []string{"result", "mismatch"}, 1},
		{"caddy_idempotency_requests_total", []string{"result", "in_progress"}, 1},
		{"caddy_idempotency_requests_total", []string{"result", "rejected"}, 1},
		{"caddy_idempotency_requests_total", []string{"result", "released"}, 1},
		{"caddy_idempotency_requests_total", []string{"result", "store_error"}, 1},
		{"caddy_idempotency_lock_takeovers_total", nil, 1},
		{"caddy_idempotency_lock_lost_total", []string{"operation", "complete"}, 1},
		{"caddy_idempotency_lock_lost_total", []string{"operation", "renew"}, 0},
		{"caddy_idempotency_pruned_records_total", nil, 3},
		{"caddy_idempotency_replay_age_seconds", nil, 2},
		// Acquire: c1 ×4, c2 ×1 (its retry in progress is answered by
		// this instance, where c2 runs, without the store), c3 ×2, the
		// undialable and the unreachable store.
		{"caddy_idempotency_store_duration_seconds", []string{"operation", "acquire"}, 9},
		{"caddy_idempotency_store_duration_seconds", []string{"operation", "complete"}, 4},
		{"caddy_idempotency_store_duration_seconds", []string{"operation", "release"}, 1},
		{"caddy_idempotency_store_errors_total", []string{"operation", "acquire"}, 1},
		{"caddy_idempotency_store_errors_total", []string{"operation", "complete"}, 0},
	} {
		if got := delta(tc.name, tc.labels...); got != tc.want {
			t.Errorf("%s%v grew by %v, want %v", tc.name, tc.labels, got, tc.want)
		}
	}
	if got := after.value("caddy_idempotency_build_info", "version", Version); got != 1 {
		t.Errorf("caddy_idempotency_build_info{version=%q} is %v, want 1", Version, got)
	}
	if after["caddy_idempotency_store_duration_seconds"].GetType() != dto.MetricType_HISTOGRAM ||
		after["caddy_idempotency_replay_age_seconds"].GetType() != dto.MetricType_HISTOGRAM {
		t.Errorf("store latency and replay age are not histograms")
	}
	for name, fam := range scrapeMetrics(t, admin) {
		if !strings.HasPrefix(name, "caddy_idempotency_") {
			continue
		}
		for _, metric := range fam.GetMetric() {
			for _, lp := range metric.GetLabel() {
				switch lp.GetName() {
				case "result", "operation", "version", "caddy_version":
				case "server":
					// The config's server names, never the Host header
					// (UNKNOWN: the handlers that unit tests provision
					// outside any server).
					if !strings.HasPrefix(lp.GetValue(), "srv") && lp.GetValue() != "UNKNOWN" {
						t.Errorf("%s has a label server=%q, not a server of the config", name, lp.GetValue())
					}
				default:
					t.Errorf("%s has a label %s=%q: only server, result, operation and the versions are bounded", name, lp.GetName(), lp.GetValue())
				}
			}
		}
	}
}

// Metrics in Caddy's registry, served by the admin endpoint: requests by
// result, store latency as a histogram, and no per-key labels.
func TestMetricsAreExposed(t *testing.T) {
	up := newUpstream(t)
	port, adminPort := freeTCPPort(t), freeTCPPort(t)
	srv := startCaddyfileAdmin(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store memory
	}
	reverse_proxy %s
}
`, port, up.Addr()), fmt.Sprintf("127.0.0.1:%d", adminPort))
	s := newSiteClient(t, srv, port)
	c := call{Key: newKey(), Body: payBody()}
	s.Do(t, c)
	s.Do(t, c)
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", adminPort))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), "caddy_") {
		t.Fatalf("admin /metrics: %d, %d bytes", resp.StatusCode, len(b))
	}
	var types []string
	histogram, replayed := false, false
	for _, l := range strings.Split(string(b), "\n") {
		if !strings.Contains(l, "idempotency") {
			continue
		}
		if strings.HasPrefix(l, "# TYPE ") {
			types = append(types, strings.TrimPrefix(l, "# TYPE "))
			histogram = histogram || strings.HasSuffix(l, " histogram")
		}
		if !strings.HasPrefix(l, "#") && strings.Contains(l, `"replayed"`) {
			replayed = true
		}
		if strings.Contains(l, c.Key) {
			t.Errorf("a metric is labelled with the key: %s", l)
		}
	}
	if len(types) == 0 {
		t.Fatalf("no idempotency metrics in the admin /metrics output")
	}
	t.Logf("metrics: %s", strings.Join(types, "; "))
	if !histogram {
		t.Errorf("no histogram (store round-trip latency) among the idempotency metrics")
	}
	if !replayed {
		t.Errorf("no sample with result \"replayed\" after a replay")
	}
}
