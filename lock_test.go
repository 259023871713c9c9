package idempotency

// The lock's life in the handler, from acquire to complete, against a
// store that answers late, fails, or loses the lock on cue: regression
// tests for what the invariant and fault tests found.

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
)

// scriptedStore wraps a store with hooks that run before its methods.
type scriptedStore struct {
	store.Store
	beforeAcquire  func(ctx context.Context)
	beforeRenew    func() error
	beforeComplete func() error
	renewing       atomic.Bool
}

func (s *scriptedStore) Acquire(ctx context.Context, req store.AcquireRequest) (store.AcquireResult, error) {
	if s.beforeAcquire != nil {
		s.beforeAcquire(ctx)
	}
	return s.Store.Acquire(ctx, req)
}

func (s *scriptedStore) Renew(ctx context.Context, key store.RecordKey, token store.LockToken) error {
	s.renewing.Store(true)
	defer s.renewing.Store(false)
	if s.beforeRenew != nil {
		if err := s.beforeRenew(); err != nil {
			return err
		}
	}
	return s.Store.Renew(ctx, key, token)
}

func (s *scriptedStore) Complete(ctx context.Context, key store.RecordKey, token store.LockToken, resp *store.Response, retention time.Duration) error {
	if s.beforeComplete != nil {
		if err := s.beforeComplete(); err != nil {
			return err
		}
	}
	return s.Store.Complete(ctx, key, token, resp, retention)
}

// A client that hangs up while its acquire is in flight must not leave a
// lock that nobody owns: the acquire runs to its end, and the request is
// executed and stored for the retry. Catches an acquire bound to the
// client's context (every retry then got 409 until lock_timeout, 30s by
// default).
func TestAcquireOutlivesClient(t *testing.T) {
	h, s, _ := lockHandler(t, 30*time.Second)
	ctx, hangUp := context.WithCancel(context.Background())
	s.beforeAcquire = func(actx context.Context) {
		hangUp()
		time.Sleep(20 * time.Millisecond)
		if actx.Err() != nil {
			t.Errorf("the acquire's context ended with the client's: %v", context.Cause(actx))
		}
	}
	var calls atomic.Int32
	serve(ctx, h, "hang-up-during-acquire", created(&calls))
	s.beforeAcquire = nil
	if got := serve(context.Background(), h, "hang-up-during-acquire", created(&calls)); got != http.StatusCreated || calls.Load() != 1 {
		t.Errorf("retry: status %d after %d executions, want a replay of the one execution", got, calls.Load())
	}
}

// An acquire that the store answers later than a renewal is due holds a
// lock that may already be taken over: it is confirmed before anything
// runs. Catches executing on a lock that a retry took over while the
// answer was on its way.
func TestLateAcquireIsConfirmed(t *testing.T) {
	const lockTimeout = 300 * time.Millisecond
	t.Run("lock lost meanwhile", func(t *testing.T) {
		h, s, logs := lockHandler(t, lockTimeout)
		lostBefore := counterValue(t, h.metrics.lockLost.renew)
		s.beforeAcquire = func(context.Context) { time.Sleep(lockTimeout / 2) }
		s.beforeRenew = func() error { return store.ErrLockLost }
		var calls atomic.Int32
		if got := serve(context.Background(), h, "late-and-lost", created(&calls)); got != http.StatusConflict {
			t.Errorf("status %d, want 409: another request owns the key", got)
		}
		if calls.Load() != 0 {
			t.Errorf("executed on a lost lock")
		}
		if logs.FilterMessage("idempotency.lock_lost").FilterField(zap.String("during", "confirm")).Len() != 1 {
			t.Errorf("no idempotency.lock_lost line for the confirmation: %v", logs.All())
		}
		if n := counterValue(t, h.metrics.lockLost.renew) - lostBefore; n != 1 {
			t.Errorf("caddy_idempotency_lock_lost_total{operation=\"renew\"} grew by %v, want 1", n)
		}
	})
	t.Run("still owned", func(t *testing.T) {
		h, s, _ := lockHandler(t, lockTimeout)
		s.beforeAcquire = func(context.Context) { time.Sleep(lockTimeout / 2) }
		var renewed atomic.Int32
		s.beforeRenew = func() error { renewed.Add(1); return nil }
		var calls atomic.Int32
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			if renewed.Load() == 0 {
				t.Errorf("executing before the late lock was confirmed")
			}
			return created(&calls).ServeHTTP(w, r)
		})
		if got := serve(context.Background(), h, "late-and-kept", next); got != http.StatusCreated || calls.Load() != 1 {
			t.Errorf("status %d after %d executions, want one execution", got, calls.Load())
		}
	})
}

// Shadow mode confirms a late acquire as enforcement does, before the
// request executes under it; where enforcement would refuse the request,
// it passes on unrecorded, under the result enforcement would give.
// Catches shadow mode executing on a lock that a retry may have taken
// over, and recording its response there.
func TestShadowLateAcquireIsConfirmed(t *testing.T) {
	const lockTimeout = 300 * time.Millisecond
	for _, tc := range []struct {
		name, key string
		renew     error
		result    string
	}{
		{"lock lost meanwhile", "shadow-late-and-lost", store.ErrLockLost, "shadow_in_progress"},
		{"store fails", "shadow-late-store-fails", errors.New("dial tcp 127.0.0.1:5432: connect: connection refused"), "shadow_store_error"},
		{"still owned", "shadow-late-and-kept", nil, "shadow_executed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, s, logs := lockHandler(t, lockTimeout)
			h.Shadow = true
			s.beforeAcquire = func(context.Context) { time.Sleep(lockTimeout / 2) }
			var renewed atomic.Int32
			s.beforeRenew = func() error { renewed.Add(1); return tc.renew }
			var calls atomic.Int32
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				if renewed.Load() == 0 {
					t.Errorf("executing before the late lock was confirmed")
				}
				return created(&calls).ServeHTTP(w, r)
			})
			status, result := serveResult(context.Background(), h, tc.key, next)
			if status != http.StatusCreated || calls.Load() != 1 {
				t.Errorf("status %d after %d executions: shadow mode must execute every request once", status, calls.Load())
			}
			if result != tc.result {
				t.Errorf("result %q, want %q", result, tc.result)
			}
			confirmLost := logs.FilterMessage("idempotency.lock_lost").FilterField(zap.String("during", "confirm")).Len()
			want := 0
			if tc.renew == store.ErrLockLost {
				want = 1
			}
			if confirmLost != want {
				t.Errorf("%d idempotency.lock_lost lines for the confirmation, want %d: %v", confirmLost, want, logs.All())
			}
		})
	}
}

// A renewal in flight when the request finishes races its completion:
// it reaches the store after the record is completed, changes nothing
// and reports nothing. Catches a renewal that, finding the record no
// longer in progress, logs idempotency.lock_lost at error level for a
// lock that was let go, not lost.
func TestRenewalDoesNotRaceCompletion(t *testing.T) {
	const lockTimeout = time.Second
	h, s, logs := lockHandler(t, lockTimeout)
	lostBefore := counterValue(t, h.metrics.lockLost.renew)
	renewStarted, renewEnded := make(chan struct{}), make(chan struct{})
	var once sync.Once
	s.beforeRenew = func() error {
		first := false
		once.Do(func() { first = true; close(renewStarted) })
		time.Sleep(100 * time.Millisecond)
		if first {
			defer close(renewEnded)
		}
		return nil
	}
	var calls atomic.Int32
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		<-renewStarted // finish while the first renewal is in flight
		return created(&calls).ServeHTTP(w, r)
	})
	if got := serve(context.Background(), h, "renew-then-complete", next); got != http.StatusCreated {
		t.Fatalf("status %d", got)
	}
	<-renewEnded
	time.Sleep(50 * time.Millisecond)
	if n := logs.FilterMessage("idempotency.lock_lost").Len(); n != 0 {
		t.Errorf("%d idempotency.lock_lost lines, want none: %v", n, logs.All())
	}
	// The critical alert counts this series: a renewal that met its own
	// completion lost nothing.
	if n := counterValue(t, h.metrics.lockLost.renew) - lostBefore; n != 0 {
		t.Errorf("caddy_idempotency_lock_lost_total{operation=\"renew\"} grew by %v, want 0", n)
	}
}

// A renewal that finds the lock taken over while the request runs is a
// real loss: one idempotency.lock_lost line and one count, however many
// renewals in flight find it. Catches the count moving out of the store's
// instrumentation and getting lost, or counting each renewal's answer.
func TestLostRenewalIsCountedOnce(t *testing.T) {
	const lockTimeout = 300 * time.Millisecond
	h, s, logs := lockHandler(t, lockTimeout)
	lostBefore := counterValue(t, h.metrics.lockLost.renew)
	s.beforeRenew = func() error {
		time.Sleep(lockTimeout / 2) // two renewals in flight at once
		return store.ErrLockLost
	}
	var calls atomic.Int32
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		time.Sleep(2 * lockTimeout)
		return created(&calls).ServeHTTP(w, r)
	})
	serve(context.Background(), h, "renewal-lost", next)
	if n := logs.FilterMessage("idempotency.lock_lost").FilterField(zap.String("during", "renew")).Len(); n != 1 {
		t.Errorf("%d idempotency.lock_lost lines during renew, want 1: %v", n, logs.All())
	}
	if n := counterValue(t, h.metrics.lockLost.renew) - lostBefore; n != 1 {
		t.Errorf("caddy_idempotency_lock_lost_total{operation=\"renew\"} grew by %v, want 1", n)
	}
}

// counterValue is c's value now.
func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// Storing the response is retried for as long as the lock cannot have
// been taken over, not a fixed few times: a store whose pooled
// connections were all killed fails one statement per dead connection.
// Catches giving up early (the record then stayed in progress and its
// retry executed a second time).
func TestCompleteRetriesWhileLockHolds(t *testing.T) {
	h, s, logs := lockHandler(t, 2*time.Second)
	var attempts atomic.Int32
	s.beforeComplete = func() error {
		if attempts.Add(1) <= 4 {
			return errors.New("FATAL: terminating connection due to administrator command (SQLSTATE 57P01)")
		}
		return nil
	}
	var calls atomic.Int32
	if got := serve(context.Background(), h, "complete-after-kills", created(&calls)); got != http.StatusCreated {
		t.Fatalf("status %d", got)
	}
	if attempts.Load() != 5 {
		t.Errorf("%d attempts to complete, want 5 (4 failures, then success)", attempts.Load())
	}
	if logs.FilterMessage("idempotency.store_error").Len() != 0 {
		t.Errorf("a store error was logged although the completion succeeded")
	}
	s.beforeComplete = nil
	serve(context.Background(), h, "complete-after-kills", created(&calls))
	if calls.Load() != 1 {
		t.Errorf("the retry executed again: the record was not completed")
	}
}

// A response whose completion failed for good (the store down for the
// whole lock) will not be replayed: it must not end as a success. The
// connection is cut (http.ErrAbortHandler) before the end of the
// response reaches the client. Catches a handler that returned normally,
// letting the client take an unrecorded answer for the final one.
//
// The completion is retried for execution_timeout plus lock_timeout (less
// the last backoff, at most 1s), and no longer: 2s here (the defaults
// make it 5 minutes).
func TestFailedCompletionCutsTheResponse(t *testing.T) {
	h, s, logs := lockHandler(t, time.Second)
	h.ExecutionTimeout = caddy.Duration(time.Second)
	s.beforeComplete = func() error { return errors.New("dial tcp 127.0.0.1:5432: connect: connection refused") }
	var calls atomic.Int32
	start := time.Now()
	panicked := func() (p any) {
		defer func() { p = recover() }()
		serve(context.Background(), h, "complete-fails", created(&calls))
		return nil
	}()
	if panicked != http.ErrAbortHandler {
		t.Fatalf("the handler ended with %v, want a panic with http.ErrAbortHandler", panicked)
	}
	if took := time.Since(start); took < time.Second || took > 20*time.Second {
		t.Errorf("the completion was given up after %v, want after execution_timeout + lock_timeout (2s), less a backoff", took)
	}
	if logs.FilterMessage("idempotency.store_error").Len() == 0 {
		t.Errorf("the failed completion was not logged")
	}
}
