package idempotency

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/errlog"
	"github.com/caddy-idempotency/idempotency/store"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// The store calls a protected request makes, in the order it makes them:
// acquire (and, with `wait`, wait for the same request in progress),
// renew while it executes, then complete, or release when nothing ran or
// nothing is to be stored. Each is bounded by the store call timeout and
// logged, at most a line a second, as a store error when it fails.

// acquireRequest describes q to the store, under this handler's timings.
func (h *Handler) acquireRequest(q *request) store.AcquireRequest {
	method, u := clientRequest(q.r)
	return store.AcquireRequest{
		Key:         q.rk,
		Token:       q.token,
		Fingerprint: q.fp,
		Method:      strings.ToUpper(method),
		Path:        u.EscapedPath(),
		LockTimeout: time.Duration(h.LockTimeout),
		Retention:   time.Duration(h.Retention),
	}
}

func (h *Handler) acquire(ctx context.Context, req store.AcquireRequest, host string) (store.AcquireResult, error) {
	// Not cancelled by the client leaving: a cancelled statement may
	// have committed all the same, leaving a lock that nobody owns, and
	// every retry would get 409 until lock_timeout. A request that
	// acquires after its client left executes and is stored for the
	// retry, as step 7 has it.
	if rec := heldHere(h.records, req.Key); rec != nil {
		return store.AcquireResult{Outcome: store.OutcomeExisting, Record: rec}, nil
	}
	ctx, cancel := h.storeCall(context.WithoutCancel(ctx), store.CallTimeout)
	defer cancel()
	res, err := h.store.Acquire(ctx, req)
	if err == nil && res.Outcome == store.OutcomeTakenOver {
		// Logged here, where every acquire passes (a shadow one, one
		// while waiting), rather than by each caller.
		h.logger.Warn("idempotency.takeover", acquireFields(req, host, zap.Duration("lock_timeout", req.LockTimeout))...)
	}
	return res, err
}

// acquireFields are the fields of a line about the acquire req, sent to
// host: the request's as the store was told them, then extra.
func acquireFields(req store.AcquireRequest, host string, extra ...zap.Field) []zap.Field {
	return append([]zap.Field{zap.String("key", req.Key.Key), zap.String("credential_id", credentialID(req.Key.CredentialHash)),
		zap.String("host", host), zap.String("method", req.Method), zap.String("path", req.Path)}, extra...)
}

// storeError logs the failure of the store operation op for q, unless
// op has been logged less than a second ago (storeLog).
func (h *Handler) storeError(q *request, op string, err error) {
	ok, suppressed := h.storeLog.allow(op)
	if !ok {
		return
	}
	h.logger.Error("idempotency.store_error", errlog.Fields(op, err, suppressed, q.appendFields(make([]zap.Field, 0, 5))...)...)
}

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

// storeCall gives a store call its context, bounded by timeout. An
// InProcess store only takes a mutex: a bound would cost it a timer per
// call (a third of the memory store's Complete) and could never fire.
func (h *Handler) storeCall(parent context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	if h.inProcess {
		return parent, func() {}
	}
	return context.WithTimeout(parent, timeout)
}

// attemptTimeout bounds one attempt to complete a record: the store
// timeout, or half a renewal interval if that is shorter (complete).
func (h *Handler) attemptTimeout() time.Duration { return min(store.CallTimeout, h.renewInterval()/2) }

// renew dates the lock anew, in one bounded round trip.
func (h *Handler) renew(rk store.RecordKey, token store.LockToken) error {
	ctx, cancel := h.storeCall(context.Background(), store.CallTimeout)
	defer cancel()
	return h.store.Renew(ctx, rk, token)
}

// complete stores the response, then lets the lease go. The client
// already has it; a failure here leaves the record in progress until its
// lock expires, and then a retry would run again. So it is retried for
// as long as the store fails, for at most execution_timeout plus
// lock_timeout (what the pool and a graceful stop wait for), while ls
// goes on renewing the lock: a store that lost its connections (a
// restart, a failover) fails the first statements on each of the pool's
// dead connections before a fresh one is dialled, and a fixed few
// attempts can all meet one. Time during which the store cannot be
// reached does not count against the lease (leaseEndSQL), so an owner
// that waits out an outage longer than lock_timeout still stores its
// response before a retry can take over, and a lock that was taken over
// meanwhile fails the completion (ErrLockLost), which ends the wait. An
// attempt is given half a renewal interval, not the whole store timeout:
// a reply that never comes (a host gone silent) would otherwise use up
// the lease of a short lock_timeout before a second attempt, on a live
// connection, could be sent. A response that the store can never take
// (ErrUnstorable) is not retried: the record is completed as not
// replayable instead, so that a retry is refused, not executed. It
// reports whether the record holds the response (or that refusal).
func (h *Handler) complete(q *request, resp *store.Response, ls *lease) (stored bool) {
	ls.completing()
	defer ls.stop()
	var err error
	degraded, held := false, false
	deadline := time.Now().Add(time.Duration(h.ExecutionTimeout) + time.Duration(h.LockTimeout))
	sealing := withSealer(context.Background(), q.sealer)
	for backoff := 50 * time.Millisecond; ; backoff = min(2*backoff, time.Second) {
		ctx, cancel := h.storeCall(sealing, h.attemptTimeout())
		err = h.store.Complete(ctx, q.rk, q.token, resp, time.Duration(h.Retention))
		cancel()
		if errors.Is(err, store.ErrUnstorable) && !degraded {
			h.logger.Error("idempotency.unstorable_response", q.fields(zap.Int("status", resp.Status), zap.Error(err))...)
			resp, degraded = &store.Response{Status: resp.Status, BodySize: resp.BodySize}, true
			continue
		}
		if err == nil || errors.Is(err, store.ErrLockLost) || errors.Is(err, store.ErrUnstorable) || time.Now().Add(backoff).After(deadline) {
			break
		}
		if !held {
			held = true
			h.storeLog.holding()
		}
		time.Sleep(backoff)
	}
	switch {
	case errors.Is(err, store.ErrLockLost):
		h.metrics.lockLost.complete.Inc()
		h.logger.Error("idempotency.lock_lost", q.fields(zap.String("during", "complete"))...)
	case err != nil:
		h.storeError(q, "complete", err)
	}
	return err == nil
}

// release deletes the record of a request that never executed. It
// reports false if the store failed: the record is then still in
// progress, until its lock goes stale.
func (h *Handler) release(q *request, cause error, extra ...zap.Field) bool {
	ctx, cancel := h.storeCall(context.Background(), store.CallTimeout)
	defer cancel()
	switch err := h.store.Release(ctx, q.rk, q.token); {
	case errors.Is(err, store.ErrLockLost):
		// Nothing was released: the record is another request's now.
		h.metrics.lockLost.release.Inc()
		h.logger.Warn("idempotency.lock_lost", q.fields(zap.String("during", "release"))...)
		return true
	case err != nil:
		h.storeError(q, "release", err)
		return false
	}
	h.logger.Info("idempotency.release", q.fields(append([]zap.Field{zap.NamedError("cause", cause)}, extra...)...)...)
	return true
}

// releaseUnstored releases the record of a request whose response
// store_status does not store: the sender's next delivery executes.
func (h *Handler) releaseUnstored(q *request, status int) {
	cause := errNotStoredStatus
	if len(h.StoreStatus) == 0 {
		cause = errRefusedNotStored
	}
	result := resultReleased
	if !h.release(q, cause, zap.Int("status", status)) {
		result = resultStoreError
	}
	h.setResult(q.repl, result)
}

// The causes logged for a release of a response that is not stored: by
// store_status, or, without it, an upstream's refusal (refusedStatuses).
var (
	errNotStoredStatus  = errors.New("store_status does not store a response with this status")
	errRefusedNotStored = errors.New("the upstream refused the request before running it (401, 403 or 429): not stored, so that its retry executes")
)
