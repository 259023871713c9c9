package idempotency

// End-to-end tests of the contract (/CONTRACT.md) through a real Caddy and
// a real Postgres. Store-neutral tests run once per store, as the subtests
// "memory" and "postgres". The harness is in harness_test.go.

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

func TestReplayIsByteForByte(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Extra": "1"}}

		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		if len(first.Header.Values("Set-Cookie")) != 2 {
			t.Errorf("the first caller must get the upstream's Set-Cookie: %v", first.Header)
		}
		for i := range 2 {
			replay := s.Do(t, c)
			wantReplayOf(t, replay, first)
			if i == 1 {
				// A wrong implementation that stores the replay markers would send them twice.
				wantReplayOf(t, replay, first)
			}
		}
		wantCount(t, up, 1)
	})
}

func TestSameKeyDifferentRequestConflicts(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		for _, tc := range []struct {
			name   string
			change func(c call) call
		}{
			{"other body", func(c call) call { c.Body = []byte(`{"amount":2000,"currency":"eur"}`); return c }},
			{"other path", func(c call) call { c.Path = "/refund"; return c }},
			{"other query", func(c call) call { c.Path = "/pay?x=1"; return c }},
			{"other method", func(c call) call { c.Method = http.MethodPatch; return c }},
		} {
			t.Run(tc.name, func(t *testing.T) {
				before := up.Count()
				orig := call{Key: newKey(), Body: []byte(`{"amount":1000,"currency":"eur"}`)}
				first := s.Do(t, orig)
				wantExecuted(t, first, http.StatusCreated)
				p := wantProblem(t, s.Do(t, tc.change(orig)), http.StatusConflict)
				if !strings.Contains(strings.ToLower(p.Detail), "key") {
					t.Errorf("detail should tell the caller to use a new key: %q", p.Detail)
				}
				// The conflict must not disturb the stored record.
				wantReplayOf(t, s.Do(t, orig), first)
				wantCount(t, up, before+1)
			})
		}
	})
}

func TestJSONFingerprintIsCanonical(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		for _, tc := range []struct {
			name        string
			ctype       string
			first, then string
			replay      bool // else 409
		}{
			{"key order", "application/json", `{"a":1,"b":2}`, `{ "b": 2, "a": 1 }`, true},
			{"whitespace", "application/json", `{"a":[1,2],"b":{"c":"d"}}`, "{\n\t\"a\" : [ 1 , 2 ],\r\n \"b\":{ \"c\" :\"d\"}\n}\n", true},
			{"nested key order", "application/json; charset=utf-8", `{"o":{"x":1,"y":{"q":1,"p":2}}}`, `{"o":{"y":{"p":2,"q":1},"x":1}}`, true},
			{"+json media type", "application/merge-patch+json", `{"a":1,"b":2}`, `{"b":2,"a":1}`, true},
			// Catches parsing numbers into float64: these are equal as floats.
			{"numbers kept exactly (1 vs 1.0)", "application/json", `{"a":1}`, `{"a":1.0}`, false},
			{"numbers kept exactly (big ints)", "application/json", `{"a":100000000000000001}`, `{"a":100000000000000000}`, false},
			{"array order matters", "application/json", `{"a":[1,2]}`, `{"a":[2,1]}`, false},
			{"string whitespace kept", "application/json", `{"a":"x y"}`, `{"a":"x  y"}`, false},
			// Catches canonicalising every body: only JSON media types are.
			{"non-JSON media type is raw", "text/plain", `{"a":1,"b":2}`, `{"b":2,"a":1}`, false},
			{"invalid JSON is raw", "application/json", `{"a":1,`, `{"a": 1,`, false},
		} {
			t.Run(tc.name, func(t *testing.T) {
				key := newKey()
				first := s.Do(t, call{Key: key, Body: []byte(tc.first), ContentType: tc.ctype})
				wantExecuted(t, first, http.StatusCreated)
				second := s.Do(t, call{Key: key, Body: []byte(tc.then), ContentType: tc.ctype})
				if tc.replay {
					wantReplayOf(t, second, first)
				} else {
					wantProblem(t, second, http.StatusConflict)
				}
			})
		}
	})
}

func TestConcurrentSameKeyExecutesOnce(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		const n = 25
		c := call{Key: newKey(), Body: payBody(), Header: sleepFor(300 * time.Millisecond)}
		replies := make([]reply, n)
		errs := make([]error, n)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				replies[i], errs[i] = s.DoCtx(context.Background(), c)
			}()
		}
		close(start)
		wg.Wait()

		var okBody []byte
		executed, replayed, inProgress := 0, 0, 0
		for i, r := range replies {
			if errs[i] != nil {
				t.Fatalf("request %d: %v", i, errs[i])
			}
			switch {
			case r.Status == http.StatusCreated:
				if r.replayed() {
					replayed++
				} else {
					executed++
				}
				if okBody == nil {
					okBody = r.Body
				} else if !bytes.Equal(r.Body, okBody) {
					t.Errorf("2xx bodies differ: %q vs %q", r.Body, okBody)
				}
			case r.Status == http.StatusConflict:
				inProgress++
				wantProblem(t, r, http.StatusConflict)
				wantRetryAfter(t, r)
			default:
				t.Errorf("request %d: unexpected reply %s", i, r)
			}
		}
		t.Logf("executed %d, replayed %d, in progress %d", executed, replayed, inProgress)
		if executed != 1 {
			t.Errorf("%d callers got a fresh execution, want exactly 1", executed)
		}
		wantCount(t, up, 1)
		last := s.Do(t, call{Key: c.Key, Body: c.Body})
		if !last.replayed() || !bytes.Equal(last.Body, okBody) {
			t.Errorf("after the race, a retry must replay the one execution: %s", last)
		}
	})
}

func TestInProgressConflictHasRetryAfter(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		for _, tc := range []struct {
			name      string
			directive string
			want      string
		}{
			{"default 2s", "", "2"},
			{"retry_after 5s", "retry_after 5s", "5"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				up := newUpstream(t)
				s := protectedSite(t, sb, up.Addr(), tc.directive)
				c := call{Key: newKey(), Body: payBody(), Header: sleepFor(700 * time.Millisecond)}
				firstCh := runBackground(t, s, c)
				up.WaitStarted(t, 1)

				second := s.Do(t, call{Key: c.Key, Body: c.Body})
				wantProblem(t, second, http.StatusConflict)
				if got := second.Header.Get("Retry-After"); got != tc.want {
					t.Errorf("Retry-After = %q, want %q", got, tc.want)
				}

				first := <-firstCh
				wantExecuted(t, first, http.StatusCreated)
				wantReplayOf(t, s.Do(t, call{Key: c.Key, Body: c.Body}), first)
				wantCount(t, up, 1)
			})
		}
	})
}

// An owner that died leaves an in_progress record whose lock goes stale;
// of many concurrent retries exactly one takes it over (a compare-and-swap)
// and executes. Postgres only: a dead owner is simulated by writing the
// record as a crashed instance would leave it, which the memory store
// cannot be made to hold from outside (memory_test.go covers its takeover).
// Catches a takeover by read-then-write, which lets several retriers in.
func TestStaleLockIsTakenOverByOneRetrier(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	// The record is turned back into a dead owner's behind the handler's
	// back; its replay cache would still replay the completed one. The
	// lock_timeout outlasts the takeover's execution (300ms), so that
	// the new owner needs no renewal: on a loaded machine, a renewal due
	// 100ms into a 300ms lock could land too late and let a second
	// retrier take over, which is the lease's documented limit, not what
	// this test is about.
	s := protectedSite(t, sb, up.Addr(), "lock_timeout 1s", "replay_cache off")
	c := call{Key: newKey(), Body: payBody()}
	dead := s.Do(t, c) // a real record, with the real fingerprint
	wantExecuted(t, dead, http.StatusCreated)
	n := pgExec(t, sb.DSN, `UPDATE `+quoteIdent(sb.Table)+` SET status = 'in_progress',
		lock_token = $1, locked_at = now() - interval '1 hour',
		response_status = NULL, response_headers = NULL, response_body = NULL,
		replayable = NULL, response_size = NULL
		WHERE key = $2`, bytes.Repeat([]byte{0xde}, 16), c.Key)
	if n != 1 {
		t.Fatalf("updated %d rows, want 1", n)
	}

	const retriers = 10
	replies := make([]reply, retriers)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range retriers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			replies[i] = s.Do(t, call{Key: c.Key, Body: c.Body, Header: sleepFor(300 * time.Millisecond)})
		}()
	}
	close(start)
	wg.Wait()

	var owner reply
	takeovers := 0
	for _, r := range replies {
		switch {
		case r.Status == http.StatusCreated && !r.replayed():
			takeovers++
			owner = r
		case r.Status == http.StatusConflict:
			wantRetryAfter(t, r)
		case r.Status == http.StatusCreated && r.replayed():
		default:
			t.Errorf("unexpected reply %s", r)
		}
	}
	if takeovers != 1 {
		t.Fatalf("%d retriers executed, want exactly 1", takeovers)
	}
	for _, r := range replies {
		if r.replayed() && !bytes.Equal(r.Body, owner.Body) {
			t.Errorf("a replay differs from the takeover's response")
		}
	}
	wantCount(t, up, 2)
	wantReplayOf(t, s.Do(t, c), owner)
	rows := pgQuery(t, sb.DSN, `SELECT status, lock_token IS NULL FROM `+quoteIdent(sb.Table))
	if len(rows) != 1 || rows[0][0] != "completed" || rows[0][1] != "true" {
		t.Errorf("after the takeover the row is %v, want one completed row without a lock", rows)
	}
}

// A live owner renews its lock: a retry sent after lock_timeout, while the
// first request still runs, is not a takeover. Catches a lock that is only
// taken at the start and never renewed.
func TestSlowRequestIsNotTakenOver(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		// A 1s lock rather than a shorter one: on a loaded 2-core machine a
		// renewal can wait longer than a 300ms lock's margin for a pool
		// connection (docs/guarantees.md), which is not what this test is about.
		s := protectedSite(t, sb, up.Addr(), "lock_timeout 1s")
		// 1.5s past the last retry, for the retry to be answered while
		// the first request still runs on a loaded machine.
		c := call{Key: newKey(), Body: payBody(), Header: sleepFor(4500 * time.Millisecond)}
		firstCh := runBackground(t, s, c)
		up.WaitStarted(t, 1)
		start := time.Now()
		for _, at := range []time.Duration{1300 * time.Millisecond, 2000 * time.Millisecond, 3000 * time.Millisecond} {
			time.Sleep(time.Until(start.Add(at)))
			r := s.Do(t, call{Key: c.Key, Body: c.Body})
			if r.Status != http.StatusConflict {
				t.Errorf("retry at %v past lock_timeout: got %s, want 409 in progress", at, r)
				continue
			}
			wantRetryAfter(t, r)
		}
		first := <-firstCh
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, call{Key: c.Key, Body: c.Body}), first)
		wantCount(t, up, 1)
	})
}

// The flaky-wifi case: the client goes away mid-request; the upstream runs
// on to completion and the client's retry gets a replay. Catches an
// upstream request bound to the client's context.
func TestClientDisconnectStillCompletes(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "lock_timeout 1s", "execution_timeout 10s")
		c := call{Key: newKey(), Body: payBody(), Header: sleepFor(700 * time.Millisecond)}

		ctx, cancel := context.WithCancel(context.Background())
		errCh := make(chan error, 1)
		go func() {
			_, err := s.DoCtx(ctx, c)
			errCh <- err
		}()
		up.WaitStarted(t, 1)
		time.Sleep(50 * time.Millisecond)
		cancel()
		if err := <-errCh; err == nil {
			t.Fatalf("the cancelled request succeeded; the test did not disconnect")
		}

		up.WaitEnded(t, 1)
		e := up.Executions()[0]
		if !e.Finished || e.Cancelled {
			t.Fatalf("the upstream's work was cancelled when the client disconnected (finished=%v cancelled=%v)", e.Finished, e.Cancelled)
		}

		r := pollPastInProgress(t, s, call{Key: c.Key, Body: c.Body})
		if !r.replayed() || r.Status != http.StatusCreated || r.Header.Get("X-Execution-Id") != e.ID {
			t.Errorf("retry after a disconnect: got %s, want a replay of execution %s", r, e.ID)
		}
		wantCount(t, up, 1)
	})
}

// A config reload while a disconnected client's request still runs: the
// old config's store is cleaned up under the detached work, which must
// still store its response so that the retry is a replay. Catches a store
// whose Cleanup pulls the pool from under in-flight requests (the retry
// then finds a stale lock and executes a second time).
func TestReloadDuringDetachedExecution(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		logPath := t.TempDir() + "/caddy.log"
		cfg := func(extra string) []byte {
			js, _, err := adaptCaddyfile(globalOptions(logPath, "") + fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		lock_timeout 1s
		%s
	}
	reverse_proxy %s
}
`, port, sb.Block(), extra, up.Addr()))
			if err != nil {
				t.Fatal(err)
			}
			return js
		}
		srv := startCaddyJSON(t, cfg(""), logPath)
		s := newSiteClient(t, srv, port)
		c := call{Key: newKey(), Body: payBody(), Header: sleepFor(800 * time.Millisecond)}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, _ = s.DoCtx(ctx, c)
		}()
		up.WaitStarted(t, 1)
		time.Sleep(50 * time.Millisecond)
		cancel()
		<-done
		if err := caddy.Load(cfg("retry_after 1s"), true); err != nil { // caddyMu is held by this test
			t.Fatalf("reload: %v", err)
		}
		s.reloaded(t)
		up.WaitEnded(t, 1)
		e := up.Executions()[0]
		if !e.Finished {
			t.Fatalf("the detached work did not finish across the reload")
		}
		time.Sleep(400 * time.Millisecond) // past lock_timeout: a stuck lock would now be taken over
		r := pollPastInProgress(t, s, call{Key: c.Key, Body: c.Body})
		if !r.replayed() || r.Header.Get("X-Execution-Id") != e.ID {
			t.Errorf("retry after a reload during the detached work: got %s, want a replay of execution %s", r, e.ID)
		}
		wantCount(t, up, 1)
	})
}

// The detached work is bounded, and what the cut-off execution stores is
// the outcome-unknown problem. Catches context.WithoutCancel without a
// timeout, and a stored empty 499.
func TestExecutionTimeoutBoundsDetachedWork(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "execution_timeout 1s")
		c := call{Key: newKey(), Body: payBody(), Header: sleepFor(10 * time.Second)}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, _ = s.DoCtx(ctx, c)
		}()
		up.WaitStarted(t, 1)
		time.Sleep(50 * time.Millisecond)
		cancel()
		<-done
		up.WaitEnded(t, 1)
		e := up.Executions()[0]
		if !e.Cancelled {
			t.Fatalf("the upstream ran to its end although execution_timeout is 1s")
		}
		// Far from the 10s the work would run unbounded, with room for
		// a loaded machine.
		if took := e.Ended.Sub(e.Started); took > 5*time.Second {
			t.Errorf("the detached work ran %v, want about 1.05s (execution_timeout 1s)", took)
		}
		// reverse_proxy writes a bare 499 when it is cancelled: the retry
		// must get the stored outcome-unknown problem, not an empty 499,
		// and must not run the work a second time.
		r := pollPastInProgress(t, s, call{Key: c.Key, Body: c.Body})
		wantReplayedProblem(t, r, http.StatusBadGateway, "outcome-unknown")
		wantCount(t, up, 1)
	})
}

func TestQuotedKeyIsTheSameKey(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		for _, tc := range []struct{ name, first, then string }{
			{"bare then quoted", "abcdefgh-1234", `"abcdefgh-1234"`},
			{"quoted then bare", `"ijklmnop-5678"`, "ijklmnop-5678"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				before := up.Count()
				body := payBody()
				first := s.Do(t, call{Key: tc.first, Body: body})
				wantExecuted(t, first, http.StatusCreated)
				wantReplayOf(t, s.Do(t, call{Key: tc.then, Body: body}), first)
				wantProblem(t, s.Do(t, call{Key: tc.then, Body: payBody()}), http.StatusConflict)
				wantCount(t, up, before+1)
			})
		}
	})
}

// Records are scoped by (credential, key). Catches scoping by key alone.
func TestTenantsAreIsolated(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		for _, tc := range []struct {
			name       string
			directives []string
			credHeader string
			credA      string
			credB      string
		}{
			{"Authorization", nil, "", "Bearer tenant-a", "Bearer tenant-b"},
			{"credential_header", []string{"credential_header X-Api-Key"}, "X-Api-Key", "key-a", "key-b"},
			{"credential placeholder", []string{"credential {http.request.header.X-User}"}, "X-User", "user-a", "user-b"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				up := newUpstream(t)
				s := protectedSite(t, sb, up.Addr(), tc.directives...)
				key := newKey()
				a := call{Key: key, Cred: tc.credA, CredHeader: tc.credHeader, Body: []byte(`{"amount":1}`)}
				b := call{Key: key, Cred: tc.credB, CredHeader: tc.credHeader, Body: []byte(`{"amount":2}`)}

				ra := s.Do(t, a)
				wantExecuted(t, ra, http.StatusCreated)
				rb := s.Do(t, b) // another body under the same key: another tenant's request, not a 409
				wantExecuted(t, rb, http.StatusCreated)
				if ra.Header.Get("X-Execution-Id") == rb.Header.Get("X-Execution-Id") {
					t.Fatalf("tenant B got tenant A's response")
				}
				wantReplayOf(t, s.Do(t, a), ra)
				wantReplayOf(t, s.Do(t, b), rb)
				wantCount(t, up, 2)

				if tc.credHeader != "" {
					// The configured source is the only credential: Authorization alone is not one.
					missing := s.Do(t, call{Key: newKey(), Body: payBody(), Cred: "Bearer x"})
					wantProblem(t, missing, http.StatusUnauthorized)
				}
			})
		}
	})
}

func TestRejectedRequestsReachNothing(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "max_request_body 1024")
		big := bytes.Repeat([]byte("x"), 1025)
		for _, tc := range []struct {
			name   string
			c      call
			status int
		}{
			{"missing key", call{Body: payBody()}, http.StatusBadRequest},
			{"missing key, upgrade headers", call{Body: payBody(), Header: map[string]string{"Connection": "Upgrade", "Upgrade": "websocket"}}, http.StatusBadRequest},
			{"key of 7 bytes", call{Key: "abcdefg", Body: payBody()}, http.StatusBadRequest},
			{"key of 256 bytes", call{Key: strings.Repeat("k", 256), Body: payBody()}, http.StatusBadRequest},
			{"key with a tab", call{Key: "abcd\tefgh", Body: payBody()}, http.StatusBadRequest},
			{"key with a non-ASCII byte", call{Key: "abcdefgh\xe9", Body: payBody()}, http.StatusBadRequest},
			{"quoted key of 7 bytes", call{Key: `"abcdefg"`, Body: payBody()}, http.StatusBadRequest},
			{"missing credential", call{Key: newKey(), Cred: noCred, Body: payBody()}, http.StatusUnauthorized},
			{"empty credential", call{Key: newKey(), Cred: " ", Body: payBody()}, http.StatusUnauthorized},
			{"body over max_request_body", call{Key: newKey(), Body: big, ContentType: "text/plain"}, http.StatusRequestEntityTooLarge},
			{"chunked body over max_request_body", call{Key: newKey(), Body: big, ContentType: "text/plain", Chunked: true}, http.StatusRequestEntityTooLarge},
		} {
			t.Run(tc.name, func(t *testing.T) {
				wantProblem(t, s.Do(t, tc.c), tc.status)
			})
		}
		wantCount(t, up, 0)
	})
}

// Catches off-by-one limits: the boundaries themselves are valid.
func TestLimitsAreInclusive(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "max_request_body 1024")
		exact := bytes.Repeat([]byte("y"), 1024)
		for _, tc := range []struct {
			name string
			c    call
		}{
			{"key of 8 bytes", call{Key: "k" + randomHex(3) + "z", Body: payBody()}},
			{"key of 255 bytes", call{Key: randomHex(4) + strings.Repeat("k", 247), Body: payBody()}},
			{"key with spaces and punctuation", call{Key: "pay ~!@#$%^&*()_+ " + randomHex(4), Body: payBody()}},
			{"body of exactly max_request_body", call{Key: newKey(), Body: exact, ContentType: "text/plain"}},
			{"chunked body of exactly max_request_body", call{Key: newKey(), Body: exact, ContentType: "text/plain", Chunked: true}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				first := s.Do(t, tc.c)
				wantExecuted(t, first, http.StatusCreated)
				wantReplayOf(t, s.Do(t, tc.c), first)
			})
		}
		wantCount(t, up, 5)
		for _, e := range up.Executions()[3:] {
			if !bytes.Equal(e.Body, exact) {
				t.Errorf("upstream got %d bytes, want the 1024 sent", len(e.Body))
			}
		}
	})
}

func TestOptionalLetsKeylessRequestsThrough(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "optional")
		body := payBody()
		for range 2 {
			wantExecuted(t, s.Do(t, call{Body: body}), http.StatusCreated)
		}
		wantCount(t, up, 2)
		// Unprotected means untouched: no credential is demanded either.
		wantExecuted(t, s.Do(t, call{Body: body, Cred: noCred}), http.StatusCreated)
		// A request that does carry a key is still protected.
		c := call{Key: newKey(), Body: body}
		first := s.Do(t, c)
		wantReplayOf(t, s.Do(t, c), first)
		wantProblem(t, s.Do(t, call{Key: "short"}), http.StatusBadRequest)
		wantCount(t, up, 4)
	})
}

func TestUnprotectedMethodsPassThrough(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		t.Run("defaults", func(t *testing.T) {
			up := newUpstream(t)
			s := protectedSite(t, sb, up.Addr())
			for _, m := range []string{http.MethodGet, http.MethodPut, http.MethodDelete} {
				for _, c := range []call{
					{Method: m, Cred: noCred},
					{Method: m, Key: "fixed-key-1234"}, // a key on an unprotected method is not recorded
				} {
					for range 2 {
						wantExecuted(t, s.Do(t, c), http.StatusCreated)
					}
				}
			}
			wantCount(t, up, 12)
		})
		t.Run("methods PUT", func(t *testing.T) {
			up := newUpstream(t)
			s := protectedSite(t, sb, up.Addr(), "methods PUT")
			wantExecuted(t, s.Do(t, call{Method: http.MethodPost, Body: payBody()}), http.StatusCreated)
			wantProblem(t, s.Do(t, call{Method: http.MethodPut, Body: payBody()}), http.StatusBadRequest)
			c := call{Method: http.MethodPut, Key: newKey(), Body: payBody()}
			first := s.Do(t, c)
			wantReplayOf(t, s.Do(t, c), first)
			wantCount(t, up, 2)
		})
	})
}

func TestMatcherScopesProtection(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSiteMatcher(t, sb, up.Addr(), "/payments/* ")
		wantExecuted(t, s.Do(t, call{Path: "/other"}), http.StatusCreated)
		wantProblem(t, s.Do(t, call{Path: "/payments/1"}), http.StatusBadRequest)
		c := call{Path: "/payments/2", Key: newKey(), Body: payBody()}
		first := s.Do(t, c)
		wantReplayOf(t, s.Do(t, c), first)
		wantCount(t, up, 2)
	})
}

// The upstream must see exactly the bytes the client sent, not the
// canonical form the fingerprint used.
func TestUpstreamGetsExactBody(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		binary := make([]byte, 512)
		for i := range binary {
			binary[i] = byte(i)
		}
		for _, tc := range []struct {
			name    string
			body    []byte
			ctype   string
			chunked bool
		}{
			{"binary", binary, "application/octet-stream", false},
			{"binary chunked", binary, "application/octet-stream", true},
			{"JSON with odd whitespace", []byte("{ \"b\" :2,\n\t\"a\":\"\\u00e9\" ,\"n\":1.50 }\r\n"), "application/json", false},
			{"JSON chunked", []byte("{ \"z\":1 ,  \"y\":2 }"), "application/json", true},
			{"form", []byte("amount=1000&currency=eur&z=%20"), "application/x-www-form-urlencoded", false},
			{"empty", nil, "application/json", false},
		} {
			t.Run(tc.name, func(t *testing.T) {
				n := up.Count()
				c := call{Key: newKey(), Body: tc.body, ContentType: tc.ctype, Chunked: tc.chunked}
				first := s.Do(t, c)
				wantExecuted(t, first, http.StatusCreated)
				got := up.Executions()[n].Body
				if !bytes.Equal(got, tc.body) {
					t.Errorf("upstream got %q, client sent %q", got, tc.body)
				}
				wantReplayOf(t, s.Do(t, c), first)
			})
		}
	})
}

// No raw token ever reaches the database or a log line.
func TestCredentialIsNeverStoredOrLogged(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		secret := "sk_live_" + randomHex(12)
		cred := "Bearer " + secret
		c := call{Key: newKey(), Body: payBody(), Cred: cred, Header: sleepFor(300 * time.Millisecond)}
		ch := runBackground(t, s, c)
		up.WaitStarted(t, 1)
		s.Do(t, call{Key: c.Key, Body: c.Body, Cred: cred}) // in progress
		<-ch
		s.Do(t, call{Key: c.Key, Body: c.Body, Cred: cred})    // replay
		s.Do(t, call{Key: c.Key, Body: payBody(), Cred: cred}) // mismatch
		wantCount(t, up, 1)

		needles := map[string]string{
			"raw":    secret,
			"hex":    hex.EncodeToString([]byte(secret)),
			"base64": base64.StdEncoding.EncodeToString([]byte(secret))[:16],
		}
		logs, err := os.ReadFile(s.LogPath)
		if err != nil {
			t.Fatal(err)
		}
		for form, needle := range needles {
			if bytes.Contains(logs, []byte(needle)) {
				t.Errorf("the log holds the credential (%s)", form)
			}
		}
		if sb.Name != "postgres" {
			return
		}
		rows := pgQuery(t, sb.DSN, "SELECT t::text FROM "+quoteIdent(sb.Table)+" t")
		if len(rows) != 1 {
			t.Fatalf("table has %d rows, want 1", len(rows))
		}
		for form, needle := range needles {
			if strings.Contains(strings.ToLower(rows[0][0]), strings.ToLower(needle)) {
				t.Errorf("the database row holds the credential (%s): %s", form, rows[0][0])
			}
		}
	})
}

// Catches a store that ignores expires_at on acquire.
func TestExpiredRecordExecutesAnew(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "retention 2s", "lock_timeout 1s", "prune_interval 0")
		c := call{Key: newKey(), Body: payBody()}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, c), first)
		time.Sleep(2200 * time.Millisecond)
		second := s.Do(t, c)
		wantExecuted(t, second, http.StatusCreated)
		if second.Header.Get("X-Execution-Id") == first.Header.Get("X-Execution-Id") {
			t.Errorf("an expired record was replayed")
		}
		wantReplayOf(t, s.Do(t, c), second)
		// An expired record is absent: another body under the old key is no conflict.
		time.Sleep(2200 * time.Millisecond)
		wantExecuted(t, s.Do(t, call{Key: c.Key, Body: payBody()}), http.StatusCreated)
		wantCount(t, up, 3)
	})
}

// Pruning deletes expired rows and only those. Postgres only: the memory
// store's sweep is not observable from outside (memory_test.go covers it).
func TestPruneDeletesExpiredRows(t *testing.T) {
	t.Run("prune_interval 0 disables pruning", func(t *testing.T) {
		// Catches a pruner that treats 0 as "always" (a zero ticker, a busy loop).
		sb := postgresBackend(t)
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "retention 2s", "lock_timeout 1s", "prune_interval 0")
		wantExecuted(t, s.Do(t, call{Key: newKey(), Body: payBody()}), http.StatusCreated)
		time.Sleep(2500 * time.Millisecond)
		if n := pgCount(t, sb); n != 1 {
			t.Errorf("%d rows with pruning disabled, want the 1 expired row kept", n)
		}
	})
	sb := postgresBackend(t)
	up := newUpstream(t)
	s := protectedSite(t, sb, up.Addr(), "retention 2s", "lock_timeout 1s", "prune_interval 1s")
	for range 3 {
		wantExecuted(t, s.Do(t, call{Key: newKey(), Body: payBody()}), http.StatusCreated)
	}
	if n := pgCount(t, sb); n != 3 {
		t.Fatalf("%d rows after 3 requests, want 3", n)
	}
	late := call{Key: newKey(), Body: payBody()}
	lateReply := s.Do(t, late)
	// The live row lives on however slow the machine is, until the
	// pruner has taken the others.
	if n := pgExec(t, sb.DSN, "UPDATE "+quoteIdent(sb.Table)+" SET expires_at = now() + interval '1 hour' WHERE key = $1", late.Key); n != 1 {
		t.Fatalf("%d rows of the live key, want 1", n)
	}
	waitFor(t, 10*time.Second, "expired rows to be pruned", func() bool { return pgCount(t, sb) <= 1 })
	if n := pgCount(t, sb); n != 1 {
		t.Fatalf("%d rows after pruning, want the 1 live row", n)
	}
	wantReplayOf(t, s.Do(t, late), lateReply)
}

func TestErrorResponsesAreStoredAndReplayed(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		for _, status := range []int{http.StatusInternalServerError, http.StatusUnprocessableEntity} {
			t.Run(strconv.Itoa(status), func(t *testing.T) {
				n := up.Count()
				c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Status": strconv.Itoa(status)}}
				first := s.Do(t, c)
				wantExecuted(t, first, status)
				wantReplayOf(t, s.Do(t, c), first)
				wantCount(t, up, n+1)
			})
		}
	})
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
					pgQuery(t, sb.DSN, "SELECT t::text FROM "+quoteIdent(sb.Table)+" t"))
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

func TestLargeResponseIsNotReplayed(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "max_response_body 1024")
		for _, tc := range []struct {
			name       string
			size       int
			chunked    bool
			replayable bool
		}{
			{"with Content-Length", 5000, false, false},
			{"streamed", 5000, true, false},
			// Headers count toward the limit too (about 250 bytes here).
			{"body and headers under max_response_body", 700, false, true},
			{"body and headers under max_response_body streamed", 700, true, true},
			{"body of exactly max_response_body, with headers", 1024, false, false},
		} {
			t.Run(tc.name, func(t *testing.T) {
				n := up.Count()
				h := map[string]string{"X-Test-Size": strconv.Itoa(tc.size)}
				if tc.chunked {
					h["X-Test-Chunked"] = "1"
				}
				c := call{Key: newKey(), Body: payBody(), Header: h}
				first := s.Do(t, c)
				wantExecuted(t, first, http.StatusCreated)
				if want := sizedBody(first.Header.Get("X-Execution-Id"), tc.size); !bytes.Equal(first.Body, want) {
					t.Errorf("the first caller got %d bytes, want the whole %d", len(first.Body), tc.size)
				}
				second := s.Do(t, c)
				if tc.replayable {
					wantReplayOf(t, second, first)
				} else {
					p := wantProblem(t, second, http.StatusConflict)
					if text := strings.ToLower(p.Title + " " + p.Detail); !strings.Contains(text, "large") &&
						!strings.Contains(text, "size") && !strings.Contains(text, "big") {
						t.Errorf("the 409 should say the response was too large: %+v", p)
					}
					if second.Header.Get("Retry-After") != "" {
						t.Errorf("a too-large response will never be replayable; Retry-After invites a retry")
					}
				}
				wantCount(t, up, n+1)
			})
		}
	})
}

// Fail closed: no store, no execution. Catches failing open.
func TestStoreUnreachableFailsClosed(t *testing.T) {
	up := newUpstream(t)
	dsn := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?sslmode=disable&connect_timeout=2", freeTCPPort(t))
	s := protectedSite(t, storeBackend{Name: ""}, up.Addr(),
		fmt.Sprintf("store postgres {\n\t\t\tdsn %q\n\t\t\ttable idem_unreachable\n\t\t\tmigrate off\n\t\t}", dsn))
	r := s.Do(t, call{Key: newKey(), Body: payBody()})
	if r.Status != http.StatusServiceUnavailable {
		t.Fatalf("got %s, want 503", r)
	}
	wantRetryAfter(t, r)
	wantProblem(t, r, http.StatusServiceUnavailable)
	wantCount(t, up, 0)
	// Unprotected requests do not need the store.
	wantExecuted(t, s.Do(t, call{Method: http.MethodGet}), http.StatusCreated)
}

// The response streams through as it is produced. Catches a recorder that
// buffers the whole response before writing it.
func TestStreamingPassesThrough(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr())
		gate := "g-" + randomHex(4)
		c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Gate": gate}}
		req, err := s.request(context.Background(), c)
		if err != nil {
			t.Fatal(err)
		}
		type result struct {
			first string
			rest  []byte
			err   error
			resp  *http.Response
		}
		got := make(chan result, 1)
		go func() {
			resp, err := s.client.Do(req)
			if err != nil {
				got <- result{err: err}
				return
			}
			defer resp.Body.Close()
			buf := make([]byte, 64)
			n, err := resp.Body.Read(buf)
			first := string(buf[:n])
			if err != nil && err != io.EOF {
				got <- result{err: err}
				return
			}
			got <- result{first: first, resp: resp}
			up.Open(gate)
			rest, err := io.ReadAll(resp.Body)
			got <- result{rest: rest, err: err}
		}()
		var r1 result
		select {
		case r1 = <-got:
		case <-time.After(3 * time.Second):
			up.Open(gate)
			t.Fatalf("the first flushed chunk did not reach the client while the upstream was still running")
		}
		if r1.err != nil {
			t.Fatal(r1.err)
		}
		r2 := <-got
		if r2.err != nil {
			t.Fatal(r2.err)
		}
		id := r1.resp.Header.Get("X-Execution-Id")
		whole := r1.first + string(r2.rest)
		if want := "first-" + id + "\nsecond\n"; whole != want {
			t.Fatalf("streamed body = %q, want %q", whole, want)
		}
		replay := s.Do(t, call{Key: c.Key, Body: c.Body})
		if !replay.replayed() || string(replay.Body) != whole {
			t.Errorf("replay of a streamed response: got %s, want body %q", replay, whole)
		}
		wantCount(t, up, 1)
	})
}

// The module sits inside encode: it stores the identity body and encode
// compresses each answer for its own client. Catches a recorder that
// stores compressed bytes or encode's Content-Encoding header.
func TestEncodeCompressesReplays(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	encode gzip
	idempotency {
		%s
	}
	reverse_proxy %s
}
`, port, sb.Block(), up.Addr()))
		gz := map[string]string{"X-Test-Size": "4000", "Accept-Encoding": "gzip"}
		c := call{Key: newKey(), Body: payBody(), Header: gz}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		want := sizedBody(first.Header.Get("X-Execution-Id"), 4000)
		if first.Header.Get("Content-Encoding") != "gzip" || !bytes.Equal(gunzip(t, first.Body), want) {
			t.Fatalf("the first answer is not the gzipped upstream body: %v", first.Header)
		}
		plain := s.Do(t, call{Key: c.Key, Body: c.Body, Header: map[string]string{"Accept-Encoding": "identity"}})
		if !plain.replayed() || plain.Header.Get("Content-Encoding") != "" || !bytes.Equal(plain.Body, want) {
			t.Errorf("a replay to a client without gzip must be the identity body: %v, %d bytes", plain.Header, len(plain.Body))
		}
		again := s.Do(t, c)
		if !again.replayed() || again.Header.Get("Content-Encoding") != "gzip" || !bytes.Equal(gunzip(t, again.Body), want) {
			t.Errorf("a replay to a gzip client must be gzipped once: %v", again.Header)
		}
		wantCount(t, up, 1)
	})
}

func gunzip(t *testing.T, b []byte) []byte {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatalf("not gzip: %v", err)
	}
	out, err := io.ReadAll(zr)
	if err != nil {
		t.Fatalf("bad gzip: %v", err)
	}
	return out
}

func TestExcludedHeadersAreNotReplayed(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "exclude_headers x-secret Location") // names are case-insensitive
		c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Extra": "1"}}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		for _, h := range []string{"X-Secret", "Authorization", "Set-Cookie", "Location"} {
			if first.Header.Get(h) == "" {
				t.Errorf("the first caller must get the upstream's %s", h)
			}
		}
		replay := s.Do(t, c)
		if !replay.replayed() || !bytes.Equal(replay.Body, first.Body) {
			t.Fatalf("want a replay, got %s", replay)
		}
		for _, h := range []string{"X-Secret", "Authorization", "Set-Cookie", "Location"} {
			if v := replay.Header.Values(h); len(v) != 0 {
				t.Errorf("replay carries %s: %q", h, v)
			}
		}
		// The defaults stay excluded, the rest is kept.
		if got := replay.Header.Values("X-Multi"); !equalStrings(got, []string{"one", "two"}) {
			t.Errorf("replay X-Multi = %q, want [one two]", got)
		}
	})
}

// Credentials that an upstream sends back are not stored nor replayed:
// the header the handler reads its credential from (here X-Api-Key, as
// credential_header or through a credential placeholder), Cookie,
// Set-Cookie2, and the Authentication-Info headers (RFC 7615), as with
// Authorization.
// They would otherwise sit in the store, the admin API's records and the
// CLI's output. Catches a never-stored list that knew only
// Authorization as a credential.
func TestCredentialHeadersAreNotReplayed(t *testing.T) {
	for _, directive := range []string{"credential_header X-Api-Key", "credential {http.request.header.x-api-key}"} {
		t.Run(directive, func(t *testing.T) { testCredentialHeadersAreNotReplayed(t, directive) })
	}
}

func testCredentialHeadersAreNotReplayed(t *testing.T, directive string) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), directive)
		c := call{Key: newKey(), Body: payBody(), Cred: "tenant-a-key", CredHeader: "X-Api-Key",
			Header: map[string]string{"X-Test-Credentials": "1"}}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		credentials := []string{"X-Api-Key", "Cookie", "Set-Cookie2", "Authentication-Info", "Proxy-Authentication-Info"}
		for _, h := range credentials {
			if first.Header.Get(h) == "" {
				t.Errorf("the first caller must get the upstream's %s", h)
			}
		}
		replay := s.Do(t, c)
		if !replay.replayed() || !bytes.Equal(replay.Body, first.Body) {
			t.Fatalf("want a replay, got %s", replay)
		}
		for _, h := range credentials {
			if v := replay.Header.Values(h); len(v) != 0 {
				t.Errorf("replay carries %s: %q", h, v)
			}
		}
		if got := replay.Header.Values("X-Multi"); !equalStrings(got, []string{"one", "two"}) {
			t.Errorf("replay X-Multi = %q, want [one two]", got)
		}
	})
}

func TestCustomKeyHeader(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		s := protectedSite(t, sb, up.Addr(), "key_header X-Request-Key")
		body := payBody()
		wantProblem(t, s.Do(t, call{Key: newKey(), Body: body}), http.StatusBadRequest) // Idempotency-Key is not it
		c := call{Key: newKey(), KeyHeader: "X-Request-Key", Body: body}
		first := s.Do(t, c)
		wantExecuted(t, first, http.StatusCreated)
		wantReplayOf(t, s.Do(t, c), first)
		wantCount(t, up, 1)
	})
}

// {http.idempotency.result} and {http.idempotency.key} are set for other
// handlers; a deferred header op reads them at write time.
func TestPlaceholders(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		up := newUpstream(t)
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	header >X-Idem-Result {http.idempotency.result}
	header >X-Idem-Key {http.idempotency.key}
	idempotency {
		%s
	}
	reverse_proxy %s
}
`, port, sb.Block(), up.Addr()))
		key := newKey()
		body := payBody()
		inflight := call{Key: newKey(), Body: payBody(), Header: sleepFor(500 * time.Millisecond)}
		ch := runBackground(t, s, inflight)
		up.WaitStarted(t, 1)
		for _, tc := range []struct {
			name    string
			c       call
			result  string
			wantKey string
		}{
			{"executed", call{Key: key, Body: body}, "executed", key},
			{"replayed", call{Key: key, Body: body}, "replayed", key},
			{"mismatch", call{Key: key, Body: payBody()}, "mismatch", key},
			{"in_progress", call{Key: inflight.Key, Body: inflight.Body}, "in_progress", inflight.Key},
			{"rejected", call{Body: body}, "rejected", ""},
		} {
			r := s.Do(t, tc.c)
			if got := r.Header.Get("X-Idem-Result"); got != tc.result {
				t.Errorf("%s: {http.idempotency.result} = %q, want %q (status %d)", tc.name, got, tc.result, r.Status)
			}
			if tc.wantKey != "" && r.Header.Get("X-Idem-Key") != tc.wantKey {
				t.Errorf("%s: {http.idempotency.key} = %q, want %q", tc.name, r.Header.Get("X-Idem-Key"), tc.wantKey)
			}
		}
		<-ch
	})
}

// Several Caddy instances share one table: a retry that lands on another
// instance is replayed, and a concurrent one gets 409.
func TestPostgresSharedBetweenInstances(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	portA, portB := freeTCPPort(t), freeTCPPort(t)
	siteBlock := func(port int) string {
		return fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		lock_timeout 5s
	}
	reverse_proxy %s
}
`, port, sb.Block(), up.Addr())
	}
	srv := startCaddyfile(t, siteBlock(portA)+siteBlock(portB))
	a, b := newSiteClient(t, srv, portA), newSiteClient(t, srv, portB)

	c := call{Key: newKey(), Body: payBody(), Header: sleepFor(500 * time.Millisecond)}
	ch := runBackground(t, a, c)
	up.WaitStarted(t, 1)
	wantProblem(t, b.Do(t, call{Key: c.Key, Body: c.Body}), http.StatusConflict)
	first := <-ch
	wantExecuted(t, first, http.StatusCreated)
	wantReplayOf(t, b.Do(t, call{Key: c.Key, Body: c.Body}), first)
	wantCount(t, up, 1)
}

// A config reload keeps the store working. Catches a pool created with the
// context of the config that unloads.
func TestPostgresSurvivesReload(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	port := freeTCPPort(t)
	cfg := func(extra string) []byte {
		logPath := t.TempDir() + "/caddy.log"
		js, _, err := adaptCaddyfile(globalOptions(logPath, "") + fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		%s
	}
	reverse_proxy %s
}
`, port, sb.Block(), extra, up.Addr()))
		if err != nil {
			t.Fatal(err)
		}
		return js
	}
	srv := startCaddyJSON(t, cfg(""), "")
	s := newSiteClient(t, srv, port)
	c := call{Key: newKey(), Body: payBody()}
	first := s.Do(t, c)
	wantExecuted(t, first, http.StatusCreated)

	if err := caddy.Load(cfg("retry_after 3s"), true); err != nil { // caddyMu is held by this test
		t.Fatalf("reload: %v", err)
	}
	s.reloaded(t)
	wantReplayOf(t, s.Do(t, c), first)
	wantExecuted(t, s.Do(t, call{Key: newKey(), Body: payBody()}), http.StatusCreated)
	wantCount(t, up, 2)
}

// A reload that moves the store to another table leaves the requests in
// flight on the store they acquired on: the one running completes its
// record in the old table; its retry, after the reload, finds nothing in
// the new table and executes again (README, "Credential secret").
func TestReloadToAnotherTableInFlight(t *testing.T) {
	dsn := testDSN(t)
	before, after := freshTable(t), freshTable(t)
	up := newUpstream(t)
	block := func(table string) string {
		return fmt.Sprintf("store postgres {\n\t\t\tdsn %q\n\t\t\ttable %s\n\t\t}", dsn, table)
	}
	s := protectedSite(t, storeBackend{Name: "postgres", DSN: dsn, Table: before}, up.Addr())
	gate := "g-" + randomHex(4)
	c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Gate": gate}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		// The reload may close the connection: the request runs on.
		_, _ = s.DoCtx(context.Background(), c)
	}()
	up.WaitStarted(t, 1)
	reloadSite(t, s, up.Addr(), block(after))
	up.Open(gate)
	<-done
	up.WaitEnded(t, 1)
	waitFor(t, 5*time.Second, "the completion in the old table", func() bool {
		rows := pgQuery(t, dsn, `SELECT count(*) FROM `+quoteIdent(before)+` WHERE key = $1 AND status = 'completed'`, c.Key)
		return rows[0][0] == "1"
	})
	wantExecuted(t, s.Do(t, c), http.StatusCreated)
	wantCount(t, up, 2)
}

// A JSON config, as through the admin API, with a DSN from an {env.*}
// placeholder resolved at provision time.
func TestJSONConfig(t *testing.T) {
	sb := postgresBackend(t)
	t.Setenv("IDEMPOTENCY_E2E_DSN", sb.DSN)
	up := newUpstream(t)
	port := freeTCPPort(t)
	cfg := fmt.Sprintf(`{
	"admin": {"disabled": true},
	"logging": {"logs": {"default": {"writer": {"output": "discard"}}}},
	"apps": {"http": {"servers": {"srv0": {
		"listen": ["127.0.0.1:%d"],
		"automatic_https": {"disable": true},
		"routes": [{"handle": [
			{
				"handler": "idempotency",
				"store": {"backend": "postgres", "dsn": "{env.IDEMPOTENCY_E2E_DSN}", "table": %q},
				"lock_timeout": "5s",
				"max_request_body": 4096
			},
			{"handler": "reverse_proxy", "upstreams": [{"dial": %q}]}
		]}]
	}}}}
}`, port, sb.Table, up.Addr())
	srv := startCaddyJSON(t, []byte(cfg), "")
	s := newSiteClient(t, srv, port)
	c := call{Key: newKey(), Body: payBody()}
	first := s.Do(t, c)
	wantExecuted(t, first, http.StatusCreated)
	wantReplayOf(t, s.Do(t, c), first)
	wantProblem(t, s.Do(t, call{Key: newKey(), Body: bytes.Repeat([]byte("z"), 5000), ContentType: "text/plain"}), http.StatusRequestEntityTooLarge)
	if n := pgCount(t, sb); n != 1 {
		t.Errorf("%d rows in the table, want 1", n)
	}
}

func TestLogs(t *testing.T) {
	t.Run("memory store warns it is not durable", func(t *testing.T) {
		up := newUpstream(t)
		s := protectedSite(t, storeBackend{Name: "memory"}, up.Addr())
		found := false
		for _, l := range s.moduleLogLines(t) {
			if l["level"] == "warn" {
				found = true
			}
		}
		if !found {
			t.Errorf("no warning from the module at start with the memory store")
		}
	})
	t.Run("one line per replay", func(t *testing.T) {
		up := newUpstream(t)
		s := protectedSite(t, storeBackend{Name: "memory"}, up.Addr())
		c := call{Key: newKey(), Body: payBody(), Path: "/pay/x"}
		s.Do(t, c)
		s.Do(t, c)
		var replays []map[string]any
		for _, l := range s.moduleLogLines(t) {
			if msg, _ := l["msg"].(string); msg == "idempotency.replay" {
				replays = append(replays, l)
			}
		}
		if len(replays) != 1 {
			t.Fatalf("%d idempotency.replay lines, want 1", len(replays))
		}
		for _, field := range []string{"key", "method", "path", "original_status", "age_seconds"} {
			if _, ok := replays[0][field]; !ok {
				t.Errorf("idempotency.replay line lacks %q: %v", field, replays[0])
			}
		}
		if replays[0]["key"] != c.Key || replays[0]["path"] != "/pay/x" || replays[0]["method"] != "POST" {
			t.Errorf("idempotency.replay line: %v", replays[0])
		}
		// The credential id is a short prefix of the credential's keyed
		// hash, never the credential, nor anything its unkeyed hash gives.
		sum := handlerCredentialHash(t, storeBackend{Name: "memory"}, defaultCred)
		credID, _ := replays[0]["credential_id"].(string)
		if credID == "" || len(credID) >= 64 || !strings.HasPrefix(hex.EncodeToString(sum[:]), credID) {
			t.Errorf("idempotency.replay credential_id = %q, want a short prefix of the credential's keyed hash", credID)
		}
	})
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

// ---------------------------------------------------------------------------
// Caddyfile

// Each testdata/adapt/*.caddyfiletest is a Caddyfile, a line of dashes, and
// the JSON it must adapt to (as Caddy's own adapt tests).
func TestCaddyfileAdapt(t *testing.T) {
	files, err := filepath.Glob("testdata/adapt/*.caddyfiletest")
	if err != nil || len(files) == 0 {
		t.Fatalf("no golden files: %v", err)
	}
	for _, f := range files {
		t.Run(strings.TrimSuffix(f[len("testdata/adapt/"):], ".caddyfiletest"), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			caddyfile, wantJSON, ok := strings.Cut(string(data), "\n----------\n")
			if !ok {
				t.Fatalf("%s: no ---------- separator", f)
			}
			got, warnings, err := adaptCaddyfile(caddyfile + "\n")
			if err != nil {
				t.Fatalf("adapting: %v", err)
			}
			for _, w := range warnings {
				t.Errorf("warning: %s", w.String())
			}
			if g, w := normJSON(t, got), normJSON(t, []byte(wantJSON)); g != w {
				t.Errorf("adapted JSON differs.\n got: %s\nwant: %s", g, w)
			}
		})
	}
}

func normJSON(t *testing.T, b []byte) string {
	t.Helper()
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("bad JSON: %v\n%s", err, b)
	}
	out, _ := json.MarshalIndent(v, "", "  ")
	return string(out)
}

func TestCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct {
		name  string
		block string // the body of idempotency { }; its first line is Caddyfile line 3
		lines []int  // the lines the error may name
	}{
		{"unknown subdirective", "store memory\n\t\tfrobnicate on", []int{4}},
		{"bad duration", "store memory\n\t\tlock_timeout soon", []int{4}},
		{"negative duration", "store memory\n\t\tretention -1h", []int{4}},
		{"bad size", "store memory\n\t\tmax_request_body lots", []int{4}},
		{"bad table name", "store postgres {\n\t\t\tdsn postgres://x@127.0.0.1/db\n\t\t\ttable \"x; DROP TABLE y\"\n\t\t}", []int{5}},
		{"two stores", "store memory\n\t\tstore postgres {\n\t\t\tdsn postgres://x@127.0.0.1/db\n\t\t}", []int{4}},
		{"missing dsn", "store postgres {\n\t\t\ttable t\n\t\t}", []int{3, 4, 5}},
		{"unknown store", "store redis", []int{3}},
		{"bad migrate value", "store postgres {\n\t\t\tdsn postgres://x@127.0.0.1/db\n\t\t\tmigrate maybe\n\t\t}", []int{5}},
		{"bad max_conns", "store postgres {\n\t\t\tdsn postgres://x@127.0.0.1/db\n\t\t\tmax_conns many\n\t\t}", []int{5}},
		{"key_header without argument", "store memory\n\t\tkey_header", []int{4}},
		{"credential_header without argument", "credential_header", []int{3}},
		{"methods without argument", "methods", []int{3}},
		{"optional with an argument", "optional yes", []int{3}},
		{"retention with two arguments", "retention 1h 2h", []int{3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := fmt.Sprintf("http://127.0.0.1:8080 {\n\tidempotency {\n\t\t%s\n\t}\n\treverse_proxy 127.0.0.1:9\n}\n", tc.block)
			_, _, err := adaptCaddyfile(cfg)
			if err == nil {
				t.Fatalf("adapting succeeded, want an error for:\n%s", cfg)
			}
			named := false
			for _, l := range tc.lines {
				if strings.Contains(err.Error(), fmt.Sprintf("Caddyfile:%d", l)) {
					named = true
				}
			}
			if !named {
				t.Errorf("error does not name line %v: %v", tc.lines, err)
			}
		})
	}
}

// A next handler that panics (reverse_proxy when the upstream fails in
// the middle of its response; here `abort`) still ends its record: the
// retry gets the stored outcome-unknown answer, not 409 for as long as a
// lock that nobody stops renewing lives.
func TestPanickingHandlerCompletesItsRecord(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		port := freeTCPPort(t)
		s := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		%s
		lock_timeout 1s
	}
	abort
}
`, port, sb.Block()))
		c := call{Key: newKey(), Body: payBody()}
		if r, err := s.DoCtx(context.Background(), c); err == nil {
			t.Fatalf("an aborted request got an answer: %s", r)
		}
		// Past lock_timeout: a lock that were still renewed would answer
		// 409, and one left to go stale would be taken over.
		time.Sleep(1500 * time.Millisecond)
		// Its completion may still be on its way: a client retries a 409
		// with Retry-After.
		r := pollPastInProgress(t, s, c)
		if r.Status != http.StatusBadGateway || !r.replayed() || !bytes.Contains(r.Body, []byte("#outcome-unknown")) {
			t.Fatalf("retry after an abort: %s; want the stored outcome-unknown problem, replayed", r)
		}
		wantReplayOf(t, s.Do(t, c), r)
	})
}
