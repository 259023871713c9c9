package canonjson

// The first passes over a body: validating it while counting its
// non-empty objects and their members, then recording where those
// objects and their member names begin.

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
