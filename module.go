// Package idempotency is a Caddy HTTP handler that makes retries of
// non-idempotent requests safe: the Idempotency-Key pattern that Stripe
// made standard, done once, at the edge, in front of any upstream.
//
// A client sends a unique Idempotency-Key with each request that must not
// run twice (a payment, an order). The handler remembers (credential, key)
// and the exact response; a retry with the same key gets that response
// replayed byte for byte instead of a second execution. Records live in a
// store: Postgres for production (shared by any number of Caddy
// instances), or memory for development.
package idempotency

import (
	"cmp"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Defaults, as the contract states them.
const (
	defaultKeyHeader        = "Idempotency-Key"
	defaultCredentialHeader = "Authorization"
	defaultRetention        = 24 * time.Hour
	defaultLockTimeout      = 30 * time.Second
	defaultRetryAfter       = 2 * time.Second
	defaultMaxBody          = 1 << 20
	defaultPruneInterval    = time.Hour
	defaultExecutionTimeout = 5 * time.Minute
	pruneBatchSize          = 5000
	// storeTimeout bounds one store round trip: a store that does not
	// answer in time is treated as unreachable (503), rather than
	// holding the client until its own timeout.
	storeTimeout = 5 * time.Second
)

// alwaysExcluded are the response headers never stored nor replayed:
// cookies and credentials belong to the first response only, and
// hop-by-hop headers describe the first connection, not the response.
// The header that a handler reads its credential from is excluded too
// (Provision), and so are those a response's Connection field names
// (recorder.response).
var alwaysExcluded = []string{
	"Set-Cookie", "Set-Cookie2", "Cookie", "Authorization", "Proxy-Authorization",
	"Authentication-Info", "Proxy-Authentication-Info",
	"Connection", "Keep-Alive", "Transfer-Encoding", "Te", "Trailer",
	"Upgrade", "Proxy-Authenticate",
}

// Handler makes retries of non-idempotent requests safe. Requests whose
// method is in Methods must carry an idempotency key; the first request
// with a key executes and its response is stored, and later requests with
// the same key and credential get that response replayed.
type Handler struct {
	// The store that keeps records. Default: memory (one process, not
	// durable). Use postgres in production.
	StoreRaw json.RawMessage `json:"store,omitempty" caddy:"namespace=http.handlers.idempotency.stores inline_key=backend"`

	// The request header that carries the key. Default: Idempotency-Key.
	KeyHeader string `json:"key_header,omitempty"`

	// The request header that identifies the caller; records are scoped
	// by its value, hashed. Default: Authorization.
	CredentialHeader string `json:"credential_header,omitempty"`

	// A placeholder that identifies the caller instead of a header, such
	// as {http.auth.user.id}. Takes precedence over CredentialHeader. It
	// must be exactly one placeholder: a constant would put every caller
	// in one scope, text around a placeholder would still be a value when
	// the placeholder is empty, and two placeholders run their values
	// together ("ab"+"c" is "a"+"bc").
	Credential string `json:"credential,omitempty"`

	// The secret under which credentials are hashed (HMAC-SHA-256), at
	// least 32 bytes; placeholders such as {env.IDEMPOTENCY_SECRET} are
	// resolved at start, which keeps it out of the config. Every
	// instance sharing a store must use the same one, and changing it
	// makes every existing record unreachable. Default: the store's own
	// (Postgres: 32 random bytes kept in the table <table>_secret,
	// created by the first instance; memory: random per process).
	CredentialSecret string `json:"credential_secret,omitempty"`

	// The methods that are protected, compared case-insensitively;
	// others pass through untouched. GET, HEAD, OPTIONS and TRACE are
	// refused: Go's transport re-sends them on its own. Default: POST,
	// PATCH.
	Methods []string `json:"methods,omitempty"`

	// If true, a protected request without a key passes through
	// unprotected instead of getting 400.
	Optional bool `json:"optional,omitempty"`

	// How long a record is kept after its creation. Default: 24h.
	Retention caddy.Duration `json:"retention,omitempty"`

	// How old the lock of an in-progress record must be before another
	// request may take it over (its owner is presumed dead). The owner
	// renews its lock while it runs. At least 1s. Default: 30s.
	LockTimeout caddy.Duration `json:"lock_timeout,omitempty"`

	// The Retry-After sent with a 409 for a request still in progress,
	// and with a 503 when the store is unreachable. At least 1s.
	// Default: 2s.
	RetryAfter caddy.Duration `json:"retry_after,omitempty"`

	// The largest request body accepted, in bytes; larger gets 413.
	// Default: 1 MiB.
	MaxRequestBody int64 `json:"max_request_body,omitempty"`

	// The bytes of request bodies that may be buffered at once, by every
	// handler of the process whose budget has this size; a request whose
	// body would exceed it gets 503 with Retry-After. At least
	// max_request_body plus 128 KiB. Default: 64 MiB, or that floor if
	// it is larger.
	RequestBodyBudget int64 `json:"request_body_budget,omitempty"`

	// The largest response body stored, in bytes. A larger response
	// still reaches the first caller whole, but is not replayable.
	// Default: 1 MiB.
	MaxResponseBody int64 `json:"max_response_body,omitempty"`

	// Response headers not stored nor replayed, in addition to
	// Set-Cookie, Set-Cookie2, Cookie, Authorization,
	// Proxy-Authorization, Authentication-Info,
	// Proxy-Authentication-Info, the header the credential is read from
	// and hop-by-hop headers.
	ExcludeHeaders []string `json:"exclude_headers,omitempty"`

	// How often this instance deletes expired records. 0 disables
	// pruning by this instance; otherwise at least 1s. Default: 1h.
	PruneInterval *caddy.Duration `json:"prune_interval,omitempty"`

	// How long a protected request keeps running after its client
	// disconnected, so that the client's retry finds a stored response.
	// At least 1s. Default: 5m.
	ExecutionTimeout caddy.Duration `json:"execution_timeout,omitempty"`

	// The size in bytes of this handler's cache of completed responses,
	// which replays them without a round trip to the store (cache.go).
	// 0 disables it. Default: 4 MiB.
	ReplayCache *int64 `json:"replay_cache,omitempty"`

	// How long a request that finds the same request (same key, same
	// fingerprint) still in progress waits for it to finish, to get its
	// response replayed, before it gets 409 with Retry-After. The store
	// wakes waiters when the first request completes (Postgres:
	// LISTEN/NOTIFY), so waiting costs no polling. 0 or at least 10ms.
	// Default: 0, an immediate 409.
	Wait caddy.Duration `json:"wait,omitempty"`

	// The status answered when a key is reused with a different request:
	// 409 (Conflict, the default, as Stripe does) or 422 (Unprocessable
	// Content, the IETF draft's choice).
	MismatchStatus int `json:"mismatch_status,omitempty"`

	// If true, nothing is enforced: protected requests are fingerprinted
	// and recorded, and every would-be replay, mismatch and in-progress
	// conflict is logged (idempotency.shadow), but every request reaches
	// the next handler. For rolling the handler out in front of an
	// existing API. {http.idempotency.result} says shadow_<result>.
	// wait, mismatch_status and on_store_error do not apply.
	Shadow bool `json:"shadow,omitempty"`

	// What a protected request gets when the store cannot be reached:
	// "fail_closed" (the default) answers 503 with Retry-After and does
	// not execute the request; "fail_open" executes it without
	// protection (a retry may then execute twice) and logs
	// idempotency.fail_open. Only for routes where a duplicate is
	// harmless and availability matters more.
	OnStoreError string `json:"on_store_error,omitempty"`

	// A fixed scope instead of a credential, for senders that have none
	// (webhooks: one sender per route). Records are scoped by it as by a
	// credential, under a keyed hash; no credential is read. Excludes
	// credential and credential_header.
	Scope string `json:"scope,omitempty"`

	// An RFC 6901 JSON pointer, such as /id: the key is the JSON string,
	// or the number as written, at that place in the request body (which
	// is read for the fingerprint anyway) instead of a header. Excludes
	// key_header.
	KeyJSON string `json:"key_json,omitempty"`

	// The statuses whose responses are stored and replayed: codes (204)
	// or classes (2xx). Any other response reaches the client and the
	// record is released, so that the next request with the key
	// executes (a webhook sender's next delivery). Default: every
	// response is stored.
	StoreStatus []string `json:"store_status,omitempty"`

	// store is the chain of stores the handler calls (wrapStore), and
	// cache the replay cache in it, or nil.
	// keyPointer is KeyJSON's reference tokens; storeStatus is
	// StoreStatus's set (nil: every status).
	keyPointer  []string
	storeStatus statusSet
	// explicitKeyHeader and explicitCredHeader are the key_header and
	// credential_header as configured, before the defaults (Validate).
	explicitKeyHeader, explicitCredHeader string
	scopeCache                            *atomic.Pointer[scopeCached]

	store     store.Store
	cache     *replayCache
	inProcess bool   // the store does no I/O (storeCall)
	records   string // the name of the records the store holds (recordsOf)
	waiter    store.Waiter
	methods   map[string]struct{}
	excluded  map[string]struct{}
	logger    *zap.Logger
	retrySecs int
	metrics   handlerMetrics
	credKey   *credentialKey
	// credHeader is the header that the credential is read from
	// (credentialSource), or "" for a placeholder that reads none.
	credHeader string
	// challenge is the WWW-Authenticate of a 401 (authChallenge).
	challenge string
	// words rewords the problems that name a header, for handlers with
	// another key_header or credential_header.
	words map[string]problemWording
	// executing counts the requests that may own a record, from before
	// their acquire is sent to their completion or release: the store
	// keeps its connections for them when a reload unloads this handler
	// under them. (From the acquire on: one that is still in flight when
	// the pool closes may commit all the same.)
	executing *atomic.Int64
	// keeper renews the locks of the requests running (renew.go).
	keeper *lockKeeper
	// bodyBudget bounds the request bodies buffered at once
	// (requestbody.go).
	bodyBudget *bodyBudget
	// storeLog limits the store_error lines and notes outages
	// (storelog.go).
	storeLog *storeLog
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.idempotency",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision sets defaults, loads the store and starts pruning.
func (h *Handler) Provision(ctx caddy.Context) error {
	// Every line names the HTTP server, as the metrics do: one Caddy logs
	// for several servers, whose handlers' lines look alike otherwise.
	h.logger = ctx.Logger().With(zap.String("server", serverName(ctx)))

	h.explicitKeyHeader, h.explicitCredHeader = h.KeyHeader, h.CredentialHeader
	h.scopeCache = new(atomic.Pointer[scopeCached])
	if err := h.provisionWebhook(); err != nil {
		return fmt.Errorf("idempotency: %w", err)
	}
	if h.KeyHeader == "" {
		h.KeyHeader = defaultKeyHeader
	}
	if h.CredentialHeader == "" {
		h.CredentialHeader = defaultCredentialHeader
	}
	if len(h.Methods) == 0 {
		h.Methods = []string{http.MethodPost, http.MethodPatch}
	}
	if h.Retention == 0 {
		h.Retention = caddy.Duration(defaultRetention)
	}
	if h.LockTimeout == 0 {
		h.LockTimeout = caddy.Duration(defaultLockTimeout)
	}
	if h.RetryAfter == 0 {
		h.RetryAfter = caddy.Duration(defaultRetryAfter)
	}
	if h.MaxRequestBody == 0 {
		h.MaxRequestBody = defaultMaxBody
	}
	if h.MaxResponseBody == 0 {
		h.MaxResponseBody = defaultMaxBody
	}
	h.provisionBodyBudget()
	if h.PruneInterval == nil {
		d := caddy.Duration(defaultPruneInterval)
		h.PruneInterval = &d
	}
	if h.ExecutionTimeout == 0 {
		h.ExecutionTimeout = caddy.Duration(defaultExecutionTimeout)
	}
	h.retrySecs = int(math.Ceil(time.Duration(h.RetryAfter).Seconds()))

	h.methods = make(map[string]struct{}, len(h.Methods))
	for _, m := range h.Methods {
		h.methods[strings.ToUpper(m)] = struct{}{}
	}
	h.credHeader = credentialSource(h.CredentialHeader, h.Credential)
	h.excluded = make(map[string]struct{}, len(alwaysExcluded)+len(h.ExcludeHeaders))
	for _, name := range append(append([]string{h.CredentialHeader, h.credHeader}, alwaysExcluded...), h.ExcludeHeaders...) {
		if name == "" {
			continue
		}
		h.excluded[http.CanonicalHeaderKey(name)] = struct{}{}
	}

	if h.StoreRaw == nil {
		h.StoreRaw = caddyconfig.JSONModuleObject(MemoryStore{}, "backend", "memory", nil)
	}
	mod, err := ctx.LoadModule(h, "StoreRaw")
	if err != nil {
		return fmt.Errorf("loading idempotency store: %v", err)
	}
	if err := h.provisionMetrics(ctx); err != nil {
		return err
	}
	if h.ReplayCache == nil {
		size := int64(defaultReplayCache)
		h.ReplayCache = &size
	}
	h.storeLog = newStoreLog(h)
	sm := newStoreMetrics(h.metrics.server)
	sm.log = h.storeLog
	h.store, h.cache = wrapStore(mod.(store.Store), sm, *h.ReplayCache)
	_, h.inProcess = store.As[store.InProcess](h.store)
	h.records = recordsOf(h.store)
	if err := h.provisionCredentials(); err != nil {
		return fmt.Errorf("idempotency: %w", err)
	}
	keyWord := h.KeyHeader
	if h.KeyJSON != "" {
		keyWord = "idempotency key (" + h.KeyJSON + ")"
	}
	h.words = wordProblems(keyWord, cmp.Or(h.credHeader, h.CredentialHeader))
	h.challenge = authChallenge(h.credHeader)
	h.executing = new(atomic.Int64)
	h.keeper = newLockKeeper(h)
	if d, ok := store.As[store.Drainer](h.store); ok {
		d.DrainWhile(func() bool { return h.executing.Load() > 0 },
			time.Duration(h.ExecutionTimeout)+time.Duration(h.LockTimeout))
	}
	if err := h.provisionModes(); err != nil {
		return err
	}
	h.registerStore()

	if *h.PruneInterval > 0 {
		go h.pruneLoop(ctx, time.Duration(*h.PruneInterval))
	}
	// Which release runs, for a support case: Caddy has no place for it.
	// h.logger names the server already.
	h.logger.Info("idempotency.provisioned", zap.String("version", Version),
		zap.String("store", mod.(caddy.Module).CaddyModule().ID.Name()))
	return nil
}

// wrapStore builds the chain of stores that a handler calls, around the
// store module raw: the metrics time each call that reaches raw, and the
// replay cache, outermost, answers replays without one (its hits are no
// round trips of the store). A cacheSize of 0 leaves the cache out; the
// cache is returned too, nil then, for the admin API, whose releases
// evict what it holds. raw's capabilities stay reachable through the
// chain (store.As).
func wrapStore(raw store.Store, m *storeMetrics, cacheSize int64) (store.Store, *replayCache) {
	var s store.Store = instrumentedStore{raw, m}
	if cacheSize <= 0 {
		return s, nil
	}
	// Even in front of the memory store: a hit skips the store's lock
	// and its defensive copy of the response.
	rc := newReplayCache(s, cacheSize)
	_, inProcess := store.As[store.InProcess](raw)
	rc.learnOnComplete = !inProcess
	return rc, rc
}

// Validate rejects settings that cannot work.
func (h *Handler) Validate() error {
	if err := h.validateModes(); err != nil {
		return err
	}
	if h.MaxRequestBody < 0 || h.MaxResponseBody < 0 {
		return fmt.Errorf("max_request_body and max_response_body must be positive")
	}
	// The Caddyfile's bound, for JSON too: a body is held in memory.
	for name, n := range map[string]int64{"max_request_body": h.MaxRequestBody, "max_response_body": h.MaxResponseBody} {
		if n > math.MaxInt32 {
			return fmt.Errorf("idempotency: %s: size must be between 1 byte and 2GiB, got %d", name, n)
		}
	}
	if err := h.validateBodyBudget(); err != nil {
		return err
	}
	if h.ReplayCache != nil && *h.ReplayCache < 0 {
		return fmt.Errorf("replay_cache must not be negative")
	}
	if h.Retention < 0 || h.LockTimeout < 0 || h.RetryAfter < 0 || h.ExecutionTimeout < 0 || *h.PruneInterval < 0 {
		return fmt.Errorf("durations must not be negative")
	}
	if time.Duration(h.Retention) <= time.Duration(h.LockTimeout) {
		return fmt.Errorf("retention (%s) must be longer than lock_timeout (%s)",
			time.Duration(h.Retention), time.Duration(h.LockTimeout))
	}
	for _, m := range h.Methods {
		if !validToken(m) {
			return fmt.Errorf("invalid method %q", m)
		}
		if err := checkUnsafeMethod(m); err != nil {
			return err
		}
	}
	for _, f := range durationFloors(h) {
		if err := f.check(); err != nil {
			return err
		}
	}
	if h.Credential != "" {
		if err := checkCredentialPlaceholder(h.Credential); err != nil {
			return err
		}
	}
	if err := checkScope(h.Scope, h.Credential, h.explicitCredHeader); err != nil {
		return err
	}
	if err := checkKeyJSON(h.KeyJSON, h.explicitKeyHeader); err != nil {
		return err
	}
	if err := checkKeyHeader(h.KeyHeader, h.CredentialHeader, h.Credential); err != nil {
		return err
	}
	for _, name := range append([]string{h.KeyHeader, h.CredentialHeader}, h.ExcludeHeaders...) {
		if !validToken(name) {
			return fmt.Errorf("invalid header name %q", name)
		}
	}
	return nil
}

// minDuration is the shortest lock_timeout, retry_after,
// execution_timeout and (unless 0) prune_interval: shorter ones turn the
// lock's renewals and the pruner into loops that spin on the store.
const minDuration = time.Second

// minWait is the shortest wait, unless 0.
const minWait = 10 * time.Millisecond

// durationFloor is a setting with the least value that makes sense.
type durationFloor struct {
	name   string
	value  time.Duration
	min    time.Duration
	zeroOK bool
}

func durationFloors(h *Handler) []durationFloor {
	return []durationFloor{
		{"lock_timeout", time.Duration(h.LockTimeout), minDuration, false},
		{"retry_after", time.Duration(h.RetryAfter), minDuration, false},
		{"execution_timeout", time.Duration(h.ExecutionTimeout), minDuration, false},
		{"prune_interval", time.Duration(*h.PruneInterval), minDuration, true},
		{"wait", time.Duration(h.Wait), minWait, true},
	}
}

func (f durationFloor) check() error {
	if f.value >= f.min || f.zeroOK && f.value == 0 {
		return nil
	}
	or0 := ""
	if f.zeroOK {
		or0 = " (or 0)"
	}
	return fmt.Errorf("%s %s is too short: it must be at least %s%s", f.name, f.value, f.min, or0)
}

// checkUnsafeMethod refuses the methods that Go's HTTP transport (the
// one reverse_proxy uses) re-sends on its own: it retries a request that
// fails on a dropped keep-alive connection when the method is GET, HEAD,
// OPTIONS or TRACE, whatever its headers say, so the upstream could run
// a "protected" one twice.
func checkUnsafeMethod(m string) error {
	switch strings.ToUpper(m) {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return fmt.Errorf("method %s cannot be protected: reverse_proxy's transport re-sends %s requests on a dropped keep-alive connection, which could execute one twice; protect the methods that change state (POST, PATCH, PUT, DELETE)", m, strings.ToUpper(m))
	}
	return nil
}

// validToken reports whether s is an RFC 9110 token (a method or a
// header field name).
func validToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}

// Cleanup implements caddy.CleanerUpper: the handler's config is
// unloaded. When the process exits, it waits for the requests that own a
// record to store their responses: Caddy's grace_period ends the server's
// wait for them, and the process would then end before their completion,
// leaving records in progress that a retry takes over, once their lock
// goes stale, and executes a second time.
func (h *Handler) Cleanup() error {
	h.unregisterStore()
	if caddy.Exiting() && h.executing != nil {
		h.awaitExecutions(time.Duration(h.ExecutionTimeout) + time.Duration(h.LockTimeout))
	}
	return nil
}

// awaitExecutions waits, at most max, until no request owns a record.
// Their work was detached from their clients and runs on after the
// server closed their connections; max is what execution_timeout and a
// last completion allow them.
func (h *Handler) awaitExecutions(max time.Duration) {
	n := h.executing.Load()
	if n == 0 {
		return
	}
	h.logger.Warn("idempotency.shutdown: waiting for protected requests to store their responses",
		zap.Int64("requests", n), zap.Duration("at_most", max))
	for deadline := time.Now().Add(max); h.executing.Load() > 0 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	if n := h.executing.Load(); n > 0 {
		h.logger.Error("idempotency.shutdown: exiting with protected requests still running; their records stay in progress until their locks go stale",
			zap.Int64("requests", n))
	}
}

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

// ServeHTTP implements the request path of the contract, step by step.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	// Methods compare case-insensitively: frameworks run `post` as POST.
	// ToUpper returns an upper-case method as it is, without allocating.
	method := strings.ToUpper(r.Method)
	if _, protected := h.methods[method]; !protected {
		return next.ServeHTTP(w, r)
	}
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	// A handler around this one that protects the request has set its
	// result, and counts the request by its final result when it is done.
	_, counted := repl.Get(resultPlaceholder)
	// Both placeholders are set on every protected request, so that an
	// access log shows an empty key rather than a missing field.
	repl.Set("http.idempotency.key", "")

	// 1. Key, and 2. credential, hashed at once.
	key, rk, idProb, err := h.identify(r, repl)
	if err == nil && idProb == nil && key != "" && ownedOnTheWay(r.Context(), h.records, rk) {
		// A handler around this one owns this very record and executes
		// the request under it (nesting.go): it stores the response.
		// Acquiring it again would find it in progress and answer 409.
		return next.ServeHTTP(w, r)
	}
	if !counted {
		defer h.countResult(repl)
	}
	q := request{w: w, r: r, repl: repl, next: next, key: key, rk: rk}
	switch {
	case err != nil:
		h.storeError(&q, "credential_secret", err)
		return h.storeFailed(&q)
	case idProb != nil:
		return h.refuse(&q, key, *idProb)
	case key == "" && h.keyPointer == nil:
		return h.pass(&q, resultNoKey)
	}
	q.credID = credentialID(rk.CredentialHash)

	// 3. Body, read whole (bounded) and handed on intact, and a key_json
	// key read from it.
	body, held, prob := h.readBody(r)
	defer h.bodyBudget.release(held)
	q.body, q.bodyRead, q.bodyCut = body, true, prob
	if prob != nil {
		return h.refuse(&q, key, *prob)
	}
	if h.keyPointer != nil {
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
	q.fp = fingerprint(headOf(r), body)

	// 5. Acquire, in one round trip (and, with `wait`, wait for the
	// same request in progress to finish). The store dates a lock when
	// the acquire reaches it, so the lock is dated from the acquire's
	// sending, not from the answer, which a loaded store may give late.
	h.executing.Add(1)
	defer h.executing.Add(-1)
	q.token = newLockToken()
	q.dated = time.Now()
	acq, err := h.acquireOrWait(r.Context(), h.acquireRequest(&q), logHost(r))
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
	ctx, cancel := h.storeCall(context.WithoutCancel(ctx), storeTimeout)
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

// credentialID is how logs and the CLI name a credential: the first 6
// bytes of its keyed hash, in hex, which no dictionary can reproduce
// without the secret.
func credentialID(hash [32]byte) string {
	return hex.EncodeToString(hash[:6])
}

// storeError logs the failure of the store operation op for q, unless
// op has been logged less than a second ago (storeLog).
func (h *Handler) storeError(q *request, op string, err error) {
	ok, suppressed := h.storeLog.allow(op)
	if !ok {
		return
	}
	h.logger.Error("idempotency.store_error", storeErrorFields(op, err, suppressed, q.appendFields(make([]zap.Field, 0, 5))...)...)
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
)

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

// pruneLoop deletes expired records every interval until the config that
// started it is unloaded.
func (h *Handler) pruneLoop(ctx caddy.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			n, err := h.store.Prune(ctx, pruneBatchSize)
			switch {
			case err != nil && ctx.Err() != nil:
			case err != nil:
				if ok, suppressed := h.storeLog.allow(opPrune); ok {
					h.logger.Error("idempotency.store_error", storeErrorFields(opPrune, err, suppressed)...)
				}
			case n > 0:
				h.logger.Info("idempotency.prune", zap.Int64("rows", n))
			}
		}
	}
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
