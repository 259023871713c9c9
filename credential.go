package idempotency

// Steps 1 and 2 of the request path: the key, and the caller's
// credential, hashed with HMAC-SHA-256 under a secret. An unkeyed hash of
// a Basic credential (or of any short token) is a password that a
// dictionary recovers from the table or from a log line's credential_id;
// under a secret that neither holds, it is not.

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"fmt"
	"hash"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
)

// checkCredentialSecret refuses a secret that a guess could reach.
func checkCredentialSecret(secret string) error {
	if len(secret) < store.MinSecretLen {
		return fmt.Errorf("credential_secret is %d bytes, fewer than %d: a short secret can be guessed, and with it the credentials behind the stored hashes; use for example the output of `openssl rand -base64 32`",
			len(secret), store.MinSecretLen)
	}
	return nil
}

// resolveCredentialSecret resolves the placeholders of a configured
// credential_secret, as the server does at start and the CLI with
// --config, and refuses what checkCredentialSecret refuses. Its errors
// name the placeholder, never the secret.
func resolveCredentialSecret(raw string) ([]byte, error) {
	secret, err := resolveSecret(raw)
	if err != nil {
		return nil, fmt.Errorf("credential_secret %w", err)
	}
	if !hasPlaceholder(raw) || secret == raw {
		// A literal secret (braces that name no placeholder included):
		// its errors must not quote it.
		return []byte(secret), checkCredentialSecret(secret)
	}
	if err := checkCredentialSecret(secret); err != nil {
		return nil, fmt.Errorf("credential_secret %s: %w", raw, err)
	}
	return []byte(secret), nil
}

// resolveSecret resolves the placeholders of a configured secret (a
// credential_secret, a webhook's), as the server does at start: one
// that is empty once they are replaced is refused, by the placeholder's
// name, never by its value.
func resolveSecret(raw string) (string, error) {
	secret := caddy.NewReplacer().ReplaceKnown(raw, "")
	if secret == "" && hasPlaceholder(raw) {
		return "", fmt.Errorf("%s is empty once its placeholders are replaced: is its environment variable set?", raw)
	}
	return secret, nil
}

// checkCredentialPlaceholder refuses a credential that is not exactly one
// placeholder. A caller whose placeholder is empty must get 401, not the
// scope of everyone else whose placeholder is empty, which text around it
// ("tenant-{...}") would make; and two placeholders side by side let
// ("ab", "c") and ("a", "bc") share a scope.
func checkCredentialPlaceholder(s string) error {
	if len(s) < 3 || s[0] != '{' || s[len(s)-1] != '}' || strings.ContainsAny(s[1:len(s)-1], "{}\\") {
		return fmt.Errorf("credential %q must be exactly one placeholder that identifies the caller, such as {http.auth.user.id}: a constant puts every caller in one scope, text around a placeholder gives callers without it a shared scope, and two placeholders run their values together", s)
	}
	return nil
}

// checkKeyHeader refuses a key header that carries a credential: keys
// are stored and logged as they are.
func checkKeyHeader(keyHeader, credentialHeader, credential string) error {
	switch http.CanonicalHeaderKey(keyHeader) {
	case http.CanonicalHeaderKey(credentialSource(credentialHeader, credential)), "Authorization", "Proxy-Authorization", "Cookie":
		return fmt.Errorf("key_header %q carries credentials: keys are stored and logged as they are, so it must be a header of its own, such as Idempotency-Key", keyHeader)
	}
	return nil
}

// credentialSource is the request header that a handler reads its
// credential from: credentialHeader, or the header that a credential
// placeholder reads, if any ("" for one that reads no header, such as
// {http.auth.user.id}).
func credentialSource(credentialHeader, credential string) string {
	if credential == "" {
		return credentialHeader
	}
	name, ok := strings.CutPrefix(strings.TrimSuffix(strings.TrimPrefix(credential, "{"), "}"), "http.request.header.")
	if !ok {
		return ""
	}
	return name
}

// credentialSourceLabel names where a handler reads its credential from,
// for the fingerprint (requestHead.Source): "" for the Authorization
// header, the default, whose fingerprints stay as they were before the
// source took part; the header, or the placeholder that reads none,
// otherwise. A scope's hashes are apart from every credential's already.
// Records are then shared only by handlers that read the caller alike:
// the user id "alice" from {http.auth.user.id} on one site is not the
// request of a client that sends "Authorization: alice" to another.
func credentialSourceLabel(scope, credHeader, credential string) string {
	switch {
	case scope != "":
		return ""
	case credHeader == "":
		return "placeholder " + credential
	case http.CanonicalHeaderKey(credHeader) == "Authorization":
		return ""
	}
	return "header " + http.CanonicalHeaderKey(credHeader)
}

// hasPlaceholder reports whether s holds a {placeholder}, as Caddy's
// replacer sees one (a brace escaped with a backslash is not one).
func hasPlaceholder(s string) bool {
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '\\':
			i++
		case '{':
			if strings.IndexByte(s[i+1:], '}') > 0 {
				return true
			}
		}
	}
	return false
}

// credentialHasher computes HMAC-SHA-256 under one secret. Its states are
// pooled: a request then hashes its credential without allocating.
type credentialHasher struct {
	states sync.Pool
	// seal, on a handler's hasher (secretHasher), extracts the key of a
	// sealed record from the credential: HKDF-Extract is HMAC under the
	// seal salt (seal.go).
	seal *credentialHasher
}

type hmacState struct {
	mac hash.Hash
	buf []byte
	sum [sha256.Size]byte
}

func newCredentialHasher(secret []byte) *credentialHasher {
	key := bytes.Clone(secret)
	c := new(credentialHasher)
	c.states.New = func() any { return &hmacState{mac: hmac.New(sha256.New, key)} }
	return c
}

// secretHasher is a handler's hasher under the credential secret, which
// also derives the keys of sealed records.
func secretHasher(secret []byte) *credentialHasher {
	c := newCredentialHasher(secret)
	c.seal = newCredentialHasher(sealSalt(secret))
	return c
}

func (c *credentialHasher) hash(credential string) [32]byte {
	s := c.states.Get().(*hmacState)
	s.mac.Reset()
	s.buf = append(s.buf[:0], credential...)
	s.mac.Write(s.buf)
	sum := [32]byte(s.mac.Sum(s.sum[:0]))
	if cap(s.buf) <= 4<<10 {
		// A rare huge credential's buffer is not kept.
		c.states.Put(s)
	}
	return sum
}

// credentialKey is a handler's hasher, which a store's default secret may
// only give once the store is reachable.
type credentialKey struct {
	hasher atomic.Pointer[credentialHasher]
	mu     sync.Mutex // serialises loads
	load   func(context.Context) ([]byte, error)
}

// get returns the hasher, loading the secret the first time.
func (k *credentialKey) get(ctx context.Context) (*credentialHasher, error) {
	if c := k.hasher.Load(); c != nil {
		return c, nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if c := k.hasher.Load(); c != nil {
		return c, nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), store.CallTimeout)
	defer cancel()
	secret, err := k.load(ctx)
	if err != nil {
		return nil, err
	}
	c := secretHasher(secret)
	k.hasher.Store(c)
	return c, nil
}

// provisionCredentials sets up the hashing of credentials: under
// credential_secret, or else under the store's default secret, which the
// first request gets from the store. A Postgres store reads it as it
// starts: never at provision, which must not write to the database (the
// secret is created there if no instance has yet).
func (h *Handler) provisionCredentials() error {
	h.credKey = new(credentialKey)
	if h.CredentialSecret != "" {
		// Resolved here, never written back: the config keeps the
		// placeholder, and the secret stays out of it.
		secret, err := resolveCredentialSecret(h.CredentialSecret)
		if err != nil {
			return err
		}
		h.credKey.hasher.Store(secretHasher(secret))
		return nil
	}
	src, ok := store.As[store.SecretKeeper](h.store)
	if !ok {
		return fmt.Errorf("credential_secret is required with store %T, which keeps no default secret", store.Innermost(h.store))
	}
	src.UseCredentialSecret()
	// The secret is read from the store, whose failure to give it (a
	// database down at start) is an outage like any other: it is framed
	// by store_unavailable and store_recovered, which counts the
	// credential_secret lines left out meanwhile.
	h.credKey.load = func(ctx context.Context) ([]byte, error) {
		epoch := h.storeLog.begin()
		secret, err := src.CredentialSecret(ctx)
		h.storeLog.observed(ctx, opCredentialSecret, epoch, err)
		return secret, err
	}
	return nil
}

// authChallenge is the WWW-Authenticate challenge of a 401 for a request
// without a credential, which RFC 9110 requires on every 401. A credential
// in Authorization is a token (RFC 6750's Bearer, as payment APIs use):
// a request that sent none gets a bare Bearer challenge, without an error
// code, as RFC 6750 has for a request without authentication. A header of
// the API's own (X-Api-Key) has no registered scheme: ApiKey, with the
// header to send, tells a client what is missing, and one that does not
// know the scheme ignores it. A placeholder that reads no header
// ({http.auth.user.id}) gets Bearer too: the authentication in front of
// this handler answers the requests it refuses with its own challenge,
// and this one only the requests it let through without a user.
func authChallenge(credHeader string) string {
	if credHeader == "" || http.CanonicalHeaderKey(credHeader) == "Authorization" {
		return "Bearer"
	}
	return `ApiKey header="` + credHeader + `"`
}

// identify does steps 1 and 2: it reads the key and the credential, and
// hashes the credential at once, so that the raw value goes no further.
// It returns the problem to answer for a client's error, or an error if
// the credential secret cannot be had (the store is unreachable). With
// neither, an empty key means a request without one, under `optional`.
// The problems are the package's: finish words them for the handler.
//
// A key_json key is in the body: it is left "", for step 3 to read
// (bodyKey). A scope is hashed in place of a credential (scopeHash).
// With sl, the key of a sealed record is extracted from the credential
// into it as well (seal.go).
func (h *Handler) identify(r *http.Request, repl *caddy.Replacer, sl *sealer) (key string, rk store.RecordKey, p *problem, err error) {
	if h.bodyKeyed() {
		return h.identifyCaller(r, repl, "", sl)
	}
	keyValues := keyValues(r.Header, h.keyHeader(r))
	if len(keyValues) == 0 {
		if h.Optional {
			return "", rk, nil, nil
		}
		return "", rk, &probKeyMissing, nil
	}
	rawKey, ok := onlyValue(keyValues)
	if !ok {
		return "", rk, &probKeyDuplicate, nil
	}
	if key, err = parseKey(rawKey); err != nil {
		prob := probKeyMalformed.withDetail(err.Error())
		return "", rk, &prob, nil
	}
	repl.Set("http.idempotency.key", key)
	return h.identifyCaller(r, repl, key, sl)
}

// identifyCaller does step 2 for a request with the key: it reads the
// credential and hashes it, or hashes the scope.
func (h *Handler) identifyCaller(r *http.Request, repl *caddy.Replacer, key string, sl *sealer) (string, store.RecordKey, *problem, error) {
	var rk store.RecordKey
	if h.Scope != "" {
		hasher, err := h.credKey.get(r.Context())
		if err != nil {
			return key, rk, nil, err
		}
		sc := h.scopeSums(hasher)
		if sl != nil {
			sl.prk = sc.prk
		}
		return key, store.RecordKey{CredentialHash: sc.sum, Key: key}, nil, nil
	}
	// A header is read by its fields, also through a placeholder, which
	// would join fields that disagree into a scope of their own.
	var credential string
	var ok bool
	if h.credHeader == "" {
		credential = repl.ReplaceAll(h.Credential, "")
	} else if credential, ok = onlyValue(r.Header.Values(h.credHeader)); !ok {
		return key, rk, &probCredentialDuplicate, nil
	}
	if credential == "" {
		return key, rk, &probCredentialMissing, nil
	}
	hasher, err := h.credKey.get(r.Context())
	if err != nil {
		return key, rk, nil, err
	}
	if sl != nil {
		sl.prk = hasher.seal.hash(credential)
	}
	return key, store.RecordKey{CredentialHash: hasher.hash(credential), Key: key}, nil, nil
}

// onlyValue returns the value of a header's fields, if they agree: two
// different values of the key or of the credential leave it ambiguous
// which one the upstream (or an authentication handler before this one)
// goes by. Identical repeats are one value.
func onlyValue(values []string) (string, bool) {
	if len(values) == 0 {
		return "", true
	}
	for _, v := range values[1:] {
		if v != values[0] {
			return "", false
		}
	}
	return values[0], true
}
