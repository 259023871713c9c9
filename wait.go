package idempotency

import (
	"context"
	"sync"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// acquireOrWait is acquire, except that with `wait` a request that finds
// the same request still in progress waits, up to Wait, for it to finish,
// and returns what it then finds: usually a completed record to replay,
// or a released one that this request now owns. A request still in
// progress at the deadline is returned as it is, for the usual 409.
//
// Waiting costs an Acquire as it starts and one per wake-up, not
// polling: the store wakes the waiter when the record is completed or
// released. It also wakes at least every LockTimeout, because an owner
// that died sends no news and its lock can only be taken over once it
// is stale.
func (h *Handler) acquireOrWait(ctx context.Context, req store.AcquireRequest, host string) (store.AcquireResult, error) {
	acq, err := h.acquire(ctx, req, host)
	if err != nil || h.waiter == nil || !waitable(acq, req) {
		return acq, err
	}
	start := time.Now()
	deadline := start.Add(time.Duration(h.Wait))
	waits := 0
	for {
		var waited bool
		acq, waited, err = h.waitOnce(ctx, req, host, deadline)
		if !waited || ctx.Err() != nil {
			break
		}
		waits++
	}
	if c := h.logger.Check(zapcore.DebugLevel, "idempotency.wait"); c != nil {
		c.Write(acquireFields(req, host, zap.Float64("waited_seconds", time.Since(start).Seconds()),
			zap.Int("waits", waits), zap.Bool("still_in_progress", err == nil && waitable(acq, req)))...)
	}
	return acq, err
}

// waitOnce registers for the record's completion, looks at the record
// (after registering, so that a completion in between is not missed),
// and if it is still in progress and the deadline is ahead, waits for
// news, the deadline, a stale lock or the client leaving. It returns what
// the look found, and whether it waited after it: if so, the caller must
// look again.
func (h *Handler) waitOnce(ctx context.Context, req store.AcquireRequest, host string, deadline time.Time) (acq store.AcquireResult, waited bool, err error) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := h.waiter.WaitCompleted(wctx, req.Key)
	acq, err = h.acquire(ctx, req, host)
	remaining := time.Until(deadline)
	if err != nil || !waitable(acq, req) || remaining <= 0 {
		return acq, false, err
	}
	t := time.NewTimer(min(remaining, time.Duration(h.LockTimeout)))
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	case <-ctx.Done():
	}
	return acq, true, nil
}

// waitable reports whether acq is the same request still in progress
// under another owner: what a waiter waits on. A different request under
// the key (a mismatch) gets its 409 at once.
func waitable(acq store.AcquireResult, req store.AcquireRequest) bool {
	return acq.Outcome == store.OutcomeExisting &&
		acq.Record.Status == store.StatusInProgress &&
		acq.Record.Fingerprint == req.Fingerprint
}

// waitSet is the in-process registry of waiters, keyed by record: all
// waiters of one record share one channel, closed to wake them. The zero
// value is ready to use.
type waitSet[K comparable] struct {
	mu sync.Mutex
	m  map[K]*waitEntry
}

type waitEntry struct {
	ch      chan struct{}
	waiters int
}

// wait returns the channel that wake(key) closes. The registration is
// dropped when ctx is done, so that keys whose records never complete
// (expired, pruned) do not accumulate.
func (s *waitSet[K]) wait(ctx context.Context, key K) <-chan struct{} {
	s.mu.Lock()
	if s.m == nil {
		s.m = make(map[K]*waitEntry)
	}
	e := s.m[key]
	if e == nil {
		e = &waitEntry{ch: make(chan struct{})}
		s.m[key] = e
	}
	e.waiters++
	s.mu.Unlock()
	context.AfterFunc(ctx, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		// After a wake the key may hold a newer entry: leave it alone.
		if s.m[key] == e {
			if e.waiters--; e.waiters == 0 {
				delete(s.m, key)
			}
		}
	})
	return e.ch
}

// wake wakes the waiters of key, if any.
func (s *waitSet[K]) wake(key K) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e, ok := s.m[key]; ok {
		close(e.ch)
		delete(s.m, key)
	}
}

// wakeAll wakes every waiter, so that each looks at its record again.
func (s *waitSet[K]) wakeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for key, e := range s.m {
		close(e.ch)
		delete(s.m, key)
	}
}
