package idempotency

// The operator's kit: the Grafana dashboard and the Prometheus alert
// rules, checked by promtool, and checked against the metrics a running
// Caddy serves, so that a renamed metric or label breaks a test rather
// than a dashboard.

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"go.yaml.in/yaml/v3"
)

const (
	dashboardFile  = "dashboards/caddy-idempotency.json"
	alertsFile     = "prometheus/alerts.yml"
	alertsTestFile = "prometheus/alerts_test.yml"
	// datasourceRef is how every panel and query names its data source:
	// the dashboard's datasource variable, chosen at import.
	datasourceRef = "${datasource}"
	// dashboardUID is the dashboard's own uid: stable, so that a link or
	// an alert's panel URL survives a re-import, which updates the
	// dashboard in place instead of adding a copy.
	dashboardUID = "caddy-idempotency"
	// defaultRouteHandler is the route_handler variable's default: the
	// handler of a Caddyfile site's route.
	defaultRouteHandler = "subroute"
)

// The rules load, and their unit tests (synthetic series, the alerts
// that must fire and those that must not) pass.
func TestAlertRulesPromtool(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool is not in PATH (%v): install promtool: apt-get install prometheus", err)
	}
	for _, args := range [][]string{{"check", "rules", alertsFile}, {"test", "rules", alertsTestFile}} {
		out, err := exec.Command(promtool, args...).CombinedOutput()
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

type grafanaDatasource struct {
	Type string
	UID  string
}

type grafanaPanel struct {
	ID          int
	Type        string
	Title       string
	Description string
	Datasource  *grafanaDatasource
	GridPos     *struct{ H, W, X, Y int }
	Targets     []struct {
		Datasource   *grafanaDatasource
		RefID        string
		Expr         string
		LegendFormat string
	}
}

type grafanaDashboard struct {
	Title      string
	Templating struct {
		List []struct {
			Name       string
			Type       string
			Query      any
			Definition string
			Datasource *grafanaDatasource
			Current    any
		}
	}
	Panels []grafanaPanel
}

func loadDashboard(t *testing.T) (grafanaDashboard, map[string]any) {
	t.Helper()
	data, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d grafanaDashboard
	var raw map[string]any
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	if err := json.Unmarshal(data, &raw); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d, raw
}

// The dashboard imports as is into any Grafana: its data source is a
// variable, no UID names a particular data source, its own uid is stable,
// and every panel has what Grafana needs to draw it.
func TestDashboardImportable(t *testing.T) {
	d, raw := loadDashboard(t)
	if d.Title == "" {
		t.Errorf("the dashboard has no title")
	}
	if raw["uid"] != dashboardUID {
		t.Errorf("the dashboard's uid is %v, want %q: without a stable uid every import adds a copy, and links to it break", raw["uid"], dashboardUID)
	}
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, e := range v {
				if k == "uid" && e != datasourceRef && path != "dashboard" {
					t.Errorf("%s.uid is %v: only %s may name a data source", path, e, datasourceRef)
				}
				walk(path+"."+k, e)
			}
		case []any:
			for i, e := range v {
				walk(fmt.Sprintf("%s[%d]", path, i), e)
			}
		}
	}
	walk("dashboard", raw)

	hasDatasourceVar := false
	for _, v := range d.Templating.List {
		switch v.Type {
		case "datasource":
			hasDatasourceVar = hasDatasourceVar || v.Name == "datasource" && v.Query == "prometheus"
		case "query":
			if v.Datasource == nil || v.Datasource.UID != datasourceRef {
				t.Errorf("variable %s: data source %+v, want %s", v.Name, v.Datasource, datasourceRef)
			}
		}
	}
	if !hasDatasourceVar {
		t.Errorf("no variable named datasource of type datasource (query prometheus)")
	}

	ids := make(map[int]bool)
	var graphs int
	for _, p := range d.Panels {
		name := fmt.Sprintf("panel %d %q", p.ID, p.Title)
		if p.ID == 0 || ids[p.ID] {
			t.Errorf("%s: id missing or not unique", name)
		}
		ids[p.ID] = true
		if p.Title == "" || p.Type == "" || p.GridPos == nil || p.GridPos.W == 0 || p.GridPos.H == 0 {
			t.Errorf("%s: needs a title, a type and a gridPos", name)
		}
		if p.Type == "row" {
			continue
		}
		graphs++
		if p.Description == "" {
			t.Errorf("%s: no description: the panel should say what it shows", name)
		}
		if p.Datasource == nil || p.Datasource.UID != datasourceRef || p.Datasource.Type != "prometheus" {
			t.Errorf("%s: data source %+v, want prometheus %s", name, p.Datasource, datasourceRef)
		}
		if len(p.Targets) == 0 {
			t.Errorf("%s: no targets", name)
		}
		for _, tg := range p.Targets {
			if tg.Expr == "" || tg.RefID == "" {
				t.Errorf("%s: a target without expr or refId", name)
			}
			if tg.Datasource == nil || tg.Datasource.UID != datasourceRef {
				t.Errorf("%s: target %s: data source %+v, want %s", name, tg.RefID, tg.Datasource, datasourceRef)
			}
			// A legend names labels that the query keeps.
			kept := groupingLabels(tg.Expr)
			for _, m := range legendLabel.FindAllStringSubmatch(tg.LegendFormat, -1) {
				if !slices.Contains(kept, m[1]) {
					t.Errorf("%s: legend {{%s}}, but %s aggregates it away", name, m[1], tg.Expr)
				}
			}
		}
	}
	if graphs < 10 {
		t.Errorf("%d graph panels, want the kit's ten or more", graphs)
	}
}

var (
	legendLabel = regexp.MustCompile(`\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}`)
	// A metric of the kit, with its label matchers if any.
	kitSelector = regexp.MustCompile(`\b(caddy_[a-z_]+)(\{[^}]*\})?`)
	kitMatcher  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"`)
	kitGrouping = regexp.MustCompile(`\b(?:by|without|on|ignoring)\s*\(([^)]*)\)`)
	labelValues = regexp.MustCompile(`label_values\(\s*(caddy_[a-z_]+)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)`)
	// A regexp matcher that only lists values: each must exist.
	valueList = regexp.MustCompile(`^[a-zA-Z0-9_]+(\|[a-zA-Z0-9_]+)*$`)
)

// groupingLabels lists the labels of expr's by, without, on and ignoring
// clauses.
func groupingLabels(expr string) []string {
	var labels []string
	for _, m := range kitGrouping.FindAllStringSubmatch(expr, -1) {
		for _, l := range strings.Split(m[1], ",") {
			if l = strings.TrimSpace(l); l != "" {
				labels = append(labels, l)
			}
		}
	}
	return labels
}

// kitExpr is one PromQL expression of the kit, and where it is.
type kitExpr struct{ where, expr string }

// kitExprs returns every expression of the dashboard (its panels' and its
// variables' queries) and of the alert rules.
func kitExprs(t *testing.T) []kitExpr {
	t.Helper()
	d, _ := loadDashboard(t)
	var exprs []kitExpr
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			exprs = append(exprs, kitExpr{fmt.Sprintf("dashboard panel %q", p.Title), tg.Expr})
		}
	}
	for _, v := range d.Templating.List {
		if v.Type == "query" {
			exprs = append(exprs, kitExpr{fmt.Sprintf("dashboard variable %s", v.Name), v.Definition})
		}
	}
	data, err := os.ReadFile(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert, Record, Expr string
			}
		}
	}
	if err := yaml.Unmarshal(data, &rules); err != nil {
		t.Fatalf("%s: %v", alertsFile, err)
	}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			exprs = append(exprs, kitExpr{"alert " + r.Alert + r.Record, r.Expr})
		}
	}
	return exprs
}

// servedFamily returns the family that serves the series name, and
// whether name is a histogram's bucket series.
func servedFamily(m metricsSnapshot, name string) (*dto.MetricFamily, bool) {
	if fam, ok := m[name]; ok {
		return fam, false
	}
	for _, suffix := range []string{"_bucket", "_count", "_sum"} {
		base, ok := strings.CutSuffix(name, suffix)
		if fam := m[base]; ok && fam != nil && fam.GetType() == dto.MetricType_HISTOGRAM {
			return fam, suffix == "_bucket"
		}
	}
	return nil, false
}

// labelValuesOf returns the values that label takes in fam's series.
func labelValuesOf(fam *dto.MetricFamily, label string) []string {
	var values []string
	for _, metric := range fam.GetMetric() {
		for _, lp := range metric.GetLabel() {
			if lp.GetName() == label && !slices.Contains(values, lp.GetValue()) {
				values = append(values, lp.GetValue())
			}
		}
	}
	return values
}

// Every metric, label and label value that the dashboard and the alert
// rules use is one that Caddy serves, with this module handling traffic
// of every result: a renamed metric, label or result fails here.
func TestOperatorKitMetricsExist(t *testing.T) {
	up := newUpstream(t)
	pMem, pDeadUpstream, pDeadStore := freeTCPPort(t), freeTCPPort(t), freeTCPPort(t)
	admin := fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
	deadDSN := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?sslmode=disable&connect_timeout=2", freeTCPPort(t))
	logPath := filepath.Join(t.TempDir(), "caddy.log")
	// caddy_http_* need the global option metrics, as the dashboard says.
	global := strings.Replace(globalOptions(logPath, admin), "{\n", "{\n\tmetrics\n", 1)
	cfgJSON, _, err := adaptCaddyfile(global + fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store memory
		max_response_body 1KiB
		prune_interval 1s
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
	}
	reverse_proxy %s
}
`, pMem, up.Addr(), pDeadUpstream, freeTCPPort(t), pDeadStore, deadDSN, up.Addr()))
	if err != nil {
		t.Fatal(err)
	}
	srv := startCaddyJSON(t, cfgJSON, logPath)
	mem := newSiteClient(t, srv, pMem)
	before := scrapeMetrics(t, admin)

	c1 := call{Key: newKey(), Body: payBody()}
	wantExecuted(t, mem.Do(t, c1), http.StatusCreated)
	mem.Do(t, c1)
	wantProblem(t, mem.Do(t, call{Key: c1.Key, Body: payBody()}), http.StatusConflict)
	c2 := call{Key: newKey(), Body: payBody(), Header: sleepFor(300 * time.Millisecond)}
	ch := runBackground(t, mem, c2)
	up.WaitStarted(t, 2)
	wantProblem(t, mem.Do(t, call{Key: c2.Key, Body: c2.Body}), http.StatusConflict)
	<-ch
	wantProblem(t, mem.Do(t, call{Body: payBody()}), http.StatusBadRequest)
	big := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Size": "4096"}}
	wantExecuted(t, mem.Do(t, big), http.StatusCreated)
	wantProblem(t, mem.Do(t, big), http.StatusConflict)
	newSiteClient(t, srv, pDeadUpstream).Do(t, call{Key: newKey(), Body: payBody()})
	wantProblem(t, newSiteClient(t, srv, pDeadStore).Do(t, call{Key: newKey(), Body: payBody()}), http.StatusServiceUnavailable)
	const sent = 10 // the requests above

	after := scrapeMetrics(t, admin)
	// The dashboard counts Caddy's requests on the routes of its
	// route_handler variable, by default subroute: a Caddyfile's sites,
	// which each request enters once (Caddy counts one per top-level
	// route it goes through).
	if d := after.value("caddy_http_requests_total", "handler", defaultRouteHandler) - before.value("caddy_http_requests_total", "handler", defaultRouteHandler); d != sent {
		t.Errorf("caddy_http_requests_total{handler=%q} grew by %v, want the %d requests sent", defaultRouteHandler, d, sent)
	}
	for _, result := range []string{resultExecuted, resultReplayed, resultMismatch, resultInProgress,
		resultRejected, resultReleased, resultStoreError} {
		if after.value("caddy_idempotency_requests_total", "result", result) <= before.value("caddy_idempotency_requests_total", "result", result) {
			t.Errorf("no request counted as %s: the traffic should produce every result", result)
		}
	}
	if d := after.value("caddy_idempotency_not_replayable_total") - before.value("caddy_idempotency_not_replayable_total"); d != 1 {
		t.Errorf("caddy_idempotency_not_replayable_total grew by %v, want 1", d)
	}
	// The server label is Caddy's: the dashboard filters both by it.
	// (Counters outlive configs: earlier tests' servers are served too.)
	if caddyFam := after["caddy_http_requests_total"]; caddyFam != nil {
		caddyServers := labelValuesOf(caddyFam, "server")
		var counted int
		for _, s := range labelValuesOf(after["caddy_idempotency_requests_total"], "server") {
			if after.value("caddy_idempotency_requests_total", "server", s) == before.value("caddy_idempotency_requests_total", "server", s) {
				continue
			}
			counted++
			if !slices.Contains(caddyServers, s) {
				t.Errorf("caddy_idempotency_requests_total counted server=%q, which caddy_http_requests_total does not know (%v)", s, caddyServers)
			}
		}
		if counted != 3 {
			t.Errorf("requests counted on %d servers, want the config's 3", counted)
		}
	}

	checked := 0
	for _, e := range kitExprs(t) {
		var families []*dto.MetricFamily
		bucket := false
		for _, m := range kitSelector.FindAllStringSubmatch(e.expr, -1) {
			name := m[1]
			fam, isBucket := servedFamily(after, name)
			if fam == nil {
				t.Errorf("%s uses %s, which Caddy does not serve", e.where, name)
				continue
			}
			checked++
			families = append(families, fam)
			bucket = bucket || isBucket
			for _, mm := range kitMatcher.FindAllStringSubmatch(m[2], -1) {
				label, op, value := mm[1], mm[2], mm[3]
				if label == "job" || label == "instance" {
					continue // Prometheus adds them when it scrapes
				}
				values := labelValuesOf(fam, label)
				if len(values) == 0 {
					t.Errorf("%s: %s has no label %s", e.where, name, label)
					continue
				}
				if strings.Contains(value, "$") {
					continue // a dashboard variable
				}
				var want []string
				switch {
				case op == "=" || op == "!=":
					want = []string{value}
				case valueList.MatchString(value):
					want = strings.Split(value, "|")
				}
				for _, v := range want {
					if !slices.Contains(values, v) {
						t.Errorf("%s: %s{%s%s%q}: no series has %s=%q (it has %v)", e.where, name, label, op, value, label, v, values)
					}
				}
			}
		}
		for _, m := range labelValues.FindAllStringSubmatch(e.expr, -1) {
			if m[2] == "job" || m[2] == "instance" {
				continue
			}
			if fam, _ := servedFamily(after, m[1]); fam != nil && len(labelValuesOf(fam, m[2])) == 0 {
				t.Errorf("%s: %s has no label %s", e.where, m[1], m[2])
			}
		}
	grouping:
		for _, label := range groupingLabels(e.expr) {
			// Prometheus adds job and instance when it scrapes; a
			// histogram's buckets carry le.
			if label == "job" || label == "instance" || label == "le" && bucket {
				continue
			}
			for _, fam := range families {
				if len(labelValuesOf(fam, label)) > 0 {
					continue grouping
				}
			}
			t.Errorf("%s: groups by %s, which none of its metrics has: %s", e.where, label, e.expr)
		}
	}
	if checked < 20 {
		t.Errorf("only %d metric uses found in the kit: is the regexp still finding them?", checked)
	}
}

// The dashboard's variables narrow every panel: a panel that ignores
// $server, $job or $instance shows every server's (or every instance's)
// traffic under a selection that says otherwise. Each variable's own
// query is narrowed by the variables before it, so that its choices are
// those of the selection.
func TestDashboardQueriesFilterByItsVariables(t *testing.T) {
	d, _ := loadDashboard(t)
	// route_handler narrows Caddy's own series only.
	var vars []string
	var routeHandler any
	for _, v := range d.Templating.List {
		if v.Type == "query" && v.Name != "route_handler" {
			vars = append(vars, v.Name)
		}
		if v.Name == "route_handler" {
			routeHandler = v.Current
		}
	}
	if m, _ := routeHandler.(map[string]any); m == nil || m["value"] != defaultRouteHandler {
		t.Errorf("the route_handler variable's current value is %v, want %q", routeHandler, defaultRouteHandler)
	}
	for _, want := range []string{"job", "instance", "server"} {
		if !slices.Contains(vars, want) {
			t.Errorf("the dashboard has no %s variable (it has %v)", want, vars)
		}
	}
	filters := func(selector, v string) bool {
		for _, m := range kitMatcher.FindAllStringSubmatch(selector, -1) {
			if m[1] == v && m[2] == "=~" && (m[3] == "$"+v || m[3] == "${"+v+"}") {
				return true
			}
		}
		return false
	}
	var selectors int
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			for _, m := range kitSelector.FindAllStringSubmatch(tg.Expr, -1) {
				selectors++
				for _, v := range vars {
					if !filters(m[2], v) {
						t.Errorf("panel %q: %s%s does not filter by $%s", p.Title, m[1], m[2], v)
					}
				}
				// Caddy counts a request once for each top-level route it
				// goes through, labelled with the route's first handler:
				// a sum over handlers counts one request several times.
				if strings.HasPrefix(m[1], "caddy_http_") && !strings.Contains(m[2], `handler=~"$route_handler"`) {
					t.Errorf("panel %q: %s%s sums every route's count of one request: filter on handler=~\"$route_handler\"", p.Title, m[1], m[2])
				}
			}
		}
	}
	if selectors < 20 {
		t.Errorf("only %d metric selectors found in the panels: is the regexp still finding them?", selectors)
	}
	for i, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		for _, before := range d.Templating.List[:i] {
			if before.Type != "query" {
				continue
			}
			for _, m := range kitSelector.FindAllStringSubmatch(v.Definition, -1) {
				if !filters(m[2], before.Name) {
					t.Errorf("variable %s: %s does not filter by $%s, so it offers choices outside the selection", v.Name, v.Definition, before.Name)
				}
			}
		}
	}
}
