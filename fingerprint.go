package idempotency

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"hash"
	"io"
	"maps"
	"math"
	"mime"
	"net/http"
	"slices"
	"strings"
	"sync"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"

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
}

// clientRequest returns r as the client sent it: Caddy keeps the request
// from before any rewrite (handle_path, uri strip_prefix, rewrite) in the
// context. Its copy carries the method and the URL, not the Host.
func clientRequest(r *http.Request) *http.Request {
	if orig, ok := r.Context().Value(caddyhttp.OriginalRequestCtxKey).(http.Request); ok && orig.URL != nil {
		return &orig
	}
	return r
}

// clientPath is the path the client sent, escaped: ASCII, so that any
// path can be stored in a text column and logged as it was sent.
func clientPath(r *http.Request) string {
	return clientRequest(r).URL.EscapedPath()
}

// headOf describes r for fingerprint. Two sites behind one store must
// not answer with each other's responses, so the Host takes part; host
// names are case-insensitive, so it is lower-cased, and the port is kept.
func headOf(r *http.Request) requestHead {
	orig := clientRequest(r)
	return requestHead{
		Method:      strings.ToUpper(orig.Method),
		Host:        strings.ToLower(r.Host),
		Path:        orig.URL.EscapedPath(),
		RawQuery:    orig.URL.RawQuery,
		ContentType: r.Header.Values("Content-Type"),
		Trailer:     r.Trailer,
	}
}

// The tags that frame the media type and the body in the hash input.
const (
	mediaNone   byte = 'n' // no Content-Type field
	mediaParsed byte = 'p' // one field, as mime.ParseMediaType reads it
	mediaRaw    byte = 'r' // several fields, or one that does not parse
	trailers    byte = 't' // the trailers, before the body's tag
	bodyCanon   byte = 'c' // the body's canonical JSON form follows
	bodyRaw     byte = 'b' // the body's bytes follow
)

// fingerprint identifies a request for contract step 4: SHA-256 over the
// method, host, path, query, media type, trailers and body, where a JSON
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
// canonical one as it is written, a few KiB at a time (canonFlush), so
// that fingerprinting a large body costs no copy of it.
func fingerprint(h requestHead, body []byte) [32]byte {
	s := canonStatePool.Get().(*canonState)
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
	canonical := false
	if len(h.ContentType) == 1 && isJSONContentType(h.ContentType[0]) {
		s.sink = s.hash
		buf, canonical = s.canonicalJSON(append(buf, bodyCanon), body)
		s.sink = nil
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

// canonFlush is how much canonical output emit buffers before it hands
// it to the hash.
const canonFlush = 16 << 10

// canonMaxDepth bounds the nesting canonicalJSON accepts. Request bodies
// rarely nest beyond a few dozen levels, and encoding/json gives up at
// 10,000; a deeper body is hashed raw, which is still correct, only not
// insensitive to member order and whitespace.
const canonMaxDepth = 512

// canonStatePool keeps the parser's scratch slices between calls, so
// that canonicalising a typical body allocates nothing.
var canonStatePool = sync.Pool{New: func() any { return new(canonState) }}

// canonPoolMaxMembers stops one huge body from pinning its scratch
// memory in the pool.
const canonPoolMaxMembers = 1 << 14

// canonObject is a non-empty object of the parsed text: the offset of
// its opening brace, and where its members' names begin in
// canonState.members (they end where the next object's begin).
type canonObject struct {
	start, members int32
}

// canonOpen is a container still open while indexing: the index of an
// object in canonState.objects, or -1 for an array, and where its next
// member's name goes in canonState.members.
type canonOpen struct {
	object, next int32
}

// canonFrame is a container whose canonical form is being written. An
// array continues at byte offset pos; an object at members[pos], up to
// members[hi], and its members' values end no earlier than byte end.
type canonFrame struct {
	object           bool
	pos, lo, hi, end int32
}

// canonState is the scratch memory of canonicalisation. What it holds
// is bounded by the body's shape, not by the number of values: 8 bytes
// per non-empty object and 4 per object member, nothing for arrays and
// scalars, whose canonical form is written by reading the body again.
// An object with a member takes at least 5 bytes of body (`{"":` and
// `}`, nested) and any other member 5 (`,"":0`), so the scratch memory
// stays under 2.4 times the body, and is a fraction of it for most
// bodies.
type canonState struct {
	objects []canonObject // in the order their braces appear
	// members holds the offsets of member names, object by object in
	// the order of objects.
	members []int32
	open    []canonOpen
	frames  []canonFrame
	out     []byte // fingerprint's hash input, before it is flushed
	hash    hash.Hash
	sum     []byte
	// sink, when set, receives emit's output whenever it outgrows
	// canonFlush (fingerprint hashes it as it goes).
	sink io.Writer
}

func (s *canonState) release() {
	if cap(s.members) > canonPoolMaxMembers || cap(s.objects) > canonPoolMaxMembers || cap(s.out) > 4*canonFlush {
		return
	}
	canonStatePool.Put(s)
}

// canonicalJSON appends the canonical form of the JSON text body to dst:
// object members sorted by their names, numbers and strings copied byte
// for byte as sent (`1.0` is not `1`, `"\u00e9"` is not `"é"`),
// insignificant whitespace dropped.
//
// Members are sorted by their names folded (compareNames), ties kept in
// their order: many binders (Go's encoding/json among them) match names
// ignoring case, and read the last of several members that match, so
// `{"amount":1,"AMOUNT":2}` and `{"AMOUNT":2,"amount":1}` are different
// requests, as are `{"a":1,"a":2}` and `{"a":2,"a":1}`.
//
// It returns dst unchanged and false when body is not a JSON text per
// RFC 8259 (trailing data, invalid UTF-8, a leading byte order mark), or
// nests deeper than canonMaxDepth. Invalid UTF-8 is rejected rather than
// kept because names that decode alike must sort alike, and encoding/json
// decodes every invalid byte to U+FFFD: the caller then hashes the body
// raw.
//
// This is not RFC 8785 (which sorts by UTF-16 code unit and rewrites
// numbers and strings) and need not be, as the output is only ever
// hashed.
func (s *canonState) canonicalJSON(dst, body []byte) ([]byte, bool) {
	if len(body) > math.MaxInt32 {
		return dst, false
	}
	// The first pass validates and counts, so that the others fill
	// slices of the exact size: growing them by append would allocate
	// several times their final size.
	objects, members, ok := s.parse(body)
	if !ok {
		return dst, false
	}
	if objects > 0 {
		s.objects = resize(s.objects, objects)
		s.members = resize(s.members, members)
		s.index(body, false)
		n := int32(0)
		for k := range s.objects {
			n, s.objects[k].members = n+s.objects[k].members, n
		}
		s.index(body, true)
	}
	return s.emit(dst, body), true
}

// resize returns s with length n, reusing its array if it is large
// enough.
func resize[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	return s[:n]
}

// parse validates b and counts its non-empty objects and their members,
// without recursion: the depth of the input never reaches the goroutine
// stack.
func (s *canonState) parse(b []byte) (objects, members int, ok bool) {
	s.open = s.open[:0]
	i := skipJSONSpace(b, 0)
value:
	for {
		if i >= len(b) {
			return
		}
		switch c := b[i]; c {
		case '{', '[':
			if len(s.open) == canonMaxDepth {
				return
			}
			closer := byte(']')
			if c == '{' {
				closer = '}'
			}
			j := skipJSONSpace(b, i+1)
			if j < len(b) && b[j] == closer {
				i = j + 1
				break
			}
			if c == '[' {
				s.open = append(s.open, canonOpen{object: -1})
				i = j
				continue value
			}
			s.open = append(s.open, canonOpen{})
			objects++
			members++
			if i = parseName(b, j); i < 0 {
				return
			}
			continue value
		case '"':
			if i, _ = scanJSONString(b, i); i < 0 {
				return
			}
		case 't', 'f', 'n':
			lit := literal(c)
			if len(b)-i < len(lit) || string(b[i:i+len(lit)]) != lit {
				return
			}
			i += len(lit)
		default:
			if i = scanJSONNumber(b, i); i < 0 {
				return
			}
		}

		// A value ended: it is followed by a comma, or it closes one or
		// more containers.
		for {
			i = skipJSONSpace(b, i)
			if len(s.open) == 0 {
				return objects, members, i == len(b)
			}
			if i >= len(b) {
				return
			}
			object := s.open[len(s.open)-1].object >= 0
			switch {
			case b[i] == ',':
				i = skipJSONSpace(b, i+1)
				if object {
					members++
					if i = parseName(b, i); i < 0 {
						return
					}
				}
				continue value
			case object && b[i] == '}', !object && b[i] == ']':
				s.open = s.open[:len(s.open)-1]
				i++
			default:
				return
			}
		}
	}
}

// index walks the text b, which parse validated, to record its
// non-empty objects in s.objects, with their numbers of members, or,
// with members, their members' names in s.members, where s.objects
// says.
func (s *canonState) index(b []byte, members bool) {
	s.open = s.open[:0]
	k := int32(0) // the next non-empty object
	name := false // the next string is a member name
	for i := 0; i < len(b); i++ {
		switch b[i] {
		case '"':
			if name {
				top := &s.open[len(s.open)-1]
				if members {
					s.members[top.next] = int32(i)
					top.next++
				} else {
					s.objects[top.object].members++
				}
				name = false
			}
			i = stringEnd(b, i) - 1
		case '{':
			if j := skipJSONSpace(b, i+1); b[j] == '}' {
				i = j
				break
			}
			if !members {
				s.objects[k] = canonObject{start: int32(i)}
			}
			s.open = append(s.open, canonOpen{object: k, next: s.objects[k].members})
			k++
			name = true
		case '[':
			s.open = append(s.open, canonOpen{object: -1})
		case ',':
			name = s.open[len(s.open)-1].object >= 0
		case '}', ']':
			s.open = s.open[:len(s.open)-1]
		}
	}
}

// literal is the JSON literal that begins with c: 't', 'f' or 'n'.
func literal(c byte) string {
	switch c {
	case 't':
		return "true"
	case 'f':
		return "false"
	}
	return "null"
}

// parseName validates a member name and its colon at b[i:], and returns
// the offset of the member's value, or -1.
func parseName(b []byte, i int) int {
	if i >= len(b) || b[i] != '"' {
		return -1
	}
	end, _ := scanJSONString(b, i)
	if end < 0 {
		return -1
	}
	i = skipJSONSpace(b, end)
	if i >= len(b) || b[i] != ':' {
		return -1
	}
	return skipJSONSpace(b, i+1)
}

// emit appends the canonical form of the parsed text, again without
// recursion.
func (s *canonState) emit(dst, b []byte) []byte {
	s.frames = s.frames[:0]
	dst = s.emitValue(dst, b, skipJSONSpace(b, 0))
	for len(s.frames) > 0 {
		if s.sink != nil && len(dst) >= canonFlush {
			_, _ = s.sink.Write(dst)
			dst = dst[:0]
		}
		top := len(s.frames) - 1
		f := &s.frames[top]
		if !f.object {
			i := skipJSONSpace(b, int(f.pos))
			switch b[i] {
			case ']':
				dst = append(dst, ']')
				s.frames = s.frames[:top]
				s.done(i + 1)
				continue
			case ',':
				dst = append(dst, ',')
				i = skipJSONSpace(b, i+1)
			}
			dst = s.emitValue(dst, b, i)
			continue
		}
		if f.pos == f.hi {
			dst = append(dst, '}')
			end := skipJSONSpace(b, int(f.end)) + 1
			s.frames = s.frames[:top]
			s.done(end)
			continue
		}
		if f.pos != f.lo {
			dst = append(dst, ',')
		}
		name := int(s.members[f.pos])
		f.pos++
		end := stringEnd(b, name)
		dst = s.appendRaw(dst, b[name:end])
		dst = append(dst, ':')
		dst = s.emitValue(dst, b, skipJSONSpace(b, skipJSONSpace(b, end)+1))
	}
	return dst
}

// emitValue appends the scalar at b[i:], or an empty container, or opens
// the container at b[i:]: its contents are written by emit's loop.
func (s *canonState) emitValue(dst, b []byte, i int) []byte {
	var end int
	switch c := b[i]; c {
	case '[', '{':
		closer := byte(']')
		if c == '{' {
			closer = '}'
		}
		j := skipJSONSpace(b, i+1)
		if b[j] == closer {
			s.done(j + 1)
			return append(dst, c, closer)
		}
		if c == '[' {
			s.frames = append(s.frames, canonFrame{pos: int32(j)})
			return append(dst, '[')
		}
		k, _ := slices.BinarySearchFunc(s.objects, int32(i), func(o canonObject, start int32) int {
			return cmp.Compare(o.start, start)
		})
		lo, hi := s.objects[k].members, int32(len(s.members))
		if k+1 < len(s.objects) {
			hi = s.objects[k+1].members
		}
		if hi-lo > 1 {
			slices.SortFunc(s.members[lo:hi], func(x, y int32) int { return compareNames(b, x, y) })
		}
		s.frames = append(s.frames, canonFrame{object: true, pos: lo, lo: lo, hi: hi, end: int32(i)})
		return append(dst, '{')
	case '"':
		end = stringEnd(b, i)
	case 't', 'f', 'n':
		end = i + len(literal(c))
	default:
		end = scanJSONNumber(b, i)
	}
	s.done(end)
	return s.appendRaw(dst, b[i:end])
}

// done tells the innermost open container that one of its values ended
// at byte end.
func (s *canonState) done(end int) {
	if len(s.frames) == 0 {
		return
	}
	f := &s.frames[len(s.frames)-1]
	if !f.object {
		f.pos = int32(end)
	} else {
		f.end = max(f.end, int32(end))
	}
}

// stringEnd returns the offset just after the validated string token at
// b[i:]: the first quote after b[i] that an even number of backslashes
// precede.
func stringEnd(b []byte, i int) int {
	for j := i + 1; ; {
		q := j + bytes.IndexByte(b[j:], '"')
		n := 0
		for b[q-1-n] == '\\' {
			n++
		}
		if n%2 == 0 {
			return q + 1
		}
		j = q + 1
	}
}

// compareNames orders the member names at offsets x and y of b by their
// decoded values folded (nameRunes), and names that fold alike by their
// offsets: sorting by it never swaps two members that a binder matching
// names case-insensitively could take for the same one.
//
// It reads the names as it compares them, allocating nothing, and stops
// at their first difference.
func compareNames(b []byte, x, y int32) int {
	p, q := nameRunes{b: b, i: int(x) + 1}, nameRunes{b: b, i: int(y) + 1}
	for {
		r1, ok1 := p.next()
		r2, ok2 := q.next()
		switch {
		case !ok1 && !ok2:
			return cmp.Compare(x, y)
		case !ok1:
			return -1
		case !ok2:
			return 1
		case r1 != r2:
			return cmp.Compare(r1, r2)
		}
	}
}

// nameRunes reads the decoded value of a validated string token, from
// b[i:] to its closing quote, folded: each rune as the smallest of its
// simple case folding orbit (what encoding/json matches names by: ASCII
// case, and K, k and the Kelvin sign, S, s and ſ alike), with '_' and
// '-' skipped, as encoding/json/v2 skips them when it matches names
// case-insensitively. Escapes decode as encoding/json decodes them, lone
// surrogates to U+FFFD included.
type nameRunes struct {
	b []byte
	i int
}

func (n *nameRunes) next() (rune, bool) {
	for {
		c := n.b[n.i]
		var r rune
		switch {
		case c == '"':
			return 0, false
		case c == '\\':
			r = n.escape()
		case c < utf8.RuneSelf:
			r = rune(c)
			n.i++
		default:
			var size int
			r, size = utf8.DecodeRune(n.b[n.i:])
			n.i += size
		}
		switch {
		case r == '_' || r == '-':
			continue
		case 'a' <= r && r <= 'z':
			return r - ('a' - 'A'), true
		case r < utf8.RuneSelf:
			return r, true
		}
		return foldRune(r), true
	}
}

// escape decodes the escape sequence at n.b[n.i:].
func (n *nameRunes) escape() rune {
	s := n.b[n.i:]
	n.i += 2
	switch s[1] {
	case 'b':
		return '\b'
	case 'f':
		return '\f'
	case 'n':
		return '\n'
	case 'r':
		return '\r'
	case 't':
		return '\t'
	case 'u':
		r := hex4(s[2:])
		n.i += 4
		if !utf16.IsSurrogate(r) {
			return r
		}
		if len(s) >= 12 && s[6] == '\\' && s[7] == 'u' {
			if pair := utf16.DecodeRune(r, hex4(s[8:])); pair != utf8.RuneError {
				n.i += 6
				return pair
			}
		}
		return utf8.RuneError
	}
	return rune(s[1]) // '"', '\\' and '/' stand for themselves
}

// foldRune returns the smallest rune of r's simple case folding orbit.
func foldRune(r rune) rune {
	for {
		f := unicode.SimpleFold(r)
		if f <= r {
			return f
		}
		r = f
	}
}

// appendRaw appends a token as it was sent; a large one goes straight to
// the sink, if there is one, rather than through dst.
func (s *canonState) appendRaw(dst, token []byte) []byte {
	if s.sink == nil || len(token) < canonFlush {
		return append(dst, token...)
	}
	_, _ = s.sink.Write(dst)
	_, _ = s.sink.Write(token)
	return dst[:0]
}

// skipJSONSpace returns the offset of the first byte at or after i that
// is not JSON whitespace.
func skipJSONSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\n' || b[i] == '\r' || b[i] == '\t') {
		i++
	}
	return i
}

// scanJSONString validates the string token at b[i:] and returns the
// offset just after it, or -1, and whether it contains escapes.
func scanJSONString(b []byte, i int) (end int, escaped bool) {
	for j := i + 1; j < len(b); {
		c := b[j]
		switch {
		case c == '"':
			return j + 1, escaped
		case c == '\\':
			escaped = true
			if j+1 == len(b) {
				return -1, false
			}
			switch b[j+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				j += 2
			case 'u':
				if j+6 > len(b) || hex4(b[j+2:j+6]) < 0 {
					return -1, false
				}
				j += 6
			default:
				return -1, false
			}
		case c < 0x20:
			return -1, false
		case c < utf8.RuneSelf:
			j++
		default:
			r, size := utf8.DecodeRune(b[j:])
			if r == utf8.RuneError && size == 1 {
				return -1, false
			}
			j += size
		}
	}
	return -1, false
}

// scanJSONNumber validates the number token at b[i:] and returns the
// offset just after it, or -1.
func scanJSONNumber(b []byte, i int) int {
	digits := func(j int) int {
		for j < len(b) && '0' <= b[j] && b[j] <= '9' {
			j++
		}
		return j
	}
	j := i
	if j < len(b) && b[j] == '-' {
		j++
	}
	switch {
	case j < len(b) && b[j] == '0':
		j++
	case j < len(b) && '1' <= b[j] && b[j] <= '9':
		j = digits(j + 1)
	default:
		return -1
	}
	if j < len(b) && b[j] == '.' {
		if k := digits(j + 1); k > j+1 {
			j = k
		} else {
			return -1
		}
	}
	if j < len(b) && (b[j] == 'e' || b[j] == 'E') {
		j++
		if j < len(b) && (b[j] == '+' || b[j] == '-') {
			j++
		}
		if k := digits(j); k > j {
			j = k
		} else {
			return -1
		}
	}
	return j
}

// hex4 decodes four hex digits, or returns -1.
func hex4(h []byte) rune {
	var r rune
	for _, c := range h[:4] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			return -1
		}
		r = r<<4 | rune(c)
	}
	return r
}

// appendUnescapedJSON appends the decoded contents of a validated string
// token. It decodes exactly as encoding/json does, lone surrogates to
// U+FFFD included, so that names equal to encoding/json are equal here
// and keep their order.
func appendUnescapedJSON(dst, s []byte) []byte {
	for i := 0; i < len(s); {
		c := s[i]
		if c != '\\' {
			dst = append(dst, c)
			i++
			continue
		}
		switch c = s[i+1]; c {
		case 'b':
			dst = append(dst, '\b')
		case 'f':
			dst = append(dst, '\f')
		case 'n':
			dst = append(dst, '\n')
		case 'r':
			dst = append(dst, '\r')
		case 't':
			dst = append(dst, '\t')
		case 'u':
			r := hex4(s[i+2:])
			i += 6
			if utf16.IsSurrogate(r) {
				if i+6 <= len(s) && s[i] == '\\' && s[i+1] == 'u' {
					if pair := utf16.DecodeRune(r, hex4(s[i+2:])); pair != utf8.RuneError {
						dst = utf8.AppendRune(dst, pair)
						i += 6
						continue
					}
				}
				r = utf8.RuneError
			}
			dst = utf8.AppendRune(dst, r)
			continue
		default: // '"', '\\' and '/' stand for themselves
			dst = append(dst, c)
		}
		i += 2
	}
	return dst
}
