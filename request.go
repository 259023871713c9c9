package idempotency

import (
	"encoding/hex"
	"errors"
	"net/http"
	"strings"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// The request path: ServeHTTP, the one path a protected request takes in
// every mode, step by step as docs/how-it-works.md numbers them, and the
// per-request value that carries what each step learns. Each step ends in
// a verdict that the mode policy (modes.go) answers.

// request is a protected request on its way through ServeHTTP's steps:
// what the steps have learned of it, and what every log line about it
// says (fields). Each step fills in what it learns, as reverse_proxy's
// handleResponseContext carries an attempt.
type request struct {
	w    http.ResponseWriter
	r    *http.Request
	repl *caddy.Replacer
	next caddyhttp.Handler

	key    string          // the key, as parsed from its header (step 1)
	rk     store.RecordKey // the record's key: the key under the credential (step 2)
	credID string          // the credential, as logs name it (credentialID)
	fp     [32]byte        // the fingerprint (step 4)
	// body is the request's body once it has been read (bodyRead, step
	// 3), which handOn gives back to the request: whole, or, where
	// reading stopped at bodyCut, the part read and then the rest.
	body     []byte
	bodyRead bool
	bodyCut  *problem
	token    store.LockToken // this request's claim on its record (step 5)
	// sealer seals and opens the request's record (seal.go), nil where
	// the handler does neither.
	sealer *sealer
	// dated is when the lock was last dated: no later than when the
	// store got the acquire, or the renewal, that dated it. Renewals
	// are timed from it.
	dated time.Time
}

// appendFields appends the fields of every line about the request to f.
func (q *request) appendFields(f []zap.Field) []zap.Field {
	return append(f, zap.String("key", q.key), zap.String("credential_id", q.credID),
		zap.String("host", logHost(q.r)), zap.String("method", q.r.Method), zap.String("path", clientPath(q.r)))
}

// fields are the request's fields, then extra.
func (q *request) fields(extra ...zap.Field) []zap.Field {
	return append(q.appendFields(make([]zap.Field, 0, 5+len(extra))), extra...)
}

// ServeHTTP is the request path, in the steps that docs/how-it-works.md
// numbers: the numbers below are its.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	// Methods compare case-insensitively: frameworks run `post` as POST.
	// ToUpper returns an upper-case method as it is, without allocating.
	method := strings.ToUpper(r.Method)
	_, protected := h.methods[method]
	if !protected && h.verifier == nil {
		return next.ServeHTTP(w, r)
	}
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	// A handler around this one that protects the request has set its
	// result, and counts the request by its final result when it is done.
	_, counted := repl.Get(resultPlaceholder)
	// Both placeholders are set on every protected request, so that an
	// access log shows an empty key rather than a missing field.
	repl.Set("http.idempotency.key", "")

	var sl *sealer
	if h.opening {
		sl = &sealer{table: h.sealTable, seal: h.sealing}
	}
	q := request{w: w, r: r, repl: repl, next: next, sealer: sl}

	// 0. A webhook delivery's signature, before anything else, whatever
	// its method, in every mode and under a handler around this one
	// (verify.go). A verified request of a method that is not protected
	// then goes on unrecorded, as any such request does.
	if h.verifier != nil {
		held, prob, err := h.verifyDelivery(&q)
		defer h.bodyBudget.release(held)
		if err != nil || prob != nil {
			if !counted {
				defer h.countResult(repl)
			}
			if prob != nil {
				return h.refuse(&q, "", *prob)
			}
			return h.unverified(&q, err)
		}
		if !protected {
			restoreBody(r, q.body, q.bodyCut)
			return next.ServeHTTP(w, r)
		}
	}

	// 1. Key, and 2. credential, hashed at once, and the key of a sealed
	// record extracted from it.
	key, rk, idProb, err := h.identify(r, repl, sl)
	if err == nil && idProb == nil && key != "" && ownedOnTheWay(r.Context(), h.records, rk) {
		// A handler around this one owns this very record and executes
		// the request under it (nesting.go): it stores the response.
		// Acquiring it again would find it in progress and answer 409.
		if q.bodyRead {
			restoreBody(r, q.body, q.bodyCut)
		}
		return next.ServeHTTP(w, r)
	}
	if !counted {
		defer h.countResult(repl)
	}
	q.key, q.rk = key, rk
	switch {
	case err != nil:
		h.storeError(&q, "credential_secret", err)
		return h.storeFailed(&q)
	case idProb != nil:
		return h.refuse(&q, key, *idProb)
	case key == "" && !h.bodyKeyed():
		return h.pass(&q, resultNoKey)
	}
	q.credID = credentialID(rk.CredentialHash)

	// 3. Body, read whole (bounded) and handed on intact, unless step 0
	// read it, and a key_json key read from it.
	if !q.bodyRead {
		body, held, prob := h.readBody(r)
		defer h.bodyBudget.release(held)
		q.body, q.bodyRead, q.bodyCut = body, true, prob
		if prob != nil {
			return h.refuse(&q, key, *prob)
		}
	}
	body := q.body
	if h.bodyKeyed() {
		switch prob := h.keyFromBody(&q, body); {
		case prob != nil:
			return h.refuse(&q, "", *prob)
		case q.key == "":
			// Without a key under `optional`.
			return h.pass(&q, resultNoKey)
		case ownedOnTheWay(r.Context(), h.records, q.rk):
			// Executed under this very record by a handler around this
			// one (as above).
			return q.handOn()
		}
	}

	// 4. Fingerprint.
	head := headOf(r)
	head.Source = h.credSource
	q.fp = fingerprint(head, body)
	if sl != nil {
		sl.fp = q.fp
	}

	// 5. Acquire, in one round trip (and, with `wait`, wait for the
	// same request in progress to finish). The store dates a lock when
	// the acquire reaches it, so the lock is dated from the acquire's
	// sending, not from the answer, which a loaded store may give late.
	h.executing.Add(1)
	defer h.executing.Add(-1)
	q.token = store.NewLockToken()
	q.dated = time.Now()
	acq, err := h.acquireOrWait(withSealer(r.Context(), sl), h.acquireRequest(&q), logHost(r))
	if errors.Is(err, store.ErrRecordUnreadable) {
		return h.unreadable(&q, err)
	}
	if err != nil {
		h.storeError(&q, "acquire", err)
		return h.storeFailed(&q)
	}

	// 6. An existing record.
	if acq.Outcome == store.OutcomeExisting {
		return h.existing(&q, acq.Record)
	}
	if refused := h.confirmLate(&q); refused != nil {
		return h.answer(&q, *refused)
	}

	// 7–9. Execute, then complete or release.
	restoreBody(r, body, nil)
	hideKeyFromTransport(r.Header)
	return h.execute(&q)
}

// verdict is what a request that is not executed under its record gets:
// the result that {http.idempotency.result} shows, and the problem that
// enforcement answers (none for a replay). Shadow mode executes the
// request instead, unrecorded, under the result (answer).
type verdict struct {
	result     string
	prob       problem
	retryAfter int
}

// confirmLate confirms the lock of an acquire answered later than a
// renewal would be due: the lock may be about to go stale, or a retry
// may already have taken it over, and nothing that runs can be taken
// back. Confirmed, the lock is dated from the confirmation (q.dated);
// otherwise it returns the verdict on a request that must not execute
// under it. That fails closed, whatever on_store_error says: the lock
// would go stale under the execution.
func (h *Handler) confirmLate(q *request) *verdict {
	if time.Since(q.dated) < h.renewInterval() {
		return nil
	}
	confirmed := time.Now()
	switch err := h.renew(q.rk, q.token); {
	case errors.Is(err, store.ErrLockLost):
		h.metrics.lockLost.renew.Inc()
		h.logger.Warn("idempotency.lock_lost", q.fields(zap.String("during", "confirm"))...)
		return &verdict{resultInProgress, probInProgress, h.retrySecs}
	case err != nil:
		// Nothing ran: give the key back if the store lets us, so that
		// the retry need not wait for the lock to go stale.
		h.storeError(q, "renew", err)
		h.release(q, err)
		return &verdict{resultStoreError, probStoreUnavailable, h.retrySecs}
	}
	q.dated = confirmed
	return nil
}

// credentialID is how logs and the CLI name a credential: the first 6
// bytes of its keyed hash, in hex, which no dictionary can reproduce
// without the secret.
func credentialID(hash [32]byte) string {
	return hex.EncodeToString(hash[:6])
}

// reject answers a request that is the client's error (steps 1–3), or
// that the body budget has no room for (503, to retry later).
func (h *Handler) reject(w http.ResponseWriter, repl *caddy.Replacer, key string, p problem) error {
	if c := h.logger.Check(zapcore.DebugLevel, "idempotency.rejected"); c != nil {
		c.Write(zap.String("key", key), zap.Int("status", p.Status), zap.String("title", p.Title))
	}
	retryAfter := 0
	switch p.Status {
	case http.StatusServiceUnavailable:
		retryAfter = h.retrySecs
	case http.StatusUnauthorized:
		w.Header().Set("WWW-Authenticate", h.challenge)
	}
	return h.finish(w, repl, resultRejected, p, retryAfter)
}

func (h *Handler) finish(w http.ResponseWriter, repl *caddy.Replacer, result string, p problem, retryAfter int) error {
	h.setResult(repl, result)
	p.worded(h.words).write(w, retryAfter)
	return nil
}

// Results, as {http.idempotency.result} shows them.
const (
	resultExecuted   = "executed"
	resultReplayed   = "replayed"
	resultMismatch   = "mismatch"
	resultInProgress = "in_progress"
	resultRejected   = "rejected"
	resultReleased   = "released"
	resultStoreError = "store_error"
	resultUnreadable = "unreadable"
)
