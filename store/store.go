// Package store is the contract between the idempotency handler and the
// stores that keep its records: the Store interface, the capabilities a
// store may add to it, and the records, results and errors they
// exchange. It is a package of its own so that a store is written, in
// this module or another, against the contract alone, never against the
// handler's internals.
//
// A store keeps one record per RecordKey: a credential's keyed hash and
// the client's Idempotency-Key. Whatever its backend, it guarantees what
// the handler's promise of one execution per key rests on: Acquire
// creates a record, or takes over one whose lease has run out, for
// exactly one caller, and takes one over only for the same request (its
// fingerprint), since the dead owner may have executed; a record in
// progress under a live lease is never taken over and never expires;
// only the token that owns a record completes, renews or releases it,
// and a caller that lost it is told so (ErrLockLost); a completed record
// answers with its stored response until it expires. A call whose reply
// was lost may be sent again under the same token: Acquire finds the
// record its own, Complete and Release find their work done.
//
// Stores are Caddy guest modules in the namespace
// "http.handlers.idempotency.stores", selected by the "backend" field of
// the handler's "store" object. The handler wraps the store it is given
// (metrics, the replay cache); As finds a capability through the
// wrappers.
package store

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Store keeps idempotency records. Implementations are guest modules in
// the namespace "http.handlers.idempotency.stores", selected by the
// "backend" field of the handler's "store" object.
//
// A request's path costs two statements of the store (Acquire,
// Complete) for a first execution and one (Acquire) for a replay, none
// when the replay cache answers it (the handler's roundtrip_test.go
// counts them). A statement is not always a round trip of its own: the
// Postgres store sends the calls of concurrent requests together (its
// pgbatch.go), and a call whose reply was lost may cost a second
// statement that finds out what the first did.
type Store interface {
	// Acquire atomically either creates an in_progress record owned by
	// req.Token, with a lease of req.LockTimeout, or returns the record
	// that already exists. An existing record that has expired is
	// treated as absent; an in_progress record whose lease is live never
	// expires. An in_progress record whose lease has run out (the
	// record's own lease: the retrier's LockTimeout plays no part) and
	// whose fingerprint is req's (the same request, retried) is taken
	// over by exactly one caller (a compare-and-swap), which then owns
	// it with a lease of its own; a different request never takes over,
	// since the dead owner may have executed. A record in progress
	// under req.Token, with a live lease, is the caller's own, from an
	// earlier attempt whose reply was lost: OutcomeCreated. The body
	// of a completed record's Response is the caller's to read, not to
	// change: a store may share it between the requests it answers.
	Acquire(ctx context.Context, req AcquireRequest) (AcquireResult, error)

	// Complete stores resp on the record owned by token, marks it
	// completed and makes it expire retention from now. It returns
	// ErrLockLost if the caller no longer owns the record (another
	// request took it over), and an error wrapping ErrUnstorable if the
	// store can never take resp. Repeated by the token that completed
	// the record (its reply was lost), it returns nil and changes
	// nothing: the record expires as the completion made it. The caller
	// gives resp up: a store may keep its Body and Header as they are,
	// without a copy, and nothing changes them afterwards.
	Complete(ctx context.Context, key RecordKey, token LockToken, resp *Response, retention time.Duration) error

	// Release deletes the in_progress record owned by token, so that a
	// retry executes. It returns ErrLockLost if the record is another's
	// or completed; a record that is gone (an earlier attempt deleted
	// it) counts as released.
	Release(ctx context.Context, key RecordKey, token LockToken) error

	// Renew extends the lease of the record owned by token to now plus
	// the length the lease was given at Acquire, and keeps the record
	// from expiring before the lease ends, so that a slow request is
	// neither taken over nor forgotten while it runs. It returns
	// ErrLockLost if the caller no longer owns the record.
	Renew(ctx context.Context, key RecordKey, token LockToken) error

	// Prune deletes expired records in batches of at most batchSize rows
	// and returns how many it deleted. With a shared store, only one
	// caller prunes at a time; the others return 0 at once.
	Prune(ctx context.Context, batchSize int) (int64, error)
}

// Waiter is implemented by stores that can wake a request waiting for an
// in-progress record to finish (the handler's `wait`), so that waiting
// costs no polling. Both stores of this module implement it: memory with
// a channel, Postgres with LISTEN/NOTIFY.
type Waiter interface {
	// EnableWaiting is called once, at provision, by a handler that
	// waits. From then on Complete and Release wake the waiters of their
	// record, on every instance that shares the store, and WaitCompleted
	// works. A store may make completions cheaper without it (a NOTIFY
	// serialises commits in Postgres), so it is not always on. An error
	// says why the store cannot wake waiters, and the handler does not
	// start.
	EnableWaiting() error

	// WaitCompleted returns a channel that is closed when the record of
	// key is completed or released after the call, or when the store
	// may have missed that news (a lost notification connection): either
	// way, the caller must look at the record again, with Acquire. So
	// that no completion slips between a look and the wait, a caller
	// calls WaitCompleted first and then looks. The registration ends
	// when ctx is done.
	WaitCompleted(ctx context.Context, key RecordKey) <-chan struct{}
}

// SecretKeeper is implemented by stores that keep a default credential
// secret, which every handler sharing their records agrees on without
// configuration: in front of one, credential_secret may be left out.
type SecretKeeper interface {
	// UseCredentialSecret is called at provision by each handler that
	// hashes credentials under the store's secret: a store that reads
	// the secret as it starts (Postgres) reads it from then on.
	UseCredentialSecret()
	// CredentialSecret returns the secret, for the first request that
	// needs it.
	CredentialSecret(ctx context.Context) ([]byte, error)
}

// The store's calls, as the metrics' operation label and the
// store_error lines name them.
const (
	OpAcquire  = "acquire"
	OpComplete = "complete"
	OpRelease  = "release"
	OpRenew    = "renew"
	OpPrune    = "prune"
)

// MinSecretLen is the shortest credential secret, in bytes, that a
// handler accepts or a SecretKeeper keeps: the key size of HMAC-SHA-256,
// out of reach of a guess.
const MinSecretLen = 32

// CallTimeout bounds one store round trip: a store that does not answer
// within it has failed the call. Stores use it for what they do on a
// call's behalf (a connection's dial).
const CallTimeout = 5 * time.Second

// Named is implemented by stores that name themselves to an operator,
// in the admin API and the CLI: Name, such as "postgres:public.keys",
// tells two stores of one backend apart; Table and Database are empty
// where the backend has none.
type Named interface {
	StoreName() (name, backend, table, database string)
}

// Classifier is implemented by stores whose errors say, in their
// backend's terms, that the store did not answer: a server shutting
// down or starting up, a session ended, a standby's read-only answer
// during a failover. The handler reads refused, lost and timed-out
// connections alone; it frames an outage, and its log lines, by both.
type Classifier interface {
	Unanswered(err error) bool
}

// StartCounter is implemented by stores that start in the background,
// retried until their backend answers (Postgres: its migrations and the
// first read of its secret): the handler that provisioned the store
// gives it the counter of its server's failed attempts, before Caddy
// runs the config.
type StartCounter interface {
	CountFailedStarts(c Counter)
}

// Counter is a metric that a store adds to.
type Counter interface{ Inc() }

// ServerName is the name of the HTTP server whose routes ctx
// provisions, or Caddy's own placeholder for none: the "server" field
// of a store's log lines, as of the handler's.
func ServerName(ctx caddy.Context) string {
	if srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok && srv != nil && srv.Name() != "" {
		return srv.Name()
	}
	return "UNKNOWN"
}

// Drainer is implemented by stores that hold what their handlers'
// requests need past the unloading of the config that loaded them
// (Postgres: its connection pool, which a reload would otherwise close
// under the requests still completing their records).
type Drainer interface {
	// DrainWhile is called at provision: from then on Cleanup keeps what
	// the requests need while busy reports that one of them owns a
	// record, for at most max.
	DrainWhile(busy func() bool, max time.Duration)
}

// RecordSet is implemented by stores that can tell which records they
// hold: handlers whose stores name the same set read and write the same
// records, so a handler nested in another must not acquire the record
// the outer one owns, and the admin API groups handlers by it. The
// records of a store without it are its own.
type RecordSet interface {
	Records() string
}

// InProcess is implemented by stores that keep their records in this
// process's memory: the replay cache in front of one does not copy the
// responses that its handler completes, which the store holds already,
// and its calls, which do no I/O, are given no timeout.
type InProcess interface {
	InProcess()
}

// Inspector is implemented by stores that an operator can look into and
// release records of, through the admin API (and, for Postgres, `caddy
// idempotency`). Neither method is on the request path.
type Inspector interface {
	// InspectRecords returns up to f.Limit records that f selects,
	// ordered by credential hash and key; expired ones included.
	InspectRecords(ctx context.Context, f RecordFilter) ([]InspectedRecord, error)
	// DeleteRecord deletes the record of key and wakes the requests
	// that wait on it. Without force, only an in-progress record whose
	// lease has ended (by lockTimeout, as RecordFilter.LockTimeout, for
	// a record without a lease of its own): one that no live request
	// owns. It returns the status of the record it deleted, or
	// ErrNoRecord.
	DeleteRecord(ctx context.Context, key RecordKey, force bool, lockTimeout time.Duration) (Status, error)
}

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

// A Wrapper is a store that wraps another: the handler's metrics and
// replay cache. As and Innermost follow Unwrap down the chain, so that
// a store's capabilities stay found behind the wrappers.
type Wrapper interface {
	Unwrap() Store
}

// As returns the capability T of s: s's own, or that of the store it
// wraps (a Wrapper's Unwrap), and so on down the chain. A wrapper that
// adds to a capability (the metrics and the cache time and watch
// renewals, LockRenewer) implements it itself, and is found first.
func As[T any](s Store) (T, bool) {
	for {
		if t, ok := s.(T); ok {
			return t, true
		}
		w, ok := s.(Wrapper)
		if !ok {
			var zero T
			return zero, false
		}
		s = w.Unwrap()
	}
}

// Innermost is the store at the bottom of s's chain: the store module.
func Innermost(s Store) Store {
	for {
		w, ok := s.(Wrapper)
		if !ok {
			return s
		}
		s = w.Unwrap()
	}
}

// ErrLockLost means the record is no longer owned by the caller's token:
// its lock went stale and another request took it over, or it was
// released by an operator.
var ErrLockLost = errors.New("idempotency: lock lost to another request")

// ErrNoRecord means that no record matches (Inspector), or that the
// record to delete is gone or, without force, no longer in progress with
// an ended lease.
var ErrNoRecord = errors.New("no such record")

// ErrStoreFull is returned by a bounded store that cannot take a new
// record; the handler answers 503 so the client retries later.
var ErrStoreFull = errors.New("idempotency: store is full")

// ErrRecordUnreadable means that Acquire found a record it cannot give:
// its stored response does not decode (it was changed in the store), or
// it is sealed and does not open with the request's credential. The
// store answered: this is no outage. The handler refuses the request and
// never executes it again, since the request under that record may have
// run.
var ErrRecordUnreadable = errors.New("idempotency: the stored record cannot be read")

// ErrUnstorable means the store refused a response for good (Postgres:
// a data exception, an integrity violation, a size limit): trying again
// cannot succeed.
var ErrUnstorable = errors.New("idempotency: the store cannot keep this response")

// RecordKey identifies a record: the keyed hash of the credential
// (the handler's credential.go) and the client's Idempotency-Key. The raw credential
// never reaches a store.
type RecordKey struct {
	CredentialHash [32]byte
	Key            string
}

// LockToken identifies one owner of an in_progress record, so that a
// request whose lock was taken over cannot complete or release the
// record of the request that took it over.
type LockToken [16]byte

// KeptBody is body as a store keeps it when Complete gives it up: as it
// is, unless its buffer is much larger than the body (a response of
// undeclared length, grown by append; a HEAD answer's buffer sized for
// its Content-Length), which is cut to its size, so that a kept body
// holds at most an eighth (or 256 bytes) more than its bytes. Slack
// under that is not worth a copy: the allocator rounds sizes up as much.
func KeptBody(body []byte) []byte {
	if slack := cap(body) - len(body); slack > 256 && slack > len(body)/8 {
		return bytes.Clone(body)
	}
	return body
}

// Status is the state of a record.
type Status string

const (
	StatusInProgress Status = "in_progress"
	StatusCompleted  Status = "completed"
)

// AcquireRequest describes the request that wants to own a key.
type AcquireRequest struct {
	Key         RecordKey
	Token       LockToken
	Fingerprint [32]byte
	Method      string
	Path        string
	// LockTimeout is the lease the record gets if this request creates
	// or takes it over: no other request may take it over before the
	// lease ends, and each renewal extends it by as much again.
	LockTimeout time.Duration
	// Retention is how long the record lives: from its creation, and
	// then from its completion. It must exceed LockTimeout.
	Retention time.Duration
}

// Outcome says how Acquire ended.
type Outcome int

const (
	// OutcomeCreated: no live record existed; the caller owns a new one.
	OutcomeCreated Outcome = iota
	// OutcomeTakenOver: an in_progress record's lock had gone stale; the
	// caller took it over and owns it.
	OutcomeTakenOver
	// OutcomeExisting: a live record exists and is owned by someone
	// else, or is completed. AcquireResult.Record describes it.
	OutcomeExisting
)

// AcquireResult is the answer of Acquire.
type AcquireResult struct {
	Outcome Outcome
	// Record is the existing record when Outcome is OutcomeExisting.
	Record *Record
}

// Record is a stored idempotency record as Acquire returns it.
type Record struct {
	Status      Status
	Fingerprint [32]byte
	Method      string
	Path        string
	CreatedAt   time.Time
	ExpiresAt   time.Time
	LockedAt    time.Time
	// LockedUntil is when the lease of an in_progress record ends.
	LockedUntil time.Time
	// TTL is how long the record had left to live when the store
	// answered, as the store measured it: unlike ExpiresAt, it means
	// the same on every clock.
	TTL time.Duration
	// Response is set when Status is StatusCompleted.
	Response *Response
}

// Response is a recorded response.
type Response struct {
	Status int
	Header http.Header
	Body   []byte
	// Replayable is false when the body was larger than
	// max_response_body: the record is completed without a body and a
	// retry gets an error instead of a truncated replay.
	Replayable bool
	// BodySize is the size of the original body, even when it was too
	// large to keep.
	BodySize int64
	// Sealed marks a response that the handler sealed (its `seal`): Body
	// holds its headers and body, encrypted under a key that only a
	// request with the caller's credential derives, and Header is nil.
	// Status, Replayable and BodySize stay in the clear. A store keeps it
	// as any other (EncodeResponseHeaders keeps the mark).
	Sealed bool
}

// NewLockToken returns a random token, for a request to claim a record
// with.
func NewLockToken() LockToken {
	var t LockToken
	_, _ = rand.Read(t[:]) // crypto/rand.Read never returns an error
	return t
}
