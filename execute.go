package idempotency

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptrace"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Steps 7 to 9 (docs/how-it-works.md): executing a request that owns its
// record, then storing its response, or giving the key back when nothing
// can have run.

// execute runs the next handler for a request that owns its key, and
// stores its response, or releases the key if nothing can have run.
func (h *Handler) execute(q *request) error {
	r, repl := q.r, q.repl
	// The protected work must not be cancelled by the client going away:
	// that is exactly when a retry will come, and it must find a stored
	// response, not a half-done request. The work is bounded instead by
	// ExecutionTimeout, counted from the disconnect.
	//
	// The context also notes the record that the request executes under
	// (for a handler inside this one, nesting.go), and carries a trace
	// that notes whether any attempt got a connection to an upstream:
	// reverse_proxy sends its requests, and every lb_retries attempt, on
	// the request's context, and Go's transport (HTTP/1 and HTTP/2)
	// reports a connection before it writes anything to it.
	trace := newReachTrace()
	ownedCtx, owned := withOwned(context.WithoutCancel(r.Context()), h.records, q.rk)
	execCtx, cancel := context.WithCancel(httptrace.WithClientTrace(ownedCtx, &trace.trace))
	defer cancel()
	stopWatch := context.AfterFunc(r.Context(), func() {
		t := time.NewTimer(time.Duration(h.ExecutionTimeout))
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-execCtx.Done():
		}
	})
	defer stopWatch()

	h.setResult(repl, resultExecuted)
	ls := h.keepLock(q)
	// Every path stops the lease where its record is settled; this one
	// is for a path that would not, such as a panic, since a lease left
	// in liveLocks would answer its key as in progress for good.
	defer ls.stop()
	rec := newRecorder(q.w, h.MaxResponseBody)
	panicked, err := serveRecovering(q.next, rec, r.WithContext(execCtx))
	if panicked == errResendRefused {
		// The trace stopped a second sending of the request: an answer
		// like any failed attempt that reached the upstream.
		panicked, err = nil, errResendRefused
	}
	if panicked != nil {
		// reverse_proxy panics with http.ErrAbortHandler when the
		// upstream fails in the middle of its response, and `abort`
		// always does. Unrecorded, the record would stay in progress,
		// and every retry get 409 until the record expired. The upstream
		// may have acted, so the answer stored is the outcome-unknown
		// one, not the part of a response that the client got.
		h.logger.Error("idempotency.outcome_unknown", q.fields(zap.Any("panic", panicked))...)
		if resp := probOutcomeUnknown.worded(h.words).response(); h.storeStatus.stores(resp.Status) {
			h.complete(q, resp, ls)
		} else {
			ls.stop()
			h.releaseUnstored(q, resp.Status)
		}
		panic(panicked)
	}
	// The body has been handed on (and read to its end): let it go
	// before the completion copies the response, so that a request holds
	// its body or its response's copies, not both.
	r.Body = http.NoBody

	if (refusedWithin(repl) || owned.unexecuted.Load()) && !trace.reached.Load() {
		// Nothing ran: the key is released, and the answer of the handler
		// that refused stays the result, since the client got it.
		ls.stop()
		if !h.release(q, errRefusedWithin) {
			h.setResult(repl, resultStoreError)
		}
		return h.answerUnexecuted(q, rec, err)
	}
	if err != nil && !rec.wroteHeader {
		_, proxied := repl.Get(upstreamPlaceholder)
		if execCtx.Err() == nil && !trace.reached.Load() && nothingExecuted(err, proxied) {
			ls.stop()
			result := resultReleased
			if !h.release(q, err, zap.Int("status", unexecutedStatus(err))) {
				result = resultStoreError
			}
			h.setResult(repl, result)
			return h.answerUnexecuted(q, rec, err)
		}
	}
	resp := rec.response(h.excluded)
	// An error before any response, or a cut-off execution (reverse_proxy
	// answers 499 when execution_timeout cancels it, with nothing the
	// retry could use), leaves the outcome unknown: the upstream may
	// have acted on the request. Storing that answer is what keeps a
	// retry from running it a second time.
	if err != nil && !rec.wroteHeader || execCtx.Err() != nil || rec.status == statusClientClosedRequest {
		p := probOutcomeUnknown.worded(h.words)
		var he caddyhttp.HandlerError
		if errors.As(err, &he) && he.StatusCode >= 500 {
			p.Status = he.StatusCode
		}
		h.logger.Error("idempotency.outcome_unknown", q.fields(zap.Bool("execution_timeout", execCtx.Err() != nil), zap.Error(err))...)
		h.answerOwn(rec, p)
		resp = p.response()
	}

	if !h.storeStatus.stores(resp.Status) {
		// A webhook's failed delivery: the sender's next attempt must
		// execute, not replay the failure (outcome-unknown included).
		ls.stop()
		h.releaseUnstored(q, resp.Status)
		return h.executed(err, true)
	}
	stored := h.complete(q, resp, ls)
	if c := h.logger.Check(zapcore.DebugLevel, "idempotency.executed"); c != nil && stored {
		c.Write(q.fields(zap.Int("status", resp.Status))...)
	}
	return h.executed(err, stored)
}

// answerUnexecuted answers a request whose key was released because
// nothing ran, when the next handler gave an error and no response,
// instead of returning the error: Caddy would run the error routes
// (handle_errors, a subroute's errors) on it, outside this handler's
// protection, and a reverse_proxy fallback there would execute every
// retry of the key. The status is the one Caddy would have sent.
func (h *Handler) answerUnexecuted(q *request, rec *recorder, err error) error {
	markUnexecuted(q.r.Context())
	if err == nil || rec.wroteHeader {
		return err
	}
	p := probNotExecuted.worded(h.words)
	p.Status = unexecutedStatus(err)
	h.answerOwn(rec, p)
	return h.executed(err, true)
}

// unexecutedStatus is the status Caddy answers err with.
func unexecutedStatus(err error) int {
	var he caddyhttp.HandlerError
	if errors.As(err, &he) && he.StatusCode >= 400 && he.StatusCode < 600 {
		return he.StatusCode
	}
	return http.StatusInternalServerError
}

// statusClientClosedRequest is what reverse_proxy writes when its
// request's context is cancelled.
const statusClientClosedRequest = 499

// serveRecovering calls next, and returns what it panicked with, if it
// did, instead of panicking.
func serveRecovering(next caddyhttp.Handler, w http.ResponseWriter, r *http.Request) (panicked any, err error) {
	defer func() { panicked = recover() }()
	return nil, next.ServeHTTP(w, r)
}

// reachTrace notes whether a request got a connection to an upstream,
// and refuses to send a request to an upstream a second time.
//
// Go's HTTP/1 transport sends a request again, on a new connection, when
// a reused connection breaks after the request was written and before
// any answer: for GET and the like, and for any bodiless request that
// carries a canonical Idempotency-Key or X-Idempotency-Key header (the
// transport takes it for leave to retry). hideKeyFromTransport re-files
// the client's header, but a `header_up Idempotency-Key ...` behind this
// handler puts it back; and reverse_proxy's own retries, with an
// lb_retry_match that allows the method, send a written request to the
// next upstream. Either way the upstream may have acted on the first
// sending, so a new connection asked for while a written HTTP/1 request
// has had no answer is refused: the request ends as outcome-unknown,
// never executed twice. HTTP/2 is left alone: its transport re-sends
// only streams that the server refused unprocessed (REFUSED_STREAM,
// GOAWAY).
type reachTrace struct {
	trace   httptrace.ClientTrace
	reached atomic.Bool
	// unanswered is set when an HTTP/1 request was written (its first
	// field, Host, went out) and cleared by the first byte of an answer.
	unanswered atomic.Bool
}

// errResendRefused is what a reachTrace panics with, in the goroutine
// that sends the request, to stop the transport from sending it again.
var errResendRefused = errors.New("idempotency: refused to send a protected request to an upstream a second time")

func newReachTrace() *reachTrace {
	t := new(reachTrace)
	t.trace.GetConn = func(string) {
		if t.unanswered.Load() {
			panic(errResendRefused)
		}
	}
	t.trace.GotConn = func(httptrace.GotConnInfo) { t.reached.Store(true) }
	t.trace.WroteHeaderField = func(name string, _ []string) {
		// HTTP/2 writes ":authority" and the other pseudo-fields first.
		if name == "Host" {
			t.unanswered.Store(true)
		}
	}
	t.trace.GotFirstResponseByte = func() { t.unanswered.Store(false) }
	return t
}

// upstreamPlaceholder is set by reverse_proxy (and php_fastcgi,
// forward_auth) for every upstream it tries, before it dials.
const upstreamPlaceholder = "http.reverse_proxy.upstream.address"

// nothingExecuted reports whether err, returned without a response by a
// request that got no connection to any upstream, proves that the
// request never reached one, so that releasing its key cannot cause a
// second execution. proxied says whether a reverse_proxy picked an
// upstream for the request (or for an earlier one on its replacer).
func nothingExecuted(err error, proxied bool) bool {
	// A dial error, or reverse_proxy's "no upstreams available" (a 503
	// without a dial error): the last attempt sent nothing, and the trace
	// says no earlier one did.
	var dialErr reverseproxy.DialError
	if errors.As(err, &dialErr) {
		return true
	}
	var he caddyhttp.HandlerError
	if !errors.As(err, &he) {
		return false
	}
	if he.StatusCode == http.StatusServiceUnavailable && he.Err != nil && he.Err.Error() == "no upstreams available" {
		return true
	}
	// A 4xx is a handler refusing the request (a static error, a rate
	// limit), unless a reverse_proxy took part: handle_response's
	// `error` answers after the upstream acted, and a transport that no
	// trace sees (FastCGI) may have sent the request. 499 is
	// reverse_proxy's "canceled" after the request may have been sent.
	return !proxied && he.StatusCode >= 400 && he.StatusCode < 500 && he.StatusCode != 499
}
