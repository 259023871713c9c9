package idempotency

// Inbound webhooks: a sender delivers each event at least once and
// retries until it gets a 2xx. scope stands in for the credential that a
// sender does not have, key_json reads the event id from the body (Stripe
// sends it nowhere else), and store_status keeps a failed delivery from
// being stored, so that the sender's next attempt executes.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
)

// scopeKeyLabel derives, from the credential secret, the key that scopes
// are hashed under. A scope's hash is then never a credential's, whatever
// value a caller sends: the two are HMACs under different keys.
const scopeKeyLabel = "idempotency scope key\x00"

// scopeHash is the record scope of the scope name, hashed under a key
// derived from the secret that c hashes credentials under.
func scopeHash(c *credentialHasher, name string) [32]byte {
	derived := c.hash(scopeKeyLabel)
	return newCredentialHasher(derived[:]).hash(name)
}

// scopeSums is the handler's scope hashed under hasher's secret, and the
// key of its sealed records extracted from it, computed once per secret.
func (h *Handler) scopeSums(hasher *credentialHasher) *scopeCached {
	if c := h.scopeCache.Load(); c != nil && c.hasher == hasher {
		return c
	}
	c := &scopeCached{hasher: hasher, sum: scopeHash(hasher, h.Scope), prk: hasher.seal.hash(scopeKeyLabel + h.Scope)}
	h.scopeCache.Store(c)
	return c
}

// scopeCached is a scope's hash, and the key of its sealed records, under
// one hasher's secret.
type scopeCached struct {
	hasher *credentialHasher
	sum    [32]byte
	prk    [32]byte
}

// checkScope refuses a scope given with a credential: the records would
// be scoped by one of the two, and the other silently ignored.
// credentialHeader is the credential_header as configured, "" if unset.
func checkScope(scope, credential, credentialHeader string) error {
	if scope == "" {
		return nil
	}
	switch {
	case strings.TrimSpace(scope) == "":
		return fmt.Errorf("scope must not be empty")
	case credential != "":
		return fmt.Errorf("scope %q and credential %q are both set: scope is a fixed scope instead of a credential, for senders without one (webhooks); keep one of them", scope, credential)
	case credentialHeader != "":
		return fmt.Errorf("scope %q and credential_header %q are both set: scope is a fixed scope instead of a credential, and no credential is read with it; keep one of them", scope, credentialHeader)
	}
	return nil
}

// checkKeyJSON refuses a key_json given with a key_header (as
// configured, "" if unset), and a pointer that is not RFC 6901's.
func checkKeyJSON(pointer, keyHeader string) error {
	if pointer == "" {
		return nil
	}
	if keyHeader != "" {
		return fmt.Errorf("key_json %q and key_header %q are both set: the key is read from the body or from a header, not both; keep one of them", pointer, keyHeader)
	}
	_, err := parseJSONPointer(pointer)
	return err
}

// parseJSONPointer parses an RFC 6901 JSON pointer into its reference
// tokens, unescaped. The empty pointer, the whole document, is refused:
// a key is a member of the body, not the body.
func parseJSONPointer(s string) ([]string, error) {
	if !strings.HasPrefix(s, "/") {
		return nil, fmt.Errorf("key_json %q is not a JSON pointer (RFC 6901): it must start with /, as /id does", s)
	}
	tokens := strings.Split(s[1:], "/")
	for i, t := range tokens {
		for j := 0; j < len(t); j++ {
			if t[j] == '~' && (j+1 == len(t) || t[j+1] != '0' && t[j+1] != '1') {
				return nil, fmt.Errorf("key_json %q is not a JSON pointer (RFC 6901): ~ must be followed by 0 (for ~) or 1 (for /)", s)
			}
		}
		// ~1 first: "~01" is "~1", not "/".
		tokens[i] = strings.ReplaceAll(strings.ReplaceAll(t, "~1", "/"), "~0", "~")
	}
	return tokens, nil
}

var (
	errKeyJSONMissing = errors.New("the body is not JSON, or has no member there")
	errKeyJSONType    = errors.New("the member is not a string or a number")
	errKeyJSONTwice   = errors.New("the member is in the body more than once (names that differ only in case count as the same name)")
)

// jsonPointerValue returns the string, or the number as written, at the
// pointer ptr in the JSON document body. A member named twice on the way,
// or under names that differ only in case, is an error: parsers disagree
// on which one counts (encoding/json matches names case-insensitively and
// takes the last), and the upstream's might take the other.
func jsonPointerValue(body []byte, ptr []string) (string, error) {
	if !json.Valid(body) {
		return "", errKeyJSONMissing
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	return pointerValue(dec, ptr)
}

// pointerValue reads the value that dec is at, all of it, and returns
// what ptr points at inside it. The document is valid JSON. Reading the
// value to its end, closing delimiter included, is what lets the caller
// go on to the members after it, where a second one of the same name
// may be.
func pointerValue(dec *json.Decoder, ptr []string) (string, error) {
	tok, err := dec.Token()
	if err != nil {
		return "", errKeyJSONMissing
	}
	if len(ptr) == 0 {
		switch v := tok.(type) {
		case string:
			return v, nil
		case json.Number:
			return v.String(), nil
		case json.Delim:
			if err := skipRest(dec); err != nil {
				return "", err
			}
		}
		return "", errKeyJSONType
	}
	value, result, found := "", error(errKeyJSONMissing), false
	switch tok {
	case json.Delim('{'):
		for dec.More() {
			tok, _ := dec.Token()
			name, _ := tok.(string)
			if !strings.EqualFold(name, ptr[0]) {
				if err := skipValue(dec); err != nil {
					return "", err
				}
				continue
			}
			if found {
				return "", errKeyJSONTwice
			}
			found = true
			if name != ptr[0] {
				// Named alike but not as RFC 6901 asks: not the member,
				// but a second one after it would be a duplicate too.
				if err := skipValue(dec); err != nil {
					return "", err
				}
				continue
			}
			value, result = pointerValue(dec, ptr[1:])
			if result == errKeyJSONTwice {
				return "", result
			}
		}
	case json.Delim('['):
		want, ok := arrayIndex(ptr[0])
		for i := 0; dec.More(); i++ {
			if ok && i == want {
				value, result = pointerValue(dec, ptr[1:])
				if result == errKeyJSONTwice {
					return "", result
				}
				continue
			}
			if err := skipValue(dec); err != nil {
				return "", err
			}
		}
	default:
		return "", errKeyJSONMissing
	}
	if _, err := dec.Token(); err != nil { // the closing delimiter
		return "", errKeyJSONMissing
	}
	return value, result
}

// arrayIndex is the array index that a reference token names: digits
// without a leading zero ("-", past the end, names none).
func arrayIndex(t string) (int, bool) {
	if t == "" || len(t) > 1 && t[0] == '0' {
		return 0, false
	}
	n, err := strconv.Atoi(t)
	return n, err == nil && n >= 0 && t[0] != '+'
}

// skipValue reads past the value that dec is at.
func skipValue(dec *json.Decoder) error {
	tok, err := dec.Token()
	if err != nil {
		return errKeyJSONMissing
	}
	if _, ok := tok.(json.Delim); ok {
		return skipRest(dec)
	}
	return nil
}

// skipRest reads past the end of the object or array whose opening
// delimiter dec has read.
func skipRest(dec *json.Decoder) error {
	for depth := 1; depth > 0; {
		tok, err := dec.Token()
		if err == io.EOF || err != nil {
			return errKeyJSONMissing
		}
		switch tok {
		case json.Delim('{'), json.Delim('['):
			depth++
		case json.Delim('}'), json.Delim(']'):
			depth--
		}
	}
	return nil
}

// bodyKey reads the key at key_json from the request's body (step 3
// read it): "" and no problem for a body without it under `optional`.
func (h *Handler) bodyKey(body []byte) (string, *problem) {
	if h.keyPointer == nil {
		return digestKey(body), nil
	}
	raw, err := jsonPointerValue(body, h.keyPointer)
	switch {
	case errors.Is(err, errKeyJSONMissing):
		if h.Optional {
			return "", nil
		}
		p := probKeyMissing.withDetail(fmt.Sprintf(
			"this endpoint takes its idempotency key from the JSON body's member %s, and this request's body is not JSON or has no such member; nothing was executed", h.KeyJSON))
		return "", &p
	case err != nil:
		p := probKeyMalformed.withDetail(fmt.Sprintf("the JSON body's member %s cannot be the idempotency key: %v; nothing was executed", h.KeyJSON, err))
		return "", &p
	}
	if err := checkBareKey(raw); err != nil {
		p := probKeyMalformed.withDetail(fmt.Sprintf("the JSON body's member %s: %v; nothing was executed", h.KeyJSON, err))
		return "", &p
	}
	return raw, nil
}

// keyFromBody sets q's key from the body, for key_json or a webhook's
// body digest (bodyKeyed). It leaves it "" for a body without one under
// `optional`.
func (h *Handler) keyFromBody(q *request, body []byte) *problem {
	key, prob := h.bodyKey(body)
	if prob != nil || key == "" {
		return prob
	}
	q.key, q.rk.Key = key, key
	q.repl.Set("http.idempotency.key", key)
	return nil
}

// statusSet is the set of statuses whose responses are stored
// (store_status): nil stores every response.
type statusSet map[int]struct{}

// refusedStatuses are the answers of an upstream that refused a request
// before running it (its credential unknown or not allowed, a rate
// limit): not stored unless store_status lists them, so a retry, once
// the client has fixed its credential or waited, executes, and a flood
// of made-up credentials leaves no records. As Stripe does.
var refusedStatuses = []int{http.StatusUnauthorized, http.StatusForbidden, http.StatusTooManyRequests}

// parseStoreStatus parses store_status's codes (204) and classes (2xx);
// without any, the set is nil: every status but refusedStatuses.
func parseStoreStatus(values []string) (statusSet, error) {
	if len(values) == 0 {
		return nil, nil
	}
	set := make(statusSet)
	for _, v := range values {
		if len(v) == 3 && v[0] >= '1' && v[0] <= '5' && strings.EqualFold(v[1:], "xx") {
			base := int(v[0]-'0') * 100
			for s := base; s < base+100; s++ {
				set[s] = struct{}{}
			}
			continue
		}
		n, err := strconv.Atoi(v)
		if err != nil || len(v) != 3 || n < 100 || n > 599 {
			return nil, fmt.Errorf("store_status %q is neither a status code (100 to 599, such as 204) nor a class (1xx to 5xx, such as 2xx)", v)
		}
		set[n] = struct{}{}
	}
	return set, nil
}

// stores reports whether a response with status is stored.
func (s statusSet) stores(status int) bool {
	if s == nil {
		return !slices.Contains(refusedStatuses, status)
	}
	_, ok := s[status]
	return ok
}

// provisionWebhook parses key_json and store_status.
func (h *Handler) provisionWebhook() error {
	if h.KeyJSON != "" {
		var err error
		if h.keyPointer, err = parseJSONPointer(h.KeyJSON); err != nil {
			return err
		}
	}
	var err error
	h.storeStatus, err = parseStoreStatus(h.StoreStatus)
	return err
}
