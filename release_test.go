package idempotency

// When a key may be released: only when no request can have reached an
// upstream. A release lets the retry execute; wrongly given, it executes
// a request a second time.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// handle_response's `error` answers after the upstream acted: a 402 from
// it is no proof that nothing ran. Catches releasing on any 4xx handler
// error (three identical POSTs were three executions).
func TestHandleResponseErrorIsNotReleased(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
	}
	reverse_proxy %s {
		@declined status 402
		handle_response @declined {
			error "payment declined" 402
		}
	}
}
`, port, sb.Block(), up.Addr()))
		c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Status": "402"}}
		first := s.Do(t, c)
		if first.replayed() {
			t.Fatalf("first: %s, a replay", first)
		}
		for i := range 2 {
			if r := s.Do(t, c); !r.replayed() {
				t.Errorf("retry %d after the upstream declined: %s, want the stored answer replayed", i+1, r)
			}
		}
		wantCount(t, up, 1)
	})
}

// With lb_retries (and a retry_match that lets POST be retried), an
// attempt that reached an upstream, then a dial error on the next one:
// the error is a dial error, but the first attempt may have executed.
func TestDialErrorAfterAnAttemptThatReachedIsNotReleased(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		dead := fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
		// lb_policy first and max_fails 1: the first attempt goes to the
		// live upstream, which marks itself down by failing; the second
		// to the dead port. After fail_duration the live one is first
		// again, for a retry that a release would let execute.
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
	}
	reverse_proxy %s %s {
		lb_policy first
		lb_retries 1
		lb_retry_match {
			method POST
		}
		fail_duration 1s
		max_fails 1
	}
}
`, port, sb.Block(), up.Addr(), dead))
		c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Crash": "1"}}
		if r := s.Do(t, c); r.Status < 500 {
			t.Fatalf("first: %s, want a 5xx", r)
		}
		wantCount(t, up, 1)
		time.Sleep(1200 * time.Millisecond) // past fail_duration
		if r := s.Do(t, c); !r.replayed() {
			t.Errorf("retry after an attempt that reached the upstream: %s, want the stored answer replayed", r)
		}
		wantCount(t, up, 1)
	})
}

// A dial error on an upstream nothing was sent to releases the key: the
// retry executes once the upstream is up.
func TestDialErrorReleasesAndRetryExecutes(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		addr := fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
		s := protectedSite(t, sb, addr)
		c := call{Key: newKey(), Body: payBody()}
		if r := s.Do(t, c); r.Status != http.StatusBadGateway || r.replayed() {
			t.Fatalf("first, upstream down: %s, want a fresh 502", r)
		}
		up := newUpstreamAt(t, addr)
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, c), first)
		wantCount(t, up, 1)
	})
}

// A handler that refuses the request before any upstream is tried (a
// static error, a rate limit) releases the key: the retry executes.
func TestStaticErrorBeforeProxyReleases(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
	}
	route {
		error @busy "slow down" 429
		reverse_proxy %s
	}
	@busy header X-Busy 1
}
`, port, sb.Block(), up.Addr()))
		c := call{Key: newKey(), Body: payBody()}
		busy := c
		busy.Header = map[string]string{"X-Busy": "1"}
		if r := s.Do(t, busy); r.Status != http.StatusTooManyRequests || r.replayed() {
			t.Fatalf("refused: %s, want a fresh 429", r)
		}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, c), first)
		wantCount(t, up, 1)
	})
}

// failingRelease is a store whose releases fail.
type failingRelease struct{ store.Store }

func (failingRelease) Release(context.Context, store.RecordKey, store.LockToken) error {
	return errors.New("store down")
}

// A release that the store refused leaves the record in progress: the
// result says store_error, not released. The request is answered all the
// same, not handed to the error routes.
func TestFailedReleaseResultIsStoreError(t *testing.T) {
	h, _, _ := lockHandler(t, 30*time.Second)
	h.store = failingRelease{h.store}
	repl := caddy.NewReplacer()
	r := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader(`{"amount":1}`))
	r.Header.Set("Idempotency-Key", "failed-release-"+runID)
	r.Header.Set("Authorization", defaultCred)
	r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
	dialErr := dialError(t)
	var calls atomic.Int32
	undialable := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		calls.Add(1)
		return caddyhttp.Error(http.StatusBadGateway, dialErr)
	})
	w := httptest.NewRecorder()
	if err := h.ServeHTTP(w, r, undialable); err != nil {
		t.Fatalf("the dial error was returned (%v): Caddy's error routes would run on the request", err)
	}
	if w.Code != http.StatusBadGateway || !strings.Contains(w.Body.String(), "#not-executed") {
		t.Errorf("answer %d %q, want the 502 #not-executed problem", w.Code, w.Body)
	}
	if got, _ := repl.GetString("http.idempotency.result"); got != resultStoreError {
		t.Errorf("result %q after a failed release, want %q", got, resultStoreError)
	}
}

// dialError is the error reverse_proxy's transport gives for an upstream
// that refuses connections: a real one, since Caddy before v2.11.8 has no
// way to make one outside its package.
func dialError(t *testing.T) error {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	tr := new(reverseproxy.HTTPTransport)
	if err := tr.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	defer tr.Cleanup()
	r, err := http.NewRequest(http.MethodPost, fmt.Sprintf("http://127.0.0.1:%d/", freeTCPPort(t)), nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = tr.RoundTrip(r)
	if !errors.As(err, new(reverseproxy.DialError)) {
		t.Fatalf("dialing a closed port: %v, not a dial error", err)
	}
	return err
}

// Nothing can have executed when the upstream cannot be dialled: the key
// is released and the retry executes (here: fails to dial again) instead
// of getting a 409 or a replayed 502.
func TestUndialableUpstreamReleasesKey(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		s := protectedSite(t, sb, "") // reverse_proxy to a closed port
		c := call{Key: newKey(), Body: payBody()}
		for i := range 3 {
			r := s.Do(t, c)
			if r.Status != http.StatusBadGateway || r.replayed() {
				t.Fatalf("attempt %d: got %s, want a fresh 502", i+1, r)
			}
		}
		if sb.Name == "postgres" {
			if n := pgCount(t, sb); n != 0 {
				t.Errorf("%d rows remain after released attempts, want 0: %v", n,
					pgtest.Query(t, sb.DSN, "SELECT t::text FROM "+pgtest.QuoteIdent(sb.Table)+" t"))
			}
		}
	})
}

// The upstream received the request and then died: it may have executed,
// so the key must not be released. Catches releasing on every error.
func TestUpstreamThatMayHaveExecutedIsNotReleased(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		for _, tc := range []struct {
			name  string
			warm  bool // an earlier request leaves a keep-alive connection: the crash is on a reused one
			empty bool // an empty body (POST /orders/1/cancel)
		}{
			{"fresh connection", false, false},
			{"reused connection", true, false},
			{"reused connection, empty body", true, true},
		} {
			warm := tc.warm
			t.Run(tc.name, func(t *testing.T) {
				up := newUpstream(t)
				s := protectedSite(t, sb, up.Addr())
				if warm {
					wantExecuted(t, s.Do(t, call{Key: newKey(), Body: payBody()}), http.StatusCreated)
				}
				n := up.Count()
				c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Crash": "1"}}
				if tc.empty {
					c.Body = nil
				}
				first := s.Do(t, c)
				if first.Status < 500 {
					t.Fatalf("first: got %s, want a 5xx", first)
				}
				if got := up.Count(); got != n+1 {
					t.Errorf("one client request reached the upstream %d times", got-n)
				}
				second := s.Do(t, c)
				if second.Status < 400 {
					t.Errorf("retry after a possible execution: got %s, want an error, not a success", second)
				}
				wantCount(t, up, n+1)
			})
		}
	})
}
