package idempotency

// Hostile input, end to end through Caddy: bodies built to exhaust the
// parser or the limits, bodies that never end or never arrive, huge
// header values, keys built to break quoting or SQL, and configs built to
// inject SQL. And the secrets: no raw credential in the database, the log
// or the metrics, no tenant reading another's replay, no secret-carrying
// response header stored.

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddyserver/caddy/v2"
)

// A JSON body nested 100,000 levels deep is refused by the canonicaliser
// at its depth limit and hashed raw: bounded work, no stack exhaustion,
// and the request is protected like any other.
func TestHostileDeepJSON(t *testing.T) {
	up := newUpstream(t)
	s := protectedSite(t, storeBackend{Name: "memory"}, up.Addr())
	const depth = 100_000
	for name, body := range map[string][]byte{
		"arrays":   []byte(strings.Repeat("[", depth) + strings.Repeat("]", depth)),
		"objects":  []byte(strings.Repeat(`{"a":`, depth) + "1" + strings.Repeat("}", depth)),
		"unclosed": []byte(strings.Repeat("[", depth)),
	} {
		t.Run(name, func(t *testing.T) {
			n := up.Count()
			c := call{Key: newKey(), Body: body}
			start := time.Now()
			first := s.Do(t, c)
			wantExecuted(t, first, http.StatusCreated)
			wantReplayOf(t, s.Do(t, c), first)
			// Bounded work, with room for a loaded machine.
			if d := time.Since(start); d > 10*time.Second {
				t.Errorf("two requests took %v", d)
			}
			if got := up.Executions()[n].Body; !bytes.Equal(got, body) {
				t.Errorf("the upstream got %d bytes, the client sent %d", len(got), len(body))
			}
			// Hashed raw: one byte of whitespace more is another request.
			spaced := append(append([]byte(nil), body...), ' ')
			wantProblem(t, s.Do(t, call{Key: c.Key, Body: spaced}), http.StatusConflict)
		})
	}
}

// Duplicate member names are kept in their order: {"a":1,"a":2} means
// a = 2 to most parsers and a = 1 to some, so it is another request than
// {"a":2,"a":1}, while reordering distinct names and whitespace are not.
// Invalid UTF-8 makes a body not JSON: it is hashed raw, byte for byte.
func TestHostileJSONDuplicatesAndInvalidUTF8(t *testing.T) {
	up := newUpstream(t)
	s := protectedSite(t, storeBackend{Name: "memory"}, up.Addr())
	for _, tc := range []struct {
		name         string
		first        string
		same, differ []string
	}{
		{
			name:   "duplicate names",
			first:  `{"b":0,"a":1,"a":2}`,
			same:   []string{`{ "a" : 1 , "a" : 2 , "b" : 0 }`, `{"a":1,"b":0,"a":2}`},
			differ: []string{`{"b":0,"a":2,"a":1}`, `{"b":0,"a":2}`},
		},
		{
			name:   "invalid UTF-8",
			first:  "{\"a\":\"\xff\xfe\",\"b\":1}",
			same:   []string{"{\"a\":\"\xff\xfe\",\"b\":1}"},
			differ: []string{"{\"b\":1,\"a\":\"\xff\xfe\"}", "{\"a\":\"\xff\xfd\",\"b\":1}"},
		},
		{
			name:   "overlong UTF-8 encoding of a quote",
			first:  "{\"a\":\"\xc0\xa2\"}",
			same:   []string{"{\"a\":\"\xc0\xa2\"}"},
			differ: []string{`{"a":"\""}`, "{ \"a\":\"\xc0\xa2\"}"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := up.Count()
			key := newKey()
			first := s.Do(t, call{Key: key, Body: []byte(tc.first)})
			wantExecuted(t, first, http.StatusCreated)
			if got := up.Executions()[n].Body; string(got) != tc.first {
				t.Errorf("the upstream got %q, the client sent %q", got, tc.first)
			}
			for _, b := range tc.same {
				wantReplayOf(t, s.Do(t, call{Key: key, Body: []byte(b)}), first)
			}
			for _, b := range tc.differ {
				wantProblem(t, s.Do(t, call{Key: key, Body: []byte(b)}), http.StatusConflict)
			}
			wantCount(t, up, n+1)
		})
	}
}

// endless is a request body that never ends: 1 KiB every few
// milliseconds, until the test is over.
type endless struct {
	done <-chan struct{}
	sent int
}

func (e *endless) Read(p []byte) (int, error) {
	select {
	case <-e.done:
		return 0, io.EOF
	case <-time.After(2 * time.Millisecond):
	}
	n := copy(p, bytes.Repeat([]byte("x"), min(len(p), 1024)))
	e.sent += n
	return n, nil
}

// A chunked body with no Content-Length that passes max_request_body
// mid-stream gets 413 as soon as it does, while the client is still
// sending: nothing reaches the upstream, nothing is stored.
func TestHostileEndlessChunkedBody(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "max_request_body 64KiB")
		done := make(chan struct{})
		defer close(done)
		body := &endless{done: done}
		req, err := http.NewRequest(http.MethodPost, s.URL+"/pay", body)
		if err != nil {
			t.Fatal(err)
		}
		req.ContentLength = -1 // chunked
		req.Header.Set("Idempotency-Key", newKey())
		req.Header.Set("Authorization", defaultCred)
		req.Header.Set("Content-Type", "application/octet-stream")
		start := time.Now()
		resp, err := s.client.Do(req)
		if err != nil {
			t.Fatalf("no answer while the body was still flowing: %v", err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		wantProblem(t, reply{Status: resp.StatusCode, Header: resp.Header, Body: b}, http.StatusRequestEntityTooLarge)
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("the 413 took %v", d)
		}
		wantCount(t, up, 0)
		if sb.Name == "postgres" {
			if n := pgCount(t, sb); n != 0 {
				t.Errorf("%d records after a refused body, want 0", n)
			}
		}
	})
}

// siteWithServerOptions starts Caddy with a servers global option block
// (timeouts, limits) and the protected site, as protectedSite does.
func siteWithServerOptions(t *testing.T, servers string, sb storeBackend, upstreamAddr string) *site {
	t.Helper()
	port := freeTCPPort(t)
	logPath := t.TempDir() + "/caddy.log"
	global := strings.Replace(globalOptions(logPath, ""), "persist_config off",
		"persist_config off\n\tservers {\n\t\t"+servers+"\n\t}", 1)
	cfg, _, err := adaptCaddyfile(global + fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
	}
	reverse_proxy %s
}
`, port, sb.Block(), upstreamAddr))
	if err != nil {
		t.Fatal(err)
	}
	return newSiteClient(t, startCaddyJSON(t, cfg, logPath), port)
}

// A body that stalls times out (Caddy's read_body timeout) before the key
// is acquired: nothing is stored or locked, and the client's retry with
// the whole body executes at once.
func TestHostileStalledBody(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := siteWithServerOptions(t, "timeouts {\n\t\t\tread_body 1s\n\t\t}", sb, up.Addr())

		key, body := newKey(), payBody()
		for _, framing := range []string{"Content-Length", "chunked"} {
			conn, err := net.Dial("tcp", strings.TrimPrefix(s.URL, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			head := fmt.Sprintf("POST /pay HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: %s\r\n"+
				"Authorization: %s\r\nContent-Type: application/json\r\n", key, defaultCred)
			if framing == "chunked" {
				head += fmt.Sprintf("Transfer-Encoding: chunked\r\n\r\n%x\r\n%s", len(body), body[:10])
			} else {
				head += fmt.Sprintf("Content-Length: %d\r\n\r\n%s", len(body), body[:10])
			}
			if _, err := io.WriteString(conn, head); err != nil {
				t.Fatal(err)
			}
			// ...and nothing more: the rest of the body never comes.
			start := time.Now()
			_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
			if err != nil {
				t.Fatalf("%s: no answer to a stalled body: %v", framing, err)
			}
			b, _ := io.ReadAll(resp.Body)
			conn.Close()
			wantProblem(t, reply{Status: resp.StatusCode, Header: resp.Header, Body: b}, http.StatusRequestTimeout)
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("%s: the timeout took %v, read_body is 1s", framing, d)
			}
			wantCount(t, up, 0)
		}
		if sb.Name == "postgres" {
			if n := pgCount(t, sb); n != 0 {
				t.Errorf("%d records after stalled bodies, want 0", n)
			}
		}
		first := s.Do(t, call{Key: key, Body: body})
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, call{Key: key, Body: body}), first)
	})
}

// A body cut short (the client declared more than it sent, or ended a
// chunked body without its last chunk, then half-closed its side) is not
// a shorter request: it is refused as unreadable, nothing is executed or
// stored, and the client's retry with the whole body executes.
func TestHostileTruncatedBody(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		key, body := newKey(), payBody()
		for _, framing := range []string{"Content-Length", "chunked", "empty"} {
			conn, err := net.Dial("tcp", strings.TrimPrefix(s.URL, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			head := fmt.Sprintf("POST /pay HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: %s\r\n"+
				"Authorization: %s\r\nContent-Type: application/json\r\n", key, defaultCred)
			switch framing {
			case "chunked":
				head += fmt.Sprintf("Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n", 10, body[:10])
			case "empty":
				head += fmt.Sprintf("Content-Length: %d\r\n\r\n", len(body))
			default:
				head += fmt.Sprintf("Content-Length: %d\r\n\r\n%s", len(body), body[:10])
			}
			if _, err := io.WriteString(conn, head); err != nil {
				t.Fatal(err)
			}
			if err := conn.(*net.TCPConn).CloseWrite(); err != nil {
				t.Fatal(err)
			}
			_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
			if err == nil {
				b, _ := io.ReadAll(resp.Body)
				wantProblem(t, reply{Status: resp.StatusCode, Header: resp.Header, Body: b}, http.StatusBadRequest)
			}
			// No answer at all (Caddy may drop a connection whose request
			// cannot be read) is right too: nothing may have executed.
			conn.Close()
			wantCount(t, up, 0)
		}
		if sb.Name == "postgres" {
			if n := pgCount(t, sb); n != 0 {
				t.Errorf("%d records after truncated bodies, want 0", n)
			}
		}
		first := s.Do(t, call{Key: key, Body: body})
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, call{Key: key, Body: body}), first)
	})
}

// Header values of 64 KiB (past Caddy's default 16 KiB limit, which
// refuses them before any handler runs, so raised here): a key that long
// is refused before anything happens; a credential that long is one like
// any other (it is hashed); a response header that long is stored and
// replayed whole.
func TestHostileLargeHeaders(t *testing.T) {
	const size = 64 << 10
	big := func(c byte) string { return strings.Repeat(string(c), size) }
	eachStore(t, func(t *testing.T, sb storeBackend) {
		var hits atomic.Int32
		up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hits.Add(1)
			w.Header().Set("X-Big", big('h'))
			w.Header().Set("X-Execution-Id", pgtest.RandomHex(8))
			w.WriteHeader(http.StatusCreated)
		}))
		t.Cleanup(up.Close)
		s := siteWithServerOptions(t, "max_header_size 1MiB", sb, strings.TrimPrefix(up.URL, "http://"))

		wantProblem(t, s.Do(t, call{Key: big('k'), Body: payBody()}), http.StatusBadRequest)
		wantProblem(t, s.Do(t, call{Key: `"` + big('k') + `"`, Body: payBody()}), http.StatusBadRequest)
		if hits.Load() != 0 {
			t.Fatalf("a 64 KiB key reached the upstream")
		}

		credA, credB := "Bearer "+big('a'), "Bearer "+big('a')[1:]+"b"
		c := call{Key: newKey(), Body: payBody(), Cred: credA}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		if first.Header.Get("X-Big") != big('h') {
			t.Fatalf("the 64 KiB response header did not reach the first caller whole")
		}
		replay := s.Do(t, c)
		wantReplayOf(t, replay, first)
		other := s.Do(t, call{Key: c.Key, Body: c.Body, Cred: credB})
		wantExecuted(t, other, http.StatusCreated)
		if n := hits.Load(); n != 2 {
			t.Errorf("the upstream ran %d times, want 2 (one per credential)", n)
		}
		logs, _ := os.ReadFile(s.LogPath)
		if bytes.Contains(logs, []byte(big('a')[:64])) {
			t.Errorf("the log holds the credential")
		}
	})
}

// Keys built to break quoting, parsing or SQL are either refused with 400
// or kept exactly: a quoted key is its unescaped content, and what the
// store holds is the key byte for byte.
func TestHostileKeys(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		for _, tc := range []struct {
			name, sent, same, stored string
		}{
			{"SQL in the key", `k'); DROP TABLE x; --`, `"k'); DROP TABLE x; --"`, `k'); DROP TABLE x; --`},
			{"quotes inside a bare key", `ab"cd"ef`, `"ab\"cd\"ef"`, `ab"cd"ef`},
			{"backslashes", `a\b\c\d\e`, `"a\\b\\c\\d\\e"`, `a\b\c\d\e`},
			{"spaces inside", `pay order 42`, `"pay order 42"`, `pay order 42`},
			{"quoted spaces at the edges", `" pay 42 "`, `" pay 42 "`, ` pay 42 `},
			{"percent and placeholders", `{http.request.uri}%00%s`, `"{http.request.uri}%00%s"`, `{http.request.uri}%00%s`},
		} {
			t.Run(tc.name, func(t *testing.T) {
				n := up.Count()
				body := payBody()
				first := s.Do(t, call{Key: tc.sent, Body: body})
				wantExecuted(t, first, http.StatusCreated)
				wantReplayOf(t, s.Do(t, call{Key: tc.same, Body: body}), first)
				if got := first.Header.Get("X-Execution-Id"); up.Executions()[n].ID != got {
					t.Errorf("the answer is not the upstream's execution")
				}
				wantCount(t, up, n+1)
				if sb.Name == "postgres" {
					rows := pgtest.Query(t, sb.DSN, "SELECT count(*) FROM "+pgtest.QuoteIdent(sb.Table)+" WHERE key = $1", tc.stored)
					if rows[0][0] != "1" {
						t.Errorf("no record with the key %q", tc.stored)
					}
				}
			})
		}
		for _, key := range []string{
			`"unterminated-key`, `"abcdefgh"x`, `"abcdefgh";q=1`, `"a\bcdefghi"`, "tab\there-key",
		} {
			t.Run("refused "+key, func(t *testing.T) {
				wantProblem(t, s.Do(t, call{Key: key, Body: payBody()}), http.StatusBadRequest)
			})
		}
	})
}

// A table name that carries SQL is refused when the config loads, through
// the JSON API as well as the Caddyfile (TestCaddyfileErrors): no
// statement is ever built with it. The canary table it names survives.
func TestHostileTableNameRefusedAtLoad(t *testing.T) {
	dsn := pgtest.DSN(t)
	canary := pgtest.FreshTable(t)
	pgtest.Exec(t, dsn, "CREATE TABLE "+canary+" (x int)")
	cfg := fmt.Sprintf(`{
	"admin": {"disabled": true},
	"logging": {"logs": {"default": {"writer": {"output": "discard"}}}},
	"apps": {"http": {"servers": {"srv0": {
		"listen": ["127.0.0.1:%d"],
		"routes": [{"handle": [
			{"handler": "idempotency", "store": {"backend": "postgres", "dsn": %q, "table": %q}},
			{"handler": "static_response", "status_code": 201}
		]}]
	}}}}
}`, freeTCPPort(t), dsn, "x; DROP TABLE "+canary)
	caddyMu.Lock()
	err := caddy.Load([]byte(cfg), true)
	if err == nil {
		_ = caddy.Stop()
	}
	caddyMu.Unlock()
	if err == nil || !strings.Contains(err.Error(), "table") {
		t.Fatalf("loading a config with table %q: %v, want it refused", "x; DROP TABLE "+canary, err)
	}
	if rows := pgtest.Query(t, dsn, "SELECT to_regclass($1) IS NOT NULL", canary); rows[0][0] != "true" {
		t.Fatalf("the canary table %s is gone", canary)
	}
}

// Secrets stay out of everything the module writes or exposes: the raw
// credential and the database password never reach the table, the log
// (whatever path the request takes: executed, replayed, in progress,
// mismatch, store error) or the metrics. Secret-carrying response
// headers are never stored. A tenant never gets another's response, even
// with the same key and body at the same moment.
func TestHostileSecretsNeverLeak(t *testing.T) {
	sb := postgresBackend(t)
	dbPassword := "pw-" + pgtest.RandomHex(10)
	fwd := pgtest.NewForwarder(t, pgtest.Addr(t, sb.DSN))
	// The server trusts the test's connections, so the password is
	// ignored by it, but the module gets it in its DSN like any other.
	dsn := strings.Replace(pgtest.ThroughForwarder(t, sb.DSN, fwd), "postgres@", "postgres:"+dbPassword+"@", 1)
	t.Setenv("IDEMPOTENCY_SECRET_TEST_DSN", dsn)

	var upstreamSecrets []string
	for i := range 5 {
		upstreamSecrets = append(upstreamSecrets, fmt.Sprintf("upstream-secret-%d-%s", i, pgtest.RandomHex(6)))
	}
	var started atomic.Int32
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started.Add(1)
		if d, err := time.ParseDuration(r.Header.Get("X-Test-Sleep")); err == nil {
			time.Sleep(d)
		}
		h := w.Header()
		h["Set-Cookie"] = []string{"session=" + upstreamSecrets[0] + "; Path=/", "csrf=" + upstreamSecrets[1]}
		h.Set("Authorization", "Bearer "+upstreamSecrets[2])
		h.Set("Proxy-Authorization", "Basic "+upstreamSecrets[3])
		h.Set("Proxy-Authenticate", "Basic realm="+upstreamSecrets[4])
		h.Set("X-Execution-Id", pgtest.RandomHex(8))
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"ok":true}`)
	}))
	t.Cleanup(up.Close)

	port, adminPort := freeTCPPort(t), freeTCPPort(t)
	srv := startCaddyfileAdmin(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store postgres {
			dsn {env.IDEMPOTENCY_SECRET_TEST_DSN}
			table %s
		}
		retry_after 1s
		# In the clear, so that the table shows what is stored: the
		# secrets must be left out, not only sealed.
		seal off
	}
	reverse_proxy %s
}
`, port, sb.Table, strings.TrimPrefix(up.URL, "http://")), fmt.Sprintf("127.0.0.1:%d", adminPort))
	s := newSiteClient(t, srv, port)

	tokenA, tokenB := "sk_live_"+pgtest.RandomHex(12), "sk_live_"+pgtest.RandomHex(12)
	credA, credB := "Bearer "+tokenA, "Bearer "+tokenB
	secrets := make(map[string]string)
	for name, v := range map[string]string{"token A": tokenA, "token B": tokenB, "db password": dbPassword, "credential A": credA} {
		secrets[name] = v
		secrets[name+" (hex)"] = hex.EncodeToString([]byte(v))
		secrets[name+" (base64)"] = base64.StdEncoding.EncodeToString([]byte(v))
	}
	for i, v := range upstreamSecrets {
		secrets[fmt.Sprintf("upstream secret %d", i)] = v
	}

	// Every path a request can take.
	key, body := newKey(), payBody()
	// Long enough for B's request and A's retry to be answered while A's
	// runs, on a loaded machine too.
	slow := call{Key: key, Body: body, Cred: credA, Header: sleepFor(2 * time.Second)}
	chA := runBackground(t, s, slow)
	storetest.WaitFor(t, 15*time.Second, "A's request to reach the upstream", func() bool { return started.Load() == 1 })
	// Tenant B, same key, same body, while A's request runs: B's own.
	chB := runBackground(t, s, call{Key: key, Body: body, Cred: credB, Header: slow.Header})
	wantProblem(t, s.Do(t, call{Key: key, Body: body, Cred: credA}), http.StatusConflict) // in progress
	ra, rb := <-chA, <-chB
	wantExecuted(t, ra, http.StatusCreated)
	wantExecuted(t, rb, http.StatusCreated)
	if ra.Header.Get("X-Execution-Id") == rb.Header.Get("X-Execution-Id") {
		t.Fatal("tenant B got tenant A's execution")
	}
	// reverse_proxy drops the Proxy-* ones itself, as hop-by-hop.
	for _, h := range []string{"Set-Cookie", "Authorization"} {
		if ra.Header.Get(h) == "" {
			t.Errorf("the first caller must get the upstream's %s", h)
		}
	}
	for _, tc := range []struct {
		cred  string
		first reply
	}{{credA, ra}, {credB, rb}} {
		replay := s.Do(t, call{Key: key, Body: body, Cred: tc.cred})
		wantReplayOf(t, replay, tc.first)
		for _, h := range []string{"Set-Cookie", "Authorization", "Proxy-Authorization", "Proxy-Authenticate"} {
			if v := replay.Header.Values(h); len(v) != 0 {
				t.Errorf("a replay carries %s: %q", h, v)
			}
		}
	}
	wantProblem(t, s.Do(t, call{Key: key, Body: payBody(), Cred: credA}), http.StatusConflict) // mismatch
	fwd.Cut()
	wantProblem(t, s.Do(t, call{Key: newKey(), Body: body, Cred: credA}), http.StatusServiceUnavailable)
	fwd.Restore()

	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", adminPort))
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	logs, err := os.ReadFile(s.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(logs, []byte("idempotency.store_error")) || !bytes.Contains(logs, []byte("idempotency.in_progress")) {
		t.Fatalf("the log lacks the paths this test meant to exercise")
	}
	var moduleLog bytes.Buffer
	for _, l := range bytes.Split(logs, []byte("\n")) {
		if bytes.Contains(l, []byte(`"logger":"http.handlers.idempotency`)) {
			moduleLog.Write(append(l, '\n'))
		}
	}
	// The headers are binary (bytea): their printable bytes are read as
	// text too.
	table := pgtest.Query(t, sb.DSN, "SELECT string_agg(t::text || ' ' || coalesce(encode(t.response_header_bytes, 'escape'), ''), E'\\n') FROM "+
		pgtest.QuoteIdent(sb.Table)+" t")[0][0]
	for where, data := range map[string][]byte{
		"the log": logs, "the module's log": moduleLog.Bytes(), "the metrics": metrics, "the table": []byte(table),
	} {
		for name, secret := range secrets {
			// Caddy's own debug log of the upstream round trip shows
			// response headers it does not redact (Proxy-Authenticate):
			// not this module's doing.
			if where == "the log" && strings.HasPrefix(name, "upstream") {
				continue
			}
			if bytes.Contains(bytes.ToLower(data), bytes.ToLower([]byte(secret))) {
				t.Errorf("%s holds %s", where, name)
			}
		}
	}
	if !strings.Contains(table, "X-Execution-Id") {
		t.Errorf("the table holds no response headers at all: %.300s", table)
	}
}
