package idempotency

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.uber.org/zap"
)

// HeldLock is a lock that its request still holds: a record key and the
// token that owns it.
type HeldLock struct {
	Key   RecordKey
	Token LockToken
}

// A LockRenewer renews many locks in one round trip. A handler renews
// every lock its requests hold together, once per tick, through a store
// that implements it (the Postgres store, in one statement); other
// stores get a Renew per lock. The error at i is lock i's, as Renew
// would return it: ErrLockLost for a lock that is no longer the
// caller's.
type LockRenewer interface {
	RenewLocks(ctx context.Context, locks []HeldLock) []error
}

// renewLocks renews locks through store, in one round trip when it can.
func renewLocks(ctx context.Context, store Store, locks []HeldLock) []error {
	if r, ok := store.(LockRenewer); ok {
		return r.RenewLocks(ctx, locks)
	}
	errs := make([]error, len(locks))
	var wg sync.WaitGroup
	for i, l := range locks {
		wg.Go(func() { errs[i] = store.Renew(ctx, l.Key, l.Token) })
	}
	wg.Wait()
	return errs
}

// lockRenewer keeps the locks of a handler's requests in progress alive.
// Renewing each lock on a timer of its own cost a statement per lock per
// interval, and under load those statements queue with everything else;
// one tick renews every lock that is due at once. A tick comes every
// half renewal interval while any lock is held, and renews the locks
// dated at least that long ago: a lock's renewal is sent between half an
// interval and an interval after it was last dated, as it was when each
// lock had its own timer. An idle handler has no tick.
type lockRenewer struct {
	h  *Handler
	mu sync.Mutex
	// held is the locks of the requests running; timer is set while it
	// is not empty, and while a tick runs.
	held  map[*heldLock]struct{}
	timer *time.Timer
}

// heldLock is one request's lock. Its fields after key are guarded by
// the renewer's mu.
type heldLock struct {
	lock        HeldLock
	key, credID string
	lockedSince time.Time
	// renewing is closed when the renewal in flight that includes this
	// lock ends; nil when there is none.
	renewing chan struct{}
}

func (r *lockRenewer) period() time.Duration { return r.h.renewInterval() / 2 }

// keepLock renews the lock while the request runs, so that a request
// slower than LockTimeout is not taken over by a retry. The store dates
// a lock when a renewal reaches it, so no earlier than when it was sent:
// lockedSince is when the acquire, or the last renewal, was sent. A
// renewal is due a third of the timeout after that at the latest,
// leaving room for two slow or failed attempts. stop waits for a renewal
// in flight, so that none races the completion, and returns when the
// lock was last dated.
func (h *Handler) keepLock(rk RecordKey, token LockToken, key, credID string, lockedSince time.Time) (stop func() time.Time) {
	r := h.renewer
	l := &heldLock{lock: HeldLock{Key: rk, Token: token}, key: key, credID: credID, lockedSince: lockedSince}
	r.mu.Lock()
	r.held[l] = struct{}{}
	if r.timer == nil {
		r.timer = time.AfterFunc(r.period(), r.tick)
	}
	r.mu.Unlock()
	return func() time.Time {
		r.mu.Lock()
		delete(r.held, l)
		done := l.renewing
		r.mu.Unlock()
		if done != nil {
			<-done
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		return l.lockedSince
	}
}

// tick renews the locks that are due, in one round trip, then sets the
// next tick if any lock is still held.
func (r *lockRenewer) tick() {
	start := time.Now()
	period := r.period()
	r.mu.Lock()
	var (
		due   []*heldLock
		locks []HeldLock
		done  = make(chan struct{})
	)
	for l := range r.held {
		if l.renewing == nil && start.Sub(l.lockedSince) >= period {
			l.renewing = done
			due = append(due, l)
			locks = append(locks, l.lock)
		}
	}
	r.mu.Unlock()

	if len(due) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
		sent := time.Now()
		errs := renewLocks(ctx, r.h.store, locks)
		cancel()
		r.mu.Lock()
		for i, l := range due {
			l.renewing = nil
			switch err := errs[i]; {
			case err == nil:
				l.lockedSince = sent
			case errors.Is(err, ErrLockLost):
				// Another request has the record: renewing it again
				// cannot help. The completion finds the lock lost.
				delete(r.held, l)
				r.h.logger.Error("idempotency.lock_lost",
					zap.String("key", l.key), zap.String("credential_id", l.credID),
					zap.String("during", "renew"))
			default:
				// Not dated anew: the next tick tries again.
				r.h.logger.Error("idempotency.store_error",
					zap.String("operation", "renew"), zap.String("key", l.key),
					zap.String("credential_id", l.credID), zap.Error(err))
			}
		}
		r.mu.Unlock()
		close(done)
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.held) == 0 {
		r.timer = nil
		return
	}
	r.timer.Reset(max(0, time.Until(start.Add(period))))
}
