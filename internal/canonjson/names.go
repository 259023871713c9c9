package canonjson

// The order of an object's members: their names compared as decoded and
// case-folded, as binders that match names case-insensitively see them.

import (
	"cmp"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

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
