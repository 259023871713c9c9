package idempotency

// Several idempotency handlers on one request: nested (one on the site,
// one in a route), or at one level with overlapping matchers, which
// Caddy orders by path, not as written. Each enforces by its own key, as
// it would alone, with one exception: a handler stands down for the very
// record that a handler on the request's way owns and is executing (same
// records, same scope, same key), which it would otherwise find in
// progress and answer 409. A handler that does not enforce (shadow
// passing a request through, fail_open, optional without a key) owns
// nothing, so it makes none stand down. docs/guarantees.md states the
// rule for users.

import (
	"context"
	"errors"
	"sync/atomic"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
)

// ownedCtxKey is the context key of the records that the handlers on a
// request's way own while it executes: an *ownedRecord.
type ownedCtxKey struct{}

// ownedRecord is one record owned by a handler on a request's way, and
// those of the handlers around it.
type ownedRecord struct {
	records string
	key     store.RecordKey
	outer   *ownedRecord
	// unexecuted is set by a handler inside the owner that released its
	// own record, nothing having run, and answered the request itself
	// (answerUnexecuted): the owner has no answer to store either.
	unexecuted atomic.Bool
}

// withOwned returns ctx noting that the request executes under the
// record key of records, and that note.
func withOwned(ctx context.Context, records string, key store.RecordKey) (context.Context, *ownedRecord) {
	outer, _ := ctx.Value(ownedCtxKey{}).(*ownedRecord)
	o := &ownedRecord{records: records, key: key, outer: outer}
	return context.WithValue(ctx, ownedCtxKey{}, o), o
}

// markUnexecuted tells the handler around this one that owns a record
// on the request's way, if any, that the request did not execute.
func markUnexecuted(ctx context.Context) {
	if o, _ := ctx.Value(ownedCtxKey{}).(*ownedRecord); o != nil {
		o.unexecuted.Store(true)
	}
}

// ownedOnTheWay reports whether a handler that the request passed owns
// the record key of records and executes the request under it.
func ownedOnTheWay(ctx context.Context, records string, key store.RecordKey) bool {
	for o, _ := ctx.Value(ownedCtxKey{}).(*ownedRecord); o != nil; o = o.outer {
		if o.records == records && o.key == key {
			return true
		}
	}
	return false
}

// errRefusedWithin is the cause logged when a handler releases its
// record because a handler inside it refused the request.
var errRefusedWithin = errors.New("an idempotency handler inside this one answered the request without executing it")

// refusedWithin reports whether a handler inside this one, which set
// {http.idempotency.result} last, answered the request itself without
// executing it (finish): a 409 in progress, a 503 or a 400 is no answer
// to store for the retries of this handler's key, since nothing ran.
// A replay is an answer: the request ran once, under the other key.
func refusedWithin(repl *caddy.Replacer) bool {
	switch result, _ := repl.GetString(resultPlaceholder); result {
	case resultMismatch, resultInProgress, resultRejected, resultStoreError, resultUnreadable, resultUnverified:
		return true
	}
	return false
}
