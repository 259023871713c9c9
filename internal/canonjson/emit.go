package canonjson

// Writing the canonical form: the body read again, value by value, with
// each object's members in sorted order and large tokens sent straight
// to the sink.

import (
	"cmp"
	"slices"
)

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
