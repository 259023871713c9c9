package idempotency

import (
	"fmt"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// The rules a configuration must keep, each defined once: Validate holds
// a JSON config to them, and the Caddyfile parser (caddyfile.go) to the
// same functions, naming the file and line of a broken one.

// Validate rejects settings that cannot work.
func (h *Handler) Validate() error {
	if err := h.validateModes(); err != nil {
		return err
	}
	if err := checkBodySize("max_request_body", h.MaxRequestBody); err != nil {
		return err
	}
	if err := checkBodySize("max_response_body", h.MaxResponseBody); err != nil {
		return err
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
	if err := checkMethods(h.Methods); err != nil {
		return err
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
	if err := checkHeaderNames("key_header", h.KeyHeader); err != nil {
		return err
	}
	if err := checkHeaderNames("credential_header", h.CredentialHeader); err != nil {
		return err
	}
	return checkHeaderNames("exclude_headers", h.ExcludeHeaders...)
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

// checkMismatchStatus: the statuses a key reused with another request
// may get.
func checkMismatchStatus(status int) error {
	if status != http.StatusConflict && status != http.StatusUnprocessableEntity {
		return fmt.Errorf("mismatch_status must be 409 or 422, not %d", status)
	}
	return nil
}

// checkOnStoreError: the answers to a store that fails.
func checkOnStoreError(v string) error {
	if v != onStoreErrorFailClosed && v != onStoreErrorFailOpen {
		return fmt.Errorf("on_store_error must be %s or %s, not %q", onStoreErrorFailClosed, onStoreErrorFailOpen, v)
	}
	return nil
}

// checkBodySize bounds a body that is held in memory whole.
func checkBodySize(name string, n int64) error {
	if n <= 0 || n > math.MaxInt32 {
		return fmt.Errorf("%s: size must be between 1 byte and 2GiB, got %d", name, n)
	}
	return nil
}

// checkMethods: methods are tokens, and none that a transport re-sends
// on its own.
func checkMethods(methods []string) error {
	for _, m := range methods {
		if !validToken(m) {
			return fmt.Errorf("methods: invalid method %q", m)
		}
		if err := checkUnsafeMethod(m); err != nil {
			return fmt.Errorf("methods: %w", err)
		}
	}
	return nil
}

// checkHeaderNames: the header names that option gives are tokens.
func checkHeaderNames(option string, names ...string) error {
	for _, name := range names {
		if !validToken(name) {
			return fmt.Errorf("%s: invalid header name %q", option, name)
		}
	}
	return nil
}

// checkHeaderArrives refuses a request header that Caddy's server drops
// from every request: since v2.11.8 a name with '_' or '.' reaches the
// handlers only if the server lists it (expected_underscore_headers,
// expected_dot_headers), against headers that CGI backends fold onto
// others. Read from it, the key or the credential would be missing from
// every request. Outside a server (a program's handler) nothing is
// checked.
func checkHeaderArrives(ctx caddy.Context, option, name string) error {
	sep := ""
	switch {
	case strings.ContainsRune(name, '_'):
		sep = "_"
	case strings.ContainsRune(name, '.'):
		sep = "."
	default:
		return nil
	}
	srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok || srv == nil {
		return nil
	}
	for _, entry := range append(slices.Clone(srv.ExpectedUnderscoreHeaders), srv.ExpectedDotHeaders...) {
		if strings.EqualFold(entry, name) ||
			strings.HasSuffix(entry, "*") && len(name) >= len(entry)-1 && strings.EqualFold(name[:len(entry)-1], entry[:len(entry)-1]) {
			return nil
		}
	}
	return fmt.Errorf("%s %q: Caddy drops every request header whose name has %q unless the server lists it (the servers option expected_underscore_headers or expected_dot_headers), so every request would lack it; list it there, or use a name with hyphens", option, name, sep)
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
