package idempotency

// The client-friendly modes: wait (wait.go), mismatch_status, shadow and
// on_store_error, and the one policy that tells them apart. The path is
// ServeHTTP, in module.go, the one path a protected request takes in
// every mode; each of its steps ends in a verdict, and the functions
// here (answer, refuse, storeFailed, existing, answerOwn, executed) are
// where a mode decides what the client gets for it. No other code asks
// which mode is on.

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
	if err := checkMismatchStatus(h.MismatchStatus); err != nil {
		return err
	}
	return checkOnStoreError(h.OnStoreError)
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

// The one policy that tells the modes apart: what a request gets for a
// verdict. Enforcement answers the verdict; shadow mode logs it and hands
// the request on, unrecorded, under the result shadow_<result>, and
// changes no response of a request it executes; on_store_error fail_open
// hands a request on when the store failed.

// handOn passes the request to the next handler, unprotected, with its
// body if step 3 read it. It owns no record, so handlers inside this one
// enforce as they would alone (nesting.go).
func (q *request) handOn() error {
	if q.bodyRead {
		restoreBody(q.r, q.body, q.bodyCut)
		hideKeyFromTransport(q.r.Header)
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

// existing answers a request whose key already has a record that this
// request does not own.
func (h *Handler) existing(q *request, rec *store.Record) error {
	d := h.decide(q, rec)
	if h.Shadow {
		// What enforcement would have answered, at the level that logs
		// it, and the request executes instead.
		if c := h.logger.Check(zapcore.InfoLevel, "idempotency.shadow"); c != nil {
			d.write(c, q, zap.String("would", d.result))
		}
		return h.pass(q, d.result)
	}
	if c := h.logger.Check(zapcore.InfoLevel, d.msg); c != nil {
		d.write(c, q)
	}
	if d.result != resultReplayed {
		if d.counts != nil {
			d.counts.Inc()
		}
		return h.finish(q.w, q.repl, d.result, d.prob, d.retryAfter)
	}
	h.metrics.replayAge.Observe(d.age)
	h.setResult(q.repl, resultReplayed)
	h.replay(q.w, q.r, rec.Response, d.gunzip)
	return nil
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

// answerOwn answers an executed request with p, the module's own answer,
// where the next handler wrote no response. Shadow mode changes no
// response.
func (h *Handler) answerOwn(rec *recorder, p problem) {
	if !h.Shadow && !rec.wroteHeader {
		p.write(rec, 0)
	}
}

// executed is what ServeHTTP returns for a request that executed under
// its record, once the record is settled (stored, or released unstored),
// given the next handler's error err. Enforcement has answered for err
// (answerOwn), and keeps it from Caddy's error routes, which would run
// outside this protection. Shadow mode changes no response: err goes on
// to the site's error handling, as it would without this handler.
func (h *Handler) executed(err error, settled bool) error {
	if h.Shadow {
		return err
	}
	if !settled {
		// The client has the response as it streamed, but not its end:
		// a chunked body's last chunk, an HTTP/2 stream's end, go out
		// only once this returns. A response that no retry will get
		// must not end as a success, so the connection is cut instead
		// (a body with a Content-Length may already be whole).
		panic(http.ErrAbortHandler)
	}
	return nil
}
