package canonjson

// JSON tokens: whitespace skipped, strings and numbers validated and
// delimited, and the contents of strings decoded.

import (
	"bytes"
	"unicode/utf16"
	"unicode/utf8"
)

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
