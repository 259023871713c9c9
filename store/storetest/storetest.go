// Package storetest is the store contract's conformance suite: the
// calls of package store's Store, and of the capabilities a store
// offers, held against a store as the handler makes them, concurrency
// and real time included. A store, of this module or another, proves
// itself by running it from its tests:
//
//	func TestConformance(t *testing.T) {
//		storetest.Run(t, func(t *testing.T) store.Store { return newEmptyStore(t) })
//	}
//
// The memory and Postgres stores run it bare, and the handler's tests
// run it on each of them under the wrappers a handler puts around a
// store (metrics, the replay cache).
package storetest

import (
	"context"
	"crypto/sha256"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
)

// Run runs the suite on the stores that open returns: a store of its
// own for each test (the tests run in parallel), empty, and ready to
// serve, a Waiter's waiting enabled.
func Run(t *testing.T, open func(t *testing.T) store.Store) {
	t.Helper()
	for _, c := range []struct {
		name string
		fn   func(t *testing.T, s store.Store)
	}{
		{"Calls", testCalls},
		{"ConcurrentAcquireCreatesOnce", testConcurrentAcquireCreatesOnce},
		{"TakeoverAndExpiry", testTakeoverAndExpiry},
		{"LiveLeaseNeverExpires", testLiveLeaseNeverExpires},
		{"LeaseIsTheRecords", testLeaseIsTheRecords},
		{"HeadersRoundTripExactly", testHeadersRoundTripExactly},
		{"RepeatedCallsFindTheirEffect", testRepeatedCallsFindTheirEffect},
		{"CancelledContext", testCancelledContext},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.fn(t, open(t))
		})
	}
	// The capabilities' tests, for a store that offers them.
	probe := open(t)
	if _, ok := store.As[store.Inspector](probe); ok {
		t.Run("LateRenewalVsRelease", func(t *testing.T) {
			t.Parallel()
			testLateRenewalVsRelease(t, open(t))
		})
	}
	if _, ok := store.As[store.Waiter](probe); ok {
		t.Run("Waiter", func(t *testing.T) {
			t.Parallel()
			testWaiter(t, open(t))
		})
	}
}

// The lease and retention of Request's requests.
const (
	LockTimeout = 30 * time.Second
	Retention   = 24 * time.Hour
)

// Request is an acquire of key under credential, for a POST of body,
// with a token of its own: the same arguments make the same request
// (its fingerprint), as another attempt.
func Request(credential, key, body string) store.AcquireRequest {
	return store.AcquireRequest{
		Key:         store.RecordKey{CredentialHash: sha256.Sum256([]byte(credential)), Key: key},
		Token:       store.NewLockToken(),
		Fingerprint: sha256.Sum256([]byte("POST /v1/charges " + body)),
		Method:      http.MethodPost,
		Path:        "/v1/charges",
		LockTimeout: LockTimeout,
		Retention:   Retention,
	}
}

// Retry is the same request again, as another attempt that owns
// nothing.
func Retry(req store.AcquireRequest) store.AcquireRequest {
	req.Token = store.NewLockToken()
	return req
}

// MustAcquire acquires req from s, and fails t unless the outcome is
// want, with a record exactly when want is OutcomeExisting. It returns
// the record.
func MustAcquire(t testing.TB, s store.Store, req store.AcquireRequest, want store.Outcome) *store.Record {
	t.Helper()
	res, err := s.Acquire(context.Background(), req)
	if err != nil {
		t.Fatalf("acquire %q: %v", req.Key.Key, err)
	}
	if res.Outcome != want {
		t.Fatalf("acquire %q: outcome %v, want %v (record %+v)", req.Key.Key, res.Outcome, want, res.Record)
	}
	if (res.Record != nil) != (want == store.OutcomeExisting) {
		t.Fatalf("acquire %q: record %+v with outcome %v", req.Key.Key, res.Record, res.Outcome)
	}
	return res.Record
}

// Clock is a clock that a test moves by hand, for a store that takes
// one (the memory store's New).
type Clock struct {
	mu sync.Mutex
	t  time.Time
}

// NewClock returns a clock stopped at a fixed time.
func NewClock() *Clock {
	return &Clock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
}

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// Advance moves the clock by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// WaitFor polls cond every 10ms until it holds, and fails t if the
// timeout passes first.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
