package idempotency

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/errlog"
	"github.com/caddy-idempotency/idempotency/store"
	"go.uber.org/zap"
)

// renewLocks renews locks through store, in one round trip when it can:
// when st, or a store it wraps, renews many at once. A wrapper that
// watches renewals (the cache, the metrics) implements LockRenewer
// itself, and is found first.
func renewLocks(ctx context.Context, st store.Store, locks []store.HeldLock) []error {
	if r, ok := store.As[store.LockRenewer](st); ok {
		return r.RenewLocks(ctx, locks)
	}
	errs := make([]error, len(locks))
	var wg sync.WaitGroup
	for i, l := range locks {
		wg.Go(func() { errs[i] = st.Renew(ctx, l.Key, l.Token) })
	}
	wg.Wait()
	return errs
}

// lockKeeper keeps the locks of a handler's requests in progress alive.
// Renewing each lock on a timer of its own cost a statement per lock per
// interval, and under load those statements queue with everything else;
// one tick renews every lock that is due at once. A tick comes every
// half renewal interval while any lock is held, and renews the locks
// dated at least that long ago: a lock's renewal is sent between half an
// interval and an interval after it was last dated, as it was when each
// lock had its own timer. An idle handler has no tick.
//
// A tick does not wait for the renewals it sends: a statement stuck on a
// dead connection, or behind a slow database, must not hold up the
// renewals of the ticks after it. A lock whose renewal has had no answer
// for an interval is sent again with the next tick, beside the first
// attempt, which is left to succeed or fail on its own.
type lockKeeper struct {
	h  *Handler
	mu sync.Mutex
	// held is the locks of the requests running; timer is set while it
	// is not empty.
	held  map[*keptLock]struct{}
	timer *time.Timer
}

func newLockKeeper(h *Handler) *lockKeeper {
	return &lockKeeper{h: h, held: make(map[*keptLock]struct{})}
}

// keptLock is one request's lock. Its fields after credID are guarded by
// the keeper's mu.
type keptLock struct {
	lock        store.HeldLock
	key, credID string
	// dated is when the lock was last dated: when the acquire, or the
	// last renewal that succeeded, was sent.
	dated time.Time
	// inFlight counts the renewals of this lock that have had no answer
	// yet; lastSent is when the latest of them was sent.
	inFlight int
	lastSent time.Time
	lost     bool
	// completing: the record is being completed (lease.completing).
	completing bool
	// stopped: the request has let go of the lock (its record completed
	// or released). A renewal that ends later changes nothing in the
	// store (it renews only a record in progress under the token) and
	// tells nothing: it finds the lock gone, which is no loss.
	stopped bool
}

func (r *lockKeeper) period() time.Duration { return r.h.renewInterval() / 2 }

// keepLock renews the lock while the request runs, so that a request
// slower than LockTimeout is not taken over by a retry. The store dates
// a lock when a renewal reaches it, so no earlier than when it was sent:
// the lock is dated (request.dated) from when the acquire, or the last
// renewal, was sent. A renewal is due a third of the timeout after that
// at the latest, leaving room for two slow or failed attempts.
//
// The renewals go on while the response is being stored: a completion
// sent on a connection whose reply never comes (a database host gone
// silent, a failover without a reset) waits for its attempt's timeout,
// and the lease must not run out behind it while a retry could take the
// record over and execute it a second time.
func (h *Handler) keepLock(q *request) *lease {
	r := h.keeper
	l := &keptLock{lock: store.HeldLock{Key: q.rk, Token: q.token}, key: q.key, credID: q.credID, dated: q.dated}
	r.mu.Lock()
	r.held[l] = struct{}{}
	if r.timer == nil {
		r.timer = time.AfterFunc(r.period(), r.tick)
	}
	r.mu.Unlock()
	ls := &lease{r: r, l: l, fp: q.fp, r0: q.r, at: liveLockKey{h.records, q.rk}}
	liveLocks.mu.Lock()
	liveLocks.m[ls.at] = ls
	liveLocks.mu.Unlock()
	return ls
}

// liveLocks holds the leases of the requests that execute in this
// process, by their records and key, across handlers and configs.
//
// A lease ends by the database's clock, and a partition between this
// process and its database (a network cut, a failover that takes longer
// than lock_timeout) lets it end while the owner still runs: its
// renewals did not arrive. Another instance may then take the record
// over, which no instance can prevent; but a retry sent to this process,
// the usual case of a client whose connection the outage broke, need not.
// Nor may its acquire be sent at all: one sent early in a partition can
// sit in the network and reach the database after the lease has ended,
// where it takes the record over. The owner is alive here, and once the
// store answers again its completion, under a token nobody replaced,
// still stores the response. So an acquire of a key whose owner runs here
// is answered as in progress without asking the store (heldHere).
//
// A map under a lock rather than a sync.Map: every acquire looks a key
// up, and a sync.Map's keys are interfaces, which cost the lookup, the
// insert and the delete an allocation each.
var liveLocks = struct {
	mu sync.Mutex
	m  map[liveLockKey]*lease
}{m: make(map[liveLockKey]*lease)}

type liveLockKey struct {
	records string
	rk      store.RecordKey
}

// forgetLiveLock stops answering key's retries for the owner that runs
// here: an operator released its record (force), and the next request
// with the key is to execute, while the owner runs on.
func forgetLiveLock(records string, key store.RecordKey) {
	liveLocks.mu.Lock()
	delete(liveLocks.m, liveLockKey{records, key})
	liveLocks.mu.Unlock()
}

// heldHere returns the record that an owner in this process holds for
// key, to answer an acquire of it: while the owner runs, and while it
// completes with a renewal overdue. A completion that is on time is left
// to the store to answer, since it may have been stored already, and a
// request waiting for it (`wait`) must then find the response, not the
// owner that is about to let go.
func heldHere(records string, key store.RecordKey) *store.Record {
	liveLocks.mu.Lock()
	ls := liveLocks.m[liveLockKey{records, key}]
	liveLocks.mu.Unlock()
	if ls == nil {
		return nil
	}
	// A lock found lost counts too: a renewal that reached the store
	// after the lease ended finds it lost, though no one took it, and
	// the owner's completion may still store the response. If another
	// instance did take it, this process's retries wait for the owner
	// here to end, no longer.
	ls.r.mu.Lock()
	dated, stopped, completing := ls.l.dated, ls.l.stopped, ls.l.completing
	ls.r.mu.Unlock()
	if stopped || completing && time.Since(dated) < ls.r.h.renewInterval() {
		return nil
	}
	method, u := clientRequest(ls.r0)
	return &store.Record{Status: store.StatusInProgress, Fingerprint: ls.fp, Method: strings.ToUpper(method), Path: u.EscapedPath(),
		LockedAt: dated, TTL: time.Duration(ls.r.h.Retention)}
}

// lease is a request's hold on its lock, as keepLock renews it.
type lease struct {
	r *lockKeeper
	l *keptLock
	// What heldHere answers for the record: the request's fingerprint,
	// the request the client sent, and its place in liveLocks.
	fp [32]byte
	r0 *http.Request
	at liveLockKey
}

// completing notes that the record is being completed: from now on, a
// renewal that finds the lock gone may have met the completion itself,
// so it tells nothing; the completion finds out whether the lock was
// lost.
func (ls *lease) completing() {
	ls.r.mu.Lock()
	defer ls.r.mu.Unlock()
	ls.l.completing = true
}

// stop ends the renewals. It does not wait for a renewal in flight: one
// stuck in the store would hold the request up for as long, and a
// renewal that reaches the store after the record was completed or
// released finds no record in progress to change.
func (ls *lease) stop() {
	liveLocks.mu.Lock()
	if liveLocks.m[ls.at] == ls {
		delete(liveLocks.m, ls.at)
	}
	liveLocks.mu.Unlock()
	ls.r.mu.Lock()
	defer ls.r.mu.Unlock()
	delete(ls.r.held, ls.l)
	ls.l.stopped = true
}

// tick sends the renewal of the locks that are due, then sets the next
// tick if any lock is still held.
func (r *lockKeeper) tick() {
	start := time.Now()
	period, interval := r.period(), r.h.renewInterval()
	r.mu.Lock()
	defer r.mu.Unlock()
	var due []*keptLock
	for l := range r.held {
		switch {
		case l.lost:
		case l.inFlight == 0 && start.Sub(l.dated) >= period,
			l.inFlight > 0 && start.Sub(l.lastSent) >= interval:
			l.inFlight++
			l.lastSent = start
			due = append(due, l)
		}
	}
	if len(due) > 0 {
		go r.renew(due)
	}
	if len(r.held) == 0 {
		r.timer = nil
		return
	}
	r.timer.Reset(max(0, time.Until(start.Add(period))))
}

// renew renews due in one round trip and records each lock's outcome.
func (r *lockKeeper) renew(due []*keptLock) {
	locks := make([]store.HeldLock, len(due))
	for i, l := range due {
		locks[i] = l.lock
	}
	ctx, cancel := r.h.storeCall(context.Background(), store.CallTimeout)
	dated := time.Now() // the locks renewed, as the store dates them
	errs := renewLocks(ctx, r.h.store, locks)
	cancel()
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, l := range due {
		l.inFlight--
		switch err := errs[i]; {
		case l.stopped:
		case errors.Is(err, store.ErrLockLost) && l.completing:
			l.lost = true
		case err == nil:
			if dated.After(l.dated) {
				l.dated = dated
			}
		case errors.Is(err, store.ErrLockLost):
			// Another request has the record: renewing it again
			// cannot help. The completion finds the lock lost.
			if !l.lost {
				l.lost = true
				r.h.metrics.lockLost.renew.Inc()
				r.h.logger.Error("idempotency.lock_lost",
					zap.String("key", l.key), zap.String("credential_id", l.credID),
					zap.String("during", "renew"))
			}
		default:
			// Not dated anew: the next tick that finds it due tries
			// again.
			if ok, suppressed := r.h.storeLog.allow(store.OpRenew); ok {
				r.h.logger.Error("idempotency.store_error", errlog.Fields(store.OpRenew, err, suppressed,
					zap.String("key", l.key), zap.String("credential_id", l.credID))...)
			}
		}
	}
}

// renewInterval is the longest a lock goes without a renewal sent: a
// third of the lock timeout.
func (h *Handler) renewInterval() time.Duration { return time.Duration(h.LockTimeout) / 3 }
