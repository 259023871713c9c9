package idempotency

// The idempotency key header: parsing its value (step 1 of docs/how-it-works.md), and
// keeping it from Go's transport, which takes it as leave to re-send.

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
)

const (
	minKeyLen = 8
	maxKeyLen = 255
	keyRule   = "idempotency key must be 8 to 255 printable ASCII characters (0x20 to 0x7E)"
)

var (
	errKeyEdgeSpace    = errors.New("idempotency key must not begin or end with a space; to send such a key, quote it as a structured field string")
	errKeyUnterminated = errors.New("idempotency key starts with a double quote but has no closing quote")
	errKeyBadEscape    = errors.New(`idempotency key is a quoted string with an invalid escape: only \" and \\ are allowed`)
	errKeyAfterClosing = errors.New("idempotency key has characters after its closing quote; send the quoted key alone, without parameters")
)

// parseKey validates the value of the key header (step 1) and
// returns the key it names. Error messages are written for the client,
// without the header's name, which is configurable.
//
// A value that starts with a double quote is the IETF draft's form, an
// RFC 8941 sf-string, and names the key between the quotes: `"abcdefgh"`
// and `abcdefgh` are the same key. Parameters after the string are
// rejected rather than ignored, as none are defined.
//
// No whitespace is trimmed: HTTP/1 already strips it around field values
// and HTTP/2 and HTTP/3 reject values that carry it, so a space still at
// either end of a bare key did not come from a conforming client, and
// trimming it would make "k " and "k" one key on one path and two on
// another. Inside quotes every character is explicit and kept.
func parseKey(raw string) (string, error) {
	if strings.HasPrefix(raw, `"`) {
		return parseQuotedKey(raw)
	}
	if err := checkBareKey(raw); err != nil {
		return "", err
	}
	if raw[0] == ' ' || raw[len(raw)-1] == ' ' {
		return "", errKeyEdgeSpace
	}
	return raw, nil
}

// checkBareKey applies the key rule to a key as it is, unquoted.
func checkBareKey(key string) error {
	if len(key) < minKeyLen || len(key) > maxKeyLen {
		return fmt.Errorf("%s; got %d bytes", keyRule, len(key))
	}
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < 0x20 || c > 0x7e {
			return fmt.Errorf("%s; byte %d is 0x%02X", keyRule, i+1, c)
		}
	}
	return nil
}

// parseQuotedKey parses an RFC 8941 sf-string: printable ASCII between
// double quotes, where only `\"` and `\\` are escapes.
func parseQuotedKey(raw string) (string, error) {
	// Every key byte takes at most two bytes quoted: no need to scan more.
	if len(raw) > 2*maxKeyLen+2 {
		return "", fmt.Errorf("%s; got a %d-byte value", keyRule, len(raw))
	}
	var (
		b       []byte // the unescaped key, once an escape was seen
		escaped bool
	)
	for i := 1; i < len(raw); i++ {
		c := raw[i]
		switch {
		case c == '\\':
			if i+1 == len(raw) || raw[i+1] != '"' && raw[i+1] != '\\' {
				return "", errKeyBadEscape
			}
			if !escaped {
				b = append(make([]byte, 0, len(raw)), raw[1:i]...)
				escaped = true
			}
			i++
			b = append(b, raw[i])
		case c == '"':
			if i != len(raw)-1 {
				return "", errKeyAfterClosing
			}
			key := raw[1:i]
			if escaped {
				key = string(b)
			}
			if len(key) < minKeyLen || len(key) > maxKeyLen {
				return "", fmt.Errorf("%s; got %d between the quotes", keyRule, len(key))
			}
			return key, nil
		case c < 0x20 || c > 0x7e:
			return "", fmt.Errorf("%s; byte %d is 0x%02X", keyRule, i+1, c)
		case escaped:
			b = append(b, c)
		}
	}
	return "", errKeyUnterminated
}

// hideKeyFromTransport re-files the idempotency key headers under their
// lower-case spelling. Go's http.Transport takes a canonical
// Idempotency-Key or X-Idempotency-Key as leave to re-send a bodiless
// request on a dropped keep-alive connection (reverse_proxy sends a nil
// body when Content-Length is 0): that would execute once more a request
// this handler exists to execute once. Field names are case-insensitive,
// so the upstream still receives the header.
func hideKeyFromTransport(header http.Header) {
	for i, name := range transportKeyHeaders {
		if values, ok := header[name]; ok {
			delete(header, name)
			lower := hiddenKeyHeaders[i]
			if hidden := header[lower]; len(hidden) > 0 {
				values = append(hidden, values...)
			}
			header[lower] = values
		}
	}
}

// transportKeyHeaders are the key headers that Go's http.Transport reads,
// and hiddenKeyHeaders the names they are re-filed under, lower-cased
// once rather than per request.
var (
	transportKeyHeaders = [...]string{"Idempotency-Key", "X-Idempotency-Key"}
	hiddenKeyHeaders    = func() (lower [len(transportKeyHeaders)]string) {
		for i, name := range transportKeyHeaders {
			lower[i] = strings.ToLower(name)
		}
		return lower
	}()
)

// keyValues returns the values of the key header name, with those that a
// handler around this one re-filed (hideKeyFromTransport): a handler
// inside another reads the key that the outer one hid from the
// transport. Go's servers file every header under its canonical name,
// so a lower-case one is always re-filed.
func keyValues(header http.Header, name string) []string {
	values := header.Values(name)
	canonical := http.CanonicalHeaderKey(name)
	for i, hidden := range transportKeyHeaders {
		if canonical == hidden {
			return append(values[:len(values):len(values)], header[hiddenKeyHeaders[i]]...)
		}
	}
	return values
}
