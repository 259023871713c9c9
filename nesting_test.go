package idempotency

// Several idempotency handlers on one request (docs/guarantees.md,
// "Several handlers on one request"): nested, or at one level with
// overlapping matchers. A handler that does not enforce never makes
// another stand down, and none turns off a protection the configuration
// wrote.

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// The rollout that docs/modes.md describes: shadow on the site, already
// enforcing on one route. Shadow records the first request and passes
// the retries through; the handler inside must replay them. The inner
// handler stood down for any request that the shadow one had seen, and
// all three executed.
func TestShadowOutsideEnforcingHandler(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%[2]s
		shadow
	}
	route /pay* {
		idempotency {
			%[2]s
		}
		reverse_proxy %[3]s
	}
}
`, port, sb.Block(), up.Addr()))
		c := call{Key: newKey(), Body: payBody()}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		for range 2 {
			wantReplayOf(t, s.Do(t, c), first)
		}
		wantCount(t, up, 1)
		if got := up.Executions()[0].Key; got != c.Key {
			t.Errorf("upstream got key %q, want %q", got, c.Key)
		}
		// A request that shadow would refuse (the key reused with
		// another body) goes through it, and the inner handler refuses it.
		c.Body = payBody()
		wantProblem(t, s.Do(t, c), http.StatusConflict)
		wantCount(t, up, 1)
	})
}

// fail_open outside an enforcing handler with a store of its own: while
// the outer store is down, the inner handler still protects the route.
func TestFailOpenOutsideEnforcingHandler(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		down := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?sslmode=disable&connect_timeout=2", freeTCPPort(t))
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store postgres {
			dsn %q
			migrate off
		}
		on_store_error fail_open
	}
	route /pay* {
		idempotency {
			%s
		}
		reverse_proxy %s
	}
}
`, port, down, sb.Block(), up.Addr()))
		c := call{Key: newKey(), Body: payBody()}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		for range 2 {
			wantReplayOf(t, s.Do(t, c), first)
		}
		wantCount(t, up, 1)
	})
}

// optional outside: a request without the outer handler's key passes it
// unprotected, and the handler inside enforces by its own key.
func TestOptionalOutsideEnforcingHandler(t *testing.T) {
	for _, shadow := range []string{"", "shadow"} {
		t.Run("outer "+strings.TrimSpace("optional "+shadow), func(t *testing.T) {
			eachStore(t, func(t *testing.T, sb storeBackend) {
				up := newUpstream(t)
				port := freeTCPPort(t)
				s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%[2]s
		optional
		%[3]s
	}
	route /pay* {
		idempotency {
			%[2]s
			key_header X-Request-Id
		}
		reverse_proxy %[4]s
	}
}
`, port, sb.Block(), shadow, up.Addr()))
				c := call{Header: map[string]string{"X-Request-Id": newKey()}, Body: payBody()}
				first := s.Do(t, c)
				wantExecuted(t, first, http.StatusCreated)
				for range 2 {
					wantReplayOf(t, s.Do(t, c), first)
				}
				wantCount(t, up, 1)
			})
		})
	}
}

// Two handlers at one level whose matchers overlap: Caddy runs the one
// with the longer path first, whatever the written order (and a route
// keeps the written order). Each protects the request by its own key:
// the same Idempotency-Key, or the same X-Request-Id, never executes
// twice. The /v1/charges* handler stood down when it ran first, and two
// X-Request-Id values with one Idempotency-Key executed twice.
func TestOverlappingHandlersEachEnforce(t *testing.T) {
	broad := "idempotency /v1/* {\n\t\t%[1]s\n\t\toptional\n\t}"
	narrow := "idempotency /v1/charges* {\n\t\t%[1]s\n\t\tkey_header X-Request-Id\n\t}"
	for _, tc := range []struct{ name, handlers string }{
		{"broad written first", broad + "\n\t" + narrow + "\n\treverse_proxy %[2]s"},
		{"narrow written first", narrow + "\n\t" + broad + "\n\treverse_proxy %[2]s"},
		{"route, broad first", "route {\n\t" + broad + "\n\t" + narrow + "\n\treverse_proxy %[2]s\n\t}"},
		{"route, narrow first", "route {\n\t" + narrow + "\n\t" + broad + "\n\treverse_proxy %[2]s\n\t}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eachStore(t, func(t *testing.T, sb storeBackend) {
				up := newUpstream(t)
				port := freeTCPPort(t)
				s := siteFromCaddyfile(t, port, fmt.Sprintf("http://127.0.0.1:%d {\n\t", port)+
					fmt.Sprintf(tc.handlers, sb.Block(), up.Addr())+"\n}\n")
				charge := func(key, requestID string, body []byte) call {
					return call{Path: "/v1/charges", Key: key, Body: body,
						Header: map[string]string{"X-Request-Id": requestID}}
				}

				key, body := newKey(), payBody()
				first := s.Do(t, charge(key, newKey(), body))
				wantExecuted(t, first, http.StatusCreated)
				wantReplayOf(t, s.Do(t, charge(key, newKey(), body)), first)
				wantCount(t, up, 1)

				requestID, body := newKey(), payBody()
				second := s.Do(t, charge(newKey(), requestID, body))
				wantExecuted(t, second, http.StatusCreated)
				wantReplayOf(t, s.Do(t, charge(newKey(), requestID, body)), second)
				wantCount(t, up, 2)
			})
		})
	}
}

// A handler inside another refuses a request that the outer one owns
// (here: its key is still in progress): nothing executed, so the outer
// one releases its record rather than store the refusal, and the retry,
// once the first request is done, gets its response. Stored, the 409
// would have been replayed for the outer key's whole retention.
func TestNestedRefusalReleasesOuterRecord(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%[2]s
		key_header X-Request-Id
	}
	route /pay* {
		idempotency {
			%[2]s
		}
		reverse_proxy %[3]s {
			flush_interval -1
		}
	}
}
`, port, sb.Block(), up.Addr()))
		key, body := newKey(), payBody()
		held := call{Key: key, Body: body, Header: map[string]string{"X-Request-Id": newKey(), "X-Test-Gate": "g"}}
		done := make(chan reply, 1)
		go func() {
			r, err := s.DoCtx(context.Background(), held)
			if err != nil {
				t.Errorf("held request: %v", err)
			}
			done <- r
		}()
		up.WaitStarted(t, 1)

		retry := call{Key: key, Body: body, Header: map[string]string{"X-Request-Id": newKey(), "X-Test-Gate": "g"}}
		wantProblem(t, s.Do(t, retry), http.StatusConflict)
		up.Open("g")
		first := <-done
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, retry), first)
		wantCount(t, up, 1)
	})
}

// A request that two handlers protect is counted once, by its final
// result, as a request through one handler is: by the outermost one.
// Each handler counted it.
func TestNestedHandlersCountARequestOnce(t *testing.T) {
	up := newUpstream(t)
	port, admin := freeTCPPort(t), fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
	srv := startCaddyfileAdmin(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		shadow
	}
	route /pay* {
		idempotency {
			key_header X-Request-Id
		}
		idempotency
		reverse_proxy %s
	}
}
`, port, up.Addr()), admin)
	s := newSiteClient(t, srv, port)
	before := scrapeMetrics(t, admin)
	c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Request-Id": newKey()}}
	wantExecuted(t, s.Do(t, c), http.StatusCreated)
	c.Header["X-Request-Id"] = newKey()
	s.Do(t, c)
	after := scrapeMetrics(t, admin)
	for result, want := range map[string]float64{"executed": 1, "replayed": 1, "shadow_executed": 0, "shadow_replayed": 0} {
		name := "caddy_idempotency_requests_total"
		if got := after.value(name, "result", result) - before.value(name, "result", result); got != want {
			t.Errorf("%s{result=%q} grew by %v, want %v", name, result, got, want)
		}
	}
}
