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
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/errlog"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/stores/memory"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Defaults, as docs/configuration.md gives them.
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
	// response but 401, 403 and 429, which an upstream answers when it
	// refused the request before running it (list them to store them).
	StoreStatus []string `json:"store_status,omitempty"`

	// A webhook sender whose signature every delivery must carry,
	// verified before anything is recorded (verify.go): a delivery that
	// does not verify gets 401 and reaches neither the store nor the
	// upstream. It sets the sender's scope, key, store_status 2xx and
	// retention, unless they are set.
	Webhook *WebhookConfig `json:"webhook,omitempty"`

	// Whether completed responses are sealed (seal.go): "on" encrypts
	// them under a key derived from the caller's credential, which is
	// never stored; "off" stores them as they are. A handler opens
	// sealed records either way. Default: on, except in front of a
	// store in this process's memory.
	Seal *bool `json:"seal,omitempty"`

	// keyPointer is KeyJSON's reference tokens; storeStatus is
	// StoreStatus's set (by default, every status but 401, 403 and 429).
	keyPointer  []string
	storeStatus statusSet
	// explicitKeyHeader and explicitCredHeader are the key_header and
	// credential_header as configured, before the defaults (Validate).
	explicitKeyHeader, explicitCredHeader string
	scopeCache                            *atomic.Pointer[scopeCached]

	// store is the chain of stores the handler calls (wrapStore), and
	// cache the replay cache in it, or nil.
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
	// (credentialSource), or "" for a placeholder that reads none;
	// credSource names it for the fingerprint (credentialSourceLabel).
	credHeader, credSource string
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
	// sealing: Complete seals (Seal); opening: requests derive a sealer,
	// to seal or to open what another handler sealed; sealTable names
	// the records in what is sealed (seal.go).
	sealing, opening bool
	sealTable        string
	// verifier verifies a webhook's deliveries (Webhook), or is nil.
	verifier *webhookVerifier
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
	h.logger = ctx.Logger().With(zap.String("server", store.ServerName(ctx)))

	h.explicitKeyHeader, h.explicitCredHeader = h.KeyHeader, h.CredentialHeader
	h.scopeCache = new(atomic.Pointer[scopeCached])
	if err := h.provisionSender(); err != nil {
		return fmt.Errorf("idempotency: %w", err)
	}
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
	h.credSource = credentialSourceLabel(h.Scope, h.credHeader, h.Credential)
	if h.Scope == "" {
		if err := checkHeaderArrives(ctx, "credential_header", h.credHeader); err != nil {
			return fmt.Errorf("idempotency: %w", err)
		}
	}
	if h.KeyJSON == "" {
		if err := checkHeaderArrives(ctx, "key_header", h.KeyHeader); err != nil {
			return fmt.Errorf("idempotency: %w", err)
		}
	}
	h.excluded = make(map[string]struct{}, len(alwaysExcluded)+len(h.ExcludeHeaders))
	for _, name := range append(append([]string{h.CredentialHeader, h.credHeader}, alwaysExcluded...), h.ExcludeHeaders...) {
		if name == "" {
			continue
		}
		h.excluded[http.CanonicalHeaderKey(name)] = struct{}{}
	}

	if h.StoreRaw == nil {
		h.StoreRaw = caddyconfig.JSONModuleObject(memory.Store{}, "backend", "memory", nil)
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
	h.storeLog.classifier, _ = store.As[store.Classifier](h.store)
	if sc, ok := store.As[store.StartCounter](h.store); ok {
		sc.CountFailedStarts(startupErrors(h.metrics.server))
	}
	_, h.inProcess = store.As[store.InProcess](h.store)
	h.sealing = !h.inProcess
	if h.Seal != nil {
		h.sealing = *h.Seal
	}
	h.opening = h.sealing || !h.inProcess
	h.sealTable = sealTable(h.store)
	h.records = recordsOf(h.store)
	if err := h.checkPresetScope(ctx); err != nil {
		return fmt.Errorf("idempotency: %w", err)
	}
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
				if ok, suppressed := h.storeLog.allow(store.OpPrune); ok {
					h.logger.Error("idempotency.store_error", errlog.Fields(store.OpPrune, err, suppressed)...)
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
