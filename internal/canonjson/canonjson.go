// Package canonjson writes the canonical form of a JSON text, in which
// member order and insignificant whitespace no longer count, for the
// request fingerprint to hash. It keeps numbers and strings as sent, and
// works in scratch memory of a small multiple of the body, without
// recursion, whatever the body's shape.
package canonjson

import (
	"bytes"
	"cmp"
	"io"
	"math"
	"slices"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// Flush is how much canonical output Append buffers in dst, when it
// writes to a sink, before it hands it to the sink.
const Flush = 16 << 10

// MaxDepth bounds the nesting Append accepts. Request bodies rarely nest
// beyond a few dozen levels, and encoding/json gives up at 10,000; a
// deeper body is hashed raw, which is still correct, only not
// insensitive to member order and whitespace.
const MaxDepth = 512

// poolMaxMembers stops one huge body from pinning its scratch memory in
// a pool (Small).
const poolMaxMembers = 1 << 14

// objectSpan is a non-empty object of the parsed text: the offset of
// its opening brace, and where its members' names begin in
// State.members (they end where the next object's begin).
type objectSpan struct {
	start, members int32
}

// openContainer is a container still open while indexing: the index of an
// object in State.objects, or -1 for an array, and where its next
// member's name goes in State.members.
type openContainer struct {
	object, next int32
}

// frame is a container whose canonical form is being written. An
// array continues at byte offset pos; an object at members[pos], up to
// members[hi], and its members' values end no earlier than byte end.
type frame struct {
	object           bool
	pos, lo, hi, end int32
}

// State is the scratch memory of canonicalisation. What it holds
// is bounded by the body's shape, not by the number of values: 8 bytes
// per non-empty object and 4 per object member, nothing for arrays and
// scalars, whose canonical form is written by reading the body again.
// An object with a member takes at least 5 bytes of body (`{"":` and
// `}`, nested) and any other member 5 (`,"":0`), so the scratch memory
// stays under 2.4 times the body, and is a fraction of it for most
// bodies.
type State struct {
	objects []objectSpan // in the order their braces appear
	// members holds the offsets of member names, object by object in
	// the order of objects.
	members []int32
	open    []openContainer
	frames  []frame
	// sink, during Append, receives emit's output whenever it outgrows
	// Flush.
	sink io.Writer
}

// Small reports whether s holds little enough scratch memory to be kept
// in a pool for the next body: one huge body must not pin its own.
func (s *State) Small() bool {
	return cap(s.members) <= poolMaxMembers && cap(s.objects) <= poolMaxMembers
}

// Append appends the canonical form of the JSON text body to dst:
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
// nests deeper than MaxDepth. Invalid UTF-8 is rejected rather than
// kept because names that decode alike must sort alike, and encoding/json
// decodes every invalid byte to U+FFFD: the caller then hashes the body
// raw.
//
// This is not RFC 8785 (which sorts by UTF-16 code unit and rewrites
// numbers and strings) and need not be, as the output is only ever
// hashed.
//
// With a sink, the output goes to sink whenever dst holds Flush bytes of
// it, and a large token straight to sink: what dst holds on return
// follows what sink was given.
func (s *State) Append(dst, body []byte, sink io.Writer) ([]byte, bool) {
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
	s.sink = sink
	dst = s.emit(dst, body)
	s.sink = nil
	return dst, true
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
func (s *State) parse(b []byte) (objects, members int, ok bool) {
	s.open = s.open[:0]
	i := SkipSpace(b, 0)
value:
	for {
		if i >= len(b) {
			return
		}
		switch c := b[i]; c {
		case '{', '[':
			if len(s.open) == MaxDepth {
				return
			}
			closer := byte(']')
			if c == '{' {
				closer = '}'
			}
			j := SkipSpace(b, i+1)
			if j < len(b) && b[j] == closer {
				i = j + 1
				break
			}
			if c == '[' {
				s.open = append(s.open, openContainer{object: -1})
				i = j
				continue value
			}
			s.open = append(s.open, openContainer{})
			objects++
			members++
			if i = parseName(b, j); i < 0 {
				return
			}
			continue value
		case '"':
			if i, _ = ScanString(b, i); i < 0 {
				return
			}
		case 't', 'f', 'n':
			lit := literal(c)
			if len(b)-i < len(lit) || string(b[i:i+len(lit)]) != lit {
				return
			}
			i += len(lit)
		default:
			if i = scanNumber(b, i); i < 0 {
				return
			}
		}

		// A value ended: it is followed by a comma, or it closes one or
		// more containers.
		for {
			i = SkipSpace(b, i)
			if len(s.open) == 0 {
				return objects, members, i == len(b)
			}
			if i >= len(b) {
				return
			}
			object := s.open[len(s.open)-1].object >= 0
			switch {
			case b[i] == ',':
				i = SkipSpace(b, i+1)
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
func (s *State) index(b []byte, members bool) {
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
			if j := SkipSpace(b, i+1); b[j] == '}' {
				i = j
				break
			}
			if !members {
				s.objects[k] = objectSpan{start: int32(i)}
			}
			s.open = append(s.open, openContainer{object: k, next: s.objects[k].members})
			k++
			name = true
		case '[':
			s.open = append(s.open, openContainer{object: -1})
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
	end, _ := ScanString(b, i)
	if end < 0 {
		return -1
	}
	i = SkipSpace(b, end)
	if i >= len(b) || b[i] != ':' {
		return -1
	}
	return SkipSpace(b, i+1)
}

// emit appends the canonical form of the parsed text, again without
// recursion.
func (s *State) emit(dst, b []byte) []byte {
	s.frames = s.frames[:0]
	dst = s.emitValue(dst, b, SkipSpace(b, 0))
	for len(s.frames) > 0 {
		if s.sink != nil && len(dst) >= Flush {
			_, _ = s.sink.Write(dst)
			dst = dst[:0]
		}
		top := len(s.frames) - 1
		f := &s.frames[top]
		if !f.object {
			i := SkipSpace(b, int(f.pos))
			switch b[i] {
			case ']':
				dst = append(dst, ']')
				s.frames = s.frames[:top]
				s.done(i + 1)
				continue
			case ',':
				dst = append(dst, ',')
				i = SkipSpace(b, i+1)
			}
			dst = s.emitValue(dst, b, i)
			continue
		}
		if f.pos == f.hi {
			dst = append(dst, '}')
			end := SkipSpace(b, int(f.end)) + 1
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
		dst = s.emitValue(dst, b, SkipSpace(b, SkipSpace(b, end)+1))
	}
	return dst
}

// emitValue appends the scalar at b[i:], or an empty container, or opens
// the container at b[i:]: its contents are written by emit's loop.
func (s *State) emitValue(dst, b []byte, i int) []byte {
	var end int
	switch c := b[i]; c {
	case '[', '{':
		closer := byte(']')
		if c == '{' {
			closer = '}'
		}
		j := SkipSpace(b, i+1)
		if b[j] == closer {
			s.done(j + 1)
			return append(dst, c, closer)
		}
		if c == '[' {
			s.frames = append(s.frames, frame{pos: int32(j)})
			return append(dst, '[')
		}
		k, _ := slices.BinarySearchFunc(s.objects, int32(i), func(o objectSpan, start int32) int {
			return cmp.Compare(o.start, start)
		})
		lo, hi := s.objects[k].members, int32(len(s.members))
		if k+1 < len(s.objects) {
			hi = s.objects[k+1].members
		}
		if hi-lo > 1 {
			slices.SortFunc(s.members[lo:hi], func(x, y int32) int { return compareNames(b, x, y) })
		}
		s.frames = append(s.frames, frame{object: true, pos: lo, lo: lo, hi: hi, end: int32(i)})
		return append(dst, '{')
	case '"':
		end = stringEnd(b, i)
	case 't', 'f', 'n':
		end = i + len(literal(c))
	default:
		end = scanNumber(b, i)
	}
	s.done(end)
	return s.appendRaw(dst, b[i:end])
}

// done tells the innermost open container that one of its values ended
// at byte end.
func (s *State) done(end int) {
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
func (s *State) appendRaw(dst, token []byte) []byte {
	if s.sink == nil || len(token) < Flush {
		return append(dst, token...)
	}
	_, _ = s.sink.Write(dst)
	_, _ = s.sink.Write(token)
	return dst[:0]
}

// SkipSpace returns the offset of the first byte at or after i that
// is not JSON whitespace.
func SkipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\n' || b[i] == '\r' || b[i] == '\t') {
		i++
	}
	return i
}

// ScanString validates the string token at b[i:] and returns the
// offset just after it, or -1, and whether it contains escapes.
func ScanString(b []byte, i int) (end int, escaped bool) {
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

// scanNumber validates the number token at b[i:] and returns the
// offset just after it, or -1.
func scanNumber(b []byte, i int) int {
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

// AppendUnescaped appends the decoded contents of a validated string
// token. It decodes exactly as encoding/json does, lone surrogates to
// U+FFFD included, so that names equal to encoding/json are equal here
// and keep their order.
func AppendUnescaped(dst, s []byte) []byte {
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
