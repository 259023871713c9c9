package idempotency

// The client-friendly modes: wait (wait.go), mismatch_status, shadow and
// on_store_error. Each changes what one step of the request path does
// when it would refuse a request; the path itself is in module.go.

import (
	"fmt"
	"net/http"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// The values of on_store_error.
const (
	onStoreErrorFailClosed = "fail_closed"
	onStoreErrorFailOpen   = "fail_open"
)

// Results, as {http.idempotency.result} shows them, besides those of the
// contract (module.go).
const (
	// resultNoKey: optional is on and the request carried no key; it
	// passed through unprotected.
	resultNoKey = "no_key"
	// resultFailOpen: the store failed and on_store_error is fail_open;
	// the request executed unprotected.
	resultFailOpen = "fail_open"
	// shadowPrefix prefixes every result in shadow mode: shadow_replayed
	// is a request that would have been replayed and executed instead.
	shadowPrefix = "shadow_"
)

// provisionModes sets the modes' defaults and prepares the store for
// `wait`.
func (h *Handler) provisionModes() error {
	if h.MismatchStatus == 0 {
		h.MismatchStatus = http.StatusConflict
	}
	if h.OnStoreError == "" {
		h.OnStoreError = onStoreErrorFailClosed
	}
	if h.Wait <= 0 || h.Shadow {
		return nil
	}
	w, ok := storeAs[Waiter](h.store)
	if !ok {
		return fmt.Errorf("wait: the store %T cannot wake waiting requests", innermost(h.store))
	}
	if err := w.EnableWaiting(); err != nil {
		return fmt.Errorf("wait: %w", err)
	}
	h.waiter = w
	return nil
}

func (h *Handler) validateModes() error {
	if h.Wait < 0 {
		return fmt.Errorf("wait must not be negative")
	}
	if h.MismatchStatus != http.StatusConflict && h.MismatchStatus != http.StatusUnprocessableEntity {
		return fmt.Errorf("mismatch_status must be 409 or 422, not %d", h.MismatchStatus)
	}
	if h.OnStoreError != onStoreErrorFailClosed && h.OnStoreError != onStoreErrorFailOpen {
		return fmt.Errorf("on_store_error must be %s or %s, not %q", onStoreErrorFailClosed, onStoreErrorFailOpen, h.OnStoreError)
	}
	return nil
}

// mismatchProblem is the answer to a key reused with another request,
// with the configured status.
func (h *Handler) mismatchProblem() problem {
	p := probKeyReused
	p.Status = h.MismatchStatus
	return p
}

// result is r as {http.idempotency.result} shows it in this mode.
func (h *Handler) result(r string) string {
	if h.Shadow {
		return shadowPrefix + r
	}
	return r
}

// failOpen executes a request whose record could not be acquired,
// without protection: on_store_error fail_open says that this route
// prefers a possible duplicate to a 503.
func (h *Handler) failOpen(q *request, body []byte) error {
	h.logger.Warn("idempotency.fail_open", q.fields()...)
	q.repl.Set("http.idempotency.result", resultFailOpen)
	restoreBody(q.r, body, nil)
	return q.next.ServeHTTP(q.w, q.r)
}

// serveShadow is ServeHTTP in shadow mode. Every step runs as in
// ServeHTTP, and decides as it does (decide, confirmLate), and a request
// that owns its key is executed and recorded as usual, so that the
// records are those enforcement would start from. Where ServeHTTP would
// refuse a request (a replay, a conflict, a client error, a store
// error), the request is executed anyway, unrecorded, and what would have
// happened is logged and set as the result. It starts from what identify
// made of the request (q's key and record key, idProb, err).
func (h *Handler) serveShadow(q *request, idProb *problem, err error) error {
	r, key := q.r, q.key
	// pass executes the request without recording it; a body that was
	// read must have been restored. It owns no record, so handlers
	// inside this one enforce as they would alone (nesting.go).
	pass := func(result string) error {
		q.repl.Set("http.idempotency.result", shadowPrefix+result)
		return q.next.ServeHTTP(q.w, r)
	}
	wouldReject := func(key string, p problem) {
		if c := h.logger.Check(zapcore.DebugLevel, "idempotency.shadow"); c != nil {
			c.Write(zap.String("would", resultRejected), zap.String("key", key),
				zap.Int("status", p.Status), zap.String("title", p.Title))
		}
	}

	switch {
	case err != nil:
		h.storeError(q, "credential_secret", err)
		return pass(resultStoreError)
	case idProb != nil:
		wouldReject(key, *idProb)
		return pass(resultRejected)
	case key == "" && h.keyPointer == nil:
		return pass(resultNoKey)
	}
	q.credID = credentialID(q.rk.CredentialHash)
	body, held, prob := h.readBody(r)
	defer h.bodyBudget.release(held)
	if prob != nil {
		wouldReject(key, *prob)
		restoreBody(r, body, prob)
		return pass(resultRejected)
	}
	if h.keyPointer != nil {
		prob := h.keyFromBody(q, body)
		if prob != nil || q.key == "" || ownedOnTheWay(r.Context(), h.records, q.rk) {
			restoreBody(r, body, nil)
			switch {
			case prob != nil:
				wouldReject("", *prob)
				return pass(resultRejected)
			case q.key == "":
				return pass(resultNoKey)
			}
			return q.next.ServeHTTP(q.w, r)
		}
	}
	q.fp = fingerprint(headOf(r), body)
	restoreBody(r, body, nil)

	h.executing.Add(1)
	defer h.executing.Add(-1)
	q.token = newLockToken()
	q.dated = time.Now() // see ServeHTTP
	acq, err := h.acquire(r.Context(), h.acquireRequest(q), logHost(r))
	if err != nil {
		h.storeError(q, "acquire", err)
		return pass(resultStoreError)
	}
	if acq.Outcome == OutcomeExisting {
		d := h.decide(q, acq.Record)
		if c := h.logger.Check(zapcore.InfoLevel, "idempotency.shadow"); c != nil {
			d.write(c, q, zap.String("would", d.result))
		}
		return pass(d.result)
	}
	if refused := h.confirmLate(q); refused != nil {
		return pass(refused.result)
	}
	return h.execute(q)
}
