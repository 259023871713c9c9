package store

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"net/http"

	"github.com/caddy-idempotency/idempotency/internal/canonjson"
)

// headerFormatBinary starts the binary encoding of stored headers. JSON
// text, which older versions stored, never starts with it, so that their
// rows still decode.
const headerFormatBinary = 0x01

// EncodeHeaders encodes h as both stores keep it: the version byte, then
// each header as uvarint(len(name)) name uvarint(len(values)) and
// uvarint(len(value)) value for each value. Unlike JSON, it keeps any
// byte of a name or value: a NUL, which jsonb refuses, or bytes that are
// not UTF-8, which JSON would turn into U+FFFD.
func EncodeHeaders(h http.Header) []byte {
	size := 1
	for name, values := range h {
		size += 2*binary.MaxVarintLen32 + len(name)
		for _, v := range values {
			size += binary.MaxVarintLen32 + len(v)
		}
	}
	b := make([]byte, 1, size)
	b[0] = headerFormatBinary
	for name, values := range h {
		b = binary.AppendUvarint(b, uint64(len(name)))
		b = append(b, name...)
		b = binary.AppendUvarint(b, uint64(len(values)))
		for _, v := range values {
			b = binary.AppendUvarint(b, uint64(len(v)))
			b = append(b, v...)
		}
	}
	return b
}

// headerFormatSealed is what a store keeps in place of the headers of a
// sealed response, whose headers are inside its sealed body. Versions
// before sealing read it as malformed JSON and refuse the record, rather
// than replay its sealed bytes as a body: in a rolling upgrade that
// shares a table, they fail closed.
const headerFormatSealed = 0x02

// EncodeResponseHeaders encodes r's headers as a store keeps them
// (EncodeHeaders), or, for a sealed response, the mark that says so.
func EncodeResponseHeaders(r *Response) []byte {
	if r.Sealed {
		return []byte{headerFormatSealed}
	}
	return EncodeHeaders(r.Header)
}

// DecodeResponseHeaders sets r's headers, or marks it sealed, from what
// EncodeResponseHeaders encoded.
func DecodeResponseHeaders(b []byte, r *Response) error {
	if len(b) == 1 && b[0] == headerFormatSealed {
		r.Header, r.Sealed = nil, true
		return nil
	}
	var err error
	r.Header, err = DecodeHeaders(b)
	return err
}

var errHeaderEncoding = errors.New("malformed stored headers")

// DecodeHeaders decodes what EncodeHeaders encoded, or the JSON that
// older versions stored. It is on the path of every replay, from either
// store, and a store may hold many headers a record: it makes three
// allocations whatever their number (the map, the value slices, and one
// string that every name and value slices), after a first pass that
// checks the data and counts them.
func DecodeHeaders(b []byte) (http.Header, error) {
	if len(b) == 0 || b[0] != headerFormatBinary {
		return decodeHeaderJSON(b)
	}
	b = b[1:]
	// next reads the uvarint at i, which must be at most the number of
	// bytes after it; it returns it and where they start.
	next := func(i int) (int, int, bool) {
		n, w := binary.Uvarint(b[i:])
		if w <= 0 || n > uint64(len(b)-i-w) {
			return 0, 0, false
		}
		return int(n), i + w, true
	}
	names, values := 0, 0
	for i := 0; i < len(b); {
		n, j, ok := next(i)
		if !ok {
			return nil, errHeaderEncoding
		}
		// next bounds the count by the bytes left, as each value takes
		// at least one: a corrupt count cannot size a huge allocation.
		c, k, ok := next(j + n)
		if !ok {
			return nil, errHeaderEncoding
		}
		names, values, i = names+1, values+c, k
		for range c {
			if n, j, ok = next(i); !ok {
				return nil, errHeaderEncoding
			}
			i = j + n
		}
	}
	h := make(http.Header, names)
	all := make([]string, values)
	str := string(b)
	for i := 0; i < len(b); {
		n, j, _ := next(i)
		name := str[j : j+n]
		c, k, _ := next(j + n)
		i = k
		vs := all[:c:c]
		all = all[c:]
		for v := range vs {
			n, j, _ = next(i)
			vs[v] = str[j : j+n]
			i = j + n
		}
		h[name] = vs
	}
	return h, nil
}

// decodeHeaderJSON decodes stored response headers: a JSON object of
// string arrays, as json.Marshal writes an http.Header and Postgres's
// jsonb gives it back. It is on the path of every replay from Postgres,
// where encoding/json's reflection cost more than the rest of the
// decoding; it decodes exactly as json.Unmarshal into an http.Header
// does, and hands anything but that shape to json.Unmarshal.
func decodeHeaderJSON(b []byte) (http.Header, error) {
	if h, ok := parseHeaderJSON(b); ok {
		return h, nil
	}
	var h http.Header
	err := json.Unmarshal(b, &h)
	return h, err
}

// parseHeaderJSON parses {"name": ["value", ...] or null, ...}, with the
// string scanner and unescaper of the fingerprint's canonicaliser, which
// decode as encoding/json does. It reports false for anything else,
// including invalid UTF-8, which encoding/json replaces rather than
// rejects.
func parseHeaderJSON(b []byte) (http.Header, bool) {
	i := canonjson.SkipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return nil, false
	}
	h := make(http.Header, 8)
	i = canonjson.SkipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return h, canonjson.SkipSpace(b, i+1) == len(b)
	}
	for {
		name, next, ok := parseJSONStringAt(b, i)
		if !ok {
			return nil, false
		}
		i = canonjson.SkipSpace(b, next)
		if i >= len(b) || b[i] != ':' {
			return nil, false
		}
		i = canonjson.SkipSpace(b, i+1)
		var values []string
		switch {
		case i+4 <= len(b) && string(b[i:i+4]) == "null":
			i += 4
		case i < len(b) && b[i] == '[':
			values = []string{}
			i = canonjson.SkipSpace(b, i+1)
			if i < len(b) && b[i] == ']' {
				i++
				break
			}
			for {
				v, next, ok := parseJSONStringAt(b, i)
				if !ok {
					return nil, false
				}
				values = append(values, v)
				i = canonjson.SkipSpace(b, next)
				if i >= len(b) {
					return nil, false
				}
				if b[i] == ']' {
					i++
					break
				}
				if b[i] != ',' {
					return nil, false
				}
				i = canonjson.SkipSpace(b, i+1)
			}
		default:
			return nil, false
		}
		h[name] = values
		i = canonjson.SkipSpace(b, i)
		if i >= len(b) {
			return nil, false
		}
		if b[i] == '}' {
			return h, canonjson.SkipSpace(b, i+1) == len(b)
		}
		if b[i] != ',' {
			return nil, false
		}
		i = canonjson.SkipSpace(b, i+1)
	}
}

// parseJSONStringAt decodes the JSON string at b[i:] and returns it with
// the offset after it.
func parseJSONStringAt(b []byte, i int) (string, int, bool) {
	if i >= len(b) || b[i] != '"' {
		return "", 0, false
	}
	end, escaped := canonjson.ScanString(b, i)
	if end < 0 {
		return "", 0, false
	}
	if !escaped {
		return string(b[i+1 : end-1]), end, true
	}
	return string(canonjson.AppendUnescaped(nil, b[i+1:end-1])), end, true
}
