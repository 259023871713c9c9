package idempotency

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// eachRealStore runs fn on a store of each kind on the real clock, as the
// handler uses it.
func eachRealStore(t *testing.T, fn func(t *testing.T, s Store)) {
	t.Helper()
	t.Run("memory", func(t *testing.T) {
		t.Parallel()
		fn(t, &MemoryStore{records: newMemoryRecords(100, time.Now)})
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		fn(t, newTestPostgresStore(t, freshTable(t), 4))
	})
}

// A record whose lease is live never expires and is never pruned, and a
// completed record lives a full retention after its completion, however
// long its request ran.
func TestStoreLiveLeaseNeverExpires(t *testing.T) {
	eachRealStore(t, func(t *testing.T, s Store) {
		ctx := context.Background()
		owner := testAcquireRequest("cred", "lease-key", "body")
		// A renewal may come late on a loaded machine: the lease has
		// room for several missed ones.
		owner.Retention, owner.LockTimeout = 1500*time.Millisecond, time.Second
		if res, err := s.Acquire(ctx, owner); err != nil || res.Outcome != OutcomeCreated {
			t.Fatalf("acquire: %+v, %v", res, err)
		}
		// The request runs twice its retention, renewing its lease.
		for end := time.Now().Add(2 * owner.Retention); time.Now().Before(end); {
			time.Sleep(150 * time.Millisecond)
			if err := s.Renew(ctx, owner.Key, owner.Token); err != nil {
				t.Fatalf("renew: %v", err)
			}
		}
		if n, err := s.Prune(ctx, 100); err != nil || n != 0 {
			t.Fatalf("prune while the lease is live: %d, %v; want 0", n, err)
		}
		for _, body := range []string{"body", "another body"} {
			retry := testAcquireRequest("cred", owner.Key.Key, body)
			retry.Retention, retry.LockTimeout = owner.Retention, owner.LockTimeout
			res, err := s.Acquire(ctx, retry)
			if err != nil || res.Outcome != OutcomeExisting || res.Record.Status != StatusInProgress {
				t.Fatalf("acquire by a retry with %q while the lease is live: %+v, %v; want the in-progress record", body, res, err)
			}
		}
		if err := s.Complete(ctx, owner.Key, owner.Token, &Response{Status: 201, Replayable: true}, owner.Retention); err != nil {
			t.Fatalf("complete: %v", err)
		}
		completed := time.Now()
		time.Sleep(owner.Retention / 2)
		if n, err := s.Prune(ctx, 100); err != nil || n != 0 {
			t.Fatalf("prune within the retention after completion: %d, %v; want 0", n, err)
		}
		retry := retryRequest(owner)
		res, err := s.Acquire(ctx, retry)
		if err != nil || res.Outcome != OutcomeExisting || res.Record.Status != StatusCompleted {
			t.Fatalf("acquire %v after completion: %+v, %v; want the completed record", time.Since(completed), res, err)
		}
		time.Sleep(time.Until(completed.Add(owner.Retention + 100*time.Millisecond)))
		if n, err := s.Prune(ctx, 100); err != nil || n != 1 {
			t.Fatalf("prune a retention after completion: %d, %v; want 1", n, err)
		}
	})
}

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

// Two stores sharing records, with different lock timeouts, at the
// store level: the takeover waits for the owner's lease.
func TestStoreLeaseIsTheRecords(t *testing.T) {
	eachRealStore(t, func(t *testing.T, s Store) {
		ctx := context.Background()
		owner := testAcquireRequest("cred", "lease-owner", "body")
		owner.LockTimeout = 2 * time.Second
		if res, err := s.Acquire(ctx, owner); err != nil || res.Outcome != OutcomeCreated {
			t.Fatalf("acquire: %+v, %v", res, err)
		}
		time.Sleep(300 * time.Millisecond)
		retry := retryRequest(owner)
		retry.LockTimeout = 100 * time.Millisecond
		res, err := s.Acquire(ctx, retry)
		if err != nil || res.Outcome != OutcomeExisting {
			t.Fatalf("acquire by a retry with a shorter lock timeout: %+v, %v; want the owner's record", res, err)
		}
		if !res.Record.LockedUntil.After(res.Record.LockedAt.Add(time.Second)) {
			t.Errorf("locked_until %v, locked_at %v: the lease is not the owner's 2s", res.Record.LockedUntil, res.Record.LockedAt)
		}
		// A renewal extends the lease by its own length.
		if err := s.Renew(ctx, owner.Key, owner.Token); err != nil {
			t.Fatalf("renew: %v", err)
		}
		time.Sleep(time.Second)
		if res, err := s.Acquire(ctx, retry); err != nil || res.Outcome != OutcomeExisting {
			t.Fatalf("acquire after a renewal: %+v, %v; want the owner's record", res, err)
		}
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

// Headers round-trip through both stores byte for byte, names included.
func TestStoreHeadersRoundTripExactly(t *testing.T) {
	eachRealStore(t, func(t *testing.T, s Store) {
		ctx := context.Background()
		req := testAcquireRequest("cred", "bytes-key", "body")
		header := http.Header{
			"X-Ref":               {"a\x00b\xff", "", "\x80\xfe"},
			"Trailer:Grpc-Status": {"0"},
			"lower\x00case\xff":   {"v"},
			"Empty":               {},
		}
		if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != OutcomeCreated {
			t.Fatalf("acquire: %+v, %v", res, err)
		}
		if err := s.Complete(ctx, req.Key, req.Token, &Response{Status: 200, Header: header, Body: []byte("\x00\xff"), Replayable: true, BodySize: 2}, req.Retention); err != nil {
			t.Fatalf("complete: %v", err)
		}
		res, err := s.Acquire(ctx, retryRequest(req))
		if err != nil || res.Outcome != OutcomeExisting || res.Record.Response == nil {
			t.Fatalf("replay: %+v, %v", res, err)
		}
		got := res.Record.Response.Header
		if len(got) != len(header) {
			t.Errorf("headers = %q, want %q", got, header)
		}
		for name, want := range header {
			if !equalStrings(got[name], want) {
				t.Errorf("header %q = %q, want %q", name, got[name], want)
			}
		}
		if string(res.Record.Response.Body) != "\x00\xff" {
			t.Errorf("body = %q", res.Record.Response.Body)
		}
	})
}

// Records completed before migration 0002 have their headers as JSON in
// response_headers; they still replay.
func TestPostgresReplaysHeadersStoredAsJSON(t *testing.T) {
	t.Parallel()
	s := newTestPostgresStore(t, freshTable(t), 2)
	ctx := context.Background()
	req := testAcquireRequest("cred", "json-key", "body")
	if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != OutcomeCreated {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	mustExec(t, s, `UPDATE `+s.table.quoted()+` SET status = 'completed', lock_token = NULL, locked_at = NULL,
	response_status = 200, response_headers = '{"X-A": ["1", "2"], "Content-Type": ["text/plain"]}',
	response_body = 'hi', replayable = true, response_size = 2`)
	res, err := s.Acquire(ctx, retryRequest(req))
	if err != nil || res.Outcome != OutcomeExisting || res.Record.Response == nil {
		t.Fatalf("replay: %+v, %v", res, err)
	}
	if h := res.Record.Response.Header; !equalStrings(h["X-A"], []string{"1", "2"}) || h.Get("Content-Type") != "text/plain" || len(h) != 2 {
		t.Errorf("headers = %q", h)
	}
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
	pgExec(t, sb.DSN, "ALTER TABLE "+sb.Table+" ADD CONSTRAINT small_bodies CHECK (octet_length(response_body) < 50) NOT VALID")

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

// Both stores: a Complete that the store refuses for good returns
// ErrUnstorable, not a transient error.
func TestPostgresCompleteUnstorableIsPermanent(t *testing.T) {
	t.Parallel()
	s := newTestPostgresStore(t, freshTable(t), 2)
	mustExec(t, s, "ALTER TABLE "+s.table.quoted()+" ADD CONSTRAINT small_bodies CHECK (octet_length(response_body) < 5)")
	ctx := context.Background()
	req := testAcquireRequest("cred", "unstorable", "body")
	if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != OutcomeCreated {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	err := s.Complete(ctx, req.Key, req.Token, &Response{Status: 200, Body: []byte("too long"), Replayable: true}, req.Retention)
	if !errors.Is(err, ErrUnstorable) {
		t.Fatalf("complete: %v, want ErrUnstorable", err)
	}
	if err := s.Complete(ctx, req.Key, req.Token, &Response{Status: 200, BodySize: 8}, req.Retention); err != nil {
		t.Fatalf("complete without the body: %v", err)
	}
}
