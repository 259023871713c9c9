package idempotency

// The end-to-end harness: a real Caddy loaded in-process from a Caddyfile,
// a real Postgres (testdb_test.go), and an upstream that keeps a ledger of
// what it executed. Nothing in the request path is mocked.

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
	"github.com/jackc/pgx/v5"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// caddyMu serialises tests that run Caddy: caddy.Load replaces the one
// running config of the process.
var caddyMu sync.Mutex

// TestMain stops what the tests started for the whole run: the test
// database server and the Caddy binary.
func TestMain(m *testing.M) {
	code := m.Run()
	// setupTestPostgres runs lazily, on the first testDSN; its cleanup is
	// set only once it ran, so a run that needed no Postgres starts none.
	if cleanup := testPostgres.cleanup; cleanup != nil {
		cleanup()
	}
	removeCaddyBinary() // built by the tests that run Caddy as a process
	os.Exit(code)
}

// freePort returns a TCP port on 127.0.0.1 that nothing listens on now.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	port := l.Addr().(*net.TCPAddr).Port
	return port, l.Close()
}

// freeTCPPort is freePort for a test, which fails if there is none.
func freeTCPPort(t testing.TB) int {
	t.Helper()
	port, err := freePort()
	if err != nil {
		t.Fatalf("free port: %v", err)
	}
	return port
}

// randomHex returns n random bytes, hex-encoded.
func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// newKey returns a fresh, valid Idempotency-Key.
func newKey() string { return "key-" + randomHex(8) }

// adaptCaddyfile adapts a Caddyfile to Caddy JSON with the real adapter.
func adaptCaddyfile(caddyfile string) ([]byte, []caddyconfig.Warning, error) {
	adapter := caddyconfig.GetAdapter("caddyfile")
	if adapter == nil {
		return nil, nil, fmt.Errorf("no caddyfile adapter registered")
	}
	return adapter.Adapt([]byte(caddyfile), nil)
}

// caddyServer is a running in-process Caddy.
type caddyServer struct {
	// LogPath is the file the whole process logs to (JSON, DEBUG level).
	LogPath string
	// JSON is the config that was loaded.
	JSON []byte
	// Servers are the names of its HTTP servers, unique in the process.
	Servers []string
}

// globalOptions is the global options block every in-process test config
// starts with: it logs everything, which tests read, and stops at once.
func globalOptions(logPath, admin string) string {
	if admin == "" {
		admin = "off"
	}
	return globalOptionsBlock(logPath, admin, "200ms", "DEBUG")
}

// globalOptionsBlock is the global options block of a test's Caddy, in
// process (globalOptions) or not (caddyProc), logging JSON to logPath at
// level with the admin endpoint admin.
func globalOptionsBlock(logPath, admin, gracePeriod, level string) string {
	return fmt.Sprintf(`{
	admin %s
	auto_https off
	persist_config off
	grace_period %s
	log {
		output file %s
		format json
		level %s
	}
}
`, admin, gracePeriod, logPath, level)
}

// startCaddyfile adapts and loads a Caddyfile (which must not contain a
// global options block: globalOptions is prepended) and stops Caddy when
// the test ends. On failure the module's log lines are printed.
func startCaddyfile(t testing.TB, sites string) *caddyServer {
	t.Helper()
	return startCaddyfileAdmin(t, sites, "")
}

// startCaddyfileAdmin is startCaddyfile with an admin endpoint address.
func startCaddyfileAdmin(t testing.TB, sites, admin string) *caddyServer {
	t.Helper()
	logPath := filepath.Join(t.TempDir(), "caddy.log")
	cfg := globalOptions(logPath, admin) + sites
	cfgJSON, _, err := adaptCaddyfile(cfg)
	if err != nil {
		t.Fatalf("adapting Caddyfile: %v\n%s", err, cfg)
	}
	cfgJSON, servers := uniqueServerNames(t, cfgJSON)
	s := startCaddyJSON(t, cfgJSON, logPath)
	s.Servers = servers
	return s
}

var configsLoaded atomic.Int64

// uniqueServerNames renames the HTTP servers of an adapted Caddyfile,
// srv0 and on in every config, to names that no earlier config of the
// process had. Metrics are process-wide and labelled by server: work an
// earlier test's handlers finish after their config stopped (a
// completion still retried, a body still being read) would otherwise be
// counted as this test's.
func uniqueServerNames(t testing.TB, cfgJSON []byte) ([]byte, []string) {
	t.Helper()
	var cfg map[string]any
	if err := json.Unmarshal(cfgJSON, &cfg); err != nil {
		t.Fatal(err)
	}
	apps, _ := cfg["apps"].(map[string]any)
	httpApp, _ := apps["http"].(map[string]any)
	servers, _ := httpApp["servers"].(map[string]any)
	if len(servers) == 0 {
		return cfgJSON, nil
	}
	n := configsLoaded.Add(1)
	renamed, names := map[string]any{}, []string(nil)
	for name, srv := range servers {
		name = fmt.Sprintf("%s-c%d", name, n)
		renamed[name], names = srv, append(names, name)
	}
	httpApp["servers"] = renamed
	out, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return out, names
}

// startCaddyJSON loads a Caddy JSON config and stops it at cleanup.
func startCaddyJSON(t testing.TB, cfgJSON []byte, logPath string) *caddyServer {
	t.Helper()
	caddyMu.Lock()
	if err := caddy.Load(cfgJSON, true); err != nil {
		caddyMu.Unlock()
		t.Fatalf("loading config: %v\n%s", err, cfgJSON)
	}
	s := &caddyServer{LogPath: logPath, JSON: cfgJSON}
	t.Cleanup(func() {
		if err := caddy.Stop(); err != nil {
			t.Errorf("stopping caddy: %v", err)
		}
		caddyMu.Unlock()
		if t.Failed() && logPath != "" {
			s.dumpModuleLog(t)
		}
	})
	return s
}

// logLines returns the log file's JSON lines, decoded.
func (s *caddyServer) logLines(t testing.TB) []map[string]any {
	t.Helper()
	data, err := os.ReadFile(s.LogPath)
	if err != nil {
		t.Fatalf("reading log: %v", err)
	}
	var lines []map[string]any
	for _, raw := range bytes.Split(data, []byte("\n")) {
		if len(bytes.TrimSpace(raw)) == 0 {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal(raw, &m); err != nil {
			continue
		}
		lines = append(lines, m)
	}
	return lines
}

// moduleLogLines returns the lines logged by this module.
func (s *caddyServer) moduleLogLines(t testing.TB) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, l := range s.logLines(t) {
		if name, _ := l["logger"].(string); strings.Contains(name, "idempotency") {
			out = append(out, l)
		}
	}
	return out
}

func (s *caddyServer) dumpModuleLog(t testing.TB) {
	data, err := os.ReadFile(s.LogPath)
	if err != nil {
		return
	}
	var keep []string
	for _, l := range strings.Split(string(data), "\n") {
		if strings.Contains(l, "idempotency") || strings.Contains(l, `"level":"error"`) {
			keep = append(keep, l)
		}
	}
	if len(keep) > 60 {
		keep = keep[len(keep)-60:]
	}
	t.Logf("caddy log (module and error lines, last %d):\n%s", len(keep), strings.Join(keep, "\n"))
}

// ---------------------------------------------------------------------------
// Stores

// storeBackend is one of the two stores a store-neutral test runs against.
type storeBackend struct {
	Name  string // "memory" or "postgres"
	DSN   string // postgres only
	Table string // postgres only
}

// waitCompleted waits for key's record to be completed. A client has
// its answer while the record is being completed: a test that rewrites
// the record behind the handler's back must wait, or the completion,
// arriving after the rewrite, finds it or overwrites it.
func (sb storeBackend) waitCompleted(t testing.TB, key string) {
	t.Helper()
	waitFor(t, 10*time.Second, "the completion of "+key, func() bool {
		return len(pgQuery(t, sb.DSN, `SELECT 1 FROM `+quoteIdent(sb.Table)+` WHERE key = $1 AND status = 'completed'`, key)) == 1
	})
}

// Block returns the store subdirective for the Caddyfile.
func (sb storeBackend) Block() string {
	if sb.Name == "memory" {
		return "store memory"
	}
	return fmt.Sprintf("store postgres {\n\t\t\tdsn %q\n\t\t\ttable %s\n\t\t}", sb.DSN, sb.Table)
}

// storeBackendNames are the stores a store-neutral test runs against.
var storeBackendNames = []string{"memory", "postgres"}

// newStoreBackend returns the backend named name, Postgres on a fresh
// table.
func newStoreBackend(t *testing.T, name string) storeBackend {
	t.Helper()
	if name == "postgres" {
		return postgresBackend(t)
	}
	return storeBackend{Name: name}
}

// eachStore runs fn as a subtest for each backend, "memory" and
// "postgres" (the latter on a fresh table).
func eachStore(t *testing.T, fn func(t *testing.T, sb storeBackend)) {
	t.Helper()
	for _, name := range storeBackendNames {
		t.Run(name, func(t *testing.T) { fn(t, newStoreBackend(t, name)) })
	}
}

// open returns the backend's store itself, on the real clock, as a
// handler's config would provision it (Postgres on sb.Table).
func (sb storeBackend) open(t *testing.T) store.Store {
	t.Helper()
	if sb.Name == "postgres" {
		return newTestPostgresStore(t, sb.Table, 4)
	}
	return &MemoryStore{records: newMemoryRecords(100, time.Now)}
}

// postgresBackend returns the Postgres store on a fresh table.
func postgresBackend(t *testing.T) storeBackend {
	t.Helper()
	return storeBackend{Name: "postgres", DSN: testDSN(t), Table: freshTable(t)}
}

// pgOpen connects to the test database for one statement, bounded by a
// timeout; done closes the connection. (Per call, not per test: some
// tests poll through these helpers every few milliseconds.)
func pgOpen(t testing.TB, dsn string) (ctx context.Context, conn *pgx.Conn, done func()) {
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

// pgConnect opens a connection of the test's own to the test database,
// for a session that outlasts a statement (a lock held, a transaction
// open), and closes it when the test ends.
func pgConnect(t testing.TB, dsn string) *pgx.Conn {
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

// pgQuery runs a query against the test database and returns each row's
// columns as strings.
func pgQuery(t testing.TB, dsn, query string, args ...any) [][]string {
	t.Helper()
	ctx, conn, done := pgOpen(t, dsn)
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

// pgExec runs a statement against the test database.
func pgExec(t testing.TB, dsn, stmt string, args ...any) int64 {
	t.Helper()
	ctx, conn, done := pgOpen(t, dsn)
	defer done()
	tag, err := conn.Exec(ctx, stmt, args...)
	if err != nil {
		t.Fatalf("exec %q: %v", stmt, err)
	}
	return tag.RowsAffected()
}

// pgCount counts the rows of a table.
func pgCount(t testing.TB, sb storeBackend) int {
	t.Helper()
	rows := pgQuery(t, sb.DSN, "SELECT count(*) FROM "+pgx.Identifier{sb.Table}.Sanitize())
	n, _ := strconv.Atoi(rows[0][0])
	return n
}

// ---------------------------------------------------------------------------
// The upstream

// execution is one request the upstream executed.
type execution struct {
	ID        string
	Seq       int
	Method    string
	Path      string // with query
	Key       string // Idempotency-Key as received ("" if none)
	Body      []byte // exactly the bytes received
	Header    http.Header
	Trailer   http.Header // the request's trailers, once its body was read
	Started   time.Time
	Finished  bool // wrote its whole response
	Cancelled bool // its request context was cancelled before it finished
	Ended     time.Time
}

// upstream is an httptest.Server that records every request it executes.
// Its behaviour is chosen per request with X-Test-* request headers, so
// concurrent requests need no shared setup:
//
//	X-Test-Sleep: <duration>  wait before answering (ends early, Cancelled, if the request context ends)
//	X-Test-Status: <code>     answer with this status (default 201)
//	X-Test-Extra: 1           also send Set-Cookie (twice), Authorization and X-Secret
//	X-Test-Credentials: 1     also send Cookie, Set-Cookie2, Authentication-Info,
//	                          Proxy-Authentication-Info and X-Api-Key
//	X-Test-Size: <n>          answer with an n-byte body (text) instead of the JSON echo
//	X-Test-Chunked: 1         do not send Content-Length (stream the body)
//	X-Test-Gate: <name>       stream: send "first\n", flush, wait for Open(name), send "second\n"
//	X-Test-Crash: 1           read the body, then drop the connection without answering
//
// Every answer carries X-Execution-Id, unique per execution, so a replay
// is visibly the first response.
type upstream struct {
	*httptest.Server

	mu    sync.Mutex
	execs []*execution
	gates map[string]chan struct{}
}

func newUpstream(t testing.TB) *upstream {
	t.Helper()
	return newUpstreamAt(t, "")
}

// newUpstreamAt is newUpstream listening on addr ("" for a free port):
// a test that found addr dead brings its upstream up there.
func newUpstreamAt(t testing.TB, addr string) *upstream {
	t.Helper()
	u := &upstream{gates: make(map[string]chan struct{})}
	u.Server = httptest.NewUnstartedServer(http.HandlerFunc(u.serve))
	if addr != "" {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		u.Server.Listener.Close()
		u.Server.Listener = ln
	}
	u.Server.Start()
	t.Cleanup(func() {
		u.mu.Lock()
		for name, ch := range u.gates {
			select {
			case <-ch:
			default:
				close(ch)
			}
			delete(u.gates, name)
		}
		u.mu.Unlock()
		u.Server.CloseClientConnections()
		u.Server.Close()
	})
	return u
}

// Addr is host:port for reverse_proxy.
func (u *upstream) Addr() string { return strings.TrimPrefix(u.URL, "http://") }

func (u *upstream) gate(name string) chan struct{} {
	u.mu.Lock()
	defer u.mu.Unlock()
	ch, ok := u.gates[name]
	if !ok {
		ch = make(chan struct{})
		u.gates[name] = ch
	}
	return ch
}

// Open releases the requests waiting at gate name.
func (u *upstream) Open(name string) {
	ch := u.gate(name)
	u.mu.Lock()
	defer u.mu.Unlock()
	select {
	case <-ch:
	default:
		close(ch)
	}
}

func (u *upstream) serve(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, "reading body: "+err.Error(), http.StatusBadRequest)
		return
	}
	u.mu.Lock()
	e := &execution{
		ID:      randomHex(8),
		Seq:     len(u.execs) + 1,
		Method:  r.Method,
		Path:    r.URL.RequestURI(),
		Key:     r.Header.Get("Idempotency-Key"),
		Body:    body,
		Header:  r.Header.Clone(),
		Trailer: r.Trailer.Clone(),
		Started: time.Now(),
	}
	u.execs = append(u.execs, e)
	u.mu.Unlock()

	end := func(finished, cancelled bool) {
		u.mu.Lock()
		e.Finished, e.Cancelled, e.Ended = finished, cancelled, time.Now()
		u.mu.Unlock()
	}

	if r.Header.Get("X-Test-Crash") != "" {
		end(true, false)
		hj, ok := w.(http.Hijacker)
		if !ok {
			panic("upstream: cannot hijack")
		}
		conn, _, err := hj.Hijack()
		if err == nil {
			_ = conn.Close()
		}
		return
	}

	if d, err := time.ParseDuration(r.Header.Get("X-Test-Sleep")); err == nil && d > 0 {
		select {
		case <-time.After(d):
		case <-r.Context().Done():
			end(false, true)
			return
		}
	}

	status := http.StatusCreated
	if s := r.Header.Get("X-Test-Status"); s != "" {
		status, _ = strconv.Atoi(s)
	}
	h := w.Header()
	h.Set("X-Execution-Id", e.ID)
	h["X-Multi"] = []string{"one", "two"}
	h.Set("Cache-Control", "no-store")
	h.Set("Location", "/pay/"+e.ID)
	if r.Header.Get("X-Test-Extra") != "" {
		h["Set-Cookie"] = []string{"session=abc; Path=/", "tracker=xyz; Path=/"}
		h.Set("Authorization", "Bearer upstream-token")
		h.Set("X-Secret", "s3cr3t")
	}
	if r.Header.Get("X-Test-Credentials") != "" {
		h.Set("Cookie", "session=echoed")
		h.Set("Set-Cookie2", "legacy=1")
		h.Set("Authentication-Info", `nextnonce="upstream-nonce"`)
		h.Set("Proxy-Authentication-Info", `nextnonce="proxy-nonce"`)
		h.Set("X-Api-Key", "echoed-api-key")
	}

	if gate := r.Header.Get("X-Test-Gate"); gate != "" {
		h.Set("Content-Type", "text/plain")
		w.WriteHeader(status)
		_, _ = io.WriteString(w, "first-"+e.ID+"\n")
		w.(http.Flusher).Flush()
		select {
		case <-u.gate(gate):
		case <-time.After(5 * time.Second):
		case <-r.Context().Done():
			end(false, true)
			return
		}
		_, _ = io.WriteString(w, "second\n")
		end(true, false)
		return
	}

	var out []byte
	if n, err := strconv.Atoi(r.Header.Get("X-Test-Size")); err == nil {
		out = sizedBody(e.ID, n)
		h.Set("Content-Type", "text/plain")
	} else {
		out, _ = json.Marshal(map[string]any{
			"execution": e.ID,
			"seq":       e.Seq,
			"method":    r.Method,
			"path":      r.URL.RequestURI(),
			"body_len":  len(body),
		})
		h.Set("Content-Type", "application/json")
	}
	if r.Header.Get("X-Test-Chunked") != "" {
		w.WriteHeader(status)
		for len(out) > 0 {
			n := min(len(out), 512)
			_, _ = w.Write(out[:n])
			w.(http.Flusher).Flush()
			out = out[n:]
		}
	} else {
		h.Set("Content-Length", strconv.Itoa(len(out)))
		w.WriteHeader(status)
		_, _ = w.Write(out)
	}
	end(true, false)
}

// sizedBody is the deterministic n-byte body an X-Test-Size answer has.
func sizedBody(id string, n int) []byte {
	var b bytes.Buffer
	for b.Len() < n {
		fmt.Fprintf(&b, "%s:%08d\n", id, b.Len())
	}
	return b.Bytes()[:n]
}

// Executions returns a snapshot of the ledger.
func (u *upstream) Executions() []execution {
	u.mu.Lock()
	defer u.mu.Unlock()
	out := make([]execution, len(u.execs))
	for i, e := range u.execs {
		out[i] = *e
	}
	return out
}

// Count is how many requests the upstream executed.
func (u *upstream) Count() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.execs)
}

// WaitStarted waits until at least n executions have started.
func (u *upstream) WaitStarted(t testing.TB, n int) {
	t.Helper()
	waitFor(t, 15*time.Second, fmt.Sprintf("%d upstream executions to start", n), func() bool { return u.Count() >= n })
}

// WaitEnded waits until at least n executions have ended (finished or
// were cancelled).
func (u *upstream) WaitEnded(t testing.TB, n int) {
	t.Helper()
	waitFor(t, 15*time.Second, fmt.Sprintf("%d upstream executions to end", n), func() bool {
		ended := 0
		for _, e := range u.Executions() {
			if !e.Ended.IsZero() {
				ended++
			}
		}
		return ended >= n
	})
}

// waitFor polls cond every 10ms until it holds or the timeout passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// ---------------------------------------------------------------------------
// The protected site

// site is a running Caddy serving one protected site.
type site struct {
	*caddyServer
	URL    string
	client *http.Client
}

// protectedSite starts Caddy with one site on a free port:
//
//	http://127.0.0.1:<port> {
//		idempotency [matcher] {
//			<store block>
//			<directives>
//		}
//		reverse_proxy <upstream> { flush_interval -1 }
//	}
//
// upstreamAddr "" proxies to a closed port (undialable).
func protectedSite(t testing.TB, sb storeBackend, upstreamAddr string, directives ...string) *site {
	t.Helper()
	return protectedSiteMatcher(t, sb, upstreamAddr, "", directives...)
}

func protectedSiteMatcher(t testing.TB, sb storeBackend, upstreamAddr, matcher string, directives ...string) *site {
	t.Helper()
	if upstreamAddr == "" {
		upstreamAddr = fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
	}
	block := sb.Block()
	if sb.Name == "" {
		block = ""
	}
	port := freeTCPPort(t)
	body := fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency %s{
		%s
		%s
	}
	reverse_proxy %s {
		flush_interval -1
	}
}
`, port, matcher, block, strings.Join(directives, "\n\t\t"), upstreamAddr)
	return siteFromCaddyfile(t, port, body)
}

// siteFromCaddyfile starts Caddy from site blocks that listen on port.
func siteFromCaddyfile(t testing.TB, port int, sites string) *site {
	t.Helper()
	srv := startCaddyfile(t, sites)
	return newSiteClient(t, srv, port)
}

func newSiteClient(t testing.TB, srv *caddyServer, port int) *site {
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	return &site{
		caddyServer: srv,
		URL:         fmt.Sprintf("http://127.0.0.1:%d", port),
		client:      &http.Client{Transport: tr, Timeout: 15 * time.Second},
	}
}

// reloaded readies s for the requests after a reload (caddy.Load) of
// its config. Load returns before the old config's server has stopped:
// until it closes its listener, which shares the port (SO_REUSEPORT), a
// new connection may land in that listener's queue and be reset when it
// closes, or be served by the old config; and a kept-alive connection to
// the old server may be closed under the next request. So this waits
// until the old listener is closed and drops the client's idle
// connections: the next request opens one to the new config's server.
func (s *site) reloaded(t testing.TB) {
	t.Helper()
	// A Caddyfile site's host does not bind it: it listens on the port.
	waitListenerReleased(t, s.URL[strings.LastIndexByte(s.URL, ':'):])
	s.client.CloseIdleConnections()
}

// waitListenerReleased waits until one config only, the new one, listens
// on the TCP address addr (as the config gives it): the config that a
// reload replaced has closed its listener. Caddy counts a listener out
// before it closes the socket, so the kernel's list of listening sockets
// is waited for too: a connection dialled in between lands in the old
// socket's queue, and is reset when it closes.
func waitListenerReleased(t testing.TB, addr string) {
	t.Helper()
	_, portText, _ := net.SplitHostPort(addr)
	port, _ := strconv.Atoi(portText)
	waitFor(t, 10*time.Second, "the old config's listener on "+addr+" to close", func() bool {
		return caddy.ListenerUsage("tcp", addr) == 1 && listeningSockets(port) <= 1
	})
}

// listeningSockets counts the TCP sockets of this machine that listen on
// port, from /proc/net/tcp and tcp6 (Linux); elsewhere it reports 0.
func listeningSockets(port int) int {
	n := 0
	local := fmt.Sprintf(":%04X", port)
	for _, file := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		data, err := os.ReadFile(file)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(data), "\n")[1:] {
			// sl local_address rem_address st ...; st 0A is LISTEN.
			f := strings.Fields(line)
			if len(f) > 3 && strings.HasSuffix(f[1], local) && f[3] == "0A" {
				n++
			}
		}
	}
	return n
}

// oneShot is a client of the same site that opens a connection for each
// request: Go's client re-sends a request that carries an
// Idempotency-Key when a reused connection breaks before the answer, and
// a test of a cut connection must see the cut, not the re-sent request.
func (s *site) oneShot() *site {
	c := *s
	c.client = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: s.client.Timeout}
	return &c
}

// noCred, as call.Cred, sends no credential header at all.
const noCred = "\x00none"

// defaultCred is the credential calls carry unless told otherwise.
const defaultCred = "Bearer tenant-a-token"

// call is one request to the site.
type call struct {
	Method      string // default POST
	Path        string // default /pay
	Key         string // Idempotency-Key; "" sends none
	KeyHeader   string // default Idempotency-Key
	Cred        string // Authorization; default defaultCred; noCred sends none
	CredHeader  string // default Authorization
	Body        []byte
	ContentType string // default application/json; "-" sends none
	Chunked     bool   // send the body without Content-Length
	Header      map[string]string
}

// reply is a response read whole.
type reply struct {
	Status int
	Header http.Header
	Body   []byte
}

func (r reply) String() string {
	return fmt.Sprintf("%d %v %q", r.Status, r.Header, r.Body)
}

// replayed says whether the reply carries the replay markers.
func (r reply) replayed() bool {
	return r.Header.Get("Idempotent-Replay") == "true"
}

func (s *site) request(ctx context.Context, c call) (*http.Request, error) {
	if c.Method == "" {
		c.Method = http.MethodPost
	}
	if c.Path == "" {
		c.Path = "/pay"
	}
	var body io.Reader = bytes.NewReader(c.Body)
	if c.Chunked {
		body = io.MultiReader(bytes.NewReader(c.Body)) // unknown length: chunked
	}
	req, err := http.NewRequestWithContext(ctx, c.Method, s.URL+c.Path, body)
	if err != nil {
		return nil, err
	}
	if c.Chunked {
		req.ContentLength = -1
	}
	// Every instance sees the same Host, as behind a load balancer: the
	// Host is part of the fingerprint, and instances of a test listen on
	// ports of their own.
	req.Host = req.URL.Hostname()
	if c.Key != "" {
		h := c.KeyHeader
		if h == "" {
			h = "Idempotency-Key"
		}
		req.Header[http.CanonicalHeaderKey(h)] = []string{c.Key}
	}
	switch c.Cred {
	case noCred:
	case "":
		c.Cred = defaultCred
		fallthrough
	default:
		h := c.CredHeader
		if h == "" {
			h = "Authorization"
		}
		req.Header[http.CanonicalHeaderKey(h)] = []string{c.Cred}
	}
	switch c.ContentType {
	case "-":
	case "":
		req.Header.Set("Content-Type", "application/json")
	default:
		req.Header.Set("Content-Type", c.ContentType)
	}
	for k, v := range c.Header {
		req.Header.Set(k, v)
	}
	return req, nil
}

// Do sends c and reads the whole reply; transport errors fail the test.
func (s *site) Do(t testing.TB, c call) reply {
	t.Helper()
	r, err := s.DoCtx(context.Background(), c)
	if err != nil {
		t.Fatalf("%s %s: %v", c.Method, c.Path, err)
	}
	return r
}

// DoCtx sends c and reads the whole reply.
func (s *site) DoCtx(ctx context.Context, c call) (reply, error) {
	req, err := s.request(ctx, c)
	if err != nil {
		return reply{}, err
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{}, err
	}
	return reply{Status: resp.StatusCode, Header: resp.Header, Body: b}, nil
}

// payBody is a JSON request body unique to the test.
func payBody() []byte {
	return []byte(`{"amount":1000,"currency":"eur","nonce":"` + randomHex(4) + `"}`)
}

// ---------------------------------------------------------------------------
// Assertions

// problemDoc is an RFC 9457 problem document.
type problemDoc struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail"`
}

// wantProblem asserts that r is an application/problem+json answer with
// the given status, with type, title, status and detail, and returns it.
func wantProblem(t testing.TB, r reply, status int) problemDoc {
	t.Helper()
	if r.Status != status {
		t.Fatalf("status = %d, want %d; reply: %s", r.Status, status, r)
	}
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mt != "application/problem+json" {
		t.Errorf("Content-Type = %q, want application/problem+json; body %q", r.Header.Get("Content-Type"), r.Body)
	}
	var p problemDoc
	if err := json.Unmarshal(r.Body, &p); err != nil {
		t.Fatalf("problem body is not JSON: %v: %q", err, r.Body)
	}
	if p.Type == "" || p.Title == "" || p.Detail == "" {
		t.Errorf("problem lacks type, title or detail: %+v", p)
	}
	if p.Status != status {
		t.Errorf("problem status = %d, want %d", p.Status, status)
	}
	if r.replayed() {
		t.Errorf("a problem the module produced carries Idempotent-Replay")
	}
	return p
}

// wantRetryAfter asserts a Retry-After of whole seconds, and returns it.
func wantRetryAfter(t testing.TB, r reply) int {
	t.Helper()
	ra := r.Header.Get("Retry-After")
	n, err := strconv.Atoi(ra)
	if err != nil || n <= 0 {
		t.Errorf("Retry-After = %q, want a positive number of seconds", ra)
	}
	return n
}

// wantReplayOf asserts that replay is a replay of first: same status, same
// body byte for byte, same headers (but the replay markers, Set-Cookie,
// Date and the hop-by-hop headers), with the two replay markers.
func wantReplayOf(t testing.TB, replay, first reply) {
	t.Helper()
	if replay.Status != first.Status {
		t.Errorf("replay status = %d, want %d", replay.Status, first.Status)
	}
	if !bytes.Equal(replay.Body, first.Body) {
		t.Errorf("replay body differs:\n got %q\nwant %q", replay.Body, first.Body)
	}
	if got := replay.Header.Values("Idempotent-Replay"); len(got) != 1 || got[0] != "true" {
		t.Errorf("Idempotent-Replay = %q, want exactly [true]", got)
	}
	if got := replay.Header.Values("Idempotent-Replayed"); len(got) != 1 || got[0] != "true" {
		t.Errorf("Idempotent-Replayed = %q, want exactly [true]", got)
	}
	if got := replay.Header.Values("Set-Cookie"); len(got) != 0 {
		t.Errorf("replay carries Set-Cookie %q", got)
	}
	ignore := map[string]bool{
		"Date": true, "Set-Cookie": true, "Idempotent-Replay": true, "Idempotent-Replayed": true,
		"Connection": true, "Keep-Alive": true, "Transfer-Encoding": true, "Authorization": true,
	}
	for k, want := range first.Header {
		if ignore[k] {
			continue
		}
		if got := replay.Header.Values(k); !equalStrings(got, want) {
			t.Errorf("replay header %s = %q, want %q", k, got, want)
		}
	}
	for k, got := range replay.Header {
		// A replay may state the length that a streamed original did not.
		if ignore[k] || k == "Content-Length" {
			continue
		}
		if _, ok := first.Header[k]; !ok {
			t.Errorf("replay adds header %s: %q", k, got)
		}
	}
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// wantExecuted asserts that r is a fresh (non-replayed) upstream answer.
func wantExecuted(t testing.TB, r reply, status int) {
	t.Helper()
	if r.Status != status {
		t.Fatalf("status = %d, want %d (executed); reply: %s", r.Status, status, r)
	}
	if r.replayed() || r.Header.Get("Idempotent-Replayed") != "" {
		t.Errorf("a first execution carries replay markers: %v", r.Header)
	}
	if r.Header.Get("X-Execution-Id") == "" {
		t.Errorf("reply did not come from the upstream: %s", r)
	}
}

// wantCount asserts how many executions the upstream saw.
func wantCount(t testing.TB, u *upstream, n int) {
	t.Helper()
	if got := u.Count(); got != n {
		t.Errorf("upstream executed %d times, want %d", got, n)
	}
}

// ---------------------------------------------------------------------------
// Requests in the background and polling

// sleepFor asks the upstream to take d before answering.
func sleepFor(d time.Duration) map[string]string {
	return map[string]string{"X-Test-Sleep": d.String()}
}

// runBackground sends c in a goroutine; the reply arrives on the channel.
func runBackground(t *testing.T, s *site, c call) <-chan reply {
	t.Helper()
	ch := make(chan reply, 1)
	go func() {
		r, err := s.DoCtx(context.Background(), c)
		if err != nil {
			t.Errorf("background request: %v", err)
		}
		ch <- r
	}()
	return ch
}

// pollPastInProgress sends c until it gets something other than a 409 with
// Retry-After (the response may still be being stored).
func pollPastInProgress(t *testing.T, s *site, c call) reply {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		r := s.Do(t, c)
		if r.Status != http.StatusConflict || r.Header.Get("Retry-After") == "" || time.Now().After(deadline) {
			return r
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// ---------------------------------------------------------------------------
// Stores, called directly

// newTestPostgresStore provisions a store on table as Caddy would, and
// cleans it up when the test ends.
func newTestPostgresStore(t *testing.T, table string, maxConns int32) *PostgresStore {
	t.Helper()
	return provisionTestStore(t, &PostgresStore{DSN: testDSN(t), Table: table, MaxConns: maxConns})
}

// provisionTestStore provisions s as Caddy would, waits for its start
// (its migrations), and cleans it up when the test ends.
func provisionTestStore(t *testing.T, s *PostgresStore) *PostgresStore {
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
	if err := s.ready(ctx); err != nil {
		t.Fatalf("starting: %v", err)
	}
	if err := s.Validate(); err != nil {
		t.Fatalf("validating: %v", err)
	}
	return s
}

// testAcquireRequest describes a POST of body under key by credential,
// with a token of its own.
func testAcquireRequest(credential, key, body string) store.AcquireRequest {
	return store.AcquireRequest{
		Key:         store.RecordKey{CredentialHash: sha256.Sum256([]byte(credential)), Key: key},
		Token:       newLockToken(),
		Fingerprint: sha256.Sum256([]byte("POST /v1/charges " + body)),
		Method:      http.MethodPost,
		Path:        "/v1/charges",
		LockTimeout: 30 * time.Second,
		Retention:   24 * time.Hour,
	}
}

// retryRequest is the same request again, as another attempt that owns
// nothing (for any store).
func retryRequest(req store.AcquireRequest) store.AcquireRequest {
	req.Token = newLockToken()
	return req
}

func mustAcquirePG(t *testing.T, s *PostgresStore, req store.AcquireRequest, want store.Outcome) store.AcquireResult {
	t.Helper()
	res, err := s.Acquire(context.Background(), req)
	if err != nil {
		t.Fatalf("acquire: %v", err)
	}
	if res.Outcome != want {
		t.Fatalf("acquire: outcome %d, want %d (record %+v)", res.Outcome, want, res.Record)
	}
	if (res.Record != nil) != (want == store.OutcomeExisting) {
		t.Fatalf("acquire: outcome %d with record %+v", res.Outcome, res.Record)
	}
	return res
}

func mustExec(t *testing.T, s *PostgresStore, sql string, args ...any) {
	t.Helper()
	if _, err := s.pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// memClock is a clock that tests move by hand.
type memClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *memClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *memClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func newTestMemoryStore(maxEntries int) (*MemoryStore, *memClock) {
	clock := &memClock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	return &MemoryStore{MaxEntries: maxEntries, records: newMemoryRecords(maxEntries, clock.now)}, clock
}

const (
	memTestLockTimeout = 30 * time.Second
	memTestRetention   = 24 * time.Hour
)

func memTestRequest(key string) store.AcquireRequest {
	return store.AcquireRequest{
		Key:         store.RecordKey{CredentialHash: [32]byte{1}, Key: key},
		Token:       newLockToken(),
		Fingerprint: [32]byte{2},
		Method:      http.MethodPost,
		Path:        "/charges",
		LockTimeout: memTestLockTimeout,
		Retention:   memTestRetention,
	}
}

func mustAcquire(t *testing.T, s store.Store, req store.AcquireRequest, want store.Outcome) *store.Record {
	t.Helper()
	res, err := s.Acquire(context.Background(), req)
	if err != nil {
		t.Fatalf("Acquire(%q): %v", req.Key.Key, err)
	}
	if res.Outcome != want {
		t.Fatalf("Acquire(%q) outcome = %v, want %v", req.Key.Key, res.Outcome, want)
	}
	if (res.Record != nil) != (want == store.OutcomeExisting) {
		t.Fatalf("Acquire(%q) record = %+v with outcome %v", req.Key.Key, res.Record, res.Outcome)
	}
	return res.Record
}

func quoteIdent(name string) string {
	return `"` + strings.ReplaceAll(name, `"`, `""`) + `"`
}

// ---------------------------------------------------------------------------
// A handler, called directly

// provisionHandler provisions h outside a config, and unloads it at the
// test's end as Caddy unloads a config: h's Cleanup, then its context's
// (its store's). A handler made by hand stays among the admin API's
// running stores otherwise, in the tests that follow.
func provisionHandler(tb testing.TB, h *Handler) error {
	tb.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	tb.Cleanup(cancel)
	err := h.Provision(ctx)
	tb.Cleanup(func() { _ = h.Cleanup() })
	return err
}

// lockHandler is a provisioned handler on a fresh memory store, wrapped
// by a scriptedStore, logging to an observer.
func lockHandler(t *testing.T, lockTimeout time.Duration) (*Handler, *scriptedStore, *observer.ObservedLogs) {
	t.Helper()
	h := &Handler{LockTimeout: caddy.Duration(lockTimeout), PruneInterval: new(caddy.Duration)}
	if err := provisionHandler(t, h); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	h.logger = zap.New(core)
	s := &scriptedStore{Store: h.store}
	h.store = s
	return h, s, logs
}

// serve sends one protected request through h with ctx, and returns the
// status the client got. Memory stores share their records, so keys are
// made unique to the test run.
func serve(ctx context.Context, h *Handler, key string, next caddyhttp.Handler) int {
	status, _ := serveResult(ctx, h, key, next)
	return status
}

// serveResult is serve, with the {http.idempotency.result} it set.
func serveResult(ctx context.Context, h *Handler, key string, next caddyhttp.Handler) (status int, result string) {
	r := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader(`{"amount":1}`))
	key += "-" + runID
	r.Header.Set("Idempotency-Key", key)
	r.Header.Set("Authorization", defaultCred)
	r.Header.Set("Content-Type", "application/json")
	repl := caddy.NewReplacer()
	r = r.WithContext(context.WithValue(ctx, caddy.ReplacerCtxKey, repl))
	w := httptest.NewRecorder()
	err := h.ServeHTTP(w, r, next)
	result, _ = repl.GetString("http.idempotency.result")
	if err != nil {
		return -1, result
	}
	return w.Code, result
}

// runID tells this test binary's keys from those of earlier runs.
var runID = randomHex(4)

// created is a next handler that counts its calls and answers 201.
func created(calls *atomic.Int32) caddyhttp.Handler {
	return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		calls.Add(1)
		w.WriteHeader(http.StatusCreated)
		return nil
	})
}

// ---------------------------------------------------------------------------
// The CLI and the metrics

// cliResult is what one run of the CLI printed and returned.
type cliResult struct {
	stdout, stderr string
	code           int
}

func (r cliResult) String() string {
	return fmt.Sprintf("exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
}

// runCLI runs `caddy idempotency args...` with env as the only
// database-related environment (IDEMPOTENCY_DSN and DATABASE_URL of the
// test process are not passed on).
func runCLI(t *testing.T, env []string, args ...string) cliResult {
	t.Helper()
	return runCLIInput(t, "", env, args...)
}

// runCLIInput is runCLI with stdin.
func runCLIInput(t *testing.T, stdin string, env []string, args ...string) cliResult {
	t.Helper()
	bin := buildCaddy(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, append([]string{"idempotency"}, args...)...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEMPOTENCY_DSN=") && !strings.HasPrefix(kv, "DATABASE_URL=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdin, cmd.Stdout, cmd.Stderr = strings.NewReader(stdin), &stdout, &stderr
	err := cmd.Run()
	res := cliResult{stdout: stdout.String(), stderr: stderr.String()}
	var exitErr *exec.ExitError
	switch {
	case errors.As(err, &exitErr):
		res.code = exitErr.ExitCode()
	case err != nil:
		t.Fatalf("running %s: %v", bin, err)
	}
	return res
}

func wantCLI(t *testing.T, res cliResult, code int, contains ...string) {
	t.Helper()
	if res.code != code {
		t.Fatalf("want exit %d, got %s", code, res)
	}
	for _, s := range contains {
		if !strings.Contains(res.stdout+res.stderr, s) {
			t.Errorf("output lacks %q: %s", s, res)
		}
	}
}

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
