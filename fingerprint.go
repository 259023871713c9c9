package idempotency

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"io"
	"math"
	"slices"
	"strings"
	"sync"
	"unicode/utf16"
	"unicode/utf8"
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

// parseKey validates the value of the key header (contract step 1) and
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
	if len(raw) < minKeyLen || len(raw) > maxKeyLen {
		return "", fmt.Errorf("%s; got %d bytes", keyRule, len(raw))
	}
	for i := 0; i < len(raw); i++ {
		if c := raw[i]; c < 0x20 || c > 0x7e {
			return "", fmt.Errorf("%s; byte %d is 0x%02X", keyRule, i+1, c)
		}
	}
	if raw[0] == ' ' || raw[len(raw)-1] == ' ' {
		return "", errKeyEdgeSpace
	}
	return raw, nil
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
// every fingerprint, which makes every stored record mismatch.
const fingerprintDomain = "idempotency-fingerprint-v1\x00"

// fingerprint identifies a request for contract step 4: SHA-256 over the
// method, path, query and body, where a JSON body is canonicalised so
// that key order and whitespace do not matter. Each field but the last is
// length-prefixed, so no two distinct requests frame to the same bytes.
//
// The hash input is streamed: a raw body is hashed in place, and a
// canonical one as it is written, a few KiB at a time (canonFlush), so
// that fingerprinting a large body costs no copy of it.
func fingerprint(method, path, rawQuery, contentType string, body []byte) [32]byte {
	s := canonStatePool.Get().(*canonState)
	defer s.release()
	if s.hash == nil {
		s.hash = sha256.New()
	}
	s.hash.Reset()

	buf := append(s.out[:0], fingerprintDomain...)
	for _, field := range [...]string{method, path, rawQuery} {
		buf = binary.BigEndian.AppendUint64(buf, uint64(len(field)))
		buf = append(buf, field...)
	}
	canonical := false
	if isJSONContentType(contentType) {
		s.sink = s.hash
		buf, canonical = s.canonicalJSON(buf, body)
		s.sink = nil
	}
	s.hash.Write(buf)
	if !canonical {
		s.hash.Write(body)
	}
	s.out = buf[:0]
	s.sum = s.hash.Sum(s.sum[:0])
	return [32]byte(s.sum)
}

// canonFlush is how much canonical output emit buffers before it hands
// it to the hash.
const canonFlush = 16 << 10

// canonMaxDepth bounds the nesting canonicalJSON accepts. Request bodies
// rarely nest beyond a few dozen levels, and encoding/json gives up at
// 10,000; a deeper body is hashed raw, which is still correct, only not
// insensitive to key order and whitespace.
const canonMaxDepth = 512

// canonStatePool keeps the parser's scratch slices between calls, so
// that canonicalising a typical body allocates nothing.
var canonStatePool = sync.Pool{New: func() any { return new(canonState) }}

// canonPoolMaxNodes stops one huge body from pinning its scratch memory
// in the pool.
const canonPoolMaxNodes = 1 << 14

const (
	canonObject byte = iota + 1
	canonArray
	canonKey
	canonScalar
)

// canonNode is one value, or one member name, of a parsed JSON text. Nodes
// are stored in document order, so a container's children follow it and
// a name's value follows the name.
type canonNode struct {
	kind byte
	// escaped: the name's token has escapes, so its decoded form was
	// written to canonState.names[nameStart:nameEnd].
	escaped bool
	// start and end delimit the raw token of a name or scalar.
	start, end int32
	// next is the index of the node after this one's subtree.
	next               int32
	nameStart, nameEnd int32
}

// canonFrame is a container whose canonical form is being written.
// An object walks canonState.order[start:end], its member names in sorted
// order; an array walks its child nodes from start to end.
type canonFrame struct {
	object          bool
	start, pos, end int32
}

type canonState struct {
	nodes  []canonNode
	open   []int32 // the containers still open while parsing
	names  []byte
	order  []int32
	frames []canonFrame
	out    []byte // fingerprint's hash input, before it is flushed
	hash   hash.Hash
	sum    []byte
	// sink, when set, receives emit's output whenever it outgrows
	// canonFlush (fingerprint hashes it as it goes).
	sink io.Writer
}

func (s *canonState) release() {
	if cap(s.nodes) > canonPoolMaxNodes || cap(s.out) > 64*canonPoolMaxNodes {
		return
	}
	canonStatePool.Put(s)
}

// canonicalJSON appends the canonical form of the JSON text body to dst:
// object members sorted by their decoded names (ties keep their order, so
// `{"a":1,"a":2}` and `{"a":2,"a":1}` stay different), numbers and
// strings copied byte for byte as sent (`1.0` is not `1`, `"\u00e9"` is
// not `"é"`), insignificant whitespace dropped.
//
// It returns dst unchanged and false when body is not a JSON text per
// RFC 8259 (trailing data, invalid UTF-8, a leading byte order mark), or
// nests deeper than canonMaxDepth. Invalid UTF-8 is rejected rather than
// kept because names that decode alike must sort alike, and encoding/json
// decodes every invalid byte to U+FFFD: the caller then hashes the body
// raw.
//
// Names sort by their UTF-8 bytes, that is by code point; this is not
// RFC 8785 (which sorts by UTF-16 code unit) and need not be, as the
// output is only ever hashed.
func (s *canonState) canonicalJSON(dst, body []byte) ([]byte, bool) {
	if len(body) > math.MaxInt32 || !s.parse(body) {
		return dst, false
	}
	return s.emit(dst, body), true
}

// parse validates body and builds s.nodes, without recursion: the depth
// of the input never reaches the goroutine stack.
func (s *canonState) parse(b []byte) bool {
	s.nodes, s.open, s.names = s.nodes[:0], s.open[:0], s.names[:0]
	i := skipJSONSpace(b, 0)
value:
	for {
		if i >= len(b) {
			return false
		}
		n := int32(len(s.nodes))
		switch c := b[i]; c {
		case '{', '[':
			if len(s.open) == canonMaxDepth {
				return false
			}
			kind, closer := canonArray, byte(']')
			if c == '{' {
				kind, closer = canonObject, '}'
			}
			s.nodes = append(s.nodes, canonNode{kind: kind})
			i = skipJSONSpace(b, i+1)
			if i < len(b) && b[i] == closer {
				s.nodes[n].next = n + 1
				i++
				break
			}
			s.open = append(s.open, n)
			if kind == canonObject {
				if i = s.parseName(b, i); i < 0 {
					return false
				}
			}
			continue value
		case '"':
			end, _ := scanJSONString(b, i)
			if end < 0 {
				return false
			}
			s.nodes = append(s.nodes, canonNode{kind: canonScalar, start: int32(i), end: int32(end), next: n + 1})
			i = end
		case 't', 'f', 'n':
			lit := "null"
			if c == 't' {
				lit = "true"
			} else if c == 'f' {
				lit = "false"
			}
			if len(b)-i < len(lit) || string(b[i:i+len(lit)]) != lit {
				return false
			}
			s.nodes = append(s.nodes, canonNode{kind: canonScalar, start: int32(i), end: int32(i + len(lit)), next: n + 1})
			i += len(lit)
		default:
			end := scanJSONNumber(b, i)
			if end < 0 {
				return false
			}
			s.nodes = append(s.nodes, canonNode{kind: canonScalar, start: int32(i), end: int32(end), next: n + 1})
			i = end
		}

		// A value ended: it is followed by a comma, or it closes one or
		// more containers.
		for {
			i = skipJSONSpace(b, i)
			if len(s.open) == 0 {
				return i == len(b)
			}
			if i >= len(b) {
				return false
			}
			top := s.open[len(s.open)-1]
			object := s.nodes[top].kind == canonObject
			switch {
			case b[i] == ',':
				i = skipJSONSpace(b, i+1)
				if object {
					if i = s.parseName(b, i); i < 0 {
						return false
					}
				}
				continue value
			case object && b[i] == '}', !object && b[i] == ']':
				s.nodes[top].next = int32(len(s.nodes))
				s.open = s.open[:len(s.open)-1]
				i++
			default:
				return false
			}
		}
	}
}

// parseName parses a member name and its colon at b[i:], and returns the
// offset of the member's value, or -1.
func (s *canonState) parseName(b []byte, i int) int {
	if i >= len(b) || b[i] != '"' {
		return -1
	}
	end, escaped := scanJSONString(b, i)
	if end < 0 {
		return -1
	}
	n := int32(len(s.nodes))
	node := canonNode{kind: canonKey, start: int32(i), end: int32(end), next: n + 1}
	if escaped {
		node.escaped = true
		node.nameStart = int32(len(s.names))
		s.names = appendUnescapedJSON(s.names, b[i+1:end-1])
		node.nameEnd = int32(len(s.names))
	}
	s.nodes = append(s.nodes, node)
	i = skipJSONSpace(b, end)
	if i >= len(b) || b[i] != ':' {
		return -1
	}
	return skipJSONSpace(b, i+1)
}

// name returns the decoded name of key node k.
func (s *canonState) name(b []byte, k int32) []byte {
	n := &s.nodes[k]
	if n.escaped {
		return s.names[n.nameStart:n.nameEnd]
	}
	return b[n.start+1 : n.end-1]
}

// emit appends the canonical form of the parsed text, again without
// recursion.
func (s *canonState) emit(dst, b []byte) []byte {
	s.order, s.frames = s.order[:0], s.frames[:0]
	dst = s.emitValue(dst, b, 0)
	for len(s.frames) > 0 {
		if s.sink != nil && len(dst) >= canonFlush {
			_, _ = s.sink.Write(dst)
			dst = dst[:0]
		}
		f := &s.frames[len(s.frames)-1]
		if f.pos == f.end {
			if f.object {
				dst = append(dst, '}')
				s.order = s.order[:f.start]
			} else {
				dst = append(dst, ']')
			}
			s.frames = s.frames[:len(s.frames)-1]
			continue
		}
		if f.pos != f.start {
			dst = append(dst, ',')
		}
		if f.object {
			k := s.order[f.pos]
			f.pos++
			dst = s.appendRaw(dst, b[s.nodes[k].start:s.nodes[k].end])
			dst = append(dst, ':')
			dst = s.emitValue(dst, b, k+1)
		} else {
			v := f.pos
			f.pos = s.nodes[v].next
			dst = s.emitValue(dst, b, v)
		}
	}
	return dst
}

// emitValue appends scalar node v, or opens container node v: its
// children are written by emit's loop.
func (s *canonState) emitValue(dst, b []byte, v int32) []byte {
	n := &s.nodes[v]
	switch n.kind {
	case canonArray:
		s.frames = append(s.frames, canonFrame{start: v + 1, pos: v + 1, end: n.next})
		return append(dst, '[')
	case canonObject:
		start := int32(len(s.order))
		for k := v + 1; k < n.next; k = s.nodes[k+1].next {
			s.order = append(s.order, k)
		}
		members := s.order[start:]
		if len(members) > 1 {
			// Ties are broken by position, which keeps duplicate names
			// in their order as pdqsort alone would not.
			slices.SortFunc(members, func(x, y int32) int {
				if c := bytes.Compare(s.name(b, x), s.name(b, y)); c != 0 {
					return c
				}
				return cmp.Compare(x, y)
			})
		}
		s.frames = append(s.frames, canonFrame{object: true, start: start, pos: start, end: int32(len(s.order))})
		return append(dst, '{')
	default:
		return s.appendRaw(dst, b[n.start:n.end])
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
