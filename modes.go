package idempotency

// The client-friendly modes: wait (wait.go), mismatch_status, shadow and
// on_store_error. Each changes what one step of the request path does
// when it would refuse a request; the path itself is ServeHTTP, in
// module.go, the one path a protected request takes in every mode.

import (
	"fmt"
	"net/http"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
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
	w, ok := store.As[store.Waiter](h.store)
	if !ok {
		return fmt.Errorf("wait: the store %T cannot wake waiting requests", store.Innermost(h.store))
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

// resultPlaceholder is where a protected request's result is kept, for
// access logs, for handlers around this one (nesting.go) and for the
// metrics, which count it once the request is done.
const resultPlaceholder = "http.idempotency.result"

// setResult sets the request's result r, named as this mode names it:
// the one place a result gets its name.
func (h *Handler) setResult(repl *caddy.Replacer, r string) {
	if h.Shadow {
		r = shadowPrefix + r
	}
	repl.Set(resultPlaceholder, r)
}

// The one policy that tells the modes apart: what a request that does
// not execute under its record gets. Enforcement answers the verdict;
// shadow mode logs it and hands the request on, unrecorded, under the
// result shadow_<result>; on_store_error fail_open hands a request on when
// the store failed.

// handOn passes the request to the next handler, unprotected, with its
// body if step 3 read it. It owns no record, so handlers inside this one
// enforce as they would alone (nesting.go).
func (q *request) handOn() error {
	if q.bodyRead {
		restoreBody(q.r, q.body, nil)
	}
	return q.next.ServeHTTP(q.w, q.r)
}

// pass hands q on under result, as this mode shows it.
func (h *Handler) pass(q *request, result string) error {
	h.setResult(q.repl, result)
	return q.handOn()
}

// answer ends q with the verdict v: enforcement answers it, shadow mode
// hands the request on.
func (h *Handler) answer(q *request, v verdict) error {
	if h.Shadow {
		return h.pass(q, v.result)
	}
	return h.finish(q.w, q.repl, v.result, v.prob, v.retryAfter)
}

// refuse ends a client error of q (a missing or malformed key, a
// missing credential, a body it cannot take) with the problem p. Shadow
// mode logs what it would have answered, at debug level, as enforcement
// does its rejections.
func (h *Handler) refuse(q *request, key string, p problem) error {
	if !h.Shadow {
		return h.reject(q.w, q.repl, key, p)
	}
	if c := h.logger.Check(zapcore.DebugLevel, "idempotency.shadow"); c != nil {
		c.Write(zap.String("would", resultRejected), zap.String("key", key),
			zap.Int("status", p.Status), zap.String("title", p.Title))
	}
	return h.pass(q, resultRejected)
}

// storeFailed ends q, whose store failed (the error is logged): 503, or
// with on_store_error fail_open the request executes without
// protection, since this route prefers a possible duplicate to a 503.
// Shadow mode hands it on as a store error.
func (h *Handler) storeFailed(q *request) error {
	switch {
	case h.Shadow:
		return h.pass(q, resultStoreError)
	case h.OnStoreError != onStoreErrorFailOpen:
		return h.finish(q.w, q.repl, resultStoreError, probStoreUnavailable, h.retrySecs)
	}
	h.logger.Warn("idempotency.fail_open", q.fields()...)
	h.setResult(q.repl, resultFailOpen)
	if !q.bodyRead {
		// The body is unread, and goes on as it came; the key header
		// does not.
		hideKeyFromTransport(q.r.Header)
	}
	return q.handOn()
}
