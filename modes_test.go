package idempotency

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddyserver/caddy/v2"
)

// ---------------------------------------------------------------------------
// wait

// A request that finds the same request in progress waits for it and
// gets its response replayed, instead of 409. Catches a wait that is not
// implemented (409) or that polls no faster than lock_timeout (slow).
func TestWaitReplaysWhenTheFirstCompletes(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "wait 5s")
		c := call{Key: newKey(), Body: payBody(), Header: sleepFor(600 * time.Millisecond)}
		firstCh := runBackground(t, s, c)
		up.WaitStarted(t, 1)
		start := time.Now()
		second := s.Do(t, call{Key: c.Key, Body: c.Body})
		waited := time.Since(start)
		first := <-firstCh
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, second, first)
		wantCount(t, up, 1)
		// Woken by the completion, not by the deadline nor lock_timeout (30s).
		if waited > 2*time.Second {
			t.Errorf("the waiter answered after %v; the first request took 600ms", waited)
		}
	})
}

// At the deadline a waiter gets the usual 409 with Retry-After.
func TestWaitDeadlineGives409(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		// A wait of 1s, longer than a request takes on a loaded
		// machine: a mismatch that waited would take at least that.
		s := protectedSite(t, sb, up.Addr(), "wait 1s")
		c := call{Key: newKey(), Body: payBody(), Header: sleepFor(2500 * time.Millisecond)}
		firstCh := runBackground(t, s, c)
		up.WaitStarted(t, 1)
		start := time.Now()
		r := s.Do(t, call{Key: c.Key, Body: c.Body})
		waited := time.Since(start)
		wantProblem(t, r, http.StatusConflict)
		wantRetryAfter(t, r)
		if waited < time.Second || waited > 2400*time.Millisecond {
			t.Errorf("answered after %v, want about the 1s of wait", waited)
		}
		// A different request under the key does not wait.
		start = time.Now()
		wantProblem(t, s.Do(t, call{Key: c.Key, Body: payBody()}), http.StatusConflict)
		if d := time.Since(start); d >= time.Second {
			t.Errorf("a mismatch waited %v", d)
		}
		wantExecuted(t, <-firstCh, http.StatusCreated)
		wantCount(t, up, 1)
		var line map[string]any
		for _, l := range s.moduleLogLines(t) {
			if l["msg"] == "idempotency.wait" {
				line = l
			}
		}
		if line == nil || line["level"] != "debug" || line["still_in_progress"] != true {
			t.Errorf("idempotency.wait line: %v", line)
		}
		t.Logf("%v", line)
	})
}

// With Postgres, waiting costs no polling: each waiter looks at the
// record when it starts and when it is woken, whatever the wait. Also,
// an operator's release wakes waiters, which then execute at once.
func TestWaitPostgresIsNotified(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	port, admin := freeTCPPort(t), fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
	srv := startCaddyfileAdmin(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		wait 20s
		lock_timeout 1h
		replay_cache off
	}
	reverse_proxy %s
}
`, port, sb.Block(), up.Addr()), admin)
	s := newSiteClient(t, srv, port)
	acquires := func() float64 {
		return scrapeMetrics(t, admin).value("caddy_idempotency_store_duration_seconds", "operation", "acquire")
	}
	// The first request runs on another instance: the retries of a key
	// whose owner runs in their own process are answered there, without
	// the store, and it is the store's acquires that show a waiter that
	// polls. It waits too, so that its completion notifies.
	ownerPort := freeTCPPort(t)
	owner := procSite(t, startCaddyProc(t, "owner", fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		wait 20s
		lock_timeout 1h
		replay_cache off
	}
	reverse_proxy %s
}
`, ownerPort, sb.Block(), up.Addr())), ownerPort)

	// The first request's response is held open (its record in
	// progress) until every waiter waits: a fixed sleep let a busy
	// machine start the waiters after the record was complete.
	c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Gate": "waiters"}}
	firstCh := runBackground(t, owner, c)
	up.WaitStarted(t, 1)
	before := acquires()
	const waiters = 4
	replies := make(chan reply, waiters)
	for range waiters {
		go func() { replies <- s.Do(t, call{Key: c.Key, Body: c.Body}) }()
	}
	storetest.WaitFor(t, 4*time.Second, "every waiter to look twice", func() bool {
		return acquires()-before >= 2*waiters
	})
	time.Sleep(time.Second) // a waiter that polled would look again meanwhile
	up.Open("waiters")
	first := <-firstCh
	for range waiters {
		wantReplayOf(t, <-replies, first)
	}
	// Per waiter: the look that found it in progress, the look after
	// registering, the look after the wake-up; one more if the listener
	// connected meanwhile (it wakes everyone).
	if n := acquires() - before; n < 3*waiters || n > 4*waiters {
		t.Errorf("%v acquires for %d waiters, want 3 or 4 each: polling?", n, waiters)
	}

	// A stuck record (its instance died; the lock is fresh for an hour,
	// so the operator forces the release): a waiter is woken by the
	// CLI's release and executes.
	stuck := call{Key: newKey(), Body: payBody()}
	wantExecuted(t, s.Do(t, stuck), http.StatusCreated)
	sb.waitCompleted(t, stuck.Key)
	pgtest.Exec(t, sb.DSN, `UPDATE `+pgtest.QuoteIdent(sb.Table)+` SET status = 'in_progress',
		lock_token = $1, locked_at = now(),
		response_status = NULL, response_headers = NULL, response_body = NULL,
		replayable = NULL, response_size = NULL
		WHERE key = $2`, bytes.Repeat([]byte{0xde}, 16), stuck.Key)
	buildCaddy(t) // before the clock starts
	base := acquires()
	waiterCh := runBackground(t, s, stuck)
	storetest.WaitFor(t, 15*time.Second, "the waiter to wait", func() bool {
		return acquires()-base >= 2 // its first look and the one after registering
	})
	start := time.Now()
	wantCLI(t, runCLI(t, []string{"IDEMPOTENCY_DSN=" + sb.DSN}, "release", "--force", "--table", sb.Table,
		"--key", stuck.Key, "--credential", defaultCred), exitOK)
	r := <-waiterCh
	wantExecuted(t, r, http.StatusCreated)
	// Unwoken, it would wait its 20s; the CLI's run is in the time.
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("the waiter executed %v after the release", d)
	}
	wantCount(t, up, 3)
}

// The listener reconnects when its connection is killed, and a waiter is
// still woken by the next completion.
func TestWaitPostgresListenerReconnects(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	s := protectedSite(t, sb, up.Addr(), "wait 20s", "lock_timeout 1h")
	storetest.WaitFor(t, 15*time.Second, "the listener to connect", func() bool {
		return pgtest.Backends(t, sb.DSN, "caddy-idempotency-listener") == 1
	})
	pgtest.Query(t, sb.DSN, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'caddy-idempotency-listener'`)
	storetest.WaitFor(t, 15*time.Second, "the listener to reconnect", func() bool {
		return pgtest.Backends(t, sb.DSN, "caddy-idempotency-listener") == 1
	})
	c := call{Key: newKey(), Body: payBody(), Header: sleepFor(700 * time.Millisecond)}
	firstCh := runBackground(t, s, c)
	up.WaitStarted(t, 1)
	start := time.Now()
	second := s.Do(t, call{Key: c.Key, Body: c.Body})
	wantReplayOf(t, second, <-firstCh)
	// Unwoken, it would answer at the end of its 20s wait.
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("the waiter answered after %v; the first request took 700ms", d)
	}
	var line map[string]any
	for _, l := range s.moduleLogLines(t) {
		if l["msg"] == "idempotency.store_error" && l["operation"] == "listen" && l["level"] == "error" {
			line = l
		}
	}
	if line == nil {
		t.Errorf("no idempotency.store_error line for the lost listener connection")
	}
	t.Logf("%v", line)
}

// ---------------------------------------------------------------------------
// mismatch_status

func TestMismatchStatus422(t *testing.T) {
	up := newUpstream(t)
	s := protectedSite(t, storeBackend{Name: "memory"}, up.Addr(), "mismatch_status 422")
	c := call{Key: newKey(), Body: payBody()}
	wantExecuted(t, s.Do(t, c), http.StatusCreated)
	p := wantProblem(t, s.Do(t, call{Key: c.Key, Body: payBody()}), http.StatusUnprocessableEntity)
	if !strings.HasSuffix(p.Type, "#key-reused") {
		t.Errorf("type %q, want the key-reused problem", p.Type)
	}
	wantCount(t, up, 1)
}

// ---------------------------------------------------------------------------
// shadow

// In shadow mode nothing is refused, every case that would have been is
// logged and shown in the placeholder, and the records are kept as
// enforcement would have them: turning shadow off replays them.
func TestShadow(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		site := func(shadow string) string {
			return fmt.Sprintf(`http://127.0.0.1:%d {
	header >X-Idem-Result {http.idempotency.result}
	idempotency {
		%s
		max_request_body 100
		%s
	}
	reverse_proxy %s
}
`, port, sb.Block(), shadow, up.Addr())
		}
		srv := startCaddyfile(t, site("shadow"))
		s := newSiteClient(t, srv, port)

		c := call{Key: newKey(), Body: payBody()}
		first := s.Do(t, c)
		inflight := call{Key: newKey(), Body: payBody(), Header: sleepFor(500 * time.Millisecond)}
		ch := runBackground(t, s, inflight)
		up.WaitStarted(t, 2)
		big := bytes.Repeat([]byte("x"), 300)
		for _, tc := range []struct {
			name   string
			c      call
			result string
		}{
			{"would replay", c, "shadow_replayed"},
			{"would conflict", call{Key: c.Key, Body: payBody()}, "shadow_mismatch"},
			{"would be in progress", call{Key: inflight.Key, Body: inflight.Body}, "shadow_in_progress"},
			{"no key", call{Body: payBody()}, "shadow_rejected"},
			{"body too large, chunked", call{Key: newKey(), Body: big, ContentType: "text/plain", Chunked: true}, "shadow_rejected"},
			{"body too large", call{Key: newKey(), Body: big, ContentType: "text/plain"}, "shadow_rejected"},
			{"new key", call{Key: newKey(), Body: payBody()}, "shadow_executed"},
		} {
			r := s.Do(t, tc.c)
			wantExecuted(t, r, http.StatusCreated)
			if got := r.Header.Get("X-Idem-Result"); got != tc.result {
				t.Errorf("%s: result %q, want %q", tc.name, got, tc.result)
			}
			execs := up.Executions()
			if got := execs[len(execs)-1].Body; !bytes.Equal(got, tc.c.Body) {
				t.Errorf("%s: the upstream got %d bytes, want the %d sent", tc.name, len(got), len(tc.c.Body))
			}
		}
		<-ch
		wantCount(t, up, 9)
		would := map[string]bool{}
		for _, l := range srv.moduleLogLines(t) {
			if l["msg"] == "idempotency.shadow" && l["level"] == "info" {
				would[l["would"].(string)] = true
				if l["key"] == "" || l["credential_id"] == "" || l["path"] != "/pay" {
					t.Errorf("idempotency.shadow line lacks fields: %v", l)
				}
			}
		}
		for _, w := range []string{"replayed", "mismatch", "in_progress"} {
			if !would[w] {
				t.Errorf("no idempotency.shadow line with would=%s (got %v)", w, would)
			}
		}

		// Enforcing now: the first response is what the shadow recorded.
		if err := caddy.Load(mustAdapt(t, globalOptions(srv.LogPath, "")+site("")), true); err != nil {
			t.Fatal(err)
		}
		s.reloaded(t)
		replay := s.Do(t, c)
		if got := replay.Header.Get("X-Idem-Result"); got != "replayed" {
			t.Errorf("result %q once enforcing, want replayed", got)
		}
		// The placeholder is set by a header op, outside what is recorded.
		first.Header.Del("X-Idem-Result")
		replay.Header.Del("X-Idem-Result")
		wantReplayOf(t, replay, first)
		wantProblem(t, s.Do(t, call{Key: c.Key, Body: payBody()}), http.StatusConflict)
		wantCount(t, up, 9)
	})
}

// A store that fails does not stop shadow traffic either.
func TestShadowStoreError(t *testing.T) {
	up := newUpstream(t)
	dsn := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?sslmode=disable&connect_timeout=2", freeTCPPort(t))
	port := freeTCPPort(t)
	s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	header >X-Idem-Result {http.idempotency.result}
	idempotency {
		store postgres {
			dsn %q
			migrate off
		}
		shadow
	}
	reverse_proxy %s
}
`, port, dsn, up.Addr()))
	r := s.Do(t, call{Key: newKey(), Body: payBody()})
	wantExecuted(t, r, http.StatusCreated)
	if got := r.Header.Get("X-Idem-Result"); got != "shadow_store_error" {
		t.Errorf("result %q, want shadow_store_error", got)
	}
}

func mustAdapt(t *testing.T, caddyfile string) []byte {
	t.Helper()
	js, _, err := adaptCaddyfile(caddyfile)
	if err != nil {
		t.Fatalf("adapting: %v\n%s", err, caddyfile)
	}
	return js
}

// ---------------------------------------------------------------------------
// on_store_error

// fail_open executes the request, with its body intact, when the store
// is down, and says so; the default fails closed (module_test.go).
func TestFailOpen(t *testing.T) {
	up := newUpstream(t)
	dsn := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?sslmode=disable&connect_timeout=2", freeTCPPort(t))
	port := freeTCPPort(t)
	s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	header >X-Idem-Result {http.idempotency.result}
	idempotency {
		store postgres {
			dsn %q
			migrate off
		}
		on_store_error fail_open
	}
	reverse_proxy %s
}
`, port, dsn, up.Addr()))
	c := call{Key: newKey(), Body: payBody()}
	for i := range 2 {
		r := s.Do(t, c)
		wantExecuted(t, r, http.StatusCreated)
		if got := r.Header.Get("X-Idem-Result"); got != "fail_open" {
			t.Errorf("result %q, want fail_open", got)
		}
		if got := up.Executions()[i].Body; !bytes.Equal(got, c.Body) {
			t.Errorf("the upstream got %q, want %q", got, c.Body)
		}
	}
	wantCount(t, up, 2) // unprotected: the retry executed again
	var failOpen, storeErrors int
	for _, l := range s.moduleLogLines(t) {
		switch l["msg"] {
		case "idempotency.fail_open":
			failOpen++
			if l["level"] != "warn" || l["key"] != c.Key {
				t.Errorf("idempotency.fail_open line: %v", l)
			}
		case "idempotency.store_error":
			storeErrors++
		}
	}
	// A store_error line a second at most: the second request's is left
	// out unless a slow machine sent it a second later.
	if failOpen != 2 || storeErrors < 1 || storeErrors > 2 {
		t.Errorf("%d idempotency.fail_open and %d idempotency.store_error lines, want 2 and 1 or 2", failOpen, storeErrors)
	}
}

// ---------------------------------------------------------------------------
// Configuration

func TestModesCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct {
		name, block string
	}{
		{"mismatch_status 400", "mismatch_status 400"},
		{"mismatch_status twice", "mismatch_status 422\n\t\tmismatch_status 409"},
		{"mismatch_status without argument", "mismatch_status"},
		{"wait not a duration", "wait forever"},
		{"wait negative", "wait -1s"},
		{"wait twice", "wait 1s\n\t\twait 2s"},
		{"shadow with argument", "shadow on"},
		{"on_store_error unknown", "on_store_error ignore"},
		{"on_store_error two arguments", "on_store_error fail_open fail_closed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := fmt.Sprintf("http://127.0.0.1:8080 {\n\tidempotency {\n\t\tstore memory\n\t\t%s\n\t}\n\treverse_proxy 127.0.0.1:9\n}\n", tc.block)
			_, _, err := adaptCaddyfile(cfg)
			if err == nil {
				t.Fatalf("adapting succeeded, want an error for:\n%s", cfg)
			}
			lines := strings.Count(tc.block, "\n") + 4
			if !strings.Contains(err.Error(), fmt.Sprintf("Caddyfile:%d", lines)) {
				t.Errorf("error does not name line %d: %v", lines, err)
			}
		})
	}
}

// The JSON equivalents load, and invalid values are refused at load.
func TestModesJSON(t *testing.T) {
	ok := `{"handler": "idempotency", "wait": "2s", "mismatch_status": 422, "shadow": false, "on_store_error": "fail_open"}`
	if err := loadHandlerJSON(t, ok); err != nil {
		t.Errorf("loading %s: %v", ok, err)
	}
	for _, bad := range []string{
		`{"handler": "idempotency", "mismatch_status": 418}`,
		`{"handler": "idempotency", "on_store_error": "shrug"}`,
		`{"handler": "idempotency", "wait": "-1s"}`,
	} {
		if err := loadHandlerJSON(t, bad); err == nil {
			t.Errorf("loading %s succeeded, want an error", bad)
		}
	}
	var h Handler
	if err := json.Unmarshal([]byte(ok), &h); err != nil || time.Duration(h.Wait) != 2*time.Second ||
		h.MismatchStatus != 422 || h.OnStoreError != "fail_open" {
		t.Errorf("unmarshalling %s: %+v, %v", ok, h, err)
	}
}

// loadHandlerJSON loads (and stops) a JSON config whose one route runs
// handler, and returns the load's error: how a JSON config's Validate is
// seen.
func loadHandlerJSON(t *testing.T, handler string) error {
	cfg := fmt.Sprintf(`{
"admin": {"disabled": true},
"logging": {"logs": {"default": {"writer": {"output": "discard"}}}},
"apps": {"http": {"servers": {"srv0": {
	"listen": ["127.0.0.1:%d"],
	"routes": [{"handle": [%s, {"handler": "static_response", "body": "ok"}]}]
}}}}
}`, freeTCPPort(t), handler)
	caddyMu.Lock()
	defer caddyMu.Unlock()
	err := caddy.Load([]byte(cfg), true)
	if err == nil {
		_ = caddy.Stop()
	}
	return err
}
