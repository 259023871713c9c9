package idempotency

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
)

// The reproduction: with a retention of 3s and a lock_timeout of
// 1s, a request that runs 5s kept its lock but its record expired at 3s,
// and the same request (or, on the memory store, another one under the
// same key) executed again at 3.5s.
func TestLongRequestOutlivesRetention(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		t.Parallel()
		u := newUpstream(t)
		site := protectedSite(t, sb, u.Addr(), "retention 3s", "lock_timeout 1s")
		key, body := newKey(), payBody()
		first := make(chan reply, 1)
		go func() {
			r, err := site.DoCtx(context.Background(), call{Key: key, Body: body, Header: map[string]string{"X-Test-Sleep": "5s"}})
			if err != nil {
				t.Errorf("first request: %v", err)
			}
			first <- r
		}()
		u.WaitStarted(t, 1)
		time.Sleep(3500 * time.Millisecond)
		wantProblem(t, site.Do(t, call{Key: key, Body: body}), http.StatusConflict)
		other := site.Do(t, call{Key: key, Body: []byte(`{"amount":1}`)})
		if other.Status < 400 || other.Status >= 500 {
			t.Errorf("another request under the key while it runs: %s; want a 4xx", other)
		}
		r := <-first
		wantExecuted(t, r, http.StatusCreated)
		wantReplayOf(t, site.Do(t, call{Key: key, Body: body}), r)
		wantCount(t, u, 1)
	})
}

// The lease belongs to the record: a retry that reaches an instance with
// a shorter lock_timeout than the owner's waits for the owner's lease.
func TestLeaseIsTheOwnersLockTimeout(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		t.Parallel()
		u := newUpstream(t)
		// Two handlers sharing the store, as two instances share a
		// table (memory stores of the same size share their records),
		// chosen by a header that the fingerprint leaves out.
		port := freeTCPPort(t)
		site := siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	@slow header X-Instance slow
	@quick header X-Instance quick
	idempotency @slow {
		%[2]s
		lock_timeout 30s
	}
	idempotency @quick {
		%[2]s
		lock_timeout 1s
	}
	reverse_proxy %[3]s
}
`, port, sb.Block(), u.Addr()))
		key, body := newKey(), payBody()
		first := make(chan reply, 1)
		go func() {
			r, err := site.DoCtx(context.Background(), call{Key: key, Body: body, Header: map[string]string{"X-Instance": "slow", "X-Test-Sleep": "3s"}})
			if err != nil {
				t.Errorf("first request: %v", err)
			}
			first <- r
		}()
		u.WaitStarted(t, 1)
		time.Sleep(1500 * time.Millisecond)
		retry := call{Key: key, Body: body, Header: map[string]string{"X-Instance": "quick"}}
		wantProblem(t, site.Do(t, retry), http.StatusConflict)
		r := <-first
		wantExecuted(t, r, http.StatusCreated)
		wantReplayOf(t, site.Do(t, retry), r)
		wantCount(t, u, 1)
	})
}

// A response whose headers carry bytes that JSON cannot (NUL, and bytes
// that are not UTF-8) is stored, and replayed byte for byte. With jsonb,
// Postgres refused the completion for good, and the retry executed
// again once the lock expired.
func TestHeaderBytesReplayExactly(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		t.Parallel()
		u := newUpstream(t)
		port := freeTCPPort(t)
		siteFromCaddyfile(t, port, fmt.Sprintf(`http://127.0.0.1:%d {
	header X-Ref {http.request.uri.query.ref}
	idempotency {
		%s
		lock_timeout 1s
	}
	reverse_proxy %s
}
`, port, sb.Block(), u.Addr()))
		// Go's client refuses such a header line: the exchange is raw.
		key := newKey()
		body := string(payBody())
		raw := fmt.Sprintf("POST /pay?ref=a%%00b%%FF%%C3%%A9 HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nIdempotency-Key: %s\r\n"+
			"Authorization: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
			port, key, defaultCred, len(body), body)
		exchange := func() (string, string) {
			conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.WriteString(conn, raw); err != nil {
				t.Fatal(err)
			}
			resp, err := io.ReadAll(conn)
			if err != nil {
				t.Fatal(err)
			}
			head, payload, _ := strings.Cut(string(resp), "\r\n\r\n")
			var ref string
			for _, line := range strings.Split(head, "\r\n") {
				if v, ok := strings.CutPrefix(line, "X-Ref: "); ok {
					ref = v
				}
			}
			return ref, payload
		}
		ref, firstBody := exchange()
		if ref != "a\x00b\xff\xc3\xa9" {
			t.Fatalf("X-Ref = %q: the test does not send the bytes it means to", ref)
		}
		time.Sleep(1500 * time.Millisecond) // past the lock timeout
		replayRef, replayBody := exchange()
		if replayRef != ref || replayBody != firstBody {
			t.Errorf("replay: X-Ref %q, body %q; want %q, %q", replayRef, replayBody, ref, firstBody)
		}
		wantCount(t, u, 1)
	})
}

// A response the database refuses for good (here a constraint on the
// body's size) is not retried until the lock runs out, which let the
// retry execute again: the record is completed as not replayable, and
// the retry gets the 409 that says so.
func TestPostgresUnstorableResponseIsNotExecutedAgain(t *testing.T) {
	t.Parallel()
	sb := postgresBackend(t)
	u := newUpstream(t)
	site := protectedSite(t, sb, u.Addr(), "lock_timeout 1s")
	site.Do(t, call{Key: newKey(), Body: payBody()}) // creates the table
	pgtest.Exec(t, sb.DSN, "ALTER TABLE "+sb.Table+" ADD CONSTRAINT small_bodies CHECK (octet_length(response_body) < 50) NOT VALID")

	key := newKey()
	c := call{Key: key, Body: payBody(), Header: map[string]string{"X-Test-Size": "100"}}
	wantExecuted(t, site.Do(t, c), http.StatusCreated)
	time.Sleep(1500 * time.Millisecond) // past the lock timeout
	p := wantProblem(t, site.Do(t, c), http.StatusConflict)
	if !strings.Contains(strings.ToLower(p.Title+p.Detail), "replay") {
		t.Errorf("problem %+v is not the not-replayable one", p)
	}
	wantCount(t, u, 2) // the first request of each key
	var logged bool
	for _, l := range site.moduleLogLines(t) {
		logged = logged || l["msg"] == "idempotency.unstorable_response"
	}
	if !logged {
		t.Errorf("no idempotency.unstorable_response log line")
	}
}
