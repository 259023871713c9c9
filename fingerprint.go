package idempotency

import (
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"hash"
	"maps"
	"mime"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"

	"github.com/caddy-idempotency/idempotency/internal/canonjson"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// isJSONContentType reports whether a Content-Type names JSON:
// application/json or any structured syntax suffix +json (RFC 6839),
// whatever its parameters.
func isJSONContentType(ct string) bool {
	mt, _, _ := strings.Cut(ct, ";")
	mt = strings.TrimSpace(mt)
	typ, sub, ok := strings.Cut(mt, "/")
	if !ok || typ == "" {
		return false
	}
	if strings.EqualFold(mt, "application/json") {
		return true
	}
	const suffix = "+json"
	return len(sub) > len(suffix) && strings.EqualFold(sub[len(sub)-len(suffix):], suffix)
}

// fingerprintDomain versions the hashed framing: changing it changes
// every fingerprint, which makes every stored record mismatch. Framing
// that only requests which had none of it carry (trailers) is added
// without a new version: it frames where no request of the old framing
// has that tag, so every earlier fingerprint stays what it was.
const fingerprintDomain = "idempotency-fingerprint-v2\x00"

// requestHead is what identifies a request besides its body, as the
// client sent it.
type requestHead struct {
	Method, Host, Path, RawQuery string
	// ContentType holds every Content-Type field of the request.
	ContentType []string
	// Trailer holds the request's trailers, complete once its body has
	// been read to its end. They reach the upstream (reverse_proxy
	// forwards them), so they are part of the request.
	Trailer http.Header
	// ContentEncoding holds every Content-Encoding field: the same bytes
	// gzipped or not are another body to the upstream.
	ContentEncoding []string
	// Override holds the values of each methodOverrideHeaders field, in
	// that order: frameworks run the method they name instead of the
	// request's.
	Override [len(methodOverrideHeaders)][]string
	// Source is where the handler reads the credential from
	// (credentialSourceLabel): a user id read from a placeholder on one
	// site and the same string sent as Authorization to another site of
	// the store hash alike, and must not be one caller's request.
	Source string
}

// methodOverrideHeaders are the headers with which common frameworks
// (Rails, Laravel, Express's method-override, Spring's filters) let a
// POST stand for another method.
var methodOverrideHeaders = [...]string{"X-Http-Method-Override", "X-Http-Method", "X-Method-Override"}

// clientRequest returns the method and URL of r as the client sent them:
// Caddy keeps the request from before any rewrite (handle_path, uri
// strip_prefix, rewrite) in the context. Its copy carries the method and
// the URL, not the Host. The copy stays in this frame: returning its
// address cost a 250-byte allocation per call.
func clientRequest(r *http.Request) (method string, u *url.URL) {
	if orig, ok := r.Context().Value(caddyhttp.OriginalRequestCtxKey).(http.Request); ok && orig.URL != nil {
		return orig.Method, orig.URL
	}
	return r.Method, r.URL
}

// clientPath is the path the client sent, escaped: ASCII, so that any
// path can be stored in a text column and logged as it was sent.
func clientPath(r *http.Request) string {
	_, u := clientRequest(r)
	return u.EscapedPath()
}

// logHost is r's Host as log lines name it: as the fingerprint takes it,
// so that a line names the site whose records it is about.
func logHost(r *http.Request) string {
	return strings.ToLower(r.Host)
}

// headOf describes r for fingerprint. Two sites behind one store must
// not answer with each other's responses, so the Host takes part; host
// names are case-insensitive, so it is lower-cased, and the port is kept.
func headOf(r *http.Request) requestHead {
	method, u := clientRequest(r)
	return requestHead{
		Method:          strings.ToUpper(method),
		Host:            strings.ToLower(r.Host),
		Path:            u.EscapedPath(),
		RawQuery:        u.RawQuery,
		ContentType:     r.Header.Values("Content-Type"),
		Trailer:         r.Trailer,
		ContentEncoding: r.Header.Values("Content-Encoding"),
		Override: [...][]string{
			r.Header.Values(methodOverrideHeaders[0]),
			r.Header.Values(methodOverrideHeaders[1]),
			r.Header.Values(methodOverrideHeaders[2]),
		},
	}
}

// The tags that frame the media type and the body in the hash input.
const (
	mediaNone   byte = 'n' // no Content-Type field
	mediaParsed byte = 'p' // one field, as mime.ParseMediaType reads it
	mediaRaw    byte = 'r' // several fields, or one that does not parse
	trailers    byte = 't' // the trailers, before the body's tag
	encoding    byte = 'e' // the Content-Encoding fields, after the trailers
	override    byte = 'o' // the method override fields, after the encoding
	source      byte = 's' // the credential's source, after the overrides
	bodyCanon   byte = 'c' // the body's canonical JSON form follows
	bodyRaw     byte = 'b' // the body's bytes follow
)

// fingerprintState is fingerprint's scratch memory.
type fingerprintState struct {
	canon canonjson.State
	out   []byte // the hash input, before it is flushed
	hash  hash.Hash
	sum   []byte
}

// fingerprintStates keeps fingerprint's scratch memory between calls,
// so that fingerprinting a typical body allocates nothing.
var fingerprintStates = sync.Pool{New: func() any { return new(fingerprintState) }}

func (s *fingerprintState) release() {
	if !s.canon.Small() || cap(s.out) > 4*canonjson.Flush {
		return
	}
	fingerprintStates.Put(s)
}

// fingerprint identifies a request for step 4 (docs/how-it-works.md): SHA-256 over the
// method, host, path, query, media type, trailers, content coding,
// method override headers and body, where a JSON
// body is canonicalised so that member order and whitespace do not
// matter.
//
// Every field but the body is length-prefixed and the media type, the
// trailers and the body carry tags, so no two distinct requests frame to
// the same bytes: a body hashed raw never frames like a canonical one, a
// media type is a field of its own (a body means what its media type and
// charset say, so the same bytes under another type are another
// request), and a request without trailers frames as it did before
// trailers took part.
//
// The hash input is streamed: a raw body is hashed in place, and a
// canonical one as it is written, a few KiB at a time (canonjson.Flush),
// so that fingerprinting a large body costs no copy of it.
func fingerprint(h requestHead, body []byte) [32]byte {
	s := fingerprintStates.Get().(*fingerprintState)
	defer s.release()
	if s.hash == nil {
		s.hash = sha256.New()
	}
	s.hash.Reset()

	buf := append(s.out[:0], fingerprintDomain...)
	for _, field := range [...]string{h.Method, h.Host, h.Path, h.RawQuery} {
		buf = appendField(buf, field)
	}
	buf = appendMediaType(buf, h.ContentType)
	buf = appendTrailers(buf, h.Trailer)
	buf = appendValues(buf, encoding, h.ContentEncoding)
	buf = appendOverride(buf, h.Override)
	if h.Source != "" {
		buf = appendField(append(buf, source), h.Source)
	}
	canonical := false
	if len(h.ContentType) == 1 && isJSONContentType(h.ContentType[0]) {
		buf, canonical = s.canon.Append(append(buf, bodyCanon), body, s.hash)
		if !canonical {
			buf = buf[:len(buf)-1]
		}
	}
	if !canonical {
		buf = append(buf, bodyRaw)
	}
	s.hash.Write(buf)
	if !canonical {
		s.hash.Write(body)
	}
	s.out = buf[:0]
	s.sum = s.hash.Sum(s.sum[:0])
	return [32]byte(s.sum)
}

// appendField appends s, prefixed with its length.
func appendField(dst []byte, s string) []byte {
	return append(binary.BigEndian.AppendUint64(dst, uint64(len(s))), s...)
}

// appendMediaType appends the framed media type of a request with the
// Content-Type fields values. One field that parses is normalised as
// its meaning allows: type, subtype and parameter names are
// case-insensitive, parameters unordered, and so is the charset's value
// (RFC 2978); other values are kept. Anything else is kept as sent.
func appendMediaType(dst []byte, values []string) []byte {
	if len(values) == 0 {
		return append(dst, mediaNone)
	}
	if len(values) == 1 && plainMediaType(values[0]) {
		// What ParseMediaType gives for it, without its allocations:
		// the common `application/json` costs a replay nothing.
		dst = appendField(append(dst, mediaParsed), values[0])
		return binary.BigEndian.AppendUint64(dst, 0)
	}
	if len(values) == 1 {
		if mt, params, err := mime.ParseMediaType(values[0]); err == nil {
			dst = appendField(append(dst, mediaParsed), mt)
			dst = binary.BigEndian.AppendUint64(dst, uint64(len(params)))
			for _, name := range slices.Sorted(maps.Keys(params)) {
				value := params[name]
				if name == "charset" {
					value = strings.ToLower(value)
				}
				dst = appendField(appendField(dst, name), value)
			}
			return dst
		}
	}
	dst = binary.BigEndian.AppendUint64(append(dst, mediaRaw), uint64(len(values)))
	for _, v := range values {
		dst = appendField(dst, v)
	}
	return dst
}

// appendTrailers appends the framed trailers, if any field has a value:
// a trailer declared and not sent is none. Names are canonicalised, as
// they are case-insensitive, and sorted, as their order does not count;
// the values of a name are kept in their order, which does.
func appendTrailers(dst []byte, trailer http.Header) []byte {
	var names []string
	for name, values := range trailer {
		if len(values) > 0 {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return dst
	}
	// By canonical name, and by name as sent among those alike: only a
	// handler's own edits could file one name under two spellings.
	slices.SortFunc(names, func(a, b string) int {
		return cmp.Or(strings.Compare(http.CanonicalHeaderKey(a), http.CanonicalHeaderKey(b)), strings.Compare(a, b))
	})
	dst = binary.BigEndian.AppendUint64(append(dst, trailers), uint64(len(names)))
	for _, name := range names {
		values := trailer[name]
		dst = binary.BigEndian.AppendUint64(appendField(dst, http.CanonicalHeaderKey(name)), uint64(len(values)))
		for _, v := range values {
			dst = appendField(dst, v)
		}
	}
	return dst
}

// appendValues appends tag and the framed values, if there are any: a
// request without them frames as it did before they took part.
func appendValues(dst []byte, tag byte, values []string) []byte {
	if len(values) == 0 {
		return dst
	}
	return appendFields(append(dst, tag), values)
}

// appendFields appends the number of values, then each, length-prefixed.
func appendFields(dst []byte, values []string) []byte {
	dst = binary.BigEndian.AppendUint64(dst, uint64(len(values)))
	for _, v := range values {
		dst = appendField(dst, v)
	}
	return dst
}

// appendOverride appends the framed method override fields, if any is
// there: each header's values in the order of methodOverrideHeaders, so
// that a value under one name never frames like the same under another.
func appendOverride(dst []byte, fields [len(methodOverrideHeaders)][]string) []byte {
	present := false
	for _, values := range fields {
		present = present || len(values) > 0
	}
	if !present {
		return dst
	}
	dst = append(dst, override)
	for _, values := range fields {
		dst = appendFields(dst, values)
	}
	return dst
}

// plainMediaType reports whether v is a media type that
// mime.ParseMediaType returns as it is, with no parameters: a lower-case
// type and subtype of token characters.
func plainMediaType(v string) bool {
	slash := strings.IndexByte(v, '/')
	if slash <= 0 || slash == len(v)-1 {
		return false
	}
	for i := 0; i < len(v); i++ {
		c := v[i]
		switch {
		case i == slash:
		case 'a' <= c && c <= 'z', '0' <= c && c <= '9', strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}
