package idempotency

// The end-to-end harness: a real Caddy loaded in-process from a Caddyfile
// (here; a Caddy process is caddyproc_test.go's), a real Postgres
// (internal/pgtest), and an upstream that keeps a ledger of what it
// executed (harness_upstream_test.go). Nothing in the request path is
// mocked. The stores as tests call them, the CLI and the metrics have
// files of their own (harness_*_test.go).

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
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
	pgtest.Cleanup()
	removeCaddyBinary() // built by the tests that run Caddy as a process
	os.Exit(code)
}

// freeTCPPort is freePort for a test, which fails if there is none.
func freeTCPPort(t testing.TB) int {
	t.Helper()
	port, err := pgtest.FreePort()
	if err != nil {
		t.Fatalf("free port: %v", err)
	}
	return port
}

// newKey returns a fresh, valid Idempotency-Key.
func newKey() string { return "key-" + pgtest.RandomHex(8) }

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
// until the old listener is closed and gives the client a transport of
// its own: the next request opens a connection to the new config's
// server. Dropping the idle connections was not enough: Go's transport
// hands a connection back to its pool a moment after the response's
// body was read, so the previous request's could come back after the
// drop, and be reset under the next request when the old server
// closed it.
func (s *site) reloaded(t testing.TB) {
	t.Helper()
	// A Caddyfile site's host does not bind it: it listens on the port.
	waitListenerReleased(t, s.URL[strings.LastIndexByte(s.URL, ':'):])
	old := s.client.Transport.(*http.Transport)
	old.CloseIdleConnections()
	tr := old.Clone()
	t.Cleanup(tr.CloseIdleConnections)
	s.client.Transport = tr
}

// waitListenerReleased waits until one config only, the new one, listens
// on the TCP address addr (as the config gives it): the config that a
// reload replaced has closed its listener. Caddy counts a listener out
// before it closes the socket, so the kernel's list of listening sockets
// is waited for too: a connection dialled in between lands in the old
// socket's queue, and is reset when it closes.
func waitListenerReleased(t testing.TB, addr string) {
	t.Helper()
	host, portText, _ := net.SplitHostPort(addr)
	port, _ := strconv.Atoi(portText)
	deadline := time.Now().Add(10 * time.Second)
	for {
		usage, socks := caddy.ListenerUsage("tcp", addr), listeningSockets(host, port)
		if usage == 1 && len(socks) <= 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after 10s waiting for the old config's listener on %s to close: Caddy counts %d listeners on it, the kernel lists these sockets listening there: %q",
				addr, usage, socks)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// listeningSockets returns the lines of /proc/net/tcp (Linux; elsewhere
// none) of the sockets that listen on host:port, an IPv4 address, or on
// the wildcard address and port: another process's socket on another
// address and the same port (an IPv6 one) is not in the way.
func listeningSockets(host string, port int) []string {
	var out []string
	ip := net.ParseIP(host).To4()
	if ip == nil {
		return nil
	}
	want := map[string]bool{
		fmt.Sprintf("%02X%02X%02X%02X:%04X", ip[3], ip[2], ip[1], ip[0], port): true,
		fmt.Sprintf("00000000:%04X", port):                                     true,
	}
	data, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		return nil
	}
	for _, line := range strings.Split(string(data), "\n")[1:] {
		// sl local_address rem_address st ...; st 0A is LISTEN.
		f := strings.Fields(line)
		if len(f) > 3 && want[f[1]] && f[3] == "0A" {
			out = append(out, strings.Join(f, " "))
		}
	}
	return out
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
	return []byte(`{"amount":1000,"currency":"eur","nonce":"` + pgtest.RandomHex(4) + `"}`)
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
