package idempotency

import (
	"encoding/json"
	"net/http"
)

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
// string scanner and unescaper of the fingerprint (fingerprint.go), which
// decode as encoding/json does. It reports false for anything else,
// including invalid UTF-8, which encoding/json replaces rather than
// rejects.
func parseHeaderJSON(b []byte) (http.Header, bool) {
	i := skipJSONSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return nil, false
	}
	h := make(http.Header, 8)
	i = skipJSONSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return h, skipJSONSpace(b, i+1) == len(b)
	}
	for {
		name, next, ok := parseJSONStringAt(b, i)
		if !ok {
			return nil, false
		}
		i = skipJSONSpace(b, next)
		if i >= len(b) || b[i] != ':' {
			return nil, false
		}
		i = skipJSONSpace(b, i+1)
		var values []string
		switch {
		case i+4 <= len(b) && string(b[i:i+4]) == "null":
			i += 4
		case i < len(b) && b[i] == '[':
			values = []string{}
			i = skipJSONSpace(b, i+1)
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
				i = skipJSONSpace(b, next)
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
				i = skipJSONSpace(b, i+1)
			}
		default:
			return nil, false
		}
		h[name] = values
		i = skipJSONSpace(b, i)
		if i >= len(b) {
			return nil, false
		}
		if b[i] == '}' {
			return h, skipJSONSpace(b, i+1) == len(b)
		}
		if b[i] != ',' {
			return nil, false
		}
		i = skipJSONSpace(b, i+1)
	}
}

// parseJSONStringAt decodes the JSON string at b[i:] and returns it with
// the offset after it.
func parseJSONStringAt(b []byte, i int) (string, int, bool) {
	if i >= len(b) || b[i] != '"' {
		return "", 0, false
	}
	end, escaped := scanJSONString(b, i)
	if end < 0 {
		return "", 0, false
	}
	if !escaped {
		return string(b[i+1 : end-1]), end, true
	}
	return string(appendUnescapedJSON(nil, b[i+1:end-1])), end, true
}
