// Package canonjson writes the canonical form of a JSON text, in which
// member order and insignificant whitespace no longer count, for the
// request fingerprint to hash. It keeps numbers and strings as sent, and
// works in scratch memory of a small multiple of the body, without
// recursion, whatever the body's shape.
package canonjson

import (
	"io"
	"math"
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
