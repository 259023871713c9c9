package storetest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
)

// The calls of store.go's contract, one after another, as a first
// execution, its retries and an operator make them.
func testCalls(t *testing.T, s store.Store) {
	ctx := context.Background()
	resp := &store.Response{Status: 201, Body: []byte("made"), Replayable: true}

	// Acquire creates once; a retry, of the same request or not,
	// gets the record in progress, and takes nothing over.
	req := Request("cred", "contract-key", "body")
	if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("first acquire: %+v, %v; want created", res, err)
	}
	for _, other := range []store.AcquireRequest{Retry(req), Request("cred", "contract-key", "another body")} {
		res, err := s.Acquire(ctx, other)
		if err != nil || res.Outcome != store.OutcomeExisting || res.Record.Status != store.StatusInProgress {
			t.Fatalf("acquire by another attempt: %+v, %v; want the record in progress", res, err)
		}
	}
	// The owner's own acquire again (its reply was lost) is its own.
	if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire again by the owner: %+v, %v; want created", res, err)
	}

	// Only the owner's token renews, completes or releases.
	stranger := Retry(req).Token
	if err := s.Renew(ctx, req.Key, stranger); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("renew by another token: %v; want ErrLockLost", err)
	}
	if err := s.Complete(ctx, req.Key, stranger, resp, req.Retention); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("complete by another token: %v; want ErrLockLost", err)
	}
	if err := s.Release(ctx, req.Key, stranger); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("release by another token: %v; want ErrLockLost", err)
	}
	if err := s.Renew(ctx, req.Key, req.Token); err != nil {
		t.Fatalf("renew by the owner: %v", err)
	}

	// Completed, the record answers every retry with its response;
	// the owner's completion again changes nothing.
	if err := s.Complete(ctx, req.Key, req.Token, resp, req.Retention); err != nil {
		t.Fatalf("complete: %v", err)
	}
	if err := s.Complete(ctx, req.Key, req.Token, resp, req.Retention); err != nil {
		t.Fatalf("complete again by the owner: %v; want nil", err)
	}
	res, err := s.Acquire(ctx, Retry(req))
	if err != nil || res.Outcome != store.OutcomeExisting || res.Record.Status != store.StatusCompleted ||
		res.Record.Response == nil || string(res.Record.Response.Body) != "made" || res.Record.Response.Status != 201 {
		t.Fatalf("acquire after completion: %+v, %v; want the completed record with its response", res, err)
	}
	if err := s.Release(ctx, req.Key, req.Token); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("release of a completed record: %v; want ErrLockLost", err)
	}

	// Released, the key is free; a release of a record gone counts
	// as done.
	rel := Request("cred", "contract-released", "body")
	if res, err := s.Acquire(ctx, rel); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	for i := range 2 {
		if err := s.Release(ctx, rel.Key, rel.Token); err != nil {
			t.Fatalf("release %d: %v; want nil", i+1, err)
		}
	}
	if res, err := s.Acquire(ctx, Retry(rel)); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire after a release: %+v, %v; want created", res, err)
	}
}

// A lease that ran out is taken over by a retry of the same request,
// once, and the old owner has lost its lock; a record that expired is
// absent, and pruned.
func testTakeoverAndExpiry(t *testing.T, s store.Store) {
	ctx := context.Background()
	const lease = 200 * time.Millisecond
	req := Request("cred", "contract-stale", "body")
	req.LockTimeout = lease
	if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	time.Sleep(lease + 100*time.Millisecond)
	if res, err := s.Acquire(ctx, Request("cred", "contract-stale", "another body")); err != nil ||
		res.Outcome != store.OutcomeExisting || res.Record.Status != store.StatusInProgress {
		t.Fatalf("acquire of a stale lock by another request: %+v, %v; want the record, not a takeover", res, err)
	}
	retries := make([]store.AcquireRequest, 8)
	outcomes := make([]store.Outcome, len(retries))
	var wg sync.WaitGroup
	for i := range retries {
		retries[i] = Retry(req)
		wg.Go(func() {
			res, err := s.Acquire(ctx, retries[i])
			if err != nil {
				t.Errorf("retry %d: %v", i, err)
			}
			outcomes[i] = res.Outcome
		})
	}
	wg.Wait()
	takers := 0
	for _, o := range outcomes {
		if o == store.OutcomeTakenOver {
			takers++
		}
	}
	if takers != 1 {
		t.Fatalf("outcomes of concurrent retries after the lease ran out: %v; want one takeover", outcomes)
	}
	if err := s.Complete(ctx, req.Key, req.Token, &store.Response{Status: 201, Replayable: true}, time.Hour); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("complete by the owner taken over: %v; want ErrLockLost", err)
	}

	short := Request("cred", "contract-expiring", "body")
	short.LockTimeout, short.Retention = lease, lease
	if res, err := s.Acquire(ctx, short); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	if err := s.Complete(ctx, short.Key, short.Token, &store.Response{Status: 201, Replayable: true}, short.Retention); err != nil {
		t.Fatalf("complete: %v", err)
	}
	time.Sleep(short.Retention + 100*time.Millisecond)
	if n, err := s.Prune(ctx, 100); err != nil || n < 1 {
		t.Fatalf("prune after expiry: %d, %v; want the expired record deleted", n, err)
	}
	if res, err := s.Acquire(ctx, Retry(short)); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire after expiry: %+v, %v; want created anew", res, err)
	}
}

// A record whose lease is live never expires and is never pruned, and a
// completed record lives a full retention after its completion, however
// long its request ran.
func testLiveLeaseNeverExpires(t *testing.T, s store.Store) {
	ctx := context.Background()
	owner := Request("cred", "lease-key", "body")
	// A renewal may come late on a loaded machine: the lease has
	// room for several missed ones.
	owner.Retention, owner.LockTimeout = 1500*time.Millisecond, time.Second
	if res, err := s.Acquire(ctx, owner); err != nil || res.Outcome != store.OutcomeCreated {
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
		retry := Request("cred", owner.Key.Key, body)
		retry.Retention, retry.LockTimeout = owner.Retention, owner.LockTimeout
		res, err := s.Acquire(ctx, retry)
		if err != nil || res.Outcome != store.OutcomeExisting || res.Record.Status != store.StatusInProgress {
			t.Fatalf("acquire by a retry with %q while the lease is live: %+v, %v; want the in-progress record", body, res, err)
		}
	}
	if err := s.Complete(ctx, owner.Key, owner.Token, &store.Response{Status: 201, Replayable: true}, owner.Retention); err != nil {
		t.Fatalf("complete: %v", err)
	}
	completed := time.Now()
	time.Sleep(owner.Retention / 2)
	if n, err := s.Prune(ctx, 100); err != nil || n != 0 {
		t.Fatalf("prune within the retention after completion: %d, %v; want 0", n, err)
	}
	retry := Retry(owner)
	res, err := s.Acquire(ctx, retry)
	if err != nil || res.Outcome != store.OutcomeExisting || res.Record.Status != store.StatusCompleted {
		t.Fatalf("acquire %v after completion: %+v, %v; want the completed record", time.Since(completed), res, err)
	}
	time.Sleep(time.Until(completed.Add(owner.Retention + 100*time.Millisecond)))
	if n, err := s.Prune(ctx, 100); err != nil || n != 1 {
		t.Fatalf("prune a retention after completion: %d, %v; want 1", n, err)
	}
}

// Two stores sharing records, with different lock timeouts, at the
// store level: the takeover waits for the owner's lease.
func testLeaseIsTheRecords(t *testing.T, s store.Store) {
	ctx := context.Background()
	owner := Request("cred", "lease-owner", "body")
	owner.LockTimeout = 2 * time.Second
	if res, err := s.Acquire(ctx, owner); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	time.Sleep(300 * time.Millisecond)
	retry := Retry(owner)
	retry.LockTimeout = 100 * time.Millisecond
	res, err := s.Acquire(ctx, retry)
	if err != nil || res.Outcome != store.OutcomeExisting {
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
	if res, err := s.Acquire(ctx, retry); err != nil || res.Outcome != store.OutcomeExisting {
		t.Fatalf("acquire after a renewal: %+v, %v; want the owner's record", res, err)
	}
}

// Headers round-trip through both stores byte for byte, names included.
func testHeadersRoundTripExactly(t *testing.T, s store.Store) {
	ctx := context.Background()
	req := Request("cred", "bytes-key", "body")
	header := http.Header{
		"X-Ref":               {"a\x00b\xff", "", "\x80\xfe"},
		"Trailer:Grpc-Status": {"0"},
		"lower\x00case\xff":   {"v"},
		"Empty":               {},
	}
	if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	if err := s.Complete(ctx, req.Key, req.Token, &store.Response{Status: 200, Header: header, Body: []byte("\x00\xff"), Replayable: true, BodySize: 2}, req.Retention); err != nil {
		t.Fatalf("complete: %v", err)
	}
	res, err := s.Acquire(ctx, Retry(req))
	if err != nil || res.Outcome != store.OutcomeExisting || res.Record.Response == nil {
		t.Fatalf("replay: %+v, %v", res, err)
	}
	got := res.Record.Response.Header
	if len(got) != len(header) {
		t.Errorf("headers = %q, want %q", got, header)
	}
	for name, want := range header {
		if !slices.Equal(got[name], want) {
			t.Errorf("header %q = %q, want %q", name, got[name], want)
		}
	}
	if string(res.Record.Response.Body) != "\x00\xff" {
		t.Errorf("body = %q", res.Record.Response.Body)
	}
}

// A call whose reply was lost after it took effect is repeated with the
// same token, and finds its own effect: the acquire owns the record it
// created, the completion and the release are done.
func testRepeatedCallsFindTheirEffect(t *testing.T, s store.Store) {
	ctx := context.Background()
	req := Request("cred", "repeat-key", "body")
	for i := range 2 {
		if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != store.OutcomeCreated {
			t.Fatalf("acquire %d: %+v, %v; want created, the caller's", i+1, res, err)
		}
	}
	other := Retry(req)
	if res, err := s.Acquire(ctx, other); err != nil || res.Outcome != store.OutcomeExisting {
		t.Fatalf("acquire by another token: %+v, %v; want existing", res, err)
	}
	resp := &store.Response{Status: 201, Body: []byte("done"), Replayable: true, BodySize: 4}
	for i := range 2 {
		if err := s.Complete(ctx, req.Key, req.Token, resp, req.Retention); err != nil {
			t.Fatalf("complete %d: %v", i+1, err)
		}
	}
	if err := s.Complete(ctx, req.Key, other.Token, resp, req.Retention); !errors.Is(err, store.ErrLockLost) {
		t.Errorf("complete by another token: %v, want ErrLockLost", err)
	}
	if err := s.Release(ctx, req.Key, req.Token); !errors.Is(err, store.ErrLockLost) {
		t.Errorf("release of a completed record: %v, want ErrLockLost", err)
	}

	released := Request("cred", "repeat-release", "body")
	if res, err := s.Acquire(ctx, released); err != nil || res.Outcome != store.OutcomeCreated {
		t.Fatalf("acquire: %+v, %v", res, err)
	}
	for i := range 2 {
		if err := s.Release(ctx, released.Key, released.Token); err != nil {
			t.Fatalf("release %d: %v", i+1, err)
		}
	}
}

// "The owner is gone" is one rule: a renewal that reaches the store after
// the lease ended fails, as a takeover and a release would then succeed;
// one before it keeps the record from both. Renewal and release racing at
// the lease's end never both succeed (both may fail, each dated by its own
// statement's clock; the release succeeds when sent again).
func testLateRenewalVsRelease(t *testing.T, s store.Store) {
	ctx := context.Background()
	ins, ok := store.As[store.Inspector](s)
	if !ok {
		t.Fatalf("%T is not an Inspector", s)
	}
	const lease = 150 * time.Millisecond
	acquire := func(key string) store.AcquireRequest {
		t.Helper()
		req := Request("cred", key, "body")
		req.LockTimeout = lease
		if res, err := s.Acquire(ctx, req); err != nil || res.Outcome != store.OutcomeCreated {
			t.Fatalf("acquire: %+v, %v", res, err)
		}
		return req
	}

	late := acquire("late-renewal")
	time.Sleep(lease + 50*time.Millisecond)
	if err := s.Renew(ctx, late.Key, late.Token); !errors.Is(err, store.ErrLockLost) {
		t.Fatalf("a renewal after the lease ended: %v, want ErrLockLost", err)
	}
	if _, err := ins.DeleteRecord(ctx, late.Key, false, 0); err != nil {
		t.Fatalf("a release after the lease ended: %v", err)
	}

	for i := range 12 {
		req := acquire(fmt.Sprintf("race-%02d", i))
		// Around the lease's end, from a little before to a little after.
		time.Sleep(lease - 30*time.Millisecond + time.Duration(i)*5*time.Millisecond)
		var renewErr, releaseErr error
		var wg sync.WaitGroup
		wg.Go(func() { renewErr = s.Renew(ctx, req.Key, req.Token) })
		wg.Go(func() { _, releaseErr = ins.DeleteRecord(ctx, req.Key, false, 0) })
		wg.Wait()
		switch {
		case renewErr == nil && releaseErr == nil:
			t.Fatalf("race %d: the renewal and the release both succeeded", i)
		case renewErr != nil && !errors.Is(renewErr, store.ErrLockLost),
			releaseErr != nil && !errors.Is(releaseErr, store.ErrNoRecord):
			t.Fatalf("race %d: renewal %v, release %v", i, renewErr, releaseErr)
		case renewErr != nil && releaseErr != nil:
			// The renewal found the lease ended: so does a release now.
			if _, err := ins.DeleteRecord(ctx, req.Key, false, 0); err != nil {
				t.Fatalf("race %d: a release after the renewal failed: %v", i, err)
			}
		}
		if renewErr == nil {
			// Renewed: the lease is live again, and the owner completes.
			if err := s.Complete(ctx, req.Key, req.Token, &store.Response{Status: 201, Replayable: true}, time.Hour); err != nil {
				t.Fatalf("race %d: completing after a renewal: %v", i, err)
			}
		}
	}
}
